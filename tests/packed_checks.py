"""Checks shared by the tests of the kernels of packed sequences and grouped value heads
(test_packed.py: those of gdn and kda, parametrized over the variant, and gdn's own; test_packed_kda.py:
kda's own): each variant's packed configs, a generated module imported without compiling, the chunk index
counted out sequence by sequence, packed inputs, kernels that record their launches, a guard against
reading a tensor's values on the host, a module's glue run on recording kernels under that guard, and the
token tensors a module's kernels read and write through masked statements or copy whole."""
from __future__ import annotations

import importlib.util
import re

import torch
from template_checks import rendered_config

from tuner import space
from tuner.candidate import Candidate
from tuner.inputs import packed_lengths
from tuner.problem import Problem

# Each variant's packed configs by name: the default packed one of each split ("default": pre_seq;
# "chunked"), and one with every parameter of the split off its default ("all"; kda's "chunked-all"; gdn's
# "chunked" sets the one parameter of its chunked split, block_dv_o). Several chunks per precompute block
# pad the chunk index to whole blocks and exclude kda's warp specialisation (so its "all" keeps one stage:
# two need warp specialisation).
PACKED = {"split": "pre_seq", "packed": True}
CONFIGS = {
    "gdn": {
        "default": PACKED,
        "all": {**PACKED, "block_dv": 64, "threads": 256, "solve": "doubling", "overlap": True, "prepare_chunks": 2},
        "chunked": {"split": "chunked", "packed": True, "block_dv_o": 64},
        "roles": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                  "gc_loads": "once", "fast_math": True, "prepare_loads": "async"},
        "roles-store-warp": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                             "gc_loads": "once", "fast_math": True, "o_store": "store_warp"},
        # What a packed call runs without a stored packed winner (its parameter's caller_default).
        "caller-default": space.load("gdn").default(Problem("gdn", 64, 64), {"packed": True}),
        # g and beta copied asynchronously as well: a sequence's partial chunk loads them element by element.
        "roles-async-gates": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                              "gc_loads": "once", "fast_math": True, "prepare_loads": "async_gates"},
        # Every sequence walked as segments in parallel (role-split and one-warpgroup sequential kernels).
        "roles-segments": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                           "gc_loads": "once", "fast_math": True, "prepare_loads": "async", "o_store": "store_warp",
                           "segments": 4},
        "segments": {**PACKED, "solve": "merged", "block_dv": 32, "segments": 2},
        # The role-split kernel reading its scores and row weights from the precompute kernel.
        "roles-prepared-scores": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True,
                                  "num_stages": 2, "fast_math": True, "prepare_loads": "async",
                                  "o_store": "store_warp", "output_scores": "prepare"},
        # A sequence's last, partial chunk loaded by TMA as a whole box, the next sequence's rows masked.
        "roles-whole-tail": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                             "gc_loads": "once", "fast_math": True, "prepare_loads": "async",
                             "o_store": "store_warp", "tail_loads": "whole_chunks"},
        # The sequences in four groups per value head and DV block, each walked by one block.
        "roles-groups": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                         "gc_loads": "once", "fast_math": True, "prepare_loads": "async", "o_store": "store_warp",
                         "sequence_groups": 4},
        "roles-groups-whole-tail": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True,
                                    "num_stages": 2, "gc_loads": "once", "fast_math": True, "prepare_loads": "async",
                                    "o_store": "store_warp", "tail_loads": "whole_chunks", "sequence_groups": 4},
        # The new values' state-free products formed ahead of the state, with whole-chunk tails.
        "roles-values-ahead-whole-tail": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True,
                                          "num_stages": 2, "gc_loads": "once", "fast_math": True,
                                          "prepare_loads": "async", "o_store": "store_warp",
                                          "tail_loads": "whole_chunks", "new_values": "ahead"},
        # The V tile swizzled, its whole-chunk tail rows zeroed through the swizzle.
        "roles-v-swizzled-whole-tail": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True,
                                        "num_stages": 2, "gc_loads": "once", "fast_math": True,
                                        "prepare_loads": "async", "o_store": "store_warp",
                                        "tail_loads": "whole_chunks", "v_swizzle": True},
        # And the values role's loads ahead of its stores, the tail rows masked in registers.
        "roles-values-loads-first-whole-tail": {**PACKED, "solve": "merged", "block_dv": 64,
                                                "sequential_roles": True, "num_stages": 2, "gc_loads": "once",
                                                "fast_math": True, "prepare_loads": "async",
                                                "o_store": "store_warp", "tail_loads": "whole_chunks",
                                                "v_swizzle": True, "values_loads": "first"},
        # gc and the row weights by a warp of their own, over grouped sequences with whole-chunk tails.
        "roles-gate-warp-groups-whole-tail": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True,
                                              "num_stages": 3, "gc_loads": "gate_warp", "fast_math": True,
                                              "prepare_loads": "async", "o_store": "store_warp",
                                              "tail_loads": "whole_chunks", "sequence_groups": 4},
        # gc head-major, a chunk's one TMA box (past the sequence's end: the next sequence's gc, clamped
        # by the gate warp), over grouped sequences with whole-chunk tails, and with element-loaded tails.
        "roles-gc-tma-groups-whole-tail": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True,
                                           "num_stages": 3, "gc_loads": "tma", "fast_math": True,
                                           "prepare_loads": "async", "o_store": "store_warp",
                                           "tail_loads": "whole_chunks", "sequence_groups": 4},
        "roles-gc-tma": {**PACKED, "solve": "merged", "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                         "gc_loads": "tma", "fast_math": True, "prepare_loads": "async", "o_store": "store_warp"},
    },
    "kda": {
        "default": PACKED,
        "all": {**PACKED, "sub_chunk": 32, "block_dv": 32, "block_dk": 64, "threads": 128, "prepare_chunks": 2,
                "overlap": True, "solve": "doubling", "system_in": "shared", "score_rows": "sub_chunk"},
        "chunked": {"split": "chunked", "packed": True},
        "chunked-all": {"split": "chunked", "packed": True, "chunk_size": 32, "sub_chunk": 32, "block_dv": 32,
                        "block_dv_o": 128, "block_dk": 64, "num_stages": 2, "threads": 128,
                        "warp_specialized": True, "qk_in": "shared", "system_in": "shared", "wu_in": "fragment"},
        "roles": {**PACKED, "block_dv": 64, "sequential_roles": True, "num_stages": 2, "prepare_loads": "async"},
        "roles-store-warp": {**PACKED, "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                             "o_store": "store_warp"},
        # The precompute kernel's fastest forms on the H100: row factors once (whole rows: block_dk = DK
        # of the GPU tests, 64), bf16 operands, a thread per channel's gate scan.
        "caller-default": space.load("kda").default(Problem("kda", 64, 64), {"packed": True}),
        "roles-rows-once": {**PACKED, "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                            "prepare_loads": "async", "row_factors": "once", "score_operands": "bfloat16",
                            "block_dk": 64, "gate_scan": "per_channel", "solve": "column"},
        "roles-segments": {**PACKED, "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                           "prepare_loads": "async", "row_factors": "once", "score_operands": "bfloat16",
                           "block_dk": 64, "gate_scan": "per_channel", "solve": "column", "o_store": "store_warp",
                           "segments": 4},
        "segments": {**PACKED, "segments": 2},
        "roles-whole-tail": {**PACKED, "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                             "prepare_loads": "async", "row_factors": "once", "score_operands": "bfloat16",
                             "block_dk": 64, "gate_scan": "per_channel", "solve": "column", "o_store": "store_warp",
                             "tail_loads": "whole_chunks"},
        "roles-groups": {**PACKED, "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                         "prepare_loads": "async", "row_factors": "once", "score_operands": "bfloat16",
                         "block_dk": 64, "gate_scan": "per_channel", "solve": "column", "o_store": "store_warp",
                         "sequence_groups": 4},
        "roles-groups-whole-tail": {**PACKED, "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                                    "prepare_loads": "async", "row_factors": "once", "score_operands": "bfloat16",
                                    "block_dk": 64, "gate_scan": "per_channel", "solve": "column",
                                    "o_store": "store_warp", "tail_loads": "whole_chunks", "sequence_groups": 4},
        "roles-values-ahead-whole-tail": {**PACKED, "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                                          "prepare_loads": "async", "row_factors": "once",
                                          "score_operands": "bfloat16", "block_dk": 64, "gate_scan": "per_channel",
                                          "solve": "column", "o_store": "store_warp", "tail_loads": "whole_chunks",
                                          "new_values": "ahead"},
        "roles-v-swizzled-whole-tail": {**PACKED, "block_dv": 64, "sequential_roles": True, "num_stages": 2,
                                        "prepare_loads": "async", "row_factors": "once",
                                        "score_operands": "bfloat16", "block_dk": 64, "gate_scan": "per_channel",
                                        "solve": "column", "o_store": "store_warp", "tail_loads": "whole_chunks",
                                        "v_swizzle": True},
        "roles-values-loads-first-whole-tail": {**PACKED, "block_dv": 64, "sequential_roles": True,
                                                "num_stages": 2, "prepare_loads": "async", "row_factors": "once",
                                                "score_operands": "bfloat16", "block_dk": 64,
                                                "gate_scan": "per_channel", "solve": "column",
                                                "o_store": "store_warp", "tail_loads": "whole_chunks",
                                                "v_swizzle": True, "values_loads": "first"},
    },
}
VARIANTS = list(CONFIGS)


def module_of(candidate: Candidate, tmp_path):
    """The generated module, imported without compiling anything."""
    path = tmp_path / f"{candidate.name}.py"
    path.write_text(candidate.source)
    spec = importlib.util.spec_from_file_location(candidate.name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counted_index(lengths, C, per_block) -> list[tuple[int, int]]:
    """The chunk index counted out sequence by sequence: (sequence, chunk) of every chunk, then (-1, 0) up
    to the documented slot count (ceil(T / C) + N - 1, at least 1, rounded up to whole blocks)."""
    rows = [(n, c) for n, length in enumerate(lengths) for c in range(-(-length // C))]
    slots = max(-(-sum(lengths) // C) + len(lengths) - 1, 1)
    slots = -(-slots // per_block) * per_block
    assert len(rows) <= slots, "the slot bound holds fewer slots than the sequences have chunks"
    return rows + [(-1, 0)] * (slots - len(rows))


def bounds_of(lengths, dtype=torch.int64, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(dtype=dtype, device=device)


def mixed_lengths(seed: int, total: int = 1500) -> list[int]:
    """PACKED_LENGTHS, then a seeded random mix: tuner.inputs' packed regime."""
    return packed_lengths(total, torch.Generator().manual_seed(seed))


def delta_inputs(variant, lengths, H, HV, D=64, seed=0, dtype=torch.bfloat16, device="cpu"):
    """Packed (B = 1) inputs of a delta variant ("gdn": g [1, T, HV]; "kda": g [1, T, HV, D]) of
    ``lengths`` with H query/key and HV value heads, one initial state per sequence."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, T, HV, D, generator=gen)
    channels = (D,) if variant == "kda" else ()
    g = torch.log(0.9 + 0.099 * torch.rand(1, T, HV, *channels, generator=gen))
    beta = torch.rand(1, T, HV, generator=gen).clamp(1e-3, 1 - 1e-3)
    h0 = torch.randn(len(lengths), HV, D, D, generator=gen)
    return dict(q=q.to(device, dtype), k=k.to(device, dtype), v=v.to(device, dtype), g=g.to(device),
                beta=beta.to(device), initial_state=h0.to(device))


class Launched(dict):
    """Kernels that record their arguments instead of running."""

    def __missing__(self, name):
        def launch(*args):
            self.calls[name] = args
        return launch

    def __init__(self):
        super().__init__()
        self.calls = {}


def refuse_host_reads(patch) -> None:
    """Make every way Python reads a tensor's values on the host raise (on a GPU, each is a sync)."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor's values were read on the host")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        patch.setattr(torch.Tensor, name, refuse)


def launched(variant, overrides, lengths, H, HV, monkeypatch, tmp_path, dtype=torch.int64):
    """``variant``'s module of ``overrides`` (DK = DV = 64) run on packed inputs of ``lengths`` with H
    query/key and HV value heads (cu_seqlens of ``dtype``), its kernels recording their launches and every
    way of reading a tensor's values on the host refused: (kernels, inputs, cu_seqlens, o, ht)."""
    module = module_of(rendered_config(variant, 64, **overrides), tmp_path)
    x = delta_inputs(variant, lengths, H=H, HV=HV)
    cu_seqlens = bounds_of(lengths, dtype)
    kernels = Launched()
    with monkeypatch.context() as patch:
        refuse_host_reads(patch)
        o, ht = module.forward(kernels, **x, cu_seqlens=cu_seqlens)
    return kernels, x, cu_seqlens, o, ht


def token_accesses(source: str, first_kernel: str) -> tuple[set, set, dict]:
    """The tensors the kernels of ``source`` (from ``def first_kernel`` to ``def programs``) copy as
    whole tiles, read row by row through the sequence-end mask, and write row by row, each written one
    with the statement it sits in (one indentation level up: the mask, where every write must be)."""
    lines = source[source.index(f"def {first_kernel}"):source.index("def programs")].splitlines()
    kernels = "\n".join(lines)
    copied = set(re.findall(r"T\.copy\((\w+)\[", kernels)) | set(re.findall(r"T\.copy\(\w+, (\w+)\[", kernels))
    read = set(re.findall(r"T\.if_then_else\(c \* C \+ i < seqlen, (\w+)\[bos \+ c \* C \+ i", kernels))
    written = {}
    for number, line in enumerate(lines):
        target = re.match(r"(\s+)(\w+)\[bos \+ c \* C \+ i.*\] = ", line)
        if target:
            indent = len(target.group(1))
            outer = next(up for up in reversed(lines[:number]) if len(up) - len(up.lstrip()) < indent)
            written[target.group(2)] = outer.strip()
    return copied, read, written


def rel_l2(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def compiled_configs(variant: str):
    """(module, kernels) of ``variant``'s config at DK = DV = 64 with the given overrides, each compiled
    once: the GPU tests' fixture."""
    from tuner.compile import load_kernels

    cache = {}

    def get(**overrides):
        key = tuple(sorted(overrides.items()))
        if key not in cache:
            cache[key] = load_kernels(rendered_config(variant, 64, **overrides))
        return cache[key]

    return get
