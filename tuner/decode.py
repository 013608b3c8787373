"""Decode: the token-by-token kernels (templates/recurrent.py.j2) behind FLA's ``fused_recurrent_*``
signatures, in FLA's form and in the state-pool form that vLLM calls.

FLA's form: ``initial_state`` [N, HV, K, V] (or [N, HV, V, K] with ``state_v_first``) is read, not
written; the final state is a new tensor. The pool form (``ssm_state_indices`` given):
``initial_state`` is the pool [slots, HV, K, V] (or [slots, HV, V, K]); sequence n starts from
``pool[ssm_state_indices[n]]`` and its state is written back there, in place; an index of -1 skips the
sequence (no state read or written, its outputs zeros); slots no sequence names are not touched; the
pool itself is returned as the final state. N is the batch, or ``len(cu_seqlens) - 1`` with packed
sequences (several tokens each, e.g. speculative drafts).

Speculative decoding (``ssm_state_indices`` [N, W], a slot for each token of a sequence, as vLLM lays
them out): sequence n starts from the slot of its last accepted token, ``pool[ssm_state_indices[n,
num_accepted_tokens[n] - 1]]`` (``num_accepted_tokens`` [N] in 1..W; without it, the first slot), and
the state after its token t is written to ``pool[ssm_state_indices[n, t]]``, so the next step resumes
from whichever draft token was accepted; a start slot of -1 skips the sequence, a token's slot of -1
keeps no state, and tokens past W keep none. Grouped value heads: q and k have H heads,
v, g, beta and the states HV (a multiple of H); value head j reads query/key head j // (HV / H).

The host path reads no tensor's values (no host sync): an index at or past the pool's end is not
checked here, the kernel skips its loads and stores (its outputs are garbage). The config is looked
up once per shape bucket and the kernel compiled once per config; the slot and length tensors of
FLA's form are cached per (N, T, device); ``out=`` takes a preallocated output.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .activations import activated, check_activations, l2normalised
from .errors import UserError, refuse_stated
from .inputs import retention_log_decay
from .lookup import best_config
from .problem import Problem
from .candidate import Candidate
from .store import shape_bucket
from .variants import GROUPED_HEADS, get as get_variant, recurrent_name

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class DecodeInputError(UserError, ValueError):
    """Inputs of the wrong shape, dtype or device for a decode op."""


@functools.lru_cache(maxsize=256)
def _config(name: str, dk: int, dv: int, dtype: str, bucket, device: int) -> tuple:
    """The stored winner (or the default) for one shape bucket, as sorted items."""
    lookup = best_config(name, dk, dv, dtype, batch=bucket.bh, seqlen=bucket.t, heads=1, device=device)
    return tuple(sorted(lookup.config.items()))


@functools.lru_cache(maxsize=64)
def _compiled(name: str, dk: int, dv: int, dtype: str, config: tuple):
    """The generated module and its compiled kernels for one config (one compile per process)."""
    from .compile import load_kernels

    return load_kernels(Candidate.from_config(Problem(name, dk, dv, dtype), dict(config)))


@functools.lru_cache(maxsize=1024)
def kernel_for(variant: str, dk: int, dv: int, dtype: str, sequences: int, tokens: int, heads: int,
               layout: str, device: int, token_states: bool = False):
    """(module, kernels, config) of ``variant``'s recurrent kernel for a call of ``sequences`` sequences
    with ``tokens`` tokens in all on ``heads`` value heads, with the pool in ``layout`` ("kv" or "vk"),
    a slot per token where ``token_states`` (speculative decoding). The winner of the shape bucket is
    used with the pool's layout and slots (the caller's, not a choice)."""
    name = recurrent_name(variant)
    bucket = shape_bucket(sequences * heads, max(tokens // max(sequences, 1), 1), 1)
    config = dict(_config(name, dk, dv, dtype, bucket, device))
    config["layout"] = layout
    if token_states:
        config["token_states"] = True
    module, kernels = _compiled(name, dk, dv, dtype, tuple(sorted(config.items())))
    return module, kernels, config


@functools.lru_cache(maxsize=256)
def _arange(n: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[0, step, ..., n * step) on ``device``: the slots (step 1) and the equal lengths of FLA's form."""
    return torch.arange(0, n * step, step, dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def _ones(n: int, device: torch.device) -> torch.Tensor:
    """n ones (int32) on ``device``: every sequence's first slot is where it starts."""
    return torch.ones(n, dtype=torch.int32, device=device)


def _dense(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` contiguous and in ``dtype``, copied only where it is not already (the usual case costs no kernel)."""
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _fail(message: str):
    raise DecodeInputError(message)


def _check_tensor(name, t, shape, dtype=None, device=None):
    """``device``: q's ``get_device()`` (an int: cheaper to compare than torch.device, on every call)."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor {list(shape)}, got {type(t).__name__}")
    if t.shape != shape:
        _fail(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}")
    if device is not None and t.get_device() != device:
        _fail(f"{name} is on {t.device} but q is on device {device}; put all inputs on one device")


@dataclass(frozen=True)
class Call:
    """One decode call, checked and laid out for the generated module's ``step()``.

    Attributes:
        shape: the arguments of :func:`kernel_for` after the variant: (dk, dv, dtype, sequences,
            tokens, value heads, layout).
        token_states: a slot per token (speculative decoding): :func:`kernel_for`'s ``token_states``.
        args: ``step()``'s arguments after ``kernels``.
        result: what the op returns once ``step()`` has run: (o, final state or None).
    """

    shape: tuple
    args: tuple
    result: tuple
    token_states: bool = False


def run(variant: str, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, ssm_state_indices=None, state_v_first=False, out=None, num_accepted_tokens=None):
    """``variant``'s recurrence token by token; FLA's form, or the pool form with ``ssm_state_indices``
    (module docstring). Returns ``(o [B, T, HV, V], final_state or None)``."""
    call = plan(variant, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, ssm_state_indices,
                state_v_first, out, num_accepted_tokens)
    if not q.is_cuda:
        _fail(f"q, k, v must be on a CUDA device, got {q.device}")
    module, kernels, _ = kernel_for(variant, *call.shape, q.device.index or 0, token_states=call.token_states)
    with torch.cuda.device(q.device):
        module.step(kernels, *call.args)
    return call.result


def plan(variant: str, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
         cu_seqlens=None, ssm_state_indices=None, state_v_first=False, out=None, num_accepted_tokens=None) -> Call:
    """The checks and the layout of :func:`run`, on any device; nothing is launched."""
    spec = get_variant(variant)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            _fail(f"{name} must be a 4-D tensor [B, T, heads, D], got {getattr(t, 'shape', type(t).__name__)}")
        if torch.is_grad_enabled() and t.requires_grad:
            _fail(f"{name} requires grad: the decode ops are forward-only kernels")
    B, T, H, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    device, on = q.device, q.get_device()
    if q.dtype not in _DTYPES or len({q.dtype, k.dtype, v.dtype}) != 1:
        _fail(f"q, k, v must share one dtype, float16 or bfloat16; got {q.dtype}, {k.dtype}, {v.dtype}")
    _check_tensor("k", k, q.shape, device=on)
    _check_tensor("v", v, (B, T, HV, DV), device=on)
    if HV % H or (HV != H and variant not in GROUPED_HEADS):
        _fail(f"v has {HV} heads, q and k {H}: grouped value heads (a multiple) are for gdn and kda only")
    if cu_seqlens is None:
        N = B
        cu = _arange(B + 1, T, torch.int64, device)
    else:
        if B != 1:
            _fail(f"with cu_seqlens the batch must be 1 (sequences packed along T), got B={B}")
        _check_tensor("cu_seqlens", cu_seqlens, (cu_seqlens.shape[0],), device=on)
        N = cu_seqlens.shape[0] - 1
        cu = cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.to(torch.int64)

    gate_shape = {None: None, "head": (HV,), "token": (B, T, HV), "channel": (B, T, HV, DK)}[spec.decay_per]
    tensors = [_dense(q), _dense(k), _dense(v)]
    if gate_shape is not None:
        if g is None and variant == "gdn":  # FLA: no g, no decay
            g = torch.zeros(gate_shape, dtype=torch.float32, device=device)
        _check_tensor("g", g, gate_shape, device=on)
        tensors.append(_dense(g, torch.float32))
    if spec.delta:
        if beta is None:  # FLA's default
            beta = torch.ones(B, T, HV, dtype=torch.float32, device=device)
        _check_tensor("beta", beta, (B, T, HV), device=on)
        tensors.append(_dense(beta, torch.float32))

    state = (DV, DK) if state_v_first else (DK, DV)
    if ssm_state_indices is not None:
        if initial_state is None:
            _fail("ssm_state_indices needs initial_state: the state pool [slots, HV, K, V] updated in place")
        _check_tensor("initial_state", initial_state, (initial_state.shape[0], HV, *state), torch.float32, on)
        if not initial_state.is_contiguous():
            _fail("the state pool (initial_state) must be contiguous: it is updated in place")
        per_token = ssm_state_indices.dim() == 2
        _check_tensor("ssm_state_indices", ssm_state_indices,
                      (N, ssm_state_indices.shape[-1]) if per_token else (N,), device=on)
        if ssm_state_indices.dtype not in (torch.int32, torch.int64):
            _fail(f"ssm_state_indices must be int32 or int64, got {ssm_state_indices.dtype}")
        slot_of = _dense(ssm_state_indices, torch.int32)
        if per_token:  # a slot per token: the kernel reads where the last accepted token's state is
            if num_accepted_tokens is None:
                accepted = _ones(N, device)
            else:
                _check_tensor("num_accepted_tokens", num_accepted_tokens, (N,), device=on)
                if num_accepted_tokens.dtype not in (torch.int32, torch.int64):
                    _fail(f"num_accepted_tokens must be int32 or int64, got {num_accepted_tokens.dtype}")
                accepted = _dense(num_accepted_tokens, torch.int32)
            slot_of = (slot_of, accepted)
        elif num_accepted_tokens is not None:
            _fail("num_accepted_tokens needs ssm_state_indices of shape [N, tokens], a slot for each token "
                  "(speculative decoding); with one slot per sequence there is nothing to choose from")
        h0 = ht = initial_state
    else:
        if num_accepted_tokens is not None:
            _fail("num_accepted_tokens needs ssm_state_indices [N, tokens] and the state pool as initial_state")
        slot_of = _arange(N, 1, torch.int32, device)
        per_token = False
        if initial_state is None:
            h0 = ht = torch.zeros(N, HV, *state, dtype=torch.float32, device=device)
        else:
            _check_tensor("initial_state", initial_state, (N, HV, *state), device=on)
            h0 = _dense(initial_state, torch.float32)
            ht = torch.empty_like(h0)
    if out is None:
        out = torch.empty_like(v)
    else:
        _check_tensor("out", out, v.shape, v.dtype, on)

    scale = DK ** -0.5 if scale is None else float(scale)
    slots = slot_of if per_token else (slot_of,)
    return Call(shape=(DK, DV, _DTYPES[q.dtype], N, B * T, HV, "vk" if state_v_first else "kv"),
                args=(*tensors, scale, h0, ht, *slots, cu, out),
                result=(out, ht if output_final_state or ssm_state_indices is not None else None),
                token_states=per_token)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None, out=None):
    """Gated DeltaNet token by token, FLA's ``fused_recurrent_gated_delta_rule``, plus the pool form.

    Args:
        q, k (torch.Tensor): [B, T, H, K]. v (torch.Tensor): [B, T, HV, V], HV a multiple of H.
        g (torch.Tensor): log decay [B, T, HV]. Default: None (no decay).
        beta (torch.Tensor): write strength [B, T, HV]. Default: None (ones).
        scale (float): Default: K ** -0.5.
        initial_state (torch.Tensor): fp32 [N, HV, K, V] ([N, HV, V, K] with state_v_first), or with
            ssm_state_indices the pool [slots, HV, K, V] updated in place. Default: None.
        output_final_state (bool): Default: False (the pool form always returns the pool).
        use_qk_l2norm_in_kernel (bool): L2-normalise q and k over K first. Default: False.
        use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval: FLA's activations
            of g and beta (kda also lower_bound), applied in torch first (:func:`tuner.activations.activated`).
        state_v_first (bool): states stored [V, K] (vLLM's pool). Default: False.
        cu_seqlens (torch.Tensor): [N + 1] packed sequences, B = 1. Default: None.
        ssm_state_indices (torch.Tensor): int32/int64 [N], each sequence's slot; -1 skips it. Or [N, W]
            (speculative decoding): a slot for each token, the state after token t written to [n, t], -1
            keeps none. Default: None.
        num_accepted_tokens (torch.Tensor): int32/int64 [N], with a 2-D ssm_state_indices: sequence n starts
            from the slot of its token num_accepted_tokens[n] - 1 (1..W). Default: None (the first slot).
        out (torch.Tensor): preallocated o [B, T, HV, V]. Default: None.

    Returns:
        o [B, T, HV, V] and the final state (the pool itself in the pool form), or None.
    """
    refuse_stated(DecodeInputError, "the decode ops", gk=gk, gv=gv)
    check_activations("gdn", use_gate_in_kernel, A_log, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                      error=DecodeInputError)
    if use_gate_in_kernel and g is None:
        raise DecodeInputError("`g` (raw pre-activation) must be provided when `use_gate_in_kernel=True`.")
    g, beta = activated(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    q, k = l2normalised(q, k, use_qk_l2norm_in_kernel)
    return run("gdn", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, ssm_state_indices,
               state_v_first, out, num_accepted_tokens)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                        out=None):
    """Kimi Delta Attention token by token, FLA's ``fused_recurrent_kda``, plus the pool form.

    Args: as :func:`fused_recurrent_gated_delta_rule`, with g the per-channel log decay [B, T, HV, K].
    """
    check_activations("kda", use_gate_in_kernel, A_log, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                      lower_bound=lower_bound, error=DecodeInputError)
    g, beta = activated(g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                        lower_bound=lower_bound, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                        allow_neg_eigval=allow_neg_eigval)
    q, k = l2normalised(q, k, use_qk_l2norm_in_kernel)
    return run("kda", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, ssm_state_indices,
               state_v_first, out, num_accepted_tokens)


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None,
                               ssm_state_indices=None, out=None):
    """Scalar-gated linear attention token by token, FLA's ``fused_recurrent_simple_gla`` (g [B, T, H] per
    token, or g_gamma [H] per head, or neither), plus the pool form."""
    refuse_stated(DecodeInputError, "the decode ops", reverse=reverse)
    if g is not None and g_gamma is not None:
        raise DecodeInputError("give only one of g and g_gamma")
    variant, gate = ("simple_gla", g) if g is not None else ("decay", g_gamma) if g_gamma is not None else ("linear", None)
    return run(variant, q, k, v, gate, None, scale, initial_state, output_final_state, cu_seqlens,
               ssm_state_indices, state_v_first, out)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                        reverse=False, state_v_first=False, cu_seqlens=None, ssm_state_indices=None, out=None):
    """Gated linear attention (per-channel gate gk [B, T, H, K]) token by token, FLA's
    ``fused_recurrent_gla``, plus the pool form."""
    refuse_stated(DecodeInputError, "the decode ops", gv=gv, reverse=reverse)
    if gk is None:
        raise DecodeInputError("fused_recurrent_gla needs gk [B, T, H, K] (gv alone is not supported)")
    return run("gla", q, k, v, gk, None, scale, initial_state, output_final_state, cu_seqlens,
               ssm_state_indices, state_v_first, out)


@functools.lru_cache(maxsize=64)
def _retention_decay(heads: int, device: torch.device) -> torch.Tensor:
    return retention_log_decay(heads, device)


def fused_recurrent_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False,
                              state_v_first=False, cu_seqlens=None, ssm_state_indices=None, out=None):
    """Retention (RetNet's per-head decay log(1 - 2^(-5 - h))) token by token, FLA's
    ``fused_recurrent_retention``, plus the pool form."""
    refuse_stated(DecodeInputError, "the decode ops", reverse=reverse)
    return run("decay", q, k, v, _retention_decay(q.shape[2], q.device), None, scale, initial_state,
               output_final_state, cu_seqlens, ssm_state_indices, state_v_first, out)


def fused_recurrent_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False,
                                normalize=False, cu_seqlens=None, ssm_state_indices=None, out=None):
    """Linear attention token by token, FLA's ``fused_recurrent_linear_attn`` (without ``normalize``),
    plus the pool form."""
    refuse_stated(DecodeInputError, "the decode ops", reverse=reverse, normalize=normalize)
    return run("linear", q, k, v, None, None, scale, initial_state, output_final_state, cu_seqlens,
               ssm_state_indices, False, out)


__all__ = ["fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_simple_gla",
           "fused_recurrent_gla", "fused_recurrent_retention", "fused_recurrent_linear_attn", "run", "plan", "Call",
           "kernel_for",
           "DecodeInputError"]
