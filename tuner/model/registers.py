"""The register model: each kernel's register demand per thread against the budget that applies.

The demand is the fragments and local arrays live at the busiest statement (the fragments spread
over the block's threads, ``elements * bytes / 4 / threads`` per thread), scaled and offset by
terms fitted per variant (:data:`FITTED`), plus a fitted term for a pipelined loop whose loads the
block's own threads issue. The budget is 240 for the consumers when warp specialisation injects
``setmaxnreg``, else what the launch bounds leave (255 up to 256 threads). With ``setmaxnreg``
ptxas reports the cap, not the demand, so spills and C7512 are what the model is judged against.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from .source import Kernel

# Largest register count ptxas gives one thread, and the registers of one SM (sm_90).
REGISTER_LIMIT = 255
REGISTERS_PER_SM = 65536
# Shared memory of one SM (sm_90: 228 KiB), and what the system reserves of it for each resident block.
SMEM_PER_SM = 233472
SMEM_RESERVED_PER_BLOCK = 1024
# Consumer register cap TileLang 0.1.15 sets with `setmaxnreg` under warp specialisation: one
# producer warpgroup at 24 registers, one or two consumer warpgroups at 240
# (annotate_warp_group_reg_alloc.cc; it is set only when the producer issues TMA copies alone,
# and then the producer is one warpgroup).
WS_CONSUMER_REGISTERS = 240

# Fitted terms of the register demand, per variant:
#   demand = fragment_scale * live fragment registers + overhead
#            + pipeline_overhead  (when the block's own threads run a pipelined loop that loads)
# overhead is the indexing, addressing and loop state beside the fragments; pipeline_overhead the
# loads of the next chunk that the threads issue beside the current one's work
# (Kernel.unspecialised_pipeline). A kernel is predicted to spill when demand > budget +
# spill_margin (ptxas rematerialises and shortens live ranges, so some demand above the budget
# still compiles clean), and to serialise its wgmma (C7512) when demand > budget - wgmma_margin.
# "default" serves variants not calibrated yet.
# Produced by model.fit() over the compiles recorded in tests/data (TileLang 0.1.15, CUDA 13.0,
# sm_90a; 2026-11-29), per variant, records marked superseded left out; "default" over all.
# docs/model.md has the command and the accuracy.
FITTED = {
    "default": {"fragment_scale": 0.8362, "overhead": 65.43, "spill_margin": -14, "wgmma_margin": -52,
                "pipeline_overhead": 16},
    "linear": {"fragment_scale": 1.0, "overhead": 33.0, "spill_margin": 0, "wgmma_margin": 0, "pipeline_overhead": 0},
    "decay": {"fragment_scale": 1.0, "overhead": 66.0, "spill_margin": 4, "wgmma_margin": -4, "pipeline_overhead": 0},
    "simple_gla": {"fragment_scale": 0.9131, "overhead": 52.89, "spill_margin": 0, "wgmma_margin": 0,
                   "pipeline_overhead": 0},
    "gdn": {"fragment_scale": 0.9941, "overhead": 37.05, "spill_margin": -24, "wgmma_margin": -38,
            "pipeline_overhead": 76},
    "kda": {"fragment_scale": 0.8704, "overhead": 73.09, "spill_margin": 0, "wgmma_margin": -56, "pipeline_overhead": 4},
}


# A kernel whose launch bounds ask an SM to hold several blocks trades a few spilled bytes for the
# blocks, and ptxas fits a demand well above the cap it sets (sm_90a, TileLang 0.1.15; model demand
# against ptxas): gdn's precompute, demand 69, compiles clean at a cap of 80 and with 16 bytes of
# spill at 64; kda's, demand 129, with 4 bytes at 80 and 1,068 at 64. Such a kernel is predicted to
# spill above its cap, and pruned only this far above it: the gate's timing judges a small spill.
BOUNDED_PRUNE_MARGIN = 56
# Below this share ptxas may not compile such a kernel at all: gdn's precompute kernel at 256 threads
# and eight blocks, a share of 32, stops with C7602 ("insufficient registers ... register target of 42
# or higher"); 64 is the least share measured to compile (128 threads and eight blocks, 256 and four).
BOUNDED_MIN_REGISTERS = 64


def terms(variant: str) -> dict:
    """The fitted terms the model uses for ``variant``."""
    return FITTED.get(variant, FITTED["default"])


@dataclass(frozen=True)
class KernelPrediction:
    """The model's figures for one kernel.

    Args:
        name (str): the kernel's name in ``programs()``.
        threads (int): threads per block as launched (producer warpgroup included).
        fragment_registers (float): registers per thread held by the fragments live at the
            busiest step, and by locals (:attr:`Kernel.live_registers`).
        registers (int): the predicted register demand per thread.
        budget (int): the registers a thread may use before spilling: 240 for the consumers
            under TileLang's ``setmaxnreg``, the cap of the computing role with the least room in a
            kernel split into roles by hand, else what the launch bounds leave
            (:func:`launch_register_cap`).
        spills (bool): demand above the budget.
        wgmma_serialized (bool): demand near the budget with wgmma accumulators in fragments (C7512).
        smem_bytes (int): dynamic shared memory.
        spill_margin (float): the fitted demand above a budget that still compiles without spilling.
        min_blocks_per_sm (int): the blocks an SM is to hold at once (launch bounds); its share of
            the register file is the budget, and it is hopeless only ``BOUNDED_PRUNE_MARGIN`` above it.
        role_capped (bool): the kernel is split into roles by hand, its budget a role's setmaxnreg
            cap: ptxas gives a role no more than its cap, bounded or not, so demand above it is pruned.
    """

    name: str
    threads: int
    fragment_registers: float
    registers: int
    budget: int
    spills: bool
    wgmma_serialized: bool
    smem_bytes: int
    spill_margin: float
    min_blocks_per_sm: int = 1
    role_capped: bool = False


@dataclass(frozen=True)
class Prediction:
    """The model's prediction for a config: the worst of its kernels.

    Args:
        registers (int): the largest predicted register demand per thread.
        smem_bytes (int): the largest dynamic shared memory.
        spills (bool): any kernel predicted to spill.
        wgmma_serialized (bool): any kernel predicted to serialise its wgmma (C7512).
        per_kernel (tuple[KernelPrediction, ...]): the figures per kernel.
    """

    registers: int
    smem_bytes: int
    spills: bool
    wgmma_serialized: bool
    per_kernel: tuple[KernelPrediction, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        return asdict(self)

    def prune_reason(self, budget: int = REGISTER_LIMIT) -> str | None:
        """Why to skip the config: a kernel's demand above the smaller of ``budget`` and its own
        cap, by more than the margin ptxas absorbs, or more blocks an SM asked of a kernel than its
        registers or its shared memory let reside. None to keep it."""
        for k in self.per_kernel:
            if k.min_blocks_per_sm > 1 and k.budget < BOUNDED_MIN_REGISTERS:
                return (f"{k.name}: {k.min_blocks_per_sm} blocks an SM of {k.threads} threads leave {k.budget} "
                        f"registers a thread, below the {BOUNDED_MIN_REGISTERS} ptxas needs to compile it")
            if k.min_blocks_per_sm > 1 and k.min_blocks_per_sm * (k.smem_bytes + SMEM_RESERVED_PER_BLOCK) > SMEM_PER_SM:
                return (f"{k.name}: {k.min_blocks_per_sm} blocks an SM asked, but its {k.smem_bytes} bytes of shared "
                        f"memory let {SMEM_PER_SM // (k.smem_bytes + SMEM_RESERVED_PER_BLOCK)} reside")
            cap = min(budget, k.budget)
            margin = BOUNDED_PRUNE_MARGIN if k.min_blocks_per_sm > 1 and not k.role_capped else k.spill_margin
            if k.registers > cap + margin:
                absorbed = f" + {margin:g} that ptxas absorbs" if margin else ""
                return f"{k.name}: predicted register demand {k.registers} per thread exceeds {cap}{absorbed}"
        return None

    def summary(self) -> str:
        yes = {True: "yes", False: "no"}
        lines = [f"predicted: {self.registers} registers/thread (demand), {self.smem_bytes} bytes shared memory, "
                 f"spills: {yes[self.spills]}, wgmma serialised: {yes[self.wgmma_serialized]}"]
        for k in self.per_kernel:
            lines.append(f"  {k.name}: {k.threads} threads, fragments {k.fragment_registers:g} reg, "
                         f"demand {k.registers} / budget {k.budget}, smem {k.smem_bytes} B")
        return "\n".join(lines)


def launch_register_cap(threads: int, min_blocks_per_sm: int = 1) -> int:
    """Registers per thread ptxas may use in a block of ``threads`` of which an SM is to hold
    ``min_blocks_per_sm`` (``__launch_bounds__(threads, min_blocks_per_sm)``): the 64 Ki registers
    of an SM shared out, in the allocation unit of 8, at most 255 (ptxas at 128 threads: 80 for six
    blocks, 64 for eight)."""
    return min(REGISTER_LIMIT, REGISTERS_PER_SM // (threads * min_blocks_per_sm) // 8 * 8)


def predict_kernel(kernel: Kernel, fitted: dict) -> KernelPrediction:
    """The model's figures for one parsed kernel with the given fitted terms. A kernel split into
    roles by hand is judged by its computing role with the least room: each role's fragments over
    its own threads against the cap its ``setmaxnreg`` sets (ptxas on gdn's role-split kernel: the
    state role, 64 fragment registers, spills at a cap of 88 and not at 96; the TMA loader holds no
    fragment and compiles clean at 24, the least setmaxnreg takes)."""
    margin = fitted["spill_margin"]
    if kernel.roles:
        # Only the roles that hold fragments compute; a loader role fits the smallest cap.
        computing = [r for r in kernel.roles if r.live_registers] or list(kernel.roles)
        role = max(computing, key=lambda r: fitted["fragment_scale"] * r.live_registers - r.register_cap)
        fragments, budget = role.live_registers, role.register_cap
        # ptxas allocates a role no more than its cap: demand above it spills.
        margin = 0
    else:
        fragments = kernel.live_registers
        budget = (WS_CONSUMER_REGISTERS if kernel.setmaxnreg
                  else launch_register_cap(kernel.launch_threads, kernel.min_blocks_per_sm))
        if kernel.min_blocks_per_sm > 1:
            margin = 0  # any demand above the share spills; BOUNDED_PRUNE_MARGIN says when it is hopeless
    demand = math.ceil(fitted["fragment_scale"] * fragments + fitted["overhead"]
                       + fitted.get("pipeline_overhead", 0) * kernel.unspecialised_pipeline)
    wgmma = bool(kernel.wgmma_accumulators) and demand > budget - fitted["wgmma_margin"]
    threads = kernel.launch_threads
    return KernelPrediction(
        name=kernel.name, threads=threads, fragment_registers=fragments, registers=demand, budget=budget,
        spills=demand > budget + margin, wgmma_serialized=wgmma,
        smem_bytes=kernel.smem_plan[0], spill_margin=margin, min_blocks_per_sm=kernel.min_blocks_per_sm,
        role_capped=bool(kernel.roles),
    )


def predict(kernels: Iterable[Kernel], variant: str) -> Prediction:
    """Registers, shared memory, spills and wgmma serialisation predicted for one config's kernels.

    Args:
        kernels: the config's kernels, read from its source (:func:`tuner.model.source.parse_kernels`).
        variant (str): whose fitted terms to use (:func:`terms`).

    Returns:
        Prediction: the worst figures over the kernels, and each kernel's.
    """
    fitted = terms(variant)
    return combine([predict_kernel(k, fitted) for k in kernels])


def combine(kernels: list[KernelPrediction]) -> Prediction:
    """The :class:`Prediction` of a config from its kernels' figures: the worst of each."""
    return Prediction(
        registers=max(k.registers for k in kernels), smem_bytes=max(k.smem_bytes for k in kernels),
        spills=any(k.spills for k in kernels), wgmma_serialized=any(k.wgmma_serialized for k in kernels),
        per_kernel=tuple(kernels),
    )
