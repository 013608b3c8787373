"""Run the correctness gate on every variant's default config (GPU) and print the errors reached.

    python benchmarks/gate_defaults.py --dk 128 --dtype fp16 --dtype bf16 --json gate_defaults.json

Each gate runs in its own child process with a watchdog (``tuner.gate.run_gate``), several at
once so that one GPU call covers all variants; the table lists the relative L2 error of the
output and of the final state per regime (the worst over seeds and sequence lengths).
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from tuner import gate, space
from tuner.candidate import Candidate
from tuner.problem import Problem
from tuner.variants import VARIANTS


def gate_default(variant: str, dk: int, dtype: str, timeout_s: int) -> dict:
    problem = Problem(variant, dk, dk, dtype)
    config = space.load(variant).default(problem)
    result = gate.run_gate(Candidate.from_config(problem, config), timeout_s=timeout_s)
    return {"variant": variant, "dk": dk, "dtype": dtype, "config": config, **result.as_dict()}


def table(rows: list[dict]) -> str:
    lines = [f"{'variant':<11}{'dk':>4} {'dtype':<6}{'status':<10}{'regime':<15}{'o':>10}{'final':>10}"]
    for r in rows:
        errors = r.get("errors") or {"-": {}}
        for i, (regime, e) in enumerate(errors.items()):
            head = f"{r['variant']:<11}{r['dk']:>4} {r['dtype']:<6}{r['status']:<10}" if i == 0 else " " * 31
            lines.append(f"{head}{regime:<15}{e.get('o', float('nan')):>10.2e}{e.get('final_state', float('nan')):>10.2e}")
        if r["status"] != "pass":
            lines.append(" " * 31 + f"-> {r.get('message', '')[:200]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", choices=list(VARIANTS))
    p.add_argument("--dk", type=int, action="append")
    p.add_argument("--dtype", action="append", choices=("fp16", "bf16"))
    p.add_argument("--parallel", type=int, default=4, help="gates at once")
    p.add_argument("--timeout", type=int, default=400, help="watchdog seconds per gate")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    jobs = [(v, dk, dt) for v in args.variant or VARIANTS for dk in args.dk or (128,) for dt in args.dtype or ("fp16", "bf16")]
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda j: gate_default(*j, args.timeout), jobs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    return 0 if all(r["status"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
