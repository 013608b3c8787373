"""A second, independently written implementation of the recurrences, to check tuner.reference
against: a different layout (the papers' state S in [DV, DK], as FLA's naive.py files keep it) and
different algebra (the matrix-parallel "attention" form for the additive variants, the Householder
product for the delta rule). It reads the gate's kind from g's shape and knows no variant names.
"""
from __future__ import annotations

import torch


def _per_channel_log_decay(g, B, T, H, DK) -> torch.Tensor:
    """Any accepted g (None, [H], [B, T, H], [B, T, H, DK]) as [B, T, H, DK] float64."""
    if g is None:
        return torch.zeros(B, T, H, DK, dtype=torch.float64)
    g = g.double()
    if g.dim() == 1:
        return g[None, None, :, None].expand(B, T, H, DK)
    if g.dim() == 3:
        return g[..., None].expand(B, T, H, DK)
    return g


def attention_form(q, k, v, g=None, scale=None, initial_state=None):
    """``o_t = sum_{i <= t} (q_t * exp(G_t - G_i)) . k_i v_i + (q_t * exp(G_t))^T S_0`` with ``G`` the
    cumulative log decay over the whole sequence: the parallel form of the additive recurrences.

    Args:
        q, k (torch.Tensor): [B, T, H, DK]. v (torch.Tensor): [B, T, H, DV].
        g (torch.Tensor): None, [H], [B, T, H] or [B, T, H, DK]. Default: None.
        scale (float): multiplies q. Default: DK ** -0.5.
        initial_state (torch.Tensor): [B, H, DK, DV]. Default: None.

    Returns:
        o (torch.Tensor): [B, T, H, DV] float64. final_state (torch.Tensor): [B, H, DK, DV] float64.
    """
    B, T, H, DK = q.shape
    DV = v.shape[-1]
    q = q.double() * (DK ** -0.5 if scale is None else scale)
    k, v = k.double(), v.double()
    G = _per_channel_log_decay(g, B, T, H, DK).cumsum(dim=1)
    S0 = torch.zeros(B, H, DK, DV, dtype=torch.float64) if initial_state is None else initial_state.double()
    later_or_same = torch.ones(T, T, dtype=torch.bool).tril()
    # Gamma[b, t, i, h, d] = exp(G_t - G_i) for i <= t: the decay-aware causal mask, per channel.
    log_gamma = G[:, :, None] - G[:, None, :]
    gamma = torch.where(later_or_same[None, :, :, None, None], log_gamma, torch.full_like(log_gamma, -torch.inf)).exp()
    scores = torch.einsum("bthd,btihd,bihd->bhti", q, gamma, k)
    o = torch.einsum("bhti,bihv->bthv", scores, v) + torch.einsum("bthd,bhdv->bthv", q * G.exp(), S0)
    to_end = (G[:, -1:] - G).exp()
    final = G[:, -1].exp()[..., None] * S0 + torch.einsum("bthd,bthv->bhdv", k * to_end, v)
    return o, final


def householder_form(q, k, v, g=None, beta=None, scale=None, initial_state=None):
    """The gated delta rule as written in the papers, state ``S`` in [DV, DK]:
    ``S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``, ``o_t = S_t q_t``.
    With g None it is DeltaNet.

    Args:
        q, k (torch.Tensor): [B, T, H, DK]. v (torch.Tensor): [B, T, H, DV].
        g (torch.Tensor): None, [B, T, H] or [B, T, H, DK]. Default: None.
        beta (torch.Tensor): [B, T, H].
        scale (float): multiplies q. Default: DK ** -0.5.
        initial_state (torch.Tensor): [B, H, DK, DV] (the kernels' layout). Default: None.

    Returns:
        o (torch.Tensor): [B, T, H, DV] float64. final_state (torch.Tensor): [B, H, DK, DV] float64.
    """
    B, T, H, DK = q.shape
    DV = v.shape[-1]
    scale = DK ** -0.5 if scale is None else scale
    a = _per_channel_log_decay(g, B, T, H, DK).exp()
    eye = torch.eye(DK, dtype=torch.float64)
    o = torch.zeros(B, T, H, DV, dtype=torch.float64)
    final = torch.zeros(B, H, DK, DV, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(DV, DK, dtype=torch.float64) if initial_state is None else initial_state[b, h].double().T
            for t in range(T):
                k_t, v_t, beta_t = k[b, t, h].double(), v[b, t, h].double(), float(beta[b, t, h])
                S = S @ torch.diag(a[b, t, h]) @ (eye - beta_t * torch.outer(k_t, k_t)) + beta_t * torch.outer(v_t, k_t)
                o[b, t, h] = S @ (q[b, t, h].double() * scale)
            final[b, h] = S.T
    return o, final
