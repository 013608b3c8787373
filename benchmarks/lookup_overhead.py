"""What using a tuned result costs: the config lookup, cold and warm, and the per-call overhead
of ``tuner.ops`` over calling the bare compiled kernel.

    python benchmarks/lookup_overhead.py            # lookup figures (CPU is enough)
    python benchmarks/lookup_overhead.py --ops      # plus the per-call overhead (needs a GPU)

Cold: a fresh interpreter imports ``tuner`` and answers one ``best_config`` (median of several
processes). Warm: the same query again in the same process (memoised), timed with timeit.
Overhead: host wall time per call, for ``tuner.ops.chunk_gated_delta_rule`` and for the generated
module's ``forward`` on the same compiled kernels, at a tiny shape where launch cost dominates and
at the reference shape (CUDA events), so the difference is what the wrapper adds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import timeit

COLD = ("import time; t = time.perf_counter(); import tuner; "
        "tuner.best_config('gdn', 128); print(time.perf_counter() - t)")


def cold_lookup_s(runs: int = 5) -> float:
    times = [float(subprocess.run([sys.executable, "-c", COLD], capture_output=True, text=True, check=True).stdout)
             for _ in range(runs)]
    return statistics.median(times)


def warm_lookup_us(number: int = 10000) -> float:
    import tuner

    tuner.best_config("gdn", 128)
    return min(timeit.repeat(lambda: tuner.best_config("gdn", 128), number=number, repeat=5)) / number * 1e6


def call_overhead(shape: tuple[int, int, int]) -> dict:
    import torch

    from tuner import baseline, ops
    from tuner.bench import time_forward
    from tuner.inputs import make_inputs
    from tuner.problem import Problem

    B, T, H = shape
    problem = Problem("gdn", 128, 128, "bf16", B, T, H)
    x = make_inputs(problem, seed=0, device="cuda")
    op = lambda: ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])  # noqa: E731
    op()
    fla, config = ops._plan(problem, 0, baseline.backend_choice())
    if fla is not None:
        raise SystemExit(f"lookup_overhead: tuner.ops runs FLA at {B}x{T}x{H}; LINATTN_BACKEND=tuner measures ours")
    module, kernels = ops._compiled("gdn", 128, 128, "bf16", config)
    bare = lambda: module.forward(kernels, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"])  # noqa: E731

    def host_us(fn, n=200):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n * 1e6

    return {"shape": f"{B}x{T}x{H}", "ops_us_per_call": host_us(op), "bare_us_per_call": host_us(bare),
            "ops_ms_events": time_forward(op).median_ms, "bare_ms_events": time_forward(bare).median_ms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", action="store_true", help="also measure tuner.ops' per-call overhead (GPU)")
    args = p.parse_args(argv)
    result = {"cold_lookup_s": cold_lookup_s(), "warm_lookup_us": warm_lookup_us()}
    print(f"best_config cold (import + first query): {result['cold_lookup_s'] * 1e3:.1f} ms")
    print(f"best_config warm (memoised):             {result['warm_lookup_us']:.2f} us")
    if args.ops:
        result["overhead"] = [call_overhead(s) for s in ((1, 64, 1), (4, 8192, 16))]
        for r in result["overhead"]:
            print(f"{r['shape']:>12}: ops {r['ops_us_per_call']:.1f} us/call vs bare {r['bare_us_per_call']:.1f} us/call; "
                  f"events {r['ops_ms_events']:.4f} ms vs {r['bare_ms_events']:.4f} ms")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
