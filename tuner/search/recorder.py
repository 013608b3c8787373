"""What a search writes: a row per trial, the claims that keep two workers from judging one kernel,
the winners, and the summary read back from the rows.

A kernel (its digest) is judged once per study: the trial that claims it first judges it, and any
other trial that proposes it repeats that outcome (``repeat_of``), free of charge. A row whose config
the templates now render to another kernel (they changed since) is stale: kept as history, but not
counted toward ``--trials`` and never the winner, so a study resumed after a template change judges
the new kernels.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime

from ..candidate import Candidate
from ..errors import UserError
from ..problem import Problem
from ..render import RenderError
from ..space import Space
from ..stack import Stack
from ..status import FREE, Status
from ..store import Store, TrialRecord, Winner


@dataclass(frozen=True)
class TuneSummary:
    """What a tuning run leaves behind.

    Args:
        study (str): the Optuna study name (also the ``study`` column of the trial rows).
        counts (Counter): trial rows of the study per status, repeats of a judged kernel left out.
        winner (TrialRecord | None): the fastest row that passed the gate; None without one.
        default (TrialRecord | None): the row of the template's default config.
        gated (bool): whether this run gated and timed on a GPU.
        also_at (tuple[TuneSummary]): the companion studies of the ``also_at`` shapes.
        repeats (int): trial rows that repeated the outcome of a kernel judged before.
        stale (int): kernels judged (counted in ``counts``) that the templates no longer render.
        database (str): where the rows are (a file path or a database URL).
    """

    study: str
    counts: Counter
    winner: TrialRecord | None
    default: TrialRecord | None
    gated: bool
    also_at: tuple["TuneSummary", ...] = ()
    repeats: int = 0
    stale: int = 0
    database: str = ""

    @property
    def speedup(self) -> float | None:
        """Default latency / winner latency, when both were timed."""
        if self.winner is None or self.default is None or self.default.median_ms is None:
            return None
        return self.default.median_ms / self.winner.median_ms

    @property
    def judged(self) -> int:
        """Kernels judged that the templates still render (what ``--trials`` counts)."""
        return judged_count(self.counts) - self.stale


def judged_count(counts: Counter) -> int:
    """Kernels judged, from counts per status that leave repeats out."""
    return sum(n for status, n in counts.items() if status not in FREE)


def is_judgement(record: TrialRecord) -> bool:
    """Whether ``record`` judged its kernel itself (rather than repeating another trial's outcome)."""
    return record.digest is not None and record.repeat_of is None and record.status != Status.CONSTRAINT


def counts_toward_trials(record: TrialRecord) -> bool:
    """Whether ``record`` judged a kernel at a cost (a compile at least), as ``--trials`` counts."""
    return is_judgement(record) and record.status not in FREE


class Recorder:
    """The rows of one study of one problem.

    Args:
        store (Store): the results database.
        problem (Problem): the study's problem.
        stack (Stack): this machine's stack.
        study (str): the study's name.
    """

    def __init__(self, store: Store, problem: Problem, stack: Stack, study: str):
        self.store, self.problem, self.stack, self.study = store, problem, stack, study
        rows = store.trials(study)
        self.judged = {r.digest: r for r in rows if is_judgement(r)}  # digest -> the row that judged it
        self.counts = Counter(r.status for r in rows if r.repeat_of is None)
        self.repeats = sum(r.repeat_of is not None for r in rows)
        self._current: dict[tuple[int, str], bool] = {}  # (trial number, digest) -> still rendered
        self.stale = sum(1 for r in rows if counts_toward_trials(r) and not self.is_current(r))

    def record(self, number: int, config: dict, status: Status, reason: str = "", **fields) -> TrialRecord:
        """Record trial ``number``'s outcome (``fields``: the other columns of :class:`TrialRecord`)."""
        record = TrialRecord(study=self.study, number=number, problem=self.problem, config=config, status=status,
                             stack=self.stack, reason=reason, **fields)
        self._write(record)
        self._current[number, record.digest] = True  # judged on what the templates render now
        if is_judgement(record):
            self.judged[record.digest] = record
        return record

    def repeat(self, number: int, config: dict, original: TrialRecord, started_at: datetime) -> TrialRecord:
        """Record trial ``number`` as a repeat of the kernel ``original`` judged."""
        same = {k: getattr(original, k) for k in ("status", "reason", "prediction", "compile_report",
                                                   "gate_errors", "median_ms", "p10_ms", "p90_ms")}
        record = TrialRecord(study=self.study, number=number, problem=self.problem, config=config,
                             stack=self.stack, digest=original.digest, repeat_of=original.number,
                             started_at=started_at, **same)
        self._write(record)
        return record

    def _write(self, record: TrialRecord) -> None:
        self.store.record_trial(record)
        if record.repeat_of is None:
            self.counts[record.status] += 1
        else:
            self.repeats += 1

    def rows(self) -> dict[int, TrialRecord]:
        """Every row of the study, by trial number (all workers')."""
        return {r.number: r for r in self.store.trials(self.study)}

    def judgement(self, digest: str) -> TrialRecord | None:
        """The recorded outcome of kernel ``digest`` in this study, by any worker; None yet."""
        if digest not in self.judged:
            row = next((r for r in self.store.trials(self.study, digest) if is_judgement(r)), None)
            if row is not None:
                self.judged[digest] = row
        return self.judged.get(digest)

    def is_current(self, record: TrialRecord) -> bool:
        """Whether the templates still render ``record``'s config to the kernel it judged."""
        key = record.number, record.digest
        if key not in self._current:
            self._current[key] = still_rendered(self.problem, record)
        return self._current[key]

    def claim(self, digest: str, number: int) -> int:
        """Claim kernel ``digest`` for trial ``number``; the number of the trial that holds it."""
        return self.store.claim(self.study, digest, number)

    def take_over(self, digest: str, lost: int, number: int) -> bool:
        """Move the claim of ``digest`` from lost trial ``lost`` to ``number``; False if another did."""
        return self.store.take_over(self.study, digest, lost, number)

    def write_winner(self) -> None:
        """Store the study's fastest passing kernel as the problem's winner (the store keeps the
        faster of it and the one stored)."""
        row = best(self.problem, self.store, self.study)
        if row is None:
            return
        self.store.write_winner(Winner(
            problem=self.problem, stack=self.stack, digest=row.digest, config=row.config,
            median_ms=row.median_ms, p10_ms=row.p10_ms, p90_ms=row.p90_ms, gate_errors=row.gate_errors or {},
            study=row.study, trial_number=row.number), gate_status=row.status)


def best(problem: Problem, store: Store, study: str) -> TrialRecord | None:
    """The fastest passing row of ``study`` whose kernel is still what the template renders today."""
    rows = [r for r in store.trials(study) if r.status == Status.PASS and r.median_ms is not None]
    for row in sorted(rows, key=lambda r: r.median_ms):
        if still_rendered(problem, row):
            return row
    return None


def summarise(problem: Problem, store: Store, study: str, space: Space, gated: bool,
              also_at: list[tuple[Problem, str]] = ()) -> TuneSummary:
    """The :class:`TuneSummary` of ``study`` (a search of ``space``) as recorded in ``store``, over
    all its workers, with those of its companion studies (``also_at``: (problem, study) pairs)."""
    rows = store.trials(study)
    judged = [r for r in rows if r.repeat_of is None]
    default_digest = _digest(problem, space.default(problem))
    default = next((r for r in rows if r.digest == default_digest and r.repeat_of is None), None)
    companions = tuple(summarise(p, store, name, space, gated) for p, name in also_at)
    stale = sum(1 for r in judged if counts_toward_trials(r) and not still_rendered(problem, r))
    return TuneSummary(study, Counter(r.status for r in judged), best(problem, store, study), default, gated=gated,
                       also_at=companions, repeats=len(rows) - len(judged), stale=stale, database=store.where)


def still_rendered(problem: Problem, record: TrialRecord) -> bool:
    """Whether the templates still render ``record``'s config to the kernel it judged."""
    return _digest(problem, record.config) == record.digest


def _digest(problem: Problem, config: dict) -> str | None:
    """What the template renders ``config`` to today; None when it no longer can."""
    try:
        return Candidate.from_config(problem, config).digest
    except (UserError, RenderError):
        return None
