"""FLA's in-kernel activations of the delta-rule ops' inputs, done in torch before the tuner's kernels
run: q and k normalised, the log decay from the raw gate input and the write strength from logits
(FLA 0.6.0's ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel`` and
their parameters), with FLA's errors."""
from __future__ import annotations

import torch


def check_activations(variant, use_gate_in_kernel, A_log, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                      safe_gate=False, lower_bound=None, error=ValueError):
    """FLA 0.6.0's errors, as ``error``, for the activation arguments of its gdn (``variant`` "gdn") and kda ops."""
    if use_gate_in_kernel and A_log is None and not (variant == "kda" and lower_bound is not None):
        raise error("`A_log` must be provided when `use_gate_in_kernel=True`"
                    + (" and `lower_bound` is not set." if variant == "kda" else "."))
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise error("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not -5 <= lower_bound < 0:
            raise error(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise error("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")


def l2normalised(q, k, on: bool):
    """FLA's use_qk_l2norm_in_kernel: q and k normalised over K (in fp32, back in their dtype) where ``on``."""
    if not on:
        return q, k
    return tuple(torch.nn.functional.normalize(x.float(), dim=-1).to(x.dtype) for x in (q, k))


def activated(g, beta, *, use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """The log decay and the write strength FLA's kernels compute from raw ``g`` and ``beta``, in fp32.

    With ``use_gate_in_kernel``, g [..., HV] (gdn) or [..., HV, K] (kda) is the raw gate input:
    ``-exp(A_log) * softplus(g + dt_bias)`` (A_log [HV], dt_bias [HV] or [HV * K]), or where
    ``lower_bound`` is given (kda) ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, A_log then
    optional. With ``use_beta_sigmoid_in_kernel`` beta is logits: ``sigmoid(beta)``, twice that with
    ``allow_neg_eigval``. Inputs not activated are returned as they are."""
    if use_gate_in_kernel:
        HV = g.shape[2]
        per_channel = g.dim() == 4
        shape = (HV, -1) if per_channel else (HV,)
        x = g.float() + (0 if dt_bias is None else dt_bias.float().view(shape))
        a = None if A_log is None else A_log.float().exp().view((HV, 1) if per_channel else (HV,))
        if lower_bound is not None:
            g = lower_bound * torch.sigmoid(x if a is None else a * x)
        else:
            g = -a * torch.nn.functional.softplus(x)
    if use_beta_sigmoid_in_kernel and beta is not None:
        beta = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    return g, beta
