"""The fp64 oracles: the three forms agree with each other and with an independent implementation,
reduce to the simpler variants where the math says so, and the checks catch the classic bugs of
chunked kernels."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from independent_recurrence import attention_form, householder_form
from tuner import reference, variants
from tuner.errors import UserError

TOL = 1e-10
FORMS = {"recurrent": reference.recurrent, "chunked": reference.chunked, "kernel_mirror": reference.kernel_mirror}


def rel_l2(ref: torch.Tensor, out: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float = TOL):
    err = rel_l2(ref, out)
    assert err < tol, f"{name}: relative L2 {err:.3e} >= {tol:.0e}"


def random_inputs(variant, B, T, H, K, V, seed=0, initial_state=False, alpha_low=0.5) -> dict:
    """fp64 inputs in FLA's layout: decays uniform in [alpha_low, 1), beta uniform in (0, 1)."""
    spec = variants.get(variant)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    if spec.delta:
        q, k = (torch.nn.functional.normalize(t, dim=-1) for t in (q, k))
    g_shape = spec.g_shape(B, T, H, K)
    u = None if g_shape is None else torch.rand(g_shape, generator=gen, dtype=torch.float64)
    return dict(
        q=q, k=k,
        v=torch.randn(B, T, H, V, generator=gen, dtype=torch.float64),
        g=None if u is None else torch.log(alpha_low + (1 - alpha_low) * u),
        beta=torch.rand(B, T, H, generator=gen, dtype=torch.float64) if spec.delta else None,
        initial_state=torch.randn(B, H, K, V, generator=gen, dtype=torch.float64) if initial_state else None,
    )


def run(form: str, variant: str, inputs: dict, chunk_size=16, sub_chunk=None):
    """``form`` on ``inputs`` with the final state; the chunk arguments only where the form takes them,
    kernel_mirror with two DV blocks."""
    kwargs = {}
    if form != "recurrent":
        kwargs = dict(chunk_size=chunk_size, sub_chunk=sub_chunk)
    if form == "kernel_mirror":
        kwargs["block_dv"] = inputs["v"].shape[-1] // 2
    return FORMS[form](variant, **inputs, output_final_state=True, **kwargs)


SHAPES = [
    pytest.param(2, 64, 2, 16, 8, 16, False, id="B2-T64-H2-K16-V8-C16"),
    pytest.param(1, 100, 3, 16, 8, 16, True, id="B1-T100-H3-K16-V8-C16-h0"),
    pytest.param(2, 37, 1, 8, 16, 8, True, id="B2-T37-H1-K8-V16-C8-h0"),
]


@pytest.mark.parametrize("variant", [v for v in variants.VARIANTS if not variants.get(v).delta])
@pytest.mark.parametrize("segments", [2, 3, 8])
def test_the_segmented_split_agrees_with_recurrent(variant, segments):
    """T = 100 in chunks of 16: 7 chunks, so 3 segments of 3, 3 and 1 chunks (the partial chunk in the
    last) and 8 segments of one chunk each, the last empty."""
    inputs = random_inputs(variant, 2, 100, 2, 16, 8, seed=3, initial_state=True)
    o_ref, s_ref = run("recurrent", variant, inputs)
    o, s = reference.kernel_mirror(variant, **inputs, output_final_state=True, chunk_size=16, block_dv=4,
                                   segments=segments)
    assert_close(f"segments={segments} o", o_ref, o)
    assert_close(f"segments={segments} final_state", s_ref, s)


@pytest.mark.parametrize("variant", [v for v in variants.VARIANTS if variants.get(v).delta])
def test_the_delta_rule_has_no_segmented_split(variant):
    inputs = random_inputs(variant, 1, 32, 1, 16, 8, seed=0, initial_state=False)
    with pytest.raises(UserError, match="1 for the delta rule"):
        reference.kernel_mirror(variant, **inputs, chunk_size=16, block_dv=4, segments=2)


@pytest.mark.parametrize("variant", list(variants.VARIANTS))
@pytest.mark.parametrize("B,T,H,K,V,C,h0", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_forms_agree_with_recurrent(variant, B, T, H, K, V, C, h0, seed):
    inputs = random_inputs(variant, B, T, H, K, V, seed=seed, initial_state=h0)
    o_ref, s_ref = run("recurrent", variant, inputs)
    sub_chunks = [None, C // 4] if variants.get(variant).per_channel else [None]
    for form in ("chunked", "kernel_mirror"):
        for sub in sub_chunks:
            o, s = run(form, variant, inputs, chunk_size=C, sub_chunk=sub)
            assert o.dtype == s.dtype == torch.float64
            assert_close(f"{form} sub_chunk={sub} o", o_ref, o)
            assert_close(f"{form} sub_chunk={sub} final_state", s_ref, s)


def test_scale_and_no_final_state():
    inputs = random_inputs("gla", 1, 20, 2, 8, 8)
    o_half, s = reference.chunked("gla", **inputs, scale=0.5, chunk_size=8)
    o_one, _ = reference.chunked("gla", **inputs, scale=1.0, chunk_size=8)
    assert s is None
    assert_close("o is linear in scale", o_one * 0.5, o_half)


@pytest.mark.parametrize("variant", list(variants.VARIANTS))
def test_recurrent_matches_independent_implementation(variant):
    inputs = random_inputs(variant, 2, 24, 2, 8, 6, seed=3, initial_state=True)
    o_ref, s_ref = run("recurrent", variant, inputs)
    if variants.get(variant).delta:
        o, s = householder_form(**inputs)
    else:
        inputs.pop("beta")
        o, s = attention_form(**inputs)
    assert_close("o", o, o_ref)
    assert_close("final_state", s, s_ref)


# ---- degenerate cases: each variant reduces to a simpler one where the math says so ----

DEGENERATE_SHAPE = (2, 45, 2, 8, 8)


def with_gate(inputs: dict, g) -> dict:
    return {**inputs, "g": g}


@pytest.mark.parametrize("form", list(FORMS))
def test_decay_with_zero_log_decay_is_linear(form):
    base = random_inputs("linear", *DEGENERATE_SHAPE, initial_state=True)
    H = DEGENERATE_SHAPE[2]
    o_lin, s_lin = run(form, "linear", base)
    o, s = run(form, "decay", with_gate(base, torch.zeros(H, dtype=torch.float64)))
    assert_close("o", o_lin, o)
    assert_close("final_state", s_lin, s)


@pytest.mark.parametrize("form", list(FORMS))
def test_simple_gla_with_constant_gate_is_decay(form):
    base = random_inputs("decay", *DEGENERATE_SHAPE, initial_state=True)
    B, T, H, _, _ = DEGENERATE_SHAPE
    o_dec, s_dec = run(form, "decay", base)
    o, s = run(form, "simple_gla", with_gate(base, base["g"].expand(B, T, H)))
    assert_close("o", o_dec, o)
    assert_close("final_state", s_dec, s)


@pytest.mark.parametrize("form", list(FORMS))
def test_gla_with_equal_channels_is_simple_gla(form):
    base = random_inputs("simple_gla", *DEGENERATE_SHAPE, initial_state=True)
    K = DEGENERATE_SHAPE[3]
    o_sg, s_sg = run(form, "simple_gla", base)
    o, s = run(form, "gla", with_gate(base, base["g"][..., None].expand(*base["g"].shape, K)), sub_chunk=4)
    assert_close("o", o_sg, o)
    assert_close("final_state", s_sg, s)


@pytest.mark.parametrize("form", list(FORMS))
def test_kda_with_equal_channels_is_gdn(form):
    base = random_inputs("gdn", *DEGENERATE_SHAPE, initial_state=True)
    K = DEGENERATE_SHAPE[3]
    o_gdn, s_gdn = run(form, "gdn", base)
    o, s = run(form, "kda", with_gate(base, base["g"][..., None].expand(*base["g"].shape, K)), sub_chunk=4)
    assert_close("o", o_gdn, o)
    assert_close("final_state", s_gdn, s)


@pytest.mark.parametrize("form", list(FORMS))
def test_gdn_without_decay_is_deltanet(form):
    base = random_inputs("gdn", *DEGENERATE_SHAPE, initial_state=True)
    o_ref, s_ref = householder_form(**with_gate(base, None))
    o, s = run(form, "gdn", with_gate(base, torch.zeros_like(base["g"])))
    assert_close("o", o_ref, o)
    assert_close("final_state", s_ref, s)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize("form", list(FORMS))
def test_delta_rule_without_writes_only_decays_the_initial_state(variant, form):
    inputs = random_inputs(variant, *DEGENERATE_SHAPE, initial_state=True)
    inputs["beta"] = torch.zeros_like(inputs["beta"])
    K = DEGENERATE_SHAPE[3]
    G = inputs["g"].cumsum(dim=1)  # [B, T, H] or [B, T, H, K], log decay since the start
    G = G if G.dim() == 4 else G[..., None].expand(*G.shape, K)
    S0 = inputs["initial_state"]
    expected_o = torch.einsum("bthk,bhkv->bthv", inputs["q"] * K ** -0.5 * G.exp(), S0)
    expected_s = G[:, -1].exp()[..., None] * S0
    o, s = run(form, variant, inputs)
    assert_close("o", expected_o, o)
    assert_close("final_state", expected_s, s)


# ---- the checks have teeth: classic bugs pass a degenerate setting but not a random one ----

def _mutated(monkeypatch, name: str, wrapper):
    original = getattr(reference, name)
    monkeypatch.setattr(reference, name, wrapper(original))


def _write_exponent_off_by_one(original):
    """k_write = k exp(gamma_C - gamma_r + g_1): one decay step too many."""
    def mutated(q, k, gam, per_channel):
        q_read, k_write, k_start, state_decay = original(q, k, gam, per_channel)
        first = gam[..., :1, :] if per_channel else gam[..., :1, None]
        return q_read, k_write * first.exp(), k_start, state_decay
    return mutated


def _beta_before_solve(_original):
    """beta folded into the right-hand side instead of applied after the solve."""
    def mutated(A_kk, k_start, v, beta):
        L = beta[..., None, :] * A_kk
        rhs = beta[..., None] * torch.cat([k_start, v], dim=-1)
        X = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
        return X[..., : k_start.shape[-1]], X[..., k_start.shape[-1]:]
    return mutated


def _channel_zero_gate_everywhere(original):
    """Uses channel 0's decay for every channel (position and channel axes mixed up)."""
    def mutated(q, k, gam, per_channel, sub_chunk):
        return original(q, k, gam[..., :1].expand_as(gam) if per_channel else gam, per_channel, sub_chunk)
    return mutated


MUTATIONS = [
    pytest.param("simple_gla", "_boundary_weights", _write_exponent_off_by_one, "g", id="exponent-off-by-one"),
    pytest.param("gdn", "_ut_transform", _beta_before_solve, "beta", id="beta-before-solve"),
    pytest.param("kda", "_intra_chunk_scores", _channel_zero_gate_everywhere, "channels", id="channel-axis-mixed"),
]


def _degenerate(variant: str, inputs: dict, which: str) -> dict:
    """The setting that hides the mutation: alpha = 1, equal betas, or equal channels."""
    if which == "g":
        return with_gate(inputs, torch.zeros_like(inputs["g"]))
    if which == "beta":
        return {**inputs, "beta": torch.full_like(inputs["beta"], 0.5)}
    return with_gate(inputs, inputs["g"][..., :1].expand_as(inputs["g"]))


@pytest.mark.parametrize("variant,name,mutation,which", MUTATIONS)
def test_mutation_hides_in_degenerate_setting_and_is_caught_in_random_one(monkeypatch, variant, name, mutation, which):
    inputs = random_inputs(variant, *DEGENERATE_SHAPE, seed=5, initial_state=True)
    degenerate = _degenerate(variant, inputs, which)
    expected_degenerate, _ = run("recurrent", variant, degenerate)
    expected_random, _ = run("recurrent", variant, inputs)
    _mutated(monkeypatch, name, mutation)
    mutated_degenerate, _ = run("chunked", variant, degenerate)
    mutated_random, _ = run("chunked", variant, inputs)
    assert_close("mutated chunked form, degenerate setting", expected_degenerate, mutated_degenerate)
    assert rel_l2(expected_random, mutated_random) > 1e-3


# ---- bad input ----

def _bad_inputs():
    ok = random_inputs("gdn", 1, 8, 2, 4, 4)
    return [
        pytest.param("nope", ok, {}, "unknown variant", id="unknown-variant"),
        pytest.param("gdn", {**ok, "g": None}, {}, r"needs g of shape \[1, 8, 2\], got None", id="g-missing"),
        pytest.param("gdn", {**ok, "g": ok["g"][..., None]}, {}, "needs g of shape", id="g-wrong-shape"),
        pytest.param("linear", {**ok, "beta": None}, {}, "takes no g", id="g-for-linear"),
        pytest.param("gdn", {**ok, "beta": None}, {}, "needs beta", id="beta-missing"),
        pytest.param("simple_gla", ok, {}, "takes no beta", id="beta-for-non-delta"),
        pytest.param("gdn", {**ok, "k": ok["k"][..., :3]}, {}, "k must have the shape of q", id="k-shape"),
        pytest.param("gdn", {**ok, "v": ok["v"][:, :4]}, {}, "v must be", id="v-shape"),
        pytest.param("gdn", {**ok, "initial_state": torch.zeros(1, 2, 4, 5)}, {}, "initial_state must be",
                     id="h0-shape"),
        pytest.param("gdn", {**ok, "q": ok["q"].tolist()}, {}, "q must be a torch.Tensor", id="q-not-tensor"),
        pytest.param("gdn", {**ok, "q": ok["q"][0]}, {}, "q must be a 4-D tensor", id="q-3d"),
        pytest.param("gdn", {**ok, "v": ok["v"].to("meta")}, {}, "v is on meta but q is on cpu", id="devices"),
        pytest.param("gdn", ok, {"chunk_size": 0}, "chunk_size must be", id="chunk-size"),
        pytest.param("gdn", ok, {"sub_chunk": 2}, "per-channel variants only", id="sub-chunk-scalar"),
        pytest.param("gdn", ok, {"block_dv": 3}, "block_dv must be a positive divisor", id="block-dv"),
    ]


@pytest.mark.parametrize("variant,inputs,kwargs,message", _bad_inputs())
def test_bad_input_is_a_user_error(variant, inputs, kwargs, message):
    form = reference.kernel_mirror if "block_dv" in kwargs else reference.chunked
    with pytest.raises(UserError, match=message):
        form(variant, **inputs, **kwargs)


def test_sub_chunk_must_divide_chunk():
    inputs = random_inputs("kda", 1, 8, 1, 4, 4)
    with pytest.raises(UserError, match="positive divisor of chunk_size=8"):
        reference.chunked("kda", **inputs, chunk_size=8, sub_chunk=3)


def test_head_decay_matches_closed_form():
    """decay with one token per step: o_t = sum_i alpha^(t-i) (q_t . k_i) v_i, written out."""
    inputs = random_inputs("decay", 1, 6, 1, 4, 3)
    alpha = math.exp(inputs["g"][0].item())
    q, k, v = (inputs[n][0, :, 0] for n in ("q", "k", "v"))
    expected = torch.stack([
        sum(alpha ** (t - i) * (q[t] * 4 ** -0.5 @ k[i]) * v[i] for i in range(t + 1)) for t in range(6)
    ])
    o, _ = reference.recurrent("decay", **inputs)
    assert_close("o", expected, o[0, :, 0])


# ---------------------------------------------------------------------------------------------
# Packed sequences (cu_seqlens) and grouped value heads, against the independent implementation
# run on each sequence by itself (and on q, k repeated per value head).

PACKED_LENGTHS = (1, 15, 16, 17, 40)  # one token, a chunk of 16 and either side of it, several chunks


def independent(variant, q, k, v, g, beta, initial_state):
    """The independent implementation of ``variant`` on one batch of equal-length sequences."""
    if variants.get(variant).delta:
        return householder_form(q, k, v, g=g, beta=beta, initial_state=initial_state)
    return attention_form(q, k, v, g=g, initial_state=initial_state)


def packed(variant, lengths, H=2, K=8, V=8, seed=3):
    """Sequences of ``lengths`` packed into B = 1, each with its own initial state, and cu_seqlens."""
    x = random_inputs(variant, 1, sum(lengths), H, K, V, seed=seed)
    bounds = torch.tensor((0, *torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed + 1)
    x["initial_state"] = torch.randn(len(lengths), H, K, V, generator=gen, dtype=torch.float64)
    return x, bounds


def per_sequence(variant, x, bounds):
    """The independent implementation on each packed sequence alone, joined like the packed output."""
    outputs, states = [], []
    per_token = variants.get(variant).decay_per in ("token", "channel")
    for n, (s, e) in enumerate(zip(bounds.tolist(), bounds.tolist()[1:])):
        o, state = independent(variant, x["q"][:, s:e], x["k"][:, s:e], x["v"][:, s:e],
                               x["g"][:, s:e] if per_token else x["g"],
                               None if x["beta"] is None else x["beta"][:, s:e], x["initial_state"][n:n + 1])
        outputs.append(o)
        states.append(state)
    return torch.cat(outputs, dim=1), torch.cat(states)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
@pytest.mark.parametrize("variant", list(variants.VARIANTS))
def test_packed_sequences_match_each_sequence_alone(variant, form):
    x, bounds = packed(variant, PACKED_LENGTHS)
    o_ref, s_ref = per_sequence(variant, x, bounds)
    kwargs = {} if form == "recurrent" else dict(chunk_size=16, sub_chunk=8 if variants.get(variant).per_channel else None)
    o, s = FORMS[form](variant, **x, output_final_state=True, cu_seqlens=bounds, **kwargs)
    assert o.shape == o_ref.shape and s.shape == (len(PACKED_LENGTHS), 2, 8, 8)
    assert_close(f"{variant} {form} packed o", o_ref, o)
    assert_close(f"{variant} {form} packed state", s_ref, s)


def test_packed_chunks_restart_at_every_sequence():
    """Had the chunked form run its chunks across the packed tensor, a sequence starting inside a chunk
    would see the previous sequence's keys: the output would differ from the unpacked calls."""
    x, bounds = packed("gdn", (5, 27))
    o, _ = reference.chunked("gdn", **x, output_final_state=True, cu_seqlens=bounds, chunk_size=16)
    whole, _ = reference.chunked("gdn", **{**x, "initial_state": x["initial_state"][:1]}, output_final_state=True,
                                 chunk_size=16)
    assert rel_l2(whole[:, 5:], o[:, 5:]) > 1e-3  # the second sequence does not continue the first
    alone, _ = reference.chunked("gdn", **{n: t[:, 5:] if t is not None and t.dim() > 1 and n != "initial_state" else t
                                           for n, t in x.items()} | {"initial_state": x["initial_state"][1:]},
                                 output_final_state=True, chunk_size=16)
    assert_close("second sequence alone", alone, o[:, 5:])


def test_an_empty_sequence_passes_its_state_through():
    x, bounds = packed("simple_gla", (4, 0, 6))
    o, s = reference.recurrent("simple_gla", **x, output_final_state=True, cu_seqlens=bounds)
    assert o.shape[1] == 10 and torch.equal(s[1], x["initial_state"][1])


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
@pytest.mark.parametrize("variant", variants.GROUPED_HEADS)
def test_grouped_value_heads_match_repeated_query_and_key_heads(variant, form):
    H, HV = 2, 6
    x = random_inputs(variant, 2, 37, HV, 8, 8, seed=5, initial_state=True)
    x["q"], x["k"] = x["q"][:, :, ::HV // H].contiguous(), x["k"][:, :, ::HV // H].contiguous()  # H heads
    repeated = {**x, "q": x["q"].repeat_interleave(HV // H, dim=2), "k": x["k"].repeat_interleave(HV // H, dim=2)}
    o_ref, s_ref = independent(variant, repeated["q"], repeated["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    kwargs = {} if form == "recurrent" else dict(chunk_size=16, sub_chunk=8 if variant == "kda" else None)
    o, s = FORMS[form](variant, **x, output_final_state=True, **kwargs)
    assert o.shape == (2, 37, HV, 8)
    assert_close(f"{variant} {form} grouped o", o_ref, o)
    assert_close(f"{variant} {form} grouped state", s_ref, s)


def test_grouped_heads_and_packed_sequences_together():
    x, bounds = packed("kda", (9, 20), H=4)
    x["q"], x["k"] = x["q"][:, :, ::2].contiguous(), x["k"][:, :, ::2].contiguous()
    o, s = reference.chunked("kda", **x, output_final_state=True, cu_seqlens=bounds, chunk_size=16, sub_chunk=8)
    repeated = {**x, "q": x["q"].repeat_interleave(2, dim=2), "k": x["k"].repeat_interleave(2, dim=2)}
    o_ref, s_ref = per_sequence("kda", repeated, bounds)
    assert_close("kda grouped packed o", o_ref, o)
    assert_close("kda grouped packed state", s_ref, s)


@pytest.mark.parametrize("change,message", [
    (lambda x, b: ({**x, **{n: torch.cat([x[n]] * 2) for n in ("q", "k", "v", "g", "beta")}}, b),
     "batch must be 1"),
    (lambda x, b: (x, b.flip(0)), "must rise from 0"),
    (lambda x, b: (x, b[:-1]), "must rise from 0"),
    (lambda x, b: (x, b.float()), "int32/int64"),
    (lambda x, b: ({**x, "initial_state": x["initial_state"][:2]}, b), "one state per sequence"),
], ids=["batch", "unsorted", "short", "dtype", "states"])
def test_bad_cu_seqlens_are_refused_with_the_reason(change, message):
    x, bounds = packed("gdn", (3, 5, 8))
    x, bounds = change(x, bounds)
    with pytest.raises(UserError, match=message):
        reference.recurrent("gdn", **x, cu_seqlens=bounds)


def test_grouped_heads_that_do_not_divide_or_are_not_supported_are_refused():
    x = random_inputs("gdn", 1, 8, 3, 8, 8)
    with pytest.raises(UserError, match="multiple"):
        reference.recurrent("gdn", **{**x, "q": x["q"][:, :, :2], "k": x["k"][:, :, :2]})
    y = random_inputs("gla", 1, 8, 4, 8, 8)
    with pytest.raises(UserError, match="grouped value heads are for"):
        reference.recurrent("gla", **{**y, "q": y["q"][:, :, :2], "k": y["k"][:, :, :2]})


def test_importing_the_oracles_loads_no_database_or_template_code():
    # A gate's child process and every generated module's self-check import the oracles.
    code = ("import sys, tuner.reference, tuner.inputs, tuner.problem; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'optuna', 'jinja2') "
            "or m in ('tuner.store', 'tuner.lookup')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # The package root still gives its public names, loaded on first use.
    code = "import tuner; print(tuner.best_config.__module__, tuner.get_variant('gdn').name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["tuner.lookup", "gdn"]
