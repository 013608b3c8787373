"""How good is the search? TPE at 30 and 60 trials against an exhaustive sweep of the pruned space.

    python benchmarks/tpe_vs_sweep.py --variant gdn --dk 128 --sweep benchmarks/sweep_gdn_k128.json

1. The sweep (GPU): every config of the space that passes the constraints and the register model is
   gated and timed once (``tuner.gate.gate_and_time``, a child process with a watchdog each); the
   outcome and the GPU-seconds it took are appended to the ``--sweep`` JSON after every config, so
   an interrupted sweep resumes where it stopped.
2. The searches: ``tuner.search.tune`` runs at 30 and 60 trials, several times, with its gate
   replaced by a lookup in the sweep's measurements: every number is a measurement from step 1,
   and a search's GPU-seconds are the sum of the sweep's GPU-seconds over the configs it judged.
   Replaying lets several searches be compared on the same measurements at no extra GPU time.

The goal of issue #5: within 5% of the sweep's best latency with at most a quarter of its GPU trials.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from tuner import model, space
from tuner.gate import GateResult
from tuner.problem import Problem


def pruned_space(problem: Problem) -> list[dict]:
    """The configs the tuner would judge on the GPU: valid, and not pruned by the register model."""
    sp = space.load(problem.variant)
    default = sp.default(problem)
    return [c for c in sp.grid() if not sp.violations(problem, c)
            and (c == default or model.prune_reason(problem, c) is None)]


def key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def sweep(problem: Problem, path: str) -> dict[str, dict]:
    """Gate and time every config of the pruned space, resuming from ``path``."""
    from tuner.gate import gate_and_time

    done = {}
    if os.path.exists(path):
        done = {key(r["config"]): r for r in json.load(open(path))}
    configs = pruned_space(problem)
    for i, config in enumerate(configs):
        if key(config) in done:
            continue
        result = gate_and_time(problem, config, timeout_s=300)
        done[key(config)] = {"config": config, "result": result.as_dict(), "gpu_seconds": result.seconds}
        with open(path, "w") as f:
            json.dump(list(done.values()), f, indent=1)
        median = (result.timing or {}).get("median_ms")
        print(f"[{i + 1}/{len(configs)}] {result.status} {median} ms {config}", flush=True)
    return done


def replay(problem: Problem, measured: dict[str, dict], trials: int) -> dict:
    """One search of ``trials`` trials whose gate answers from the sweep's measurements."""
    from tuner.search import tune

    judged = []

    def recorded_gate(problem, config, timeout_s=None, device=None):
        row = measured[key(config)]
        judged.append(row)
        return GateResult.from_dict(row["result"])

    with tempfile.TemporaryDirectory() as tmp:
        summary = tune(problem, trials=trials, db=os.path.join(tmp, "replay.db"), progress=False, gate=recorded_gate)
    return {"trials": trials, "gpu_trials": len(judged), "gpu_seconds": sum(r["gpu_seconds"] for r in judged),
            "best_ms": summary.winner.median_ms if summary.winner else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="gdn")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"))
    p.add_argument("--sweep", required=True, help="JSON of the sweep's measurements (written and resumed)")
    p.add_argument("--repeats", type=int, default=3, help="searches per trial budget")
    p.add_argument("--replay-only", action="store_true", help="skip the sweep: replay on the recorded JSON")
    args = p.parse_args(argv)
    problem = Problem(args.variant, args.dk, args.dk, args.dtype)
    if args.replay_only:
        measured = {key(r["config"]): r for r in json.load(open(args.sweep))}
    else:
        measured = sweep(problem, args.sweep)
    passed = [r for r in measured.values() if r["result"]["status"] == "pass"]
    if not passed:
        print("no config of the sweep passed the gate", file=sys.stderr)
        return 1
    best = min(r["result"]["timing"]["median_ms"] for r in passed)
    sweep_seconds = sum(r["gpu_seconds"] for r in measured.values())
    print(f"sweep: {len(measured)} GPU trials, {sweep_seconds:.0f} GPU-s, best {best:.3f} ms")
    for trials in (30, 60):
        runs = [replay(problem, measured, trials) for _ in range(args.repeats)]
        found = [r["best_ms"] for r in runs if r["best_ms"] is not None]
        print(f"TPE {trials} trials: best {statistics.median(found):.3f} ms median of {len(found)} "
              f"(worst {max(found):.3f}) = {statistics.median(found) / best:.3f} x sweep; "
              f"{statistics.median(r['gpu_trials'] for r in runs):.0f} GPU trials "
              f"({statistics.median(r['gpu_trials'] for r in runs) / len(measured):.2f} of the sweep), "
              f"{statistics.median(r['gpu_seconds'] for r in runs):.0f} GPU-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
