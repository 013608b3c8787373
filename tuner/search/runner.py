"""The tuning loop: proposals flow through the pipeline, the compile pool runs ahead of the GPU,
watchdogs and deadlines hold, trials of dead workers are settled.

For each proposal, cheapest step first: the search space's cheap constraints (``constraint``,
nothing rendered); the candidate rendered once and its kernel's measured constraints (the nearest
valid config is enqueued after a refusal, so it is what the search asks next); the register model
(``pruned``, nothing compiled; never the default, the baseline); a kernel already judged in the
study is not judged again (``repeat_of``); compile in the pool (``compile_error``, ``screen``, a
``hang`` past ``limits.COMPILE_S``); with a GPU, gate and time one at a time in a watchdogged child
(``hang``, ``nan``, ``mismatch``, ``crash``, ``pass``), the default first; without one a trial ends
as ``compiled``. Every judged kernel is recorded in the companion studies too (other shapes), a
passing one with its timing there from the same gate child.

A Ctrl-C only sets a flag, acted on between steps: never between recording an outcome and telling
Optuna, nor inside ``ask()``, so an interrupted study leaves nothing RUNNING.
"""
from __future__ import annotations

import concurrent.futures as cf
import random
import signal
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime

import optuna

from .. import candidate as candidates, limits
from ..candidate import Candidate
from ..gate import shape_timing
from ..problem import Problem
from ..render import RenderError
from ..status import FREE, Status
from ..store import TrialRecord, utcnow
from . import compiling
from .recorder import Recorder, counts_toward_trials, judged_count
from .strategy import Strategy, lost, worker_id

# Proposals in a row that bring no new kernel (broken constraints, model prunes, repeats) after
# which the space is taken as searched out: TPE keeps proposing what it has seen.
MAX_FREE_STREAK = 200


@dataclass(frozen=True)
class Study:
    """One study a run records into: its problem, what Optuna proposes, what is written."""

    problem: Problem
    strategy: Strategy
    recorder: Recorder


@dataclass
class InFlight:
    """A proposed config on its way through the pipeline."""

    trial: optuna.Trial
    config: dict
    started_at: datetime = field(default_factory=utcnow)
    candidate: Candidate | None = None
    prediction: dict | None = None
    compile: dict | None = None  # the compile pool's result
    compile_running_since: float | None = None  # monotonic time its compile was first seen running

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def digest(self) -> str | None:
        return None if self.candidate is None else self.candidate.digest


class Observer:
    """What a run tells whoever watches it. This one stays quiet but for notes."""

    def started(self, runner: Runner, trials: int | None) -> None:
        pass

    def update(self, runner: Runner) -> None:
        pass

    def note(self, message: str) -> None:
        print(f"tune: note: {message}", flush=True)

    def finished(self, runner: Runner) -> None:
        pass


class Runner:
    """One run of the loop over a study and its companions (the same kernels at other shapes).

    Args:
        study (Study): the study the search follows.
        companions (list[Study]): the studies of the ``also_at`` shapes.
        jobs (int): compile processes.
        gpu (int): CUDA device index.
        register_budget (int): prune configs predicted to need more registers per thread.
        gate (callable | None): ``gate(candidate, timeout_s=, device=[, also_at=]) -> GateResult``;
            None compiles only.
        observer (Observer): told of the run's progress.
        seed (int | None): seeds the draw among nearest valid configs (see ``tune``).
        compile_log (str): where the compile processes write.
    """

    def __init__(self, study: Study, companions: list[Study], *, jobs: int, gpu: int, register_budget: int,
                 gate, observer: Observer, seed: int | None, compile_log: str):
        self.study, self.companions = study, companions
        self.problem, self.strategy, self.recorder = study.problem, study.strategy, study.recorder
        self.space = self.strategy.space
        self.jobs, self.gpu, self.budget, self.gate, self.observer = jobs, gpu, register_budget, gate, observer
        self.compile_log = compile_log
        self.default = self.space.default(self.problem)
        self.in_flight: dict[int, InFlight] = {}
        self.waiting_on: dict[str, list[InFlight]] = {}  # digest -> repeats of a kernel another trial judges
        self.gpu_queue: deque[InFlight] = deque()
        self.breaks: Counter = Counter()  # digest -> compile pools it was in when they died
        self.free_streak = 0
        salt = worker_id() if seed is None else f"seed {seed}"  # as the sampler's seed (open_study)
        rows = sum(self.recorder.counts.values()) + self.recorder.repeats
        self.rng = random.Random(f"{self.strategy.name}/{rows}/{salt}")  # draws among nearest valid configs
        self.last_beat = time.monotonic()

    @property
    def gated(self) -> bool:
        return self.gate is not None

    # ---- the loop

    def run(self, trials: int | None, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        pool = compiling.CompilePool(self.jobs, self.compile_log)
        gpu_pool = cf.ThreadPoolExecutor(1)
        compiles: dict[cf.Future, InFlight] = {}
        gates: dict[cf.Future, InFlight] = {}
        self.observer.started(self, trials)
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
                    pool = self._give_back_queued(compiles, pool)
                # Keep every compile process busy plus one compiled kernel waiting for the GPU.
                while open_for_more and len(compiles) + len(self.gpu_queue) < self.jobs + 1:
                    flight = self._propose()
                    if flight is not None:
                        compiles[pool.submit(flight.candidate)] = flight
                    open_for_more = self._open_for_more(trials, deadline)
                for flight in self._resolve_waiting():
                    compiles[pool.submit(flight.candidate)] = flight
                if self.gpu_queue and not gates:
                    flight = self.gpu_queue.popleft()
                    gates[gpu_pool.submit(self._gate, flight)] = flight
                if not compiles and not gates and not self.waiting_on:
                    # asked again: repeats settled just above are free, which may reopen the budget
                    if not self._open_for_more(trials, deadline):
                        self._outwait_orphans()
                        if self.free_streak >= MAX_FREE_STREAK:
                            self.observer.note(f"the last {self.free_streak} proposals brought no new kernel (broken "
                                               "constraints, model prunes, repeats): the space looks searched out")
                        break
                    continue
                poll_s = limits.WAIT_POLL_S if self.waiting_on else limits.STOP_POLL_S
                if compiles or gates:
                    done, _ = cf.wait([*compiles, *gates], timeout=min(poll_s, limits.STOP_POLL_S),
                                      return_when=cf.FIRST_COMPLETED)
                else:  # only waiting for other workers' outcomes
                    time.sleep(min(poll_s, limits.STOP_POLL_S))
                    done = ()
                if stop.is_set():
                    raise KeyboardInterrupt
                for future in done:
                    if future in compiles:  # not when a broken pool's compiles were resubmitted
                        pool = self._compiled(future, compiles.pop(future), compiles, pool)
                    elif future in gates:
                        self._gated(future, gates.pop(future))
                pool = self._watch_compiles(compiles, pool)
                self._beat()
                self.observer.update(self)
        except BaseException:
            pool.kill()  # an interrupted compile must not finish into the kernel cache unseen
            for flight in list(self.in_flight.values()):
                self.strategy.give_back(flight.number, flight.trial.params)
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            pool.shutdown()
            gpu_pool.shutdown(wait=False, cancel_futures=True)
            self.observer.finished(self)
            for study in (self.study, *self.companions):
                study.recorder.write_winner()

    def _open_for_more(self, trials: int | None, deadline: float | None) -> bool:
        """Whether to propose another config: before the deadline, while the kernels judged or
        being judged, by any worker of the study, are fewer than ``trials``, and while proposals
        still bring new kernels."""
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if self.free_streak >= MAX_FREE_STREAK:
            return False
        if trials is None:
            return True
        rows = self.recorder.rows()
        judged = sum(1 for r in rows.values() if counts_toward_trials(r) and self.recorder.is_current(r))
        in_flight = sum(1 for r in self.strategy.running() if r.number not in rows)
        return judged + in_flight < trials

    # ---- recovery

    def recover(self) -> None:
        """Settle the trials in flight whose worker is gone (:func:`.strategy.lost`): from their row
        when the outcome was recorded (stopped between recording it and telling Optuna), else failed
        and re-proposed. Other workers may be settling the same trials: whichever gets there first."""
        gone = [r for r in lost(self.strategy.running(), time.time()) if r.number not in self.in_flight]
        if not gone:
            return
        rows = self.recorder.rows()
        for trial in gone:
            if trial.number in rows:
                self.strategy.tell_recorded(trial.number, rows[trial.number])
            else:
                self.strategy.give_back(trial.number, trial.params)

    def _outwait_orphans(self) -> None:
        """Before leaving, let untagged trials in flight grow ``limits.ORPHAN_S`` old and settle them,
        so a study resumed after a kill inside ask() ends with nothing RUNNING."""
        untagged = [r for r in self.strategy.running() if r.worker is None]
        if untagged:  # wait for the youngest: recover() settles each once it is ORPHAN_S old
            youngest = max(r.started for r in untagged)
            time.sleep(max(0.0, limits.ORPHAN_S + 1 - (time.time() - youngest)))
            self.recover()

    def _beat(self) -> None:
        if time.monotonic() - self.last_beat >= limits.HEARTBEAT_S:
            self.strategy.beat([f.trial for f in self.in_flight.values()])
            self.last_beat = time.monotonic()

    # ---- proposing

    def _propose(self) -> InFlight | None:
        """Ask for a config and take it as far as the CPU can without compiling; the trial to
        compile, or None when it was settled here."""
        asked = self.strategy.ask()
        if asked is None:
            return None
        flight = InFlight(*asked)
        self.in_flight[flight.number] = flight
        try:
            reasons, candidate = candidates.check(self.problem, flight.config)
        except RenderError as e:  # a template bug for this config: its outcome, not the study's
            return self._finish(flight, Status.COMPILE_ERROR, f"render: {e}")
        if reasons:
            nearest = self.space.nearest_valid(flight.config, self.rng,
                                               lambda c: not candidates.violations(self.problem, c))
            if nearest is not None:  # asked next, by this worker or another
                self.strategy.enqueue(nearest)
            return self._finish(flight, Status.CONSTRAINT, "; ".join(reasons))
        flight.candidate = candidate
        try:
            flight.prediction = candidate.prediction.as_dict()
            reason = candidate.prediction.prune_reason(self.budget)
        except Exception as e:  # a model that cannot read a kernel must not stop the study: compile it
            flight.prediction, reason = {"error": f"{type(e).__name__}: {e}"}, None
        original = self.recorder.judgement(flight.digest)
        # A kernel judged before is repeated, pruned ones too (configs that differ only in what a
        # split does not read render one kernel); the default is measured even where the model prunes.
        if original is not None and not (original.status == Status.PRUNED and flight.config == self.default):
            return self._repeat(flight, original)
        if reason and flight.config != self.default:
            return self._finish(flight, Status.PRUNED, reason)
        if self.recorder.claim(flight.digest, flight.number) == flight.number:
            return flight
        self.waiting_on.setdefault(flight.digest, []).append(flight)
        return None

    def _resolve_waiting(self) -> list[InFlight]:
        """Settle repeats that wait on another worker's trial of the same kernel: with its outcome
        once recorded; if that trial was lost, the first repeat takes the kernel over. Returns the
        repeats that took a kernel over, to compile."""
        if not self.waiting_on:
            return []
        running = {r.number for r in self.strategy.running()}
        to_compile = []
        for digest, waiting in list(self.waiting_on.items()):
            holder = self.recorder.claim(digest, waiting[0].number)
            if holder in self.in_flight or holder in running:
                continue
            # The holder finished (its row is recorded before Optuna is told) or was lost.
            original = self.recorder.judgement(digest)
            if original is not None:
                del self.waiting_on[digest]
                for flight in waiting:
                    self._repeat(flight, original)
            elif self.recorder.take_over(digest, holder, waiting[0].number):
                to_compile.append(waiting.pop(0))
                if not waiting:
                    del self.waiting_on[digest]
        return to_compile

    # ---- compiling

    def _compiled(self, future, flight: InFlight, compiles: dict, pool: compiling.CompilePool):
        """Take a finished compile; returns the pool (a new one when a compile killed it)."""
        try:
            flight.compile = future.result()
        except cf.process.BrokenProcessPool:
            # A crash takes down the pool and every compile in it: retry them in a new pool,
            # unless a kernel was present at two such deaths, which makes it the likely culprit.
            self.breaks[flight.digest] += 1
            if self.breaks[flight.digest] >= 2:
                self._finish(flight, Status.CRASH, "the compiler process died twice while compiling this kernel")
                return pool
            for other in compiles.values():
                self.breaks[other.digest] += 1
            return self._new_pool(pool, compiles, first=flight)
        except Exception as e:  # the compiler raised: this config's outcome, not the study's
            self._finish(flight, Status.CRASH, f"compile raised {type(e).__name__}: {e}")
            return pool
        if flight.compile["error"] is not None:
            self._finish(flight, Status.COMPILE_ERROR, flight.compile["error"])
        elif flight.compile["rejected"]:
            self._finish(flight, Status.SCREEN, "; ".join(flight.compile["rejected"]))
        elif self.gate is None:
            self._finish(flight, Status.COMPILED, "compiled; latency needs a GPU")
        elif flight.config == self.default:
            self.gpu_queue.appendleft(flight)  # the baseline goes first: a short run still measures it
        else:
            self.gpu_queue.append(flight)
        return pool

    def _new_pool(self, pool: compiling.CompilePool, compiles: dict,
                  first: InFlight | None = None) -> compiling.CompilePool:
        """A new compile pool in place of ``pool`` (its workers killed), with ``first`` and every
        compile of ``compiles`` submitted to it again; returns it."""
        pool.kill()
        pool = compiling.CompilePool(self.jobs, self.compile_log)
        resubmit = [*([first] if first else []), *compiles.values()]
        compiles.clear()
        for flight in resubmit:
            flight.compile_running_since = None
            compiles[pool.submit(flight.candidate)] = flight
        return pool

    def _give_back_queued(self, compiles: dict, pool: compiling.CompilePool) -> compiling.CompilePool:
        """At the deadline, the trials not yet on the GPU (compiling, or compiled and queued) are
        given back: failed, their configs re-proposed first when the study resumes. The run then
        ends after the gate in progress, not after the whole queue; the default config alone is
        kept, as the baseline. Returns the compile pool (a new one when compiles were dropped)."""
        dropped = {f: c for f, c in compiles.items() if c.config != self.default}
        queued = [c for c in self.gpu_queue if c.config != self.default]
        for future in dropped:
            del compiles[future]
        self.gpu_queue = deque(c for c in self.gpu_queue if c.config == self.default)
        for flight in [*dropped.values(), *queued]:
            self.in_flight.pop(flight.number, None)
            self.strategy.give_back(flight.number, flight.trial.params)
        if dropped and not compiles:  # nothing left worth waiting for in the pool
            return self._new_pool(pool, compiles)
        return pool

    def _watch_compiles(self, compiles: dict, pool: compiling.CompilePool) -> compiling.CompilePool:
        """The compile watchdog: a compile running for ``limits.COMPILE_S`` is recorded as a hang; as
        a process pool cannot stop one task, its workers are killed and the other compiles are
        submitted again to a new pool. Returns the pool."""
        now = time.monotonic()
        for future, flight in compiles.items():
            if flight.compile_running_since is None and future.running():
                flight.compile_running_since = now
        stuck = [f for f, c in compiles.items()
                 if c.compile_running_since is not None and now - c.compile_running_since > limits.COMPILE_S]
        if not stuck:
            return pool
        for future in stuck:
            self._finish(compiles.pop(future), Status.HANG,
                         f"compile still running after {limits.COMPILE_S:g} s; its process was killed")
        return self._new_pool(pool, compiles)

    # ---- gating

    def _gate(self, flight: InFlight):
        start = time.monotonic()
        also_at = {"also_at": tuple(s.problem.shape for s in self.companions)} if self.companions else {}
        result = self.gate(flight.candidate, timeout_s=limits.GATE_S, device=self.gpu, **also_at)
        return result, time.monotonic() - start

    def _gated(self, future, flight: InFlight) -> None:
        try:
            result, seconds = future.result()
        except Exception as e:
            self._finish(flight, Status.CRASH, f"gate raised {type(e).__name__}: {e}")
            return
        timing = (result.timing or {}) if result.status == Status.PASS else {}
        self._finish(flight, Status(result.status), result.message or "", timing_at=result.timing_at,
                     gate_errors=result.errors, gpu_seconds=seconds, **_latencies(timing))
        if result.status == Status.PASS:  # a kill later loses no winner (write_winner keeps the faster)
            self.recorder.write_winner()

    # ---- settling

    def _finish(self, flight: InFlight, status: Status, reason: str, timing_at: dict | None = None,
                **measured) -> None:
        """Record the outcome, then tell Optuna (a kill in between is settled by recover()); a
        kernel judged is recorded in the companion studies too (``timing_at``: the gate's timings
        at their shapes)."""
        compiled = flight.compile or {}
        record = self.recorder.record(flight.number, flight.config, status, reason, digest=flight.digest,
                                      started_at=flight.started_at, prediction=flight.prediction,
                                      compile_report=compiled.get("report"),
                                      compile_seconds=compiled.get("seconds"), **measured)
        self._told(flight, record)
        if flight.digest is not None and status != Status.CONSTRAINT:
            for repeat in self.waiting_on.pop(flight.digest, []):
                self._repeat(repeat, record)
        if flight.digest is not None and status not in FREE:
            for companion in self.companions:
                self._record_companion(companion, record, timing_at or {})

    def _repeat(self, flight: InFlight, original: TrialRecord) -> None:
        self._told(flight, self.recorder.repeat(flight.number, flight.config, original, flight.started_at))

    def _told(self, flight: InFlight, record: TrialRecord) -> None:
        self.strategy.tell(flight.trial, record, self.budget)
        free = record.status in FREE or record.repeat_of is not None
        self.free_streak = self.free_streak + 1 if free else 0
        self.in_flight.pop(flight.number, None)

    def _record_companion(self, companion: Study, record: TrialRecord, timing_at: dict) -> None:
        """Record the kernel ``record`` judged in the study of another shape, timed there by the same
        gate (``timing_at``), unless that study judged it already. Optuna is told first (a companion
        trial is created finished; its number is only known then); a kill in between leaves a trial
        without a row, and the kernel is judged again at that shape."""
        if companion.recorder.judgement(record.digest) is not None:
            return
        status, reason, measured = Status(record.status), f"judged by trial {record.number} of {record.study}", {}
        if status == Status.PASS:
            timing, failure = shape_timing(timing_at, companion.problem.shape)
            if timing is None:
                status, reason = Status.CRASH, f"{failure}; {reason}"
            else:
                measured = _latencies(timing)
        elif record.reason:
            reason = f"{record.reason}; {reason}"
        number = companion.strategy.add_judged(record.config, status, reason, measured.get("median_ms"))
        companion.recorder.record(
            number, record.config, status, reason, digest=record.digest, started_at=record.started_at,
            prediction=record.prediction, compile_report=record.compile_report,
            compile_seconds=record.compile_seconds, gate_errors=record.gate_errors, **measured)
        if status == Status.PASS:
            companion.recorder.write_winner()

    # ---- what the observer reads

    @property
    def judged(self) -> int:
        return judged_count(self.recorder.counts) - self.recorder.stale

    @property
    def best_ms(self) -> float | None:
        return min((r.median_ms for r in self.recorder.judged.values()
                    if r.median_ms is not None and self.recorder.is_current(r)), default=None)


def _latencies(timing: dict) -> dict:
    """The latency columns of a trial row from a timing dict (``bench.time_module``)."""
    return {k: timing.get(k) for k in ("median_ms", "p10_ms", "p90_ms")}
