"""The numerical facts of chunked linear attention, reproduced in fp16 storage with fp32 accumulation (what the kernels
do), and the input regimes that the correctness gate draws to provoke them."""
from __future__ import annotations

import math

import pytest
import torch

from tuner import reference, variants
from tuner.errors import UserError
from tuner.inputs import PACKED_LENGTHS, RANDOM_LENGTH_MAX, REGIMES, make_inputs, regimes_for
from tuner.problem import Problem

FP16_MAX = torch.finfo(torch.float16).max


def fp16_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp16 operands and fp32 accumulation, as an MMA does."""
    return a.half().float() @ b.half().float()


def rel_l2(ref: torch.Tensor, out: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# ---- scalar decay inside one chunk, ratio form vs factorised form ----

def intra_chunk_fp16(q, k, v, alpha: float, factorised: bool) -> torch.Tensor:
    """One chunk's ``(Q K^T * Gamma) V`` with ``Gamma[i, j] = alpha^(i - j)`` for ``i >= j``, in fp16.

    Ratio form: the scores times an fp32 weight table built from log differences (never > 1).
    Factorised form: ``(Q alpha^i)(K alpha^-j)^T``, which materialises ``alpha^-j`` in fp16.
    """
    C = q.shape[0]
    pos = torch.arange(C, dtype=torch.float32)
    if factorised:
        scores = fp16_gemm(q * alpha ** pos[:, None], (k * alpha ** -pos[:, None]).T).tril()
    else:
        log_gamma = (pos[:, None] - pos[None, :]) * math.log(alpha)
        gamma = log_gamma.masked_fill(pos[:, None] < pos[None, :], -math.inf).exp()
        scores = fp16_gemm(q, k.T) * gamma
    return fp16_gemm(scores, v)


@pytest.mark.parametrize("alpha", [0.99, 0.95, 0.9, 0.8, 0.5])
def test_factorised_decay_overflows_fp16_below_alpha_0_8_while_ratio_form_stays_accurate(alpha):
    gen = torch.Generator().manual_seed(0)
    C, D = 64, 64
    q, k, v = (torch.randn(C, D, generator=gen).half().float() for _ in range(3))
    pos = torch.arange(C, dtype=torch.float64)
    gamma = (alpha ** (pos[:, None] - pos[None, :])).tril()
    exact = ((q.double() @ k.double().T) * gamma) @ v.double()

    assert rel_l2(exact, intra_chunk_fp16(q, k, v, alpha, factorised=False)) < 2e-3
    factorised = intra_chunk_fp16(q, k, v, alpha, factorised=True)
    if alpha >= 0.9:
        assert rel_l2(exact, factorised) < 2e-3
    else:
        assert alpha ** -(C - 1) > FP16_MAX
        assert not torch.isfinite(factorised).all()


def test_cumulative_decay_underflows_in_fp16_unless_kept_in_log_space():
    """cumprod of alpha in [0.5, 0.9] over C = 128 reaches 0 in fp16; the log-space
    cumsum is exact to fp16 rounding and its differences give the ratio weights."""
    gen = torch.Generator().manual_seed(0)
    alpha = 0.5 + 0.4 * torch.rand(128, generator=gen, dtype=torch.float64)
    assert alpha.half().cumprod(0)[-1] == 0
    log_gamma = alpha.log().half().cumsum(0)
    assert torch.isfinite(log_gamma).all()
    assert abs(log_gamma[-1].item() - alpha.log().sum().item()) < 1e-2 * abs(alpha.log().sum().item())


# ---- per-channel gates, exp(+-gamma) in fp16 ----

DK = 128


def channel_gates(regime: str, seqlen: int) -> torch.Tensor:
    """[seqlen, DK] log gates of one head from the gate's input regimes."""
    inputs = make_inputs(Problem("kda", DK, DK, "fp16", batch=1, seqlen=seqlen, heads=1), regime, seed=0)
    return inputs["g"][0, :, 0].double()


def uniform_gates(low: float, seqlen: int) -> torch.Tensor:
    """[seqlen, DK] log gates with a ~ U(low, 0.999)."""
    gen = torch.Generator().manual_seed(0)
    return (low + (0.999 - low) * torch.rand(seqlen, DK, generator=gen, dtype=torch.float64)).log()


def split_factors_fp16(g: torch.Tensor, sub_chunk: int):
    """``exp(gamma)`` and ``exp(-gamma)`` in fp16 with gamma restarted every ``sub_chunk`` tokens."""
    gamma = g.reshape(-1, sub_chunk, g.shape[-1]).cumsum(dim=1)
    return gamma.exp().half(), (-gamma).exp().half()


@pytest.mark.parametrize("C", [64, 128])
@pytest.mark.parametrize("gates", ["channel_free", "U(0.5,0.999)"])
def test_unbounded_channel_gates_underflow_then_overflow_in_fp16(gates, C):
    g = channel_gates(gates, C) if gates == "channel_free" else uniform_gates(0.5, C)
    plus, minus = split_factors_fp16(g, C)
    zeroed_channels = (plus[0, -1] == 0).float().mean().item()
    assert zeroed_channels > (0.5 if C == 64 else 0.99)  # the state reads zero through most channels
    assert torch.isinf(minus).any()


@pytest.mark.parametrize("C", [64, 128])
def test_lower_bound_0_9_keeps_both_exponentials_in_fp16_range(C):
    g = channel_gates("channel_lb0.9", C)
    assert g.min() >= math.log(0.9) - 1e-6 and g.max() <= 0
    plus, minus = split_factors_fp16(g, 64)
    assert plus.min() >= 0.9 ** 64 * 0.99  # no channel underflows
    assert minus.max() <= 0.9 ** -64 * 1.01 < FP16_MAX  # 848: no overflow


@pytest.mark.parametrize("gates", ["channel_lb0.9", "U(0.5,0.999)"])
def test_sub_chunks_bound_the_exponent_span(gates):
    """Restarting gamma every 16 tokens keeps exp(-gamma) small at C = 128."""
    g = channel_gates(gates, 128) if gates == "channel_lb0.9" else uniform_gates(0.5, 128)
    whole_plus, whole_minus = split_factors_fp16(g, 128)
    plus, minus = split_factors_fp16(g, 16)
    assert torch.isfinite(minus).all() and (plus[:, -1] > 0).all()
    assert minus.float().max() < whole_minus.float().max() / 10
    if gates == "channel_lb0.9":
        assert minus.max() <= 0.9 ** -16 * 1.01  # 5.4


@pytest.mark.parametrize("regime,finite", [("channel_lb0.9", True), ("channel_free", False)])
def test_split_kda_scores_in_fp16_need_the_lower_bound(regime, finite):
    """``M = tril((K e^gamma)(K e^-gamma)^T)`` over C = 64: accurate with the bound, inf/NaN without."""
    C = 64
    inputs = make_inputs(Problem("kda", DK, DK, "fp16", batch=1, seqlen=C, heads=1), regime, seed=1)
    k, g = inputs["k"][0, :, 0].double(), inputs["g"][0, :, 0].double()
    gamma = g.cumsum(0)
    exact = torch.einsum("cd,id,cid->ci", k, k, (gamma[:, None] - gamma[None, :]).exp()).tril(-1)
    split = fp16_gemm(k * gamma.exp(), (k * (-gamma).exp()).T).tril(-1)
    if finite:
        assert rel_l2(exact, split) < 5e-3
    else:
        assert not torch.isfinite(split).all()


# ---- the input regimes ----

def small_problem(variant: str) -> Problem:
    return Problem(variant, 64, 64, "fp16", batch=2, seqlen=33, heads=3)


@pytest.mark.parametrize("variant", list(variants.VARIANTS))
def test_every_listed_regime_draws_inputs_of_the_variant_shapes(variant):
    spec = variants.get(variant)
    problem = small_problem(variant)
    assert set(regimes_for(variant)) <= set(REGIMES)
    for regime in regimes_for(variant):
        x = make_inputs(problem, regime, seed=1)
        assert x["q"].shape == x["k"].shape == (2, 33, 3, 64) and x["v"].shape == (2, 33, 3, 64)
        assert x["q"].dtype == torch.float16 and x["scale"] == 64 ** -0.5
        g_shape = spec.g_shape(2, 33, 3, 64)
        assert (x["g"] is None) == (g_shape is None)
        if g_shape is not None:
            assert x["g"].shape == g_shape and x["g"].dtype == torch.float32 and (x["g"] < 0).all()
        assert (x["beta"] is not None) == spec.delta
        if spec.delta:
            assert ((x["beta"] > 0) & (x["beta"] < 1)).all()
            assert torch.allclose(x["k"].float().norm(dim=-1), torch.ones(2, 33, 3), atol=2e-3)
        assert (x["initial_state"] is not None) == (regime == "initial_state")


@pytest.mark.parametrize("variant,grouped", [("gdn", True), ("kda", True), ("simple_gla", False)])
def test_the_packed_regime_packs_sequences_of_every_kind_with_grouped_heads_and_states(variant, grouped):
    assert regimes_for(variant, packed=True) == [*regimes_for(variant), "packed"]
    problem = Problem(variant, 64, 64, "bf16")
    for seed, index_dtype in ((0, torch.int64), (1, torch.int32)):
        x = make_inputs(problem, "packed", seed=seed, batch=3, seqlen=1000, heads=4)
        bounds = x["cu_seqlens"]
        lengths = bounds.diff().tolist()
        assert bounds.dtype == index_dtype and bounds[0] == 0 and bounds[-1] == 1000
        assert tuple(lengths[:len(PACKED_LENGTHS)]) == PACKED_LENGTHS and len(lengths) > len(PACKED_LENGTHS) + 2
        assert all(1 <= n <= RANDOM_LENGTH_MAX for n in lengths)
        H = 2 if grouped else 4
        assert x["q"].shape == x["k"].shape == (1, 1000, H, 64) and x["v"].shape == (1, 1000, 4, 64)
        assert x["beta"] is None or x["beta"].shape == (1, 1000, 4)
        assert x["initial_state"].shape == (len(lengths), 4, 64, 64)
    # The oracle takes them as they are, each sequence from its own state.
    small = make_inputs(Problem(variant, 64, 64, "bf16"), "packed", seed=2, seqlen=400, heads=2)
    o, state = reference.chunked(variant, **small, output_final_state=True)
    assert o.shape == (1, 400, 2, 64) and state.shape[0] == small["cu_seqlens"].numel() - 1


@pytest.mark.parametrize("regime,low,high", [
    ("alpha0.5", 0.5 ** 1.2, 0.5 ** 0.8), ("alpha0.9", 0.9 ** 1.2, 0.9 ** 0.8),
    ("alpha0.99", 0.99 ** 1.2, 0.99 ** 0.8), ("channel_lb0.9", 0.9, 1.0), ("default", 0.9, 0.999),
])
def test_regime_decays_lie_in_the_documented_range(regime, low, high):
    alpha = make_inputs(small_problem("gla"), regime, seed=2)["g"].double().exp()
    assert alpha.min() >= low - 1e-6 and alpha.max() <= high + 1e-6
    assert alpha.max() - alpha.min() > 0.5 * (high - low)  # drawn across the range, not a constant


def test_channel_free_gates_are_unbounded_logsigmoids():
    g = make_inputs(small_problem("gla"), "channel_free", seed=0)["g"]
    assert (g < 0).all() and g.min() < math.log(0.1)


def test_inputs_are_deterministic_per_seed_and_shape_overrides_apply():
    problem = small_problem("kda")
    a, b = make_inputs(problem, "initial_state", seed=4), make_inputs(problem, "initial_state", seed=4)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        assert torch.equal(a[name], b[name])
    assert not torch.equal(a["q"], make_inputs(problem, "initial_state", seed=5)["q"])
    x = make_inputs(problem, batch=1, seqlen=7, heads=2)
    assert x["q"].shape == (1, 7, 2, 64) and x["g"].shape == (1, 7, 2, 64) and x["beta"].shape == (1, 7, 2)


@pytest.mark.parametrize("variant,regime,message", [
    ("linear", "alpha0.9", "has none"),
    ("gdn", "channel_lb0.9", "needs per-channel gates"),
    ("decay", "channel_free", "needs per-channel gates"),
    ("gla", "alpha0.1", "unknown regime"),
])
def test_meaningless_regimes_are_refused(variant, regime, message):
    with pytest.raises(UserError, match=message):
        make_inputs(small_problem(variant), regime)


def test_bad_shape_override_is_refused():
    with pytest.raises(UserError, match="seqlen must be a positive integer"):
        make_inputs(small_problem("gdn"), seqlen=0)
