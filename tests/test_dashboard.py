"""`tune dashboard` on a real SQLite file built through tuner.store: the site opens from disk in
a headless Chromium (Selenium, chromedriver) with no console error and no request leaving the
folder, draws its charts (matplotlib's SVG, inlined), marks the recorded slowdown (and only that
one), and shows each winner against FLA's op measured beside it (a database without FLA's
measurements says so)."""
import json
import random
import re
import struct
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tuner.dashboard.data import parameter_effects
from tuner.stack import Stack
from tuner.problem import Problem
from tuner.store import Baseline, CalibrationPoint, Measurement, Store, TrialRecord, Winner

from browser import Browser, missing

H200 = Stack("NVIDIA H200", "sm_90", "0.1.15", "12.8.93", "570.86.15", "2.13.0")
UPGRADED = replace(H200, tilelang="0.1.16")
NEW_DRIVER = replace(H200, driver="575.51.03")
SLOW = Problem("gdn", 128, 128, "bf16", 4, 8192, 16)     # slowed down by the TileLang upgrade
STEADY = Problem("kda", 64, 64, "bf16", 2, 4096, 32)     # survived a driver upgrade unchanged
T0 = datetime(2026, 3, 1, 12, 0)
FLOOR_MS = 0.25


def page_name(p: Problem) -> str:
    return f"{p.variant}-k{p.dk}-v{p.dv}-{p.dtype}-b{p.batch}-t{p.seqlen}-h{p.heads}.html"


def tune_study(store: Store, problem: Problem, seed: int) -> TrialRecord:
    """Record 30 trials of a study the way tuner.search does (a few pruned, some failed, the rest
    timed); the fastest passing one."""
    rng = random.Random(seed)
    study = f"{problem.variant}-study@{H200.key()}"
    best = None
    for n in range(30):
        config = {"split": rng.choice(["fused", "chunked"]), "chunk_size": rng.choice([32, 64, 128]),
                  "num_stages": rng.choice([1, 2, 3]), "threads": rng.choice([128, 256])}
        latency = (0.8 + (0.5 if config["split"] == "fused" else 0) + 0.002 * config["chunk_size"]
                   + 0.01 * config["num_stages"]) * rng.uniform(1.0, 1.05)
        status = "pruned" if n % 7 == 3 else "mismatch" if n % 11 == 5 else "pass"
        timed = status == "pass"
        record = TrialRecord(
            study, n, problem, config, status, H200, digest=f"{seed}{n:04d}", prediction={
                "registers": 120 + n, "per_kernel": [{"name": "main", "registers": 120 + n}]},
            compile_report=None if status == "pruned" else {"kernels": [
                {"name": "main", "registers": 128 + n, "spill_stores": 0, "spill_loads": 0}]},
            gate_errors={"uniform": {"o": 2e-3}} if status != "pruned" else None,
            median_ms=latency if timed else None, p10_ms=latency * 0.98 if timed else None,
            p90_ms=latency * 1.03 if timed else None, gpu_seconds=None if status == "pruned" else rng.uniform(2, 6),
            finished_at=T0 + timedelta(minutes=n))
        store.record_trial(record)
        if timed and (best is None or latency < best.median_ms):
            best = record
    return best


def record_winner(store: Store, problem: Problem, seed: int, later: list[tuple[Stack, float, float]],
                  fla: float) -> None:
    """Tune ``problem``, store its winner, then one re-measurement per (stack, median relative to the
    winner's, relative spread); FLA's op measured beside each measurement (the tuning one too) on its
    stack, ``fla`` times the winner's median, its spread 2%."""
    best = tune_study(store, problem, seed)
    w = store.write_winner(Winner(problem, H200, best.digest, best.config, best.median_ms, best.p10_ms, best.p90_ms,
                                  best.gate_errors, best.study, best.number, updated_at=T0), "pass")
    for day, (env, factor, spread) in enumerate(later, start=1):
        median = w.median_ms * factor
        store.add_measurement(Measurement(w.id, "pass", env, median, median * (1 - spread), median * (1 + spread),
                                          {"uniform": {"o": 2e-3}}, measured_at=T0 + timedelta(days=day)))
    median = w.median_ms * fla
    for day, env in enumerate([H200, *(env for env, _, _ in later)]):
        store.add_baseline(Baseline(problem, env, "0.6.0", "pass", median, median * 0.98, median * 1.02, FLOOR_MS,
                                    {"uniform": {"o": 3e-3}}, measured_at=T0 + timedelta(days=day, minutes=5)))


def calibrate(store: Store) -> None:
    for i, (predicted, measured, spills) in enumerate([(96, 104, 0), (168, 160, 0), (200, 255, 64), (240, 232, 0)]):
        store.add_calibration(CalibrationPoint(
            "gdn", 128, 128, "bf16", {"chunk_size": 32 * (i + 1)}, f"cal{i}", predicted, 49152, predicted > 255,
            measured, spills, 49152, False, "0.1.15", "12.8.93"))


def build_db(path: Path, slowdown: bool) -> Path:
    store = Store(path)
    # SLOW's winner is faster than FLA until the upgrade slows it down past FLA; STEADY's is always behind.
    record_winner(store, SLOW, 1, [(H200, 1.005, 0.02), (UPGRADED, 1.3 if slowdown else 1.01, 0.02)], fla=1.1)
    record_winner(store, STEADY, 2, [(NEW_DRIVER, 1.01, 0.03), (NEW_DRIVER, 0.99, 0.03)], fla=0.5)
    calibrate(store)
    store.close()
    return path


def write_vs_fla(path: Path) -> Path:
    path.write_text(json.dumps([
        {**{k: getattr(SLOW, k) for k in ("variant", "dk", "dv", "dtype", "batch", "seqlen", "heads")},
         "ours_ms": 0.95, "fla_ms": 1.31, "floor_ms": 0.62}]))
    return path


def run_tune(*args):
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    db = build_db(tmp / "results.db", slowdown=True)
    out = tmp / "site"
    done = run_tune("dashboard", "--db", str(db), "--out", str(out), "--vs-fla", str(write_vs_fla(tmp / "vs.json")))
    assert done.returncode == 0, done.stderr
    return out


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_site_has_an_index_a_page_per_problem_and_the_model_page(site):
    names = {p.name for p in site.iterdir()}
    assert {"index.html", "style.css", "model.html", page_name(SLOW), page_name(STEADY)} <= names
    for page in site.glob("*.html"):  # self-contained: no script, nothing but local relative links
        text = page.read_text()
        assert "<script" not in text, page.name
        for url in re.findall(r'(?:src|href)="([^"]+)"', text):
            assert "://" not in url and not url.startswith("//"), (page.name, url)


def test_each_page_names_an_element_once_and_finds_what_its_charts_refer_to(site):
    # Several SVGs inlined in one page share one id space: a repeated id would make a chart's
    # marker or clip path resolve to another chart's.
    for page in site.glob("*.html"):
        text = page.read_text()
        ids = re.findall(r'\sid="([^"]+)"', text)
        assert len(ids) == len(set(ids)), page.name
        referred = set(re.findall(r'url\(#([^)]+)\)', text)) | set(re.findall(r'href="#([^"]+)"', text))
        assert referred and referred <= set(ids), (page.name, referred - set(ids))


def test_names_from_the_database_are_shown_as_written(tmp_path):
    # Escaped in the page's table, and drawn literally in the chart (a "$" is not mathematics there).
    store = Store(tmp_path / "r.db")
    name = "<b>$x$</b>"
    for n, (value, ms) in enumerate([("a", 1.0), ("b", 1.5)]):
        store.record_trial(TrialRecord("s", n, STEADY, {name: value}, "pass", H200, median_ms=ms, p10_ms=ms,
                                       p90_ms=ms, gpu_seconds=1.0))
    store.close()
    assert run_tune("dashboard", "--db", str(tmp_path / "r.db"), "--out", str(tmp_path / "site")).returncode == 0
    text = (tmp_path / "site" / page_name(STEADY)).read_text()
    assert "<b>" not in text
    assert ">&lt;b&gt;$x$&lt;/b&gt;</text>" in text  # the chart's label, one text element
    assert text.count("&lt;b&gt;$x$&lt;/b&gt;") == 3  # that label, its bar's tooltip, the table's row


@pytest.mark.parametrize("slowdown, code", [(True, 1), (False, 0)])
def test_dashboard_marks_a_slowdown_exactly_when_replay_exits_1(tmp_path, slowdown, code):
    db = build_db(tmp_path / "r.db", slowdown=slowdown)
    assert run_tune("dashboard", "--db", str(db), "--out", str(tmp_path / "site")).returncode == 0
    marked = 'class="marker regressed"' in (tmp_path / "site" / page_name(SLOW)).read_text()
    assert marked == slowdown
    assert run_tune("regress", "--replay", "--db", str(db)).returncode == code


def test_vs_fla_says_not_measured_without_the_file(tmp_path):
    db = build_db(tmp_path / "r.db", slowdown=False)
    out = tmp_path / "site"
    assert run_tune("dashboard", "--db", str(db), "--out", str(out), "--vs-fla",
                    str(tmp_path / "absent.json")).returncode == 0
    assert "not measured" in (out / "index.html").read_text()
    assert "not measured" in (out / page_name(SLOW)).read_text()
    assert 'id="vs-fla"' in (out / "index.html").read_text() and "chart-fla" not in (out / "index.html").read_text()


def test_a_malformed_vs_fla_is_a_one_line_error(tmp_path):
    db = build_db(tmp_path / "r.db", slowdown=False)
    bad = tmp_path / "vs.json"
    bad.write_text(json.dumps([{"variant": "gdn"}]))
    done = run_tune("dashboard", "--db", str(db), "--out", str(tmp_path / "site"), "--vs-fla", str(bad))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "entry 0 lacks dk" in done.stderr


def test_a_packed_vs_fla_row_is_not_shown_on_the_dense_problem_of_its_size():
    from tuner.dashboard.site import fla_comparison

    problem = Problem("gdn", 128, 128, "bf16", 1, 32768, 32)
    dense = {**{k: getattr(problem, k) for k in ("variant", "dk", "dv", "dtype", "batch", "seqlen", "heads")},
             "ours_ms": 1.0, "fla_ms": 2.0, "floor_ms": 0.5}
    packed = {**dense, "qk_heads": 16, "sequences": 205}
    assert fla_comparison([dense, packed], problem)["rows"] == [dense]
    assert fla_comparison([dense, packed])["rows"] == [dense, packed]  # the index lists both


def test_parameter_effects_rank_what_a_wrong_choice_costs():
    def timed(n, split, stages, ms):
        return TrialRecord("s", n, SLOW, {"split": split, "num_stages": stages}, "pass", H200,
                           median_ms=ms, p10_ms=ms, p90_ms=ms)
    trials = [timed(0, "fused", 1, 2.0), timed(1, "chunked", 1, 1.0), timed(2, "chunked", 2, 1.1),
              timed(3, "fused", 2, 2.4), TrialRecord("s", 4, SLOW, {"split": "fused", "num_stages": 3}, "nan", H200)]
    (first, w1, per1), (second, w2, _) = parameter_effects(trials)
    assert (first, second) == ("split", "num_stages")
    assert w1 == pytest.approx(1.0) and w2 == pytest.approx(0.1)  # 2.0/1.0 - 1 and 1.1/1.0 - 1
    assert per1 == {"fused": (2.0, 2), "chunked": (1.0, 2)}  # the failed trial is not timed


needs_browser = pytest.mark.skipif(missing() is not None, reason=f"{missing()}; the browser tests need it")


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


def open_clean(browser, path: Path):
    page = browser.open(path)
    assert page.problems == [], page.problems
    folder = path.parent.resolve().as_uri() + "/"
    assert page.requested and all(url.startswith(folder) for url in page.requested), page.requested
    assert page.evaluate("getComputedStyle(document.body).margin") == "0px"  # style.css was applied
    return page


@needs_browser
def test_problem_page_marks_the_slowdown_and_the_upgrade_that_caused_it(site, browser):
    page = open_clean(browser, site / page_name(SLOW))
    count = "n => document.querySelectorAll(n).length"
    assert page.evaluate(f"({count})('svg.chart-history')") == 1
    drawn = "m => m.getBoundingClientRect().height > 0"
    markers = page.evaluate(f"[...document.querySelectorAll('svg.chart-history .marker.regressed')].map({drawn})")
    assert markers == [True]  # one regression marker, rendered with a size
    assert page.evaluate(f"({count})('svg.chart-history .point')") == 3
    assert page.evaluate(f"({count})('svg.chart-history .reference-band')") == 1
    lines = page.evaluate("[...document.querySelectorAll('svg.chart-history .stack-change:not(.label)')]"
                          f".map(g => [g.textContent.trim(), ({drawn})(g)])")
    assert lines == [["tilelang 0.1.15 -> 0.1.16", True]]  # one dashed line, its tooltip says what changed
    label = page.evaluate("document.querySelector('svg.chart-history .stack-change.label').textContent")
    assert label.strip() == "tilelang 0.1.16"
    flagged = page.evaluate("[...document.querySelectorAll('#history tr.flagged')].map(r => r.textContent)")
    assert len(flagged) == 1 and "regressed" in flagged[0] and "tilelang 0.1.15 -> 0.1.16" in flagged[0]
    for chart in ("chart-convergence", "chart-convergence-gpu", "chart-parameters", "chart-fla"):
        assert page.evaluate(f"({count})('svg.{chart} .series, svg.{chart} .bar')") > 0, chart
    assert page.evaluate("document.querySelector('#winners').textContent").count("main: ") == 1
    width, height = png_size(page.screenshot(site.parent / "dashboard-regressed.png"))
    assert width == 1280 and height > 900


@needs_browser
def test_steady_page_has_no_regression_marker(site, browser):
    page = open_clean(browser, site / page_name(STEADY))
    assert page.evaluate("document.querySelectorAll('svg.chart-history .point').length") == 3
    assert page.evaluate("document.querySelectorAll('.marker, tr.flagged').length") == 0
    assert "driver 575.51.03" in page.evaluate("document.querySelector('svg.chart-history').textContent")
    assert page.evaluate("document.querySelector('#vs-fla').textContent").count("not measured") == 1


@needs_browser
def test_index_lists_both_problems_with_the_slowdown_flagged(site, browser):
    page = open_clean(browser, site / "index.html")
    rows = page.evaluate("[...document.querySelectorAll('#problems tbody tr')]"
                         ".map(r => [r.className, r.querySelector('.badge').dataset.verdict])")
    assert rows == [["flagged", "regressed"], ["", "steady"]]
    assert page.evaluate("document.querySelectorAll('#problems svg.chart-sparkline').length") == 2
    assert page.evaluate("document.querySelectorAll('svg.chart-fla .bar').length") == 3
    links = page.evaluate("[...document.querySelectorAll('a')].map(a => a.getAttribute('href'))")
    assert {page_name(SLOW), page_name(STEADY), "model.html"} <= set(links)
    png_size(page.screenshot(site.parent / "dashboard-index.png"))


@needs_browser
def test_model_page_rings_the_spill_miss(site, browser):
    page = open_clean(browser, site / "model.html")
    assert page.evaluate("document.querySelectorAll('svg.chart-calibration .calibration').length") == 4
    assert page.evaluate("document.querySelectorAll('svg.chart-calibration .calibration.miss').length") == 1
    assert "chunk_size=96" in page.evaluate("document.querySelector('#misses').textContent")
    png_size(page.screenshot(site.parent / "dashboard-model.png"))


@needs_browser
def test_problem_page_shows_the_winner_against_fla_over_time_with_the_floor(site, browser):
    page = open_clean(browser, site / page_name(SLOW))
    count = "n => document.querySelectorAll(n).length"
    assert page.evaluate(f"({count})('svg.chart-versus')") == 1
    assert page.evaluate(f"({count})('svg.chart-versus .point.ours')") == 3
    assert page.evaluate(f"({count})('svg.chart-versus .point.fla')") == 3
    floor = page.evaluate("document.querySelector('svg.chart-versus .floor title').textContent")
    assert floor == f"memory-bound floor {FLOOR_MS:.4g} ms"
    drawn = "m => m.getBoundingClientRect().height > 0"
    assert page.evaluate(f"[...document.querySelectorAll('svg.chart-versus .marker.fell_behind')].map({drawn})") \
        == [True]  # fell behind FLA at the upgrade: marked once, on the latest point
    rows = page.evaluate("[...document.querySelectorAll('#against-fla tbody tr')]"
                         ".map(r => [r.className, ...[...r.cells].map(c => c.textContent.trim())])")
    assert len(rows) == 3 and [r[0] for r in rows] == ["flagged", "", ""]  # latest first
    latest = rows[0]
    assert latest[6] == f"{1.3 / 1.1:.2f}x" and latest[7] == f"{FLOOR_MS:.4f}" and latest[8] == "slower"
    assert [r[8] for r in rows[1:]] == ["faster", "faster"] and latest[3] == "0.6.0"
    assert page.evaluate("document.querySelector('#against-fla h3 .badge').dataset.verdict") == "fell_behind"


@needs_browser
def test_a_winner_always_behind_fla_is_shown_but_not_flagged(site, browser):
    page = open_clean(browser, site / page_name(STEADY))
    assert page.evaluate("document.querySelector('#against-fla h3 .badge').dataset.verdict") == "behind"
    assert page.evaluate("document.querySelectorAll('#against-fla tr.flagged, svg.chart-versus .marker').length") == 0
    ratios = page.evaluate("[...document.querySelectorAll('#against-fla tbody tr')].map(r => r.cells[5].textContent)")
    assert ratios == [f"{0.99 / 0.5:.2f}x", f"{1.01 / 0.5:.2f}x", "2.00x"]


@needs_browser
def test_index_gives_each_winner_its_latest_ratio_to_fla(site, browser):
    page = open_clean(browser, site / "index.html")
    cells = page.evaluate("[...document.querySelectorAll('#problems tbody td.versus')]"
                          ".map(c => [c.textContent.trim(), c.querySelector('.badge').dataset.verdict])")
    assert cells == [[f"{1.3 / 1.1:.2f}x fell_behind", "fell_behind"], [f"{0.99 / 0.5:.2f}x behind", "behind"]]


def test_a_database_without_fla_measurements_says_so(tmp_path):
    store = Store(tmp_path / "r.db")
    tune_study(store, STEADY, 3)
    store.close()
    assert run_tune("dashboard", "--db", str(tmp_path / "r.db"), "--out", str(tmp_path / "site")).returncode == 0
    text = (tmp_path / "site" / page_name(STEADY)).read_text()
    assert "no FLA measurement beside a winner" in text and "chart-versus" not in text
