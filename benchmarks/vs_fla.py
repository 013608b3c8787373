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

    FLA_DISABLE_BACKEND_DISPATCH=1 python benchmarks/vs_fla.py --json benchmarks/vs_fla.json

The variants of :data:`PACKED_VARIANTS` also get packed rows (``--packed TxHV``): sequences of the
correctness gate's ``packed`` regime (``tuner.inputs.timing_inputs``, a fixed seed, so every run times
the same mix of lengths) packed into one row of T tokens (B = 1, ``cu_seqlens``), HV value heads (gdn's
and kda's grouped two to a query/key head), one initial state per sequence; ours, FLA and the dispatch
all get the same ``cu_seqlens``. Their shape reads ``packed NxT H<H>/HV<HV>`` (N sequences), apart from
the dense rows.

gdn's dense rows at D 128 also time FlashQLA (``flash_qla.chunk_gated_delta_rule``, a hand-written
TileLang GDN forward, with its defaults: its own sequence splitting on) where it is installed
(``flashqla_ms``; it takes only K = 128), with its output's relative L2 against FLA's.

FLA is timed autotuned at each row's problem, as its stored baselines are: before a row, FLA's kernels
forget the configs they chose (``tuner.baseline.autotune_fla_at``; their autotune keys leave out
batch, length and head dims, so they would run the configs of the first shape met), and the row's first
FLA call autotunes there (seconds to minutes for ``chunk_gla`` and ``chunk_kda``), or loads the choice
that the baseline's timing of the same problem made on this machine, so the row times FLA with the
configs its stored baseline was timed with; the dispatch column runs FLA with them too. Ours, FLA and the
dispatch are timed in interleaved rounds (``tuner.bench.time_side_by_side``), so the machine's drift during
a row falls on all three alike. ``--merge`` puts a run's rows into an existing JSON in place of
the rows of the same variant, D, dtype and shape, so the table can be measured over several runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import torch  # noqa: E402

from tuner import best_config, ops  # noqa: E402
from tuner.baseline import autotune_fla_at, problem_label  # noqa: E402
from tuner.bench import inputs_floor_ms, memory_floor_ms, time_forward, time_side_by_side  # noqa: E402
from tuner.inputs import timing_inputs  # noqa: E402
from tuner.problem import Problem, parse_shape  # noqa: E402
from tuner.variants import VARIANTS  # noqa: E402

SHAPES = ((4, 8192, 16), (1, 32768, 32), (16, 2048, 32))
# Packed rows by default: (total tokens, value heads), the query/key heads half as many.
PACKED_SHAPES = ((32768, 32),)
# The variants whose tuner.ops take packed sequences (cu_seqlens; gdn and kda with grouped value heads).
# Not linear: its second op, chunk_linear_attn with its default normalize, refuses them (the normaliser's
# running sum would cross the sequences).
PACKED_VARIANTS = ("decay", "simple_gla", "gla", "gdn", "kda")
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
    is the anchor table's call, the one timed. Packed inputs (``cu_seqlens`` in ``x``) go in with their
    ``cu_seqlens`` and initial states."""
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    if "cu_seqlens" in x:
        options = {"initial_state": x["initial_state"], "cu_seqlens": x["cu_seqlens"], **options}
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


def dense_inputs(variant: str, dk: int, dtype: str, shape: tuple[int, int, int]) -> tuple[Problem, dict, dict]:
    """The problem at ``shape`` (B, T, H), its inputs on the GPU and the start of its row."""
    B, T, H = shape
    problem = Problem(variant, dk, dk, dtype, B, T, H)
    x = timing_inputs(problem, device="cuda")
    return problem, x, {"variant": variant, "dk": dk, "dv": dk, "dtype": dtype, "batch": B, "seqlen": T, "heads": H,
                        "floor_ms": memory_floor_ms(problem)}


def packed_inputs(variant: str, dk: int, dtype: str, shape: tuple[int, int]) -> tuple[Problem, dict, dict]:
    """The packed problem at ``shape`` (total tokens T, value heads HV), its inputs and the start of its row.

    The problem is ``1 x T x HV`` packed, as ``tuner.ops`` looks packed calls up and the tuner times
    them (``tuner.inputs.timing_inputs``): the gate's ``packed`` regime at seed 0, the same lengths every
    run (``tuner.inputs.packed_lengths``), q and k with HV / 2 heads for gdn and kda (grouped value
    heads), HV for the others, an initial state per sequence.
    """
    T, HV = shape
    problem = Problem(variant, dk, dk, dtype, 1, T, HV, packed=True)
    x = timing_inputs(problem, device="cuda")
    return problem, x, {"variant": variant, "dk": dk, "dv": dk, "dtype": dtype, "batch": 1, "seqlen": T, "heads": HV,
                        "qk_heads": x["q"].shape[2], "sequences": x["cu_seqlens"].shape[0] - 1,
                        "floor_ms": inputs_floor_ms(x)}


def measure(variant: str, dk: int, dtype: str, shape: tuple, packed: bool = False) -> dict:
    """One row: ``shape`` is (B, T, H), or (T, HV) where ``packed``. ``seconds``: how long the row took
    (inputs, compiles or cache loads, FLA's autotune, the comparisons and the three timings)."""
    start = time.perf_counter()
    problem, x, row = (packed_inputs if packed else dense_inputs)(variant, dk, dtype, shape)
    try:
        ours, fla = op_calls(ops, variant, x, backend="tuner"), op_calls(fla_ops(), variant, x)
        autotune_fla_at(problem_label(problem))
        with_state = (op_calls(ops, variant, x, backend="tuner", output_final_state=True),
                      op_calls(fla_ops(), variant, x, output_final_state=True))
        row["vs_fla"] = {name: compare(with_state[0][name], with_state[1][name], problem.tolerance) for name in ours}
        row["rel_l2_vs_fla"] = max(max(c["o"], c["final_state"]) for c in row["vs_fla"].values())
        row["within_tolerance"] = all(c["within_tolerance"] for c in row["vs_fla"].values())
        ours, fla = next(iter(ours.values())), next(iter(fla.values()))
        dispatch = next(iter(op_calls(ops, variant, x, backend="auto").values()))
        # Interleaved rounds: the three are compared with each other, so the run's drift falls on all.
        for name, timing in time_side_by_side({"ours": ours, "fla": fla, "dispatch": dispatch}).items():
            row[f"{name}_ms"] = timing.median_ms
            # The spread says whether a row's ratio is the kernels' or the run's noise.
            row[f"{name}_p10_p90_ms"] = [timing.p10_ms, timing.p90_ms]
        if variant == "gdn" and dk == 128 and not packed:
            row.update(flashqla_columns(x, fla, problem.tolerance))
        row["dispatch_backend"] = best_config(variant, dk, dk, dtype, problem.batch, problem.seqlen, problem.heads,
                                              backend="auto", packed=packed).backend
        row["ratio"] = row["ours_ms"] / row["fla_ms"]
        row["dispatch_vs_best"] = dispatch_vs_best(row)
        row["floor_fraction"] = row["floor_ms"] / row["ours_ms"]
    except Exception as e:  # noqa: BLE001 - one failure is a row, the run goes on
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def flashqla_columns(x: dict, fla, tolerance: float) -> dict:
    """FlashQLA's time on the row's inputs and its output's relative L2 against FLA's (``fla``: FLA's
    timed call); nothing where FlashQLA is not installed, its error where it fails."""
    try:
        from flash_qla import chunk_gated_delta_rule
    except ImportError:
        return {}
    try:
        def call():
            return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"])

        rel = rel_l2(call()[0], fla()[0])
        timing = time_forward(call)
    except Exception as e:  # noqa: BLE001 - FlashQLA's failure is a column of the row, not the row's
        return {"flashqla_error": f"{type(e).__name__}: {e}"[:300]}
    return {"flashqla_ms": timing.median_ms, "flashqla_p10_p90_ms": [timing.p10_ms, timing.p90_ms],
            "flashqla_rel_l2_vs_fla": rel, "flashqla_within_tolerance": rel <= tolerance}


def dispatch_vs_best(row: dict) -> float:
    """The dispatch's time over the faster of the tuner's kernel and FLA's."""
    return row["dispatch_ms"] / min(row["ours_ms"], row["fla_ms"])


def over_the_limit(rows: list[dict]) -> list[dict]:
    """The rows whose dispatch costs more than :data:`DISPATCH_LIMIT` over the faster of the two, or
    that failed to measure."""
    return [r for r in rows if "error" in r or r["dispatch_vs_best"] > DISPATCH_LIMIT]


def shape_label(row: dict) -> str:
    """``BxTxH``, or ``packed NxT H<H>/HV<HV>`` for a packed row (N sequences of T tokens in all)."""
    if "sequences" in row:
        return f"packed {row['sequences']}x{row['seqlen']} H{row['qk_heads']}/HV{row['heads']}"
    return f"{row['batch']}x{row['seqlen']}x{row['heads']}"


def table(rows: list[dict]) -> str:
    head = (f"{'variant':<11}{'D':>4} {'shape':<26}{'ours ms':>9}{'FLA ms':>9}{'ours/FLA':>9}{'dispatch':>9}"
            f"{'disp/best':>10}  {'runs':<6}{'floor ms':>9}{'floor/ours':>11}{'relL2':>9}  tol")
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = shape_label(r)
        if "error" in r:
            lines.append(f"{r['variant']:<11}{r['dk']:>4} {shape:<26}  error: {r['error'][:80]}")
            continue
        # Rows measured before the dispatch column was added have none.
        dispatch = (f"{r['dispatch_ms']:>9.3f}{r['dispatch_vs_best']:>10.3f}  {r['dispatch_backend']:<6}"
                    if "dispatch_ms" in r else f"{'-':>9}{'-':>10}  {'-':<6}")
        lines.append(f"{r['variant']:<11}{r['dk']:>4} {shape:<26}{r['ours_ms']:>9.3f}{r['fla_ms']:>9.3f}"
                     f"{r['ratio']:>9.2f}{dispatch}{r['floor_ms']:>9.3f}{r['floor_fraction']:>11.2f}"
                     f"{r['rel_l2_vs_fla']:>9.1e}  {'ok' if r['within_tolerance'] else 'OVER'}")
    flashqla = [r for r in rows if "flashqla_ms" in r or "flashqla_error" in r]
    if flashqla:
        lines += ["", f"{'FlashQLA (gdn D 128)':<31}{'ours ms':>9}{'FlashQLA':>9}{'ours/FQLA':>10}{'relL2 vs FLA':>13}"]
        for r in flashqla:
            if "flashqla_error" in r:
                lines.append(f"{shape_label(r):<31}  error: {r['flashqla_error'][:80]}")
            elif "ours_ms" in r:
                lines.append(f"{shape_label(r):<31}{r['ours_ms']:>9.3f}{r['flashqla_ms']:>9.3f}"
                             f"{r['ours_ms'] / r['flashqla_ms']:>10.2f}{r['flashqla_rel_l2_vs_fla']:>13.1e}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all")
    p.add_argument("--dk", type=int, action="append", help="head dims (default 128)")
    p.add_argument("--dtype", default="bf16", choices=("fp16", "bf16"))
    p.add_argument("--shape", action="append",
                   help="BxTxH (default, with no --packed either: the three anchor shapes)")
    p.add_argument("--packed", action="append", type=parse_packed, metavar="TxHV",
                   help="packed sequences of T tokens in all with HV value heads, for "
                        f"{', '.join(PACKED_VARIANTS)} (default, with no --shape either: "
                        f"{', '.join(f'{t}x{hv}' for t, hv in PACKED_SHAPES)})")
    p.add_argument("--json", default="benchmarks/vs_fla.json", help="where to write the rows")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows already in --json, replacing those this run measures again")
    args = p.parse_args(argv)
    if args.packed and not set(args.variant or VARIANTS) & set(PACKED_VARIANTS):
        p.error(f"--packed is for {', '.join(PACKED_VARIANTS)}, none of the variants asked for")
    return args


def parse_packed(text: str) -> tuple[int, int]:
    """``TxHV`` (e.g. ``32768x32``) as (total tokens, value heads)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a packed shape is TxHV with positive integers, e.g. 32768x32; got {text!r}")
    return int(parts[0]), int(parts[1])


def planned(args: argparse.Namespace) -> list[tuple[str, int, tuple, bool]]:
    """(variant, D, shape, packed) of each row to measure, in order. Without --shape and --packed: the
    anchor shapes and :data:`PACKED_SHAPES`; with either, just what was asked. Packed rows are for
    :data:`PACKED_VARIANTS` only."""
    if args.shape or args.packed:
        dense, packed = [parse_shape(s) for s in args.shape or ()], args.packed or []
    else:
        dense, packed = SHAPES, PACKED_SHAPES
    rows = []
    for variant in args.variant or VARIANTS:
        for dk in args.dk or (128,):
            rows += [(variant, dk, shape, False) for shape in dense]
            if variant in PACKED_VARIANTS:
                rows += [(variant, dk, shape, True) for shape in packed]
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("vs_fla: needs a CUDA GPU (and FLA installed)", file=sys.stderr)
        return 2
    earlier = load_rows(args.json) if args.merge else []
    rows = []
    gpu, run = torch.cuda.get_device_name(), " ".join(["vs_fla.py", *(argv if argv is not None else sys.argv[1:])])
    for variant, dk, shape, packed in planned(args):
        rows.append({**measure(variant, dk, args.dtype, shape, packed), "gpu": gpu, "run": run})
        print(json.dumps(rows[-1]), flush=True)
        with open(args.json, "w") as f:  # after every row: a killed run keeps what it measured
            json.dump(merge(earlier, rows), f, indent=1)
    print(f"\n{gpu}, {args.dtype}, forward only; FLA with FLA_DISABLE_BACKEND_DISPATCH=1")
    print(table(rows))
    over = over_the_limit(rows)
    for r in over:
        print(f"vs_fla: {r['variant']} D{r['dk']} {shape_label(r)}: "
              + (r["error"] if "error" in r else f"the dispatch is {r['dispatch_vs_best']:.3f}x the faster of ours "
                 f"and FLA (limit {DISPATCH_LIMIT})"), file=sys.stderr)
    return 1 if over else 0


def row_key(row: dict) -> tuple:
    # The shape's label, not B, T, H: a packed row is 1 x T x HV, as a dense row of that shape is.
    return row["variant"], row["dk"], row["dv"], row["dtype"], shape_label(row)


def merge(earlier: list[dict], new: list[dict]) -> list[dict]:
    """``earlier`` with the rows of ``new``'s keys replaced by ``new``'s, ordered as the README's
    table: D (larger first), shape (the anchor shapes first), variant (as the registry lists them)."""
    by_key = {row_key(r): r for r in earlier} | {row_key(r): r for r in new}
    order = {v: i for i, v in enumerate(VARIANTS)}
    shapes = {f"{b}x{t}x{h}": i for i, (b, t, h) in enumerate(SHAPES)}
    return sorted(by_key.values(),
                  key=lambda r: (-r["dk"], shapes.get(shape_label(r), len(shapes)), order[r["variant"]]))


def load_rows(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return []


if __name__ == "__main__":
    sys.exit(main())
