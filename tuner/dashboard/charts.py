"""The dashboard's charts: matplotlib figures saved as SVG and inlined in the pages.

Text stays text in the SVG (``svg.fonttype: none``): it can be selected and searched, and it is
what the browser tests read. An element a reader or a test needs to tell apart (a regression
marker, a stack change, a bar) is registered with :meth:`Chart.mark`: matplotlib writes the
artist's gid as the id of the ``<g>`` it draws the artist in, and :meth:`Chart.svg` turns that id
into CSS classes and a tooltip (``<title>``). matplotlib's other ``<g>`` ids only name its
artists (``figure_1``, ``axes_1``) and would repeat across the charts of one page, so they are
dropped; the ids of its definitions (markers, clip paths) are referenced, and unique (matplotlib
hashes them with a random salt), so they stay.
"""
from __future__ import annotations

import io
import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import matplotlib
from markupsafe import Markup
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.transforms import ScaledTranslation

from ..regress import Verdict, VersusFla, stack_changes, winner_label
from ..store import CalibrationPoint, Winner
from .data import config_text, is_miss, problem_of_row, stack_label

SVG_NS = "http://www.w3.org/2000/svg"
# Written back without prefixes, as matplotlib wrote them (ElementTree's registry is global).
ET.register_namespace("", SVG_NS)
ET.register_namespace("xlink", "http://www.w3.org/1999/xlink")

# Text and verdicts in the colours style.css gives them in the page.
INK, MUTED = "#1d2430", "#5d6776"
VERDICT_COLOURS = {"first": "#2563eb", "steady": "#2563eb", "improved": "#15803d", "regressed": "#dc2626",
                   "failed": "#b45309"}
# Lines of several series in one chart (studies on different stacks).
PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#0891b2", "#be123c")
REFERENCE_BAND, WHISKER, TRIAL = "#dbeafe", "#94a3b8", "#94a3b8"
STACK_CHANGE, STACK_CHANGE_TEXT = "#a855f7", "#7e22ce"
OURS, FLA, FLOOR = "#2563eb", "#9333ea", "#64748b"
FLA_BARS = (("ours_ms", "ours", "ours", OURS), ("fla_ms", "fla", "FLA", FLA), ("floor_ms", "floor", "floor", FLOOR))
IMPORTANCE = "#0f766e"

STYLE = {
    "svg.fonttype": "none",
    "text.parse_math": False,  # labels are data: a "$" in a study name is not mathematics
    "font.size": 8, "text.color": INK,
    "axes.titlesize": 9, "axes.titleweight": "bold", "axes.titlelocation": "left",
    "axes.labelcolor": MUTED, "axes.edgecolor": "#8a94a3",
    "axes.spines.top": False, "axes.spines.right": False,
    "grid.color": "#eceff3", "axes.axisbelow": True,
    "xtick.color": MUTED, "ytick.color": MUTED,
    "legend.frameon": False,
}
PX_PER_INCH = 96  # matplotlib writes sizes in points (1/72 in), a browser shows a point as 4/3 px


class Chart:
    """One figure and the elements of it that get classes and tooltips in the SVG.

    Args:
        kind (str): the chart's kind, a CSS class of the ``<svg>`` (``chart-history``, ...).
        title (str): drawn above the axes and given to screen readers.
        width, height (int): size in CSS pixels.
        layout (str | None): matplotlib's layout engine; None where the axes fill the figure.
    """

    def __init__(self, kind: str, title: str, width: int, height: int, layout: str | None = "constrained"):
        self.kind, self.title = kind, title
        self.figure = Figure(figsize=(width / PX_PER_INCH, height / PX_PER_INCH), layout=layout)
        self.marks: dict[str, tuple[str, str]] = {}

    def axes(self, xlabel: str, ylabel: str, grid: str = "y") -> Axes:
        """The chart's one plot area, titled and labelled, with grid lines at the ticks of ``grid``
        (``x``, ``y`` or ``both``)."""
        ax = self.figure.add_subplot()
        ax.set(title=self.title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(True, axis=grid)
        return ax

    def mark(self, artist: Artist, classes: str, tip: str = "") -> Artist:
        """Give ``artist``'s element in the SVG the CSS ``classes`` and the tooltip ``tip``."""
        gid = f"mark-{len(self.marks)}"
        artist.set_gid(gid)
        self.marks[gid] = (classes, tip)
        return artist

    def svg(self) -> Markup:
        """The figure as an ``<svg>`` element to inline in a page."""
        buffer = io.StringIO()
        self.figure.savefig(buffer, format="svg", transparent=True)
        root = ET.fromstring(buffer.getvalue())
        root.remove(root.find(f"{{{SVG_NS}}}metadata"))  # the file's creator and format: not for a page
        root.attrib.update({"class": f"chart {self.kind}", "role": "img", "aria-label": self.title})
        for group in root.iter(f"{{{SVG_NS}}}g"):
            mark = self.marks.get(group.attrib.pop("id", None))
            if mark is None:
                continue
            classes, tip = mark
            group.set("class", classes)
            if tip:
                title = ET.Element(f"{{{SVG_NS}}}title")
                title.text = tip
                group.insert(0, title)
        return Markup(ET.tostring(root, encoding="unicode"))


def floor_at_zero(ax: Axes) -> None:
    """Keep latencies' autoscaled axis from reaching below zero."""
    lo, hi = ax.get_ylim()
    ax.set_ylim(max(lo, 0.0), hi)


def short_change(change: str) -> str:
    """``tilelang 0.1.15 -> 0.1.16`` -> ``tilelang 0.1.16``: what a stack change led to."""
    before, _, after = change.partition(" -> ")
    return f"{before.split(' ')[0]} {after}"


def flag(chart: Chart, ax: Axes, x: float, y: float, classes: str, tip: str) -> None:
    """A red downward triangle 10 points above (x, y): the mark of a flagged measurement."""
    above = ax.transData + ScaledTranslation(0, 10 / 72, chart.figure.dpi_scale_trans)
    chart.mark(ax.plot(x, y, "v", ms=10, color=VERDICT_COLOURS["regressed"], transform=above)[0], classes, tip)


def dated_axis(ax: Axes, dates: list) -> None:
    """One x position per measurement, at most ten of them labelled with their day."""
    n = len(dates)
    ax.set_xlim(-0.6, max(n - 0.4, 0.6))
    every = max(1, math.ceil(n / 10))
    ax.set_xticks(range(0, n, every), [f"{d:%m-%d}" for d in dates[::every]])


@matplotlib.rc_context(STYLE)
def history_chart(winner: Winner, verdicts: list[Verdict]) -> Markup:
    """Latency of each measurement of ``winner`` (median, p10-p90 whisker) in order, the latest
    verdict's reference band shaded, stack changes as dashed lines, regressions and failures marked."""
    chart = Chart("chart-history", f"latency history: {winner_label(winner)} on {winner.stack.gpu}", 760, 300)
    ax = chart.axes("measurement (date)", "latency (ms)")
    reference = verdicts[-1].reference
    if reference is not None:
        chart.mark(ax.axhspan(reference.p10_ms, reference.p90_ms, color=REFERENCE_BAND, lw=0), "reference-band",
                   f"reference {reference.median_ms:.4g} ms, p10-p90 {reference.p10_ms:.4g}-{reference.p90_ms:.4g}"
                   f" ms ({reference.measured_at:%Y-%m-%d})")
    for i in range(1, len(verdicts)):
        changes = stack_changes(verdicts[i - 1].measurement, verdicts[i].measurement)
        if changes:
            chart.mark(ax.axvline(i - 0.5, color=STACK_CHANGE, lw=1, ls=(0, (4, 3))), "stack-change",
                       "; ".join(changes))
            chart.mark(ax.text(i - 0.5, 1, " " + ", ".join(map(short_change, changes)), color=STACK_CHANGE_TEXT,
                               va="top", transform=ax.get_xaxis_transform()), "stack-change label")
    timed = [(i, v.measurement) for i, v in enumerate(verdicts) if v.measurement.median_ms is not None]
    if timed:
        xs, ms = zip(*timed)
        ax.plot(xs, [m.median_ms for m in ms], color=PALETTE[0], lw=1.8)
        ax.vlines(xs, [m.p10_ms for m in ms], [m.p90_ms for m in ms], color=WHISKER, lw=1.2)
    for i, v in enumerate(verdicts):
        m, colour = v.measurement, VERDICT_COLOURS[v.kind]
        tip = (f"{m.measured_at:%Y-%m-%d %H:%M} · {stack_label(m)}\n{v.kind}: {v.reason}"
               + (f"\nchanged: {'; '.join(v.changes)}" if v.changes else ""))
        if m.median_ms is None:
            chart.mark(ax.plot(i, 0.05, "x", ms=9, mew=2.5, color=colour, transform=ax.get_xaxis_transform())[0],
                       "marker failed", tip)
            continue
        chart.mark(ax.plot(i, m.median_ms, "o", ms=7, color=colour, mec="white")[0], f"point {v.kind}", tip)
        if v.kind == "regressed":
            flag(chart, ax, i, m.p90_ms, "marker regressed", tip)
    floor_at_zero(ax)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + 0.2 * (hi - lo))  # headroom for the regression markers and stack-change labels
    dated_axis(ax, [v.measurement.measured_at for v in verdicts])
    return chart.svg()


@matplotlib.rc_context(STYLE)
def versus_chart(winner: Winner, versus: VersusFla) -> Markup:
    """The winner's latency and FLA's beside it, pair by pair in time (median, p10-p90 whisker), the
    memory-bound floor dashed; a winner that fell behind FLA marked on its latest point."""
    chart = Chart("chart-versus", f"against FLA: {winner_label(winner)} on {winner.stack.gpu}", 760, 280)
    ax = chart.axes("measurement (date)", "latency (ms)")
    pairs = versus.pairs
    floor = next((p.fla.floor_ms for p in reversed(pairs) if p.fla.floor_ms is not None), None)
    if floor is not None:
        chart.mark(ax.axhline(floor, color=FLOOR, lw=1, ls=(0, (4, 3))), "floor",
                   f"memory-bound floor {floor:.4g} ms")
    for side, colour, label, of in (("ours", OURS, "ours", lambda p: p.ours), ("fla", FLA, "FLA", lambda p: p.fla)):
        timed = [(i, of(p)) for i, p in enumerate(pairs) if of(p).median_ms is not None]
        if not timed:
            continue
        xs, ms = zip(*timed)
        chart.mark(ax.plot(xs, [m.median_ms for m in ms], color=colour, lw=1.8, label=label)[0], f"series {side}")
        ax.vlines(xs, [m.p10_ms for m in ms], [m.p90_ms for m in ms], color=WHISKER, lw=1.2)
        for i, m in timed:
            pair = pairs[i]
            ratio = f" ({pair.ratio:.2f}x FLA)" if pair.ratio is not None else ""
            chart.mark(ax.plot(i, m.median_ms, "o", ms=7, color=colour, mec="white")[0], f"point {side}",
                       f"{m.measured_at:%Y-%m-%d %H:%M} · {label} {m.median_ms:.4g} ms{ratio}")
    if versus.flagged:
        flag(chart, ax, len(pairs) - 1, versus.latest.ours.p90_ms, "marker fell_behind", versus.reason)
    floor_at_zero(ax)
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + 0.15 * (hi - lo))  # headroom for the marker
    dated_axis(ax, [p.ours.measured_at for p in pairs])
    ax.legend(loc="lower right")
    return chart.svg()


@matplotlib.rc_context(STYLE)
def sparkline(verdicts: list[Verdict]) -> Markup:
    """A 140x30 history in a table cell: medians, the latest point coloured by its verdict."""
    timed = [(i, v) for i, v in enumerate(verdicts) if v.measurement.median_ms is not None]
    if not timed:
        return Markup()
    chart = Chart("chart-sparkline", "latency history", 140, 30, layout=None)
    ax = chart.figure.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    xs, vs = zip(*timed)
    ax.plot(xs, [v.measurement.median_ms for v in vs], color=PALETTE[0], lw=1.5)
    last = vs[-1]
    chart.mark(ax.plot(xs[-1], last.measurement.median_ms, "o", ms=4, color=VERDICT_COLOURS[last.kind])[0],
               f"point {last.kind}")
    ax.set_xlim(-0.5, max(len(verdicts) - 0.5, 0.5))
    ax.margins(y=0.25)
    return chart.svg()


@dataclass(frozen=True)
class Series:
    """One line of a convergence chart: its label, step points and the dots behind it."""

    label: str
    steps: list[tuple[float, float]]
    dots: list[tuple[float, float]] = field(default_factory=list)


@matplotlib.rc_context(STYLE)
def step_chart(kind: str, title: str, series: list[Series], xlabel: str, ylabel: str) -> Markup:
    """Best-so-far staircases (one per series, each run on to the right edge) over the points
    they summarise."""
    chart = Chart(kind, title, 520, 280)
    ax = chart.axes(xlabel, ylabel)
    stairs = []
    for i, s in enumerate(series):
        if s.dots:
            chart.mark(ax.scatter(*zip(*s.dots), s=8, color=TRIAL, alpha=0.55, lw=0), "trial")
        line = ax.step(*zip(*s.steps), where="post", color=PALETTE[i % len(PALETTE)], lw=1.8, label=s.label)[0]
        stairs.append(chart.mark(line, "series"))
    right = ax.get_xlim()[1]
    ax.set_xlim(right=right)
    for line in stairs:  # the best so far holds until the edge
        xs, ys = line.get_data()
        line.set_data([*xs, right], [*ys, ys[-1]])
    floor_at_zero(ax)
    if len(series) > 1:
        ax.legend(loc="upper right")
    return chart.svg()


@dataclass(frozen=True)
class Bar:
    """One bar: its length, kind (a CSS class), colour and tooltip."""

    value: float
    kind: str
    colour: str
    tip: str


@matplotlib.rc_context(STYLE)
def bar_chart(kind: str, title: str, rows: list[tuple[str, list[Bar]]], xlabel: str,
              legend: dict[str, str] | None = None) -> Markup:
    """Horizontal bars, rows of (label, bars) from top to bottom; ``legend`` maps labels to colours."""
    per_row = max(len(bars) for _, bars in rows)
    chart = Chart(kind, title, 620, 100 + len(rows) * (per_row * 14 + 8))
    ax = chart.axes(xlabel, "", grid="x")
    ticks = []
    for r, (label, bars) in enumerate(rows):
        top = r * (per_row + 1)
        ticks.append(top + (len(bars) - 1) / 2)
        for j, bar in enumerate(bars):
            chart.mark(ax.barh(top + j, bar.value, height=0.85, color=bar.colour)[0], f"bar {bar.kind}", bar.tip)
    ax.set_yticks(ticks, [label for label, _ in rows])
    ax.tick_params(axis="y", length=0)
    ax.invert_yaxis()
    if legend:
        ax.legend(handles=[Patch(color=c, label=label) for label, c in legend.items()], loc="lower right",
                  bbox_to_anchor=(1, 1), ncols=len(legend))
    return chart.svg()


def fla_chart(rows: list[dict]) -> Markup:
    """Our latency, FLA's and the memory-bound floor per ``vs_fla.json`` row."""
    bars = []
    for r in rows:
        p = problem_of_row(r)
        bars.append((f"{p.variant} {p.dk}x{p.dv} T{p.seqlen}",
                     [Bar(r[key], kind, colour, f"{name} {r[key]:.4g} ms") for key, kind, name, colour in FLA_BARS
                      if r[key] is not None]))
    return bar_chart("chart-fla", "latency, shorter is faster", [b for b in bars if b[1]], "latency (ms)",
                     legend={name: colour for _, _, name, colour in FLA_BARS})


def parameters_chart(effects: list[tuple[str, float, dict]]) -> Markup:
    """One bar per parameter: its weight (:func:`tuner.dashboard.data.parameter_effects`) in percent."""
    return bar_chart("chart-parameters", "what a wrong choice costs, the rest tuned",
                     [(p, [Bar(w * 100, "importance", IMPORTANCE, f"{p}: +{w:.1%}")]) for p, w, _ in effects],
                     "slowdown of the best trial with the worst value (%)")


@matplotlib.rc_context(STYLE)
def calibration_chart(variant: str, points: list[CalibrationPoint]) -> Markup:
    """Predicted registers against ptxas', the diagonal dashed, spill mispredictions ringed."""
    chart = Chart("chart-calibration", f"{variant}: predicted vs ptxas registers", 380, 340)
    ax = chart.axes("ptxas registers / thread", "predicted registers / thread", grid="both")
    for p in points:
        miss = is_miss(p)
        look = dict(mfc="none", mec=VERDICT_COLOURS["regressed"], mew=2, ms=11) if miss else \
            dict(color=VERDICT_COLOURS["steady"], alpha=0.75, ms=8)
        tip = (f"{p.dk}x{p.dv} {p.dtype} {config_text(p.config)}\npredicted {p.predicted_registers} "
               f"(spills: {p.predicted_spills}), ptxas {p.ptxas_registers} (spill bytes {p.ptxas_spill_bytes})")
        chart.mark(ax.plot(p.ptxas_registers, p.predicted_registers, "o", **look)[0],
                   f"calibration {'miss' if miss else 'hit'}", tip)
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    lim = (max(min(x0, y0), 0.0), max(x1, y1))
    ax.set(xlim=lim, ylim=lim, aspect="equal")
    ax.axline((lim[0], lim[0]), slope=1, color=WHISKER, lw=1, ls=(0, (5, 4)), zorder=0)
    return chart.svg()
