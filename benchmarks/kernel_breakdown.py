"""Where a config's forward spends its time: CUDA events around each kernel of the module.

    python benchmarks/kernel_breakdown.py --variant gdn --dk 128 --shape 4x8192x16 [--stored] [--set block_dv=64 ...]

The chunked splits launch several kernels (W/U, state pass, output); their sum next to the whole
forward's time (``tuner.bench.time_forward``) shows which one the templates should work on, and what
the host and the glue between the kernels add.

``--packed`` times the packed kernels (``packed=true``) on the packed problem's inputs, as the tuner
times them (``tuner.inputs.timing_inputs``: ``--shape 1xTxHV``, the gate's packed mix of lengths).

``--flashqla`` (gdn, DK = DV = 128) also times FlashQLA's chunk-parallel kernels on the same k, g
and beta the same way: its chunk-local cumulative sum and its K K^T solve, the work of our
precompute kernel.
"""
from __future__ import annotations

import argparse
import sys

import torch

from tuner import space
from tuner.cli import parse_overrides
from tuner.errors import UserError
from tuner.lookup import best_config
from tuner.candidate import Candidate
from tuner.compile import load_kernels
from tuner.bench import time_forward
from tuner.inputs import timing_inputs
from tuner.problem import Problem, parse_shape

REPS = 20


class _Timed:
    """A compiled kernel that records CUDA events around each launch into ``log``."""

    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __call__(self, *args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.kernel(*args, **kwargs)
        end.record()
        self.log.append((self.name, start, end))
        return out


def starting_config(problem: Problem, overrides: dict, stored: bool, device=None, start: dict | None = None) -> dict:
    """The config to time: the template's default (for a packed problem, what a packed call runs without a
    stored winner: the packed parameter's caller_default) with ``start`` (a script's own starting point), or
    with ``stored`` the winner stored for ``problem`` on ``device`` (:func:`tuner.best_config`'s, the
    tuner's own even where FLA would run), with ``overrides`` (``--set``) on top."""
    variant_space = space.load(problem.variant)
    base = {**(variant_space.default(problem, {"packed": True}) if problem.packed else {}), **(start or {})}
    if stored:
        found = best_config(problem.variant, problem.dk, problem.dv, problem.dtype, problem.batch, problem.seqlen,
                            problem.heads, device=device, backend="tuner", packed=problem.packed)
        if found.row is None:
            raise UserError(f"no winner of {problem.variant} k{problem.dk} at {problem.shape} is stored for this GPU "
                            f"(tune it, or leave out --stored)")
        base = found.config
    return variant_space.complete(problem, {**base, **overrides})


def per_kernel_ms(module, kernels: dict, inputs: dict) -> dict[str, float]:
    """Mean milliseconds of each kernel over REPS calls of ``module.forward(kernels, **inputs)``."""
    for _ in range(5):  # warm-up
        module.forward(kernels, **inputs)
    log = []
    timed = {name: _Timed(name, kernel, log) for name, kernel in kernels.items()}
    for _ in range(REPS):
        module.forward(timed, **inputs)
    torch.cuda.synchronize()
    per_kernel = {}
    for name, start, end in log:
        per_kernel[name] = per_kernel.get(name, 0.0) + start.elapsed_time(end) / REPS
    return per_kernel


def flashqla_precompute_ms(inputs: dict) -> dict[str, float]:
    """Mean milliseconds of FlashQLA's cumulative sum and K K^T solve (``flash_qla`` 0.1.3, Hopper)
    over REPS calls each, on ``inputs``' k, g and beta."""
    from flash_qla.ops.gated_delta_rule.chunk.hopper import kkt_solve
    from flash_qla.ops.utils import chunk_local_cumsum

    k, g, beta = inputs["k"].contiguous(), inputs["g"].float().contiguous(), inputs["beta"].float().contiguous()
    calls = {"flashqla cumsum": lambda: chunk_local_cumsum(g=g, chunk_size=64),
             "flashqla kkt_solve": lambda: kkt_solve(k=k, b=beta, chunk_size=64)}
    times = {}
    for name, call in calls.items():
        for _ in range(5):  # warm-up (and its compile)
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPS):
            call()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / REPS
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--shape", default="4x8192x16", help="BxTxH (default 4x8192x16)")
    p.add_argument("--stored", action="store_true",
                   help="start from the winner stored for this GPU at the shape instead of the template's default")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="change the config (the default, or with --stored the winner)")
    p.add_argument("--flashqla", action="store_true",
                   help="gdn at DK 128: also time FlashQLA's cumulative sum and K K^T solve on the same inputs")
    p.add_argument("--packed", action="store_true",
                   help="the packed kernels on the packed problem's inputs (--shape 1xTxHV: T tokens in all)")
    args = p.parse_args(argv)
    if args.flashqla and (args.variant, args.dk) != ("gdn", 128):
        p.error("--flashqla times FlashQLA's gdn kernels, which take DK = 128 only")
    batch, seqlen, heads = parse_shape(args.shape)
    if args.packed and batch != 1:
        p.error("--packed: the shape is 1xTxHV (T tokens in all)")
    if not torch.cuda.is_available():
        print("kernel_breakdown: needs a CUDA GPU", file=sys.stderr)
        return 2
    problem = Problem(args.variant, args.dk, args.dk, batch=batch, seqlen=seqlen, heads=heads, packed=args.packed)
    overrides = {**parse_overrides(args.set), **({"packed": "true"} if args.packed else {})}
    try:
        config = starting_config(problem, overrides, args.stored)
    except UserError as e:
        print(f"kernel_breakdown: {e}", file=sys.stderr)
        return 2
    inputs = timing_inputs(problem, torch.device("cuda"))
    module, kernels = load_kernels(Candidate.from_config(problem, config))
    per_kernel = per_kernel_ms(module, kernels, inputs)
    for name, ms in per_kernel.items():
        print(f"{name:<14}{ms:8.3f} ms")
    print(f"{'sum':<14}{sum(per_kernel.values()):8.3f} ms  ({args.variant} k{args.dk} {problem.label}, {config})")
    whole = time_forward(lambda: module.forward(kernels, **inputs))
    print(f"{'forward':<14}{whole.median_ms:8.3f} ms  (the whole call, median: the kernels, the glue between them "
          f"and the host)")
    if args.flashqla:
        for name, ms in flashqla_precompute_ms(inputs).items():
            print(f"{name:<20}{ms:8.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
