"""tuner.ops: FLA's signatures, clear errors for wrong inputs, the dispatch to FLA where its stored
baseline is faster (with FLA absent and the stand-in present), and (on a GPU) agreement with the oracle."""
import inspect
import itertools
import math
import sys

import pytest
import torch

from tuner import baseline, lookup, ops, reference, space, stack
from tuner.candidate import Candidate
from tuner.inputs import make_inputs
from tuner.problem import Problem
from tuner.stack import Stack
from tuner.store import Baseline, Store, Winner

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# FLA 0.6.0's leading parameters, in order (read from fla/ops/*/chunk.py).
FLA_SIGNATURES = {
    "chunk_linear_attn": ["q", "k", "v", "scale", "initial_state", "output_final_state", "normalize"],
    "chunk_retention": ["q", "k", "v", "scale", "initial_state", "output_final_state"],
    "chunk_simple_gla": ["q", "k", "v", "g", "g_gamma", "scale", "initial_state", "output_final_state"],
    "chunk_gla": ["q", "k", "v", "g", "scale", "initial_state", "output_final_state"],
    "chunk_gated_delta_rule": ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                               "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                               "state_v_first", "cu_seqlens", "cu_seqlens_cpu", "chunk_indices"],
    "chunk_kda": ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval"],
}


@pytest.mark.parametrize("name", FLA_SIGNATURES)
def test_signature_starts_like_fla(name):
    params = list(inspect.signature(getattr(ops, name)).parameters)
    assert params[: len(FLA_SIGNATURES[name])] == FLA_SIGNATURES[name]
    defaults = {p.name: p.default for p in inspect.signature(getattr(ops, name)).parameters.values()}
    assert defaults["scale"] is None and defaults["initial_state"] is None and defaults["output_final_state"] is False


def _qkv(B=1, T=8, H=2, K=16, V=16, dtype=torch.bfloat16, device="cpu"):
    return (torch.randn(B, T, H, K, dtype=dtype, device=device), torch.randn(B, T, H, K, dtype=dtype, device=device),
            torch.randn(B, T, H, V, dtype=dtype, device=device))


@pytest.mark.parametrize(
    "call, message",
    [
        pytest.param(lambda q, k, v: ops.chunk_gla(*_qkv(K=64, V=64), torch.zeros(1, 8, 2, 64)), "must be on a CUDA device",
                     id="cpu-tensors"),
        pytest.param(lambda q, k, v: ops.chunk_gla(q.float(), k, v, torch.zeros(1, 8, 2, 16)), "float16 or bfloat16", id="fp32"),
        pytest.param(lambda q, k, v: ops.chunk_gla(q[0], k, v, None), "4-D tensor [B, T, H, D]", id="3d"),
        pytest.param(lambda q, k, v: ops.chunk_gla(q, k, v, torch.zeros(1, 8, 2)), "needs g of shape [1, 8, 2, 16]", id="g-shape"),
        pytest.param(lambda q, k, v: ops.chunk_kda(q, k, v, torch.zeros(1, 8, 2, 16), None), "needs beta", id="no-beta"),
        pytest.param(lambda q, k, v: ops.chunk_simple_gla(q, k, v, g=torch.zeros(1, 8, 2), g_gamma=torch.zeros(2)),
                     "only one of g and g_gamma", id="g-and-g_gamma"),
    ],
)
def test_wrong_inputs_get_a_clear_error(call, message):
    q, k, v = _qkv()
    with pytest.raises(ops.InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(q, k, v)


def _delta_rule(variant, B=1, T=8, H=2, HV=4, K=16, **kwargs):
    """chunk_gated_delta_rule (gdn) or chunk_kda (kda, g per channel) on CPU inputs of H query/key and HV
    value heads (fails, if at all, in its checks before the CUDA one)."""
    q, k, _ = _qkv(B, T, H, K)
    v = torch.randn(B, T, HV, K, dtype=torch.bfloat16)
    g = torch.zeros(B, T, HV, *((K,) if variant == "kda" else ()))
    op = ops.chunk_kda if variant == "kda" else ops.chunk_gated_delta_rule
    return op(q, k, v, g, torch.ones(B, T, HV), **kwargs)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.parametrize(
    "arguments, message",
    [
        pytest.param(dict(B=2, cu_seqlens=torch.tensor([0, 3, 8])), "batch size is expected to be 1", id="batch"),
        pytest.param(dict(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(3, 4, 16, 16)),
                     "equal to the number of input sequences, i.e., 2 rather than 3", id="states"),
        pytest.param(dict(HV=3), "multiple of q's and k's 2", id="heads-not-a-multiple"),
        pytest.param(dict(cu_seqlens=torch.tensor([0, 5, 3, 8]), cu_seqlens_cpu=torch.tensor([0, 5, 3, 8])),
                     "must rise from 0 to T=8", id="falling"),
        pytest.param(dict(cu_seqlens=torch.tensor([0, 3, 7]), cu_seqlens_cpu=torch.tensor([0, 3, 7])),
                     "must rise from 0 to T=8", id="short-of-T"),
        pytest.param(dict(cu_seqlens=torch.tensor([0.0, 8.0])), "1-D int32 or int64", id="float-bounds"),
        pytest.param(dict(cu_seqlens=torch.tensor([8])), "1-D int32 or int64", id="one-bound"),
        pytest.param(dict(cu_seqlens=torch.tensor([0, 8]), cu_seqlens_cpu=torch.tensor([0, 4, 8])),
                     "cu_seqlens on the host", id="cpu-copy-differs"),
        pytest.param(dict(chunk_indices=torch.zeros(1, 2, dtype=torch.long)), "give cu_seqlens too", id="index-alone"),
        pytest.param(dict(cu_seqlens=torch.tensor([0, 8]), chunk_indices=torch.zeros(2)), "[chunks, 2]",
                     id="index-shape"),
        pytest.param(dict(initial_state=torch.zeros(1, 2, 16, 16)), "[1, 4, 16, 16]", id="state-heads"),
        pytest.param(dict(allow_neg_eigval=True), "`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`",
                     id="neg-eigval"),
        pytest.param(dict(use_gate_in_kernel=True), "`A_log` must be provided when `use_gate_in_kernel=True`",
                     id="gate-without-A_log"),
        # Checked, the inputs reach the device check: the rest is the GPU's.
        pytest.param(dict(K=64, cu_seqlens=torch.tensor([0, 3, 8]), cu_seqlens_cpu=torch.tensor([0, 3, 8]),
                          initial_state=torch.zeros(2, 4, 64, 64)), "must be on a CUDA device", id="valid"),
    ],
)
def test_packed_and_grouped_inputs_get_fla_s_errors(variant, arguments, message):
    with pytest.raises(ops.InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _delta_rule(variant, **arguments)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_errors_of_bad_packed_inputs_are_value_errors_as_fla_s(variant):
    with pytest.raises(ValueError):
        _delta_rule(variant, B=2, cu_seqlens=torch.tensor([0, 3, 8]))


def _without_delta(variant, B=1, T=8, H=2, K=64, **kwargs):
    """The op of ``variant`` (one without the delta rule) on CPU inputs (fails, if at all, in its checks
    before the CUDA one)."""
    q, k, v = _qkv(B, T, H, K, K)
    if variant == "linear":
        return ops.chunk_linear_attn(q, k, v, normalize=False, **kwargs)
    if variant == "decay":
        return ops.chunk_retention(q, k, v, **kwargs)
    if variant == "gla":
        return ops.chunk_gla(q, k, v, torch.zeros(B, T, H, K), **kwargs)
    return ops.chunk_simple_gla(q, k, v, torch.zeros(B, T, H), **kwargs)


@pytest.mark.parametrize("variant", ["linear", "decay", "simple_gla", "gla"])
@pytest.mark.parametrize(
    "arguments, message",
    [
        pytest.param(dict(B=2, cu_seqlens=torch.tensor([0, 3, 8])), "batch size is expected to be 1", id="batch"),
        pytest.param(dict(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(3, 2, 64, 64)),
                     "equal to the number of input sequences", id="state-count"),
        pytest.param(dict(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(2, 2, 64, 64)),
                     "must be on a CUDA device", id="valid"),
    ],
)
def test_the_ops_without_delta_take_packed_sequences_with_fla_s_errors(variant, arguments, message):
    with pytest.raises(ops.InputError, match=message):
        _without_delta(variant, **arguments)


def test_linear_attention_refuses_the_normaliser_across_packed_sequences():
    q, k, v = _qkv()
    with pytest.raises(ops.InputError, match="needs normalize=False"):
        ops.chunk_linear_attn(q, k, v, cu_seqlens=torch.tensor([0, 3, 8]))


def test_kda_s_bounded_gate_gets_fla_s_errors():
    with pytest.raises(ops.InputError, match="`lower_bound` must be specified when `safe_gate=True`"):
        _delta_rule("kda", use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(4))
    with pytest.raises(ops.InputError, match=r"safe range \[-5, 0\), got -6"):
        _delta_rule("kda", use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0)
    with pytest.raises(ops.InputError, match="must be on a CUDA device"):  # lower_bound stands in for A_log
        _delta_rule("kda", K=64, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)


def _softplus(x):
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("form", ["gdn", "kda", "kda-lower-bound", "kda-lower-bound-without-A_log"])
def test_activations_are_fla_s_formulas_element_by_element(form):
    """g from the raw gate input and beta from logits, against FLA 0.6.0's documented formulas evaluated
    one element at a time in float64."""
    generator = torch.Generator().manual_seed(0)
    B, T, HV, K = 2, 5, 3, 4
    per_channel = form.startswith("kda")
    g = torch.randn(B, T, HV, *((K,) if per_channel else ()), generator=generator, dtype=torch.bfloat16) * 4
    beta = torch.randn(B, T, HV, generator=generator, dtype=torch.bfloat16) * 3
    A_log = None if form.endswith("without-A_log") else torch.randn(HV, generator=generator)
    dt_bias = torch.randn(HV * K if per_channel else HV, generator=generator)
    lower_bound = -5.0 if "lower-bound" in form else None
    for neg in (False, True):
        got_g, got_beta = ops.activated(g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
        assert got_g.dtype == got_beta.dtype == torch.float32
        for index in itertools.product(*map(range, g.shape)):
            h = index[2]
            x = float(g[index]) + float(dt_bias[h * K + index[3] if per_channel else h])
            if lower_bound is None:
                want = -math.exp(float(A_log[h])) * _softplus(x)
            else:
                want = lower_bound * _sigmoid(x if A_log is None else math.exp(float(A_log[h])) * x)
            assert float(got_g[index]) == pytest.approx(want, rel=1e-5, abs=1e-6), index
        for index in itertools.product(*map(range, beta.shape)):
            assert float(got_beta[index]) == pytest.approx((2 if neg else 1) * _sigmoid(float(beta[index])), rel=1e-6)
    # Inputs not activated come back as they are.
    same_g, same_beta = ops.activated(g, beta)
    assert same_g is g and same_beta is beta


@needs_cuda
@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_in_kernel_activations_give_the_outputs_of_activated_inputs(variant):
    problem = Problem(variant, 64, 64, "bf16", batch=1, seqlen=200, heads=2)
    x = make_inputs(problem, regime="default", seed=1, device="cuda")
    op = ops.chunk_kda if variant == "kda" else ops.chunk_gated_delta_rule
    raw_g = torch.randn_like(x["g"]).to(torch.bfloat16)
    logits = torch.randn_like(x["beta"]).to(torch.bfloat16)
    options = dict(use_gate_in_kernel=True, A_log=torch.rand(2, device="cuda") - 1,
                   dt_bias=torch.randn(x["g"][0, 0].numel(), device="cuda"), use_beta_sigmoid_in_kernel=True)
    g, beta = ops.activated(raw_g, logits, **options)
    o, state = op(x["q"], x["k"], x["v"], raw_g, logits, output_final_state=True, backend="tuner", **options)
    o_ref, state_ref = op(x["q"], x["k"], x["v"], g, beta, output_final_state=True, backend="tuner")
    assert torch.equal(o, o_ref) and torch.equal(state, state_ref)


@needs_cuda
@pytest.mark.parametrize(
    "variant, call",
    [
        ("linear", lambda x: ops.chunk_linear_attn(x["q"], x["k"], x["v"], initial_state=x["initial_state"],
                                                   output_final_state=True, normalize=False)),
        ("decay", lambda x: ops.chunk_simple_gla(x["q"], x["k"], x["v"], g_gamma=x["g"], initial_state=x["initial_state"],
                                                 output_final_state=True)),
        ("simple_gla", lambda x: ops.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"],
                                                      output_final_state=True)),
        ("gla", lambda x: ops.chunk_gla(x["q"], x["k"], x["v"], x["g"], initial_state=x["initial_state"],
                                        output_final_state=True)),
        ("gdn", lambda x: ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                     initial_state=x["initial_state"], output_final_state=True)),
        ("kda", lambda x: ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                       output_final_state=True)),
    ],
)
def test_ops_match_the_fp64_oracle(variant, call):
    problem = Problem(variant, 64, 64, "bf16", batch=2, seqlen=300, heads=3)
    x = make_inputs(problem, regime="initial_state", seed=3, device="cuda")
    o, state = call(x)
    ref_o, ref_state = reference.chunked(variant, **x, output_final_state=True)
    for out, ref in ((o, ref_o), (state, ref_state)):
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < problem.tolerance, (variant, err)


# ---- the dispatch: FLA where its stored baseline beats the winner (CPU, the stand-in FLA)

H200 = Stack("NVIDIA H200", "sm_90", "0.1.15", "13.0.88", "570.86.15", "2.13.0")
SHAPE = dict(batch=1, seqlen=8, heads=2)


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """A database of this machine (an H200, as far as the lookup can tell) holding, per variant
    asked for, a winner at 1 ms and FLA's op at ``fla_ms``."""
    monkeypatch.setattr(stack, "current", lambda device=0: H200)
    monkeypatch.setattr(lookup, "SHIPPED_DB", tmp_path / "shipped.db")
    monkeypatch.setenv(lookup.DB_ENV, str(tmp_path / "user.db"))
    monkeypatch.delenv(baseline.BACKEND_ENV, raising=False)
    store = Store(tmp_path / "user.db")

    def record(variant, fla_ms):
        problem = Problem(variant, 64, 64, "bf16", **SHAPE)
        config = space.load(variant).default(problem)
        store.write_winner(Winner(problem, H200, Candidate.from_config(problem, config).digest, config, 1.0, 0.98,
                                  1.02, {}, "s", 0), "pass")
        store.add_baseline(Baseline(problem, H200, "0.6.0+standin", "pass", fla_ms, fla_ms * 0.98, fla_ms * 1.02))

    return record


def cpu_inputs(variant):
    return make_inputs(Problem(variant, 64, 64, "bf16", **SHAPE), "initial_state", seed=0)


# Each op as a user calls it, and what FLA's op of that name is called with.
CALLS = {
    "linear": (lambda impl, x, **o: impl.chunk_linear_attn(x["q"], x["k"], x["v"], output_final_state=True,
                                                            normalize=False, **o), "chunk_linear_attn"),
    "decay": (lambda impl, x, **o: impl.chunk_retention(x["q"], x["k"], x["v"], output_final_state=True, **o),
              "chunk_retention"),
    "simple_gla": (lambda impl, x, **o: impl.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"],
                                                              initial_state=x["initial_state"],
                                                              output_final_state=True, **o), "chunk_simple_gla"),
    "gla": (lambda impl, x, **o: impl.chunk_gla(x["q"], x["k"], x["v"], x["g"], scale=0.3, output_final_state=True,
                                                **o), "chunk_gla"),
    "gdn": (lambda impl, x, **o: impl.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                             output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                             **o), "chunk_gated_delta_rule"),
    "kda": (lambda impl, x, **o: impl.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                               initial_state=x["initial_state"], output_final_state=True, **o),
            "chunk_kda"),
}


@pytest.mark.parametrize("variant", CALLS)
def test_the_op_calls_fla_with_the_users_arguments_where_fla_is_faster(variant, measured, fla_standin):
    measured(variant, 0.5)
    call, name = CALLS[variant]
    x = cpu_inputs(variant)
    o, state = call(ops, x)  # CPU tensors: only FLA can take them here
    fla = baseline.fla_ops()
    assert fla.calls == [name]
    expected_o, expected_state = call(fla, x)
    assert torch.equal(o, expected_o) and torch.equal(state, expected_state)


def test_a_packed_kda_call_gives_fla_the_sequences_but_not_the_chunk_index_its_chunk_kda_lacks(measured, fla_standin,
                                                                                              monkeypatch):
    measured("kda", 0.5)  # FLA faster and no packed winner: FLA runs the packed call
    x = cpu_inputs("kda")
    fla, passed = baseline.fla_ops(), {}
    monkeypatch.setattr(fla, "chunk_kda", lambda *args, **kwargs: passed.update(kwargs) or (args[0], None))
    cu_seqlens, cu_seqlens_cpu = torch.tensor([0, 3, 8]), torch.tensor([0, 3, 8])
    ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                  chunk_indices=torch.tensor([[0, 0], [1, 0]]))
    assert passed["cu_seqlens"] is cu_seqlens and passed["cu_seqlens_cpu"] is cu_seqlens_cpu
    assert "chunk_indices" not in passed  # FLA 0.6.0's chunk_kda would take it in **kwargs and ignore it


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_where_fla_runs_it_gets_the_activation_arguments_as_given(variant, measured, fla_standin, monkeypatch):
    measured(variant, 0.5)
    x = cpu_inputs(variant)
    name = "chunk_kda" if variant == "kda" else "chunk_gated_delta_rule"
    fla, passed = baseline.fla_ops(), {}
    monkeypatch.setattr(fla, name, lambda *args, **kwargs: passed.update(kwargs, g=args[3]) or (args[0], None))
    A_log, dt_bias = torch.zeros(x["v"].shape[2]), torch.zeros(x["g"][0, 0].numel())
    bounded = dict(safe_gate=True, lower_bound=-5.0) if variant == "kda" else {}
    getattr(ops, name)(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True, A_log=A_log,
                       dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, **bounded)
    assert passed["g"] is x["g"] and passed["A_log"] is A_log and passed["dt_bias"] is dt_bias
    assert passed["use_gate_in_kernel"] and passed["use_beta_sigmoid_in_kernel"] and passed["allow_neg_eigval"]
    assert {k: passed[k] for k in bounded} == bounded


@pytest.mark.parametrize("variant", ["linear", "decay", "simple_gla", "gla"])
def test_a_packed_call_without_delta_gives_fla_the_sequences(variant, measured, fla_standin, monkeypatch):
    measured(variant, 0.5)  # FLA faster and no packed winner: FLA runs the packed call
    call, name = CALLS[variant]
    x = cpu_inputs(variant)
    x = dict(x, initial_state=torch.zeros(2, *x["initial_state"].shape[1:]))  # one per sequence
    fla, passed = baseline.fla_ops(), {}
    monkeypatch.setattr(fla, name, lambda *args, **kwargs: passed.update(kwargs) or (args[0], None))
    cu_seqlens = torch.tensor([0, 3, x["q"].shape[1]])
    call(ops, x, cu_seqlens=cu_seqlens)
    assert passed["cu_seqlens"] is cu_seqlens


def test_the_tuners_kernel_runs_where_it_is_faster_or_fla_is_absent_or_the_switch_says_so(measured, fla_standin,
                                                                                           monkeypatch):
    x = cpu_inputs("gla")
    call = CALLS["gla"][0]
    measured("gla", 2.0)  # FLA slower than the winner
    with pytest.raises(ops.InputError, match="must be on a CUDA device"):  # the tuner's path: CUDA only
        call(ops, x)
    assert "fla.ops" not in sys.modules  # FLA was not even imported
    measured("gdn", 0.5)  # FLA faster, but forced off, by argument and by environment
    x = cpu_inputs("gdn")
    with pytest.raises(ops.InputError, match="must be on a CUDA device"):
        CALLS["gdn"][0](ops, x, backend="tuner")
    monkeypatch.setenv(baseline.BACKEND_ENV, "tuner")
    with pytest.raises(ops.InputError, match="must be on a CUDA device"):
        CALLS["gdn"][0](ops, x)
    assert "fla.ops" not in sys.modules
    CALLS["gdn"][0](ops, x, backend="auto")  # the argument over the environment
    assert baseline.fla_ops().calls == ["chunk_gated_delta_rule"]


def test_without_fla_the_tuners_kernel_runs_and_forcing_fla_is_a_clear_error(measured):
    measured("kda", 0.5)
    x = cpu_inputs("kda")
    with pytest.raises(ops.InputError, match="must be on a CUDA device"):
        CALLS["kda"][0](ops, x)
    with pytest.raises(baseline.FlaUnavailable, match=r"pip install 'linattn-tuner\[fla\]'"):
        CALLS["kda"][0](ops, x, backend="fla")


def test_an_fla_that_will_not_import_gives_way_to_the_tuners_kernel_with_a_warning(measured, fla_standin,
                                                                                     monkeypatch):
    measured("gla", 0.5)
    monkeypatch.setitem(sys.modules, "fla.ops", None)  # installed, but importing it fails
    with pytest.warns(UserWarning, match="the tuner's kernel runs gla in its place"):
        with pytest.raises(ops.InputError, match="must be on a CUDA device"):
            CALLS["gla"][0](ops, cpu_inputs("gla"))


def test_the_choice_is_looked_up_once_per_problem(measured, fla_standin, monkeypatch):
    measured("gla", 0.5)
    looked_up = []
    real = ops.best_config
    monkeypatch.setattr(ops, "best_config", lambda *a, **k: looked_up.append(k["backend"]) or real(*a, **k))
    x = cpu_inputs("gla")
    for _ in range(3):
        CALLS["gla"][0](ops, x)
    CALLS["gla"][0](ops, x, backend="fla")
    assert looked_up == ["auto", "fla"] and baseline.fla_ops().calls == ["chunk_gla"] * 4


def test_the_switch_is_the_last_argument_of_every_op():
    for name in FLA_SIGNATURES:
        parameters = list(inspect.signature(getattr(ops, name)).parameters.values())
        assert parameters[-1].name == "backend" and parameters[-1].default is None


@pytest.mark.parametrize("variant", ["gdn", "simple_gla"])
def test_one_packed_sequence_runs_the_dense_winner_and_several_the_packed_kernels(variant, measured, monkeypatch):
    """cu_seqlens of one sequence is the dense row B = 1 (its bounds can only be [0, T]): the call takes
    the winner stored for the dense 1 x T problem; two sequences need a config of packed kernels."""
    measured(variant, 2.0)  # the tuner's winner is the faster
    ran = []
    monkeypatch.setattr(ops, "_run", lambda problem, config, *args, **kwargs: ran.append(
        (dict(config), kwargs.get("cu_seqlens"))) or (args[0], None))
    call = CALLS[variant][0]
    x = cpu_inputs(variant)
    dense = space.load(variant).default(Problem(variant, 64, 64, "bf16", **SHAPE))
    call(ops, x, cu_seqlens=torch.tensor([0, x["q"].shape[1]]))
    assert ran[-1][0] == dense and not dense.get("packed")
    two = dict(x, initial_state=torch.zeros(2, *x["initial_state"].shape[1:]))
    call(ops, two, cu_seqlens=torch.tensor([0, 3, x["q"].shape[1]]))
    assert ran[-1][0]["packed"] is True and ran[-1][1] is not None
