"""fp64 oracles for every variant: the recurrence, its chunkwise form and a mirror of the kernels'
control flow. All three share one calling convention, FLA's layout:

    q, k: [B, T, H, DK]    v: [B, T, H, DV]    scale multiplies q (default DK ** -0.5)
    g (log-space decay):   None for ``linear``; [H] for ``decay``; [B, T, H] for ``simple_gla`` and
                           ``gdn``; [B, T, H, DK] for ``gla`` and ``kda``
    beta:                  [B, T, H] for the delta variants (``gdn``, ``kda``), None otherwise
    initial_state:         [B, H, DK, DV] or None

and return ``(o [B, T, H, DV], final_state [B, H, DK, DV] or None)`` in float64 on the input's
device. The state is stored [DK, DV] (the kernels' layout, the transpose of the papers' S). One
step: decay first (``S <- exp(g_t) S``, per channel ``S <- Diag(exp(g_t)) S`` over the DK rows),
then ``S <- S + k_t v_t^T``, or for the delta rule ``u = beta_t (v_t - S^T k_t)``,
``S <- S + k_t u^T``; then ``o_t = S^T (scale q_t)``.

Chunk numerics (seeds 000 and 001): cumulative log decays restart every chunk; scalar decay weights
are always the ratio ``exp(gamma_i - gamma_j)`` with ``i >= j``, never ``gamma_i * (1 / gamma_j)``;
per-channel decays are split ``exp(gamma_c - ref) * exp(ref - gamma_j)`` with ``ref`` the log decay
at the start of the row's sub-chunk, so the row factor never exceeds 1 and the column factor grows
over at most one sub-chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import variants
from .errors import UserError
from .inputs import check_layout

__all__ = ["recurrent", "chunked", "kernel_mirror"]


@dataclass
class _Inputs:
    """Validated inputs in float64, heads before time: q, k [B, H, T, DK], v [B, H, T, DV],
    g [B, H, T] (scalar gates, zeros for ``linear``) or [B, H, T, DK] (per-channel),
    beta [B, H, T] or None, initial_state [B, H, DK, DV] or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor | None
    initial_state: torch.Tensor | None
    per_channel: bool
    delta: bool


def _prepare(variant, q, k, v, g, beta, scale, initial_state) -> _Inputs:
    spec = variants.get(variant)
    B, T, H, DK, DV = check_layout(variant, q, k, v, g, beta, initial_state)
    f64 = torch.float64
    scale = DK ** -0.5 if scale is None else float(scale)

    def heads_first(t):  # [B, T, H, ...] -> [B, H, T, ...] in float64
        return t.to(f64).transpose(1, 2)

    if spec.decay_per is None:
        gates = torch.zeros(B, H, T, dtype=f64, device=q.device)
    elif spec.decay_per == "head":
        gates = g.to(f64)[None, :, None].expand(B, H, T)
    else:
        gates = heads_first(g)
    return _Inputs(
        q=heads_first(q) * scale,
        k=heads_first(k),
        v=heads_first(v),
        g=gates,
        beta=heads_first(beta) if spec.delta else None,
        initial_state=None if initial_state is None else initial_state.to(f64),
        per_channel=spec.per_channel,
        delta=spec.delta,
    )


def _finish(o: torch.Tensor, state: torch.Tensor, output_final_state: bool):
    """[B, H, T, DV] -> [B, T, H, DV]; the state only when asked for."""
    return o.transpose(1, 2).contiguous(), (state if output_final_state else None)


def _initial(x: _Inputs) -> torch.Tensor:
    B, H, _, DK = x.k.shape
    DV = x.v.shape[-1]
    if x.initial_state is not None:
        return x.initial_state.clone()
    return torch.zeros(B, H, DK, DV, dtype=torch.float64, device=x.q.device)


def _shared_heads(q, k, v):
    """q and k repeated to v's head count for grouped value heads (value head j reads query/key head
    j // (HV / H), as FLA maps them; check_layout has checked the counts); unchanged when they match."""
    H, HV = q.shape[2], v.shape[2]
    return (q, k) if HV == H else (q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2))


def _sequence_bounds(cu_seqlens, q) -> list[tuple[int, int]]:
    """[(start, end)] of each packed sequence, after FLA's checks on cu_seqlens."""
    if q.shape[0] != 1:
        raise UserError(f"with cu_seqlens the batch must be 1 (sequences packed along T), got B={q.shape[0]}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise UserError(f"cu_seqlens must be a 1-D int32/int64 tensor [N + 1], got {cu_seqlens.dtype} "
                        f"{list(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise UserError(f"cu_seqlens must rise from 0 to T={q.shape[1]}, got {bounds}")
    return list(zip(bounds, bounds[1:]))


def _each_sequence(form, variant, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                   **options):
    """``form`` on the inputs with grouped heads shared out, once per packed sequence (from its own
    initial state) when cu_seqlens is given."""
    bounds = None if cu_seqlens is None else _sequence_bounds(cu_seqlens, q)
    check_layout(variant, q, k, v, g, beta, initial_state, sequences=None if bounds is None else len(bounds))
    q, k = _shared_heads(q, k, v)
    if bounds is None:
        return form(variant, q, k, v, g, beta, scale, initial_state, output_final_state, **options)
    outputs, states = [], []
    per_token = variants.get(variant).decay_per in ("token", "channel")
    for n, (start, end) in enumerate(bounds):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        if start == end:  # an empty sequence: no output, the state passes through
            DK, (H, DV) = q.shape[-1], v.shape[2:]
            state = torch.zeros(1, H, DK, DV, dtype=torch.float64, device=q.device) if h0 is None else h0.double()
            outputs.append(torch.empty(1, 0, H, DV, dtype=torch.float64, device=q.device))
            states.append(state)
            continue
        o, state = form(variant, q[:, start:end], k[:, start:end], v[:, start:end],
                        g[:, start:end] if per_token else g, None if beta is None else beta[:, start:end],
                        scale, h0, True, **options)
        outputs.append(o)
        states.append(state)
    return torch.cat(outputs, dim=1), (torch.cat(states) if output_final_state else None)


def recurrent(variant, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None):
    """The recurrence itself, token by token (the definition every other form is checked against).

    Args:
        variant (str): a name from ``tuner.variants.VARIANTS``.
        q (torch.Tensor): queries of shape [B, T, H, DK].
        k (torch.Tensor): keys of shape [B, T, H, DK].
        v (torch.Tensor): values of shape [B, T, H, DV].
        g (torch.Tensor): log-space decay: None, [H], [B, T, H] or [B, T, H, DK] as the variant's
            ``gate`` says. Default: None.
        beta (torch.Tensor): delta-rule write strengths of shape [B, T, H] (delta variants only).
            Default: None.
        scale (float): multiplies q. Default: DK ** -0.5.
        initial_state (torch.Tensor): state of shape [B, H, DK, DV] before the first token.
            Default: None (zeros).
        output_final_state (bool): also return the state after the last token. Default: False.
        cu_seqlens (torch.Tensor): packed sequences (FLA's meaning): with B = 1, sequence n is tokens
            cu_seqlens[n]:cu_seqlens[n + 1]; the state restarts at each, from initial_state[n]
            ([N, H, DK, DV]), and final_state is one per sequence. Default: None.

    Grouped value heads (gdn, kda): q and k may have fewer heads than v, beta, g and the state (HV, a
    multiple of H); value head j reads query/key head j // (HV / H).

    Returns:
        o (torch.Tensor): outputs of shape [B, T, HV, DV], float64.
        final_state (torch.Tensor): state of shape [B, HV, DK, DV] ([N, HV, DK, DV] packed), float64,
            or None.
    """
    return _each_sequence(_recurrent, variant, q, k, v, g, beta, scale, initial_state, output_final_state,
                          cu_seqlens)


def _recurrent(variant, q, k, v, g, beta, scale, initial_state, output_final_state):
    x = _prepare(variant, q, k, v, g, beta, scale, initial_state)
    S = _initial(x)
    o = torch.empty(*x.v.shape, dtype=torch.float64, device=x.v.device)
    for t in range(x.q.shape[2]):
        decay = x.g[:, :, t].exp()
        S = S * (decay[..., None] if x.per_channel else decay[..., None, None])
        k_t, v_t = x.k[:, :, t], x.v[:, :, t]
        if x.delta:
            v_t = x.beta[:, :, t, None] * (v_t - torch.einsum("bhkv,bhk->bhv", S, k_t))
        S = S + k_t[..., :, None] * v_t[..., None, :]
        o[:, :, t] = torch.einsum("bhkv,bhk->bhv", S, x.q[:, :, t])
    return _finish(o, S, output_final_state)


def _check_chunking(x: _Inputs, chunk_size, sub_chunk) -> int:
    """The sub-chunk length to use (``chunk_size`` when None); a UserError for bad values."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise UserError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if sub_chunk is None:
        return chunk_size
    if not x.per_channel:
        raise UserError(f"sub_chunk applies to the per-channel variants only, got sub_chunk={sub_chunk!r}")
    if not isinstance(sub_chunk, int) or sub_chunk < 1 or chunk_size % sub_chunk:
        raise UserError(f"sub_chunk must be a positive divisor of chunk_size={chunk_size}, got {sub_chunk!r}")
    return sub_chunk


def _chunks(t: torch.Tensor, C: int) -> torch.Tensor:
    """[B, H, T, ...] -> [B, H, NC, C, ...], the tail zero-padded. Zero padding is exact: a padded
    token has k = 0 and beta = 0 (writes nothing) and g = 0 (decays nothing)."""
    B, H, T = t.shape[:3]
    NC = -(-T // C)
    pad = torch.zeros(B, H, NC * C - T, *t.shape[3:], dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=2).reshape(B, H, NC, C, *t.shape[3:])


def _intra_chunk_scores(q, k, gam, per_channel: bool, sub_chunk: int):
    """Decay-weighted scores inside a chunk.

    Args:
        q, k (torch.Tensor): [..., C, DK].
        gam (torch.Tensor): cumulative log decay inside the chunk, [..., C] or [..., C, DK].
        per_channel (bool): whether ``gam`` has the DK axis.
        sub_chunk (int): per-channel only: length of the spans the exponent split restarts on.

    Returns:
        A_qk (torch.Tensor): [..., C, C], ``(q_c . k_j) * decay(j -> c)`` for ``j <= c``, else 0.
        A_kk (torch.Tensor): [..., C, C], ``(k_c . k_j) * decay(j -> c)`` for ``j < c``, else 0.
    """
    C = q.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if not per_channel:
        # Ratio form: exp(gamma_c - gamma_j) <= 1 wherever it is used; the masked entries would be
        # the large reciprocals, so they are never exponentiated.
        gamma = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        return (q @ k.transpose(-1, -2)) * gamma, (k @ k.transpose(-1, -2)) * gamma.tril(-1)
    NS = C // sub_chunk
    # ref[s]: log decay just before sub-chunk s starts (0 for the first).
    ref = torch.cat([torch.zeros_like(gam[..., :1, :]), gam[..., sub_chunk - 1:-1:sub_chunk, :]], dim=-2)
    row_factor = (gam - ref.repeat_interleave(sub_chunk, dim=-2)).exp()  # exp(gamma_c - ref) <= 1
    # Columns beyond the row's sub-chunk are masked anyway; zeroing them keeps exp() bounded.
    col_valid = torch.arange(C, device=q.device)[None, :] < (torch.arange(NS, device=q.device)[:, None] + 1) * sub_chunk
    col_exponent = (ref[..., :, None, :] - gam[..., None, :, :]).masked_fill(~col_valid[..., None], 0.0)
    col_factor = col_exponent.exp() * col_valid[..., None]  # [..., NS, C, DK]

    def scores(a):
        rows = (a * row_factor).reshape(*a.shape[:-2], NS, sub_chunk, a.shape[-1])
        return torch.einsum("...sad,...sjd->...saj", rows, k[..., None, :, :] * col_factor).reshape(*a.shape[:-2], C, C)

    return scores(q) * causal, scores(k) * causal.tril(-1)


def _boundary_weights(q, k, gam, per_channel: bool):
    """The chunk's three boundary decay positions, all exponents <= 0.

    Returns:
        q_read (torch.Tensor): ``q_c * exp(gamma_c)``, reads the state from the chunk's start.
        k_write (torch.Tensor): ``k_r * exp(gamma_C - gamma_r)``, writes aligned to the chunk's end.
        k_start (torch.Tensor): ``k_r * exp(gamma_r)``, the keys the delta rule tests against the
            incoming state.
        state_decay (torch.Tensor): ``exp(gamma_C)`` shaped to multiply a [..., DK, DV] state.
    """
    if per_channel:
        last = gam[..., -1:, :]  # [..., 1, DK]
        read, write, state_decay = gam.exp(), (last - gam).exp(), last.exp().transpose(-1, -2)
    else:  # scalar weights broadcast over DK columns; the state decay over the whole [DK, DV] state
        last = gam[..., -1:]
        read, write, state_decay = gam.exp()[..., None], (last - gam).exp()[..., None], last.exp()[..., None]
    return q * read, k * write, k * read, state_decay


def _ut_transform(A_kk, k_start, v, beta):
    """The delta rule's WY/UT transform of a chunk, batched over the leading dims.

    Args:
        A_kk (torch.Tensor): [..., C, C] strictly lower decay-weighted key scores.
        k_start (torch.Tensor): [..., C, DK] keys decayed from the chunk's start.
        v (torch.Tensor): [..., C, DV] values.
        beta (torch.Tensor): [..., C] write strengths.

    Returns:
        W (torch.Tensor): [..., C, DK] and U (torch.Tensor): [..., C, DV] with
        ``[W | U] = Diag(beta) (I + L)^{-1} [k_start | v]``, ``L[c, i] = beta_i A_kk[c, i]``.
    """
    L = beta[..., None, :] * A_kk  # strictly lower; the solve supplies the unit diagonal
    X = torch.linalg.solve_triangular(L, torch.cat([k_start, v], dim=-1), upper=False, unitriangular=True)
    X = beta[..., None] * X  # beta after the solve: the pairing that goes with L = beta_i A_kk
    return X[..., : k_start.shape[-1]], X[..., k_start.shape[-1]:]


def chunked(variant, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
            chunk_size=64, sub_chunk=None, cu_seqlens=None):
    """Chunkwise form, vectorised over batch, heads and chunks; a loop over chunks carries the state.

    Scalar decays use the ratio form at the three boundary positions (every exponent <= 0); the delta variants use the
    WY/UT transform ``X = (I + L)^{-1} [K exp(gamma) | V]``, ``L[c, i] = beta_i (k_c . k_i) decay``,
    then ``W, U = beta * X`` (beta applied after the solve, which pairs
    ``L_ij = beta_j M_ij`` with ``diag(beta)``, as the kernels do).

    Args:
        variant, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens: as in
            :func:`recurrent` (grouped value heads too); packed, chunks restart at every sequence.
        chunk_size (int): tokens per chunk, C. T need not be a multiple of it. Default: 64.
        sub_chunk (int): per-channel variants: sub-chunk length dividing C on which the exponent split
            restarts, bounding each split exponent. Default: None (C).

    Returns:
        o (torch.Tensor): outputs of shape [B, T, HV, DV], float64.
        final_state (torch.Tensor): as in :func:`recurrent`.
    """
    return _each_sequence(_chunked, variant, q, k, v, g, beta, scale, initial_state, output_final_state,
                          cu_seqlens, chunk_size=chunk_size, sub_chunk=sub_chunk)


def _chunked(variant, q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, sub_chunk):
    x = _prepare(variant, q, k, v, g, beta, scale, initial_state)
    sub = _check_chunking(x, chunk_size, sub_chunk)
    T = x.q.shape[2]
    qc, kc, vc, gc = (_chunks(t, chunk_size) for t in (x.q, x.k, x.v, x.g))
    gam = gc.cumsum(dim=3)
    A_qk, A_kk = _intra_chunk_scores(qc, kc, gam, x.per_channel, sub)
    q_read, k_write, k_start, state_decay = _boundary_weights(qc, kc, gam, x.per_channel)
    if x.delta:
        W, U = _ut_transform(A_kk, k_start, vc, _chunks(x.beta, chunk_size))
    S = _initial(x)
    o = torch.empty_like(vc)
    for n in range(qc.shape[2]):
        new_v = U[:, :, n] - W[:, :, n] @ S if x.delta else vc[:, :, n]
        o[:, :, n] = q_read[:, :, n] @ S + A_qk[:, :, n] @ new_v
        S = state_decay[:, :, n] * S + k_write[:, :, n].transpose(-1, -2) @ new_v
    return _finish(o.flatten(2, 3)[:, :, :T], S, output_final_state)


def kernel_mirror(variant, q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                  chunk_size=64, sub_chunk=None, block_dv=32, segments=1):
    """The fused kernels' control flow in fp64: a block per (DV slice, batch*head),
    a chunk loop carrying the [DK, block_dv] state, GEMM-ised scores, and for the delta variants one
    forward substitution over ``[K exp(gamma) | V]`` with beta applied after the solve.

    With ``segments`` > 1, the segmented split's (variants without the delta rule): the chunks are cut
    into that many segments of ceil(chunks / segments) chunks (trailing ones may be empty); a state pass
    gives every segment but the last its state from zero and its transition (the product of its chunks'
    state decays); the block of segment s starts from the initial state carried through segments
    0..s-1 (S = transition * S + local state) and walks its own chunks; the last one's state is the final
    state.

    Args:
        variant, q, k, v, g, beta, scale, initial_state, output_final_state: as in :func:`recurrent`.
        chunk_size (int): tokens per chunk, C. T need not be a multiple of it. Default: 64.
        sub_chunk (int): per-channel variants: sub-chunk length dividing C. Default: None (C).
        block_dv (int): DV columns per block; must divide DV. Default: 32.
        segments (int): sequence segments walked in parallel. Default: 1.

    Returns:
        o (torch.Tensor): outputs of shape [B, T, H, DV], float64.
        final_state (torch.Tensor): state of shape [B, H, DK, DV], float64, or None.
    """
    x = _prepare(variant, q, k, v, g, beta, scale, initial_state)
    sub = _check_chunking(x, chunk_size, sub_chunk)
    B, H, T, DK = x.q.shape
    DV = x.v.shape[-1]
    if not isinstance(block_dv, int) or block_dv < 1 or DV % block_dv:
        raise UserError(f"block_dv must be a positive divisor of DV={DV}, got {block_dv!r}")
    if not isinstance(segments, int) or segments < 1 or (segments > 1 and x.delta):
        raise UserError(f"segments must be a positive integer, and 1 for the delta rule (its segment transition "
                        f"is no diagonal), got {segments!r} for {variant}")
    qc, kc, vc, gc = (_chunks(t, chunk_size) for t in (x.q, x.k, x.v, x.g))
    bc = _chunks(x.beta, chunk_size) if x.delta else None
    S0 = _initial(x)
    o = torch.empty_like(vc)
    final = torch.empty_like(S0)
    per_segment = -(-qc.shape[2] // segments)
    chunks_of = [range(s * per_segment, min((s + 1) * per_segment, qc.shape[2])) for s in range(segments)]
    for bv in range(DV // block_dv):  # grid.x
        dv = slice(bv * block_dv, (bv + 1) * block_dv)
        for bh in range(B * H):  # grid.y
            b, h = divmod(bh, H)

            def step(S, n, write_o=True):
                """Chunk n from the state S entering it: o (where asked) and the state leaving it, with the
                chunk's state decay."""
                q_n, k_n, v_n = qc[b, h, n], kc[b, h, n], vc[b, h, n, :, dv]
                gam = gc[b, h, n].cumsum(dim=0)
                A_qk, A_kk = _intra_chunk_scores(q_n, k_n, gam, x.per_channel, sub)
                q_read, k_write, k_start, state_decay = _boundary_weights(q_n, k_n, gam, x.per_channel)
                if x.delta:
                    beta_n = bc[b, h, n]
                    L = beta_n[None, :] * A_kk
                    X = torch.cat([k_start, v_n], dim=-1)
                    for r in range(1, chunk_size):
                        X[r] = X[r] - L[r, :r] @ X[:r]
                    X = beta_n[:, None] * X  # beta after the solve
                    v_n = X[:, DK:] - X[:, :DK] @ S
                if write_o:
                    o[b, h, n, :, dv] = q_read @ S + A_qk @ v_n
                return state_decay * S + k_write.T @ v_n, state_decay

            # The state pass: every segment but the last from a zero state, and its transition.
            local, transition = [], []
            for chunks in chunks_of[:-1]:
                S, decay = torch.zeros_like(S0[b, h, :, dv]), torch.ones((), dtype=S0.dtype)
                for n in chunks:
                    S, state_decay = step(S, n, write_o=False)
                    decay = state_decay * decay
                local.append(S)
                transition.append(decay)
            for s, chunks in enumerate(chunks_of):  # a block per segment
                S = S0[b, h, :, dv]
                for j in range(s):
                    S = transition[j] * S + local[j]
                for n in chunks:  # the pipelined chunk loop
                    S = step(S, n)[0]
            final[b, h, :, dv] = S
    return _finish(o.flatten(2, 3)[:, :, :T], final, output_final_state)
