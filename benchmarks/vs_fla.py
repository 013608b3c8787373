"""Our tuned kernels against FLA and the memory-bound floor, side by side in one run.

For every variant and shape: the same inputs go through ``tuner.ops`` with ``backend="tuner"``
(the stored winner for this GPU), FLA's op (with ``FLA_DISABLE_BACKEND_DISPATCH=1``, so FLA runs
its own Triton kernels) and ``tuner.ops`` with ``backend="auto"`` (the dispatch: FLA where a stored
baseline beats the winner, ``tuner.lookup``); all three are timed with CUDA events and an L2 flush.
The dispatch column is its time over the faster of the other two, which must stay within
:data:`DISPATCH_LIMIT` (the run exits 1 otherwise). The outputs are compared with each other
(relative L2 of the output and of the final state, for every ``tuner.ops`` function of the variant,
against the gate's tolerance) and the floor is the time to move the bytes that must move at the copy
rate measured on the H200. Prints a table and writes JSON; each row names the command that measured it.

    FLA_DISABLE_BACKEND_DISPATCH=1 TRITON_CACHE_AUTOTUNING=1 python benchmarks/vs_fla.py --json benchmarks/vs_fla.json

FLA's kernels autotune on their first call at each shape (minutes for ``chunk_gla`` and
``chunk_kda``); ``TRITON_CACHE_AUTOTUNING=1`` keeps the choices in Triton's disk cache, so a later
run on the same machine skips them. ``--merge`` puts a run's rows into an existing JSON in place of
the rows of the same variant, D, dtype and shape, so the table can be measured over several runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import torch  # noqa: E402

from tuner import best_config, ops  # noqa: E402
from tuner.bench import memory_floor_ms, time_forward  # noqa: E402
from tuner.inputs import make_inputs  # noqa: E402
from tuner.problem import Problem, parse_shape  # noqa: E402
from tuner.variants import VARIANTS  # noqa: E402

SHAPES = ((4, 8192, 16), (1, 32768, 32), (16, 2048, 32))
# What the dispatch may cost over the faster of the tuner's kernel and FLA's: timing noise, no more.
DISPATCH_LIMIT = 1.02


def fla_ops():
    """FLA 0.6.0's ops under the names ``tuner.ops`` shares with them."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gla import chunk_gla
    from fla.ops.kda import chunk_kda
    from fla.ops.linear_attn import chunk_linear_attn
    from fla.ops.retention import chunk_retention
    from fla.ops.simple_gla import chunk_simple_gla

    return types.SimpleNamespace(chunk_linear_attn=chunk_linear_attn, chunk_simple_gla=chunk_simple_gla,
                                 chunk_retention=chunk_retention, chunk_gla=chunk_gla,
                                 chunk_gated_delta_rule=chunk_gated_delta_rule, chunk_kda=chunk_kda)


def op_calls(impl, variant: str, x: dict, **options) -> dict:
    """``variant``'s ops of ``impl`` (``tuner.ops`` or FLA's) on the inputs ``x``, by name; the first
    is the anchor table's call, the one timed."""
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    return {
        "linear": {"chunk_simple_gla": lambda: impl.chunk_simple_gla(q, k, v, **options),
                   "chunk_linear_attn": lambda: impl.chunk_linear_attn(*positive_features(q, k), v, **options)},
        "decay": {"chunk_retention": lambda: impl.chunk_retention(q, k, v, **options)},
        "simple_gla": {"chunk_simple_gla": lambda: impl.chunk_simple_gla(q, k, v, g, **options)},
        "gla": {"chunk_gla": lambda: impl.chunk_gla(q, k, v, g, **options)},
        "gdn": {"chunk_gated_delta_rule": lambda: impl.chunk_gated_delta_rule(q, k, v, g, beta, **options)},
        "kda": {"chunk_kda": lambda: impl.chunk_kda(q, k, v, g, beta, **options)},
    }[variant]


def positive_features(*tensors):
    """elu + 1 (Katharopoulos et al.). Normalised linear attention divides by <q_t, sum k>: with
    signed random q, k that sum is near zero somewhere and the output is noise (FLA keeps it in
    bf16, we in fp32). Models feed it positive features; so does this check."""
    return [(torch.nn.functional.elu(t.float()) + 1).to(t.dtype) for t in tensors]


def compare(ours, fla, tolerance: float) -> dict:
    """Relative L2 of ``o`` and of the final state (ours, FLA's calls with the final state out)."""
    (o, state), (fla_o, fla_state) = ours(), fla()
    # chunk_linear_attn with normalize returns (kv state, key sum) on both sides: the worse counts.
    states = zip(state, fla_state) if isinstance(state, tuple) else [(state, fla_state)]
    errors = {"o": rel_l2(o, fla_o), "final_state": max(rel_l2(a, b) for a, b in states)}
    return {**errors, "within_tolerance": max(errors.values()) <= tolerance}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def measure(variant: str, dk: int, dtype: str, shape: tuple[int, int, int]) -> dict:
    B, T, H = shape
    problem = Problem(variant, dk, dk, dtype, B, T, H)
    x = make_inputs(problem, regime="default", seed=0, device="cuda")
    row = {"variant": variant, "dk": dk, "dv": dk, "dtype": dtype, "batch": B, "seqlen": T, "heads": H,
           "floor_ms": memory_floor_ms(problem)}
    try:
        ours, fla = op_calls(ops, variant, x, backend="tuner"), op_calls(fla_ops(), variant, x)
        with_state = (op_calls(ops, variant, x, backend="tuner", output_final_state=True),
                      op_calls(fla_ops(), variant, x, output_final_state=True))
        row["vs_fla"] = {name: compare(with_state[0][name], with_state[1][name], problem.tolerance) for name in ours}
        row["rel_l2_vs_fla"] = max(max(c["o"], c["final_state"]) for c in row["vs_fla"].values())
        row["within_tolerance"] = all(c["within_tolerance"] for c in row["vs_fla"].values())
        ours, fla = next(iter(ours.values())), next(iter(fla.values()))
        dispatch = next(iter(op_calls(ops, variant, x, backend="auto").values()))
        row["ours_ms"] = time_forward(ours).median_ms
        row["fla_ms"] = time_forward(fla).median_ms
        row["dispatch_ms"] = time_forward(dispatch).median_ms
        row["dispatch_backend"] = best_config(variant, dk, dk, dtype, B, T, H, backend="auto").backend
        row["ratio"] = row["ours_ms"] / row["fla_ms"]
        row["dispatch_vs_best"] = dispatch_vs_best(row)
        row["floor_fraction"] = row["floor_ms"] / row["ours_ms"]
    except Exception as e:  # noqa: BLE001 - one failure is a row, the run goes on
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def dispatch_vs_best(row: dict) -> float:
    """The dispatch's time over the faster of the tuner's kernel and FLA's."""
    return row["dispatch_ms"] / min(row["ours_ms"], row["fla_ms"])


def over_the_limit(rows: list[dict]) -> list[dict]:
    """The rows whose dispatch costs more than :data:`DISPATCH_LIMIT` over the faster of the two, or
    that failed to measure."""
    return [r for r in rows if "error" in r or r["dispatch_vs_best"] > DISPATCH_LIMIT]


def table(rows: list[dict]) -> str:
    head = (f"{'variant':<11}{'D':>4} {'B x T x H':<13}{'ours ms':>9}{'FLA ms':>9}{'ours/FLA':>9}{'dispatch':>9}"
            f"{'disp/best':>10}  {'runs':<6}{'floor ms':>9}{'floor/ours':>11}{'relL2':>9}  tol")
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = f"{r['batch']}x{r['seqlen']}x{r['heads']}"
        if "error" in r:
            lines.append(f"{r['variant']:<11}{r['dk']:>4} {shape:<13}  error: {r['error'][:80]}")
            continue
        # Rows measured before the dispatch column was added have none.
        dispatch = (f"{r['dispatch_ms']:>9.3f}{r['dispatch_vs_best']:>10.3f}  {r['dispatch_backend']:<6}"
                    if "dispatch_ms" in r else f"{'-':>9}{'-':>10}  {'-':<6}")
        lines.append(f"{r['variant']:<11}{r['dk']:>4} {shape:<13}{r['ours_ms']:>9.3f}{r['fla_ms']:>9.3f}"
                     f"{r['ratio']:>9.2f}{dispatch}{r['floor_ms']:>9.3f}{r['floor_fraction']:>11.2f}"
                     f"{r['rel_l2_vs_fla']:>9.1e}  {'ok' if r['within_tolerance'] else 'OVER'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all")
    p.add_argument("--dk", type=int, action="append", help="head dims (default 128)")
    p.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"))
    p.add_argument("--shape", action="append", help="BxTxH (default: the three anchor shapes)")
    p.add_argument("--json", default="benchmarks/vs_fla.json", help="where to write the rows")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows already in --json, replacing those this run measures again")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("vs_fla: needs a CUDA GPU (and FLA installed)", file=sys.stderr)
        return 2
    shapes = [parse_shape(s) for s in args.shape] if args.shape else SHAPES
    earlier = load_rows(args.json) if args.merge else []
    rows = []
    gpu, run = torch.cuda.get_device_name(), " ".join(["vs_fla.py", *(argv if argv is not None else sys.argv[1:])])
    for variant in args.variant or VARIANTS:
        for dk in args.dk or (128,):
            for shape in shapes:
                rows.append({**measure(variant, dk, args.dtype, shape), "gpu": gpu, "run": run})
                print(json.dumps(rows[-1]), flush=True)
                with open(args.json, "w") as f:  # after every row: a killed run keeps what it measured
                    json.dump(merge(earlier, rows), f, indent=1)
    print(f"\n{gpu}, {args.dtype}, forward only; FLA with FLA_DISABLE_BACKEND_DISPATCH=1")
    print(table(rows))
    over = over_the_limit(rows)
    for r in over:
        print(f"vs_fla: {r['variant']} D{r['dk']} {r['batch']}x{r['seqlen']}x{r['heads']}: "
              + (r["error"] if "error" in r else f"the dispatch is {r['dispatch_vs_best']:.3f}x the faster of ours "
                 f"and FLA (limit {DISPATCH_LIMIT})"), file=sys.stderr)
    return 1 if over else 0


def row_key(row: dict) -> tuple:
    return row["variant"], row["dk"], row["dv"], row["dtype"], row["batch"], row["seqlen"], row["heads"]


def merge(earlier: list[dict], new: list[dict]) -> list[dict]:
    """``earlier`` with the rows of ``new``'s keys replaced by ``new``'s, ordered as the README's
    table: D (larger first), shape (the anchor shapes first), variant (as the registry lists them)."""
    by_key = {row_key(r): r for r in earlier} | {row_key(r): r for r in new}
    order = {v: i for i, v in enumerate(VARIANTS)}
    shapes = {s: i for i, s in enumerate(SHAPES)}
    return sorted(by_key.values(), key=lambda r: (-r["dk"], shapes.get((r["batch"], r["seqlen"], r["heads"]), len(shapes)),
                                                  order[r["variant"]]))


def load_rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return []


if __name__ == "__main__":
    sys.exit(main())
