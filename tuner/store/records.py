"""Rows as they leave the results database: frozen records of trials, winners, their
measurements, FLA's baseline measurements and calibration points, and the shape buckets winners are
kept by."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ..problem import Problem
from ..stack import Stack
from ..status import Status

# Outcomes of a trial, in pipeline order (the values the status column may hold).
STATUSES = tuple(s.value for s in Status)


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


# --------------------------------------------------------------------------------------------
# Shape buckets


@dataclass(frozen=True, order=True)
class ShapeBucket:
    """A power-of-two bucket of the shape a kernel runs at.

    ``batch * heads`` is the parallel extent of every template's grid and ``seqlen`` the
    sequential one; each is rounded to the nearest power of two (in log space), so shapes
    within a factor of ~1.4 share a winner.

    Args:
        bh (int): the bucket of ``batch * heads``.
        t (int): the bucket of ``seqlen``.
    """

    bh: int
    t: int

    @property
    def label(self) -> str:
        return f"bh{self.bh}-t{self.t}"

    def distance(self, other: ShapeBucket) -> int:
        """Steps of a factor two between the buckets, summed over both axes."""
        return abs(_log2(self.bh) - _log2(other.bh)) + abs(_log2(self.t) - _log2(other.t))


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _round_pow2(n: int) -> int:
    return 2 ** round(math.log2(n))


def shape_bucket(batch: int, seqlen: int, heads: int) -> ShapeBucket:
    """The :class:`ShapeBucket` of a ``[batch, seqlen, heads]`` problem."""
    if min(batch, seqlen, heads) < 1:
        raise ValueError(f"shape must be positive, got batch={batch}, seqlen={seqlen}, heads={heads}")
    return ShapeBucket(_round_pow2(batch * heads), _round_pow2(seqlen))


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class TrialRecord:
    """One trial's outcome. ``problem``'s shape is the one timed; ``repeat_of`` names the
    earlier trial whose kernel (same digest) this trial re-proposed, reusing its outcome."""

    study: str
    number: int
    problem: Problem
    config: dict
    status: str
    stack: Stack
    reason: str = ""
    digest: str | None = None
    repeat_of: int | None = None
    prediction: dict | None = None
    compile_report: dict | None = None
    gate_errors: dict | None = None
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    compile_seconds: float | None = None
    gpu_seconds: float | None = None
    started_at: datetime | None = None
    finished_at: datetime = field(default_factory=utcnow)
    id: int | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")


@dataclass(frozen=True)
class Winner:
    """The fastest gated config of a key; ``problem``'s shape is the one it was timed at."""

    problem: Problem
    stack: Stack
    digest: str
    config: dict
    median_ms: float
    p10_ms: float
    p90_ms: float
    gate_errors: dict
    study: str
    trial_number: int
    updated_at: datetime = field(default_factory=utcnow)
    id: int | None = None

    @property
    def bucket(self) -> ShapeBucket:
        return shape_bucket(self.problem.batch, self.problem.seqlen, self.problem.heads)

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative noise of the timing."""
        return (self.p90_ms - self.p10_ms) / self.median_ms


@dataclass(frozen=True)
class Measurement:
    """One (re-)measurement of a stored winner."""

    winner_id: int
    status: str
    stack: Stack
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    gate_errors: dict | None = None
    digest: str | None = None
    measured_at: datetime = field(default_factory=utcnow)
    id: int | None = None


@dataclass(frozen=True)
class Baseline:
    """One measurement of FLA's op for a problem (``tuner.baseline``), at the problem's shape on
    ``stack`` with FLA ``fla_version``: the gate's verdict (``status``, ``gate_errors``, and why it
    did not pass in ``message``) and, on a pass, the timing and the memory-bound floor at that shape.
    ``autotuned_at_shape``: FLA was timed autotuned at this shape (``tuner.baseline.autotune_fla_at``);
    False for measurements made before that was done, with whatever configs FLA had chosen earlier."""

    problem: Problem
    stack: Stack
    fla_version: str
    status: str
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    floor_ms: float | None = None
    gate_errors: dict | None = None
    message: str = ""
    measured_at: datetime = field(default_factory=utcnow)
    autotuned_at_shape: bool = False
    id: int | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")

    @property
    def bucket(self) -> ShapeBucket:
        return shape_bucket(self.problem.batch, self.problem.seqlen, self.problem.heads)

    @property
    def timed(self) -> bool:
        """Whether it passed the gate and has a latency."""
        return self.status == Status.PASS and self.median_ms is not None


@dataclass(frozen=True)
class CalibrationPoint:
    """The model's prediction and ptxas' report for one compiled kernel source."""

    variant: str
    dk: int
    dv: int
    dtype: str
    config: dict
    digest: str
    predicted_registers: int
    predicted_smem_bytes: int
    predicted_spills: bool
    ptxas_registers: int
    ptxas_spill_bytes: int
    ptxas_smem_bytes: int
    ptxas_wgmma_serialized: bool
    tilelang: str
    cuda: str
    report: dict | None = None
    created_at: datetime = field(default_factory=utcnow)
    id: int | None = None
