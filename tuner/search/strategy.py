"""What Optuna proposes and is told, through its public API only.

A study lives in the results database beside the tuner's tables, named after the problem and the
stack (:func:`study_name`), so running the same command again resumes it. Its sampler is TPE with
constraints: every outcome that means "this config cannot work" is told with a positive constraint
(:data:`tuner.status.INFEASIBLE`), so TPE steers away from it. Workers of one study tag the trials
they hold with ``worker`` (``host:pid``) and ``beat`` (the time of their last heartbeat), which is
how the others tell a trial in flight from one whose worker died.
"""
from __future__ import annotations

import os
import socket
import time
import warnings
import zlib
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from .. import limits
from ..problem import Problem
from ..space import Space
from ..stack import Stack
from ..status import INFEASIBLE, Status
from ..store import Store, TrialRecord

def study_name(problem: Problem, stack: Stack, space: Space | None = None) -> str:
    """The study of ``problem`` on this stack: a different GPU or toolchain is another study, and so
    is a search with parameters held fixed (``space.fixed``), and a packed problem (timed on packed
    inputs) is not a dense one."""
    p = problem
    fixed = "".join(f"+{name}={value}" for name, value in (space.fixed if space else ()))
    packed = "-packed" if p.packed else ""
    return f"{p.variant}-k{p.dk}-v{p.dv}-{p.dtype}-b{p.batch}-t{p.seqlen}-h{p.heads}{packed}{fixed}@{stack.key()}"


def worker_id() -> str:
    """This process, as other workers of a study see it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Running:
    """A trial of the study in flight, by whichever worker."""

    number: int
    params: dict
    worker: str | None
    started: float  # seconds since the epoch
    beat: float | None  # the worker's last heartbeat, seconds since the epoch


class Strategy:
    """One study: proposals, outcomes, and the trials that need settling.

    Args:
        study (optuna.Study): the study, as :func:`open_study` returns it.
        space (Space): the search space it draws from.
    """

    def __init__(self, study: optuna.Study, space: Space):
        self.study, self.space = study, space

    @property
    def name(self) -> str:
        return self.study.study_name

    def ask(self) -> tuple[optuna.Trial, dict] | None:
        """A new trial, tagged as this worker's, and the config it proposes (canonical); None when
        another worker took the trial for lost before this one could tag it (a slow ask: it has
        re-proposed the config)."""
        trial = self.study.ask()
        config = {}
        try:
            trial.set_user_attr("worker", worker_id())
            trial.set_user_attr("beat", time.time())
            for name, p in self.space.params.items():
                if self.space.active(name, config):
                    config[name] = trial.suggest_categorical(name, list(p.values))
        except optuna.exceptions.UpdateFinishedTrialError:
            return None
        return trial, self.space.normalise(config)

    def enqueue(self, config: dict) -> None:
        """Ask ``config`` next (by this worker or another), every parameter that applies stated."""
        self.study.enqueue_trial(self.space.stated(config))

    def tell(self, trial: optuna.Trial, record: TrialRecord, register_budget: int) -> None:
        """Tell Optuna the recorded outcome. A trial another worker finished first is left as it is:
        it told the same row, or it took the trial for lost (a slow ask() or a missed heartbeat
        under load), failed it and re-proposed its config, and that trial repeats this row."""
        try:
            trial.set_user_attr("status", str(record.status))
            if record.repeat_of is not None:
                trial.set_user_attr("repeat_of", record.repeat_of)
            if record.reason:
                trial.set_user_attr("reason", record.reason[:500])
            if record.status == Status.PASS and record.median_ms is not None:
                self.study.tell(trial, record.median_ms, skip_if_finished=True)
                return
            if record.status in INFEASIBLE:
                over = record.prediction["registers"] - register_budget if record.status == Status.PRUNED else 1
                trial.set_constraint(INFEASIBLE[record.status], float(max(over, 1)))
            self.study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass

    def give_back(self, number: int, params: dict) -> bool:
        """Fail trial ``number`` (its outcome is lost, or it is given back at a deadline) and
        re-propose its config; False when another worker finished or failed it first (and so
        re-proposed it)."""
        try:
            self.study.tell(number, state=TrialState.FAIL)
        except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
            return False
        self.study.enqueue_trial(params)
        return True

    def beat(self, trials: list[optuna.Trial]) -> None:
        """Mark ``trials`` (this worker's, in flight) alive now."""
        now = time.time()
        for trial in trials:
            try:
                trial.set_user_attr("beat", now)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # another worker took it for lost; its outcome is recorded when it ends

    def running(self) -> list[Running]:
        """The study's trials in flight, by any worker."""
        return [Running(t.number, t.params, t.user_attrs.get("worker"), t.datetime_start.timestamp(),
                        t.user_attrs.get("beat"))
                for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]

    def tell_recorded(self, number: int, record: TrialRecord) -> None:
        """Tell trial ``number``, which this process does not hold (its worker died between recording
        its outcome and telling Optuna), the recorded outcome: its value or PRUNED. Optuna's public API
        sets attributes only through the worker's own trial object, so the status and constraint stay
        unset (the row in the store has them)."""
        try:
            if record.status == Status.PASS and record.median_ms is not None:
                self.study.tell(number, record.median_ms)
            else:
                self.study.tell(number, state=TrialState.PRUNED)
        except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
            pass  # another worker settled it first

    def add_judged(self, config: dict, status: Status, reason: str, median_ms: float | None) -> int:
        """Add a finished trial for an outcome judged elsewhere (a companion study's copy of a kernel
        judged at another shape); returns its number."""
        infeasible = INFEASIBLE.get(status)
        token = f"{worker_id()}/{time.monotonic_ns()}"
        params = self.space.stated(config)
        self.study.add_trial(optuna.trial.create_trial(
            params=params, value=median_ms if status == Status.PASS else None,
            state=TrialState.COMPLETE if status == Status.PASS else TrialState.PRUNED,
            distributions={name: optuna.distributions.CategoricalDistribution(list(self.space.params[name].values))
                           for name in params},
            user_attrs={"status": str(status), "reason": reason[:500], "added": token},
            constraints={infeasible: 1.0} if infeasible else None))
        return next(t.number for t in reversed(self.study.get_trials(deepcopy=False))
                    if t.user_attrs.get("added") == token)


def open_study(problem: Problem, stack: Stack, store: Store, space: Space,
               seed: int | None = None) -> tuple[Strategy, list[str]]:
    """The study of ``space`` in ``store``'s database, created with the space's default config
    first in line when it is new; its sampler seeded by ``seed`` (else by the study, how far it got
    and this worker, so neither a resumed run nor a concurrent worker replays the same samples).

    Optuna draws a parameter from one set of values per study: when values of the space changed
    since the study began, the search continues in a study of its own, named with ``~`` and the
    space's digest, whose first configs are the earlier study's fastest (``carried_over``): a space
    grows a parameter at a time, and the search should not start again from the default. Returns the
    strategy and the parameters whose values changed (empty when none).
    """
    engine_kwargs = {"connect_args": {"timeout": store.busy_timeout_s}} if store.path is not None else {}
    name = study_name(problem, stack, space)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    changed: list[str] = []
    earlier: optuna.Study | None = None
    with store.schema_lock(), warnings.catch_warnings():  # Optuna creates its tables, and a new study, unguarded
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # constant_liar, group
        storage = optuna.storages.RDBStorage(store.url, engine_kwargs=engine_kwargs)
        done = 0
        if name in optuna.study.get_all_study_names(storage):
            existing = optuna.load_study(study_name=name, storage=storage)
            changed = _changed_parameters(existing, space)
            if changed:
                earlier = existing
                name = f"{name}~{space.digest()}"
                if name in optuna.study.get_all_study_names(storage):
                    done = len(optuna.load_study(study_name=name, storage=storage).trials)
            else:
                done = len(existing.trials)
        salt = worker_id() if seed is None else f"seed {seed}"
        # constant_liar: configs other workers are judging count as bad, so TPE looks elsewhere.
        sampler = optuna.samplers.TPESampler(multivariate=True, group=True, constant_liar=True,
                                             seed=zlib.crc32(f"{name}/{done}/{salt}".encode()))
        study = optuna.create_study(storage=storage, study_name=name, direction="minimize", sampler=sampler,
                                    load_if_exists=True)
        if not study.trials:
            for config in carried_over(earlier, space, problem) if earlier is not None else []:
                study.enqueue_trial(space.stated(config))
            study.enqueue_trial(space.stated(space.default(problem)))
    for key, value in {**problem.as_dict(), **stack.as_dict()}.items():
        study.set_user_attr(key, value)
    return Strategy(study, space), changed


# How many of the earlier study's fastest configs a study continued under a changed space asks first.
CARRIED_OVER = 4


def carried_over(study: optuna.Study, space: Space, problem: Problem, count: int = CARRIED_OVER) -> list[dict]:
    """The configs of ``study``'s ``count`` fastest passing trials, fastest first, as ``space`` states
    them: a parameter it no longer has dropped, one it gained at its default (a new parameter's default
    renders the kernel as before, so such a config repeats its judged kernel at no cost). A config
    with a value ``space`` does not offer (a value dropped, a parameter held by ``--fix``) is left out."""
    out: list[dict] = []
    for trial in sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.value):
        known = {n: v for n, v in trial.params.items() if n in space.params}
        if any(v not in space.params[n].values for n, v in known.items()):
            continue
        config = space.complete(problem, known)
        if config not in out:
            out.append(config)
        if len(out) == count:
            break
    return out


def _changed_parameters(study: optuna.Study, space: Space) -> list[str]:
    """The parameters that trials of ``study`` drew from other values than ``space`` offers now."""
    changed = set()
    for trial in study.get_trials(deepcopy=False):
        for name, distribution in trial.distributions.items():
            param = space.params.get(name)
            if param is None or tuple(getattr(distribution, "choices", ())) != tuple(param.values):
                changed.add(name)
    return sorted(changed)


def lost(running: list[Running], now: float) -> list[Running]:
    """The trials in flight whose worker is gone: a process of this host that no longer runs; one
    killed inside ask(), untagged for longer than ``limits.ORPHAN_S`` (a live worker tags its trial
    within milliseconds); or one whose heartbeat is ``limits.GRACE_S`` old (a worker elsewhere)."""
    return [r for r in running
            if _dead_here(r.worker)
            or (r.worker is None and now - r.started > limits.ORPHAN_S)
            or (r.beat is not None and now - r.beat > limits.GRACE_S)]


def _dead_here(worker: str | None) -> bool:
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
