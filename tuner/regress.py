"""Regression watch: has a stored winner become slower, or stopped passing the gate, since it was tuned?

``tune regress`` re-gates and re-times every stored winner of this machine's GPU on the current
stack and appends each measurement to the winner's history; ``tune regress --replay`` judges the
recorded history without a GPU (what CI runs). Both exit 1 when anything regressed.

The rule (:func:`judge`): a measurement is compared with its *reference*, the fastest earlier
measurement of the same winner that passed the gate (normally the one taken when it was tuned;
a later, faster one once an upgrade made it faster, so a slowdown measured twice stays flagged).
Every measurement carries its own spread, the 10th and 90th percentile of its repetitions. It

- **failed** when it did not pass the gate;
- **regressed** when its band lies wholly above the reference's (``p10 > reference p90``) *and* its
  median is more than :data:`tuner.bench.MIN_SHIFT` above the reference's: the spread says the change is not
  noise, the floor keeps a very tight band from flagging a shift nobody would act on;
- **improved** in the mirror case, **steady** otherwise, and **first** without a reference.

A verdict names what changed between the two measurements (GPU, TileLang, CUDA, driver, torch)
so the reader sees why, not just that.

Against FLA (:func:`versus_fla`): ``tune regress`` re-times FLA's op at each winner's shape too
(when FLA is installed; :mod:`tuner.baseline`), and each timed measurement of a winner is paired
with FLA's measured on the same stack (GPU, CUDA, driver, torch) nearest in time, judged by the
same noise rule: **slower**, **faster** or **even**, or **fla_failed** when FLA's op did not pass
the gate. A winner **fell behind** FLA when its latest pair is slower and an earlier one was not:
that is a regression (exit 1). A winner slower than FLA in every pair is **behind**: reported, not
flagged, since ``tuner.ops`` calls FLA for it (:mod:`tuner.lookup`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from . import baseline, bench, gate, limits, stack, variants
from .errors import UserError
from .problem import Problem
from .store import Baseline, Measurement, Store, Winner

VERDICTS = ("failed", "regressed", "improved", "steady", "first")
FLAGGED = ("failed", "regressed")


@dataclass(frozen=True)
class Verdict:
    """The judgement of one measurement of a winner.

    Args:
        measurement (Measurement): the measurement judged.
        reference (Measurement | None): what it was judged against; None for the first.
        kind (str): one of :data:`VERDICTS`.
        reason (str): the numbers behind the verdict, in words.
        changes (tuple[str, ...]): what differs between the reference's stack and the measurement's,
            e.g. ``("tilelang 0.1.15 -> 0.1.16",)``.
    """

    measurement: Measurement
    reference: Measurement | None
    kind: str
    reason: str
    changes: tuple[str, ...] = ()

    @property
    def flagged(self) -> bool:
        """Whether this verdict makes ``tune regress`` exit 1."""
        return self.kind in FLAGGED


def stack_changes(before: Measurement, after: Measurement) -> tuple[str, ...]:
    """What differs between two measurements' stacks and kernel sources, as ``"name old -> new"``."""
    changes = tuple(f"{name} {old} -> {new}" for name, old in before.stack.as_dict().items()
                    if old != (new := getattr(after.stack, name)))
    if before.digest and after.digest and before.digest != after.digest:
        changes += (f"template {before.digest} -> {after.digest}",)
    return changes


def format_errors(errors: dict | None) -> str:
    """The gate's errors in one line: nested regimes flattened, ``uniform.o=0.31, ...``."""
    def flat(d: dict, prefix: str = ""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}={v:.3g}" if isinstance(v, float) else f"{prefix}{k}={v}"
    return ", ".join(flat(errors or {}))


def _timed(m: Measurement) -> bool:
    return m.status == "pass" and None not in (m.median_ms, m.p10_ms, m.p90_ms)


def reference_of(previous: Iterable[Measurement]) -> Measurement | None:
    """The fastest earlier measurement that passed the gate, or None."""
    return min((m for m in previous if _timed(m)), key=lambda m: m.median_ms, default=None)


def compare(m, ref) -> tuple[str, str]:
    """``m`` against ``ref`` (each a timed :class:`Measurement` or :class:`Baseline`) by the noise rule:
    ``"slower"`` or ``"faster"`` beyond the noise, else ``"within"``; and the numbers, in words."""
    shift = m.median_ms / ref.median_ms - 1
    numbers = (f"median {m.median_ms:.4g} ms [p10 {m.p10_ms:.4g}, p90 {m.p90_ms:.4g}] against "
               f"{ref.median_ms:.4g} ms [p10 {ref.p10_ms:.4g}, p90 {ref.p90_ms:.4g}] ({shift:+.1%})")
    return bench.change_beyond_noise(m, ref), numbers


def judge(measurement: Measurement, previous: Iterable[Measurement]) -> Verdict:
    """Judge ``measurement`` against the measurements of the same winner before it (module docstring).

    Args:
        measurement (Measurement): the new measurement.
        previous (Iterable[Measurement]): the winner's earlier measurements, any order.

    Returns:
        Verdict
    """
    ref = reference_of(previous)
    changes = stack_changes(ref, measurement) if ref else ()
    if measurement.status != "pass":
        errors = format_errors(measurement.gate_errors)
        return Verdict(measurement, ref, "failed", f"gate: {measurement.status}" + (f" ({errors})" if errors else ""),
                       changes)
    if ref is None:
        return Verdict(measurement, None, "first", "nothing earlier to compare with")
    change, numbers = compare(measurement, ref)
    kind, words = {"slower": ("regressed", "slower beyond the noise"), "faster": ("improved", "faster beyond the noise"),
                   "within": ("steady", "within the noise")}[change]
    return Verdict(measurement, ref, kind, f"{words}: {numbers}", changes)


def judge_history(history: list[Measurement]) -> list[Verdict]:
    """Each measurement of one winner's history (oldest first) judged against those before it."""
    return [judge(m, history[:i]) for i, m in enumerate(history)]


@dataclass(frozen=True)
class Pair:
    """A timed measurement of a winner beside FLA's on the same stack at the same shape.

    Args:
        ours (Measurement): the winner's.
        fla (Baseline): FLA's op's, measured nearest in time.
        kind (str): ``"slower"``, ``"faster"`` or ``"even"`` (the noise rule, ours against FLA's), or
            ``"fla_failed"`` (FLA's op did not pass the gate).
    """

    ours: Measurement
    fla: Baseline
    kind: str

    @property
    def ratio(self) -> float | None:
        """Our median over FLA's; None when FLA's op was not timed."""
        return self.ours.median_ms / self.fla.median_ms if self.fla.timed else None


@dataclass(frozen=True)
class VersusFla:
    """A winner against FLA over its history: its pairs, oldest first (module docstring)."""

    pairs: tuple[Pair, ...]

    @property
    def latest(self) -> Pair:
        return self.pairs[-1]

    @property
    def kind(self) -> str:
        """``fell_behind`` (flagged), ``behind``, ``faster``, ``even`` or ``fla_failed``: the latest pair's."""
        if self.latest.kind != "slower":
            return self.latest.kind
        earlier = any(p.kind in ("faster", "even") for p in self.pairs[:-1])
        return "fell_behind" if earlier else "behind"

    @property
    def flagged(self) -> bool:
        """Whether this makes ``tune regress`` exit 1: the winner fell behind FLA."""
        return self.kind == "fell_behind"

    @property
    def reason(self) -> str:
        """The latest pair in words."""
        pair = self.latest
        if self.kind == "fla_failed":
            errors = format_errors(pair.fla.gate_errors)
            return f"FLA {pair.fla.fla_version}'s op did not pass the gate: {pair.fla.status}" + \
                (f" ({errors})" if errors else "")
        words = {"fell_behind": "slower than FLA beyond the noise, and it was not before",
                 "behind": "slower than FLA in every comparison (tuner.ops calls FLA here)",
                 "faster": "faster than FLA beyond the noise", "even": "even with FLA, within the noise"}[self.kind]
        return f"{words}: {pair.ratio:.2f}x FLA {pair.fla.fla_version}, {compare(pair.ours, pair.fla)[1]}"


def same_stack(a, b) -> bool:
    """Whether two measurements ran on one stack, as far as FLA's time goes (``baseline.IDENTITY``)."""
    return all(getattr(a.stack, field) == getattr(b.stack, field) for field in baseline.IDENTITY)


def versus_fla(history: list[Measurement], baselines: list[Baseline]) -> VersusFla | None:
    """One winner's ``history`` (oldest first) against ``baselines`` (FLA's op at the winner's shape):
    each timed measurement paired with FLA's on the same stack nearest in time, judged; None
    without a pair."""
    pairs = []
    for m in filter(_timed, history):
        same = [b for b in baselines if same_stack(b, m)]
        if not same:
            continue
        fla = min(same, key=lambda b: abs(b.measured_at - m.measured_at))
        if not fla.timed:
            pairs.append(Pair(m, fla, "fla_failed"))
            continue
        change = compare(m, fla)[0]
        pairs.append(Pair(m, fla, "even" if change == "within" else change))
    return VersusFla(tuple(pairs)) if pairs else None


@dataclass(frozen=True)
class Outcome:
    """A winner, the verdict on its latest measurement (None: nothing recorded for it) and how it
    stands against FLA (None: no FLA measurement beside it)."""

    winner: Winner
    verdict: Verdict | None
    note: str = ""
    versus: VersusFla | None = None

    @property
    def flagged(self) -> bool:
        return (self.verdict is not None and self.verdict.flagged) or (self.versus is not None and self.versus.flagged)


def _versus(store: Store, w: Winner, history: list[Measurement]) -> VersusFla | None:
    return versus_fla(history, store.baselines(**w.problem.as_dict(), gpu=w.stack.gpu))


def _selected(store: Store, names: list[str] | None) -> list[Winner]:
    for name in names or ():
        variants.get(name)
    return [w for w in store.winners() if not names or w.problem.variant in names]


def replay(store: Store, names: list[str] | None = None) -> list[Outcome]:
    """Judge each selected winner's latest recorded measurement against the earlier ones.

    Args:
        store (Store): the results database (opened read-only is enough; nothing is written).
        names (list[str]): limit to these variants. Default: None (all).

    Returns:
        list[Outcome]: one per winner, in the store's order.
    """
    outcomes = []
    for w in _selected(store, names):
        history = store.history(w.id)
        verdict = judge(history[-1], history[:-1]) if history else None
        outcomes.append(Outcome(w, verdict, "" if history else "no recorded measurement", _versus(store, w, history)))
    return outcomes


def remeasure(store: Store, names: list[str] | None = None, *, device: int = 0) -> list[Outcome]:
    """Re-gate and re-time the selected winners of this GPU, record and judge each measurement.

    Winners tuned on another GPU model are listed with a note and not timed: their latency says
    nothing about this one. A winner whose config now renders a different kernel (the template
    changed) is timed as it renders today, with a note saying so. Winners of one kernel at several
    shapes are gated once and timed at each shape in the same child (``gate_and_time``'s
    ``also_at``): the gate does not depend on the shape. FLA's op is gated and timed at the shapes
    of the timed winners too (when FLA is installed; a note says so otherwise), recorded as a
    baseline, and each winner judged against it (:func:`versus_fla`).

    Args:
        store (Store): the results database, writable.
        names (list[str]): limit to these variants. Default: None (all).
        device (int): CUDA device index. Default: 0.

    Returns:
        list[Outcome]: one per winner, in the store's order.
    """
    if not stack.has_gpu():
        raise UserError("no CUDA device: `tune regress` re-times the winners on the GPU; "
                        "`tune regress --replay` judges the recorded history without one")
    from .candidate import Candidate
    from .search import record_baselines

    env = stack.current(device)
    selected = _selected(store, names)
    outcomes: dict[int, Outcome] = {}
    # (the kernel as it renders today, packed) -> its candidate (at the first winner's shape) and its winners
    kernels: dict[str, tuple[Candidate, list[Winner]]] = {}
    for w in selected:
        if w.stack.gpu != env.gpu:
            outcomes[w.id] = Outcome(w, None, f"tuned on {w.stack.gpu}, not timed on {env.gpu}")
            continue
        candidate = Candidate.from_config(w.problem, w.config)
        # Packed and dense problems are timed on different inputs: one gate child each.
        kernels.setdefault((candidate.digest, w.problem.packed), (candidate, []))[1].append(w)
    for (digest, _), (candidate, group) in kernels.items():
        first = group[0]
        also_at = tuple(dict.fromkeys(w.problem.shape for w in group if w.problem.shape != first.problem.shape))
        result = gate.gate_and_time(candidate, also_at=also_at, timeout_s=limits.GATE_S, device=device)
        for w in group:
            note = "" if digest == w.digest else f"template changed: kernel {w.digest} now renders as {digest}"
            status, timing, failure = gate.outcome_at(result, w.problem.shape, first.problem.shape)
            note = failure or note
            previous = store.history(w.id)
            measurement = store.add_measurement(Measurement(
                winner_id=w.id, status=status, stack=env, gate_errors=result.errors,
                median_ms=timing.get("median_ms"), p10_ms=timing.get("p10_ms"), p90_ms=timing.get("p90_ms"),
                digest=digest))
            outcomes[w.id] = Outcome(w, judge(measurement, previous), note)
    timed = [w for _, group in kernels.values() for w in group if baseline.has_baseline(w.problem.variant)]
    version, missing = baseline.installed_version(), ""
    if version is None:
        missing = f"FLA is not installed: its op was not re-timed ({baseline.INSTALL})"
    else:
        record_baselines(dict.fromkeys(w.problem for w in timed), store, env, gate.gate_and_time, device, version)
    for w in timed:
        o = outcomes[w.id]
        outcomes[w.id] = replace(o, note="; ".join(filter(None, (o.note, missing))),
                                 versus=_versus(store, w, store.history(w.id)))
    return [outcomes[w.id] for w in selected]


def time_fla(store: Store, names: list[str] | None = None, *, device: int = 0,
             note=print) -> list[Outcome]:
    """Gate and time FLA's op at the shapes of the selected winners of this GPU where it was not yet
    measured on this stack with the installed FLA autotuned at that shape, record it, and judge each
    winner's recorded history against it (:func:`replay`). No winner is re-timed: this fills in the
    baselines beside winners timed on this stack before FLA was installed, or upgraded, and measures
    again those taken before FLA was autotuned per shape.

    Args:
        store (Store): the results database, writable.
        names (list[str]): limit to these variants. Default: None (all).
        device (int): CUDA device index. Default: 0.
        note (Callable[[str], None]): told what is timed and why nothing is. Default: print.

    Returns:
        list[Outcome]: one per winner, in the store's order.
    """
    if not stack.has_gpu():
        raise UserError("no CUDA device: `tune regress --fla-only` times FLA's op on the GPU")
    if baseline.installed_version() is None:
        raise UserError(f"FLA is not installed: there is nothing to time ({baseline.INSTALL})")
    from .search import time_missing_baselines

    env = stack.current(device)
    kernel_problems: dict[tuple, dict[Problem, None]] = {}
    for w in _selected(store, names):
        if w.stack.gpu == env.gpu:
            p = w.problem
            kernel_problems.setdefault((p.variant, p.dk, p.dv, p.dtype), {})[p] = None
    for problems in kernel_problems.values():
        time_missing_baselines(list(problems), store, env, gate.gate_and_time, device, note)
    return replay(store, names)


def winner_label(w: Winner) -> str:
    """``gdn k128 v128 bf16 B4 T8192 H16`` on ``NVIDIA H200``: a winner in one line."""
    p = w.problem
    return f"{p.variant} k{p.dk} v{p.dv} {p.dtype} B{p.batch} T{p.seqlen} H{p.heads}"


def distinctions(winners: list[Winner]) -> dict[int, str]:
    """What tells apart winners of one problem on one GPU (several studies, ``--fix`` or ``--also-at``,
    each keep their own): the config entries that differ among them (``split=pre_seq block_dv=32``),
    else the kernel digest; "" for a winner alone. Keyed by winner id."""
    groups: dict[tuple, list[Winner]] = {}
    for w in winners:
        groups.setdefault((w.problem, w.stack.gpu), []).append(w)
    out = {}
    for group in groups.values():
        names = sorted({k for w in group for k in w.config})
        differing = [k for k in names if len({repr(w.config.get(k)) for w in group}) > 1]
        for w in group:
            if len(group) == 1:
                out[w.id] = ""
            elif differing:
                out[w.id] = " ".join(f"{k}={w.config.get(k, '-')}" for k in differing)
            else:
                out[w.id] = f"kernel {w.digest}"
    return out


def print_outcomes(outcomes: list[Outcome], replayed: bool) -> None:
    """The outcomes as a table, flagged rows first, and a one-line conclusion."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=200)
    table = Table(title="recorded history, latest measurement judged" if replayed else "re-measured winners")
    for column in ("winner", "gpu", "verdict", "why", "stack changes", "against FLA", "note"):
        table.add_column(column)
    styles = {"failed": "bold red", "regressed": "bold red", "improved": "green", "fell_behind": "bold red",
              "faster": "green"}

    def styled(kind: str) -> str:
        return f"[{styles[kind]}]{kind}[/]" if kind in styles else kind

    distinct = distinctions([o.winner for o in outcomes])
    for o in sorted(outcomes, key=lambda o: not o.flagged):
        v, versus = o.verdict, o.versus
        label = " · ".join(filter(None, (winner_label(o.winner), distinct[o.winner.id])))
        cells = (label, o.winner.stack.gpu, v.reason if v else "", ", ".join(v.changes) if v else "",
                 versus.reason if versus else "", o.note)
        label, gpu, reason, changes, fla, note = map(escape, cells)  # reasons hold "[p10 ..., p90 ...]"
        table.add_row(label, gpu, styled(v.kind if v else "-"), reason, changes,
                      f"{styled(versus.kind)}: {fla}" if versus else "-", note)
    console.print(table)
    flagged = sum(o.flagged for o in outcomes)
    behind = sum(o.versus is not None and o.versus.flagged for o in outcomes)
    console.print((f"{flagged} of {len(outcomes)} winners regressed" + (f" ({behind} fell behind FLA)" if behind else ""))
                  if flagged else f"no regression among {len(outcomes)} winners")


def regress_main(db: str, names: list[str] | None = None, *, replay_only: bool = False, fla_only: bool = False,
                 device: int = 0) -> int:
    """``tune regress``: re-measure (with ``replay_only`` just judge; with ``fla_only`` time the missing
    FLA baselines and judge) and print; exit 1 on a regression."""
    if replay_only:
        store = Store(db, readonly=True)
        outcomes = replay(store, names)
    else:
        store = Store(db)
        outcomes = (time_fla if fla_only else remeasure)(store, names, device=device)
    store.close()
    print_outcomes(outcomes, replay_only or fla_only)
    return 1 if any(o.flagged for o in outcomes) else 0
