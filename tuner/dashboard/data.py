"""What the dashboard shows, read from the results database: one view per problem, and the
measures computed from the trials (best latency so far, which parameters mattered)."""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .. import variants
from ..errors import UserError
from ..problem import Problem
from ..regress import Verdict, VersusFla, distinctions, judge_history, versus_fla
from ..status import Status
from ..store import Baseline, CalibrationPoint, Measurement, Store, TrialRecord, Winner

DEFAULT_VS_FLA = variants.ROOT / "benchmarks" / "vs_fla.json"
PROBLEM_FIELDS = ("variant", "dk", "dv", "dtype", "batch", "seqlen", "heads")
VS_FLA_FIELDS = (*PROBLEM_FIELDS, "ours_ms", "fla_ms", "floor_ms")


def is_timed(trial: TrialRecord) -> bool:
    """Whether the trial passed the gate and has a latency."""
    return trial.status == Status.PASS and trial.median_ms is not None


def is_miss(p: CalibrationPoint) -> bool:
    """The model's spill verdict (what pruning acts on) differs from what ptxas reported."""
    return p.predicted_spills != (p.ptxas_spill_bytes > 0)


def config_text(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(config.items()))


def stack_label(m: Measurement | Winner | Baseline) -> str:
    e = m.stack
    return f"TileLang {e.tilelang} · CUDA {e.cuda} · driver {e.driver} · torch {e.torch}"


def best_so_far(trials: list[TrialRecord]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(Trial number, best latency so far) at each improvement, and the same against cumulative
    GPU-seconds; the trials in number order, only timed ones count."""
    by_number, by_seconds = [], []
    best, seconds = math.inf, 0.0
    for t in sorted(trials, key=lambda t: t.number):
        seconds += t.gpu_seconds or 0.0
        if is_timed(t) and t.median_ms < best:
            best = t.median_ms
            by_number.append((t.number, best))
            by_seconds.append((seconds, best))
    return by_number, by_seconds


def parameter_effects(trials: list[TrialRecord]) -> list[tuple[str, float, dict]]:
    """How much each parameter mattered in the timed trials of one study, without a model: for each
    value of a parameter, the best latency any trial with that value reached; the parameter's
    weight is how much slower the best of its worst value is than the best of its best value, i.e.
    what a wrong choice of it costs when everything else is tuned.

    Returns:
        list of (parameter, weight, {value: (best latency ms, timed trials)}), largest weight first;
        weight = best latency of the parameter's worst value / that of its best value - 1.
        Parameters seen with a single value are left out.
    """
    values: dict[str, dict] = defaultdict(dict)
    for t in filter(is_timed, trials):
        for name, value in t.config.items():
            best, count = values[name].get(value, (math.inf, 0))
            values[name][value] = (min(best, t.median_ms), count + 1)
    effects = []
    for name, per_value in values.items():
        if len(per_value) > 1:
            bests = [b for b, _ in per_value.values()]
            effects.append((name, max(bests) / min(bests) - 1, per_value))
    return sorted(effects, key=lambda e: -e[1])


def registers(trial: TrialRecord | None) -> list[str]:
    """Per kernel: ptxas registers / predicted (and spill bytes), from the winning trial's row."""
    if trial is None:
        return []
    predicted = {k["name"]: k["registers"] for k in (trial.prediction or {}).get("per_kernel", ())}
    lines = []
    for k in (trial.compile_report or {}).get("kernels", []):
        spill = k.get("spill_stores", 0) + k.get("spill_loads", 0)
        lines.append(f"{k['name']}: {k.get('registers', '?')} / {predicted.get(k['name'], '?')}"
                     + (f" (spills {spill} B)" if spill else ""))
    if not lines and trial.prediction:
        lines.append(f"predicted {trial.prediction.get('registers', '?')}")
    return lines


def load_vs_fla(path: Path) -> list[dict] | None:
    """The rows of ``benchmarks/vs_fla.json``, or None when the file does not exist."""
    if not path.exists():
        return None
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"{path} must hold a list of objects with fields {', '.join(VS_FLA_FIELDS)}")
    for i, r in enumerate(rows):
        missing = [f for f in VS_FLA_FIELDS if f not in r]
        if missing:
            raise UserError(f"{path}: entry {i} lacks {', '.join(missing)}")
    return rows


def problem_of_row(row: dict) -> Problem:
    """The problem a ``vs_fla.json`` row was measured on (a packed row's, N sequences in one row of T
    tokens, is packed)."""
    return Problem(**{f: row[f] for f in PROBLEM_FIELDS}, packed="sequences" in row)


@dataclass
class ProblemView:
    """Everything one problem's page shows."""

    problem: Problem
    winners: list[tuple[Winner, list[Verdict]]] = field(default_factory=list)
    studies: dict[str, list[TrialRecord]] = field(default_factory=dict)
    versus: dict[int, VersusFla] = field(default_factory=dict)  # by winner id, where FLA was measured beside it

    @property
    def page(self) -> str:
        p = self.problem
        return f"{p.variant}-k{p.dk}-v{p.dv}-{p.dtype}-b{p.batch}-t{p.seqlen}-h{p.heads}{'-packed' if p.packed else ''}.html"

    @property
    def title(self) -> str:
        p = self.problem
        return f"{p.variant} k{p.dk} v{p.dv} {p.dtype} · B{p.batch} T{p.seqlen} H{p.heads}{' packed' if p.packed else ''}"

    @property
    def latest(self) -> list[Verdict]:
        return [history[-1] for _, history in self.winners if history]

    @property
    def flagged(self) -> bool:
        return any(v.flagged for v in self.latest) or any(v.flagged for v in self.versus.values())

    @property
    def distinctions(self) -> dict[int, str]:
        """What tells this problem's winners apart, by winner id (:func:`tuner.regress.distinctions`)."""
        return distinctions([w for w, _ in self.winners])

    @property
    def timed_studies(self) -> dict[str, list[TrialRecord]]:
        """The studies with at least one timed trial, by name in name order."""
        return {name: trials for name, trials in sorted(self.studies.items()) if any(map(is_timed, trials))}

    def trial_of(self, w: Winner) -> TrialRecord | None:
        """The trial that made ``w`` the winner."""
        return next((t for t in self.studies.get(w.study, ()) if t.number == w.trial_number), None)


def collect(store: Store) -> list[ProblemView]:
    """One view per problem that has a winner or a trial, in variant-registry then shape order."""
    views: dict[Problem, ProblemView] = {}
    history: dict[int, list[Measurement]] = defaultdict(list)
    for m in store.history():
        history[m.winner_id].append(m)
    baselines: dict[tuple, list[Baseline]] = defaultdict(list)
    for b in store.baselines():
        baselines[b.problem, b.stack.gpu].append(b)
    for w in store.winners():
        view = views.setdefault(w.problem, ProblemView(w.problem))
        view.winners.append((w, judge_history(history[w.id])))
        versus = versus_fla(history[w.id], baselines[w.problem, w.stack.gpu])
        if versus is not None:
            view.versus[w.id] = versus
    for t in store.trials():
        views.setdefault(t.problem, ProblemView(t.problem)).studies.setdefault(t.study, []).append(t)
    order = list(variants.VARIANTS)
    return sorted(views.values(), key=lambda v: (order.index(v.problem.variant), v.problem.dk, v.problem.dv,
                                                 v.problem.dtype, v.problem.batch * v.problem.heads,
                                                 v.problem.seqlen, v.problem.batch, v.problem.packed))
