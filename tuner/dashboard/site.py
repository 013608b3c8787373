"""The dashboard's pages: the Jinja templates of ``templates/`` filled with the views of
:mod:`.data` and the charts of :mod:`.charts`, written into one folder with the stylesheet."""
from __future__ import annotations

import functools
import shutil
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import jinja2

from .. import variants
from ..problem import Problem
from ..regress import format_errors
from ..store import CalibrationPoint, Store, utcnow
from . import charts
from .data import (DEFAULT_VS_FLA, ProblemView, best_so_far, collect, config_text, is_miss, is_timed, load_vs_fla,
                   parameter_effects, problem_of_row, registers, stack_label)

TEMPLATES = Path(__file__).resolve().parent / "templates"
ASSETS = Path(__file__).resolve().parent.parent / "dashboard_assets"


def milliseconds(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.4f}"


def ratio(num: float | None, den: float | None, unit: str) -> str:
    """``num / den`` as ``1.38x`` (unit ``x``) or ``65%`` (unit ``%``); ``-`` when either is missing."""
    if num is None or den is None or den == 0:
        return "-"
    return f"{num / den:.2f}x" if unit == "x" else f"{num / den:.0%}"


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(ms=milliseconds, ratio=ratio)
    env.globals.update(stack_label=stack_label, config_text=config_text, format_errors=format_errors)
    return env


def render(template: str, *, title: str, generated: datetime, home: bool = False, **context) -> str:
    """A page from ``template`` (which extends ``base.html``); ``home``: the index, without a link back to it."""
    return environment().get_template(template).render(title=title, generated=generated, home=home, **context)


def fla_comparison(rows: list[dict] | None, problem: Problem | None = None) -> dict:
    """The ``vs_fla.json`` rows to show (those of ``problem`` when given) and their chart."""
    if rows is not None and problem is not None:
        rows = [r for r in rows if problem_of_row(r) == problem]
    return {"rows": rows or [], "chart": charts.fla_chart(rows) if rows else None}


def convergence(view: ProblemView) -> dict:
    """The best-so-far charts of the problem's studies with a timed trial, and a row per study:
    (name, trials, timed, best latency, GPU-seconds)."""
    studies = view.timed_studies
    if not studies:
        return {"charts": [], "rows": []}
    by_number, by_seconds = [], []
    for name, trials in studies.items():
        label = name.partition("@")[2] or name
        steps_n, steps_s = best_so_far(trials)
        by_number.append(charts.Series(label, steps_n, [(t.number, t.median_ms) for t in filter(is_timed, trials)]))
        by_seconds.append(charts.Series(label, steps_s))
    return {
        "charts": [charts.step_chart("chart-convergence", "best latency by trial", by_number, "trial number",
                                     "latency (ms)"),
                   charts.step_chart("chart-convergence-gpu", "best latency by GPU time", by_seconds,
                                     "cumulative GPU-seconds (gate and timing)", "latency (ms)")],
        "rows": [(name, len(trials), sum(map(is_timed, trials)), min(t.median_ms for t in filter(is_timed, trials)),
                  sum(t.gpu_seconds or 0 for t in trials)) for name, trials in studies.items()],
    }


def problem_page(view: ProblemView, fla_rows: list[dict] | None, generated: datetime) -> str:
    effects = {name: parameter_effects(trials) for name, trials in sorted(view.studies.items())}
    return render(
        "problem.html", title=view.title, generated=generated, view=view, distinct=view.distinctions,
        history_charts={w.id: charts.history_chart(w, verdicts) for w, verdicts in view.winners if verdicts},
        versus_charts={w.id: charts.versus_chart(w, view.versus[w.id]) for w, _ in view.winners if w.id in view.versus},
        registers={w.id: registers(view.trial_of(w)) for w, _ in view.winners},
        convergence=convergence(view),
        parameters=[(name, charts.parameters_chart(e), e) for name, e in effects.items() if e],
        fla=fla_comparison(fla_rows, view.problem))


def index_page(views: list[ProblemView], fla_rows: list[dict] | None, calibrated: bool, db: str,
               generated: datetime) -> str:
    return render(
        "index.html", title="linattn-tuner dashboard", generated=generated, home=True, views=views, db=db,
        calibrated=calibrated, flagged=sum(v.flagged for v in views), winners=sum(len(v.winners) for v in views),
        sparklines={w.id: charts.sparkline(verdicts) for v in views for w, verdicts in v.winners},
        fla=fla_comparison(fla_rows))


def model_page(points: list[CalibrationPoint], generated: datetime) -> str:
    by_variant: dict[str, list[CalibrationPoint]] = defaultdict(list)
    for p in points:
        by_variant[p.variant].append(p)
    order = list(variants.VARIANTS)
    names = sorted(by_variant, key=order.index)
    summary = []
    for name in names:
        errors = [p.predicted_registers - p.ptxas_registers for p in by_variant[name]]
        summary.append((name, len(errors), sum(map(is_miss, by_variant[name])), sum(map(abs, errors)) / len(errors),
                        min(errors), max(errors)))
    return render("model.html", title="register model against ptxas", generated=generated,
                  charts=[charts.calibration_chart(name, by_variant[name]) for name in names], summary=summary,
                  misses=[p for p in points if is_miss(p)])


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
