"""tuner.ops: FLA's signatures, clear errors for wrong inputs, and (on a GPU) agreement with the oracle."""
import inspect

import pytest
import torch

from tuner import ops, reference
from tuner.inputs import make_inputs
from tuner.problem import Problem

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# FLA 0.6.0's leading parameters, in order (read from fla/ops/*/chunk.py).
FLA_SIGNATURES = {
    "chunk_linear_attn": ["q", "k", "v", "scale", "initial_state", "output_final_state", "normalize"],
    "chunk_retention": ["q", "k", "v", "scale", "initial_state", "output_final_state"],
    "chunk_simple_gla": ["q", "k", "v", "g", "g_gamma", "scale", "initial_state", "output_final_state"],
    "chunk_gla": ["q", "k", "v", "g", "scale", "initial_state", "output_final_state"],
    "chunk_gated_delta_rule": ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                               "use_qk_l2norm_in_kernel"],
    "chunk_kda": ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel"],
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
        pytest.param(lambda q, k, v: ops.chunk_gla(q, k, v, torch.zeros(1, 8, 2, 16)), "must be on a CUDA device", id="cpu-tensors"),
        pytest.param(lambda q, k, v: ops.chunk_gla(q.float(), k, v, torch.zeros(1, 8, 2, 16)), "float16 or bfloat16", id="fp32"),
        pytest.param(lambda q, k, v: ops.chunk_gla(q[0], k, v, None), "4-D tensor [B, T, H, D]", id="3d"),
        pytest.param(lambda q, k, v: ops.chunk_gla(q, k, v, torch.zeros(1, 8, 2)), "needs g of shape [1, 8, 2, 16]", id="g-shape"),
        pytest.param(lambda q, k, v: ops.chunk_kda(q, k, v, torch.zeros(1, 8, 2, 16), None), "needs beta", id="no-beta"),
        pytest.param(lambda q, k, v: ops.chunk_gated_delta_rule(q, k, v, None, None, cu_seqlens=torch.tensor([0, 8])),
                     "cu_seqlens is not supported", id="varlen"),
        pytest.param(lambda q, k, v: ops.chunk_simple_gla(q, k, v, g=torch.zeros(1, 8, 2), g_gamma=torch.zeros(2)),
                     "only one of g and g_gamma", id="g-and-g_gamma"),
    ],
)
def test_wrong_inputs_get_a_clear_error(call, message):
    q, k, v = _qkv()
    with pytest.raises(ops.InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(q, k, v)


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
