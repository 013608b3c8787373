"""Calibration of the register model against ptxas: compile sampled configs, record each
kernel's prediction beside ptxas' report (``tune calibrate``, the ``tuner_calibration`` table),
refit the model's free terms (:data:`tuner.model.FITTED`) and score them. A tool over the model,
the candidates, the compiler and the store.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from . import space as spaces, stack
from . import candidate as candidates
from .candidate import Candidate
from .compile import compile_candidate
from .model import (FITTED, REGISTER_LIMIT, Kernel, KernelPrediction, launch_register_cap, parse_kernels, predict_kernel,
                    terms)
from .problem import Problem
from .store import CalibrationPoint, Store


@dataclass(frozen=True)
class Observation:
    """One compiled kernel: the model's view of it beside what TileLang and ptxas reported.

    Args:
        digest (str): the digest of the rendered source (one compiled config).
        config (dict): the config it was rendered from.
        kernel (Kernel): the parsed kernel.
        registers (int): ptxas' "Used N registers" (the ``setmaxnreg`` cap where one is set).
        spill_bytes (int): spill stores plus spill loads, bytes per thread.
        wgmma_serialized (bool): ptxas warned C7512.
        smem_bytes (int | None): the dynamic shared memory TileLang launches the kernel with.
    """

    digest: str
    config: dict
    kernel: Kernel
    registers: int
    spill_bytes: int
    wgmma_serialized: bool
    smem_bytes: int | None

    @property
    def demand_reported(self) -> bool:
        """ptxas' register count is the kernel's demand: no ``setmaxnreg``, no spill, below the cap."""
        return (not self.kernel.setmaxnreg and self.spill_bytes == 0
                and self.registers < launch_register_cap(self.kernel.launch_threads, self.kernel.min_blocks_per_sm))


@dataclass(frozen=True)
class Accuracy:
    """How well a set of fitted terms predicts a set of observations (counted per config).

    Args:
        configs (int): compiled configs.
        false_prunes (int): configs pruned (a kernel's predicted demand above its budget) that
            compiled without spilling.
        missed_spills (int): configs kept that spilled.
        spilled (int): configs that spilled.
        smem_exact (int): kernels whose shared memory was predicted to the byte, of ``kernels``.
        kernels (int): compiled kernels.
        register_errors (tuple[int, ...]): predicted minus reported registers, for the kernels
            whose reported count is their demand.
        wgmma_wrong (int): kernels whose C7512 prediction was wrong.
    """

    configs: int
    false_prunes: int
    missed_spills: int
    spilled: int
    smem_exact: int
    kernels: int
    register_errors: tuple[int, ...]
    wgmma_wrong: int

    def lines(self) -> list[str]:
        errs = self.register_errors
        mae = sum(abs(e) for e in errs) / len(errs) if errs else float("nan")
        worst = max(errs, key=abs) if errs else 0
        pct = lambda n: f"{100 * n / self.configs:.1f}%" if self.configs else "-"  # noqa: E731
        return [
            f"configs compiled: {self.configs} ({self.spilled} spilled)",
            f"false prunes: {self.false_prunes} ({pct(self.false_prunes)})",
            f"missed spills: {self.missed_spills} ({pct(self.missed_spills)})",
            f"shared memory exact: {self.smem_exact}/{self.kernels} kernels",
            f"register error where ptxas reports demand: mean |err| {mae:.1f}, worst {worst:+d} "
            f"over {len(errs)} kernels",
            f"C7512 mispredicted: {self.wgmma_wrong}/{self.kernels} kernels",
        ]


def recorded_observations(records: list[dict]) -> list[Observation]:
    """Observations from recorded compiles (the format of ``tests/data/calibration_*.json``: per
    record ``config``, the rendered ``source`` and per kernel ptxas' and TileLang's figures).
    Records marked ``superseded`` (rendered from an earlier template) are left out: they still
    check the shared-memory rules, but the register terms describe the current kernels."""
    out = []
    for record in records:
        if record.get("superseded"):
            continue
        kernels = {k.name: k for k in parse_kernels(record["source"])}
        out += [Observation(record["digest"], record["config"], kernels[k["name"]], k["registers"],
                            k["spill_stores"] + k["spill_loads"], k["wgmma_serialized"], k["dynamic_smem_bytes"])
                for k in record["kernels"]]
    return out


def accuracy(observations: list[Observation], fitted: dict) -> Accuracy:
    """Score ``fitted`` on ``observations``: per config, pruned vs spilled; per kernel, smem and registers."""
    by_config: dict[str, list[tuple[Observation, KernelPrediction]]] = {}
    for o in observations:
        by_config.setdefault(o.digest, []).append((o, predict_kernel(o.kernel, fitted)))
    false_prunes = missed = spilled = 0
    for pairs in by_config.values():
        pruned = any(p.spills for _, p in pairs)
        spills = any(o.spill_bytes > 0 for o, _ in pairs)
        spilled += spills
        false_prunes += pruned and not spills
        missed += spills and not pruned
    pairs = [pair for pairs in by_config.values() for pair in pairs]
    return Accuracy(
        configs=len(by_config), false_prunes=false_prunes, missed_spills=missed, spilled=spilled,
        smem_exact=sum(p.smem_bytes == o.smem_bytes for o, p in pairs), kernels=len(pairs),
        register_errors=tuple(p.registers - o.registers for o, p in pairs if o.demand_reported),
        wgmma_wrong=sum(p.wgmma_serialized != o.wgmma_serialized for o, p in pairs),
    )


def fit(observations: list[Observation]) -> dict:
    """Fit the free terms of the register model to ``observations``.

    ``fragment_scale`` and ``overhead``: least squares of ptxas' count on live fragment registers
    over the kernels whose count is their demand (five or more, spread over 32 registers or more,
    slope within 0.25..2); otherwise the scale is 1 and the overhead the mean excess.
    ``pipeline_overhead`` (0..96, steps of 4) and ``spill_margin`` (-64..64, steps of 2) together:
    the pair that misclassifies the fewest configs as spilling or clean (ties: fewer false prunes,
    then the smaller pipeline term, then the margin nearest zero). They are chosen by the spills,
    not by least squares, because the kernels that pay the pipeline term are mostly those ptxas
    holds at its cap, where the count is not the demand. ``wgmma_margin``: the threshold that
    misclassifies the fewest kernels' C7512 (ties: nearest zero).
    """
    points = [(o.kernel.live_registers, o.registers) for o in observations if o.demand_reported]
    fitted = dict(FITTED["default"])
    if points:
        fitted.update(fragment_scale=1.0, overhead=round(sum(y - x for x, y in points) / len(points), 2))
    xs = [x for x, _ in points]
    if len(points) >= 5 and max(xs) - min(xs) >= 32:
        n = len(points)
        mx, my = sum(xs) / n, sum(y for _, y in points) / n
        scale = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
        if 0.25 <= scale <= 2:  # else too few or too clustered points to trust a slope
            fitted.update(fragment_scale=round(scale, 4), overhead=round(my - scale * mx, 2))
    best = None
    for pipeline in range(0, 97, 4):
        trial = {**fitted, "pipeline_overhead": pipeline}
        excess = _config_excess(observations, trial)
        (errors, false_prunes, _), margin = _best_spill_margin(excess)
        key = (errors, false_prunes, pipeline, abs(margin))
        if best is None or key < best[0]:
            best = (key, {**trial, "spill_margin": margin})
    if best is not None:
        fitted = best[1]
    # C7512 is predicted when a kernel with wgmma accumulators has demand > budget - wgmma_margin.
    kernels = [(p.registers - p.budget, o.wgmma_serialized) for o in observations
               for p in [predict_kernel(o.kernel, fitted)] if o.kernel.wgmma_accumulators]
    serialised = sum(o.wgmma_serialized for o in observations if not o.kernel.wgmma_accumulators)
    fitted["wgmma_margin"] = min(range(-64, 65, 2), key=lambda m: (
        serialised + sum((e > -m) != w for e, w in kernels), abs(m)))
    return fitted


def _config_excess(observations: list[Observation], fitted: dict) -> list[tuple[int, bool]]:
    """Per config: its kernels' largest predicted demand minus budget, and whether it spilled.
    A config is predicted to spill when that excess is above ``spill_margin``."""
    by_config: dict[str, tuple[int, bool]] = {}
    for o in observations:
        p = predict_kernel(o.kernel, fitted)
        excess, spilled = by_config.get(o.digest, (-REGISTER_LIMIT, False))
        by_config[o.digest] = (max(excess, p.registers - p.budget), spilled or o.spill_bytes > 0)
    return list(by_config.values())


def _best_spill_margin(excess: list[tuple[int, bool]]) -> tuple[tuple[int, int, int], int]:
    """The spill margin in -64..64 (steps of 2) that misclassifies the fewest configs (ties: fewer
    false prunes, then nearest zero), with its (errors, false prunes, |margin|)."""
    def cost(m: int) -> tuple[int, int, int]:
        false_prunes = sum(e > m and not s for e, s in excess)
        missed = sum(e <= m and s for e, s in excess)
        return false_prunes + missed, false_prunes, abs(m)
    margin = min(range(-64, 65, 2), key=cost)
    return cost(margin), margin


@dataclass(frozen=True)
class CalibrationResult:
    """The outcome of :func:`calibrate`.

    Args:
        problem (Problem): the problem calibrated on.
        sampled (int): configs sampled.
        compile_errors (int): sampled configs that failed to compile (not scored).
        observations (tuple[Observation, ...]): the compiled kernels.
        before (Accuracy): the module's terms for the variant (:func:`terms`) on these observations.
        fitted (dict): the terms fitted to these observations.
        after (Accuracy): the fitted terms on these observations (in sample).
    """

    problem: Problem
    sampled: int
    compile_errors: int
    observations: tuple[Observation, ...]
    before: Accuracy
    fitted: dict
    after: Accuracy

    def table(self) -> str:
        """The accuracy as Markdown rows (docs/model.md)."""
        p = self.problem
        rows = []
        for label, a in ((f"module terms {terms(p.variant)}", self.before), (f"refitted {self.fitted}", self.after)):
            errs = a.register_errors
            mae = f"{sum(abs(e) for e in errs) / len(errs):.1f} (n={len(errs)})" if errs else "-"
            rows.append(f"| {p.variant} | {label} | {self.sampled} | {self.compile_errors} | {a.configs} | {a.spilled} "
                        f"| {a.false_prunes} | {a.missed_spills} | {a.smem_exact}/{a.kernels} | {mae} "
                        f"| {a.wgmma_wrong}/{a.kernels} |")
        return "\n".join(rows)

    def report(self) -> str:
        p = self.problem
        lines = [f"calibration of {p.variant} DK={p.dk} DV={p.dv} {p.dtype}: {self.sampled} configs sampled, "
                 f"{self.compile_errors} failed to compile"]
        lines += [f"with the module's terms {terms(p.variant)}:"] + ["  " + s for s in self.before.lines()]
        lines += ["refitted " + repr(self.fitted) + " (in sample):"] + ["  " + s for s in self.after.lines()]
        return "\n".join(lines)


# Draws per wanted sample before sample_configs gives up on a space whose constraints refuse nearly all.
DRAWS_PER_SAMPLE = 1000


def sample_configs(problem: Problem, samples: int, seed: int) -> list[dict]:
    """``samples`` distinct configs of the variant's space drawn with ``seed``, constraints met: each
    parameter's value uniformly, then normalised. One seeded sequence of draws, so more samples extend
    a run. The grid is never listed (kda's has millions of configs); fewer than ``samples`` come back
    only where the space holds fewer valid configs than ``DRAWS_PER_SAMPLE`` draws a sample find."""
    sp = spaces.load(problem.variant)
    rng = random.Random(seed)
    seen, out = set(), []
    for _ in range(samples * DRAWS_PER_SAMPLE):
        if len(out) == samples:
            break
        config = sp.normalise({name: rng.choice(p.values) for name, p in sp.params.items()})
        key = tuple(sorted(config.items()))
        if key not in seen:
            seen.add(key)
            if not candidates.violations(problem, config):
                out.append(config)
    return out


def calibrate(problem: Problem, samples: int, seed: int, db: str, progress=print) -> CalibrationResult:
    """Compile sampled configs, record prediction beside ptxas in ``db``'s calibration table,
    fit the free terms and score them.

    Args:
        problem (Problem): the variant and head dims to calibrate on.
        samples (int): configs to draw from the search space.
        seed (int): sampling seed.
        db (str): the results database (its ``tuner_calibration`` table receives one row per config).
        progress (callable): called with one line per compiled config. Default: print.

    Returns:
        CalibrationResult
    """
    env, store = stack.current(), Store(db)
    observations, errors, done = [], 0, 0
    configs = sample_configs(problem, samples, seed)
    try:
        for done, config in enumerate(configs, 1):
            candidate = Candidate.from_config(problem, config)
            kernels = {k.name: k for k in candidate.kernels}
            prediction = candidate.prediction
            report = compile_candidate(candidate)
            where = f"[{done}/{len(configs)}] {config}"
            if report.error is not None:
                errors += 1
                progress(f"{where}: compile error ({report.error.splitlines()[0][:100]})")
                continue
            found = [Observation(candidate.digest, config, kernels[r.name], r.registers, r.spill_stores + r.spill_loads,
                                 r.wgmma_serialized, r.dynamic_smem_bytes) for r in report.kernels]
            observations += found
            store.add_calibration(CalibrationPoint(
                variant=problem.variant, dk=problem.dk, dv=problem.dv, dtype=problem.dtype, config=config,
                digest=candidate.digest, predicted_registers=prediction.registers,
                predicted_smem_bytes=prediction.smem_bytes, predicted_spills=prediction.spills,
                ptxas_registers=max(o.registers for o in found),
                ptxas_spill_bytes=max(o.spill_bytes for o in found),
                ptxas_smem_bytes=max(o.smem_bytes or 0 for o in found),
                ptxas_wgmma_serialized=any(o.wgmma_serialized for o in found),
                tilelang=env.tilelang, cuda=env.cuda,
                report={"prediction": prediction.as_dict(), "compile": report.as_dict(),
                        "smem_note": "ptxas_smem_bytes holds the dynamic shared memory TileLang launches with"},
            ))
            progress(f"{where}: " + ", ".join(
                f"{o.kernel.name} {o.registers} reg / {o.spill_bytes} B spill / smem {o.smem_bytes}" for o in found)
                + f" | predicted {prediction.registers} reg, smem {prediction.smem_bytes}")
    except KeyboardInterrupt:  # score what compiled so far; the rest of the draw can be resumed
        progress(f"interrupted after {done - 1} of {len(configs)} configs")
        done -= 1
    fitted = fit(observations)
    return CalibrationResult(problem, done, errors, tuple(observations),
                             accuracy(observations, terms(problem.variant)), fitted, accuracy(observations, fitted))


def calibrate_main(problem: Problem, samples: int, seed: int, db: str) -> int:
    """``tune calibrate``: run :func:`calibrate`, print its report; exit code 1 when nothing compiled."""
    result = calibrate(problem, samples=samples, seed=seed, db=db)
    print(result.report())
    print("Markdown rows (variant | terms | sampled | compile errors | compiled | spilled | false prunes | "
          "missed spills | smem exact | register MAE | C7512 wrong):")
    print(result.table())
    return 0 if result.observations else 1
