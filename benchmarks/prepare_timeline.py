"""Where a pre_seq precompute kernel's time goes, statement by statement: the rendered kernel with an SM
clock stamp (clock64) before and after every statement of its body, written by thread 0 of each block
of the first head and batch, printed as mean cycles per statement over those blocks.

    python benchmarks/prepare_timeline.py [--variant kda] [--dk 128] [--shape 4x8192x16] [--set score_rows=sub_chunk ...]

The other blocks run as rendered, so the SM holds as many blocks as in the real run and the cycles
include the time the block waits for the issue slots its neighbours take. Thread 0 stamps when it
reaches a statement; TileLang synchronises the block between dependent statements, so a statement's
cycles are the block's. The stamped kernel's time is printed beside the unstamped one's (CUDA events).
One block per (chunk, head), dense batches: ``prepare_chunks`` 1, not packed.
"""
from __future__ import annotations

import re
import sys

import torch

from roles_timeline import STAMPS_ARG, rendered_from_arguments, stamp_loops, time_stamped

# The variants with a pre_seq precompute kernel, and the config each starts from (--set changes it).
VARIANTS = {"gdn": {"split": "pre_seq"}, "gla": {"split": "pre_seq"}, "kda": {"split": "pre_seq"}}
# The precompute kernel's block: one chunk c of head bh in batch bb (either grid order: prepare_grid).
HEADER = re.compile(r"^(\s*)with T\.Kernel\((?:T\.ceildiv\(S, C(?: \* 1)?\), H|H, T\.ceildiv\(S, C(?: \* 1)?\)), B, "
                    r"threads=THREADS\) as \((?:c, bh|bh, c), bb\):$")
# Buffer declarations take no time: no stamps of their own.
ALLOCATION = r"\w+ = T\.alloc_"
PREPARE_CALL = re.compile(r'kernels\["prepare"\]\((.*)\)')


def instrument(source: str) -> tuple[str, list[str]]:
    """The rendered pre_seq module with stamps around every statement of the precompute kernel's body
    but its buffer declarations, the stamp buffer ``[1, chunks, statements + 1]`` as that kernel's last
    argument, passed by ``forward`` from the module's global ``STAMPS``; and the labels of the statements."""
    lines = source.splitlines()
    headers = [i for i, line in enumerate(lines) if HEADER.match(line)]
    if len(headers) != 1:
        raise SystemExit(f"prepare_timeline: expected one precompute block of one chunk, found {len(headers)}")
    header = lines[headers[0]]
    text, labels = stamp_loops(source, headers, "bh == 0 and bb == 0 and tx == 0", STAMPS_ARG, counter="c",
                               unstamped=ALLOCATION)
    body_indent = HEADER.match(header).group(1) + "    "
    text = text.replace(header + "\n", f"{header}\n{body_indent}tx = T.get_thread_binding()\n", 1)
    # The end of the prim_func's parameters, then the block's header (a comment may come between).
    signature = re.search(r"^    \):\n(?:\s*#.*\n)*" + re.escape(header) + "$", text, re.M)
    call = PREPARE_CALL.search(text)
    if signature is None or call is None:
        raise SystemExit("prepare_timeline: the precompute kernel's signature or its call changed")
    points = len(labels[0]) + 1
    text = (text[:signature.start()] + f"        {STAMPS_ARG}: T.Tensor([1, T.ceildiv(S, C), {points}], \"int64\"),\n"
            + text[signature.start():])
    text = text.replace(call.group(0), f"{STAMPS_ARG}.zero_()\n    {call.group(0)[:-1]}, {STAMPS_ARG})")
    return text, labels[0]


def report(stamps: torch.Tensor, labels: list[str]) -> None:
    """Mean cycles of each statement and of the whole block over the stamped blocks."""
    t = stamps[0].cpu().double()
    spent = t[:, 1:] - t[:, :-1]
    print(f"one block: {(t[:, -1] - t[:, 0]).mean().item():.0f} cycles (mean over {t.shape[0]} blocks)")
    for point, label in enumerate(labels):
        print(f"  {spent[:, point].mean().item():8.0f}  {label[:100]}")


def main(argv=None) -> int:
    plain, chunks = rendered_from_arguments(argv, __doc__.splitlines()[0], VARIANTS, "kda",
                                            "a parameter of the config (split is pre_seq)")
    source, labels = instrument(plain.source)
    timed = time_stamped(plain, source, "prepare", (1, chunks, len(labels) + 1))
    if timed is None:
        return 2
    plain_ms, stamped_ms, stamps = timed
    print(f"config {plain.config}")
    print(f"precompute kernel: {plain_ms:.3f} ms as rendered, {stamped_ms:.3f} ms stamped; {chunks} chunks a head")
    report(stamps, labels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
