"""Timing of a kernel call and the memory-bound floor it is judged against.

Method (/work/.library/device/METHOD.md): device events around each call, warm-up first, a 256 MB
write before every repetition so no input is served from the 50 MB L2 of an H200, the median and
the 10th/90th percentiles of the repetitions.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from .problem import Problem

__all__ = ["Timing", "time_forward", "time_side_by_side", "time_module", "memory_floor_ms", "floor_bytes", "H200_COPY_GBPS"]

# Device-to-device copy rate measured on the H200 of this project (bytes read + bytes written
# per second): 4.3 TB/s for large device-to-device copies. The datasheet's 4.8 TB/s is not
# reached by any copy.
H200_COPY_GBPS = 4300.0
# Larger than the L2 of every Hopper part (50 MB on H100/H200).
L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call over ``reps`` repetitions. ``device``: "cuda" (events) or "cpu" (host clock)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    device: str = "cuda"

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the run's relative noise."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms > 0 else 0.0

    def as_dict(self) -> dict:
        return asdict(self)


# Smallest relative change of the median that counts, however tight the bands are.
MIN_SHIFT = 0.03


def change_beyond_noise(m, ref) -> str:
    """The noise rule: ``m`` against ``ref`` (each with ``median_ms``, ``p10_ms``, ``p90_ms``) is
    ``"slower"`` when its band lies wholly above ``ref``'s (``p10 > ref p90``) and its median is more
    than :data:`MIN_SHIFT` above, ``"faster"`` in the mirror case, else ``"within"`` the noise."""
    shift = m.median_ms / ref.median_ms - 1
    if m.p10_ms > ref.p90_ms and shift > MIN_SHIFT:
        return "slower"
    if m.p90_ms < ref.p10_ms and shift < -MIN_SHIFT:
        return "faster"
    return "within"


def time_forward(fn: Callable[[], object], *, warmup_ms: float = 25.0, rep: int = 100, flush_l2: bool = True,
                 device: str | torch.device | None = None) -> Timing:
    """Time ``fn()`` (one kernel call, or the host glue that launches several).

    Args:
        fn (Callable): called with no arguments; its inputs are bound already.
        warmup_ms (float): calls made (and discarded) until this much time has passed, at least one.
            Default: 25.
        rep (int): timed repetitions. Default: 100.
        flush_l2 (bool): write a 256 MB buffer before each repetition, outside the timed region.
            Default: True.
        device: CUDA device to time on. Default: None (the current CUDA device). Without CUDA the
            host clock times ``fn`` (no L2 flush): for CPU-only runs and tests, not for reports.

    Returns:
        Timing: median, 10th and 90th percentile in milliseconds.
    """
    return time_side_by_side({"fn": fn}, warmup_ms=warmup_ms, rep=rep, rounds=1, flush_l2=flush_l2,
                             device=device)["fn"]


def time_side_by_side(calls: dict[str, Callable[[], object]], *, warmup_ms: float = 25.0, rep: int = 100,
                      rounds: int = 5, flush_l2: bool = True,
                      device: str | torch.device | None = None) -> dict[str, Timing]:
    """Time several calls that are to be compared, as :func:`time_forward` times one, in ``rounds``
    interleaved rounds of ``rep / rounds`` repetitions each (each round in another order), so that a
    drift of the machine (clocks, the host's load) during the run falls on all of them alike.

    Returns:
        dict: each name of ``calls`` to its :class:`Timing` over all its ``rep`` repetitions.
    """
    if rep < 1 or rounds < 1 or rep % rounds:
        raise ValueError(f"rep must be a positive multiple of rounds, got rep={rep}, rounds={rounds}")
    names = list(calls)
    on_gpu = torch.cuda.is_available()
    times: dict[str, list[float]] = {name: [] for name in names}
    with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
        flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if on_gpu and flush_l2 else None
        for name in names:
            _warm_up(calls[name], warmup_ms, on_gpu)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name] += (_device_times if on_gpu else _host_times)(calls[name], rep // rounds, flush)
    return {name: _timing(times[name], "cuda" if on_gpu else "cpu") for name in names}


def _warm_up(fn, warmup_ms: float, on_gpu: bool) -> None:
    start = time.perf_counter()
    while True:
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        if (time.perf_counter() - start) * 1e3 >= warmup_ms:
            return


def _device_times(fn, rep: int, flush) -> list[float]:
    begins = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for b, e in zip(begins, ends):
        if flush is not None:
            flush.zero_()
        b.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [b.elapsed_time(e) for b, e in zip(begins, ends)]


def _host_times(fn, rep: int, flush) -> list[float]:
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _timing(times_ms: list[float], device: str) -> Timing:
    qs = statistics.quantiles(times_ms, n=10, method="inclusive") if len(times_ms) > 1 else times_ms * 9
    return Timing(statistics.median(times_ms), qs[0], qs[-1], len(times_ms), device)


def floor_bytes(problem: Problem, *, batch: int | None = None, seqlen: int | None = None, heads: int | None = None,
                initial_state: bool = False, final_state: bool = True) -> int:
    """The fewest bytes a forward pass must move through device memory.

    q, k [B, T, H, DK] and v [B, T, H, DV] read and o [B, T, H, DV] written in the input dtype;
    the gate read in fp32 ([H], [B, T, H] or [B, T, H, DK] as the variant's ``gate`` says) and beta
    [B, T, H] for the delta variants; the fp32 states [B, H, DK, DV]: the final one written, the
    initial one read when given.
    """
    B = problem.batch if batch is None else batch
    T = problem.seqlen if seqlen is None else seqlen
    H = problem.heads if heads is None else heads
    spec, DK, DV = problem.spec, problem.dk, problem.dv
    elem = 2  # fp16 and bf16
    total = elem * B * T * H * (2 * DK + 2 * DV)
    g_shape = spec.g_shape(B, T, H, DK)
    if g_shape is not None:
        n = 1
        for d in g_shape:
            n *= d
        total += 4 * n
    if spec.delta:
        total += 4 * B * T * H
    total += 4 * B * H * DK * DV * (int(initial_state) + int(final_state))
    return total


def memory_floor_ms(problem: Problem, bandwidth_gbps: float = H200_COPY_GBPS, **shape) -> float:
    """The memory-bound floor: :func:`floor_bytes` over ``bandwidth_gbps`` (GB/s, 1e9 bytes), in ms.

    At the default 4.3 TB/s, the linear variant at B=4, T=8192, H=16, D=128 in bf16 moves 0.537 GB
    (plus 4 MB of final state): about 0.126 ms.
    """
    return floor_bytes(problem, **shape) / (bandwidth_gbps * 1e9) * 1e3


def inputs_floor_ms(x: dict, bandwidth_gbps: float = H200_COPY_GBPS) -> float:
    """The memory-bound floor of a forward on the inputs ``x`` (``tuner.inputs.make_inputs``), counted
    as :func:`memory_floor_ms` counts (each input read once, o and the final states written once)
    from the tensors themselves: for packed inputs, whose q and k may have fewer heads than v and
    whose states are one per sequence. cu_seqlens' few bytes are left out."""
    def nbytes(t):
        return 0 if t is None else t.numel() * t.element_size()

    read = sum(nbytes(x.get(name)) for name in ("q", "k", "v", "g", "beta", "initial_state"))
    # o has v's shape and dtype; the final states are fp32 [N, HV, DK, DV] as the initial ones are.
    final = x["initial_state"]
    states = (final.numel() if final is not None
              else x["v"].shape[0] * x["v"].shape[2] * x["q"].shape[3] * x["v"].shape[3])
    written = nbytes(x["v"]) + 4 * states
    return (read + written) / (bandwidth_gbps * 1e9) * 1e3


def time_module(problem: Problem, module, kernels: dict, x: dict, **timing) -> dict:
    """A generated module's ``forward`` on the inputs ``x`` (at the problem's shape), timed as the
    tuner records it: ``Timing.as_dict()`` plus ``floor_ms``.

    Args:
        problem (Problem): what is timed (for the floor).
        module, kernels: the generated module and its compiled programs (``tuner.compile``).
        x (dict): ``tuner.inputs.timing_inputs`` for the problem.
        **timing: keyword arguments of :func:`time_forward`.

    A module's ``before_timing(problem)``, where it has one, is called first (FLA's baseline module makes
    FLA autotune at this problem there).
    """
    if hasattr(module, "before_timing"):
        module.before_timing(problem)
    if problem.spec.recurrence_of:
        # A decode kernel is timed as a decode step: its states updated in place in a pool, buffers
        # made once; the step reads and writes every state.
        t = time_forward(module.decode_call(kernels, **x), **timing)
        return dict(t.as_dict(), floor_ms=memory_floor_ms(problem, initial_state=True))
    t = time_forward(lambda: module.forward(kernels, **x), **timing)
    return dict(t.as_dict(), floor_ms=inputs_floor_ms(x) if problem.packed else memory_floor_ms(problem))
