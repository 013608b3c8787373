"""What ``tune run`` prints: where its files go, its progress, and the summary table.

On a terminal the progress is a rich bar; elsewhere (a log, CI, a pipe) a line per kernel judged,
with the time left at the pace seen so far. The counts read the same in both and in the summary:
the kernels judged by outcome, then the proposals that cost nothing (broken constraints, model
prunes, repeats of a judged kernel).
"""
from __future__ import annotations

import os
import sys
import time
from collections import Counter

from .search import Observer, TuneSummary, judged_count
from .status import FAILED, Status
from .store import TrialRecord


def describe_counts(counts: Counter, repeats: int, gated: bool) -> str:
    """The counts in words (``counts`` per status, repeats left out; they are ``repeats``)."""
    failed = sum(counts[s] for s in FAILED)
    judged = (f"passed {counts[Status.PASS]}, failed {failed}" if gated else
              f"compiled {counts[Status.COMPILED]}, failed {failed} (no GPU: none gated or timed)")
    return (f"{judged}; not compiled: {counts[Status.CONSTRAINT]} broke a constraint, {counts[Status.PRUNED]} "
            f"pruned by the register model, {repeats} repeated a judged kernel")


class Progress(Observer):
    """The run's progress, on a terminal or not."""

    def __init__(self):
        self.bar = None
        self.start = time.monotonic()

    def started(self, runner, trials: int | None) -> None:
        from .compile import kernels_dir

        self.total, self.start = trials, time.monotonic()
        self.judged_at_start = self.printed = runner.judged
        tilelang_cache = os.environ.get("TILELANG_CACHE_DIR", "~/.tilelang/cache")  # TileLang's default
        print(f"tune: results go to {runner.recorder.store.where}; compile log {runner.compile_log}; kernels "
              f"cached in {kernels_dir()} and {tilelang_cache}", flush=True)
        if not runner.gated:
            left = "kernels until the deadline" if trials is None else f"{max(trials - runner.judged, 0)} kernels"
            seen = sorted(r.compile_seconds for r in runner.recorder.judged.values() if r.compile_seconds)
            if seen and trials is not None:
                per = seen[len(seen) // 2]
                pace = (f"about {per:.0f} s a compile in this study so far, so about "
                        f"{_minutes(per * max(trials - runner.judged, 0) / runner.jobs)}")
            else:
                pace = "the time left is shown as kernels are judged (a compile for sm_90a takes 10-60 s here)"
            print(f"tune: no GPU: compiling {left} for sm_90a on {runner.jobs} processes, none gated or timed; "
                  f"{pace}; --trials N compiles fewer", flush=True)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]tuning"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.description}"), TimeElapsedColumn())
            self.task = self.bar.add_task("", total=trials)
            self.bar.start()
        self.update(runner)

    def update(self, runner) -> None:
        best = runner.best_ms
        text = (describe_counts(runner.recorder.counts, runner.recorder.repeats, runner.gated)
                + (f"; best {best:.4f} ms" if best is not None else ""))
        judged = runner.judged
        if self.bar is not None:
            self.bar.update(self.task, completed=judged, description=text)
        elif judged > self.printed:
            self.printed = judged
            elapsed = time.monotonic() - self.start
            left = ""
            if self.total is not None and judged < self.total:
                pace = elapsed / (judged - self.judged_at_start)
                left = f", about {_minutes(pace * (self.total - judged))} left"
            print(f"tune: {judged}/{self.total or '?'} kernels judged after {_minutes(elapsed)}{left}: {text}",
                  flush=True)

    def note(self, message: str) -> None:
        (self.bar.console.print if self.bar is not None else print)(f"tune: note: {message}")

    def finished(self, runner) -> None:
        self.update(runner)
        if self.bar is not None:
            self.bar.stop()


def print_summary(summary: TuneSummary) -> None:
    """The counts and the winner against the template's default, as a table, for the study and
    for each of its companion studies (``--also-at``)."""
    from rich.console import Console

    console = Console()
    for study in (summary, *summary.also_at):
        _print_study(console, study)
    if not summary.gated:
        console.print("No GPU: configs were pruned and compiled only; latency needs a GPU (run again on one).")
    console.print(f"results: {summary.database}", soft_wrap=True)


def _print_study(console, summary: TuneSummary) -> None:
    from rich.table import Table

    trials = sum(summary.counts.values()) + summary.repeats
    stale = (f"; {summary.stale} of the kernels judged are no longer what the templates render (not counted "
             "toward --trials, never the winner)" if summary.stale else "")
    console.print(f"study {summary.study}: {trials} trials, {judged_count(summary.counts)} kernels judged: "
                  f"{describe_counts(summary.counts, summary.repeats, summary.gated)}{stale}", soft_wrap=True)
    table = Table(title="winner vs the template's default")
    table.add_column("")
    rows = (summary.winner, summary.default)
    for label in ("winner", "default"):
        table.add_column(label)
    for label, show in (("trial", lambda r: str(r.number)), ("status", lambda r: str(r.status)),
                        ("latency median (p10-p90)", _latency), ("registers ptxas / predicted", _registers),
                        ("config", lambda r: "\n".join(f"{k}={v}" for k, v in r.config.items()))):
        table.add_row(label, *(show(r) if r is not None else "-" for r in rows))
    console.print(table)
    if summary.speedup is not None:
        console.print(f"speed-up over the default: {summary.speedup:.2f}x")


def _registers(record: TrialRecord) -> str:
    kernels = (record.compile_report or {}).get("kernels", [])
    measured = max((k["registers"] for k in kernels if k.get("registers") is not None), default=None)
    predicted = (record.prediction or {}).get("registers")
    return " / ".join(str(x) for x in (measured, predicted) if x is not None) or "-"


def _latency(record: TrialRecord) -> str:
    if record.median_ms is None:
        return "-"
    return f"{record.median_ms:.4f} ms ({record.p10_ms:.4f}-{record.p90_ms:.4f})"


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
