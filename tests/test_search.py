"""The tuning loop against real processes and real SQLite files: a compile-only study of
``linear`` at dk=64, killed with SIGKILL and resumed; bad input; a locked database."""
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter

import optuna
import pytest

from tuner import space
from tuner.candidate import violations
from tuner.errors import UserError
from tuner.problem import Problem

import search_doubles
from sqlite_lock import LOCK_HOLDER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tune_cmd(db, *args):
    return [sys.executable, "-m", "tuner.cli", "run", "--variant", "linear", "--dk", "64", "--db", str(db), *args]


def run_tune(db, *args, env=None, timeout=600):
    return subprocess.run(tune_cmd(db, *args), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


def query(db, sql):
    con = sqlite3.connect(db, timeout=30)
    try:
        return con.execute(sql).fetchall()
    except sqlite3.OperationalError:  # tables not created yet
        return []
    finally:
        con.close()


def rows(db):
    return query(db, "SELECT id, study, number, status, digest, config, repeat_of, reason FROM tuner_trials ORDER BY id")


def optuna_states(db):
    return dict(query(db, "SELECT number, state FROM trials"))


@pytest.mark.slow
def test_compile_only_study_survives_kill_9_and_resumes_without_loss_or_duplicates(tmp_path, cache_env):
    db = tmp_path / "results.db"
    proc = subprocess.Popen(tune_cmd(db, "--trials", "5", "--jobs", "1"), cwd=ROOT, env=cache_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    # Kill once a row is recorded and another trial is in flight (RUNNING in Optuna).
    while time.monotonic() < deadline:
        if rows(db) and "RUNNING" in optuna_states(db).values():
            break
        assert proc.poll() is None, "the tuner ended before it could be killed"
        time.sleep(0.2)
    else:
        pytest.fail("no trial was recorded within 300 s")
    os.killpg(proc.pid, signal.SIGKILL)  # the tuner and its compile processes, as kill -9 would
    proc.wait()
    before = rows(db)
    running_at_kill = [n for n, s in optuna_states(db).items() if s == "RUNNING"]
    assert before and running_at_kill

    done = run_tune(db, "--trials", "5", "--jobs", "1", env=cache_env)
    assert done.returncode == 0, done.stderr
    after = rows(db)
    assert after[:len(before)] == before  # every earlier row kept, unchanged
    assert len({(r[1], r[2]) for r in after}) == len(after)  # never two rows for one trial
    judged = [r for r in after if r[6] is None and r[4] is not None]
    assert len({r[4] for r in judged}) == len(judged)  # no kernel judged twice
    states = optuna_states(db)
    assert "RUNNING" not in states.values()
    finished = {n for n, s in states.items() if s in ("COMPLETE", "PRUNED")}
    assert finished == {r[2] for r in after}  # one row per finished trial
    compiled = [r for r in after if r[3] not in ("constraint", "pruned") and r[6] is None]
    assert len(compiled) == 5  # --trials counts kernels compiled and judged; the rest is free
    study = optuna.load_study(study_name=after[0][1], storage=f"sqlite:///{db}")
    recorded = {r[2] for r in after}
    for n in running_at_kill:  # a trial lost with the process: settled from its row, or failed and re-run
        if n in recorded and n in {r[2] for r in before}:
            assert states[n] in ("COMPLETE", "PRUNED")
        else:
            assert states[n] == "FAIL"
            lost = study.trials[n].params  # re-proposed: judged, or first in line once the budget allows
            assert any(t.system_attrs.get("fixed_params", t.params) == lost and t.number > n
                       and (t.number in recorded or t.state.name == "WAITING") for t in study.trials)
    assert {r[3] for r in after} <= {"constraint", "pruned", "compile_error", "screen", "compiled"}
    default = space.load("linear").default(Problem("linear", 64, 64))
    assert any(json.loads(r[5]) == default and r[3] == "compiled" for r in after)  # trial 0 is the default
    assert "latency needs a GPU" in done.stdout
    (study,) = query(db, "SELECT study_name FROM studies")  # Optuna's tables beside ours
    assert study[0] == after[0][1] and study[0].startswith("linear-k64-v64-bf16-b4-t8192-h16@none-")

    # The same command again: the study is complete, nothing new is judged or recorded. While
    # another process holds the database locked, it waits and then succeeds.
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(db), "3"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    start = time.monotonic()
    again = run_tune(db, "--trials", "5", env=cache_env)
    holder.wait()
    assert again.returncode == 0, again.stderr
    assert time.monotonic() - start > 2.0
    assert rows(db) == after


def one_error_line(result):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("tune: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("args, says", [
    (["--variant", "nope", "--dk", "64"], "unknown variant 'nope'"),
    (["--variant", "linear", "--dk", "0"], "positive integer"),
    (["--variant", "linear", "--dk", "96"], "dk=96 is not supported"),
    (["--variant", "linear", "--dk", "64", "--trials", "0"], "positive integer"),
    (["--variant", "linear", "--dk", "64", "--fix", "bogus=1"], "unknown parameter 'bogus' for linear"),
    (["--variant", "linear", "--dk", "64", "--fix", "block_dv=48"], "block_dv=48 is not one of"),
    (["--variant", "linear", "--dk", "64", "--fix", "block_dv"], "expected NAME=VALUE"),
], ids=["unknown-variant", "dk-0", "dk-96", "trials-0", "fix-unknown", "fix-bad-value", "fix-no-value"])
def test_bad_input_exits_2_with_one_line(tmp_path, args, says):
    result = subprocess.run([sys.executable, "-m", "tuner.cli", "run", *args, "--db", str(tmp_path / "r.db")],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert says in one_error_line(result)
    assert not (tmp_path / "r.db").exists()


@pytest.mark.parametrize("content", [b"not a database at all\n" * 50, b"SQLite format 3\x00" + b"\x00" * 200],
                         ids=["foreign", "truncated-sqlite"])
def test_an_unusable_database_exits_2_and_is_left_byte_identical(tmp_path, content):
    db = tmp_path / "results.db"
    db.write_bytes(content)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    line = one_error_line(run_tune(db, "--trials", "1", timeout=120))
    assert str(db) in line and "left untouched" in line
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert sorted(os.listdir(tmp_path)) == ["results.db"]  # no journal or WAL beside it either


def test_a_default_run_writes_the_users_database_and_leaves_the_shipped_one_untouched(tmp_path, monkeypatch,
                                                                                      capsys):
    # The README's main job (`tune --variant V --dk N`, no --db) from the repository root, as a new
    # user runs it; nothing to compile (without_kernels), the rest is the real path.
    from tuner import cli, paths

    without_kernels(monkeypatch, tmp_path)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv(paths.DB_ENV, raising=False)
    monkeypatch.chdir(ROOT)
    shipped = paths.SHIPPED_DB
    before = hashlib.sha256(shipped.read_bytes()).hexdigest(), shipped.stat().st_mtime_ns
    beside = sorted(os.listdir(ROOT))
    assert cli.main(["--variant", "linear", "--dk", "64", "--trials", "2"]) == 0
    assert (hashlib.sha256(shipped.read_bytes()).hexdigest(), shipped.stat().st_mtime_ns) == before
    assert sorted(os.listdir(ROOT)) == beside  # no -wal, -journal or .compile.log beside it either
    user = tmp_path / "data" / "linattn-tuner" / "results.db"
    assert [r[3] for r in rows(user)].count("compiled") == 2
    out = capsys.readouterr().out
    assert f"results go to {user}; compile log {user}.compile.log" in out and f"results: {user}" in out


@contextlib.contextmanager
def immutable(path):
    """``path`` made immutable (``chattr +i``): unwritable for every user, root included, as a
    mode-0444 file is for an ordinary one (the tests run as root, whom file modes do not stop)."""
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i is not available here: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_database_the_user_may_not_write_exits_2_before_anything_compiles(tmp_path, cache_env):
    from tuner.store import Store

    db = tmp_path / "results.db"
    Store(db).close()  # an existing, sound results database
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    with immutable(db):
        line = one_error_line(run_tune(db, "--trials", "1", env=cache_env, timeout=120))
    assert str(db) in line and "read-only" in line
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert not list((tmp_path / "cache").rglob("*.report.json"))  # no kernel compiled


def compiler_running_under(pid: int) -> bool:
    """Whether an nvcc (or a stage it runs) is a descendant of process ``pid``."""
    parents, names = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        parents[int(entry)], names[int(entry)] = int(fields[1]), name
    def descends(p):
        while p > 1:
            if p == pid:
                return True
            p = parents.get(p, 0)
        return False
    return any(name in ("nvcc", "cicc", "ptxas", "cudafe++") and descends(p) for p, name in names.items())


@pytest.mark.slow
@pytest.mark.parametrize("command", [["run", "--trials", "1", "--jobs", "1"], ["compile"]], ids=["tune", "compile"])
def test_ctrl_c_during_a_compile_leaves_nothing_a_later_run_believes(tmp_path, cache_env, command):
    db = ["--db", str(tmp_path / "results.db")] if command[0] == "run" else []
    cmd = [sys.executable, "-m", "tuner.cli", command[0], "--variant", "linear", "--dk", "64", *command[1:], *db]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cache_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not compiler_running_under(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, "no compiler was seen running"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert not list((tmp_path / "cache").rglob("*.report.json")), out  # nothing stored for the compile cut off
    again = subprocess.run(cmd, cwd=ROOT, env=cache_env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    if command[0] == "run":
        assert [r[3] for r in rows(tmp_path / "results.db")] == ["compiled"]  # the default, compiled this time
    else:
        assert ": ok, 1 kernel(s)" in again.stdout and "cached report" not in again.stdout


FIXTURE = os.path.join(ROOT, "tests", "fixtures", "torch_forward.py")
# The fixture gate's watchdog: long enough for a loaded 2-core machine to time the CPU module at a
# larger shape, short enough to wait out a hang.
GATE_S = 30
SMALL = Problem("linear", 64, 64, batch=1, seqlen=128, heads=1)
# What the hand-written module does when the gate runs it for each config.
BEHAVIOURS = [(space.load("linear").complete(SMALL, change), behaviour) for change, behaviour in (
    ({"num_stages": 2}, "hang"), ({"num_stages": 1}, "nan"), ({"num_stages": 0}, "correct"))]


def fixture_gate(candidate, *, timeout_s, device, also_at=()):
    """The real gate (child process, watchdog) on the hand-written CPU module instead of the kernel."""
    from tuner.candidate import Candidate
    from tuner.gate import gate_and_time

    behaviour = next(b for c, b in BEHAVIOURS if c == candidate.config)
    with open(FIXTURE) as f:
        source = f.read().replace('BEHAVIOUR = "correct"', f'BEHAVIOUR = "{behaviour}"').replace(
            'VARIANT = "decay"', 'VARIANT = "linear"')
    return gate_and_time(Candidate(candidate.problem, candidate.config, source), timeout_s=GATE_S, device=device,
                         seqlens=(64,), batch=1, heads=1, seeds=(0,), rep=3, warmup_ms=1, also_at=also_at)


def refusing_gate(gated: list, seconds: float = 0):
    """A gate that notes each config it is given in ``gated``, takes ``seconds`` and refuses it
    (for tests that look at what reaches the GPU, not at kernels)."""
    from tuner.gate import GateResult

    def gate(candidate, *, timeout_s, device):
        gated.append(candidate.config)
        time.sleep(seconds)
        return GateResult("mismatch", message="not run: the test looks at what reaches the gate")

    return gate


def without_kernels(monkeypatch, tmp_path, compile=search_doubles.compile_nothing):
    """The tuner's compile step is ``compile`` (a compile that succeeds at once with no kernels): its
    loop runs with nothing to compile, for tests that look at the search rather than at kernels."""
    from tuner.search import compiling

    monkeypatch.setenv("LINATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compiling, "compile_for_gate", compile)


def enqueue(db, problem, configs):
    """Create the study tune() will resume, with these configs first in line."""
    from tuner import search, stack

    study = optuna.create_study(storage=f"sqlite:///{db}", direction="minimize",
                                study_name=search.study_name(problem, stack.current()))
    for config in configs:
        study.enqueue_trial(config)
    return study.study_name


@pytest.mark.slow
def test_a_hang_and_a_nan_are_recorded_and_the_study_carries_on_to_a_winner(tmp_path, monkeypatch):
    from tuner import search
    from tuner.store import Store

    monkeypatch.setenv("LINATTN_CACHE", str(tmp_path / "cache"))
    db = tmp_path / "results.db"
    name = enqueue(db, SMALL, [c for c, _ in BEHAVIOURS])
    summary = search.tune(SMALL, trials=3, db=str(db), jobs=2, gate=fixture_gate)

    by_stages = {r.config["num_stages"]: r for r in Store(db).trials()}
    hang, nan, good = (by_stages[c["num_stages"]] for c, _ in BEHAVIOURS)
    assert (hang.status, nan.status, good.status) == ("hang", "nan", "pass")
    assert GATE_S <= hang.gpu_seconds < GATE_S + 45  # the watchdog killed it
    assert good.median_ms > 0 and good.p10_ms <= good.median_ms <= good.p90_ms
    states = {t.number: t.state.name for t in optuna.load_study(study_name=name, storage=f"sqlite:///{db}").trials}
    assert states == {hang.number: "PRUNED", nan.number: "PRUNED", good.number: "COMPLETE"}
    (winner,) = Store(db).winners()  # the one config that passed, with its gate errors
    assert winner.config == good.config and winner.median_ms == good.median_ms and winner.gate_errors
    assert summary.winner.number == good.number and summary.counts["hang"] == 1


@pytest.mark.slow
def test_each_kernel_judged_is_recorded_at_every_also_at_shape_with_its_timing_and_winner(tmp_path, monkeypatch):
    from tuner import search
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)  # the fixture gate runs its own module
    db = tmp_path / "results.db"
    (nan, _), (good, _) = BEHAVIOURS[1:]
    enqueue(db, SMALL, [nan, good])
    larger = "2x1024x4"  # 64 times the tokens of SMALL
    for _ in range(2):  # the second run resumes: nothing new is judged or recorded
        summary = search.tune(SMALL, trials=2, db=str(db), jobs=2, gate=fixture_gate,
                              also_at=(larger,))

    records = Store(db).trials()
    companion = search.study_name(SMALL.at(larger), search.stack.current())
    tuned = {r.config["num_stages"]: r for r in records if r.study == summary.study}
    at = {r.config["num_stages"]: r for r in records if r.study == companion}
    assert len(records) == 4 and {n: r.status for n, r in at.items()} == {n: r.status for n, r in tuned.items()}
    assert tuned[good["num_stages"]].status == "pass" and tuned[nan["num_stages"]].status == "nan"
    for n, row in at.items():
        assert row.digest == tuned[n].digest and row.problem == SMALL.at(larger)
        assert row.gate_errors == tuned[n].gate_errors and f"judged by trial {tuned[n].number}" in row.reason
    passed, tuned_pass = at[good["num_stages"]], tuned[good["num_stages"]]
    assert passed.median_ms > tuned_pass.median_ms and passed.p10_ms <= passed.median_ms <= passed.p90_ms

    winners = {w.problem.shape: w for w in Store(db).winners()}
    assert set(winners) == {SMALL.shape, larger} and winners[larger].config == good
    assert winners[larger].median_ms == passed.median_ms and summary.also_at[0].winner.number == passed.number
    trials = {t.number: t for t in optuna.load_study(study_name=companion, storage=f"sqlite:///{db}").trials}
    tuned_trials = {t.number: t for t in optuna.load_study(study_name=summary.study, storage=f"sqlite:///{db}").trials}
    assert trials[passed.number].state.name == "COMPLETE" and trials[passed.number].value == passed.median_ms
    failed, tuned_failed = trials[at[nan["num_stages"]].number], tuned_trials[tuned[nan["num_stages"]].number]
    assert failed.state.name == "PRUNED" and failed.user_attrs["status"] == "nan"
    constraints = {k: v for k, v in tuned_failed.system_attrs.items() if k.startswith("constraints")}
    assert constraints and {k: failed.system_attrs.get(k) for k in constraints} == constraints  # as TPE reads it


@pytest.mark.slow
def test_a_config_that_breaks_a_constraint_is_followed_by_the_nearest_valid_one(tmp_path, monkeypatch):
    from tuner import search
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)
    db = tmp_path / "results.db"
    refused = {**space.load("linear").default(SMALL), "threads": 256}
    name = enqueue(db, SMALL, [refused])
    gated = []
    search.tune(SMALL, trials=1, db=str(db), jobs=1, gate=refusing_gate(gated))

    first, second = Store(db).trials()
    assert (first.config, first.status, second.status) == (refused, "constraint", "mismatch")
    assert violations(SMALL, second.config) == [] and gated == [second.config]
    assert [k for k in refused if refused[k] != second.config[k]] in (["threads"], ["scores_in"])  # one change
    trials = optuna.load_study(study_name=name, storage=f"sqlite:///{db}").trials
    # Optuna records every parameter it drew, the caller's packed at its one searched value too.
    told = [space.load("linear").normalise(t.params) for t in trials]
    assert told == [refused, second.config] and trials[0].constraints == {"space": 1.0}


def test_a_trial_another_worker_took_for_lost_is_recorded_and_the_study_carries_on(tmp_path, monkeypatch):
    """Under load a worker can outlast the orphan or heartbeat window; another worker then fails its
    RUNNING trial and re-proposes the config (as ``_Tuner._abandon`` does). The worker holding it
    records the outcome and goes on (it used to die telling Optuna); the re-proposal repeats it."""
    from optuna.trial import TrialState

    from tuner import search
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)
    db = tmp_path / "results.db"
    refuse, gated = refusing_gate([]), []

    def gate_whose_trial_is_taken(candidate, *, timeout_s, device):
        if not gated:  # the other worker's recover(): every RUNNING trial failed and re-proposed
            study = optuna.load_study(study_name=optuna.get_all_study_names(f"sqlite:///{db}")[0],
                                      storage=f"sqlite:///{db}")
            for trial in study.get_trials(states=(TrialState.RUNNING,)):
                study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
                study.enqueue_trial(trial.params)
        gated.append(candidate.config)
        return refuse(candidate, timeout_s=timeout_s, device=device)

    summary = search.tune(SMALL, trials=2, db=str(db), jobs=1, gate=gate_whose_trial_is_taken)

    records = Store(db).trials(summary.study)
    first = next(r for r in records if r.config == gated[0])
    assert first.status == "mismatch" and first.repeat_of is None  # the outcome of the taken trial, kept
    assert any(r.repeat_of == first.number for r in records)  # the re-proposal found it, not judged again
    # the study went on to --trials kernels judged (the taken trial's among them: its row is the
    # judgement), none judged twice
    assert len(gated) == len({json.dumps(c, sort_keys=True) for c in gated}) == 2
    states = {t.number: t.state for t in optuna.load_study(study_name=summary.study, storage=f"sqlite:///{db}").trials}
    assert states[first.number] == TrialState.FAIL and TrialState.RUNNING not in states.values()


def test_a_trial_failed_by_another_worker_inside_ask_is_left_to_it(tmp_path, monkeypatch):
    """An untagged trial is an orphan to the other workers once ORPHAN_S old: a slow ask() can lose
    its trial before the worker tags it. The worker drops it (the other re-proposed the config)."""
    from optuna.trial import TrialState

    from tuner import search
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)
    db = tmp_path / "results.db"
    ask, taken = optuna.Study.ask, []

    def ask_whose_first_trial_is_taken(study, *args, **kwargs):
        trial = ask(study, *args, **kwargs)
        if not taken:
            taken.append(trial.number)
            study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        return trial

    monkeypatch.setattr(optuna.Study, "ask", ask_whose_first_trial_is_taken)
    summary = search.tune(SMALL, trials=2, db=str(db), jobs=1, gate=refusing_gate([]))

    records = Store(db).trials(summary.study)
    assert taken == [0] and 0 not in {r.number for r in records}
    assert len([r for r in records if r.status == "mismatch" and r.repeat_of is None]) == 2


@pytest.mark.slow
def test_a_seed_makes_the_sampled_configs_reproducible(tmp_path, monkeypatch):
    from tuner import search
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)

    def sampled(db, seed):
        """The configs in the order they were asked (rows are recorded as compiles finish)."""
        search.tune(SMALL, trials=6, db=str(tmp_path / db), jobs=1, gate=refusing_gate([]), seed=seed)
        return [r.config for r in sorted(Store(tmp_path / db).trials(), key=lambda r: r.number)]

    first, again, other = sampled("a.db", 7), sampled("b.db", 7), sampled("c.db", 8)
    asked = min(len(first), len(again), len(other))  # a run may ask one more while the last kernel compiles
    assert asked >= 6 and first[:asked] == again[:asked] and other[:asked] != first[:asked]


@pytest.mark.slow
def test_a_search_space_whose_values_changed_continues_in_a_study_of_its_own(tmp_path, monkeypatch, capsys):
    from dataclasses import replace

    from tuner import search
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)
    db = tmp_path / "results.db"
    before = search.tune(SMALL, trials=2, db=str(db), jobs=1, gate=refusing_gate([]))
    kept = [(r.number, r.status) for r in Store(db).trials(before.study)]

    sp = space.load("linear")
    widened = replace(sp, params={**sp.params, "threads": replace(sp.params["threads"], values=(128, 256, 384))})
    monkeypatch.setattr(search.spaces, "load", lambda variant: widened)
    for _ in range(2):  # Optuna refuses other values for a parameter within one study; resuming finds the new one
        after = search.tune(SMALL, trials=3, db=str(db), jobs=1, gate=refusing_gate([]))
        assert after.study == f"{before.study}~{widened.digest()}"
    assert capsys.readouterr().out.count("values of threads") == 2
    assert [(r.number, r.status) for r in Store(db).trials(before.study)] == kept  # the old study is left as it was
    assert len([r for r in Store(db).trials(after.study) if r.status == "mismatch" and r.repeat_of is None]) == 3


def test_a_study_continued_under_a_changed_space_asks_the_earlier_studys_fastest_configs_first(tmp_path):
    """A space that grew a value starts a study of its own; its first configs are the earlier study's
    fastest passing ones (failed ones are not), restated in the new space, then the default. A config
    with a value the new space no longer offers is left out."""
    from dataclasses import replace

    from tuner import stack
    from tuner.search.strategy import CARRIED_OVER, open_study
    from tuner.status import Status
    from tuner.store import Store

    store, here = Store(tmp_path / "results.db"), stack.current()
    sp = space.load("linear")
    configs = [sp.complete(SMALL, {"num_stages": n, "threads": t}) for n in (0, 1, 2) for t in (128, 256)]
    times = [0.5, 0.2, 0.9, 0.1, 0.3, 0.4]
    strategy, changed = open_study(SMALL, here, store, sp)
    assert not changed
    for config, ms in zip(configs, times):
        strategy.add_judged(config, Status.PASS, "", ms)
    strategy.add_judged(sp.complete(SMALL, {"num_stages": 3}), Status.MISMATCH, "wrong", None)
    fastest = [config for _, config in sorted(zip(times, configs), key=lambda pair: pair[0])]

    def first_asked(new_space):
        new, changed = open_study(SMALL, here, store, new_space)
        assert changed and new.name != strategy.name
        return [new.ask()[1] for _ in range(CARRIED_OVER + 1)]

    widened = replace(sp, params={**sp.params, "threads": replace(sp.params["threads"], values=(128, 256, 384))})
    assert first_asked(widened) == fastest[:CARRIED_OVER] + [widened.default(SMALL)]
    # The fastest config's num_stages (1) dropped: the next four, in order.
    narrowed = replace(sp, params={**sp.params, "num_stages": replace(sp.params["num_stages"], values=(0, 2, 3, 4))})
    assert first_asked(narrowed) == [c for c in fastest if c["num_stages"] != 1][:CARRIED_OVER] + \
        [narrowed.default(SMALL)]


@pytest.mark.slow
def test_a_kernel_the_templates_no_longer_render_is_judged_again_and_only_that_counts(tmp_path, monkeypatch, capsys):
    """After a template change a study's rows judged kernels its configs no longer render to: resumed,
    the study does not count them toward --trials, judges the kernel the config renders to now and
    makes that the winner."""
    from tuner import search
    from tuner.console import print_summary
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)
    db = tmp_path / "results.db"
    good = BEHAVIOURS[2][0]
    name = enqueue(db, SMALL, [good])
    before = search.tune(SMALL, trials=1, db=str(db), jobs=1, gate=fixture_gate)
    (first,) = Store(db).trials(name)
    assert first.status == "pass" and before.winner.number == first.number and before.stale == 0
    # What a template change leaves behind: the row's kernel is not what its config renders to now.
    old = "0" * len(first.digest)
    con = sqlite3.connect(db)
    with con:
        for table in ("tuner_trials", "tuner_claims"):
            con.execute(f"UPDATE {table} SET digest = ? WHERE study = ?", (old, name))
    con.close()
    optuna.load_study(study_name=name, storage=f"sqlite:///{db}").enqueue_trial(good)

    after = search.tune(SMALL, trials=1, db=str(db), jobs=1, gate=fixture_gate)
    judged = sorted((r for r in Store(db).trials(name) if r.repeat_of is None), key=lambda r: r.number)
    assert after.study == name and [(r.digest, r.status) for r in judged] == [(old, "pass"), (first.digest, "pass")]
    assert after.stale == 1 and after.judged == 1 and after.winner.number == judged[1].number
    print_summary(after)
    said = " ".join(capsys.readouterr().out.split())
    assert "2 kernels judged" in said and "1 of the kernels judged are no longer what the templates render" in said


@pytest.mark.slow
def test_tune_seed_on_the_command_line_reproduces_the_configs_asked(tmp_path, cache_env):
    def asked(db):
        result = run_tune(tmp_path / db, "--trials", "3", "--jobs", "1", "--seed", "4", env=cache_env)
        assert result.returncode == 0, result.stderr
        return [r[0] for r in query(tmp_path / db, "SELECT config FROM tuner_trials ORDER BY number")]

    first, again = asked("a.db"), asked("b.db")  # the second run loads the kernels the first one compiled
    n = min(len(first), len(again))  # a run may ask one more while its last kernel compiles
    assert n >= 3 and again[:n] == first[:n]


@pytest.mark.slow
def test_compile_failures_are_recorded_and_never_gated(tmp_path, monkeypatch):
    from tuner import search
    from tuner.store import Store

    monkeypatch.setenv("LINATTN_CACHE", str(tmp_path / "cache"))
    # The compile processes find no nvcc, nor these kernels in TileLang's cache (where an earlier test
    # of the same configs left them).
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang"))
    db = tmp_path / "results.db"
    enqueue(db, SMALL, [c for c, _ in BEHAVIOURS[:2]])
    gated = []
    summary = search.tune(SMALL, trials=2, db=str(db), jobs=2,
                          gate=lambda *a, **k: gated.append(a))  # never called
    records = Store(db).trials()
    assert [r.status for r in records] == ["compile_error"] * 2 and "nvcc" in records[0].reason
    assert gated == [] and summary.winner is None and Store(db).winners() == []


@pytest.mark.slow
def test_fixed_parameters_hold_in_every_trial_of_a_study_of_their_own(tmp_path, monkeypatch):
    from tuner import search
    from tuner.store import Store

    monkeypatch.setenv("LINATTN_CACHE", str(tmp_path / "cache"))
    gated = []
    summary = search.tune(SMALL, trials=3, db=str(tmp_path / "r.db"), jobs=2,
                          gate=refusing_gate(gated), fixed={"num_stages": "0", "block_dv": "32"})
    assert summary.study.endswith(f"+num_stages=0+block_dv=32@{search.stack.current().key()}")
    records = Store(tmp_path / "r.db").trials()
    assert len([r for r in records if r.status == "mismatch" and r.repeat_of is None]) == 3  # --trials 3
    assert all((r.config["num_stages"], r.config["block_dv"]) == (0, 32) for r in records)
    first = min(records, key=lambda r: r.number)  # the held space's default, enqueued first
    assert first.config == space.load("linear").complete(SMALL, {"num_stages": 0, "block_dv": 32})
    assert gated and all(c["num_stages"] == 0 for c in gated)


@pytest.mark.slow
def test_the_default_is_asked_with_its_inherited_parameters_stated_and_configs_are_canonical(tmp_path, monkeypatch):
    from tuner import search
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)
    db = tmp_path / "r.db"
    summary = search.tune(SMALL, trials=4, db=str(db), jobs=1, gate=refusing_gate([]),
                          fixed={"split": "chunked"}, seed=3)
    default = space.load("linear").complete(SMALL, {"split": "chunked"})
    assert "block_dv_o" not in default  # it inherits block_dv
    trials = optuna.load_study(study_name=summary.study, storage=f"sqlite:///{db}").trials
    # Unstated, Optuna would draw block_dv_o at random and the first kernel would not be the default.
    assert trials[0].system_attrs["fixed_params"] == {**default, "block_dv_o": default["block_dv"]}
    records = sorted(Store(db).trials(), key=lambda r: r.number)
    assert records[0].config == default
    assert all(r.config.get("block_dv_o") != r.config["block_dv"] for r in records)  # never stated at its inherited value


@pytest.mark.slow
def test_a_compile_that_hangs_is_recorded_and_the_others_go_on(tmp_path, monkeypatch):
    from tuner import limits, search
    from tuner.store import Store

    monkeypatch.setattr(limits, "COMPILE_S", 5.0)
    stuck, fine = (c for c, _ in BEHAVIOURS[:2])
    assert stuck["num_stages"] == 2  # the stuck config's compile never returns, the other's at once
    without_kernels(monkeypatch, tmp_path, compile=search_doubles.compile_stuck_at_two_stages)
    db = tmp_path / "results.db"
    enqueue(db, SMALL, [stuck, fine])
    gated = []
    start = time.monotonic()
    search.tune(SMALL, trials=2, db=str(db), jobs=2, gate=refusing_gate(gated))
    by_stages = {r.config["num_stages"]: r for r in Store(db).trials()}
    assert by_stages[2].status == "hang" and "compile still running after 5 s" in by_stages[2].reason
    assert by_stages[1].status == "mismatch" and gated == [fine]
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_the_deadline_gives_queued_trials_back_and_the_default_is_gated_first(tmp_path, monkeypatch):
    from tuner import search
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)  # nothing to compile: all queue at once
    db = tmp_path / "results.db"
    default = space.load("linear").default(SMALL)
    others = [space.load("linear").complete(SMALL, {"block_dv": bdv, "num_stages": n})
              for bdv in (16, 32) for n in (0, 1)]
    name = enqueue(db, SMALL, [*others, default])  # the default asked last
    gated = []
    start = time.monotonic()
    search.tune(SMALL, timeout=2, db=str(db), jobs=4, gate=refusing_gate(gated, seconds=4))
    # The deadline, the gate in progress and the default's (kept as the baseline), not the whole queue.
    assert time.monotonic() - start < 2 + 2 * 4 + 10
    # The gate in progress at the deadline, if any (a slow start leaves none), then the default.
    assert gated[-1] == default and len(gated) <= 2
    judged = [r.config for r in Store(db).trials() if r.status == "mismatch"]
    assert sorted(map(str, judged)) == sorted(map(str, gated))  # nothing queued left a row
    trials = optuna.load_study(study_name=name, storage=f"sqlite:///{db}").trials
    assert not [t for t in trials if t.state.name == "RUNNING"]
    given_back = Counter(str(t.params) for t in trials if t.state.name == "FAIL")
    waiting = Counter(str(t.system_attrs["fixed_params"]) for t in trials if t.state.name == "WAITING")
    assert given_back and not given_back - waiting  # each re-proposed for the next run
    # Once the queue is asked out the sampler proposes; one that breaks a constraint enqueues the
    # nearest valid config, which waits too.
    refused = [t for t in trials if t.user_attrs.get("status") == "constraint"]
    assert (waiting - given_back).total() <= len(refused)


def fla_gate(gated: list):
    """The real gate (child process) on FLA's op, the stand-in FLA on the CPU; the tuner's kernels
    refused unrun. ``gated`` gets (config, shape, also_at, watchdog) of each call."""
    from tuner import baseline
    from tuner.gate import GateResult, gate_and_time

    def gate(candidate, *, timeout_s, device, also_at=()):
        gated.append((candidate.config, candidate.problem.shape, also_at, timeout_s))
        if candidate.config != baseline.CONFIG:
            return GateResult("mismatch", message="not run: the test looks at FLA's baseline")
        return gate_and_time(candidate, timeout_s=GATE_S, device=device, also_at=also_at, regimes=["default"],
                             seqlens=(64,), batch=1, heads=1, seeds=(0,), rep=3, warmup_ms=1)

    return gate


@pytest.mark.slow
def test_tune_times_fla_once_per_stack_and_version_at_every_shape_it_tunes(tmp_path, monkeypatch, fla_standin,
                                                                          capsys):
    from tuner import baseline, limits, search, stack
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)
    db, larger, gated = tmp_path / "results.db", "1x256x2", []
    for _ in range(2):  # the second run finds FLA measured on this stack with this version
        search.tune(SMALL, trials=1, db=str(db), jobs=1, gate=fla_gate(gated), also_at=(larger,))
    assert [g for g in gated if g[0] == baseline.CONFIG] == [(baseline.CONFIG, SMALL.shape, (larger,), limits.BASELINE_S)]
    rows = Store(db).baselines()
    assert [(b.problem, b.stack, b.fla_version, b.status) for b in rows] == [
        (p, stack.current(), fla_standin, "pass") for p in (SMALL, SMALL.at(larger))]
    assert all(b.p10_ms <= b.median_ms <= b.p90_ms and b.floor_ms > 0 for b in rows)
    assert rows[0].gate_errors["default"]["o"] < 1e-2  # checked against the fp64 oracle like a kernel
    out = capsys.readouterr().out
    assert out.count(f"timing FLA {fla_standin}'s chunk_linear_attn at {SMALL.shape}, {larger}") == 1


@pytest.mark.slow
def test_a_packed_problem_is_tuned_with_packed_kernels_and_fla_timed_on_the_packed_mix(tmp_path, monkeypatch,
                                                                                     fla_standin):
    """``--fix packed=true``: the study's problem is packed, every kernel judged states packed, and FLA's
    op is gated and timed on the packed regime's mix (its floor counts one state per sequence), apart
    from the dense problem of the same shape."""
    from tuner import search, stack
    from tuner.bench import inputs_floor_ms, memory_floor_ms
    from tuner.inputs import timing_inputs
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)
    db, gated, shape = tmp_path / "results.db", [], Problem("linear", 64, 64, batch=1, seqlen=600, heads=2)
    summary = search.tune(shape, trials=1, db=str(db), jobs=1, gate=fla_gate(gated), fixed={"packed": "true"})
    packed = dataclasses.replace(shape, packed=True)
    assert summary.study == search.study_name(packed, stack.current(), space.load("linear").fix({"packed": True}))
    assert "-h2-packed+packed=True@" in summary.study
    (b,) = Store(db).baselines()
    assert (b.problem, b.status) == (packed, "pass") and b.gate_errors["default"]["o"] < 1e-2
    x = timing_inputs(packed, "cpu")
    assert x["cu_seqlens"].shape[0] > 5 and x["initial_state"].shape[0] == x["cu_seqlens"].shape[0] - 1
    assert b.floor_ms == pytest.approx(inputs_floor_ms(x)) and b.floor_ms > 1.5 * memory_floor_ms(packed)
    trials = Store(db).trials()
    assert trials and all(t.problem == packed and t.config["packed"] is True for t in trials)
    with pytest.raises(UserError, match="a packed problem is timed as one row"):
        search.tune(Problem("linear", 64, 64, batch=2, seqlen=600, heads=2), trials=1, db=str(db),
                    fixed={"packed": "true"}, gate=fla_gate(gated))
    with pytest.raises(UserError, match="a packed problem's shapes are 1 x total tokens"):
        search.tune(shape, trials=1, db=str(db), fixed={"packed": "true"}, gate=fla_gate(gated), also_at=("2x600x2",))


def test_tune_without_fla_says_so_and_stores_no_baseline(tmp_path, monkeypatch, capsys):
    from tuner import search
    from tuner.store import Store

    without_kernels(monkeypatch, tmp_path)
    db = tmp_path / "results.db"
    search.tune(SMALL, trials=1, db=str(db), jobs=1, gate=refusing_gate([]))
    assert Store(db).baselines() == []
    assert "FLA is not installed: its op is not timed beside the kernels" in capsys.readouterr().out


@pytest.mark.slow
def test_configs_of_one_pruned_kernel_are_one_judgement_and_its_repeats(tmp_path, cache_env):
    """With a budget no kernel meets, every config but the default is pruned; configs that render one
    kernel (parameters the split does not read) repeat the first pruning instead of pruning again."""
    db = tmp_path / "results.db"
    done = run_tune(db, "--trials", "2", "--jobs", "1", "--register-budget", "1", "--seed", "3", env=cache_env)
    assert done.returncode == 0, done.stderr
    after = rows(db)
    judged = [r for r in after if r[6] is None and r[4] is not None]
    assert len({r[4] for r in judged}) == len(judged)  # no kernel judged twice
    repeats = [r for r in after if r[6] is not None]
    assert "pruned" in {r[3] for r in repeats}  # the search did meet a pruned kernel again
    assert [r[3] for r in judged].count("compiled") == 1  # the default, measured though over the budget
