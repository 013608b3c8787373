"""Static screen of generated CUDA for barriers that not every thread they wait for can reach.

A fused scalar-decay kernel (one block per DV slice, [C]-shaped weight fragments) deadlocked on
the H200 because TileLang 0.1.15 emitted a 128-thread barrier inside
``if ((((int)threadIdx.x) >> 6) == 0) {``, a branch only 64 of the 128 threads enter. Looking for
"a barrier under an ``if``" is not enough: warp-specialised kernels open with
``if (((int)threadIdx.x) < 128) {`` and call ``tl::__sync_thread_partial(id, 128)`` inside, which
every entering thread reaches. So the screen counts: for each barrier it evaluates the conditions
of the enclosing branches over ``threadIdx.x`` in ``range(block size)`` (an ``else`` negates the
conditions of its chain, nested branches combine) and rejects when fewer threads enter than the
barrier waits for. A condition that does not depend on the thread index is uniform and ignored.

The same count is made for the mbarriers a kernel initialises itself (hand-made roles): every
thread that reaches an arrival at an array's barrier arrives once per phase, so the threads over
all its arrival sites must be the count the array was initialised with. Fewer, and the phase
never completes (a hang); more, and it completes before the arrivals it was meant to wait for.

A kernel that hands registers between warpgroups (``setmaxnreg``: ``tl::warpgroup_reg_alloc<N>`` and
``warpgroup_reg_dealloc<N>`` in TileLang's CUDA) starts every warp at the registers ptxas gave it (at
most the launch's share of the register file: 128 at 512 threads). ``.inc`` can only raise a warp's
count and ``.dec`` only lower it: kda's packed role-split kernel, 128 registers, asked ``.inc`` for
104 and stopped with an illegal instruction on the H100. The screen rejects an ``.inc`` below the
kernel's registers (where ptxas' count is given) and a ``.dec`` above them (the launch's share where
it is not).

A thread-dependent condition the evaluator cannot read (a loop variable, a value loaded from
memory, ``threadIdx.y``) yields a ``cannot_evaluate`` finding that does NOT reject: a false
rejection throws away a config for good, while a missed deadlock costs one watchdog timeout in
the gate, which reports it as ``hang``.

:mod:`.source` finds the kernels, branches, barriers and integer locals in the source (the
barriers it recognises are listed there); :mod:`.condition` evaluates a branch condition for
every thread (what a condition may use is listed there).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..model.registers import launch_register_cap
from .condition import CannotEvaluate, evaluate_condition
from .source import (Kernel, barriers, blank_comments_and_strings, branches, integer_definitions, kernels, line_of,
                     mbarriers, register_handoffs)

__all__ = ["Finding", "screen", "CannotEvaluate", "evaluate_condition"]

# Finding kinds.
PARTIAL_BARRIER = "barrier_in_partial_branch"
MBARRIER_COUNT = "mbarrier_arrivals_not_its_count"
SETMAXNREG_DIRECTION = "setmaxnreg_against_its_direction"
CANNOT_EVALUATE = "cannot_evaluate"


@dataclass(frozen=True)
class Finding:
    """One screen result. ``rejects``: the kernel must not be run (it would deadlock)."""

    kind: str
    line: int
    message: str
    kernel: str = ""

    @property
    def rejects(self) -> bool:
        return self.kind in (PARTIAL_BARRIER, MBARRIER_COUNT, SETMAXNREG_DIRECTION)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        return cls(**d)


def screen(cuda_source: str, threads: int | None = None, registers: int | None = None) -> list[Finding]:
    """Barriers in ``cuda_source`` that fewer threads reach than they wait for, mbarriers whose
    arrivals do not match their count, and setmaxnreg calls against their direction.

    Args:
        cuda_source (str): CUDA C++ as TileLang generates it (``kernel.get_kernel_source()``); may
            hold several ``__global__`` kernels.
        threads (int): threads per block. Used for kernels without ``__launch_bounds__``; the
            launch bound wins where present, since warp specialisation adds a producer warpgroup
            to the ``threads`` a program asks for. Default: None.
        registers (int): registers per thread ptxas gave the kernel (its report), where known: the
            count every warp starts at, which setmaxnreg moves; for a source of one kernel (as
            ``tuner.compile`` passes each kernel's). Default: None.

    Returns:
        list[Finding]: ``barrier_in_partial_branch``, ``mbarrier_arrivals_not_its_count`` and
        ``setmaxnreg_against_its_direction`` findings (reject) and ``cannot_evaluate``
        findings (for a human; do not reject), in source order. Empty for a clean kernel.
    """
    text = blank_comments_and_strings(cuda_source)
    findings = []
    for kernel in kernels(text):
        block = kernel.launch_bound or threads
        if block is None:
            findings.append(Finding(CANNOT_EVALUATE, kernel.line, "no __launch_bounds__ and no thread count given; "
                                                                 "barriers not checked", kernel.name))
            continue
        findings += _screen_kernel(cuda_source, text, kernel, block)
        findings += _screen_register_handoff(text, kernel, block, registers)
    return findings


def _screen_register_handoff(text: str, kernel: Kernel, block: int, registers: int | None) -> list[Finding]:
    """setmaxnreg findings of one kernel of ``block`` threads whose warps start at ``registers`` (None:
    unknown, at most the launch's share): an .inc below the start or a .dec above it, each an illegal
    instruction on the GPU."""
    start = registers or launch_register_cap(block)
    findings = []
    for h in register_handoffs(text, kernel.body_start, kernel.body_end):
        if (registers is not None and h.count < start) if h.increases else (h.count > start):
            verb, can = ("inc", "raise") if h.increases else ("dec", "lower")
            findings.append(Finding(SETMAXNREG_DIRECTION, line_of(text, h.pos),
                                    f"setmaxnreg.{verb} to {h.count} registers in a kernel whose warps start at "
                                    f"{start} (block of {block}): .{verb} can only {can} the count (an illegal "
                                    f"instruction on the GPU)", kernel.name))
    return findings


def _screen_kernel(src: str, text: str, kernel: Kernel, block: int) -> list[Finding]:
    """The findings of one kernel run by ``block`` threads (``text``: ``src`` blanked)."""
    try:
        kernel_branches = branches(text, kernel.body_start, kernel.body_end)
    except CannotEvaluate as e:
        return [Finding(CANNOT_EVALUATE, kernel.line, f"could not parse the kernel body: {e}", kernel.name)]
    definitions = integer_definitions(text[kernel.body_start:kernel.body_end])
    tx = np.arange(block, dtype=np.int64)
    findings = []

    def entered(pos: int) -> tuple[np.ndarray, tuple | None]:
        """The threads that reach offset ``pos``, and the innermost thread-dependent condition."""
        mask, innermost = np.ones(block, dtype=bool), None
        for branch in sorted((b for b in kernel_branches if b.start <= pos < b.end), key=lambda b: b.start):
            for cond, wanted in branch.conditions:
                cond_mask = evaluate_condition(cond, tx, definitions)
                if cond_mask is None:
                    continue  # uniform across the block
                mask &= cond_mask if wanted else ~cond_mask
                innermost = (cond, wanted, branch.line)
        return mask, innermost

    for barrier in barriers(src, text, kernel.body_start, kernel.body_end):
        line = line_of(text, barrier.pos)
        if not barrier.count_is_constant:
            findings.append(Finding(CANNOT_EVALUATE, line, f"barrier count not a constant: {barrier.text}",
                                    kernel.name))
            continue
        waits_for = block if barrier.count is None else barrier.count
        try:
            mask, innermost = entered(barrier.pos)
        except CannotEvaluate as e:
            findings.append(Finding(CANNOT_EVALUATE, line, f"{barrier.text} inside a branch whose condition "
                                                           f"cannot be evaluated ({e})", kernel.name))
            continue
        count = int(mask.sum())
        if count < waits_for:
            cond, wanted, cond_line = innermost
            where = f"if ({cond})" if wanted else f"else of if ({cond})"
            findings.append(Finding(PARTIAL_BARRIER, line,
                                    f"barrier for {waits_for} threads inside a branch entered by {count} threads: "
                                    f"{barrier.text} under `{where}` (line {cond_line}), block of {block}",
                                    kernel.name))
    arrays, arrivals = mbarriers(text, kernel.body_start, kernel.body_end)
    for name, waits_for in arrays.items():
        sites = [a for a in arrivals if a.name == name]
        try:
            per_site = [int(entered(a.pos)[0].sum()) for a in sites]
        except CannotEvaluate as e:
            findings.append(Finding(CANNOT_EVALUATE, kernel.line, f"mbarrier {name}: an arrival inside a branch "
                                                                  f"whose condition cannot be evaluated ({e})",
                                    kernel.name))
            continue
        if sum(per_site) != waits_for:
            where = ", ".join(f"{n} at line {line_of(text, a.pos)}" for a, n in zip(sites, per_site)) or "none"
            findings.append(Finding(MBARRIER_COUNT, line_of(text, sites[0].pos) if sites else kernel.line,
                                    f"mbarrier {name} is initialised for {waits_for} arrivals a phase and "
                                    f"{sum(per_site)} threads arrive ({where}), block of {block}", kernel.name))
    return findings
