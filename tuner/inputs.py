"""Seeded inputs in FLA's layout for the correctness gate, in regimes that hit the numerics traps
of chunked linear attention (underflow, overflow, masked tails, initial states).

Every regime draws q, k, v from a standard normal (q and k L2-normalised along the head dim for the
delta variants, as FLA's users do), beta uniform in (0, 1) for the delta variants, and a gate that
depends on the regime (for ``decay`` the gate is the per-head constant, for ``simple_gla``/``gdn``
a per-token scalar, for ``gla``/``kda`` per token and channel). ``initial_state`` is None except in
the ``initial_state`` regime. Regimes that say nothing for a variant are refused: the ``alpha*``
regimes for ``linear`` (no decay), the ``channel_*`` regimes for the scalar-gated variants.

The ``packed`` regime packs sequences of several lengths along T (B = 1, ``cu_seqlens``), each from its
own initial state, with value heads grouped two to a query/key head (gdn, kda, an even head count): the
regime of kernels that take packed sequences (a config stating ``packed``).
"""
from __future__ import annotations

import math

import torch

from . import variants
from .errors import UserError
from .problem import Problem

__all__ = ["REGIMES", "check_layout", "make_inputs", "regimes_for", "timing_inputs"]

REGIMES: dict[str, str] = {
    "default": "decays drawn uniformly in [0.9, 0.999] (per head, token or channel)",
    "alpha0.5": "strong decay: alpha around 0.5 (log alpha jittered by +-20%), where factorised weights overflow",
    "alpha0.9": "alpha around 0.9 (log alpha jittered by +-20%)",
    "alpha0.99": "decay near 1: alpha around 0.99 (log alpha jittered by +-20%), where off-by-one exponents hide",
    "channel_lb0.9": "per-channel gates with the 0.9 lower bound: g uniform in [log 0.9, 0]",
    "channel_free": "per-channel gates without a bound: g = logsigmoid(N(0, 1)), as unconstrained models produce",
    "initial_state": "the default decays plus a standard-normal initial state",
    "packed": "the default decays on sequences of lengths 1, 15, 64, 65, 200, then a random mix, packed along T "
              "(B = 1, cu_seqlens int64 for an even seed, int32 for an odd one), each from a standard-normal "
              "initial state; value heads two to a query/key head where the variant groups them",
}

# The lengths a packed input starts with: one token, shorter than a chunk, a chunk, one past it, several
# chunks and a tail (of every chunk size). Random lengths up to RANDOM_LENGTH_MAX follow.
PACKED_LENGTHS = (1, 15, 64, 65, 200)
RANDOM_LENGTH_MAX = 300

_ALPHA_REGIMES = {"alpha0.5": 0.5, "alpha0.9": 0.9, "alpha0.99": 0.99}


def regimes_for(variant: str, packed: bool = False) -> list[str]:
    """The regimes the correctness gate runs for ``variant``: with ``packed`` (kernels that take packed
    sequences) the ``packed`` regime too.

    Per-channel variants are gated with and without the 0.9 lower bound: unbounded gates
    underflow exp(gamma) in fp16 and overflow exp(-gamma), which a template must
    handle (the per-channel templates stage the split exponents in fp32 per sub-chunk) or refuse.

    Args:
        variant (str): a name from ``tuner.variants.VARIANTS``.

    Returns:
        list[str]: regime names, keys of :data:`REGIMES`.
    """
    spec = variants.get(variant)
    names = ["default", "initial_state"]
    if spec.decay_per is not None:
        names += ["alpha0.9", "alpha0.99", "alpha0.5"]
    if spec.per_channel:
        names += ["channel_lb0.9", "channel_free"]
    return names + ["packed"] if packed else names


def _log_decay(regime: str, shape, gen: torch.Generator) -> torch.Tensor:
    """The regime's log decay of the given shape, float64 on the CPU."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    if regime in _ALPHA_REGIMES:
        return math.log(_ALPHA_REGIMES[regime]) * (0.8 + 0.4 * u)
    if regime == "channel_lb0.9":
        return math.log(0.9) * u
    if regime == "channel_free":
        return torch.nn.functional.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64))
    return torch.log(0.9 + 0.099 * u)


def make_inputs(problem: Problem, regime: str = "default", seed: int = 0, device="cpu",
                batch: int | None = None, seqlen: int | None = None, heads: int | None = None) -> dict:
    """Deterministic inputs for ``problem`` in one regime, the same on every device.

    Args:
        problem (Problem): variant, head dims, dtype and the default shape.
        regime (str): a key of :data:`REGIMES`. Default: "default". ``packed``: ``seqlen`` is the total
            of the packed sequences' lengths (:func:`packed_lengths`), ``heads`` the value heads, and
            ``batch`` is not used (B = 1).
        seed (int): seeds a CPU ``torch.Generator``; the tensors are moved to ``device`` afterwards.
            Default: 0.
        device (str or torch.device): where the tensors end up. Default: "cpu".
        batch, seqlen, heads (int): override the problem's B, T, H. Default: None.

    Returns:
        dict: ``q, k`` [B, T, H, DK] and ``v`` [B, T, H, DV] in ``problem.torch_dtype``; ``g`` (the
        variant's gate shape, or None) and ``beta`` [B, T, H] (delta variants, else None) and
        ``initial_state`` [B, H, DK, DV] (or None) in float32; ``scale`` = DK ** -0.5. ``packed``: v, g,
        beta with HV heads, q and k with H (HV / 2 where grouped), ``initial_state`` [N, HV, DK, DV] and
        ``cu_seqlens`` [N + 1] too.
    """
    spec = problem.spec
    if regime not in REGIMES:
        raise UserError(f"unknown regime {regime!r}; accepted: {', '.join(REGIMES)}")
    if regime in _ALPHA_REGIMES and spec.decay_per is None:
        raise UserError(f"regime {regime!r} sets a decay, but variant {spec.name!r} has none")
    if regime.startswith("channel_") and not spec.per_channel:
        has = f"a decay per {spec.decay_per}" if spec.decay_per else "no decay"
        raise UserError(f"regime {regime!r} needs per-channel gates; variant {spec.name!r} has {has}")
    B = problem.batch if batch is None else batch
    T = problem.seqlen if seqlen is None else seqlen
    H = problem.heads if heads is None else heads
    for label, n in (("batch", B), ("seqlen", T), ("heads", H)):
        if not isinstance(n, int) or n < 1:
            raise UserError(f"{label} must be a positive integer, got {n!r}")
    DK, DV = problem.dk, problem.dv

    gen = torch.Generator().manual_seed(seed)
    packed = regime == "packed"
    HV = H
    if packed:
        B = 1
        lengths = packed_lengths(T, gen)
        if spec.name in variants.GROUPED_HEADS and H % 2 == 0:
            H = HV // 2
    q = torch.randn(B, T, H, DK, generator=gen)
    k = torch.randn(B, T, H, DK, generator=gen)
    v = torch.randn(B, T, HV, DV, generator=gen)
    if spec.delta:
        q, k = (torch.nn.functional.normalize(t, dim=-1) for t in (q, k))
    g_shape = spec.g_shape(B, T, HV, DK)
    g = None if g_shape is None else _log_decay(regime, g_shape, gen).float()
    # 1 - U[0, 1) lies in (0, 1]; clamp keeps it off 1 so beta is strictly inside (0, 1).
    beta = (1 - torch.rand(B, T, HV, generator=gen)).clamp(max=1 - 1e-6) if spec.delta else None
    states = len(lengths) if packed else B
    initial_state = torch.randn(states, HV, DK, DV, generator=gen) if regime in ("initial_state", "packed") else None

    def place(t, dtype):
        return None if t is None else t.to(device=device, dtype=dtype)

    dtype = problem.torch_dtype
    out = dict(q=place(q, dtype), k=place(k, dtype), v=place(v, dtype), g=place(g, torch.float32),
               beta=place(beta, torch.float32), initial_state=place(initial_state, torch.float32),
               scale=DK ** -0.5)
    if packed:
        bounds = torch.tensor([0, *lengths]).cumsum(0)
        out["cu_seqlens"] = place(bounds, torch.int32 if seed % 2 else torch.int64)
    return out


def timing_inputs(problem: Problem, device) -> dict:
    """The inputs a kernel of ``problem`` is timed on: the ``default`` regime at its shape, or for a
    packed problem the ``packed`` regime's mix of lengths (``seqlen`` tokens in all, ``heads`` value
    heads), both at seed 0, so every timing of the problem sees the same inputs."""
    return make_inputs(problem, "packed" if problem.packed else "default", 0, device)


def packed_lengths(total: int, gen: torch.Generator) -> list[int]:
    """Sequence lengths summing to ``total``: :data:`PACKED_LENGTHS`, then lengths drawn uniformly from
    1 to :data:`RANDOM_LENGTH_MAX` with ``gen``; the last one cut to fit."""
    lengths, left = [], total
    for n in PACKED_LENGTHS:
        if left == 0:
            return lengths
        lengths.append(min(n, left))
        left -= lengths[-1]
    while left:
        lengths.append(min(int(torch.randint(1, RANDOM_LENGTH_MAX + 1, (1,), generator=gen)), left))
        left -= lengths[-1]
    return lengths


def _shape(t) -> str:
    return "None" if t is None else str(list(t.shape))


def check_layout(variant: str, q, k, v, g=None, beta=None, initial_state=None, error=UserError, sequences=None):
    """Check that inputs follow FLA's layout for ``variant``; raise ``error`` saying what was
    expected and what was given. v, g, beta and initial_state have HV heads, a multiple of q's and k's
    H for the variants of ``variants.GROUPED_HEADS`` (grouped value heads), else H; initial_state
    holds ``sequences`` states (packed sequences), else B.

    Returns:
        (B, T, H, DK, DV)
    """
    spec = variants.get(variant)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise error(f"{name} must be a torch.Tensor [B, T, H, D], got {type(t).__name__}")
        if t.dim() != 4:
            raise error(f"{name} must be a 4-D tensor [B, T, H, D], got shape {_shape(t)}")
    B, T, H, DK = q.shape
    HV, DV = v.shape[2:]
    if k.shape != q.shape:
        raise error(f"k must have the shape of q {_shape(q)}, got {_shape(k)}")
    if v.shape[:2] != q.shape[:2]:
        raise error(f"v must be [B, T, HV, DV] = [{B}, {T}, HV, DV], got {_shape(v)}")
    if HV != H and variant not in variants.GROUPED_HEADS:
        raise error(f"v must be [B, T, H, DV] = [{B}, {T}, {H}, DV], got {_shape(v)}: grouped value heads are "
                    f"for {', '.join(variants.GROUPED_HEADS)}")
    if HV % H:
        raise error(f"grouped value heads: v's {HV} heads must be a multiple of q's and k's {H} (HV % H = {HV % H})")
    expected_g = spec.g_shape(B, T, HV, DK)
    if expected_g is None and g is not None:
        raise error(f"variant {variant!r} takes no g (no decay), got g of shape {_shape(g)}")
    if expected_g is not None and (g is None or tuple(g.shape) != expected_g):
        raise error(f"variant {variant!r} needs g of shape {list(expected_g)}, got {_shape(g)}")
    if spec.delta and (beta is None or tuple(beta.shape) != (B, T, HV)):
        raise error(f"variant {variant!r} needs beta of shape {[B, T, HV]}, got {_shape(beta)}")
    if not spec.delta and beta is not None:
        raise error(f"variant {variant!r} takes no beta (not a delta rule), got beta of shape {_shape(beta)}")
    states = B if sequences is None else sequences
    if initial_state is not None and tuple(initial_state.shape) != (states, HV, DK, DV):
        which = "[B, H, DK, DV]" if sequences is None else "one state per sequence, [N, HV, DK, DV]"
        raise error(f"initial_state must be {which} = {[states, HV, DK, DV]}, got {_shape(initial_state)}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and t.device != q.device:
            raise error(f"{name} is on {t.device} but q is on {q.device}; put all inputs on one device")
    return B, T, H, DK, DV


def retention_log_decay(heads: int, device=None) -> torch.Tensor:
    """RetNet's per-head log decay, as FLA's ``chunk_retention`` uses: log(1 - 2^(-5 - h))."""
    return (1 - 2.0 ** (-5.0 - torch.arange(heads, dtype=torch.float, device=device))).log()
