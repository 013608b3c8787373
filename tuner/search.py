"""The tuning loop: Optuna proposes configs, the pipeline judges them, every outcome is stored.

For each proposed config, cheapest check first:

1. the search space's constraints (status ``constraint``, nothing rendered);
2. the register model against the budget (status ``pruned``, nothing compiled);
3. render; a kernel (digest) already judged in this study is not judged again (``repeat_of``);
4. compile in a pool of ``jobs`` processes, ahead of the GPU (``compile_error``, ``screen``);
5. with a GPU: gate and time in a watchdogged child, one at a time (``hang``, ``nan``,
   ``mismatch``, ``crash``, ``pass``); without one the trial ends as ``compiled``.

The study lives in the results database beside our tables, named after the problem and the
stack (:func:`study_name`), so re-running the same command resumes it: trials a killed run left
RUNNING are settled from their recorded row or failed and re-proposed. ``trials`` is the total
number of judged trials the study should hold. Outcomes reach Optuna as follows: ``pass`` is
COMPLETE with the median latency (ms) as the value to minimise; every other outcome is PRUNED,
infeasible ones with a positive constraint so TPE steers away from them (``compiled`` is
feasible: judged, just not timed); FAIL only marks a trial whose process was lost.
"""
from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import multiprocessing
import os
import socket
import time
import warnings
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from datetime import datetime

import optuna
from optuna.trial import TrialState

from . import environment, space as spaces
from .environment import Environment
from .errors import UserError
from .problem import Problem
from .render import RenderError, render
from .store import Store, TrialRecord, Winner, utcnow

DEFAULT_TRIALS = 40
GATE_TIMEOUT_S = 300.0
# A RUNNING trial whose worker has not beaten for GRACE_S is failed by the other workers.
HEARTBEAT_S = 30
GRACE_S = 120
# Outcomes that mean "this config cannot work", and the constraint that tells TPE so.
_INFEASIBLE = {"constraint": "space", "pruned": "registers", "compile_error": "kernel", "screen": "kernel",
               "hang": "kernel", "nan": "kernel", "mismatch": "kernel", "crash": "kernel"}
_FAILED = ("compile_error", "screen", "hang", "nan", "mismatch", "crash")


@dataclass(frozen=True)
class TuneSummary:
    """What a :func:`tune` run leaves behind.

    Args:
        study (str): the Optuna study name (also the ``study`` column of the trial rows).
        counts (Counter): trial rows of the study per status.
        winner (TrialRecord | None): the fastest row that passed the gate; None without one.
        default (TrialRecord | None): the row of the template's default config.
        gated (bool): whether this run gated and timed on a GPU.
    """

    study: str
    counts: Counter
    winner: TrialRecord | None
    default: TrialRecord | None
    gated: bool

    @property
    def speedup(self) -> float | None:
        """Default latency / winner latency, when both were timed."""
        if self.winner is None or self.default is None or self.default.median_ms is None:
            return None
        return self.default.median_ms / self.winner.median_ms


@dataclass
class _Candidate:
    """A proposed config on its way through the pipeline."""

    trial: optuna.Trial
    config: dict
    started_at: datetime = field(default_factory=utcnow)
    digest: str | None = None
    rendered: object = None
    prediction: dict | None = None
    compile: dict | None = None

    @property
    def number(self) -> int:
        return self.trial.number


def study_name(problem: Problem, env: Environment) -> str:
    """The study of ``problem`` on this stack: a different GPU or toolchain is another study."""
    p = problem
    return f"{p.variant}-k{p.dk}-v{p.dv}-{p.dtype}-b{p.batch}-t{p.seqlen}-h{p.heads}@{env.key()}"


def tune(problem: Problem, *, trials: int | None = None, timeout: float | None = None,
         db: str = "results.db", storage: str | None = None, jobs: int = 2, gpu: int = 0,
         register_budget: int = 255, progress: bool = True, gate=None) -> TuneSummary:
    """Search ``problem``'s config space and record every outcome and the winner.

    Args:
        problem (Problem): what to tune.
        trials (int): total judged trials the study should hold. Default: 40 (unless ``timeout``).
        timeout (float): stop proposing configs after this many seconds. Default: None.
        db (str): the results database (path or URL); also the study's storage by default.
        storage (str): an Optuna storage URL for the study, shared by several workers. Default: None.
        jobs (int): compile processes. Default: 2.
        gpu (int): CUDA device index. Default: 0.
        register_budget (int): prune configs predicted to need more registers per thread. Default: 255.
        progress (bool): show a progress bar and the summary table. Default: True.
        gate (callable): ``gate(problem, config, timeout_s=, device=) -> GateResult`` to gate and time
            with; None: :func:`tuner.gate.gate_and_time` when a GPU is present, no gating otherwise.

    Returns:
        TuneSummary
    """
    if trials is None and timeout is None:
        trials = DEFAULT_TRIALS
    for label, value in (("trials", trials), ("timeout", timeout), ("jobs", jobs), ("register-budget", register_budget)):
        if value is not None and value < 1:
            raise UserError(f"--{label} must be a positive number, got {value}")
    store = Store(db)  # first: a database that cannot be used fails before any work
    if gate is None and environment.has_gpu():
        _require("tuner.gate", "gating and timing")
        from .gate import gate_and_time as gate
    _require("tuner.compile", "compiling")
    env = environment.current(gpu)
    with warnings.catch_warnings():
        # Heartbeats, group sampling and fail_stale_trials are used on purpose (with ask/tell).
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        study = _open_study(problem, env, storage or store.url, store)
        tuner = _Tuner(problem, env, store, study, jobs=jobs, gpu=gpu, budget=register_budget, gate=gate)
        tuner.run(trials, timeout, progress)
        return tuner.summary()


def tune_main(problem: Problem, args) -> int:
    """``tune run``: :func:`tune` with the CLI's arguments; prints the summary; the exit code."""
    summary = tune(problem, trials=args.trials, timeout=args.timeout, db=args.db, storage=args.storage,
                   jobs=args.jobs, gpu=args.gpu, register_budget=args.register_budget)
    print_summary(summary)
    return 0


def _require(module: str, purpose: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UserError(f"{module} is not available, so {purpose} cannot run")


def _open_study(problem: Problem, env: Environment, url: str, store: Store) -> optuna.Study:
    engine_kwargs = {"connect_args": {"timeout": store.busy_timeout_s}} if url.startswith("sqlite") else {}
    name = study_name(problem, env)
    storage = optuna.storages.RDBStorage(
        url, engine_kwargs=engine_kwargs, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
        heartbeat_stale_trial_callback=lambda study, trial: _Tuner.rerun(study, trial, store))
    # Seeded by the study and how far it got, so a resumed run does not replay its first samples.
    done = 0
    if name in optuna.study.get_all_study_names(storage):
        done = len(optuna.load_study(study_name=name, storage=storage).trials)
    seed = zlib.crc32(f"{name}/{done}".encode())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(multivariate=True, group=True, seed=seed)
    study = optuna.create_study(storage=storage, study_name=name, direction="minimize",
                                sampler=sampler, load_if_exists=True)
    for key, value in {**problem.as_dict(), **env.as_dict()}.items():
        study.set_user_attr(key, value)
    return study


def _worker() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _is_dead_here(worker: str | None) -> bool:
    """Whether ``worker`` ("host:pid") ran on this host and its process is gone."""
    host, _, pid = (worker or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class _Tuner:
    """One run of the loop over a study: owns the pools, the queue for the GPU and the counts."""

    def __init__(self, problem, env, store, study, *, jobs, gpu, budget, gate):
        self.problem, self.env, self.store, self.study = problem, env, store, study
        self.space = spaces.load(problem.variant)
        self.jobs, self.gpu, self.budget, self.gate = jobs, gpu, budget, gate
        self.model = _model()
        rows = store.trials(study.study_name)
        self.judged = {r.digest: r for r in rows if r.digest and r.repeat_of is None and r.status != "constraint"}
        self.counts = Counter(r.status for r in rows)
        self.in_flight: dict[int, _Candidate] = {}
        self.waiting_on: dict[str, list[_Candidate]] = {}  # digest -> repeats of a kernel in flight
        self.gpu_queue: deque[_Candidate] = deque()
        self.breaks: Counter = Counter()  # digest -> compile pools it was in when they died
        self.compile_log = (store.path or os.path.abspath("results")) + ".compile.log"

    # ---- recovery

    @staticmethod
    def rerun(study: optuna.Study, trial: optuna.trial.FrozenTrial, store: Store) -> None:
        """A trial lost with its process: re-propose its config unless its outcome was recorded."""
        if not any(r.number == trial.number for r in store.trials(study.study_name)):
            study.enqueue_trial(trial.params)

    def recover(self) -> None:
        """Settle trials left RUNNING by a process of this host that is gone."""
        rows = {r.number: r for r in self.store.trials(self.study.study_name)}
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if not _is_dead_here(t.user_attrs.get("worker")):
                continue
            if t.number in rows:  # killed between recording the row and telling Optuna
                self._tell(optuna.Trial(self.study, t._trial_id), rows[t.number])
            else:
                self._abandon(t.number, t.params)
        optuna.storages.fail_stale_trials(self.study)

    def _abandon(self, number: int, params: dict) -> None:
        self.study.tell(number, state=TrialState.FAIL)
        self.study.enqueue_trial(params)

    # ---- the loop

    def run(self, trials: int | None, timeout: float | None, progress: bool) -> None:
        self.recover()
        if not self.study.trials:
            self.study.enqueue_trial(self.space.default(self.problem))
        deadline = None if timeout is None else time.monotonic() + timeout
        context = multiprocessing.get_context("spawn")  # no CUDA state or torch threads forked
        pool = self._compile_pool(context)
        gpu_pool = cf.ThreadPoolExecutor(1)
        compiling: dict[cf.Future, _Candidate] = {}
        gating: dict[cf.Future, _Candidate] = {}
        bar = _Progress(self, trials) if progress else None
        try:
            while True:
                open_for_more = (deadline is None or time.monotonic() < deadline) and \
                    (trials is None or self._judged_count() + len(self.in_flight) < trials)
                # Keep every compile process busy plus one compiled kernel waiting for the GPU.
                while open_for_more and len(compiling) + len(self.gpu_queue) < self.jobs + 1:
                    candidate = self._propose()
                    if candidate is not None:
                        compiling[pool.submit(_compile, candidate.rendered)] = candidate
                    open_for_more = trials is None or self._judged_count() + len(self.in_flight) < trials
                    open_for_more &= deadline is None or time.monotonic() < deadline
                if self.gpu_queue and not gating:
                    candidate = self.gpu_queue.popleft()
                    gating[gpu_pool.submit(self._gate, candidate)] = candidate
                if not compiling and not gating:
                    if not open_for_more:
                        break
                    continue
                done, _ = cf.wait([*compiling, *gating], timeout=HEARTBEAT_S / 2,
                                  return_when=cf.FIRST_COMPLETED)
                for future in done:
                    if future in compiling:  # not when a broken pool's compiles were resubmitted
                        pool = self._compiled(future, compiling.pop(future), compiling, pool, context)
                    elif future in gating:
                        self._gated(future, gating.pop(future))
                for candidate in self.in_flight.values():
                    self.study._storage.record_heartbeat(candidate.trial._trial_id)
                if bar:
                    bar.update()
        except BaseException:
            for candidate in list(self.in_flight.values()):
                self._abandon(candidate.number, candidate.trial.params)
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            gpu_pool.shutdown(wait=False, cancel_futures=True)
            if bar:
                bar.close()
            self._write_winner()

    def _compile_pool(self, context) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(self.jobs, mp_context=context, initializer=_quiet,
                                      initargs=(self.compile_log,))

    def _judged_count(self) -> int:
        return len(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))

    def _propose(self) -> _Candidate | None:
        """Ask for a config and take it as far as the CPU can without compiling; the candidate
        to compile, or None when the trial was settled here."""
        trial = self.study.ask()
        trial.set_user_attr("worker", _worker())
        self.study._storage.record_heartbeat(trial._trial_id)
        config = {}
        for name, p in self.space.params.items():
            if self.space.active(name, config):
                config[name] = trial.suggest_categorical(name, list(p.values))
        candidate = _Candidate(trial, config)
        self.in_flight[trial.number] = candidate
        reasons = self.space.violations(self.problem, config)
        if reasons:
            return self._finish(candidate, "constraint", "; ".join(reasons))
        if self.model is not None:
            try:
                candidate.prediction = self.model.predict(self.problem, config).as_dict()
                reason = self.model.prune_reason(self.problem, config, self.budget)
            except Exception as e:  # a model that cannot read a kernel must not stop the study: compile it
                candidate.prediction, reason = {"error": f"{type(e).__name__}: {e}"}, None
            if reason:
                return self._finish(candidate, "pruned", reason)
        try:
            candidate.rendered = render(self.problem, config)
        except RenderError as e:  # a template bug for this config: its outcome, not the study's
            return self._finish(candidate, "compile_error", f"render: {e}")
        candidate.digest = candidate.rendered.digest
        if candidate.digest in self.judged:
            return self._repeat(candidate, self.judged[candidate.digest])
        in_flight = [c for c in self.in_flight.values() if c.digest == candidate.digest and c is not candidate]
        if in_flight:
            self.waiting_on.setdefault(candidate.digest, []).append(candidate)
            return None
        return candidate

    def _compiled(self, future, candidate, compiling, pool, context):
        """Take a finished compile; returns the pool (a new one if a compile killed it)."""
        try:
            candidate.compile = future.result()
        except cf.process.BrokenProcessPool:
            # A crash takes down the pool and every compile in it: retry them in a new pool,
            # unless a kernel was present at two such deaths, which makes it the likely culprit.
            self.breaks[candidate.digest] += 1
            if self.breaks[candidate.digest] >= 2:
                self._finish(candidate, "crash", "the compiler process died twice while compiling this kernel")
                return pool
            pool.shutdown(wait=False, cancel_futures=True)
            pool = self._compile_pool(context)
            for other in compiling.values():
                self.breaks[other.digest] += 1
            resubmit = [candidate, *compiling.values()]
            compiling.clear()
            for c in resubmit:
                compiling[pool.submit(_compile, c.rendered)] = c
            return pool
        except Exception as e:  # the compiler raised: this config's outcome, not the study's
            self._finish(candidate, "crash", f"compile raised {type(e).__name__}: {e}")
            return pool
        report = candidate.compile
        if report["error"] is not None:
            self._finish(candidate, "compile_error", report["error"])
        elif report["rejected"]:
            self._finish(candidate, "screen", "; ".join(report["rejected"]))
        elif self.gate is None:
            self._finish(candidate, "compiled", "compiled; latency needs a GPU")
        else:
            self.gpu_queue.append(candidate)
        return pool

    def _gate(self, candidate: _Candidate):
        start = time.monotonic()
        result = self.gate(self.problem, candidate.config, timeout_s=GATE_TIMEOUT_S, device=self.gpu)
        return result, time.monotonic() - start

    def _gated(self, future, candidate: _Candidate) -> None:
        try:
            result, seconds = future.result()
        except Exception as e:
            self._finish(candidate, "crash", f"gate raised {type(e).__name__}: {e}")
            return
        timing = (result.timing or {}) if result.status == "pass" else {}
        self._finish(candidate, result.status, result.message or "", gate_errors=result.errors,
                     gpu_seconds=seconds, **{k: timing.get(k) for k in ("median_ms", "p10_ms", "p90_ms")})

    def _finish(self, candidate: _Candidate, status: str, reason: str, **measured) -> None:
        """Record the outcome, then tell Optuna (a kill in between is settled by recover())."""
        report = candidate.compile
        record = TrialRecord(
            study=self.study.study_name, number=candidate.number, problem=self.problem, config=candidate.config,
            status=status, environment=self.env, reason=reason, digest=candidate.digest,
            prediction=candidate.prediction, compile_report=report and report["report"],
            compile_seconds=report and report["seconds"], started_at=candidate.started_at, **measured)
        self._settle(candidate, record)
        if candidate.digest is not None and status != "constraint":
            self.judged[candidate.digest] = record
            for repeat in self.waiting_on.pop(candidate.digest, []):
                self._repeat(repeat, record)

    def _repeat(self, candidate: _Candidate, original: TrialRecord) -> None:
        same = {k: getattr(original, k) for k in ("status", "reason", "prediction", "compile_report",
                                                   "gate_errors", "median_ms", "p10_ms", "p90_ms")}
        record = TrialRecord(study=self.study.study_name, number=candidate.number, problem=self.problem,
                             config=candidate.config, environment=self.env, digest=candidate.digest,
                             repeat_of=original.number, started_at=candidate.started_at, **same)
        self._settle(candidate, record)

    def _settle(self, candidate: _Candidate, record: TrialRecord) -> None:
        self.store.record_trial(record)
        self._tell(candidate.trial, record)
        self.in_flight.pop(candidate.number, None)
        self.counts[record.status] += 1

    def _tell(self, trial: optuna.Trial, record: TrialRecord) -> None:
        trial.set_user_attr("status", record.status)
        if record.reason:
            trial.set_user_attr("reason", record.reason[:500])
        if record.status == "pass" and record.median_ms is not None:
            self.study.tell(trial, record.median_ms)
            return
        if record.status in _INFEASIBLE:
            over = record.prediction["registers"] - self.budget if record.status == "pruned" else 1
            trial.set_constraint(_INFEASIBLE[record.status], float(max(over, 1)))
        self.study.tell(trial, state=TrialState.PRUNED)

    # ---- results

    def best(self) -> TrialRecord | None:
        """The fastest passing row whose kernel is still what the template renders today."""
        rows = [r for r in self.store.trials(self.study.study_name) if r.status == "pass" and r.median_ms is not None]
        for row in sorted(rows, key=lambda r: r.median_ms):
            if _digest(self.problem, row.config) == row.digest:
                return row
        return None

    def _write_winner(self) -> None:
        row = self.best()
        if row is None:
            return
        self.store.write_winner(Winner(
            problem=self.problem, environment=self.env, digest=row.digest, config=row.config,
            median_ms=row.median_ms, p10_ms=row.p10_ms, p90_ms=row.p90_ms, gate_errors=row.gate_errors or {},
            study=row.study, trial_number=row.number), gate_status=row.status)

    def summary(self) -> TuneSummary:
        rows = self.store.trials(self.study.study_name)
        default_digest = _digest(self.problem, self.space.default(self.problem))
        default = next((r for r in rows if r.digest == default_digest and r.repeat_of is None), None)
        return TuneSummary(self.study.study_name, Counter(r.status for r in rows), self.best(), default,
                           gated=self.gate is not None)


def _digest(problem: Problem, config: dict) -> str | None:
    """What the template renders ``config`` to today; None when it no longer can."""
    try:
        return render(problem, config).digest
    except (UserError, RenderError):
        return None


def _quiet(log_path: str) -> None:
    """Send a compile process's output (TVM prints tracebacks of failed compiles) to a log file:
    the errors are recorded in the trial rows, and the terminal keeps the progress bar."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _compile(rendered) -> dict:
    """Compile in a pool process; a plain dict crosses back."""
    from .compile import compile_rendered

    start = time.monotonic()
    report = compile_rendered(rendered)
    return {"error": report.error, "rejected": [f.message for f in report.rejected],
            "report": report.as_dict(), "seconds": time.monotonic() - start}


def _model():
    """The register model, or None (with a note) while tuner/model.py does not exist yet."""
    if importlib.util.find_spec("tuner.model") is None:
        print("tune: note: the register model (tuner/model.py) is missing; no config is pruned by prediction")
        return None
    from . import model

    return model


# ---- presentation


def _registers(record: TrialRecord) -> str:
    kernels = (record.compile_report or {}).get("kernels", [])
    measured = max((k["registers"] for k in kernels if k.get("registers") is not None), default=None)
    predicted = (record.prediction or {}).get("registers")
    return " / ".join(str(x) for x in (measured, predicted) if x is not None) or "-"


def _latency(record: TrialRecord) -> str:
    if record.median_ms is None:
        return "-"
    return f"{record.median_ms:.4f} ms ({record.p10_ms:.4f}-{record.p90_ms:.4f})"


def print_summary(summary: TuneSummary) -> None:
    """The counts and the winner against the template's default, as a table."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    counts = ", ".join(f"{n} {s}" for s, n in sorted(summary.counts.items()))
    console.print(f"study {summary.study}: {sum(summary.counts.values())} trials ({counts})")
    if not summary.gated:
        console.print("No GPU: configs were pruned and compiled only; latency needs a GPU (run again on one).")
    table = Table(title="winner vs the template's default")
    table.add_column("")
    rows = (summary.winner, summary.default)
    for label in ("winner", "default"):
        table.add_column(label)
    for label, show in (("trial", lambda r: str(r.number)), ("status", lambda r: r.status),
                        ("latency median (p10-p90)", _latency), ("registers ptxas / predicted", _registers),
                        ("config", lambda r: "\n".join(f"{k}={v}" for k, v in r.config.items()))):
        table.add_row(label, *(show(r) if r is not None else "-" for r in rows))
    console.print(table)
    if summary.speedup is not None:
        console.print(f"speed-up over the default: {summary.speedup:.2f}x")


class _Progress:
    """A rich progress bar: trials judged, pruned, failed and the best latency so far."""

    def __init__(self, tuner: _Tuner, total: int | None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.tuner = tuner
        self.progress = Progress(TextColumn("[bold]tuning"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.description}"), TimeElapsedColumn())
        self.task = self.progress.add_task("", total=total)
        self.progress.start()
        self.update()

    def update(self) -> None:
        c = self.tuner.counts
        best = min((r.median_ms for r in self.tuner.judged.values() if r.median_ms is not None), default=None)
        text = (f"pruned {c['pruned'] + c['constraint']}, failed {sum(c[s] for s in _FAILED)}, "
                f"compiled {c['compiled']}, passed {c['pass']}"
                + (f", best {best:.4f} ms" if best is not None else ""))
        self.progress.update(self.task, completed=sum(c.values()), description=text)

    def close(self) -> None:
        self.update()
        self.progress.stop()
