"""Shared memory of a kernel, exact: a replay of TileLang 0.1.15's ``MergeSharedMemoryAllocations``
(live ranges, stage copies, swizzle alignments, best-fit reuse) over a kernel read from its source.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the kernel's description; this module reads only its attributes
    from .source import Buffer, Kernel

# Alignment of a shared buffer nothing stricter asks for (the merge pass's `align_bytes`).
SMEM_ALIGN = 16


def _swizzle_alignment(buf: Buffer) -> int:
    """Alignment TileLang requires of a TMA/wgmma shared operand: ``128 << swizzle mode``
    (``src/layout/swizzle_mode.h``), the swizzle being the widest of 128/64/32 bytes that the
    buffer's innermost row holds (a one-dimensional buffer is not swizzled)."""
    if len(buf.shape) < 2:
        return 128
    row = buf.shape[-1] * buf.itemsize
    for swizzle, alignment in ((128, 1024), (64, 512), (32, 256)):
        if row % swizzle == 0:
            return alignment
    return 128


def _alignment(kernel: Kernel, buf: Buffer) -> int:
    """The merge pass's alignment of a shared buffer. A TMA copy records its swizzle's (a load
    into a buffer no wgmma reads keeps TileLang's linear layout: no swizzle, 128); a wgmma operand
    no TMA copy touches gets the pass's worst case, 1024; anything else ``SMEM_ALIGN``."""
    if buf.name in kernel.tma_stores or (buf.name in kernel.tma_loads and buf.name in kernel.wgmma_shared):
        return _swizzle_alignment(buf)
    if buf.name in kernel.tma_loads:
        return 128
    if buf.name in kernel.wgmma_shared:
        return 1024
    return SMEM_ALIGN


@dataclass(frozen=True)
class Placement:
    """Where the merge pass puts one shared buffer: byte ``offset`` and ``size``."""

    name: str
    offset: int
    size: int
    alignment: int


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class _FreeList:
    """The merge pass's free list: sorted, coalesced blocks; best-fit allocation."""

    def __init__(self):
        self.blocks: list[list[int]] = []  # [offset, size], sorted by offset

    def free(self, offset: int, size: int) -> None:
        if size == 0:
            return
        self.blocks.append([offset, size])
        self.blocks.sort()
        merged = [self.blocks[0]]
        for off, sz in self.blocks[1:]:
            last = merged[-1]
            if last[0] + last[1] >= off:
                last[1] = max(last[0] + last[1], off + sz) - last[0]
            else:
                merged.append([off, sz])
        self.blocks = merged

    def best_fit(self, need: int, alignment: int) -> int | None:
        best, best_waste = None, None
        for i, (off, sz) in enumerate(self.blocks):
            head = _align(off, alignment) - off
            if head > sz or sz - head < need:
                continue
            if best_waste is None or sz - need < best_waste:
                best, best_waste = i, sz - need
        return None if best is None else self._carve(best, need, alignment)

    def from_tail(self, alignment: int, top: int) -> int | None:
        if not self.blocks or sum(self.blocks[-1]) != top:
            return None
        off, _ = self.blocks[-1]
        aligned = _align(off, alignment)
        if aligned >= top:
            return None
        self.blocks.pop()
        self.free(off, aligned - off)
        return aligned

    def _carve(self, index: int, need: int, alignment: int) -> int:
        off, sz = self.blocks.pop(index)
        aligned = _align(off, alignment)
        self.free(aligned + need, sz - (aligned - off) - need)
        self.free(off, aligned - off)
        return aligned


def _load_start(kernel: Kernel, name: str, first: float) -> float:
    """Where a buffer filled inside the pipelined loop is first used once TileLang has moved its
    load ahead of the loop body. The producer warps issue the TMA loads and the ``T.Parallel``
    loads at once (under the aggressive merge only the latter move, ahead of the TMA); the
    prologue of a pipeline without warp specialisation issues the ``T.copy`` loads, the one whose
    buffer is last used first, and, where the loop has a constant number of iterations and copies,
    its ``T.Parallel`` loads after them. Measured on the kernels in tests/data and, for the last,
    on kda's precompute kernel over two chunks a block (its beta vector placed right after the
    copied tiles)."""
    if name not in kernel.pipeline_loads or not kernel.num_stages:
        return first
    if kernel.producer_consumer:
        if name not in kernel.tma_loads | kernel.thread_loads:
            return first  # a strided T.copy stays with the consumers
        if not kernel.aggressive_merge:
            return first - 0.5
        return kernel.pipeline_steps[0] - 0.5 if name in kernel.thread_loads else first
    if kernel.aggressive_merge:
        return first
    hoisted = sorted((kernel.live[n][1], n) for n in kernel.pipeline_loads - kernel.thread_loads)
    if name in kernel.thread_loads:
        if kernel.pipeline_extent is None or not hoisted:
            return first
        return first - 1 + (1 + len(hoisted)) / (2 + len(hoisted))
    return first - 1 + (1 + [n for _, n in hoisted].index(name)) / (2 + len(hoisted))


def shared_memory_plan(kernel: Kernel) -> tuple[int, list[Placement]]:
    """The dynamic shared memory TileLang allocates for ``kernel`` and where each buffer lies.

    Replays ``LinearScanPack`` of ``merge_shared_memory_allocations.cc`` on live ranges read from
    the source (:attr:`Kernel.uses`, or :attr:`Kernel.live` under the aggressive merge); the
    pipeline's loads come first.

    Returns:
        tuple[int, list[Placement]]: the byte size of the merged allocation and the placements.
    """
    ranges = kernel.live if kernel.aggressive_merge else kernel.uses
    intervals = []
    for buf in kernel.buffers:
        if buf.scope != "shared" or buf.name not in ranges:
            continue
        first, last = ranges[buf.name]
        size = buf.nbytes
        if buf.name in kernel.pipeline_loads and (kernel.pipelined or kernel.producer_consumer):
            size *= max(1, kernel.num_stages)
        first = _load_start(kernel, buf.name, first)
        intervals.append((first, last + 1, size, _alignment(kernel, buf), buf.name))
    intervals.sort(key=lambda iv: (iv[0], -iv[2], iv[4]))

    free, top, active, placements = _FreeList(), 0, [], []
    for start, end, size, alignment, name in intervals:
        for done in sorted((a for a in active if a[0] <= start), key=lambda a: a[0]):
            free.free(done[1], done[2])
            active.remove(done)
        offset = free.best_fit(size, alignment)
        if offset is None:
            offset = free.from_tail(alignment, top)
            if offset is not None:
                top = offset + size
        if offset is None:
            offset = _align(top, alignment)
            free.free(top, offset - top)
            top = offset + size
        active.append((end, offset, size))
        placements.append(Placement(name, offset, size, alignment))
    total = max((p.offset + p.size for p in placements), default=0)
    return _align(total, SMEM_ALIGN), placements


def shared_memory_bytes(kernels: Iterable[Kernel]) -> int:
    """Dynamic shared memory of the largest of ``kernels`` (one config's), in bytes, as TileLang
    allocates it."""
    return max(k.smem_plan[0] for k in kernels)
