"""Drop-in forward kernels with FLA 0.6.0's names, argument order, layouts and defaults.

Each op looks up what runs the problem on this GPU (``tuner.best_config``): the tuner's kernel of
the best stored config (compiled once per config: TileLang keeps it on disk, this module in memory;
the kernels take the batch and sequence length at run time), or FLA's op of the same name, called
with the same arguments, where a stored FLA baseline beats the tuner's winner and FLA is installed
(``tuner.lookup``). ``backend=`` (else ``$LINATTN_BACKEND``) forces ``"tuner"`` or ``"fla"``; in
``"auto"`` an FLA that cannot be imported gives way to the tuner's kernel with a warning, and a
forced ``"fla"`` is an error then. FLA is imported only when it runs, and called as it is installed
(its own backend dispatch is the caller's to set with ``FLA_DISABLE_BACKEND_DISPATCH``). The choice
is memoised with the config, once per problem, device and backend: a later call reads the switch's
environment variable and one dictionary entry.

``chunk_gated_delta_rule`` and ``chunk_kda`` take packed sequences (``cu_seqlens``, B = 1) and grouped
value heads, as FLA does, and ``chunk_linear_attn``, ``chunk_retention``, ``chunk_simple_gla`` (through
their chunked split) and ``chunk_gla`` (its pre_seq split) packed sequences: the config is looked up by
the total tokens and the value heads, so a new mix of lengths needs no new compile (the kernels take the
lengths at run time), and no tensor's values are read on the host (no sync); the chunk index is built on
the device unless ``chunk_indices`` is given.

Inputs are checked the same whatever runs; forward only: these are inference kernels, an input that
requires grad is refused. FLA's in-kernel activations of the delta-rule ops (``use_gate_in_kernel`` with
``A_log``, ``dt_bias`` and kda's ``lower_bound``; ``use_beta_sigmoid_in_kernel`` with
``allow_neg_eigval``) are applied here in torch, in fp32, before the tuner's kernels run (FLA gets them
as given). The token-by-token ops (``tuner.decode``) always run the tuner's kernels.
"""
from __future__ import annotations

import functools
import warnings

import torch

from . import baseline
from .activations import activated, check_activations, l2normalised
from .errors import UserError, refuse_stated, stated
from .inputs import check_layout, retention_log_decay
from .lookup import best_config
from .problem import Problem
from .candidate import Candidate

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@functools.lru_cache(maxsize=64)
def _retention_decay(heads: int, device: torch.device) -> torch.Tensor:
    # Made once per head count and device: made per call, it put four small kernels before the op's
    # own (only read, so one tensor serves every call).
    return retention_log_decay(heads, device)


class InputError(UserError, ValueError):
    """Inputs of the wrong shape, dtype or device for an op."""


def _check(variant: str, q, k, v, g, beta, initial_state, cu_seqlens=None) -> Problem:
    sequences = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    B, T, H, DK, DV = check_layout(variant, q, k, v, g, beta, initial_state, error=InputError, sequences=sequences)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise InputError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if torch.is_grad_enabled() and t.requires_grad:
            raise InputError(f"{name} requires grad: tuner.ops are forward-only kernels")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise InputError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    # Value heads are the grid's parallel extent; packed sequences are one row of all their tokens.
    return Problem(variant, DK, DV, _DTYPES[q.dtype], B, T, v.shape[2])


def _check_sequences(q, initial_state, cu_seqlens, cu_seqlens_cpu=None, chunk_indices=None) -> None:
    """FLA's checks of packed sequences, on shapes, dtypes and devices (a device tensor's values would
    need a host sync): cu_seqlens_cpu's values are checked, being on the host already."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return  # check_layout says what q must be
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None or chunk_indices is not None:
            raise InputError("cu_seqlens_cpu and chunk_indices describe packed sequences: give cu_seqlens too")
        return
    if q.shape[0] != 1:
        raise InputError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`: "
                         "flatten variable-length inputs into one row")
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2
            or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise InputError(f"cu_seqlens must be a 1-D int32 or int64 tensor [N + 1], got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} {list(getattr(cu_seqlens, 'shape', []))}")
    if cu_seqlens.device != q.device:
        raise InputError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}; put it on q's device "
                         "(cu_seqlens_cpu is the host copy)")
    sequences = cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape[0] != sequences:
        raise InputError(f"The number of initial states is expected to be equal to the number of input sequences, "
                         f"i.e., {sequences} rather than {initial_state.shape[0]}")
    if cu_seqlens_cpu is not None:
        if (not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu"
                or cu_seqlens_cpu.shape != cu_seqlens.shape):
            raise InputError(f"cu_seqlens_cpu must be cu_seqlens on the host, a CPU tensor {list(cu_seqlens.shape)}")
        bounds = cu_seqlens_cpu.tolist()
        if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise InputError(f"cu_seqlens must rise from 0 to T={q.shape[1]} (never fall), got {bounds}")
    if chunk_indices is not None and (not isinstance(chunk_indices, torch.Tensor) or chunk_indices.dim() != 2
                                      or chunk_indices.shape[1] != 2 or chunk_indices.device != q.device):
        raise InputError(f"chunk_indices must be FLA's [chunks, 2] (sequence, chunk) index on q's device, got "
                         f"{list(getattr(chunk_indices, 'shape', []))}")


@functools.cache
def _compiled(variant: str, dk: int, dv: int, dtype: str, config: tuple):
    """The generated module and its compiled kernels for one config (one compile per process)."""
    from .compile import load_kernels

    return load_kernels(Candidate.from_config(Problem(variant, dk, dv, dtype), dict(config)))


@functools.cache
def _plan(problem: Problem, device: int, backend: str, packed: bool = False) -> tuple:
    """What runs ``problem`` on ``device``: (FLA's ``fla.ops``, None) where FLA does, else (None, the
    tuner's config as items); ``packed``: a config of kernels that take packed sequences and grouped
    value heads."""
    lookup = best_config(problem.variant, problem.dk, problem.dv, problem.dtype, problem.batch, problem.seqlen,
                         problem.heads, device=device, backend=backend, packed=packed)
    if lookup.backend == "fla":
        try:
            return baseline.fla_ops(), None
        except baseline.FlaUnavailable as e:
            if backend == "fla":
                raise
            warnings.warn(f"{e}: the tuner's kernel runs {problem.variant} in its place", stacklevel=4)
    return None, tuple(lookup.config.items())


def _route(variant, q, k, v, g=None, beta=None, initial_state=None, backend=None, cu_seqlens=None):
    """The problem of the inputs, FLA's ``fla.ops`` where FLA runs it (else None) and the tuner's config."""
    problem = _check(variant, q, k, v, g, beta, initial_state, cu_seqlens)
    # Packed sequences and grouped value heads need the kernels that take them (a config stating packed).
    # One packed sequence (cu_seqlens [0, T], a shape known on the host) is the dense row B = 1: it takes
    # the dense winner at 1 x T, which may split that one long sequence into segments.
    packed = (cu_seqlens is not None and cu_seqlens.shape[0] > 2) or problem.heads != q.shape[2]
    fla, config = _plan(problem, q.device.index or 0, baseline.backend_choice(backend), packed)
    return problem, fla, config


def _run(problem: Problem, config: tuple, q, k, v, g=None, beta=None, scale=None, initial_state=None,
         output_final_state=False, cu_seqlens=None, chunk_indices=None):
    """The tuner's kernel of ``config`` on the inputs."""
    if not q.is_cuda:
        raise InputError(f"q, k, v must be on a CUDA device, got {q.device}")
    module, kernels = _compiled(problem.variant, problem.dk, problem.dv, problem.dtype, config)
    sequences = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices) if dict(config).get("packed") else {}
    with torch.cuda.device(q.device):
        o, final_state = module.forward(kernels, q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                        **sequences)
    return o, (final_state if output_final_state else None)


def _delta_rule(problem, config, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm_qk,
                **sequences):
    q, k = l2normalised(q, k, l2norm_qk)  # done here in torch: the kernels take normalised q, k
    return _run(problem, config, q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, **sequences)


def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                      cu_seqlens=None, backend=None):
    """Linear attention, FLA's ``chunk_linear_attn``.

    Args:
        q (torch.Tensor): queries of shape [B, T, H, K].
        k (torch.Tensor): keys of shape [B, T, H, K].
        v (torch.Tensor): values of shape [B, T, H, V].
        scale (float): multiplies q. Default: K ** -0.5.
        initial_state (torch.Tensor | tuple): [B, H, K, V] fp32; with ``normalize`` a tuple
            ``(kv_state, z_state)``, z_state [B, 1, H, K]. Default: None.
        output_final_state (bool): return the final state. Default: False.
        normalize (bool): divide each output by ``<scale q_t, sum_{s<=t} k_s>``. Default: True.
        cu_seqlens (torch.Tensor): packed sequences, as for ``chunk_gated_delta_rule`` (one state per
            sequence, [N, H, K, V]); not with ``normalize``, whose running sum of k would cross the
            sequences' bounds. Default: None.
        backend (str): ``"auto"``, ``"tuner"`` or ``"fla"`` (module docstring). Default:
            ``$LINATTN_BACKEND``, else ``"auto"``.

    Returns:
        o [B, T, H, V] and the final state (a tuple ``(kv_state, z_state)`` with ``normalize``), or None.
    """
    if normalize and cu_seqlens is not None:
        raise InputError("chunk_linear_attn with cu_seqlens needs normalize=False: the normaliser's running sum "
                         "of k would run across the packed sequences' bounds")
    _check_sequences(q, initial_state, cu_seqlens)
    kv_init, z_init = initial_state if normalize and isinstance(initial_state, tuple) else (initial_state, None)
    problem, fla, config = _route("linear", q, k, v, initial_state=kv_init, backend=backend, cu_seqlens=cu_seqlens)
    if fla is not None:
        return fla.chunk_linear_attn(q, k, v, scale=scale, initial_state=initial_state,
                                     output_final_state=output_final_state, normalize=normalize, cu_seqlens=cu_seqlens)
    o, final_state = _run(problem, config, q, k, v, scale=scale, initial_state=kv_init,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if not normalize:
        return o, final_state
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_cum = k.float().cumsum(1)
    if z_init is not None:
        k_cum = k_cum + z_init.float()
    o = (o.float() / ((q.float() * scale * k_cum).sum(-1, keepdim=True) + 1e-10)).to(o.dtype)
    return o, ((final_state, k_cum[:, -1:].to(k.dtype)) if output_final_state else None)


def chunk_retention(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    backend=None):
    """Retention (constant per-head decay), FLA's ``chunk_retention``.

    Args:
        q, k (torch.Tensor): [B, T, H, K]. v (torch.Tensor): [B, T, H, V].
        scale (float): Default: K ** -0.5. initial_state (torch.Tensor): [N, H, K, V], N = B or the
            packed sequences. Default: None.
        output_final_state (bool): Default: False.
        cu_seqlens (torch.Tensor): packed sequences, as for ``chunk_gated_delta_rule``. Default: None.
        backend (str): ``"auto"``, ``"tuner"`` or ``"fla"`` (module docstring). Default:
            ``$LINATTN_BACKEND``, else ``"auto"``.

    Returns:
        o [B, T, H, V], final state [N, H, K, V] fp32 or None.
    """
    _check_sequences(q, initial_state, cu_seqlens)
    g = _retention_decay(q.shape[2], q.device)
    problem, fla, config = _route("decay", q, k, v, g, initial_state=initial_state, backend=backend,
                                  cu_seqlens=cu_seqlens)
    if fla is not None:
        return fla.chunk_retention(q, k, v, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return _run(problem, config, q, k, v, g=g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     state_v_first=False, cu_seqlens=None, backend=None):
    """Scalar-gated linear attention (Mamba2 / SSD), FLA's ``chunk_simple_gla``.

    Args:
        q, k (torch.Tensor): [B, T, H, K]. v (torch.Tensor): [B, T, H, V].
        g (torch.Tensor): per-token log gate [B, T, H]. Default: None.
        g_gamma (torch.Tensor): per-head constant log decay [H]; only one of g, g_gamma. Default: None.
        scale (float): Default: K ** -0.5. initial_state (torch.Tensor): [N, H, K, V], N = B or the
            packed sequences. Default: None.
        output_final_state (bool): Default: False.
        cu_seqlens (torch.Tensor): packed sequences, as for ``chunk_gated_delta_rule``. Default: None.
        backend (str): ``"auto"``, ``"tuner"`` or ``"fla"`` (module docstring). Default:
            ``$LINATTN_BACKEND``, else ``"auto"``.

    Returns:
        o [B, T, H, V], final state [N, H, K, V] fp32 or None.
    """
    refuse_stated(InputError, "tuner.ops", state_v_first=state_v_first)
    _check_sequences(q, initial_state, cu_seqlens)
    if g is not None and g_gamma is not None:
        raise InputError("give only one of g and g_gamma")
    variant, gate = ("simple_gla", g) if g is not None else ("decay", g_gamma) if g_gamma is not None else ("linear", None)
    problem, fla, config = _route(variant, q, k, v, gate, initial_state=initial_state, backend=backend,
                                  cu_seqlens=cu_seqlens)
    if fla is not None:
        return fla.chunk_simple_gla(q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return _run(problem, config, q, k, v, g=gate, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
              cu_seqlens=None, backend=None):
    """Gated linear attention with a per-channel gate, FLA's ``chunk_gla``.

    Args:
        q, k (torch.Tensor): [B, T, H, K]. v (torch.Tensor): [B, T, H, V].
        g (torch.Tensor): per-channel log gate [B, T, H, K].
        scale (float): Default: K ** -0.5. initial_state (torch.Tensor): [N, H, K, V], N = B or the
            packed sequences. Default: None.
        output_final_state (bool): Default: False.
        cu_seqlens (torch.Tensor): packed sequences, as for ``chunk_gated_delta_rule``. Default: None.
        backend (str): ``"auto"``, ``"tuner"`` or ``"fla"`` (module docstring). Default:
            ``$LINATTN_BACKEND``, else ``"auto"``.

    Returns:
        o [B, T, H, V], final state [N, H, K, V] fp32 or None.
    """
    refuse_stated(InputError, "tuner.ops", state_v_first=state_v_first)
    _check_sequences(q, initial_state, cu_seqlens)
    problem, fla, config = _route("gla", q, k, v, g, initial_state=initial_state, backend=backend,
                                  cu_seqlens=cu_seqlens)
    if fla is not None:
        return fla.chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return _run(problem, config, q, k, v, g=g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           use_gate_in_kernel=False, A_log=None, dt_bias=None, backend=None):
    """Gated DeltaNet, FLA's ``chunk_gated_delta_rule``.

    Args:
        q, k (torch.Tensor): [B, T, H, K]. v (torch.Tensor): [B, T, HV, V], HV a multiple of H (grouped
            value heads: value head j reads query/key head j // (HV / H)).
        g (torch.Tensor): per-token log decay [B, T, HV]. beta (torch.Tensor): write strength [B, T, HV].
        scale (float): Default: K ** -0.5.
        initial_state (torch.Tensor): [N, HV, K, V], N = B or the packed sequences. Default: None.
        output_final_state (bool): Default: False.
        use_qk_l2norm_in_kernel (bool): L2-normalise q and k over K first. Default: False.
        use_beta_sigmoid_in_kernel (bool): beta is logits: sigmoid(beta) is used. Default: False.
        allow_neg_eigval (bool): with use_beta_sigmoid_in_kernel, 2 * sigmoid(beta). Default: False.
        cu_seqlens (torch.Tensor): int32 or int64 [N + 1] on q's device: N sequences packed along T
            (B = 1), sequence n being tokens cu_seqlens[n]:cu_seqlens[n + 1]. Its values are not read on
            the host (no sync), so not checked there: bounds outside [0, T] are clamped to it. Default: None.
        cu_seqlens_cpu (torch.Tensor): the same bounds on the host; they are checked (rising from 0 to T).
            Default: None.
        chunk_indices (torch.Tensor): FLA's precomputed [chunks, 2] (sequence, chunk) index of the packed
            sequences, used for the kernels' chunk grid in place of the one built on the device.
            Default: None.
        use_gate_in_kernel (bool): g is the raw gate input: -exp(A_log) * softplus(g + dt_bias) is used
            (:func:`activated`). Default: False.
        A_log (torch.Tensor): [HV], needed with use_gate_in_kernel. dt_bias (torch.Tensor): [HV]. Default: None.
        backend (str): ``"auto"``, ``"tuner"`` or ``"fla"`` (module docstring). Default:
            ``$LINATTN_BACKEND``, else ``"auto"``.

    Returns:
        o [B, T, HV, V], final state [N, HV, K, V] fp32 or None.
    """
    refuse_stated(InputError, "tuner.ops", state_v_first=state_v_first)
    check_activations("gdn", use_gate_in_kernel, A_log, use_beta_sigmoid_in_kernel, allow_neg_eigval, error=InputError)
    _check_sequences(q, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices)
    problem, fla, config = _route("gdn", q, k, v, g, beta, initial_state, backend, cu_seqlens)
    activations = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                       use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    if fla is not None:
        return fla.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                          cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                                          **stated(activations))
    g, beta = activated(g, beta, **activations)
    return _delta_rule(problem, config, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
              safe_gate=False, lower_bound=None, A_log=None, dt_bias=None, backend=None):
    """Kimi Delta Attention, FLA's ``chunk_kda``.

    Args:
        q, k (torch.Tensor): [B, T, H, K]. v (torch.Tensor): [B, T, HV, V], HV a multiple of H (grouped
            value heads: value head j reads query/key head j // (HV / H)).
        g (torch.Tensor): per-channel log decay [B, T, HV, K]. beta (torch.Tensor): [B, T, HV].
        scale (float): Default: K ** -0.5.
        initial_state (torch.Tensor): [N, HV, K, V], N = B or the packed sequences. Default: None.
        output_final_state (bool): Default: False.
        use_qk_l2norm_in_kernel (bool): L2-normalise q and k over K first. Default: False.
        use_gate_in_kernel (bool): g is the raw gate input: -exp(A_log) * softplus(g + dt_bias), or with
            lower_bound, lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) is used (:func:`activated`).
            Default: False.
        use_beta_sigmoid_in_kernel, allow_neg_eigval (bool): as for ``chunk_gated_delta_rule``. Default: False.
        cu_seqlens, cu_seqlens_cpu (torch.Tensor): packed sequences, as for ``chunk_gated_delta_rule``.
            Default: None.
        chunk_indices (torch.Tensor): FLA's [chunks, 2] (sequence, chunk) index of the packed sequences,
            as for ``chunk_gated_delta_rule``. FLA 0.6.0's ``chunk_kda`` has no such parameter (it builds
            its own), so where FLA runs the call it is not passed on. Default: None.
        safe_gate (bool): FLA's bounded-gate kernels; here only its checks of lower_bound. Default: False.
        lower_bound (float): the gate's lower bound with use_gate_in_kernel. Default: None.
        A_log (torch.Tensor): [HV], needed with use_gate_in_kernel unless lower_bound is given.
            dt_bias (torch.Tensor): [HV * K]. Default: None.
        backend (str): ``"auto"``, ``"tuner"`` or ``"fla"`` (module docstring). Default:
            ``$LINATTN_BACKEND``, else ``"auto"``.

    Returns:
        o [B, T, HV, V], final state [N, HV, K, V] fp32 or None.
    """
    refuse_stated(InputError, "tuner.ops", state_v_first=state_v_first)
    check_activations("kda", use_gate_in_kernel, A_log, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                      lower_bound, error=InputError)
    _check_sequences(q, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices)
    problem, fla, config = _route("kda", q, k, v, g, beta, initial_state, backend, cu_seqlens)
    activations = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                       use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    if fla is not None:
        return fla.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                             **stated(dict(activations, safe_gate=safe_gate)))
    g, beta = activated(g, beta, **activations)
    return _delta_rule(problem, config, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)


__all__ = ["chunk_linear_attn", "chunk_retention", "chunk_simple_gla", "chunk_gla", "chunk_gated_delta_rule",
           "chunk_kda", "activated", "retention_log_decay", "InputError"]


# The token-by-token (decode) ops, FLA's fused_recurrent_* with the state-pool form (tuner/decode.py).
from .decode import (DecodeInputError, fused_recurrent_gated_delta_rule, fused_recurrent_gla,  # noqa: E402
                     fused_recurrent_kda, fused_recurrent_linear_attn, fused_recurrent_retention,
                     fused_recurrent_simple_gla)

__all__ += ["fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "fused_recurrent_simple_gla",
            "fused_recurrent_gla", "fused_recurrent_retention", "fused_recurrent_linear_attn", "DecodeInputError"]
