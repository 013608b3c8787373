"""Where one step of a role-split sequential kernel (gdn's or kda's sequential_roles) goes, role by role: the
rendered kernel with an SM clock stamp (clock64) before and after every statement of each role's
chunk loop, read for one block, as mean cycles per statement over the middle chunks and as the
moment each role reaches each statement, relative to the state role's start of the same chunk.

    python benchmarks/roles_timeline.py [--variant gdn] [--dk 128] [--shape 4x8192x16] [--set num_stages=3 ...]

The stamps are written by one thread of each role of block (0, 0); the other blocks run as rendered,
so the SM is as busy as in the real run. A stamp costs a few cycles; the step's total is compared
with the unstamped kernel's time (CUDA events) in the same run.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from kernel_breakdown import per_kernel_ms, starting_config
from tuner.candidate import Candidate
from tuner.cli import parse_overrides
from tuner.compile import load_kernels
from tuner.errors import UserError
from tuner.inputs import make_inputs
from tuner.problem import Problem, parse_shape

# Each variant's role-split config, the one timed unless --set says otherwise.
ROLES = {"gdn": {"split": "pre_seq", "solve": "merged", "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                 "gc_loads": "once", "fast_math": True},
         "kda": {"split": "pre_seq", "block_dv": 64, "sequential_roles": True, "num_stages": 2}}
# The roles' chunk loops in the order rendered: four, then those of the producer warpgroup's other warps
# where the kernel has them (o_store=store_warp, gc_loads=gate_warp), each known by its comment.
ROLE_NAMES = ("state", "values", "output", "producer")
WARP_ROLES = (("store", "# The store warp:"), ("gate", "# The gate warp:"))
# The thread of each role that stamps: the first of each warpgroup, and the first of the producer
# warpgroup's second and third warps (tx 416 and 448).
STAMPING_THREADS = "(tx % 128 == 0 or tx == 416 or tx == 448)"
CHUNK_LOOP = "for c in T.serial(chunks):"
STAMPS_ARG = "STAMPS"
# forward's launch of the sequential kernel, its operands before the scale.
SEQUENTIAL_CALL = re.compile(r'kernels\["sequential"\]\((.*), scale\)')


def _statements(lines: list[str], start: int, indent: str) -> list[tuple[int, int]]:
    """(first, end) line ranges of the statements of the block whose first line is ``start``, all
    indented by ``indent``: a statement runs until the next code line at that indentation."""
    firsts, end = [], start
    for i in range(start, len(lines)):
        line = lines[i]
        if line.strip() and not line.startswith(indent):
            break
        end = i + 1
        if line.startswith(indent) and line[len(indent)] not in " #)]}" and not line.strip().startswith(("else", "elif")):
            firsts.append(i)
    return list(zip(firsts, firsts[1:] + [end]))


def stamp_loops(source: str, loops: list[int], guard: str, buffer: str,
                counter: str | None = None, unstamped: str | None = None) -> tuple[str, list[list[str]]]:
    """``source`` with ``buffer[loop, c, k] = clock64`` (under ``guard``) before statement k of each
    loop's body and after its last, for the blocks whose header is at line index ``loops``; and per
    loop the labels of its statements (statement k runs between stamps k and k + 1). ``c`` is
    ``counter``, by default each header's loop variable (``for c in ...``); statements that match the
    regular expression ``unstamped`` get no stamp of their own (their time falls to the one before)."""
    lines = source.splitlines()
    labels: list[list[str]] = []
    inserts: dict[int, list[str]] = {}
    for loop_id, loop in enumerate(loops):
        body_indent = re.match(r"\s*", lines[loop + 1]).group(0)
        ranges = [(first, end) for first, end in _statements(lines, loop + 1, body_indent)
                  if not (unstamped and re.match(unstamped, lines[first].strip()))]
        index = counter or lines[loop].split()[1]
        stamp = (f"{body_indent}if {guard}:\n"
                 f"{body_indent}    {buffer}[{loop_id}, {index}, {{point}}] = T.call_extern(\"int64\", \"clock64\")")
        labels.append([lines[first].strip() for first, _ in ranges])
        for point, (first, _) in enumerate(ranges):
            inserts.setdefault(first, []).append(stamp.format(point=point))
        inserts.setdefault(ranges[-1][1], []).append(stamp.format(point=len(ranges)))
    out = []
    for i, line in enumerate(lines + [""]):
        out.extend(inserts.get(i, []))
        if i < len(lines):
            out.append(line)
    return "\n".join(out) + "\n", labels


def role_names(source: str) -> list[str]:
    """The roles of the rendered role-split module's chunk loops, in their order."""
    return [*ROLE_NAMES, *(name for name, comment in WARP_ROLES if comment in source)]


def instrument(source: str) -> tuple[str, list[list[str]]]:
    """The rendered role-split module with stamps in each role's chunk loop (``stamp_loops``), the
    stamp buffer as the sequential kernel's last argument, passed by ``forward`` from the module's
    global ``STAMPS``; and per role the labels of its statements."""
    loops = [i for i, line in enumerate(source.splitlines()) if line.strip() == CHUNK_LOOP]
    roles = len(role_names(source))
    if len(loops) != roles:
        raise SystemExit(f"roles_timeline: expected {roles} chunk loops, found {len(loops)}")
    text, labels = stamp_loops(source, loops, f"bbh == 0 and bv == 0 and {STAMPING_THREADS}", STAMPS_ARG)
    points = max(len(role_labels) for role_labels in labels) + 1
    signature = "        scale: T.float32,\n    ):\n        with T.Kernel(T.ceildiv(DV, BLOCK_DV), B * H, threads=ROLE_THREADS)"
    call = SEQUENTIAL_CALL.search(text)
    if signature not in text or call is None:
        raise SystemExit("roles_timeline: the rendered kernel's signature or its call changed")
    text = text.replace(signature, signature.replace(
        "\n    ):", f"\n        {STAMPS_ARG}: T.Tensor([{roles}, T.ceildiv(S, C), {points}], \"int64\"),\n    ):"))
    text = text.replace(call.group(0), f"{STAMPS_ARG}.zero_()\n    {call.group(0)[:-1]}, {STAMPS_ARG})")
    return text, labels


def report(stamps: torch.Tensor, labels: list[list[str]], names, reference: int = 0) -> None:
    """Per loop, mean cycles in each statement over the middle half of the iterations, and when it
    was reached, relative to the start of the same iteration of loop ``reference``."""
    t = stamps.cpu().double()
    iters = t.shape[1]
    middle = slice(iters // 4, iters - iters // 4)
    step = (t[reference, middle.start + 1:middle.stop, 0] - t[reference, middle.start:middle.stop - 1, 0]).mean().item()
    print(f"one iteration of the {names[reference]} loop: {step:.0f} cycles (iterations {middle.start}..{middle.stop - 1})")
    origin = t[reference, middle, 0]
    for loop, name in enumerate(names):
        print(f"\n{name}: cycles in each statement | reached at (cycles after the {names[reference]} loop began the iteration)")
        for point, label in enumerate(labels[loop]):
            spent = (t[loop, middle, point + 1] - t[loop, middle, point]).mean().item()
            at = (t[loop, middle, point] - origin).mean().item()
            print(f"  {spent:8.0f} | {at:8.0f}  {label[:100]}")


def time_stamped(plain: Candidate, source: str, kernel: str, stamps_shape: tuple[int, ...]):
    """The program ``kernel`` of ``plain`` timed as rendered and as ``source`` (its stamped form, whose
    forward passes the module's ``STAMPS``), both on one set of inputs (CUDA events): (rendered ms,
    stamped ms, the stamps of the last run), or None without a GPU, having printed ``source``."""
    if not torch.cuda.is_available():
        print(source)
        print(f"{Path(sys.argv[0]).stem}: needs a CUDA GPU to run; the instrumented source is printed", file=sys.stderr)
        return None
    x = make_inputs(plain.problem, "default", 0, torch.device("cuda"))
    plain_ms = per_kernel_ms(*load_kernels(plain), x)[kernel]
    module, kernels = load_kernels(Candidate(plain.problem, plain.config, source))
    stamps = torch.zeros(*stamps_shape, dtype=torch.int64, device="cuda")
    setattr(module, STAMPS_ARG, stamps)
    return plain_ms, per_kernel_ms(module, kernels, x)[kernel], stamps


def rendered_from_arguments(argv, description: str, configs: dict, default: str, set_help: str):
    """The candidate that ``--variant`` (one of ``configs``), ``--dk``, ``--shape`` and ``--set`` in ``argv``
    name (the variant's config ``configs[variant]`` with the --set values), and its number of chunks."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--variant", choices=sorted(configs), default=default)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--shape", default="4x8192x16", help="BxTxH (default 4x8192x16)")
    p.add_argument("--stored", action="store_true",
                   help="start from the winner stored for this GPU at the shape instead of this script's config")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help=set_help)
    args = p.parse_args(argv)
    batch, seqlen, heads = parse_shape(args.shape)
    problem = Problem(args.variant, args.dk, args.dk, batch=batch, seqlen=seqlen, heads=heads)
    try:
        config = starting_config(problem, parse_overrides(args.set), args.stored, start=configs[args.variant])
    except UserError as e:
        raise SystemExit(f"{p.prog}: {e}") from None
    return Candidate.from_config(problem, config), -(-seqlen // config["chunk_size"])


def main(argv=None) -> int:
    plain, chunks = rendered_from_arguments(argv, __doc__.splitlines()[0], ROLES, "gdn",
                                            "a parameter of the role-split config (default: ROLES[variant] in this file)")
    source, labels = instrument(plain.source)
    timed = time_stamped(plain, source, "sequential", (len(labels), chunks, max(len(r) for r in labels) + 1))
    if timed is None:
        return 2
    plain_ms, stamped_ms, stamps = timed
    print(f"config {plain.config}")
    print(f"sequential kernel: {plain_ms:.3f} ms as rendered, {stamped_ms:.3f} ms stamped; {chunks} chunks")
    report(stamps, labels, [f"{name} role" for name in role_names(plain.source)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
