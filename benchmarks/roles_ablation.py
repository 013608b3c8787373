"""Where gdn's role-split sequential kernel (sequential_roles) spends its time: the kernel as rendered,
and with parts of its output role cut out of the rendered source (those runs time only; their o is
wrong), beside the one-warpgroup kernel, per kernel with CUDA events.

    python benchmarks/roles_ablation.py [--dk 128] [--shape 4x8192x16]

If the output role cut to its waits leaves the sequential time where it was, the chain of the state
and new-values roles limits the kernel, not the output.
"""
from __future__ import annotations

import argparse
import sys

import torch

from kernel_breakdown import per_kernel_ms
from roles_timeline import ROLES as VARIANT_ROLES
from tuner import space
from tuner.candidate import Candidate
from tuner.compile import load_kernels
from tuner.inputs import make_inputs
from tuner.problem import Problem, parse_shape

ROLES = VARIANT_ROLES["gdn"]
O_STORE = ("for i, j in T.Parallel(C, BLOCK_DV):\n                        O_s[i, j] = acc_o[i, j] * scale\n"
           "                    T.copy(O_s, O[bb, c * C:(c + 1) * C, bh, dv0:dv0 + BLOCK_DV])")
SCORES = ("for i, j in T.Parallel(C, C):\n                        Attn_s[i, j] = T.if_then_else(j <= i, QK[i, j] * "
          "T.exp2((gc_s[s, i] - gc_s[s, j]) * LOG2E), 0.0)")
QK = "T.gemm(Q_s[s, :, :], K_s[s, :, :], QK, transpose_B=True, clear_accum=True)"
# name -> (config overrides, statements of the rendered source replaced by `pass`)
FORMS = {
    "roles, 2 buffers": (ROLES, ()),
    "roles, 3 buffers": ({**ROLES, "num_stages": 3}, ()),
    "roles, o by the store warp": ({**ROLES, "o_store": "store_warp"}, ()),
    "roles, no o store": (ROLES, (O_STORE,)),
    "roles, no scores": (ROLES, (SCORES,)),
    "roles, output only waits": (ROLES, (SCORES, O_STORE, QK)),
    "one warpgroup, block_dv 32": ({"split": "pre_seq", "solve": "merged", "block_dv": 32}, ()),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--shape", default="4x8192x16", help="BxTxH (default 4x8192x16)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("roles_ablation: needs a CUDA GPU", file=sys.stderr)
        return 2
    batch, seqlen, heads = parse_shape(args.shape)
    problem = Problem("gdn", args.dk, args.dk, batch=batch, seqlen=seqlen, heads=heads)
    x = make_inputs(problem, "default", 0, torch.device("cuda"))
    for name, (overrides, cut) in FORMS.items():
        config = space.load("gdn").complete(problem, overrides)
        source = Candidate.from_config(problem, config).source
        for statement in cut:
            if statement not in source:
                raise SystemExit(f"roles_ablation: the rendered kernel no longer has {statement.splitlines()[0]!r}")
            source = source.replace(statement, "pass")
        ms = per_kernel_ms(*load_kernels(Candidate(problem, config, source)), x)
        print(f"{name:<28}" + "  ".join(f"{k} {v:.3f} ms" for k, v in ms.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
