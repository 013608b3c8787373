"""Decode steps: our recurrent kernels against FLA's ``fused_recurrent_*`` and the state's memory floor.

One decode step (T = 1, or --seqlen tokens per sequence) at B = 1, 8, 64, 256, 1024 sequences, H = 16
heads, K = V = 128, bf16 q/k/v, fp32 gates, beta and states. Each row times, with CUDA events and an
L2 flush (``tuner.bench.time_forward``):

- ``ours_pool_ms``: ``tuner.ops.fused_recurrent_*`` in the pool form (``ssm_state_indices`` over a pool
  of B slots, updated in place), what a server calls;
- ``ours_ms``: the same op in FLA's form (``initial_state`` read, a new final state written);
- ``fla_ms``: FLA's op in FLA's form, run in a child process per row (a kernel that faults, as FLA's
  gdn was seen to at B = 64, ends its child and is recorded as ``fla_error``, not the run);
- ``floor_ms``: the bytes the step must move (every state read and written once, plus q, k, v, g,
  beta and o) at the H200's copy rate (``tuner.bench.memory_floor_ms``).

The outputs are compared with FLA's: ``rel_o`` over all of o, ``rel_state`` over the first 8 sequences'
final states. Prints a table and writes JSON; each row names the command that measured it.

    FLA_DISABLE_BACKEND_DISPATCH=1 PYTHONPATH=$PWD python benchmarks/decode_vs_fla.py --json benchmarks/decode_vs_fla.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import torch  # noqa: E402

BATCHES = (1, 8, 64, 256, 1024)
HEADS, DIM = 16, 128
COMPARED_STATES = 8
# FLA's fused_recurrent op of each variant, and how our inputs map onto its arguments.
FLA_OPS = {
    "gdn": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule", lambda x: dict(g=x["g"], beta=x["beta"])),
    "kda": ("fla.ops.kda", "fused_recurrent_kda", lambda x: dict(g=x["g"], beta=x["beta"])),
    "simple_gla": ("fla.ops.simple_gla", "fused_recurrent_simple_gla", lambda x: dict(g=x["g"])),
    "gla": ("fla.ops.gla", "fused_recurrent_gla", lambda x: dict(gk=x["g"])),
    "decay": ("fla.ops.retention", "fused_recurrent_retention", lambda x: {}),
    "linear": ("fla.ops.linear_attn", "fused_recurrent_linear_attn", lambda x: {}),
}
GATE = {"gdn": "token", "kda": "channel", "simple_gla": "token", "gla": "channel", "decay": None, "linear": None}


def inputs(variant: str, batch: int, seqlen: int, seed: int = 0) -> dict:
    """The same inputs in every process (a seeded CUDA generator): q, k (L2-normalised), v in bf16; the
    log decay (in [log 0.9, 0]), beta (in (0, 1)) and the initial states in fp32."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    shape = (batch, seqlen, HEADS)
    q = randn(*shape, DIM).bfloat16()
    k = torch.nn.functional.normalize(randn(*shape, DIM), dim=-1).bfloat16()
    v = randn(*shape, DIM).bfloat16()
    gate = {None: None, "token": shape, "channel": (*shape, DIM)}[GATE[variant]]
    g = None if gate is None else torch.rand(*gate, generator=gen, device="cuda") * math.log(0.9)
    beta = torch.rand(*shape, generator=gen, device="cuda") if variant in ("gdn", "kda") else None
    h0 = randn(batch, HEADS, DIM, DIM) * 0.1
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0)


def fla_call(variant: str, x: dict):
    module, name, extra = FLA_OPS[variant]
    op = getattr(__import__(module, fromlist=[name]), name)
    return lambda: op(x["q"], x["k"], x["v"], **extra(x), initial_state=x["h0"], output_final_state=True)


def our_calls(variant: str, x: dict) -> tuple:
    """(FLA's form, the pool form) through ``tuner.ops``."""
    from tuner import ops

    name = FLA_OPS[variant][1]
    op = getattr(ops, name)
    q, k, v = x["q"], x["k"], x["v"]
    extra = FLA_OPS[variant][2](x)
    slots = torch.arange(q.shape[0], dtype=torch.int32, device="cuda")
    pool = x["h0"].clone()
    out = torch.empty_like(v)
    fla_form = lambda: op(q, k, v, **extra, initial_state=x["h0"], output_final_state=True)  # noqa: E731
    pool_form = lambda: op(q, k, v, **extra, initial_state=pool, ssm_state_indices=slots, out=out)  # noqa: E731
    return fla_form, pool_form


def fla_child(variant: str, batch: int, seqlen: int, result_path: str) -> int:
    """Time FLA's op at one shape; save its output and the first states for the comparison."""
    from tuner.bench import time_forward

    x = inputs(variant, batch, seqlen)
    call = fla_call(variant, x)
    o, ht = call()
    timing = time_forward(call)
    torch.save(dict(o=o.cpu(), ht=ht[:COMPARED_STATES].cpu(), fla_ms=timing.median_ms), result_path)
    return 0


def rel_l2(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def measure(variant: str, batch: int, seqlen: int, command: str) -> dict:
    from tuner.bench import memory_floor_ms, time_forward
    from tuner.decode import kernel_for
    from tuner.problem import Problem
    from tuner.variants import recurrent_name

    x = inputs(variant, batch, seqlen)
    fla_form, pool_form = our_calls(variant, x)
    o, ht = fla_form()
    ours = time_forward(fla_form).median_ms
    ours_pool = time_forward(pool_form).median_ms
    problem = Problem(recurrent_name(variant), DIM, DIM, "bf16", batch, seqlen, HEADS)
    row = dict(variant=variant, batch=batch, seqlen=seqlen, heads=HEADS, dk=DIM, dv=DIM, dtype="bf16",
               ours_ms=ours, ours_pool_ms=ours_pool,
               floor_ms=memory_floor_ms(problem, initial_state=True),
               config=kernel_for(variant, DIM, DIM, "bf16", batch, batch * seqlen, HEADS, "kv", 0)[2],
               command=command)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "fla.pt")
        child = subprocess.run([sys.executable, __file__, "--fla-child", variant, str(batch), str(seqlen), path],
                               capture_output=True, text=True, timeout=240)
        if child.returncode != 0 or not os.path.exists(path):
            row["fla_error"] = (child.stderr or child.stdout).strip()[-600:]
            return row
        fla = torch.load(path)
    row.update(fla_ms=fla["fla_ms"], rel_o=rel_l2(o.cpu(), fla["o"]),
               rel_state=rel_l2(ht[:COMPARED_STATES].cpu(), fla["ht"]))
    return row


def table(rows: list[dict]) -> str:
    lines = ["| variant | B x T x H | ours pool (ms) | ours (ms) | FLA (ms) | ours / FLA | floor (ms) | floor / ours pool "
             "| rel. L2 o, state vs FLA |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fla = f"{r['fla_ms']:.4f}" if "fla_ms" in r else "failed"
        ratio = f"{r['ours_ms'] / r['fla_ms']:.2f}" if "fla_ms" in r else "-"
        rel = f"{r['rel_o']:.1e}, {r['rel_state']:.1e}" if "fla_ms" in r else "-"
        lines.append(f"| {r['variant']} | {r['batch']}x{r['seqlen']}x{r['heads']} | {r['ours_pool_ms']:.4f} | "
                     f"{r['ours_ms']:.4f} | {fla} | {ratio} | {r['floor_ms']:.4f} | "
                     f"{r['floor_ms'] / r['ours_pool_ms']:.2f} | {rel} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--fla-child"]:
        variant, batch, seqlen, path = argv[1:]
        return fla_child(variant, int(batch), int(seqlen), path)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", choices=list(FLA_OPS), help="default: gdn, kda, simple_gla")
    p.add_argument("--batch", type=int, action="append", help=f"default: {', '.join(map(str, BATCHES))}")
    p.add_argument("--seqlen", type=int, default=1, help="tokens per sequence in the step. Default: 1")
    p.add_argument("--json", default="benchmarks/decode_vs_fla.json", help="where to write the rows")
    args = p.parse_args(argv)
    command = "FLA_DISABLE_BACKEND_DISPATCH=1 PYTHONPATH=$PWD python benchmarks/decode_vs_fla.py " + " ".join(argv)
    rows = []
    for variant in args.variant or ("gdn", "kda", "simple_gla"):
        for batch in args.batch or BATCHES:
            rows.append(measure(variant, batch, args.seqlen, command))
            print(json.dumps(rows[-1]), flush=True)
            with open(args.json, "w") as f:  # after every row: a killed run keeps what it measured
                json.dump(rows, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
