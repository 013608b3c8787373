"""The static dashboard: what was tuned, how it has held up since, and why it is fast or slow.

``tune dashboard --db results.db --out site/`` writes plain HTML with inline SVG charts drawn
here and one stylesheet copied from ``dashboard_assets/``: no script, nothing fetched, so the site
opens from disk (``file://``) and can be archived as a CI artefact. Pages:

- ``index.html``: every problem with its winners, latest verdict (:mod:`tuner.regress`'s rule)
  and a sparkline of its history; our kernels against FLA and the memory-bound floor
  (``benchmarks/vs_fla.json`` from ``benchmarks/vs_fla.py``, "not measured" without it).
- one page per problem (variant, head dims, dtype, timed shape): the latency history of each
  winner across runs with its p10-p90 band, the reference band, stack changes (TileLang, CUDA,
  driver, torch) marked where they happened and regressions marked on the point; the winners'
  configs, registers (ptxas / predicted) and gate errors; tuning convergence (best latency
  against trial number and against cumulative GPU-seconds); which parameters mattered.
- ``model.html``: the register model's prediction against ptxas, one scatter per variant.

Which parameters mattered is measured without a model, from the timed trials of a study: for
each value of a parameter, the best latency any trial with that value reached; the parameter's
weight is how much slower the best of its worst value is than the best of its best value, i.e.
what a wrong choice of it costs when everything else is tuned (:func:`parameter_effects`).
"""
from __future__ import annotations

import html
import json
import math
import shutil
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from . import variants
from .errors import UserError
from .problem import Problem
from .regress import Verdict, distinctions, format_errors, judge_history, stack_changes, winner_label
from .store import CalibrationPoint, Measurement, Store, TrialRecord, Winner, utcnow

ASSETS = Path(__file__).resolve().parent / "dashboard_assets"
DEFAULT_VS_FLA = variants.ROOT / "benchmarks" / "vs_fla.json"
VS_FLA_FIELDS = ("variant", "dk", "dv", "dtype", "batch", "seqlen", "heads", "ours_ms", "fla_ms", "floor_ms")
# Line colours of several series in one chart (studies on different stacks).
FLA_BARS = (("ours_ms", "ours", "ours"), ("fla_ms", "fla", "FLA"), ("floor_ms", "floor", "floor"))
PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#be123c")


def esc(value) -> str:
    return html.escape(str(value), quote=True)


# --------------------------------------------------------------------------------------------
# SVG charts


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (1, 2 or 5 times a power of ten apart) within [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def padded(values: Iterable[float], pad: float = 0.08, floor: float | None = None) -> tuple[float, float]:
    """The range of ``values`` widened by ``pad`` of its width on both sides (never below ``floor``)."""
    values = list(values)
    lo, hi = min(values), max(values)
    width = hi - lo or abs(hi) * 0.1 or 1.0
    lo, hi = lo - pad * width, hi + pad * width
    return (max(lo, floor) if floor is not None else lo), hi


def tick_text(v: float) -> str:
    return f"{v:.4g}"


class Plot:
    """An SVG canvas with data coordinates, axes and a title; charts append elements to ``parts``.

    Args:
        kind (str): the chart's kind, a CSS class (``chart-history``, ``chart-convergence``, ...).
        xlim, ylim (tuple[float, float]): data ranges mapped onto the plot area.
        width, height (int): size in pixels.
    """

    def __init__(self, kind: str, title: str, xlim: tuple[float, float], ylim: tuple[float, float], *,
                 width: int = 560, height: int = 280, xlabel: str = "", ylabel: str = "",
                 margins: tuple[int, int, int, int] = (30, 16, 46, 62), caption: bool = True):
        self.kind, self.title, self.xlim, self.ylim = kind, title, xlim, ylim
        self.width, self.height, self.xlabel, self.ylabel = width, height, xlabel, ylabel
        self.top, self.right, self.bottom, self.left = margins
        self.caption = caption
        self.parts: list[str] = []

    def x(self, v: float) -> float:
        lo, hi = self.xlim
        return self.left + (v - lo) / (hi - lo) * (self.width - self.left - self.right)

    def y(self, v: float) -> float:
        lo, hi = self.ylim
        return self.height - self.bottom - (v - lo) / (hi - lo) * (self.height - self.top - self.bottom)

    def add(self, element: str) -> None:
        self.parts.append(element)

    def axes(self, xticks: Sequence[tuple[float, str]] | None = None, yticks: bool = True) -> None:
        """Grid, both axes with ticks (``xticks``: positions with labels, None: round numbers;
        ``yticks``: False where rows, not values, run down the y axis)."""
        x0, x1, y0, y1 = self.left, self.width - self.right, self.height - self.bottom, self.top
        if xticks is None:
            xticks = [(v, tick_text(v)) for v in nice_ticks(*self.xlim)]
        yticks = nice_ticks(*self.ylim) if yticks else []
        grid = "".join(f'<line x1="{x0}" x2="{x1}" y1="{self.y(v):.1f}" y2="{self.y(v):.1f}"/>' for v in yticks)
        ticks = "".join(f'<text x="{x0 - 6}" y="{self.y(v) + 4:.1f}" text-anchor="end">{tick_text(v)}</text>'
                        for v in yticks)
        ticks += "".join(f'<text x="{self.x(v):.1f}" y="{y0 + 15}" text-anchor="middle">{esc(label)}</text>'
                         for v, label in xticks)
        self.add(f'<g class="grid">{grid}</g>')
        self.add(f'<g class="axis"><path d="M{x0},{y1} V{y0} H{x1}" fill="none"/>{ticks}'
                 f'<text x="{(x0 + x1) / 2}" y="{self.height - 8}" text-anchor="middle">{esc(self.xlabel)}</text>'
                 f'<text transform="translate(14,{(y0 + y1) / 2}) rotate(-90)" text-anchor="middle">'
                 f'{esc(self.ylabel)}</text></g>')

    def legend(self, entries: Sequence[tuple[str, str]]) -> None:
        """Coloured labels along the top right: (label, colour)."""
        x = self.width - self.right
        items = []
        for label, colour in reversed(entries):
            x -= 14 + 6.2 * len(label)
            items.append(f'<rect x="{x:.0f}" y="{self.top - 15}" width="10" height="10" style="fill:{colour}"/>'
                         f'<text x="{x + 13:.0f}" y="{self.top - 6}">{esc(label)}</text>')
        self.add(f'<g class="legend">{"".join(items)}</g>')

    def svg(self) -> str:
        return (f'<svg class="chart {self.kind}" xmlns="http://www.w3.org/2000/svg" width="{self.width}" '
                f'height="{self.height}" viewBox="0 0 {self.width} {self.height}" role="img" '
                f'aria-label="{esc(self.title)}"><title>{esc(self.title)}</title>'
                + (f'<text class="chart-title" x="{self.left}" y="16">{esc(self.title)}</text>' if self.caption else "")
                + "".join(self.parts) + "</svg>")


def polyline(points: Sequence[tuple[float, float]], colour: str, cls: str = "series") -> str:
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return f'<polyline class="{cls}" points="{path}" stroke="{colour}"/>'


def stack_label(m: Measurement | Winner) -> str:
    e = m.stack
    return f"TileLang {e.tilelang} · CUDA {e.cuda} · driver {e.driver} · torch {e.torch}"


def history_chart(winner: Winner, verdicts: list[Verdict]) -> str:
    """Latency of each measurement of ``winner`` (median, p10-p90 whisker) in order, the latest
    verdict's reference band shaded, stack changes as dashed lines, regressions marked."""
    timed = [v.measurement for v in verdicts if v.measurement.median_ms is not None]
    latest_ref = verdicts[-1].reference if verdicts else None
    bounds = [x for m in timed + ([latest_ref] if latest_ref else []) for x in (m.p10_ms, m.p90_ms)]
    lo, hi = padded(bounds or [0.0, 1.0], pad=0.15, floor=0.0)
    ylim = (lo, hi + 0.2 * (hi - lo))  # headroom for regression markers and stack-change labels
    n = len(verdicts)
    every = max(1, math.ceil(n / 10))
    plot = Plot("chart-history", f"latency history: {winner_label(winner)} on {winner.stack.gpu}",
                (-0.6, max(n - 0.4, 0.6)), ylim, width=760, height=300, xlabel="measurement (date)",
                ylabel="latency (ms)")
    plot.axes([(i, v.measurement.measured_at.strftime("%m-%d")) for i, v in enumerate(verdicts) if i % every == 0])
    top, bottom = plot.top, plot.height - plot.bottom
    if latest_ref is not None:
        y1, y0 = plot.y(latest_ref.p90_ms), plot.y(latest_ref.p10_ms)
        plot.add(f'<rect class="reference-band" x="{plot.left}" width="{plot.width - plot.left - plot.right}" '
                 f'y="{y1:.1f}" height="{max(y0 - y1, 1):.1f}"><title>reference {latest_ref.median_ms:.4g} ms, '
                 f'p10-p90 {latest_ref.p10_ms:.4g}-{latest_ref.p90_ms:.4g} ms '
                 f'({latest_ref.measured_at:%Y-%m-%d})</title></rect>')
    for i in range(1, n):
        changes = stack_changes(verdicts[i - 1].measurement, verdicts[i].measurement)
        if changes:
            x = plot.x(i - 0.5)
            short = ", ".join(c.split(" -> ")[0].split(" ")[0] + " " + c.split(" -> ")[1] for c in changes)
            plot.add(f'<g class="stack-change"><line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{bottom}"/>'
                     f'<text x="{x + 3:.1f}" y="{top + 10}">{esc(short)}</text>'
                     f'<title>{esc("; ".join(changes))}</title></g>')
    line = [(plot.x(i), plot.y(v.measurement.median_ms)) for i, v in enumerate(verdicts)
            if v.measurement.median_ms is not None]
    plot.add(polyline(line, PALETTE[0]))
    for i, v in enumerate(verdicts):
        m, x = v.measurement, plot.x(i)
        tip = esc(f"{m.measured_at:%Y-%m-%d %H:%M} · {stack_label(m)}\n{v.kind}: {v.reason}"
                  + (f"\nchanged: {'; '.join(v.changes)}" if v.changes else ""))
        if m.median_ms is None:
            yb = bottom - 10
            plot.add(f'<path class="marker failed" data-verdict="failed" d="M{x - 6:.1f},{yb - 6} l12,12 '
                     f'm-12,0 l12,-12"><title>{tip}</title></path>')
            continue
        plot.add(f'<line class="whisker" x1="{x:.1f}" x2="{x:.1f}" y1="{plot.y(m.p10_ms):.1f}" '
                 f'y2="{plot.y(m.p90_ms):.1f}"/>')
        plot.add(f'<circle class="point {v.kind}" data-verdict="{v.kind}" cx="{x:.1f}" '
                 f'cy="{plot.y(m.median_ms):.1f}" r="5"><title>{tip}</title></circle>')
        if v.kind == "regressed":
            ym = plot.y(m.p90_ms) - 8
            plot.add(f'<path class="marker regressed" data-verdict="regressed" '
                     f'd="M{x:.1f},{ym:.1f} l-7,-12 h14 z"><title>{tip}</title></path>')
    return plot.svg()


def sparkline(verdicts: list[Verdict]) -> str:
    """A 140x30 history in a table cell: medians, the latest point coloured by its verdict."""
    timed = [(i, v) for i, v in enumerate(verdicts) if v.measurement.median_ms is not None]
    if not timed:
        return ""
    plot = Plot("chart-sparkline", "latency history", (-0.5, max(len(verdicts) - 0.5, 0.5)),
                padded([v.measurement.median_ms for _, v in timed], pad=0.2), width=140, height=30,
                margins=(4, 4, 4, 4), caption=False)
    plot.add(polyline([(plot.x(i), plot.y(v.measurement.median_ms)) for i, v in timed], PALETTE[0]))
    i, last = timed[-1]
    plot.add(f'<circle class="point {last.kind}" data-verdict="{last.kind}" cx="{plot.x(i):.1f}" '
             f'cy="{plot.y(last.measurement.median_ms):.1f}" r="3"/>')
    return plot.svg()


@dataclass(frozen=True)
class Series:
    """One line of a convergence chart: its label, colour, step points and the dots behind it."""

    label: str
    colour: str
    steps: list[tuple[float, float]]
    dots: list[tuple[float, float]] = field(default_factory=list)


def step_chart(kind: str, title: str, series: list[Series], xlabel: str, ylabel: str) -> str:
    """Best-so-far staircases (one per series) over the points they summarise."""
    xs = [x for s in series for x, _ in s.steps + s.dots]
    ys = [y for s in series for _, y in s.steps + s.dots]
    plot = Plot(kind, title, padded(xs, pad=0.03), padded(ys, pad=0.1, floor=0.0), width=520, xlabel=xlabel,
                ylabel=ylabel)
    plot.axes()
    for s in series:
        plot.add("".join(f'<circle class="trial" cx="{plot.x(x):.1f}" cy="{plot.y(y):.1f}" r="2.5"/>'
                         for x, y in s.dots))
        stair = []
        for x, y in s.steps:
            if stair:
                stair.append((plot.x(x), stair[-1][1]))
            stair.append((plot.x(x), plot.y(y)))
        stair.append((plot.x(plot.xlim[1]), stair[-1][1]))
        plot.add(polyline(stair, s.colour))
    if len(series) > 1:
        plot.legend([(s.label, s.colour) for s in series])
    return plot.svg()


def bar_chart(kind: str, title: str, rows: list[tuple[str, list[tuple[float, str, str]]]], xlabel: str,
              legend: Sequence[tuple[str, str]] = ()) -> str:
    """Horizontal bars: rows of (label, bars), a bar being (value, CSS class, tooltip)."""
    per_row = max(len(bars) for _, bars in rows)
    bar_h, gap = 12, 10
    height = 30 + 46 + len(rows) * (per_row * bar_h + gap)
    top = max(v for _, bars in rows for v, _, _ in bars)
    plot = Plot(kind, title, (0.0, top * 1.08 or 1.0), (0.0, 1.0), width=620, height=height, xlabel=xlabel,
                margins=(30, 16, 46, 150))
    plot.axes(yticks=False)
    y = plot.top + gap / 2
    for label, bars in rows:
        plot.add(f'<text x="{plot.left - 6}" y="{y + per_row * bar_h / 2 + 4:.1f}" text-anchor="end">'
                 f'{esc(label)}</text>')
        for value, cls, tip in bars:
            plot.add(f'<rect class="bar {cls}" x="{plot.left}" y="{y:.1f}" width="{plot.x(value) - plot.left:.1f}" '
                     f'height="{bar_h - 2}"><title>{esc(tip)}</title></rect>')
            y += bar_h
        y += gap
    if legend:
        plot.legend(legend)
    return plot.svg()


def calibration_chart(variant: str, points: list[CalibrationPoint]) -> str:
    """Predicted registers against ptxas', the diagonal dashed, spill mispredictions ringed."""
    values = [v for p in points for v in (p.predicted_registers, p.ptxas_registers)]
    lim = padded(values, pad=0.08, floor=0.0)
    plot = Plot("chart-calibration", f"{variant}: predicted vs ptxas registers", lim, lim, width=380, height=340,
                xlabel="ptxas registers / thread", ylabel="predicted registers / thread")
    plot.axes()
    plot.add(f'<line class="diagonal" x1="{plot.x(lim[0]):.1f}" y1="{plot.y(lim[0]):.1f}" '
             f'x2="{plot.x(lim[1]):.1f}" y2="{plot.y(lim[1]):.1f}"/>')
    for p in points:
        cls = "miss" if is_miss(p) else "hit"
        tip = (f"{p.dk}x{p.dv} {p.dtype} {config_text(p.config)}\npredicted {p.predicted_registers} "
               f"(spills: {p.predicted_spills}), ptxas {p.ptxas_registers} (spill bytes {p.ptxas_spill_bytes})")
        plot.add(f'<circle class="calibration {cls}" cx="{plot.x(p.ptxas_registers):.1f}" '
                 f'cy="{plot.y(p.predicted_registers):.1f}" r="{6 if cls == "miss" else 4}">'
                 f'<title>{esc(tip)}</title></circle>')
    return plot.svg()


# --------------------------------------------------------------------------------------------
# What the pages show


def is_miss(p: CalibrationPoint) -> bool:
    """The model's spill verdict (what pruning acts on) differs from what ptxas reported."""
    return p.predicted_spills != (p.ptxas_spill_bytes > 0)


def config_text(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(config.items()))


def best_so_far(trials: list[TrialRecord]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(Trial number, best latency so far) at each improvement, and the same against cumulative
    GPU-seconds; the trials in number order, only ``pass`` ones timed."""
    by_number, by_seconds = [], []
    best, seconds = math.inf, 0.0
    for t in sorted(trials, key=lambda t: t.number):
        seconds += t.gpu_seconds or 0.0
        if t.status == "pass" and t.median_ms is not None and t.median_ms < best:
            best = t.median_ms
            by_number.append((t.number, best))
            by_seconds.append((seconds, best))
    return by_number, by_seconds


def parameter_effects(trials: list[TrialRecord]) -> list[tuple[str, float, dict]]:
    """How much each parameter mattered in the timed trials of one study (module docstring).

    Returns:
        list of (parameter, weight, {value: (best latency ms, timed trials)}), largest weight first;
        weight = best latency of the parameter's worst value / that of its best value - 1.
        Parameters seen with a single value are left out.
    """
    timed = [t for t in trials if t.status == "pass" and t.median_ms is not None]
    values: dict[str, dict] = defaultdict(dict)
    for t in timed:
        for name, value in t.config.items():
            best, count = values[name].get(value, (math.inf, 0))
            values[name][value] = (min(best, t.median_ms), count + 1)
    effects = []
    for name, per_value in values.items():
        if len(per_value) > 1:
            bests = [b for b, _ in per_value.values()]
            effects.append((name, max(bests) / min(bests) - 1, per_value))
    return sorted(effects, key=lambda e: -e[1])


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


def _problem_of_row(row: dict) -> Problem:
    return Problem(**{f: row[f] for f in VS_FLA_FIELDS[:7]})


@dataclass
class ProblemView:
    """Everything one problem's page shows."""

    problem: Problem
    winners: list[tuple[Winner, list[Verdict]]] = field(default_factory=list)
    studies: dict[str, list[TrialRecord]] = field(default_factory=dict)

    @property
    def page(self) -> str:
        p = self.problem
        return f"{p.variant}-k{p.dk}-v{p.dv}-{p.dtype}-b{p.batch}-t{p.seqlen}-h{p.heads}.html"

    @property
    def latest(self) -> list[Verdict]:
        return [history[-1] for _, history in self.winners if history]

    @property
    def flagged(self) -> bool:
        return any(v.flagged for v in self.latest)


def collect(store: Store) -> list[ProblemView]:
    """One view per problem that has a winner or a trial, in variant-registry then shape order."""
    views: dict[Problem, ProblemView] = {}
    history: dict[int, list[Measurement]] = defaultdict(list)
    for m in store.history():
        history[m.winner_id].append(m)
    for w in store.winners():
        views.setdefault(w.problem, ProblemView(w.problem)).winners.append((w, judge_history(history[w.id])))
    for t in store.trials():
        views.setdefault(t.problem, ProblemView(t.problem)).studies.setdefault(t.study, []).append(t)
    order = list(variants.VARIANTS)
    return sorted(views.values(), key=lambda v: (order.index(v.problem.variant), v.problem.dk, v.problem.dv,
                                                 v.problem.dtype, v.problem.batch * v.problem.heads,
                                                 v.problem.seqlen, v.problem.batch))


# --------------------------------------------------------------------------------------------
# Pages


def badge(kind: str) -> str:
    return f'<span class="badge {kind}" data-verdict="{kind}">{kind}</span>'


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: Sequence[int] = (),
          row_classes: Iterable[str] | None = None) -> str:
    """An HTML table; cells are HTML already (escape text before), ``numeric`` columns right-aligned."""
    head = "".join(f'<th class="num">{esc(h)}</th>' if i in numeric else f"<th>{esc(h)}</th>"
                   for i, h in enumerate(headers))
    classes = iter(row_classes or ())
    body = "".join(
        f'<tr class="{next(classes, "")}">'
        + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
        + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(title: str, body: str, generated: datetime, home: bool = False) -> str:
    crumb = "" if home else '<a href="index.html">&larr; all problems</a>'
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<link rel="stylesheet" href="style.css"></head><body>'
            f'<header>{crumb}<h1>{esc(title)}</h1></header><main>{body}'
            f'<p class="note">generated {generated:%Y-%m-%d %H:%M} UTC by <code>tune dashboard</code></p>'
            f"</main></body></html>")


def section(title: str, body: str, ident: str) -> str:
    return f'<section id="{ident}"><h2>{esc(title)}</h2>{body}</section>'


def latency(m) -> str:
    if m is None or m.median_ms is None:
        return "-"
    return f"{m.median_ms:.4f} <span class=\"muted\">[{m.p10_ms:.4f}, {m.p90_ms:.4f}]</span>"


def fla_table(rows: list[dict]) -> str:
    return table(
        ("variant", "dk x dv", "dtype", "B, T, H", "ours (ms)", "FLA (ms)", "floor (ms)", "FLA / ours",
         "floor / ours"),
        ([esc(r["variant"]), f'{r["dk"]}x{r["dv"]}', esc(r["dtype"]), f'{r["batch"]}, {r["seqlen"]}, {r["heads"]}',
          _ms(r["ours_ms"]), _ms(r["fla_ms"]), _ms(r["floor_ms"]), _ratio(r["fla_ms"], r["ours_ms"], "x"),
          _ratio(r["floor_ms"], r["ours_ms"], "%")] for r in rows),
        numeric=(4, 5, 6, 7, 8))


def fla_chart(rows: list[dict]) -> str:
    bars = []
    for r in rows:
        label = f'{r["variant"]} {r["dk"]}x{r["dv"]} T{r["seqlen"]}'
        bars.append((label, [(r[key], cls, f"{name} {r[key]:.4g} ms") for key, cls, name in FLA_BARS
                             if r[key] is not None]))
    return bar_chart("chart-fla", "latency, shorter is faster", [b for b in bars if b[1]], "latency (ms)",
                     legend=[("ours", "var(--ours)"), ("FLA", "var(--fla)"), ("floor", "var(--floor)")])


def _ms(value) -> str:
    return "not measured" if value is None else f"{value:.4f}"


def _ratio(num, den, unit: str) -> str:
    if num is None or den is None or den == 0:
        return "-"
    return f"{num / den:.2f}x" if unit == "x" else f"{num / den:.0%}"


def fla_section(rows: list[dict] | None, problem: Problem | None = None) -> str:
    if rows is not None and problem is not None:
        rows = [r for r in rows if _problem_of_row(r) == problem]
    if not rows:
        return section("Against FLA and the memory-bound floor",
                       '<p class="not-measured">not measured (run <code>benchmarks/vs_fla.py</code> on a GPU; '
                       'it writes <code>benchmarks/vs_fla.json</code>)</p>', "vs-fla")
    return section("Against FLA and the memory-bound floor", fla_chart(rows) + fla_table(rows), "vs-fla")


def history_section(view: ProblemView) -> str:
    if not view.winners:
        return section("Latency history", '<p class="note">no winner recorded for this problem yet</p>', "history")
    parts = []
    distinct = distinctions([w for w, _ in view.winners])
    for w, verdicts in view.winners:
        told = f" · {esc(distinct[w.id])}" if distinct[w.id] and not distinct[w.id].startswith("kernel") else ""
        parts.append(f"<h3>{esc(w.stack.gpu)} · {esc(w.stack.arch)} · kernel {esc(w.digest)}{told}</h3>")
        if not verdicts:
            parts.append('<p class="note">no measurement recorded</p>')
            continue
        parts.append(history_chart(w, verdicts))
        rows, classes = [], []
        for v in reversed(verdicts):
            m = v.measurement
            rows.append((f"{m.measured_at:%Y-%m-%d %H:%M}", esc(stack_label(m)), esc(m.status), latency(m),
                         badge(v.kind), esc(v.reason), esc("; ".join(v.changes)) or "-"))
            classes.append("flagged" if v.flagged else "")
        parts.append(table(("measured", "stack", "gate", "median [p10, p90] ms", "verdict", "why", "stack changes"),
                           rows, numeric=(3,), row_classes=classes))
    rule = ('<p class="note">A measurement has <em>regressed</em> when its p10-p90 band lies wholly above the '
            "reference's (the fastest earlier measurement that passed the gate, shaded) and its median is more "
            "than 3% slower; <em>failed</em> when it no longer passes the gate. Dashed lines mark changes of "
            "the stack between two measurements.</p>")
    return section("Latency history", rule + "".join(parts), "history")


def _trial_of_winner(view: ProblemView, w: Winner) -> TrialRecord | None:
    return next((t for t in view.studies.get(w.study, ()) if t.number == w.trial_number), None)


def registers_text(trial: TrialRecord | None) -> str:
    """Per kernel: ptxas registers / predicted (and spill bytes), from the winning trial's row."""
    if trial is None:
        return "-"
    predicted = {k["name"]: k["registers"] for k in (trial.prediction or {}).get("per_kernel", ())}
    kernels = (trial.compile_report or {}).get("kernels", [])
    lines = []
    for k in kernels:
        spill = k.get("spill_stores", 0) + k.get("spill_loads", 0)
        lines.append(f"{esc(k['name'])}: {k.get('registers', '?')} / {predicted.get(k['name'], '?')}"
                     + (f" (spills {spill} B)" if spill else ""))
    if not lines and trial.prediction:
        lines.append(f"predicted {trial.prediction.get('registers', '?')}")
    return "<br>".join(lines) or "-"


def winners_section(view: ProblemView) -> str:
    if not view.winners:
        return ""
    rows = []
    for w, _ in view.winners:
        trial = _trial_of_winner(view, w)
        rows.append((esc(w.stack.gpu), esc(stack_label(w)), f"<code>{esc(w.digest)}</code>",
                     f"<code>{esc(config_text(w.config))}</code>", registers_text(trial), latency(w),
                     esc(format_errors(w.gate_errors)) or "-",
                     f"{w.updated_at:%Y-%m-%d} · {esc(w.study)} #{w.trial_number}"))
    body = table(("GPU", "stack", "kernel", "config", "registers ptxas / predicted", "tuned median [p10, p90] ms",
                  "gate errors (rel. L2)", "tuned"), rows, numeric=(5,))
    return section("Current winners", body, "winners")


def convergence_section(view: ProblemView) -> str:
    studies = {name: trials for name, trials in view.studies.items()
               if any(t.status == "pass" and t.median_ms is not None for t in trials)}
    if not studies:
        note = "no trial was timed" + (" (tuned without a GPU)" if view.studies else "")
        return section("Tuning convergence", f'<p class="note">{note}</p>', "convergence")
    by_number, by_seconds = [], []
    for i, (name, trials) in enumerate(sorted(studies.items())):
        colour, label = PALETTE[i % len(PALETTE)], name.partition("@")[2] or name
        steps_n, steps_s = best_so_far(trials)
        dots = [(t.number, t.median_ms) for t in trials if t.status == "pass" and t.median_ms is not None]
        by_number.append(Series(label, colour, steps_n, dots))
        by_seconds.append(Series(label, colour, steps_s))
    charts = (step_chart("chart-convergence", "best latency by trial", by_number, "trial number", "latency (ms)")
              + step_chart("chart-convergence-gpu", "best latency by GPU time", by_seconds,
                           "cumulative GPU-seconds (gate and timing)", "latency (ms)"))
    counts = table(("study", "trials", "timed", "best (ms)", "GPU-seconds"),
                   ((esc(name), str(len(trials)), str(sum(t.status == "pass" for t in trials)),
                     f"{min(t.median_ms for t in trials if t.status == 'pass' and t.median_ms is not None):.4f}",
                     f"{sum(t.gpu_seconds or 0 for t in trials):.1f}") for name, trials in sorted(studies.items())),
                   numeric=(1, 2, 3, 4))
    return section("Tuning convergence", f'<div class="charts">{charts}</div>{counts}', "convergence")


def parameters_section(view: ProblemView) -> str:
    parts = []
    for name, trials in sorted(view.studies.items()):
        effects = parameter_effects(trials)
        if not effects:
            continue
        parts.append(f"<h3>{esc(name)}</h3>")
        parts.append(bar_chart("chart-parameters", "what a wrong choice costs, the rest tuned",
                               [(p, [(w * 100, "importance", f"{p}: +{w:.1%}")]) for p, w, _ in effects],
                               "slowdown of the best trial with the worst value (%)"))
        rows = [(esc(p), f"{w:.1%}", ", ".join(f"{esc(v)}: {b:.4f} ms ({n})" for v, (b, n) in
                                                sorted(per.items(), key=lambda kv: kv[1][0])))
                for p, w, per in effects]
        parts.append(table(("parameter", "weight", "value: best latency (timed trials), best first"), rows,
                           numeric=(1,)))
    if not parts:
        return section("Which parameters mattered", '<p class="note">needs timed trials with at least two values '
                       "of a parameter</p>", "parameters")
    how = ('<p class="note">Per parameter, the best latency reached with each of its values; the weight is how much '
           "slower the best of its worst value is than the best of its best value (a per-value spread of the timed "
           "trials, not a fitted model).</p>")
    return section("Which parameters mattered", how + "".join(parts), "parameters")


def problem_page(view: ProblemView, fla_rows: list[dict] | None, generated: datetime) -> str:
    body = (history_section(view) + winners_section(view) + convergence_section(view) + parameters_section(view)
            + fla_section(fla_rows, view.problem))
    p = view.problem
    title = f"{p.variant} k{p.dk} v{p.dv} {p.dtype} · B{p.batch} T{p.seqlen} H{p.heads}"
    return page(title, body, generated)


def index_page(views: list[ProblemView], fla_rows: list[dict] | None, calibrated: bool, db: str,
               generated: datetime) -> str:
    rows, classes = [], []
    for view in views:
        p = view.problem
        link = f'<a href="{esc(view.page)}">{esc(p.variant)} k{p.dk} v{p.dv} {esc(p.dtype)}</a>'
        shape = f"B{p.batch} T{p.seqlen} H{p.heads}"
        if not view.winners:
            rows.append((link, shape, "-", "-", "-", "", '<span class="muted">not tuned on a GPU</span>'))
            classes.append("")
        distinct = distinctions([w for w, _ in view.winners])
        for w, verdicts in view.winners:
            latest = verdicts[-1] if verdicts else None
            told = f'<br><span class="muted">{esc(distinct[w.id])}</span>' if distinct[w.id] else ""
            rows.append((link, shape + told, esc(w.stack.gpu), esc(stack_label(latest.measurement if latest else w)),
                         latency(latest.measurement if latest else None), sparkline(verdicts),
                         badge(latest.kind) if latest else "-"))
            classes.append("flagged" if latest and latest.flagged else "")
    flagged = sum(v.flagged for v in views)
    summary = (f'<p class="summary">{len(views)} problems, {sum(len(v.winners) for v in views)} winners; '
               + (f'<strong class="regressed">{flagged} regressed</strong>' if flagged else "no regression")
               + f' (latest measurement of each winner). Database: <code>{esc(db)}</code>.</p>')
    problems = section("Problems", summary + table(
        ("problem", "shape", "GPU", "latest stack", "latest median [p10, p90] ms", "history", "verdict"),
        rows, numeric=(4,), row_classes=classes), "problems")
    model = section("Register model", '<p><a href="model.html">predictions against ptxas</a></p>' if calibrated
                    else '<p class="note">no calibration recorded (<code>tune calibrate</code>)</p>', "model")
    return page("linattn-tuner dashboard", problems + fla_section(fla_rows) + model, generated, home=True)


def model_page(points: list[CalibrationPoint], generated: datetime) -> str:
    by_variant: dict[str, list[CalibrationPoint]] = defaultdict(list)
    for p in points:
        by_variant[p.variant].append(p)
    order = list(variants.VARIANTS)
    charts, rows = [], []
    for name in sorted(by_variant, key=order.index):
        pts = by_variant[name]
        charts.append(calibration_chart(name, pts))
        errors = [p.predicted_registers - p.ptxas_registers for p in pts]
        rows.append((esc(name), str(len(pts)), str(sum(map(is_miss, pts))),
                     f"{sum(map(abs, errors)) / len(errors):.1f}", f"{min(errors):+d} .. {max(errors):+d}"))
    summary = table(("variant", "kernels", "spill misses", "mean |error| (registers)", "error range"), rows,
                    numeric=(1, 2, 3))
    misses = [p for p in points if is_miss(p)]
    miss_table = table(
        ("variant", "dk x dv", "config", "predicted", "ptxas", "spill bytes", "TileLang / CUDA"),
        ((esc(p.variant), f"{p.dk}x{p.dv}", f"<code>{esc(config_text(p.config))}</code>",
          f"{p.predicted_registers}{' (spills)' if p.predicted_spills else ''}", str(p.ptxas_registers),
          str(p.ptxas_spill_bytes), f"{esc(p.tilelang)} / {esc(p.cuda)}") for p in misses),
        numeric=(3, 4, 5)) if misses else '<p class="note">none</p>'
    how = ('<p class="note">Each point is one compiled kernel source: the register demand the model predicted '
           "against what ptxas allocated. Ringed in red: a <em>miss</em>, where the model's spill verdict (what "
           "pruning acts on) differs from ptxas'. Under warp specialisation ptxas reports the setmaxnreg cap.</p>")
    body = (section("Predicted against ptxas", how + f'<div class="charts">{"".join(charts)}</div>' + summary,
                    "calibration")
            + section("Misses", miss_table, "misses"))
    return page("register model against ptxas", body, generated)


def write_site(store: Store, out: Path, fla_rows: list[dict] | None) -> list[Path]:
    """Write the dashboard of ``store`` into ``out``; the pages written, index first.

    Args:
        store (Store): the results database (read-only is enough).
        out (Path): the folder to write to (created; existing pages are overwritten).
        fla_rows (list[dict] | None): rows of ``vs_fla.json``, None when not measured.
    """
    out.mkdir(parents=True, exist_ok=True)
    for asset in ASSETS.iterdir():
        shutil.copyfile(asset, out / asset.name)
    generated = utcnow()
    views = collect(store)
    points = store.calibration()
    pages = {out / "index.html": index_page(views, fla_rows, bool(points), store.where, generated)}
    for view in views:
        pages[out / view.page] = problem_page(view, fla_rows, generated)
    if points:
        pages[out / "model.html"] = model_page(points, generated)
    for path, text in pages.items():
        path.write_text(text, encoding="utf-8")
    return list(pages)


def dashboard_main(db: str, out: str, vs_fla: str | None = None) -> int:
    """``tune dashboard``: write the site and print where its index is."""
    store = Store(db, readonly=True)
    try:
        pages = write_site(store, Path(out), load_vs_fla(Path(vs_fla) if vs_fla else DEFAULT_VS_FLA))
    finally:
        store.close()
    print(f"wrote {len(pages)} pages; open {pages[0].resolve().as_uri()}")
    return 0
