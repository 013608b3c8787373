"""`tune regress`: the noise rule, and the replay of a recorded history in a real SQLite file
built through tuner.store (exit 1 on a slowdown, a gate failure or a winner that fell behind FLA, 0
otherwise, nothing written); FLA re-timed beside the winners (the stand-in, through the real gate)."""
import hashlib
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timedelta

import pytest

from tuner import baseline, stack
from tuner.candidate import Candidate
from tuner.problem import Problem
from tuner.stack import Stack
from tuner.regress import judge, judge_history, replay, versus_fla
from tuner.store import Baseline, Measurement, Store, Winner

H200 = Stack("NVIDIA H200", "sm_90", "0.1.15", "12.8.93", "570.86.15", "2.13.0")
UPGRADED = replace(H200, tilelang="0.1.16")
T0 = datetime(2026, 3, 1)


def measured(median, p10, p90, env=H200, status="pass", day=0, winner_id=1, gate_errors=None):
    return Measurement(winner_id, status, env, median, p10, p90, gate_errors, measured_at=T0 + timedelta(days=day))


def run_tune(*args):
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], capture_output=True, text=True, timeout=120)


def make_db(path, later: list[Measurement], variant="gdn"):
    """A winner tuned at 1.00 ms [0.98, 1.03], then the measurements ``later`` of it."""
    store = Store(path)
    w = store.write_winner(Winner(Problem(variant, 128, 128), H200, "abc123", {"split": "chunked", "chunk_size": 64},
                                  1.0, 0.98, 1.03, {"o": 1e-3}, "study", 7, updated_at=T0), "pass")
    for m in later:
        store.add_measurement(replace(m, winner_id=w.id))
    store.close()
    return w


@pytest.mark.parametrize(
    "new, kind",
    [
        pytest.param(measured(1.10, 1.08, 1.12), "regressed", id="bands-apart-10pct-slower"),
        pytest.param(measured(1.10, 0.95, 1.25), "steady", id="10pct-slower-but-noisy"),
        pytest.param(measured(1.02, 1.031, 1.04), "steady", id="bands-apart-below-floor"),
        pytest.param(measured(0.90, 0.89, 0.91), "improved", id="bands-apart-faster"),
        pytest.param(measured(1.0, 0.99, 1.01, status="mismatch"), "failed", id="gate-mismatch"),
    ],
)
def test_noise_rule_uses_both_bands_and_a_floor(new, kind):
    reference = measured(1.0, 0.98, 1.03)
    verdict = judge(new, [reference])
    assert verdict.kind == kind, verdict.reason
    assert verdict.reference == reference


def test_reference_is_the_fastest_earlier_pass_so_a_repeated_slowdown_stays_flagged():
    history = [measured(1.0, 0.98, 1.03), measured(1.2, 1.18, 1.22, env=UPGRADED, day=1),
               measured(1.2, 1.18, 1.22, env=UPGRADED, day=2), measured(0.5, 0.4, 0.6, status="nan", day=3),
               measured(1.01, 0.99, 1.04, day=4)]
    verdicts = judge_history(history)
    assert [v.kind for v in verdicts] == ["first", "regressed", "regressed", "failed", "steady"]
    assert verdicts[2].reference == history[0]
    assert verdicts[1].changes == ("tilelang 0.1.15 -> 0.1.16",)
    assert verdicts[4].changes == ()  # back on the old stack: judged against the same-stack reference


def test_replay_exits_1_on_a_recorded_slowdown_and_names_the_cause(tmp_path):
    db = tmp_path / "r.db"
    make_db(db, [measured(1.01, 0.99, 1.04, day=1), measured(1.25, 1.22, 1.29, env=UPGRADED, day=2)])
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    out = run_tune("regress", "--replay", "--db", str(db))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "regressed" in out.stdout and "tilelang 0.1.15 -> 0.1.16" in out.stdout
    assert "[p10 1.22, p90 1.29]" in out.stdout  # the spread behind the verdict is shown
    assert "1 of 1 winners regressed" in out.stdout
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before  # a replay writes nothing


@pytest.mark.parametrize(
    "later",
    [
        pytest.param([measured(1.02, 0.99, 1.05, env=UPGRADED, day=1)], id="upgrade-within-noise"),
        pytest.param([measured(1.3, 1.25, 1.35, env=UPGRADED, day=1), measured(0.99, 0.97, 1.02, day=2)],
                     id="slowdown-fixed-since"),
        pytest.param([], id="only-the-tuning-measurement"),
    ],
)
def test_replay_exits_0_without_a_slowdown(tmp_path, later):
    db = tmp_path / "r.db"
    make_db(db, later)
    out = run_tune("regress", "--replay", "--db", str(db))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no regression among 1 winners" in out.stdout


def test_replay_exits_1_when_the_latest_measurement_failed_the_gate(tmp_path):
    db = tmp_path / "r.db"
    make_db(db, [measured(None, None, None, status="mismatch", env=UPGRADED, day=1, gate_errors={"uniform": {"o": 0.31, "seqlen": 1000}})])
    out = run_tune("regress", "--replay", "--db", str(db))
    assert out.returncode == 1
    assert "gate: mismatch (uniform.o=0.31, uniform.seqlen=1000)" in out.stdout


def test_replay_judges_only_the_variants_asked_for(tmp_path):
    db = tmp_path / "r.db"
    make_db(db, [measured(1.25, 1.22, 1.29, day=1)], variant="gdn")
    make_db(db, [measured(1.0, 0.98, 1.03, day=1)], variant="kda")
    assert run_tune("regress", "--replay", "--db", str(db), "--variant", "kda").returncode == 0
    assert run_tune("regress", "--replay", "--db", str(db), "--variant", "gdn").returncode == 1
    assert run_tune("regress", "--replay", "--db", str(db)).returncode == 1


def test_replay_of_a_missing_database_is_a_one_line_error(tmp_path):
    out = run_tune("regress", "--replay", "--db", str(tmp_path / "absent.db"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"tune: error: {tmp_path / 'absent.db'} does not exist"]


@pytest.mark.skipif(stack.has_gpu(), reason="checks the message shown without a CUDA device")
def test_without_a_gpu_regress_says_so_and_points_to_replay(tmp_path):
    db = tmp_path / "r.db"
    make_db(db, [])
    out = run_tune("regress", "--db", str(db))
    assert out.returncode == 2
    assert "no CUDA device" in out.stderr and "--replay" in out.stderr
    assert len(Store(db).history()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not stack.has_gpu(), reason="needs a CUDA device")
def test_regress_re_times_a_real_winner_and_appends_to_its_history(tmp_path):
    from tuner import space
    from tuner.candidate import Candidate
    from tuner.gate import gate_and_time

    problem = Problem("linear", 64, 64, batch=1, seqlen=1024, heads=4)
    config = space.load("linear").default(problem)
    candidate = Candidate.from_config(problem, config)
    tuned = gate_and_time(candidate, timeout_s=300, device=0)
    assert tuned.status == "pass", tuned.message
    t = tuned.timing
    env = stack.current(0)
    db = tmp_path / "r.db"
    store = Store(db)
    w = store.write_winner(Winner(problem, env, candidate.digest, config, t["median_ms"], t["p10_ms"],
                                  t["p90_ms"], tuned.errors, "study", 0), "pass")
    out = run_tune("regress", "--db", str(db))
    assert out.returncode in (0, 1), out.stderr
    history = store.history(w.id)
    assert len(history) == 2 and history[-1].status == "pass" and history[-1].stack == env
    verdict = judge(history[-1], history[:-1])
    assert (out.returncode == 1) == verdict.flagged


def test_a_template_change_is_named_among_the_changes_of_a_slowdown(tmp_path):
    before = replace(measured(1.0, 0.98, 1.03), digest="abc123")
    after = replace(measured(1.10, 1.08, 1.12, day=1), digest="def456")
    verdict = judge(after, [before])
    assert verdict.kind == "regressed"
    assert "template abc123 -> def456" in verdict.changes
    make_db(tmp_path / "r.db", [after])
    stored = Store(tmp_path / "r.db", readonly=True).history()
    assert [m.digest for m in stored] == ["abc123", "def456"]  # the tuning-time entry carries the winner's digest


def test_winners_of_one_kernel_at_several_shapes_are_gated_once_and_each_timed_at_its_shape(tmp_path, monkeypatch):
    """`tune regress` with the real gate (child process, timing) on the CPU module in place of the kernels."""
    from pathlib import Path

    from tuner import gate, regress, space
    from tuner.candidate import Candidate

    monkeypatch.setattr(stack, "has_gpu", lambda: True)
    monkeypatch.setattr(stack, "current", lambda device=0: H200)
    source = (Path(__file__).parent / "fixtures" / "torch_forward.py").read_text()  # the correct decay module
    real, calls = gate.gate_and_time, []

    def cpu_gate_and_time(candidate, *, also_at=(), timeout_s, device):
        calls.append((candidate.problem.shape, candidate.config["num_stages"], also_at))
        return real(Candidate(candidate.problem, candidate.config, source), also_at=also_at, timeout_s=120,
                    device=device, regimes=["default"], seqlens=(64,), batch=1, heads=1, seeds=(0,), rep=3, warmup_ms=1)

    monkeypatch.setattr(gate, "gate_and_time", cpu_gate_and_time)
    small, large, other = Problem("decay", 64, 64, batch=1, seqlen=128, heads=2), "2x1024x2", "1x256x1"
    one, two = (space.load("decay").complete(small, {"num_stages": n}) for n in (2, 1))
    store = Store(tmp_path / "r.db")
    written = [store.write_winner(Winner(p, env, Candidate.from_config(p, config).digest, config, 1.0, 0.9, 1.1, {}, "s", 0), "pass")
               for p, config, env in ((small, one, H200), (small.at(large), one, H200), (small, two, H200),
                                      (small.at(other), one, H200),
                                      (small.at(other), two, replace(H200, gpu="NVIDIA H100")))]

    outcomes = regress.remeasure(store, device=0)

    assert calls == [(small.shape, 2, (large, other)), (small.shape, 1, ())]  # one gate per kernel
    assert [o.winner.id for o in outcomes] == [w.id for w in written]
    assert "tuned on NVIDIA H100" in outcomes[-1].note and len(store.history(written[-1].id)) == 1
    latest = {w.problem.shape + str(w.config["num_stages"]): store.history(w.id)[-1] for w in written[:4]}
    assert all(m.status == "pass" and m.p10_ms <= m.median_ms <= m.p90_ms for m in latest.values())
    assert latest[large + "2"].median_ms > latest[small.shape + "2"].median_ms  # 16 times the tokens


def test_winners_of_one_problem_are_told_apart_in_the_replay(tmp_path):
    # Studies with parameters held (--fix split=...) keep winners of their own for one problem.
    db = tmp_path / "r.db"
    make_db(db, [])
    store = Store(db)
    store.write_winner(Winner(Problem("gdn", 128, 128), H200, "def456", {"split": "pre_seq", "chunk_size": 64},
                              0.8, 0.78, 0.83, {"o": 1e-3}, "study+split=pre_seq", 3, updated_at=T0), "pass")
    store.write_winner(Winner(Problem("kda", 128, 128), H200, "0aa111", {"split": "chunked", "chunk_size": 64},
                              2.0, 1.9, 2.1, {"o": 1e-3}, "kda study", 1, updated_at=T0), "pass")
    store.close()
    out = run_tune("regress", "--replay", "--db", str(db)).stdout
    assert "gdn k128 v128 bf16 B4 T8192 H16 · split=chunked" in out
    assert "gdn k128 v128 bf16 B4 T8192 H16 · split=pre_seq" in out
    assert "kda k128 v128 bf16 B4 T8192 H16 " in out and "H16 · chunk_size" not in out  # alone: nothing added


# ---- against FLA: a winner that fell behind its baseline is a regression


def fla_at(median, p10, p90, env=H200, status="pass", day=0, problem=Problem("gdn", 128, 128)):
    timed = status == "pass"
    return Baseline(problem, env, "0.6.0", status, median if timed else None, p10 if timed else None,
                    p90 if timed else None, 0.13 if timed else None, {"default": {"o": 0.2}} if not timed else {},
                    measured_at=T0 + timedelta(days=day, minutes=5))


def make_db_with_fla(path, later: list[Measurement], fla: list[Baseline]):
    w = make_db(path, later)
    store = Store(path)
    for b in fla:
        store.add_baseline(b)
    store.close()
    return w


def test_each_measurement_is_paired_with_flas_on_its_stack_nearest_in_time():
    ours = [measured(1.0, 0.98, 1.03), measured(1.0, 0.98, 1.02, env=UPGRADED, day=1),
            measured(1.2, 1.18, 1.22, day=2), measured(None, None, None, status="nan", day=3)]
    fla = [fla_at(1.1, 1.08, 1.12, day=0), fla_at(0.7, 0.69, 0.71, day=2),
           fla_at(0.5, 0.49, 0.51, env=replace(H200, driver="575.51.03"), day=2)]  # another driver: never paired
    versus = versus_fla(ours, fla)
    # the upgrade changed TileLang only, which FLA's time does not depend on: paired with FLA on that stack
    assert [(p.ours.median_ms, p.fla.median_ms, p.kind) for p in versus.pairs] == [
        (1.0, 1.1, "faster"), (1.0, 1.1, "faster"), (1.2, 0.7, "slower")]
    assert versus.kind == "fell_behind" and versus.flagged
    assert versus.latest.ratio == pytest.approx(1.2 / 0.7)
    assert "slower than FLA beyond the noise, and it was not before: 1.71x FLA 0.6.0" in versus.reason


@pytest.mark.parametrize("fla, kind, flagged", [
    pytest.param([fla_at(0.5, 0.49, 0.51), fla_at(0.5, 0.49, 0.51, day=1)], "behind", False, id="always-slower"),
    pytest.param([fla_at(1.02, 1.0, 1.05), fla_at(0.8, 0.78, 0.82, day=1)], "fell_behind", True, id="was-even"),
    pytest.param([fla_at(1.02, 0.9, 1.2), fla_at(1.05, 0.9, 1.2, day=1)], "even", False, id="within-noise"),
    pytest.param([fla_at(0.5, 0.49, 0.51), fla_at(None, None, None, status="mismatch", day=1)], "fla_failed", False,
                 id="fla-failed-the-gate"),
])
def test_only_a_winner_that_fell_behind_fla_is_flagged(fla, kind, flagged):
    versus = versus_fla([measured(1.0, 0.98, 1.03), measured(1.0, 0.98, 1.03, day=1)], fla)
    assert (versus.kind, versus.flagged) == (kind, flagged), versus.reason


def test_without_a_measurement_of_fla_on_the_stack_there_is_no_comparison():
    assert versus_fla([measured(1.0, 0.98, 1.03)], [fla_at(0.5, 0.49, 0.51, env=replace(H200, gpu="NVIDIA H100"))]) \
        is None


@pytest.mark.parametrize("fla, code, summary, kind, reason", [
    pytest.param([fla_at(1.2, 1.18, 1.22), fla_at(0.8, 0.79, 0.81, day=1)], 1,
                 "1 of 1 winners regressed (1 fell behind FLA)", "fell_behind", "and it was not before", id="fell-behind"),
    pytest.param([fla_at(0.5, 0.49, 0.51), fla_at(0.5, 0.49, 0.51, day=1)], 0, "no regression among 1 winners",
                 "behind", "tuner.ops calls FLA here", id="always-behind"),
])
def test_replay_exits_1_for_a_winner_that_fell_behind_fla_not_for_one_always_behind(tmp_path, fla, code, summary,
                                                                                    kind, reason):
    db = tmp_path / "r.db"
    make_db_with_fla(db, [measured(1.01, 0.99, 1.04, day=1)], fla)
    out = run_tune("regress", "--replay", "--db", str(db))
    assert out.returncode == code, out.stdout + out.stderr
    assert f"{kind}: slower than FLA" in out.stdout and summary in out.stdout
    (outcome,) = replay(Store(db, readonly=True))
    assert outcome.versus.kind == kind and reason in outcome.versus.reason


def cpu_gate(source):
    """The real gate (child process, timing) on the CPU: the tuner's kernels replaced by the hand-written
    module ``source``, FLA's op (the stand-in) run as it is."""
    from tuner import gate

    real = gate.gate_and_time

    def gate_and_time(candidate, *, also_at=(), timeout_s, device):
        if candidate.config != baseline.CONFIG:
            candidate = Candidate(candidate.problem, candidate.config, source)
        return real(candidate, also_at=also_at, timeout_s=120, device=device, regimes=["default"], seqlens=(64,),
                    batch=1, heads=1, seeds=(0,), rep=3, warmup_ms=1)

    return gate_and_time


def decay_winners_at_two_shapes(tmp_path):
    """A store holding the decay default's kernel as the H200 winner at 1x128x2 and 1x256x2."""
    from tuner import space

    small = Problem("decay", 64, 64, batch=1, seqlen=128, heads=2)
    config = space.load("decay").default(small)
    store = Store(tmp_path / "r.db")
    digest = Candidate.from_config(small, config).digest
    return store, [store.write_winner(Winner(p, H200, digest, config, 1.0, 0.9, 1.1, {}, "s", 0), "pass")
                   for p in (small, small.at("1x256x2"))]


def test_regress_re_times_fla_beside_the_winners_and_judges_them_against_it(tmp_path, monkeypatch, fla_standin):
    from pathlib import Path

    from tuner import gate, regress

    monkeypatch.setattr(stack, "has_gpu", lambda: True)
    monkeypatch.setattr(stack, "current", lambda device=0: H200)
    source = (Path(__file__).parent / "fixtures" / "torch_forward.py").read_text()  # the correct decay module
    monkeypatch.setattr(gate, "gate_and_time", cpu_gate(source))
    store, winners = decay_winners_at_two_shapes(tmp_path)

    outcomes = regress.remeasure(store, device=0)

    fla = store.baselines()
    assert [(b.problem, b.stack, b.fla_version, b.status) for b in fla] == [
        (w.problem, H200, fla_standin, "pass") for w in winners]
    for o, b in zip(outcomes, fla):
        assert o.versus is not None and o.versus.latest.fla == b
        assert o.versus.latest.ours == store.history(o.winner.id)[-1]  # paired with the measurement just taken


def test_regress_without_fla_says_so_and_times_the_winners_alone(tmp_path, monkeypatch):
    from pathlib import Path

    from tuner import gate, regress, space

    monkeypatch.setattr(stack, "has_gpu", lambda: True)
    monkeypatch.setattr(stack, "current", lambda device=0: H200)
    monkeypatch.setattr(gate, "gate_and_time", cpu_gate((Path(__file__).parent / "fixtures" / "torch_forward.py")
                                                        .read_text()))
    small = Problem("decay", 64, 64, batch=1, seqlen=128, heads=2)
    config = space.load("decay").default(small)
    store = Store(tmp_path / "r.db")
    store.write_winner(Winner(small, H200, Candidate.from_config(small, config).digest, config, 1.0, 0.9, 1.1, {},
                              "s", 0), "pass")
    (outcome,) = regress.remeasure(store, device=0)
    assert outcome.verdict is not None and outcome.versus is None and store.baselines() == []
    assert "FLA is not installed: its op was not re-timed" in outcome.note


def test_fla_only_times_the_missing_baselines_and_judges_the_recorded_history_without_re_timing(
        tmp_path, monkeypatch, fla_standin):
    from pathlib import Path

    from tuner import gate, regress

    monkeypatch.setattr(stack, "has_gpu", lambda: True)
    monkeypatch.setattr(stack, "current", lambda device=0: H200)
    source = (Path(__file__).parent / "fixtures" / "torch_forward.py").read_text()  # the correct decay module
    timed = []
    real = cpu_gate(source)

    def gate_and_time(candidate, **kwargs):
        timed.append((candidate.config, candidate.problem.shape, kwargs.get("also_at", ())))
        return real(candidate, **kwargs)

    monkeypatch.setattr(gate, "gate_and_time", gate_and_time)
    store, here = decay_winners_at_two_shapes(tmp_path)
    small, first = here[0].problem, here[0]
    elsewhere = store.write_winner(Winner(small.at("1x512x2"), replace(H200, gpu="NVIDIA H100"), first.digest,
                                          first.config, 1.0, 0.9, 1.1, {}, "s", 0), "pass")
    history = {w.id: store.history(w.id) for w in here}
    # Measured before FLA was autotuned at each shape timed: with the configs it chose elsewhere.
    store.add_baseline(Baseline(small, H200, fla_standin, "pass", 0.5, 0.45, 0.55, measured_at=T0))

    outcomes = regress.time_fla(store, device=0, note=lambda _: None)

    assert timed == [(baseline.CONFIG, small.shape, ("1x256x2",))]  # FLA alone, one child for both shapes
    assert {w.id: store.history(w.id) for w in here} == history  # no winner re-timed
    assert [(b.problem, b.autotuned_at_shape) for b in store.baselines()] == [(small, False)] + [
        (w.problem, True) for w in here]
    assert [o.versus.latest.fla.problem if o.versus else None for o in outcomes] == [w.problem for w in here] + [None]
    assert outcomes[-1].winner.id == elsewhere.id

    timed.clear()
    regress.time_fla(store, device=0, note=lambda _: None)
    assert timed == []  # measured on this stack with this FLA already


def test_fla_only_without_fla_is_a_one_line_error(tmp_path, monkeypatch):
    from tuner import regress
    from tuner.errors import UserError

    monkeypatch.setattr(stack, "has_gpu", lambda: True)
    monkeypatch.setattr(baseline, "installed_version", lambda: None)
    with pytest.raises(UserError, match="FLA is not installed"):
        regress.time_fla(Store(tmp_path / "r.db"), device=0)
