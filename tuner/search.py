"""The tuning loop: Optuna proposes configs, the pipeline judges them, every outcome is stored.

For each proposed config, cheapest check first:

1. the search space's constraints (status ``constraint``, nothing rendered); the valid config
   nearest to a refused one is enqueued, so it is what the search asks next;
2. the register model against the budget (status ``pruned``, nothing compiled);
3. render; a kernel (digest) already judged in this study is not judged again (``repeat_of``);
4. compile in a pool of ``jobs`` processes, ahead of the GPU (``compile_error``, ``screen``);
5. with a GPU: gate and time in a watchdogged child, one at a time (``hang``, ``nan``,
   ``mismatch``, ``crash``, ``pass``); without one the trial ends as ``compiled``.

Tuning for several shapes at once (``also_at``, CLI ``--also-at BxTxH``): the search is driven by
the problem's shape, and every kernel judged is also recorded in the study of each other shape
(a companion study), with a passing kernel timed at that shape in the same gate child. The gate
and the compile do not depend on the shape, so each further shape costs only its timing, and each
shape gets its own winner.

The study lives in the results database beside our tables, named after the problem and the
stack (:func:`study_name`; when the values of a parameter in the search space changed since the
study began, a study of its own named with ``~`` and the space's digest, as Optuna draws a
parameter from one set of values per study), so re-running the same command resumes it: trials a killed run left
RUNNING are settled from their recorded row or failed and re-proposed. ``trials`` is the total
number of judged trials the study should hold, over all its workers.

Several workers may run one study at once (one per GPU, :func:`tune_on_gpus`, or on several
hosts sharing a PostgreSQL ``storage``): Optuna's storage hands each trial to one worker, a
kernel is judged by the trial that claims it first (``tuner_claims``) while other trials that
propose it wait for that outcome, and each worker fails and re-proposes the trials of workers
that died (on this host at once, elsewhere once their heartbeat is ``limits.GRACE_S`` old).

Outcomes reach Optuna as follows: ``pass`` is COMPLETE with the median latency (ms) as the value to minimise; every other outcome is PRUNED,
infeasible ones with a positive constraint so TPE steers away from them (``compiled`` is
feasible: judged, just not timed); FAIL only marks a trial whose process was lost.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime

import optuna
from optuna.trial import TrialState

from . import space as spaces, stack
from .stack import Stack
from .errors import UserError
from . import model
from .gate import gate_and_time, shape_timing, twin_config
from . import limits, paths
from .paths import written_db
from .problem import Problem
from .render import RenderError, render
from .status import FAILED, FREE, INFEASIBLE
from .store import Store, TrialRecord, Winner, utcnow

DEFAULT_TRIALS = 40
# Broken constraints, model prunes and repeats of a kernel already judged are free (not counted
# against --trials). After this many free proposals in a row the space is taken as searched out
# (TPE keeps proposing what it has seen).
MAX_FREE_STREAK = 200


@dataclass(frozen=True)
class TuneSummary:
    """What a :func:`tune` run leaves behind.

    Args:
        study (str): the Optuna study name (also the ``study`` column of the trial rows).
        counts (Counter): trial rows of the study per status, repeats of a judged kernel left out.
        winner (TrialRecord | None): the fastest row that passed the gate; None without one.
        default (TrialRecord | None): the row of the template's default config.
        gated (bool): whether this run gated and timed on a GPU.
        also_at (tuple[TuneSummary]): the companion studies of the ``also_at`` shapes.
        repeats (int): trial rows that repeated the outcome of a kernel judged before.
        database (str): where the rows are (a file path or a database URL).
    """

    study: str
    counts: Counter
    winner: TrialRecord | None
    default: TrialRecord | None
    gated: bool
    also_at: tuple["TuneSummary", ...] = ()
    repeats: int = 0
    database: str = ""

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
    twin: object = None  # the rendered num_stages = 0 twin of a staged config (the gate compares them)
    compile_running_since: float | None = None  # monotonic time its compile was first seen running
    prediction: dict | None = None
    compile: dict | None = None

    @property
    def number(self) -> int:
        return self.trial.number


def study_name(problem: Problem, env: Stack, space: spaces.Space | None = None) -> str:
    """The study of ``problem`` on this stack: a different GPU or toolchain is another study, and so
    is a search with parameters held fixed (``space.fixed``)."""
    p = problem
    fixed = "".join(f"+{name}={value}" for name, value in (space.fixed if space else ()))
    return f"{p.variant}-k{p.dk}-v{p.dv}-{p.dtype}-b{p.batch}-t{p.seqlen}-h{p.heads}{fixed}@{env.key()}"


def tune(problem: Problem, *, trials: int | None = None, timeout: float | None = None,
         db: str | None = None, storage: str | None = None, jobs: int = 2, gpu: int = 0,
         register_budget: int = 255, progress: bool = True, gate=None, fixed: dict | None = None,
         also_at: tuple[str, ...] = (), seed: int | None = None) -> TuneSummary:
    """Search ``problem``'s config space and record every outcome and the winner.

    Args:
        problem (Problem): what to tune.
        trials (int): kernels the study should have compiled and judged (broken constraints,
            model prunes and repeats are free and not counted). Default: 40 (unless ``timeout``).
        timeout (float): after this many seconds, finish the gate in progress and give the trials
            still queued back to the study (re-proposed first on resume). Default: None.
        db (str): the results database (path or URL) and the study's storage, unless ``storage``.
            Default: the user's own (:func:`tuner.paths.written_db`), never the shipped one unless named.
        storage (str): a database URL (e.g. ``postgresql://...``) shared by several workers: the
            study and the results both live there, in place of ``db``. Default: None.
        jobs (int): compile processes. Default: 2.
        gpu (int): CUDA device index. Default: 0.
        register_budget (int): prune configs predicted to need more registers per thread. Default: 255.
        progress (bool): show a progress bar and the summary table. Default: True.
        gate (callable): ``gate(problem, config, timeout_s=, device=) -> GateResult`` to gate and time
            with (called with ``also_at=`` too when there are more shapes); None:
            :func:`tuner.gate.gate_and_time` when a GPU is present, no gating otherwise.
        fixed (dict): parameters held at one value (name -> value; CLI ``--fix NAME=VALUE``): a
            search of the rest of the space, in a study of its own. Default: None.
        also_at (tuple[str]): more shapes (``BxTxH``) to record every judged kernel at, each in
            its own study with its own winner; the search follows ``problem``'s shape. Default: ().
        seed (int): makes the sampling reproducible (the same seed, study and progress sample the
            same configs). Default: None (seeded by the study, its progress and the worker process).

    Returns:
        TuneSummary
    """
    if trials is None and timeout is None:
        trials = DEFAULT_TRIALS
    for label, value in (("trials", trials), ("timeout", timeout), ("jobs", jobs), ("register-budget", register_budget)):
        if value is not None and value < 1:
            raise UserError(f"--{label} must be a positive number, got {value}")
    space = spaces.load(problem.variant).fix(fixed or {})  # bad input fails before the database is touched
    companions = companion_problems(problem, also_at)
    store = Store(storage or written_db(db))  # then a database that cannot be used fails before any work
    if gate is None and stack.has_gpu():
        gate = gate_and_time
    env = stack.current(gpu)
    with warnings.catch_warnings():
        # Heartbeats, group sampling and fail_stale_trials are used on purpose (with ask/tell).
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        study = _open_study(problem, env, store, space, seed)
        companion_studies = [(p, _open_study(p, env, store, space)) for p in companions]
        tuner = _Tuner(problem, env, store, study, space, jobs=jobs, gpu=gpu, budget=register_budget, gate=gate,
                       companions=companion_studies, seed=seed)
        tuner.run(trials, timeout, progress)
        return tuner.summary()


def tune_main(problem: Problem, args) -> int:
    """``tune run``: :func:`tune` with the CLI's arguments, or one worker per GPU with ``--gpus``;
    prints the summary; the exit code."""
    if args.gpus is not None:
        return tune_on_gpus(problem, args, select_gpus(args.gpus))
    summary = tune(problem, trials=args.trials, timeout=args.timeout, db=args.db, storage=args.storage,
                   jobs=args.jobs, gpu=args.gpu or 0, register_budget=args.register_budget, fixed=dict(args.fix),
                   also_at=tuple(args.also_at), seed=args.seed)
    print_summary(summary)
    return 0


def select_gpus(wanted: str | list[int]) -> list[int]:
    """The CUDA device indices of ``--gpus`` ("all" or a list), checked against what torch sees.

    Compile-only tuning needs no GPU and is refused here: its parallelism is ``--jobs``, or
    several ``tune run`` processes on one ``--storage``.
    """
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserError(f"--gpus needs CUDA devices and torch {torch.__version__} sees none "
                        f"(built for CUDA {torch.version.cuda or 'none'}, CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); without a GPU run `tune run` "
                        "without --gpus, or several of them on one --storage")
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    seen = ", ".join(f"{i}: {name}" for i, name in enumerate(names))
    devices = list(range(count)) if wanted == "all" else wanted
    missing = [i for i in devices if i >= count]
    if missing:
        raise UserError(f"--gpus {','.join(map(str, missing))}: no such device; torch sees {seen}")
    if len({names[i] for i in devices}) > 1:
        raise UserError(f"--gpus mixes GPU models ({seen}): each model is its own study, tune them separately")
    return devices


def tune_on_gpus(problem: Problem, args, devices: list[int]) -> int:
    """One ``tune run`` worker process per CUDA device in ``devices``, all on one study.

    Each worker sees only its device (``CUDA_VISIBLE_DEVICES``) and writes its output to
    ``<db>.gpu<i>.log``. Ctrl-C is passed on to every worker, which gives back its running
    trials; the summary printed at the end is the study's, over all workers.

    Returns:
        int: 0 when every worker succeeded, else the first failing worker's exit code.
    """
    space = spaces.load(problem.variant).fix(dict(args.fix))
    companions = companion_problems(problem, args.also_at)
    store = Store(args.storage or args.db)
    if threading.current_thread() is threading.main_thread():
        # Started as a background job, the process inherits SIGINT ignored: take it back, so that
        # an interrupt still reaches the workers (the loop below passes it on).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    env = stack.current(devices[0])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        name = _open_study(problem, env, store, space).study_name  # created once, before the workers race to
        also = [(p, _open_study(p, env, store, space).study_name) for p in companions]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",") if visible else [str(i) for i in range(max(devices) + 1)]
    command = [sys.executable, "-m", "tuner.cli", "run", "--variant", problem.variant,
               *(f"--{k}={v}" for k, v in problem.as_dict().items() if k != "variant"),
               *(["--storage", args.storage] if args.storage else ["--db", args.db]),
               "--jobs", str(args.jobs), "--register-budget", str(args.register_budget), "--gpu", "0"]
    for option, value in (("--trials", args.trials), ("--timeout", args.timeout)):
        if value is not None:
            command += [option, str(value)]
    command += [f"--fix={name}={value}" for name, value in space.fixed]
    command += [f"--also-at={p.shape}" for p in companions]
    workers = []
    try:
        for i, device in enumerate(devices):
            log = f"{_log_base(store)}.gpu{device}.log"
            seed = [] if args.seed is None else ["--seed", str(args.seed + i)]  # one stream per worker
            with open(log, "w") as out:  # the child keeps its own descriptor
                # Its own session: a Ctrl-C reaches the workers once, from here, not also from the terminal.
                workers.append(subprocess.Popen(
                    command + seed, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "CUDA_VISIBLE_DEVICES": physical[device]}))
            print(f"tune: worker {workers[-1].pid} on GPU {device} ({env.gpu}), log {log}")
        codes = [w.wait() for w in workers]
    except KeyboardInterrupt:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGINT)
        for w in workers:
            w.wait()
        print_summary(summarise(problem, store, name, space, gated=True, also_at=also))
        raise
    print_summary(summarise(problem, store, name, space, gated=True, also_at=also))
    failed = [(device, code) for device, code in zip(devices, codes) if code != 0]
    for device, code in failed:
        print(f"tune: the worker on GPU {device} exited with {code}; see its log", file=sys.stderr)
    return failed[0][1] if failed else 0


def _open_study(problem: Problem, env: Stack, store: Store, space: spaces.Space,
                seed: int | None = None) -> optuna.Study:
    """The study of ``space`` in ``store``'s database, created with the space's default config
    first in line when it is new; its sampler seeded by ``seed`` (see :func:`tune`)."""
    engine_kwargs = {"connect_args": {"timeout": store.busy_timeout_s}} if store.path is not None else {}
    name = study_name(problem, env, space)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with store.schema_lock():  # Optuna creates its tables, and a new study, without guarding against a race
        storage = optuna.storages.RDBStorage(
            store.url, engine_kwargs=engine_kwargs, heartbeat_interval=limits.HEARTBEAT_S, grace_period=limits.GRACE_S,
            heartbeat_stale_trial_callback=lambda study, trial: _Tuner.rerun(study, trial, store))
        # Seeded by the study, how far it got and the seed or worker (_salt).
        done = 0
        if name in optuna.study.get_all_study_names(storage):
            existing = optuna.load_study(study_name=name, storage=storage)
            changed = _changed_parameters(existing, space)
            if changed:
                # Optuna cannot draw a parameter from other values within one study: a new one.
                name = f"{name}~{space.digest()}"
                print(f"tune: the values of {', '.join(changed)} in the {problem.variant} search space changed "
                      f"since study {existing.study_name} began: continuing in study {name}")
                if name in optuna.study.get_all_study_names(storage):
                    done = len(optuna.load_study(study_name=name, storage=storage).trials)
            else:
                done = len(existing.trials)
        # constant_liar: configs other workers are judging count as bad, so TPE looks elsewhere.
        sampler = optuna.samplers.TPESampler(multivariate=True, group=True, constant_liar=True,
                                             seed=zlib.crc32(f"{name}/{done}/{_salt(seed)}".encode()))
        study = optuna.create_study(storage=storage, study_name=name, direction="minimize",
                                    sampler=sampler, load_if_exists=True)
        if not study.trials:
            study.enqueue_trial(space.stated(space.default(problem)))
    for key, value in {**problem.as_dict(), **env.as_dict()}.items():
        study.set_user_attr(key, value)
    return study


def _changed_parameters(study: optuna.Study, space: spaces.Space) -> list[str]:
    """The parameters that trials of ``study`` drew from other values than ``space`` offers now."""
    changed = set()
    for trial in study.get_trials(deepcopy=False):
        for name, distribution in trial.distributions.items():
            param = space.params.get(name)
            if param is None or tuple(getattr(distribution, "choices", ())) != tuple(param.values):
                changed.add(name)
    return sorted(changed)


def _worker() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _salt(seed: int | None) -> str:
    """What tells this run's random draws from another's: the seed asked for, else the worker
    (so neither a resumed run nor a concurrent worker replays the same samples)."""
    return _worker() if seed is None else f"seed {seed}"


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

    def __init__(self, problem, env, store, study, space, *, jobs, gpu, budget, gate, companions=(), seed=None):
        self.problem, self.env, self.store, self.study, self.space = problem, env, store, study, space
        self.jobs, self.gpu, self.budget, self.gate = jobs, gpu, budget, gate
        self.companions: list[tuple[Problem, optuna.Study]] = list(companions)  # (problem at a shape, its study)
        rows = store.trials(study.study_name)
        self.judged = {r.digest: r for r in rows if _is_judgement(r)}
        self.counts = Counter(r.status for r in rows if r.repeat_of is None)  # see describe_counts
        self.in_flight: dict[int, _Candidate] = {}
        # digest -> repeats of a kernel that a trial (this worker's or another's) is judging
        self.waiting_on: dict[str, list[_Candidate]] = {}
        self.gpu_queue: deque[_Candidate] = deque()
        self.breaks: Counter = Counter()  # digest -> compile pools it was in when they died
        self.free_streak = 0  # proposals in a row that brought no new kernel
        # trials of the study that repeated a judged kernel's outcome (not counted by --trials)
        self.repeats = sum(r.repeat_of is not None for r in rows)
        self.compile_log = _log_base(store) + ".compile.log"
        self.rng = random.Random(f"{study.study_name}/{len(rows)}/{_salt(seed)}")  # draws among nearest valid configs

    # ---- recovery

    @staticmethod
    def rerun(study: optuna.Study, trial: optuna.trial.FrozenTrial, store: Store) -> None:
        """A trial lost with its process: re-propose its config unless its outcome was recorded."""
        if not any(r.number == trial.number for r in store.trials(study.study_name)):
            study.enqueue_trial(trial.params)

    def recover(self) -> None:
        """Settle trials left RUNNING by a process of this host that is gone, and fail those
        whose heartbeat stopped. Other workers may be settling the same trials: whichever gets
        to a trial first settles it."""
        now = datetime.now()
        lost = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if _is_dead_here(t.user_attrs.get("worker"))
                # created, then killed inside study.ask() before it got a worker tag or a heartbeat
                or ("worker" not in t.user_attrs and (now - t.datetime_start).total_seconds() > limits.ORPHAN_S)]
        self._settle_lost([(t._trial_id, t.number, t.params) for t in lost])
        optuna.storages.fail_stale_trials(self.study)

    def _outwait_orphans(self) -> None:
        """Before leaving, let untagged RUNNING trials grow limits.ORPHAN_S old and settle them, so a
        study resumed after a kill inside study.ask() ends with nothing RUNNING."""
        untagged = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                    if "worker" not in t.user_attrs]
        if untagged:  # wait for the youngest: recover() settles each once it is limits.ORPHAN_S old
            youngest = max(t.datetime_start for t in untagged)
            time.sleep(max(0.0, limits.ORPHAN_S + 1 - (datetime.now() - youngest).total_seconds()))
            self.recover()

    def _settle_lost(self, trials: list[tuple[int, int, dict]]) -> None:
        """Settle unfinished trials (id, number, params): from their row when the outcome was
        recorded (stopped between recording it and telling Optuna), else fail and re-propose."""
        rows = {r.number: r for r in self.store.trials(self.study.study_name)} if trials else {}
        for trial_id, number, params in trials:
            if number not in rows:
                self._abandon(trial_id, params)
                continue
            self._tell(optuna.Trial(self.study, trial_id), rows[number])

    def _abandon(self, trial_id: int, params: dict) -> None:
        """Fail a trial whose outcome is lost and re-propose its config, unless another worker
        failed it first (and so re-proposed it)."""
        try:
            failed = self.study._storage.set_trial_state_values(trial_id, TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            return
        if failed:
            self.study.enqueue_trial(params)

    # ---- the loop

    def run(self, trials: int | None, timeout: float | None, progress: bool) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        context = multiprocessing.get_context("spawn")  # no CUDA state or torch threads forked
        pool = self._compile_pool(context)
        gpu_pool = cf.ThreadPoolExecutor(1)
        compiling: dict[cf.Future, _Candidate] = {}
        gating: dict[cf.Future, _Candidate] = {}
        if progress:
            self._announce(trials)
        bar = _Progress(self, trials) if progress else None
        # Ctrl-C only sets a flag, acted on between steps: never between recording an outcome and
        # telling Optuna, nor inside study.ask(), so an interrupted study leaves nothing RUNNING.
        stop = threading.Event()
        previous = (signal.signal(signal.SIGINT, lambda *_: stop.set())
                    if threading.current_thread() is threading.main_thread() else None)
        try:
            while True:
                if stop.is_set():
                    raise KeyboardInterrupt
                self.recover()  # another worker of the study may have died since the last look
                open_for_more = self._open_for_more(trials, deadline)
                if deadline is not None and time.monotonic() >= deadline:
                    pool = self._give_back_queued(compiling, pool, context)
                # Keep every compile process busy plus one compiled kernel waiting for the GPU.
                while open_for_more and len(compiling) + len(self.gpu_queue) < self.jobs + 1:
                    candidate = self._propose()
                    if candidate is not None:
                        _submit(pool, compiling, candidate)
                    open_for_more = self._open_for_more(trials, deadline)
                for candidate in self._resolve_waiting():
                    _submit(pool, compiling, candidate)
                if self.gpu_queue and not gating:
                    candidate = self.gpu_queue.popleft()
                    gating[gpu_pool.submit(self._gate, candidate)] = candidate
                if not compiling and not gating and not self.waiting_on:
                    # asked again: repeats settled just above are free, which may reopen the budget
                    if not self._open_for_more(trials, deadline):
                        self._outwait_orphans()
                        if self.free_streak >= MAX_FREE_STREAK:
                            print(f"tune: note: the last {self.free_streak} proposals brought no new kernel "
                                  "(broken constraints, model prunes, repeats): the space looks searched out")
                        break
                    continue
                futures = [*compiling, *gating]
                poll_s = min(limits.WAIT_POLL_S if self.waiting_on else limits.HEARTBEAT_S / 2, limits.STOP_POLL_S)
                if futures:
                    done, _ = cf.wait(futures, timeout=poll_s, return_when=cf.FIRST_COMPLETED)
                else:  # only waiting for other workers' outcomes
                    time.sleep(poll_s)
                    done = ()
                if stop.is_set():
                    raise KeyboardInterrupt
                for future in done:
                    if future in compiling:  # not when a broken pool's compiles were resubmitted
                        pool = self._compiled(future, compiling.pop(future), compiling, pool, context)
                    elif future in gating:
                        self._gated(future, gating.pop(future))
                pool = self._watch_compiles(compiling, pool, context)
                for candidate in self.in_flight.values():
                    self.study._storage.record_heartbeat(candidate.trial._trial_id)
                if bar:
                    bar.update()
        except BaseException:
            _kill_workers(pool)  # an interrupted compile must not finish into the kernel cache unseen
            self._settle_lost([(c.trial._trial_id, c.number, c.trial.params) for c in self.in_flight.values()])
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            pool.shutdown(wait=False, cancel_futures=True)
            gpu_pool.shutdown(wait=False, cancel_futures=True)
            if bar:
                bar.close()
            for problem, study in [(self.problem, self.study), *self.companions]:
                self._write_winner(problem, study.study_name)

    def _announce(self, trials: int | None) -> None:
        """Say where the run's files go and, without a GPU, what it will do and about how long."""
        from .compile import kernels_dir

        tilelang_cache = os.environ.get("TILELANG_CACHE_DIR", "~/.tilelang/cache")  # TileLang's default
        print(f"tune: results go to {self.store.where}; compile log {self.compile_log}; kernels cached in "
              f"{kernels_dir()} and {tilelang_cache}", flush=True)
        if self.gate is not None:
            return
        left = "kernels until the deadline" if trials is None else \
            f"{max(trials - judged_count(self.counts), 0)} kernels"
        seen = sorted(r.compile_seconds for r in self.judged.values() if r.compile_seconds)
        if seen and trials is not None:
            per = seen[len(seen) // 2]
            pace = (f"about {per:.0f} s a compile in this study so far, so about "
                    f"{_minutes(per * max(trials - judged_count(self.counts), 0) / self.jobs)}")
        else:
            pace = "the time left is shown as kernels are judged (a compile for sm_90a takes 10-60 s here)"
        print(f"tune: no GPU: compiling {left} for sm_90a on {self.jobs} processes, none gated or timed; "
              f"{pace}; --trials N compiles fewer", flush=True)

    def _compile_pool(self, context) -> cf.ProcessPoolExecutor:
        return cf.ProcessPoolExecutor(self.jobs, mp_context=context, initializer=_quiet,
                                      initargs=(self.compile_log,))

    def _new_pool(self, pool, context, compiling, first: _Candidate | None = None) -> cf.ProcessPoolExecutor:
        """A new compile pool in place of ``pool`` (its workers killed), with ``first`` and every
        compile of ``compiling`` submitted to it again; returns it."""
        _kill_workers(pool)
        pool = self._compile_pool(context)
        resubmit = [*([first] if first else []), *compiling.values()]
        compiling.clear()
        for candidate in resubmit:
            _submit(pool, compiling, candidate)
        return pool

    def _open_for_more(self, trials: int | None, deadline: float | None) -> bool:
        """Whether to propose another config: before the deadline, while the kernels judged or
        being judged, by any worker of the study, are fewer than ``trials``, and while proposals
        still bring new kernels (fewer than MAX_FREE_STREAK free ones in a row)."""
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if self.free_streak >= MAX_FREE_STREAK:
            return False
        states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
        counted = [t for t in self.study.get_trials(deepcopy=False, states=states)
                   if t.user_attrs.get("status") not in FREE and "repeat_of" not in t.user_attrs]
        return trials is None or len(counted) < trials

    def _propose(self) -> _Candidate | None:
        """Ask for a config and take it as far as the CPU can without compiling; the candidate
        to compile, or None when the trial was settled here."""
        trial = self.study.ask()
        # Heartbeat first: a trial with one is failed by the other workers if this process dies
        # now; one without (killed right inside ask()) is failed once limits.ORPHAN_S old (recover()).
        self.study._storage.record_heartbeat(trial._trial_id)
        config = {}
        try:
            trial.set_user_attr("worker", _worker())
            for name, p in self.space.params.items():
                if self.space.active(name, config):
                    config[name] = trial.suggest_categorical(name, list(p.values))
        except optuna.exceptions.UpdateFinishedTrialError:
            return None  # ask() outlasted limits.ORPHAN_S: another worker failed the trial and re-proposed it
        config = self.space.normalise(config)
        candidate = _Candidate(trial, config)
        self.in_flight[trial.number] = candidate
        reasons = self.space.violations(self.problem, config)
        if reasons:
            nearest = self.space.nearest_valid(self.problem, config, self.rng)
            if nearest is not None:  # asked next, by this worker or another
                self.study.enqueue_trial(self.space.stated(nearest))
            return self._finish(candidate, "constraint", "; ".join(reasons))
        try:
            candidate.prediction = model.predict(self.problem, config).as_dict()
            reason = model.prune_reason(self.problem, config, self.budget)
        except Exception as e:  # a model that cannot read a kernel must not stop the study: compile it
            candidate.prediction, reason = {"error": f"{type(e).__name__}: {e}"}, None
        # The default is always measured: it is the baseline the winner is compared with.
        if reason and config != self.space.default(self.problem):
            return self._finish(candidate, "pruned", reason)
        try:
            candidate.rendered = render(self.problem, config)
            if twin_config(config) is not None:
                candidate.twin = render(self.problem, twin_config(config))
        except RenderError as e:  # a template bug for this config: its outcome, not the study's
            return self._finish(candidate, "compile_error", f"render: {e}")
        candidate.digest = candidate.rendered.digest
        original = self._judgement(candidate.digest)
        if original is not None:
            return self._repeat(candidate, original)
        if self.store.claim(self.study.study_name, candidate.digest, candidate.number) == candidate.number:
            return candidate
        self.waiting_on.setdefault(candidate.digest, []).append(candidate)
        return None

    def _judgement(self, digest: str) -> TrialRecord | None:
        """The recorded outcome of kernel ``digest`` in this study, by any worker; None yet."""
        if digest not in self.judged:
            row = next((r for r in self.store.trials(self.study.study_name, digest) if _is_judgement(r)), None)
            if row is not None:
                self.judged[digest] = row
        return self.judged.get(digest)

    def _resolve_waiting(self) -> list[_Candidate]:
        """Settle repeats that wait on another worker's trial of the same kernel: with its
        outcome once recorded; if that trial was lost, the first repeat takes the kernel over.
        Returns the repeats that took a kernel over, to compile. (Repeats of this worker's own
        trials are settled by :meth:`_finish`.)"""
        if not self.waiting_on:
            return []
        running = {t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        to_compile = []
        for digest, waiting in list(self.waiting_on.items()):
            holder = self.store.claim(self.study.study_name, digest, waiting[0].number)
            if holder in self.in_flight or holder in running:
                continue
            # The holder finished (its row is recorded before Optuna is told) or was lost.
            original = self._judgement(digest)
            if original is not None:
                del self.waiting_on[digest]
                for candidate in waiting:
                    self._repeat(candidate, original)
            elif self.store.take_over(self.study.study_name, digest, holder, waiting[0].number):
                to_compile.append(waiting.pop(0))
                if not waiting:
                    del self.waiting_on[digest]
        return to_compile

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
            for other in compiling.values():
                self.breaks[other.digest] += 1
            return self._new_pool(pool, context, compiling, first=candidate)
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
        elif candidate.config == self.space.default(self.problem):
            self.gpu_queue.appendleft(candidate)  # the baseline goes first: a short run still measures it
        else:
            self.gpu_queue.append(candidate)
        return pool

    def _give_back_queued(self, compiling, pool, context):
        """At the deadline, the trials not yet on the GPU (compiling, or compiled and queued) are
        given back: failed, their configs re-proposed first when the study resumes. The run then
        ends after the gate in progress, not after the whole queue; the default config alone is
        kept, as the baseline. Returns the compile pool (a new one when compiles were dropped)."""
        default = self.space.default(self.problem)
        dropped = {f: c for f, c in compiling.items() if c.config != default}
        queued = [c for c in self.gpu_queue if c.config != default]
        for future in dropped:
            del compiling[future]
        self.gpu_queue = deque(c for c in self.gpu_queue if c.config == default)
        for candidate in [*dropped.values(), *queued]:
            self.in_flight.pop(candidate.number, None)
            self._abandon(candidate.trial._trial_id, candidate.trial.params)
        if dropped and not compiling:  # nothing left worth waiting for in the pool
            return self._new_pool(pool, context, compiling)
        return pool

    def _watch_compiles(self, compiling, pool, context):
        """The compile watchdog: a compile running for limits.COMPILE_S is recorded as a hang; as
        a process pool cannot stop one task, its workers are killed and the other compiles are
        submitted again to a new pool. Returns the pool."""
        now = time.monotonic()
        for future, candidate in compiling.items():
            if candidate.compile_running_since is None and future.running():
                candidate.compile_running_since = now
        stuck = [f for f, c in compiling.items()
                 if c.compile_running_since is not None and now - c.compile_running_since > limits.COMPILE_S]
        if not stuck:
            return pool
        for future in stuck:
            self._finish(compiling.pop(future), "hang",
                         f"compile still running after {limits.COMPILE_S:g} s; its process was killed")
        return self._new_pool(pool, context, compiling)

    def _gate(self, candidate: _Candidate):
        start = time.monotonic()
        also_at = {"also_at": tuple(p.shape for p, _ in self.companions)} if self.companions else {}
        result = self.gate(self.problem, candidate.config, timeout_s=limits.GATE_S, device=self.gpu, **also_at)
        return result, time.monotonic() - start

    def _gated(self, future, candidate: _Candidate) -> None:
        try:
            result, seconds = future.result()
        except Exception as e:
            self._finish(candidate, "crash", f"gate raised {type(e).__name__}: {e}")
            return
        timing = (result.timing or {}) if result.status == "pass" else {}
        self._finish(candidate, result.status, result.message or "", timing_at=result.timing_at,
                     gate_errors=result.errors, gpu_seconds=seconds, **_latencies(timing))
        if result.status == "pass":  # a kill later loses no winner (write_winner keeps the faster)
            self._write_winner(self.problem, self.study.study_name)

    def _finish(self, candidate: _Candidate, status: str, reason: str, timing_at: dict | None = None,
                **measured) -> None:
        """Record the outcome, then tell Optuna (a kill in between is settled by recover()); a
        kernel judged is recorded in the companion studies too (``timing_at``: the gate's timings
        at their shapes)."""
        report = candidate.compile
        record = TrialRecord(
            study=self.study.study_name, number=candidate.number, problem=self.problem, config=candidate.config,
            status=status, stack=self.env, reason=reason, digest=candidate.digest,
            prediction=candidate.prediction, compile_report=report and report["report"],
            compile_seconds=report and report["seconds"], started_at=candidate.started_at, **measured)
        self._settle(candidate, record)
        if candidate.digest is not None and status != "constraint":
            self.judged[candidate.digest] = record
            for repeat in self.waiting_on.pop(candidate.digest, []):
                self._repeat(repeat, record)
        if candidate.digest is not None and status not in FREE:
            for problem, study in self.companions:
                self._record_companion(problem, study, record, timing_at or {})

    def _record_companion(self, problem: Problem, study: optuna.Study, record: TrialRecord,
                          timing_at: dict) -> None:
        """Record the kernel ``record`` judged in the study of ``problem`` (another shape), timed
        there by the same gate (``timing_at``), unless that study judged it already. Optuna is told
        first (a companion trial is created finished, its number is only known then); a kill in
        between leaves a trial without a row, and the kernel is judged again at that shape."""
        if any(_is_judgement(r) for r in self.store.trials(study.study_name, record.digest)):
            return
        status, reason, measured = record.status, f"judged by trial {record.number} of {record.study}", {}
        if status == "pass":
            timing, failure = shape_timing(timing_at, problem.shape)
            if timing is None:
                status, reason = "crash", f"{failure}; {reason}"
            else:
                measured = _latencies(timing)
        elif record.reason:
            reason = f"{record.reason}; {reason}"
        infeasible = INFEASIBLE.get(status)
        params = self.space.stated(record.config)
        frozen = optuna.trial.create_trial(
            params=params, value=measured.get("median_ms"),
            state=TrialState.COMPLETE if measured else TrialState.PRUNED,
            distributions={name: optuna.distributions.CategoricalDistribution(list(self.space.params[name].values))
                           for name in params},
            user_attrs={"status": status, "reason": reason[:500]},
            # where Trial.set_constraint keeps a constraint, as _tell sets it
            system_attrs={f"constraints:{infeasible}": 1.0} if infeasible else {})
        trial_id = study._storage.create_new_trial(study._study_id, template_trial=frozen)
        self.store.record_trial(TrialRecord(
            study=study.study_name, number=study._storage.get_trial_number_from_id(trial_id), problem=problem,
            config=record.config, status=status, stack=self.env, reason=reason, digest=record.digest,
            prediction=record.prediction, compile_report=record.compile_report,
            compile_seconds=record.compile_seconds, gate_errors=record.gate_errors, started_at=record.started_at,
            **measured))
        if status == "pass":
            self._write_winner(problem, study.study_name)

    def _repeat(self, candidate: _Candidate, original: TrialRecord) -> None:
        same = {k: getattr(original, k) for k in ("status", "reason", "prediction", "compile_report",
                                                   "gate_errors", "median_ms", "p10_ms", "p90_ms")}
        record = TrialRecord(study=self.study.study_name, number=candidate.number, problem=self.problem,
                             config=candidate.config, stack=self.env, digest=candidate.digest,
                             repeat_of=original.number, started_at=candidate.started_at, **same)
        self._settle(candidate, record)

    def _settle(self, candidate: _Candidate, record: TrialRecord) -> None:
        self.store.record_trial(record)
        self._tell(candidate.trial, record)
        free = record.status in FREE or record.repeat_of is not None
        self.free_streak = self.free_streak + 1 if free else 0
        self.in_flight.pop(candidate.number, None)
        if record.repeat_of is None:
            self.counts[record.status] += 1
        else:
            self.repeats += 1

    def _tell(self, trial: optuna.Trial, record: TrialRecord) -> None:
        """Tell Optuna the recorded outcome. A trial another worker finished first is left as it is:
        it told the same row, or it took the trial for lost (a slow ask() or a missed heartbeat
        under load), failed it and re-proposed its config, and that trial repeats this row."""
        try:
            trial.set_user_attr("status", record.status)
            if record.repeat_of is not None:
                trial.set_user_attr("repeat_of", record.repeat_of)
            if record.reason:
                trial.set_user_attr("reason", record.reason[:500])
            if record.status == "pass" and record.median_ms is not None:
                self.study.tell(trial, record.median_ms, skip_if_finished=True)
                return
            if record.status in INFEASIBLE:
                over = record.prediction["registers"] - self.budget if record.status == "pruned" else 1
                trial.set_constraint(INFEASIBLE[record.status], float(max(over, 1)))
            self.study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass

    # ---- results

    def _write_winner(self, problem: Problem, study: str) -> None:
        row = best(problem, self.store, study)
        if row is None:
            return
        self.store.write_winner(Winner(
            problem=problem, stack=self.env, digest=row.digest, config=row.config,
            median_ms=row.median_ms, p10_ms=row.p10_ms, p90_ms=row.p90_ms, gate_errors=row.gate_errors or {},
            study=row.study, trial_number=row.number), gate_status=row.status)

    def summary(self) -> TuneSummary:
        return summarise(self.problem, self.store, self.study.study_name, self.space, gated=self.gate is not None,
                         also_at=[(p, study.study_name) for p, study in self.companions])


def best(problem: Problem, store: Store, study: str) -> TrialRecord | None:
    """The fastest passing row of ``study`` whose kernel is still what the template renders today."""
    rows = [r for r in store.trials(study) if r.status == "pass" and r.median_ms is not None]
    for row in sorted(rows, key=lambda r: r.median_ms):
        if _digest(problem, row.config) == row.digest:
            return row
    return None


def summarise(problem: Problem, store: Store, study: str, space: spaces.Space, gated: bool,
              also_at: list[tuple[Problem, str]] = ()) -> TuneSummary:
    """The :class:`TuneSummary` of ``study`` (a search of ``space``) as recorded in ``store``, over
    all its workers, with those of its companion studies (``also_at``: (problem, study) pairs)."""
    rows = store.trials(study)
    judged = [r for r in rows if r.repeat_of is None]
    default_digest = _digest(problem, space.default(problem))
    default = next((r for r in rows if r.digest == default_digest and r.repeat_of is None), None)
    companions = tuple(summarise(p, store, name, space, gated) for p, name in also_at)
    return TuneSummary(study, Counter(r.status for r in judged), best(problem, store, study), default, gated=gated,
                       also_at=companions, repeats=len(rows) - len(judged), database=store.where)


def companion_problems(problem: Problem, shapes) -> list[Problem]:
    """``problem`` at each of ``shapes`` (``BxTxH``): the companion studies' problems. A shape given
    twice, or the problem's own, is a UserError."""
    companions = [problem.at(shape) for shape in shapes]
    seen = [problem.shape, *(p.shape for p in companions)]
    if len(set(seen)) != len(seen):
        raise UserError(f"--also-at {' '.join(shapes)}: each shape once, other than the tuned {problem.shape}")
    return companions


def _latencies(timing: dict) -> dict:
    """The latency columns of a trial row from a timing dict (``bench.time_module``)."""
    return {k: timing.get(k) for k in ("median_ms", "p10_ms", "p90_ms")}


def _is_judgement(record: TrialRecord) -> bool:
    """Whether ``record`` judged its kernel itself (rather than repeating another trial's outcome)."""
    return record.digest is not None and record.repeat_of is None and record.status != "constraint"


def _log_base(store: Store) -> str:
    """Where log files go: beside the SQLite file; for a database server, ``server.*`` in the per-user
    data folder."""
    if store.path is not None:
        return store.path
    folder = paths.data_dir()  # not the working directory: a clone of this repository, often
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / "server")


def _digest(problem: Problem, config: dict) -> str | None:
    """What the template renders ``config`` to today; None when it no longer can."""
    try:
        return render(problem, config).digest
    except (UserError, RenderError):
        return None


def _quiet(log_path: str) -> None:
    """Send a compile process's output (TVM prints tracebacks of failed compiles) to a log file:
    the errors are recorded in the trial rows, and the terminal keeps the progress bar."""
    # A Ctrl-C is the tuner's to handle, not a compile's: in a session of its own, the process and its
    # nvcc are out of the terminal's reach (an nvcc stopped by it would pass for a compile error).
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # A kernel shared by several configs is found in TileLang's memory cache each time, with a
    # warning that drowns the errors (thousands of them in a run).
    logging.getLogger("tilelang.cache.kernel_cache").addFilter(lambda r: "in memory cache" not in r.getMessage())


def _submit(pool: cf.ProcessPoolExecutor, compiling: dict, candidate: _Candidate) -> None:
    """Submit ``candidate``'s compile (and its twin's) to ``pool``; the watchdog's clock starts
    when the pool runs it."""
    candidate.compile_running_since = None
    compiling[pool.submit(compile_for_gate, candidate.rendered, candidate.twin)] = candidate


def _kill_workers(pool: cf.ProcessPoolExecutor) -> None:
    """Kill a compile pool's workers and their compilers (each leads its own process group, see
    :func:`_quiet`; the executor has no public way before Python 3.14). A compile killed leaves no
    report behind: it is compiled again when asked again."""
    for process in list((pool._processes or {}).values()):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone, or not yet in its own group
            process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def compile_for_gate(rendered, twin=None) -> dict:
    """Compile a config (in a pool process; a plain dict crosses back) and, when it compiles, its
    ``num_stages = 0`` twin: the gate's child then loads both from the caches and runs no nvcc."""
    from .compile import compile_rendered

    start = time.monotonic()
    report = compile_rendered(rendered)
    if twin is not None and report.ok:
        compile_rendered(twin)
    print(report.summary(), flush=True)  # the compile log: ptxas' figures, or the error, per kernel
    return {"error": report.error, "rejected": [f.message for f in report.rejected],
            "report": report.as_dict(), "seconds": time.monotonic() - start}


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
    console.print(f"study {summary.study}: {trials} trials, {judged_count(summary.counts)} kernels judged: "
                  f"{describe_counts(summary.counts, summary.repeats, summary.gated)}", soft_wrap=True)
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


def judged_count(counts: Counter) -> int:
    """Kernels judged (what ``--trials`` counts), from counts that leave repeats out."""
    return sum(n for status, n in counts.items() if status not in FREE)


def describe_counts(counts: Counter, repeats: int, gated: bool) -> str:
    """The counts in words, the same in the progress lines and the summary: the kernels judged by
    outcome, then the free proposals (``counts`` leaves repeats out; they are ``repeats``)."""
    failed = sum(counts[s] for s in FAILED)
    judged = (f"passed {counts['pass']}, failed {failed}" if gated else
              f"compiled {counts['compiled']}, failed {failed} (no GPU: none gated or timed)")
    return (f"{judged}; not compiled: {counts['constraint']} broke a constraint, {counts['pruned']} pruned "
            f"by the register model, {repeats} repeated a judged kernel")


class _Progress:
    """The run's progress: on a terminal a rich bar; elsewhere (a log, CI, a pipe) a line per kernel
    judged, with the time left at the pace seen so far."""

    def __init__(self, tuner: _Tuner, total: int | None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.tuner, self.total = tuner, total
        self.start = time.monotonic()
        self.judged_at_start = self.printed = judged_count(tuner.counts)
        self.progress = None
        if sys.stdout.isatty():
            self.progress = Progress(TextColumn("[bold]tuning"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.description}"), TimeElapsedColumn())
            self.task = self.progress.add_task("", total=total)
            self.progress.start()
        self.update()

    def update(self) -> None:
        c = self.tuner.counts
        best = min((r.median_ms for r in self.tuner.judged.values() if r.median_ms is not None), default=None)
        text = (describe_counts(c, self.tuner.repeats, self.tuner.gate is not None)
                + (f"; best {best:.4f} ms" if best is not None else ""))
        judged = judged_count(c)
        if self.progress is not None:
            self.progress.update(self.task, completed=judged, description=text)
        elif judged > self.printed:
            self.printed = judged
            elapsed = time.monotonic() - self.start
            left = ""
            if self.total is not None and judged < self.total:
                pace = elapsed / (judged - self.judged_at_start)
                left = f", about {_minutes(pace * (self.total - judged))} left"
            print(f"tune: {judged}/{self.total or '?'} kernels judged after {_minutes(elapsed)}{left}: {text}",
                  flush=True)

    def close(self) -> None:
        self.update()
        if self.progress is not None:
            self.progress.stop()


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
