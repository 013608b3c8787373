"""The search: Optuna proposes configs, the pipeline judges them, every outcome is stored.

- :mod:`.strategy`: what Optuna proposes and is told (its public API only), the study's name.
- :mod:`.runner`: the loop: compile pool ahead of the GPU, watchdogs, deadline, recovery.
- :mod:`.compiling`: the compile pool's processes.
- :mod:`.recorder`: the rows, the claims, the winners, the summary.
- :mod:`.workers`: one worker process per GPU on one study.
- :mod:`.baselines`: FLA's op timed beside the kernels, at every shape tuned.

Tuning for several shapes at once (``also_at``, CLI ``--also-at BxTxH``): the search follows the
problem's shape, and every kernel judged is also recorded in the study of each other shape (a
companion study), with a passing kernel timed at that shape in the same gate child. The gate and
the compile do not depend on the shape, so each further shape costs only its timing, and each shape
gets its own winner.

Several workers may run one study at once (one per GPU, or on several hosts sharing a PostgreSQL
``storage``): Optuna's storage hands each trial to one worker, a kernel is judged by the trial that
claims it first while other trials that propose it wait for that outcome, and each worker fails and
re-proposes the trials of workers that died (on this host at once, elsewhere once their heartbeat is
``limits.GRACE_S`` old). ``trials`` is the number of kernels the study should have judged, over all
its workers.

Before the search, FLA's op is gated and timed at every shape tuned (the problem's and ``also_at``'s)
when FLA is installed and the run gates, unless it was measured on this stack with this FLA version
already: the baseline each winner is shown and judged against (:mod:`.baselines`).

Outcomes reach Optuna as follows: ``pass`` is COMPLETE with the median latency (ms) as the value
to minimise; every other outcome is PRUNED, infeasible ones with a positive constraint so TPE
steers away from them (``compiled`` is feasible: judged, just not timed); FAIL only marks a trial
whose process was lost or that was given back at a deadline.
"""
from __future__ import annotations

from dataclasses import replace

from .. import paths, space as spaces, stack
from ..errors import UserError
from ..gate import gate_and_time
from ..problem import Problem
from ..space import Space
from ..store import Store
from .baselines import record_baselines, time_missing_baselines
from .compiling import compile_for_gate
from .recorder import Recorder, TuneSummary, best, judged_count, summarise
from .runner import Observer, Runner, Study
from .strategy import open_study, study_name

__all__ = ["DEFAULT_TRIALS", "Observer", "TuneSummary", "best", "companion_problems", "compile_for_gate",
           "judged_count", "open_studies", "packed_problem", "record_baselines", "study_name", "summarise",
           "time_missing_baselines", "tune"]

DEFAULT_TRIALS = 40


def tune(problem: Problem, *, trials: int | None = None, timeout: float | None = None,
         db: str | None = None, storage: str | None = None, jobs: int = 2, gpu: int = 0,
         register_budget: int = 255, observer: Observer | None = None, gate=None, fixed: dict | None = None,
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
        observer (Observer): told of the run's progress (the CLI's shows it). Default: one that
            prints notes only.
        gate (callable): ``gate(candidate, timeout_s=, device=) -> GateResult`` to gate and time
            with (called with ``also_at=`` too when there are more shapes), FLA's op included; None:
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
    problem, space = packed_problem(problem, space)
    companions = companion_problems(problem, also_at)
    store = Store(storage or paths.written_db(db))  # then a database that cannot be used fails before any work
    if gate is None and stack.has_gpu():
        gate = gate_and_time
    observer = observer or Observer()
    here = stack.current(gpu)
    studies = []
    for p in (problem, *companions):
        strategy, changed = open_study(p, here, store, space, seed if p is problem else None)
        if changed:
            observer.note(f"the values of {', '.join(changed)} in the {p.variant} search space changed since the "
                          f"study began: continuing in study {strategy.name}")
        studies.append(Study(p, strategy, Recorder(store, p, here, strategy.name)))
    time_missing_baselines([problem, *companions], store, here, gate, gpu, observer.note)
    runner = Runner(studies[0], studies[1:], jobs=jobs, gpu=gpu, register_budget=register_budget, gate=gate,
                    observer=observer, seed=seed, compile_log=f"{log_base(store)}.compile.log")
    runner.run(trials, timeout)
    return summarise(problem, store, studies[0].strategy.name, space, gated=gate is not None,
                     also_at=[(s.problem, s.strategy.name) for s in studies[1:]])


def open_studies(problem: Problem, store: Store, space: Space, also_at: tuple[str, ...],
                 device: int = 0) -> tuple[str, list[tuple[Problem, str]]]:
    """Create (or find) the study of ``problem`` and those of its ``also_at`` shapes, before several
    workers race to; their names, the companions' with their problems."""
    here = stack.current(device)
    name = open_study(problem, here, store, space)[0].name
    return name, [(p, open_study(p, here, store, space)[0].name) for p in companion_problems(problem, also_at)]


def packed_problem(problem: Problem, space: Space) -> tuple[Problem, Space]:
    """``problem`` and the search ``space`` (its fixed parameters held), each stating ``packed`` where
    either does: kernels that take packed sequences are timed on packed inputs (``Problem.packed``),
    and a packed problem is tuned with such kernels."""
    if not (problem.packed or dict(space.fixed).get("packed") is True):
        return problem, space
    if problem.batch != 1:
        raise UserError(f"a packed problem is timed as one row of packed sequences, 1 x total tokens x value heads "
                        f"(--batch 1 --seqlen T --heads HV); got {problem.shape}")
    return replace(problem, packed=True), space.fix({"packed": True})


def companion_problems(problem: Problem, shapes) -> list[Problem]:
    """``problem`` at each of ``shapes`` (``BxTxH``): the companion studies' problems. A shape given
    twice, or the problem's own, is a UserError."""
    companions = [problem.at(shape) for shape in shapes]
    seen = [problem.shape, *(p.shape for p in companions)]
    if len(set(seen)) != len(seen):
        raise UserError(f"--also-at {' '.join(shapes)}: each shape once, other than the tuned {problem.shape}")
    if problem.packed and any(p.batch != 1 for p in companions):
        raise UserError(f"--also-at {' '.join(shapes)}: a packed problem's shapes are 1 x total tokens x value heads")
    return companions


def log_base(store: Store) -> str:
    """Where a run's log files go: beside the SQLite file; for a database server, ``server.*`` in the
    per-user data folder (not the working directory: a clone of this repository, often)."""
    if store.path is not None:
        return store.path
    folder = paths.data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / "server")
