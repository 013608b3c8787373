"""Several workers on one study in a real PostgreSQL server (``$LINATTN_TEST_POSTGRES``, which CI
sets; skipped without it): real worker processes, each trial recorded once, no kernel judged
twice, consistent winners, a worker killed with SIGKILL; and ``--gpus`` refused without CUDA.

Run as a script, this file is one gated worker: ``python tests/test_distributed.py URL TRIALS``.
"""
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import optuna
import pytest
import sqlalchemy as sa

from tuner import search, space, stack
from tuner.problem import Problem
from tuner.store import Store, TrialRecord, Winner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POSTGRES = os.environ.get("LINATTN_TEST_POSTGRES")
needs_postgres = pytest.mark.skipif(
    not POSTGRES, reason="LINATTN_TEST_POSTGRES is unset: point it at a PostgreSQL server to run the "
                         "distributed tests (docs/distributed.md shows how)")

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "torch_forward.py")
SMALL = Problem("linear", 64, 64, batch=1, seqlen=128, heads=1)
DEFAULT_SHAPE = Problem("linear", 64, 64)  # what `tune run --variant linear --dk 64` tunes


def configs(problem):
    """Three distinct kernels of the space, by pipelining depth."""
    return [space.load("linear").complete(problem, {"num_stages": n}) for n in (0, 1, 2)]


# What the hand-written module does when the gate runs it, per kernel; any other config is correct.
WRONG = configs(SMALL)[1]


def fixture_gate(candidate, *, timeout_s, device):
    """The real gate (child process, watchdog, timing) on the hand-written CPU module."""
    from tuner.candidate import Candidate
    from tuner.gate import gate_and_time

    behaviour = "wrong" if candidate.config == WRONG else "correct"
    with open(FIXTURE) as f:
        source = f.read().replace('BEHAVIOUR = "correct"', f'BEHAVIOUR = "{behaviour}"').replace(
            'VARIANT = "decay"', 'VARIANT = "linear"')
    return gate_and_time(Candidate(candidate.problem, candidate.config, source), timeout_s=60, device=device, seqlens=(64,), batch=1,
                         heads=1, seeds=(0,), rep=3, warmup_ms=1)


@pytest.fixture
def pg_url():
    """The test server's URL with a fresh schema first on the search path: no tables yet."""
    schema = f"test_{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(POSTGRES)
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    yield f"{POSTGRES}{'&' if '?' in POSTGRES else '?'}options=-csearch_path%3D{schema}"
    with engine.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    engine.dispose()


def enqueue(url, problem, queued):
    """Create the study the workers will share, with these configs first in line."""
    study = optuna.create_study(storage=url, direction="minimize",
                                study_name=search.study_name(problem, stack.current()))
    for config in queued:
        study.enqueue_trial(config)
    return study.study_name


def start(command, env, log):
    # Its own process group, so that a kill takes the worker's compile and gate children too.
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(worker, log, timeout=240):
    assert worker.wait(timeout=timeout) == 0, open(log).read()[-3000:]


def assert_each_trial_recorded_once_and_no_kernel_judged_twice(url, name):
    """Returns the study's trials and the rows, after checking them against each other."""
    trials = optuna.load_study(study_name=name, storage=url).trials
    records = Store(url).trials(name)
    finished = sorted(t.number for t in trials if t.state.name in ("COMPLETE", "PRUNED"))
    assert sorted(r.number for r in records) == finished  # one row per judged trial, none for others
    judged = [r for r in records if r.repeat_of is None and r.digest is not None]  # not refused before rendering
    assert len({r.digest for r in judged}) == len(judged)
    by_number = {r.number: r for r in records}
    for r in records:
        if r.repeat_of is not None:  # a repeat carries the outcome of the trial that judged its kernel
            original = by_number[r.repeat_of]
            assert original.repeat_of is None and original.digest == r.digest
            assert (r.status, r.median_ms) == (original.status, original.median_ms)
    return trials, records


@needs_postgres
@pytest.mark.slow
def test_two_gated_workers_share_one_study_without_duplicates_and_keep_the_fastest_winner(pg_url, cache_env,
                                                                                        tmp_path):
    queued = configs(SMALL) * 2  # each kernel proposed twice, to both workers
    name = enqueue(pg_url, SMALL, queued)
    trials = len(configs(SMALL)) + 1  # kernels counted: the queued ones (repeats are free) and one TPE samples
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = [start([sys.executable, __file__, pg_url, str(trials)], cache_env, log) for log in logs]
    for worker, log in zip(workers, logs):
        finish(worker, log)

    study_trials, records = assert_each_trial_recorded_once_and_no_kernel_judged_twice(pg_url, name)
    compiled = [r for r in records if r.status not in ("constraint", "pruned") and r.repeat_of is None]
    assert len(compiled) == trials and {t.state.name for t in study_trials} <= {"COMPLETE", "PRUNED"}
    assert {t.user_attrs["worker"] for t in study_trials} == {f"{socket.gethostname()}:{w.pid}" for w in workers}
    by_config = {}
    for r in records:
        by_config.setdefault(r.digest, set()).add(r.status)
    statuses = [by_config[r.digest] for r in records if r.config in queued]
    assert {"mismatch"} in statuses and {"pass"} in statuses  # the wrong kernel failed, the others passed

    passing = [r for r in records if r.status == "pass"]
    winners = Store(pg_url).winners(variant="linear")
    assert winners and len({w.digest for w in winners}) == len(winners)  # one row per key
    assert {(w.problem, w.stack) for w in winners} == {(SMALL, stack.current())}
    assert min(w.median_ms for w in winners) == min(r.median_ms for r in passing)
    for w in winners:
        assert w.median_ms == min(r.median_ms for r in passing if r.digest == w.digest)
        assert w.config != WRONG


@needs_postgres
@pytest.mark.slow
def test_a_worker_killed_with_sigkill_loses_only_its_running_trial(pg_url, cache_env, tmp_path):
    queued = configs(DEFAULT_SHAPE) + configs(DEFAULT_SHAPE)[:1]
    name = enqueue(pg_url, DEFAULT_SHAPE, queued)
    command = [sys.executable, "-m", "tuner.cli", "run", "--variant", "linear", "--dk", "64", "--storage", pg_url,
               "--trials", "6", "--jobs", "1"]
    victim, survivor = (start(command, cache_env, tmp_path / f"{role}.log") for role in ("victim", "survivor"))
    victim_tag = f"{socket.gethostname()}:{victim.pid}"
    study = optuna.load_study(study_name=name, storage=pg_url)
    deadline = time.monotonic() + 180
    # Kill once a row is recorded and the victim has a trial in flight.
    while time.monotonic() < deadline:
        if victim_tag in running_workers(study) and Store(pg_url).trials(name):
            break
        assert victim.poll() is None, open(tmp_path / "victim.log").read()[-3000:]
        time.sleep(0.2)
    else:
        pytest.fail("the victim had no trial in flight within 180 s")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    finish(survivor, tmp_path / "survivor.log")

    # The survivor failed the victim's unrecorded trials and re-proposed their configs (unless the
    # kill came after its last look, which leaves them RUNNING for the rerun); nothing else was lost.
    _, before = assert_each_trial_recorded_once_and_no_kernel_judged_twice(pg_url, name)
    recorded = {r.number for r in before}
    lost = [t for t in study.trials if t.user_attrs.get("worker") == victim_tag and t.number not in recorded]
    assert lost and {t.state.name for t in lost} <= {"FAIL", "RUNNING"}

    rerun = subprocess.run(command, cwd=ROOT, env=cache_env, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr
    study_trials, after = assert_each_trial_recorded_once_and_no_kernel_judged_twice(pg_url, name)
    assert after[:len(before)] == before  # every earlier row kept, unchanged
    assert "RUNNING" not in {t.state.name for t in study_trials}
    for t in lost:
        assert study_trials[t.number].state.name == "FAIL"
        assert any(other.system_attrs.get("fixed_params", other.params) == t.params and other.number > t.number
                   for other in study_trials)
    compiled = [r for r in after if r.status not in ("constraint", "pruned") and r.repeat_of is None]
    assert len(compiled) == 6  # --trials 6: kernels compiled, over both workers and the rerun
    assert {r.status for r in after} <= {"constraint", "pruned", "compile_error", "screen", "compiled"}
    waiting = [t for t in study_trials if t.state.name == "WAITING"]  # re-proposed, first in line next time
    assert all(t.system_attrs["fixed_params"] in [lost_trial.params for lost_trial in lost] for t in waiting)


def running_workers(study):
    return {t.user_attrs.get("worker") for t in study.get_trials(states=(optuna.trial.TrialState.RUNNING,))}


RACER = """
import sys
from tuner.store import Store
from test_distributed import racing_winner
url, index = sys.argv[1], int(sys.argv[2])
store = Store(url)  # every racer creates the tables at once
print(store.claim("racing", "d" * 16, index), store.write_winner(racing_winner(index), "pass").median_ms)
"""


def racing_winner(index):
    median = 1.0 + index / 10
    return Winner(problem=SMALL, stack=stack.current(), digest="d" * 16, config={"num_stages": index},
                  median_ms=median, p10_ms=median * 0.9, p90_ms=median * 1.1, gate_errors={}, study="racing",
                  trial_number=index)


@needs_postgres
def test_racing_processes_create_the_tables_once_claim_once_and_keep_the_fastest_winner(pg_url):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests")}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, pg_url, str(i)], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    outputs = [r.communicate(timeout=120) for r in racers]
    assert [r.returncode for r in racers] == [0] * 4, [err for _, err in outputs]
    holders = {out.split()[0] for out, _ in outputs}
    assert len(holders) == 1  # every racer saw the same trial hold the kernel
    store = Store(pg_url)
    (winner,) = store.winners()
    assert winner.median_ms == 1.0 and winner.trial_number == 0
    assert 1.0 in [m.median_ms for m in store.history(winner.id)]  # the kept one's measurement is in its history
    assert all(float(out.split()[1]) <= racing_winner(i).median_ms for i, (out, _) in enumerate(outputs))
    record = TrialRecord(study="racing", number=0, problem=SMALL, config={}, status="compiled",
                         stack=stack.current(), digest="d" * 16)
    assert store.record_trial(record) and not store.record_trial(record)  # insert-or-ignore
    assert len(store.trials("racing")) == 1


PARENT = """
import sys
from tuner import cli
args = cli.build_parser().parse_args(["run", "--variant", "linear", "--dk", "64", "--db", sys.argv[1],
                                      "--trials", sys.argv[2], "--jobs", "1", *sys.argv[3:]])
try:
    sys.exit(cli.tune_on_gpus(cli.problem_from(args), args, [0, 1]))
except KeyboardInterrupt:
    sys.exit(130)
"""


def start_parent(db, trials, env, *options):
    """``tune run --gpus 0,1 [options]`` past its device check, so that it runs here: two compile-only workers."""
    return subprocess.Popen([sys.executable, "-c", PARENT, str(db), str(trials), *options], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_one_worker_per_device_share_the_sqlite_study_and_the_parent_sums_them_up(tmp_path, cache_env):
    db = tmp_path / "results.db"
    parent = start_parent(db, 4, cache_env, "--also-at", "1x256x2")
    out, _ = parent.communicate(timeout=240)
    assert parent.returncode == 0, out
    pids = [int(line.split()[2]) for line in out.splitlines() if line.startswith("tune: worker ")]
    assert len(pids) == 2 and f"log {db}.gpu0.log" in out and f"log {db}.gpu1.log" in out
    also, name = sorted(optuna.get_all_study_names(f"sqlite:///{db}"), key=lambda n: "-b1-t256-h2" not in n)
    assert "-b1-t256-h2@" in also and "-b4-t8192-h16@" in name  # the workers passed --also-at on
    study_trials, records = assert_each_trial_recorded_once_and_no_kernel_judged_twice(f"sqlite:///{db}", name)
    compiled = [r for r in records if r.status not in ("constraint", "pruned") and r.repeat_of is None]
    assert len(compiled) == 4  # --trials counts kernels compiled, over both workers
    assert f"study {name}: {len(records)} trials" in out  # the summary is the study's, not a worker's
    # Every trial a worker asked for names it; one enqueued (the nearest valid config after a constraint
    # break) that no worker asked for before the budget was spent is left waiting, unnamed.
    asked = [t for t in study_trials if t.state.name != "WAITING"]
    assert {t.user_attrs["worker"] for t in asked} <= {f"{socket.gethostname()}:{pid}" for pid in pids}
    assert "latency needs a GPU" in (tmp_path / "results.db.gpu0.log").read_text()
    at = Store(db).trials(also)  # every kernel the workers judged, once, in the study of the other shape
    assert sorted((r.digest, r.status) for r in at) == sorted((r.digest, r.status) for r in compiled)
    assert f"study {also}: 4 trials" in out


@pytest.mark.slow
def test_ctrl_c_to_the_parent_reaches_every_worker_and_they_give_back_their_trials(tmp_path, cache_env):
    db = tmp_path / "results.db"
    parent = start_parent(db, 20, cache_env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # interrupt once both workers have a trial in flight
        names = optuna.get_all_study_names(f"sqlite:///{db}") if db.exists() else []
        study = optuna.load_study(study_name=names[0], storage=f"sqlite:///{db}") if names else None
        if study and len(running_workers(study) - {None}) == 2:
            break
        assert parent.poll() is None, parent.stdout.read()
        time.sleep(0.5)
    else:
        pytest.fail("the two workers had no trials in flight within 120 s")
    parent.send_signal(signal.SIGINT)
    out, _ = parent.communicate(timeout=120)
    assert parent.returncode == 130, out
    study_trials, records = assert_each_trial_recorded_once_and_no_kernel_judged_twice(f"sqlite:///{db}", names[0])
    assert "RUNNING" not in {t.state.name for t in study_trials}
    given_back = [t for t in study_trials if t.state.name == "FAIL"]  # both were mid-trial: each gave one back
    compiled = [r for r in records if r.status not in ("constraint", "pruned") and r.repeat_of is None]
    assert len({t.user_attrs["worker"] for t in given_back}) == 2 and len(compiled) < 20  # cut short
    requeued = [t.system_attrs["fixed_params"] for t in study_trials if t.state.name == "WAITING"]
    assert all(t.params in requeued for t in given_back)


@pytest.mark.skipif(stack.has_gpu(), reason="torch sees a CUDA device here")
def test_gpus_without_a_cuda_device_exits_2_saying_what_torch_sees(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tuner.cli", "run", "--variant", "linear", "--dk", "64",
                             "--gpus", "all", "--db", str(tmp_path / "r.db")],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("tune: error: --gpus needs CUDA devices and torch ") and "sees none" in lines[0]
    assert not (tmp_path / "r.db").exists()


if __name__ == "__main__":
    search.tune(SMALL, trials=int(sys.argv[2]), storage=sys.argv[1], jobs=1, gate=fixture_gate)
