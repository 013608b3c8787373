"""How good is the search? TPE at 30 and 60 trials against an exhaustive sweep of the pruned space.

    python benchmarks/tpe_vs_sweep.py --variant gdn --dk 128 --fix decay_in=inline --fix qk_in=shared \
        --compile-only --jobs 2                                   # CPU: build every kernel once
    python benchmarks/tpe_vs_sweep.py --variant gdn --dk 128 --fix decay_in=inline --fix qk_in=shared \
        --sweep benchmarks/sweep_gdn_k128.json                    # GPU: gate and time them all
    python benchmarks/tpe_vs_sweep.py ... --sweep benchmarks/sweep_gdn_k128.json --replay-only   # CPU

``--fix`` holds parameters at one value (as ``tune --fix`` does), so the sweep covers a sub-space
small enough to measure whole; the searches are then run on the same sub-space.

1. Compile (CPU, ``--compile-only``): every config of the pruned space and its ``num_stages = 0``
   twin, through ``tuner.compile.compile_candidate``: the GPU steps load them from the caches.
2. The sweep (GPU): every config is gated by ``tuner.gate.run_gate`` (a child process with a
   watchdog each, ``--gate-jobs`` of them at once: correctness does not need the GPU alone); then
   the configs that passed are timed one after another in one child process with the GPU to
   itself, at the problem's shape, exactly as the tuner times them (``tuner.bench.time_forward``).
   A config's GPU-seconds are its gate child's wall time plus its timing. Both steps write the
   ``--sweep`` JSON as they go, so an interrupted sweep resumes where it stopped.
3. The searches (CPU): ``tuner.search.tune`` runs at each ``--budgets`` trial count (30 and 60 by
   default, and a quarter of the sweep), once per seed (``--repeats``), asking the default config
   first and, with ``--random-start``, a random one instead, with its
   gate replaced by a lookup in the sweep's measurements: every number is a measurement from step
   2, and a search's GPU-seconds are the sum of the sweep's GPU-seconds over the configs it judged.

The goal of issue #5: within 5% of the sweep's best latency with at most a quarter of its GPU trials.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from tuner import candidate as candidates, space
from tuner.candidate import Candidate
from tuner.cli import name_value
from tuner.gate import GateResult
from tuner.problem import Problem

# Wall-clock limit of the timing child per config it has left to time (load + warm-up + reps).
TIME_S_PER_CONFIG = 30


def pruned_space(problem: Problem, sp: space.Space) -> list[dict]:
    """The configs the tuner would judge on the GPU: valid, and not pruned by the register model."""
    default = sp.default(problem)
    judged = ((c, candidates.check(problem, c)) for c in sp.grid())
    return [c for c, (reasons, candidate) in judged
            if not reasons and (c == default or candidate.prediction.prune_reason() is None)]


def key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def _compile_with_twin(problem: Problem, config: dict) -> str:
    from tuner.search import compile_for_gate

    result = compile_for_gate(Candidate.from_config(problem, config))
    return "ok" if result["error"] is None and not result["rejected"] else "failed"


def compile_all(problem: Problem, configs: list[dict], jobs: int) -> None:
    with cf.ProcessPoolExecutor(jobs) as pool:
        futures = [pool.submit(_compile_with_twin, problem, c) for c in configs]
        for i, future in enumerate(cf.as_completed(futures)):
            print(f"[{i + 1}/{len(configs)}] compiled: {future.result()}", flush=True)


def _save(path: str, done: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(list(done.values()), f, indent=1)
    os.replace(path + ".tmp", path)


def sweep(problem: Problem, configs: list[dict], path: str, gate_jobs: int) -> dict[str, dict]:
    """Gate every config (``gate_jobs`` children at once), then time those that passed, resuming
    from ``path``. Returns key -> {"config", "result" (GateResult dict, timing filled on a pass),
    "gpu_seconds"}."""
    from tuner.gate import run_gate

    done = {key(r["config"]): r for r in json.load(open(path))} if os.path.exists(path) else {}
    todo = [c for c in configs if key(c) not in done]
    with cf.ThreadPoolExecutor(gate_jobs) as pool:
        futures = {pool.submit(run_gate, Candidate.from_config(problem, c), timeout_s=300): c for c in todo}
        for i, future in enumerate(cf.as_completed(futures)):
            config, result = futures[future], future.result()
            done[key(config)] = {"config": config, "result": result.as_dict(), "gpu_seconds": result.seconds}
            _save(path, done)
            print(f"[gate {i + 1}/{len(todo)}] {result.status} {result.seconds:.0f} s {config}", flush=True)
    untimed = [r for r in done.values() if r["result"]["status"] == "pass" and r["result"]["timing"] is None]
    while untimed:
        _time_in_child(problem, untimed, done, path)
        untimed = [r for r in untimed if r["result"]["timing"] is None and r["result"]["status"] == "pass"]
    return done


def _time_in_child(problem: Problem, rows: list[dict], done: dict, path: str) -> None:
    """Time ``rows``' configs in one child; a config it dies or hangs on is recorded as such."""
    with tempfile.TemporaryDirectory(prefix="linattn-sweep-") as tmp:
        job, out = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.jsonl")
        with open(job, "w") as f:
            json.dump({"problem": problem.as_dict(), "configs": [r["config"] for r in rows]}, f)
        try:
            subprocess.run([sys.executable, __file__, "--time-worker", job, out], timeout=TIME_S_PER_CONFIG * len(rows),
                           start_new_session=True)
            verdict = "crash"
        except subprocess.TimeoutExpired:
            verdict = "hang"
        lines = [json.loads(line) for line in open(out)] if os.path.exists(out) else []
    started = None
    for line in lines:
        if line["event"] == "start":
            started = line["key"]
        else:
            row = done[line["key"]]
            row["result"]["timing"] = line["timing"]
            row["gpu_seconds"] += line["seconds"]
            started = None
    if started is None and not lines:  # it died before its first config: nothing would change on a retry
        started = key(rows[0]["config"])
    if started is not None:  # the child died or hung on this one
        done[started]["result"].update(status=verdict, message=f"timing child: {verdict} while timing")
    _save(path, done)
    for row in rows:
        timing = row["result"]["timing"]
        print(f"[time] {row['result']['status']} {timing['median_ms'] if timing else '-'} ms {row['config']}", flush=True)


def time_worker(job_path: str, out_path: str) -> int:
    """The timing child: load each config from the caches and time it at the problem's shape."""
    import torch

    from tuner import bench, inputs
    from tuner.compile import load_kernels

    with open(job_path) as f:
        job = json.load(f)
    problem = Problem(**job["problem"])
    device = torch.device("cuda", 0)
    x = inputs.make_inputs(problem, "default", 0, device)
    with open(out_path, "a") as out:
        for config in job["configs"]:
            out.write(json.dumps({"event": "start", "key": key(config)}) + "\n")
            out.flush()
            start = time.perf_counter()
            module, kernels = load_kernels(Candidate.from_config(problem, config))
            timing = bench.time_module(problem, module, kernels, x, device=device)
            out.write(json.dumps({"event": "timed", "key": key(config), "seconds": time.perf_counter() - start,
                                  "timing": timing}) + "\n")
            out.flush()
    return 0


def replay(problem: Problem, fixed: dict, measured: dict[str, dict], trials: int, seed: int,
           start: dict | None = None) -> dict:
    """One search of ``trials`` trials (sampler seed ``seed``) whose gate answers from the sweep's
    measurements; the tuner asks the default config first, or ``start`` in its place."""
    import optuna

    from tuner import stack
    from tuner.search import study_name, tune

    judged = []

    def recorded_gate(problem, config, timeout_s=None, device=None):
        row = measured[key(config)]
        judged.append(row)
        return GateResult.from_dict(row["result"])

    with tempfile.TemporaryDirectory() as tmp:
        if start is not None:  # the study exists with ``start`` first in line: the tuner adds no default
            held = space.load(problem.variant).fix(fixed)
            optuna.create_study(storage=f"sqlite:///{tmp}/replay.db", direction="minimize", study_name=study_name(
                problem, stack.current(), held)).enqueue_trial(held.stated(start))
        summary = tune(problem, trials=trials, db=os.path.join(tmp, "replay.db"), progress=False, gate=recorded_gate,
                       fixed=fixed, seed=seed)
    return {"trials": trials, "gpu_trials": len(judged), "gpu_seconds": sum(r["gpu_seconds"] for r in judged),
            "best_ms": summary.winner.median_ms if summary.winner else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="gdn")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"))
    p.add_argument("--fix", action="append", default=[], type=name_value, metavar="NAME=VALUE",
                   help="hold a parameter at one value: sweep and search the rest (repeatable)")
    p.add_argument("--sweep", help="JSON of the sweep's measurements (written and resumed)")
    p.add_argument("--compile-only", action="store_true", help="only build every kernel of the space (CPU)")
    p.add_argument("--jobs", type=int, default=2, help="compile processes (--compile-only)")
    p.add_argument("--gate-jobs", type=int, default=8, help="gate children at once on the GPU")
    p.add_argument("--repeats", type=int, default=3, help="searches per trial budget")
    p.add_argument("--budgets", type=int, nargs="+", default=[30, 60],
                   help="trial budgets replayed (default 30 60; a quarter of the sweep is added)")
    p.add_argument("--random-start", action="store_true",
                   help="also replay each budget with a random config of the sweep asked first instead of "
                        "the default: the search without the default's head start")
    p.add_argument("--replay-only", action="store_true", help="skip the sweep: replay on the recorded JSON")
    p.add_argument("--sweep-only", action="store_true", help="stop after the sweep (replay later, on a CPU)")
    p.add_argument("--time-worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.time_worker:
        return time_worker(*args.time_worker)
    problem = Problem(args.variant, args.dk, args.dk, args.dtype)
    fixed = dict(args.fix)
    configs = pruned_space(problem, space.load(problem.variant).fix(fixed))
    print(f"{len(configs)} configs in the pruned space of {problem.variant} k{problem.dk} with {fixed or 'nothing'} held")
    if args.compile_only:
        compile_all(problem, configs, args.jobs)
        return 0
    if not args.sweep:
        p.error("--sweep is required unless --compile-only")
    if args.replay_only:
        measured = {key(r["config"]): r for r in json.load(open(args.sweep))}
    else:
        measured = sweep(problem, configs, args.sweep, args.gate_jobs)
    passed = [r for r in measured.values() if r["result"]["status"] == "pass" and r["result"]["timing"]]
    if not passed:
        print("no config of the sweep passed the gate", file=sys.stderr)
        return 1
    best = min(r["result"]["timing"]["median_ms"] for r in passed)
    sweep_seconds = sum(r["gpu_seconds"] for r in measured.values())
    print(f"sweep: {len(measured)} GPU trials, {sweep_seconds:.0f} GPU-s, best {best:.3f} ms "
          f"({len(passed)} passed the gate)")
    if args.sweep_only:
        return 0
    starts = [("default first", lambda _: None)]
    if args.random_start:
        rng = random.Random(0)
        starts.append(("random first", lambda _: rng.choice(list(measured.values()))["config"]))
    for trials in sorted({*args.budgets, len(measured) // 4}):
        for label, start in starts:
            runs = [replay(problem, fixed, measured, trials, seed, start(seed)) for seed in range(args.repeats)]
            found = [r["best_ms"] for r in runs if r["best_ms"] is not None]
            gpu_trials = statistics.median(r["gpu_trials"] for r in runs)
            print(f"TPE {trials} trials, {label}: best {statistics.median(found):.3f} ms median of {len(found)} "
                  f"(worst {max(found):.3f}) = {statistics.median(found) / best:.3f} x sweep; "
                  f"{gpu_trials:.0f} GPU trials ({gpu_trials / len(measured):.2f} of the sweep), "
                  f"{statistics.median(r['gpu_seconds'] for r in runs):.0f} GPU-s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
