"""FLA's op timed beside the tuner's kernels (:mod:`tuner.baseline`): when a problem is tuned, once per
problem, stack and FLA version; at every ``tune regress`` again. Each measurement is a row of the
store (:class:`~tuner.store.Baseline`), a failed gate included: a wrong baseline is seen, and never
preferred by ``tuner.best_config``."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from .. import baseline, limits
from ..gate import outcome_at
from ..problem import Problem
from ..stack import Stack
from ..store import Baseline, Store


def record_baselines(problems: Iterable[Problem], store: Store, env: Stack, gate: Callable, device: int,
                     version: str) -> list[Baseline]:
    """Gate and time FLA ``version``'s op at each of ``problems`` on ``env`` and record each measurement.

    Problems that differ only in their shape share one gate child: the first shape is timed, the
    others as its ``also_at``.

    Args:
        problems (Iterable[Problem]): chunk variants' problems, each at the shape to time.
        store (Store): the results database, writable.
        env (Stack): this machine's stack.
        gate (Callable): ``gate(candidate, timeout_s=, device=[, also_at=]) -> GateResult``
            (:func:`tuner.gate.gate_and_time`).
        device (int): CUDA device index.
        version (str): the installed FLA's version (:func:`tuner.baseline.installed_version`).

    Returns:
        list[Baseline]: the rows recorded, in the order of ``problems`` by kernel problem.
    """
    groups: dict[tuple, list[Problem]] = {}
    for p in problems:
        groups.setdefault((p.variant, p.dk, p.dv, p.dtype), []).append(p)
    recorded = []
    for first, *others in groups.values():
        also_at = {"also_at": tuple(p.shape for p in others)} if others else {}
        result = gate(baseline.candidate(first, version), timeout_s=limits.BASELINE_S, device=device, **also_at)
        for p in (first, *others):
            status, timing, failure = outcome_at(result, p.shape, first.shape)
            # The baseline module autotunes FLA at each shape before timing it (its before_timing).
            recorded.append(store.add_baseline(Baseline(
                p, env, version, status, timing.get("median_ms"), timing.get("p10_ms"), timing.get("p90_ms"),
                timing.get("floor_ms"), result.errors, failure or result.message, autotuned_at_shape=True)))
    return recorded


def time_missing_baselines(problems: list[Problem], store: Store, env: Stack, gate: Callable | None, device: int,
                           note: Callable[[str], None]) -> list[Baseline]:
    """In a tuning run: FLA's op at each of ``problems`` (one kernel problem at several shapes) not yet
    measured on this stack with the installed FLA autotuned at that shape (a measurement made before
    the baselines were, with the configs FLA had chosen at another shape, is made again); ``note`` is
    told why none is timed.

    Returns:
        list[Baseline]: the rows recorded (none when every shape was measured already).
    """
    problem = problems[0]
    if not baseline.has_baseline(problem.variant):
        note(f"{problem.variant} is a decode kernel: FLA's op is timed beside the chunk variants only")
        return []
    if gate is None:
        note("no GPU: FLA's op is not timed beside the kernels either")
        return []
    version = baseline.installed_version()
    if version is None:
        note(f"FLA is not installed: its op is not timed beside the kernels ({baseline.INSTALL})")
        return []
    same = {field: getattr(env, field) for field in baseline.IDENTITY}
    measured = {b.problem for b in store.baselines(variant=problem.variant, dk=problem.dk, dv=problem.dv,
                                                   dtype=problem.dtype, fla_version=version,
                                                   autotuned_at_shape=True, **same)}
    missing = [p for p in problems if p not in measured]
    if missing:
        note(f"timing FLA {version}'s {baseline.fla_call(problem.variant)[0]} at "
             f"{', '.join(p.shape for p in missing)} (its autotune first: minutes for some ops)")
    return record_baselines(missing, store, env, gate, device, version)
