"""FLA's six chunk ops, by the fp64 oracle: ``o`` in the input dtype, the final state in fp32.

Each call is noted in :data:`calls` (the op's name) and, where ``$FLA_STANDIN_LOG`` names a file,
appended to it as a JSON line with whether FLA's backend dispatch was off when ``fla`` was imported
(what a gate's child reports back). ``$FLA_STANDIN_WRONG=1`` makes every output 5% too large: a
wrong FLA, for the gate to catch.
"""
import json
import os

from tuner import reference
from tuner.inputs import retention_log_decay

# FLA reads its backend switch when it is imported; so does the stand-in.
DISPATCH_DISABLED = os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1"
calls = []


def _oracle(op, variant, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None):
    calls.append(op)
    log = os.environ.get("FLA_STANDIN_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"op": op, "dispatch_disabled": DISPATCH_DISABLED}) + "\n")
    o, state = reference.recurrent(variant, q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                   output_final_state=True, cu_seqlens=cu_seqlens)
    o = o.to(q.dtype)
    if os.environ.get("FLA_STANDIN_WRONG") == "1":
        o = o * 1.05
    return o, (state.float() if output_final_state else None)


def _l2norm(q, k, on):
    if not on:
        return q, k
    return [(x.double() / x.double().norm(dim=-1, keepdim=True)).to(x.dtype) for x in (q, k)]


def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                      cu_seqlens=None):
    kv_init, z_init = initial_state if normalize and isinstance(initial_state, tuple) else (initial_state, None)
    o, state = _oracle("chunk_linear_attn", "linear", q, k, v, scale=scale, initial_state=kv_init,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if not normalize:
        return o, state
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_sum = k.double().cumsum(1) + (0 if z_init is None else z_init.double())
    o = (o.double() / (q.double() * scale * k_sum).sum(-1, keepdim=True)).to(q.dtype)
    return o, ((state, k_sum[:, -1:].to(k.dtype)) if output_final_state else None)


def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs):
    return _oracle("chunk_retention", "decay", q, k, v, g=retention_log_decay(q.shape[2], q.device), scale=scale,
                   initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     state_v_first=False, cu_seqlens=None, **kwargs):
    variant, gate = ("simple_gla", g) if g is not None else ("decay", g_gamma) if g_gamma is not None else ("linear", None)
    return _oracle("chunk_simple_gla", variant, q, k, v, g=gate, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
              cu_seqlens=None):
    return _oracle("chunk_gla", "gla", q, k, v, g=g, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    q, k = _l2norm(q, k, use_qk_l2norm_in_kernel)
    return _oracle("chunk_gated_delta_rule", "gdn", q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    q, k = _l2norm(q, k, use_qk_l2norm_in_kernel)
    return _oracle("chunk_kda", "kda", q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)
