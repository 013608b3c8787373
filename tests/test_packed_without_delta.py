"""Packed sequences in the variants without the delta rule (the config's ``packed``): the chunked split
of linear, decay and simple_gla and gla's pre_seq split. Their fused splits' refusal of packed is tested
with gdn's and kda's in test_packed.py.

CPU: the packed kernels compile for sm_90a without spills or screen rejections, the model's shared memory
exact; every token load and store is masked at its sequence's end, only the states (and gla's per-chunk
decay) are copied as whole tiles; a packed call defaults to the split with packed kernels; the glue reads
no tensor's values on the host and gives each sequence its states and its first chunk. GPU (skipped
without CUDA): the packed output and final states against each sequence run alone through the dense
kernels of the same split and against the fp64 oracle.
"""
from __future__ import annotations

import re

import pytest
import torch
from packed_checks import (Launched, bounds_of, counted_index, module_of, refuse_host_reads, rel_l2,
                           token_accesses)
from template_checks import assert_compiles_as_modelled, assert_compiles_clean, cuda, rendered_config

from tuner import reference, space
from tuner.inputs import make_inputs
from tuner.problem import Problem

VARIANTS = ("linear", "decay", "simple_gla", "gla")
# The split with packed kernels (a packed call's default) and its kernels in launch order.
SPLIT = {"linear": "chunked", "decay": "chunked", "simple_gla": "chunked", "gla": "pre_seq"}
KERNELS = {"chunked": ["chunk_state", "chunk_o"], "pre_seq": ["prepare", "sequential"]}
# The tensors copied as whole tiles, read row by row through the sequence-end mask, and written row by row.
COPIED = {"chunked": {"H0", "HT", "Hs"}, "pre_seq": {"H0", "HT", "GL"}}
READ = {"linear": {"Q", "K", "V"}, "decay": {"Q", "K", "V"}, "simple_gla": {"Q", "K", "V", "G"},
        "gla": {"Q", "K", "G", "QG", "KG", "V", "AQK"}}
WRITTEN = {"chunked": {"O"}, "pre_seq": {"QG", "KG", "AQK", "O"}}
# gla's fastest precompute form on the H100 (dense): products on the diagonal, row factors once (block_dk =
# DK = 64 here), bf16 factors, a thread per channel's scan; with its tiles copied asynchronously.
GLA_FAST = {"diagonal_blocks": "products", "row_factors": "once", "block_dk": 64, "score_operands": "bfloat16",
            "gate_scan": "per_channel", "num_stages": 1, "prepare_loads": "async"}
# What a packed gla call runs without a stored packed winner (its parameter's caller_default).
GLA_CALLER_DEFAULT = space.load("gla").default(Problem("gla", 64, 64), {"packed": True})
# The kernel walking each sequence's chunks loading every chunk as a whole box (gla's with warp specialisation,
# which whole boxes need where the loop is pipelined); simple_gla's also with the row weights form and one
# stage, linear's also unpipelined and unspecialised.
WHOLE = {"tail_loads": "whole_chunks"}
WHOLE_OF = {"linear": WHOLE, "decay": WHOLE, "simple_gla": WHOLE,
            "gla": {**GLA_CALLER_DEFAULT, **WHOLE, "warp_specialized": True, "num_stages": 2}}
WHOLE_CONFIGS = [*WHOLE_OF.items(), ("simple_gla", {**WHOLE, "qk_in": "rows", "num_stages": 1}),
                 ("linear", {**WHOLE, "warp_specialized": False, "num_stages": 0})]
WHOLE_IDS = ["linear-whole", "decay-whole", "simple_gla-whole", "gla-whole", "simple_gla-whole-rows",
             "linear-whole-unpipelined"]
# The token tensors the sequential kernel copies as whole boxes, and their tiles.
WHOLE_TILES = {"linear": {"K": "K_s", "V": "V_s"}, "decay": {"K": "K_s", "V": "V_s"},
               "simple_gla": {"K": "K_s", "V": "V_s"},
               "gla": {"QG": "Qg_s", "KG": "Kg_s", "V": "V_s", "AQK": "Aqk_s"}}


def packed(variant):
    return {"split": SPLIT[variant], "packed": True}


@pytest.mark.parametrize("variant,overrides",
                         [(v, {}) for v in VARIANTS] + [("gla", GLA_FAST), ("gla", GLA_CALLER_DEFAULT)] + WHOLE_CONFIGS,
                         ids=[*VARIANTS, "gla-fast", "gla-caller-default", *WHOLE_IDS])
def test_packed_kernels_compile_without_spills_and_the_model_knows_their_shared_memory(variant, overrides, tmp_path):
    rendered = rendered_config(variant, 64, **{**packed(variant), **overrides})
    assert_compiles_as_modelled(rendered, KERNELS[SPLIT[variant]], tmp_path)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_token_load_and_store_is_masked_at_the_sequence_end(variant):
    split = SPLIT[variant]
    source = rendered_config(variant, 128, **packed(variant)).source
    copied, read, written = token_accesses(source, KERNELS[split][0])
    assert copied == COPIED[split]
    assert read == READ[variant]
    assert written == dict.fromkeys(WRITTEN[split], "if c * C + i < seqlen:")


@pytest.mark.parametrize("variant", VARIANTS)
def test_whole_chunk_tails_copy_the_sequential_kernels_tiles_and_zero_their_rows_past_the_end(variant, tmp_path):
    """tail_loads=whole_chunks: the kernel that walks each sequence's chunks (the chunked split's state
    kernel, gla's sequential one) copies its token tiles as whole boxes, each zeroed in shared memory past
    the sequence's end on a partial chunk only, and its chunk loop is pipelined (producer warps issue the
    TMA loads, as in the dense kernel); the other kernel's loads stay masked element by element."""
    walking, other = ("sequential", "prepare") if variant == "gla" else ("chunk_state", "chunk_o")
    rendered = rendered_config(variant, 64, **{**packed(variant), **WHOLE_OF[variant]})
    source = rendered.source
    kernel = source[source.index(f"def {walking}"):source.index("def programs")]
    if variant != "gla":
        kernel = kernel[:kernel.index(f"def {other}")]
    tiles = WHOLE_TILES[variant]
    boxes = re.findall(r"T\.copy\((\w+)\[bos \+ c \* C:bos \+ \(c \+ 1\) \* C, \w+, [^\]]+\], (\w+)\)", kernel)
    assert boxes == list(tiles.items())
    zeroed = re.findall(r"if \(c \+ 1\) \* C > seqlen:\n.*\n.*\n\s+(\w+)\[i, d\] = T\.if_then_else\(c \* C \+ i < seqlen, \1\[i, d\], 0\)",
                        kernel)
    assert zeroed == list(tiles.values())
    # No tile loads element by element left (simple_gla's gate, a column, still is).
    assert not re.search(r"T\.if_then_else\(c \* C \+ i < seqlen, \w+\[bos \+ c \* C \+ i, \w+, ", kernel)
    if variant != "gla":  # the output kernel's loads, element by element as before
        assert token_accesses(source, other)[1] == READ[variant]
    compiled = {k.name: k.cuda_source for k in assert_compiles_clean(rendered, KERNELS[SPLIT[variant]], tmp_path).kernels}
    # The tiles' TMA loads (and gla's decay of the chunk), issued in the producer warps' branch.
    assert compiled[walking].count("tl::tma_load(") == len(tiles) + (variant == "gla")
    assert "if (((int)threadIdx.x) < 128) {" in compiled[walking]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_packed_call_defaults_to_the_split_with_packed_kernels_and_packed_is_never_searched(variant):
    variant_space, problem = space.load(variant), Problem(variant, 128, 128)
    assert not any(c.get("packed") for c in variant_space.grid())
    default = variant_space.default(problem, {"packed": True})
    assert default["split"] == SPLIT[variant] and default["packed"] is True


def packed_inputs(variant, seed=0, device="cpu"):
    """The gate's packed regime at DK = DV = 64: sequences of lengths 1, 15, 64, 65, 200 and a mix, 3 heads."""
    return make_inputs(Problem(variant, 64, 64, "bf16"), "packed", seed=seed, device=device, seqlen=700, heads=3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_glue_reads_no_value_on_the_host_and_gives_each_sequence_its_states_and_first_chunk(variant, monkeypatch,
                                                                                                tmp_path):
    module = module_of(rendered_config(variant, 64, **packed(variant)), tmp_path)
    x = packed_inputs(variant)
    lengths = torch.diff(x.pop("cu_seqlens")).tolist()
    cu_seqlens = bounds_of(lengths, torch.int32)
    x.pop("scale")
    kernels = Launched()
    with monkeypatch.context() as patch:
        refuse_host_reads(patch)
        o, ht = module.forward(kernels, **x, cu_seqlens=cu_seqlens)
    assert o.shape == (1, sum(lengths), 3, 64) and ht.shape == (len(lengths), 3, 64, 64)
    split = SPLIT[variant]
    # The kernel per sequence (chunked: the state pass; pre_seq: the sequential kernel) and the kernel per
    # chunk slot, which takes the chunk index after the bounds.
    if split == "chunked":
        h0, per_chunk, _, bounds, starts = kernels.calls["chunk_state"][-5:]
        chunks = kernels.calls["chunk_o"][-2]
    else:
        per_chunk, h0, bounds, starts = (kernels.calls["sequential"][i] for i in (3, 5, -3, -2))
        chunks = kernels.calls["prepare"][-1]
    assert torch.equal(h0, x["initial_state"]) and bounds.dtype == torch.int64
    assert torch.equal(bounds, cu_seqlens.long())
    index = [tuple(row) for row in chunks.tolist()]
    assert index == counted_index(lengths, 64, 1) and per_chunk.shape[:2] == (len(index), 3)
    # Sequence n's chunk c is slot starts[n] + c: where the kernel per sequence reads or writes chunk c's entry.
    assert all(index[starts[n] + c] == (n, c) for n, c in index if n >= 0)


@cuda
@pytest.mark.parametrize("variant,overrides",
                         [(v, {}) for v in VARIANTS] + [("gla", GLA_FAST), ("gla", GLA_CALLER_DEFAULT)] + WHOLE_CONFIGS,
                         ids=[*VARIANTS, "gla-fast", "gla-caller-default", *WHOLE_IDS])
def test_packed_outputs_and_states_match_each_sequence_alone_and_the_oracle(variant, overrides):
    from tuner.compile import load_kernels

    packed_module, packed_kernels = load_kernels(rendered_config(variant, 64, **{**packed(variant), **overrides}))
    dense_module, dense = load_kernels(rendered_config(variant, 64, split=SPLIT[variant]))
    x = packed_inputs(variant, seed=1, device="cuda")
    o, ht = packed_module.forward(packed_kernels, x["q"], x["k"], x["v"], g=x["g"], scale=x["scale"],
                                  initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    o_ref, ht_ref = reference.chunked(variant, x["q"], x["k"], x["v"], g=x["g"], scale=x["scale"],
                                      initial_state=x["initial_state"], output_final_state=True,
                                      cu_seqlens=x["cu_seqlens"])
    tolerance = Problem(variant, 64, 64).tolerance
    assert rel_l2(o, o_ref) < tolerance and rel_l2(ht, ht_ref) < tolerance
    bounds = x["cu_seqlens"].tolist()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        g = x["g"] if x["g"] is None or x["g"].dim() == 1 else x["g"][:, start:end]  # decay's is per head
        o_n, ht_n = dense_module.forward(dense, x["q"][:, start:end], x["k"][:, start:end], x["v"][:, start:end],
                                         g=g, scale=x["scale"], initial_state=x["initial_state"][n:n + 1])
        assert rel_l2(o[:, start:end], o_n) < tolerance, (n, end - start)
        assert rel_l2(ht[n:n + 1], ht_n) < tolerance, (n, end - start)


@cuda
@pytest.mark.parametrize("variant,overrides", WHOLE_CONFIGS, ids=WHOLE_IDS)
def test_a_whole_chunk_tail_never_lets_the_next_sequence_reach_this_one(variant, overrides):
    """With the sequence after a partial chunk all NaN, every other sequence's output and final state are
    finite and as they were."""
    from tuner.compile import load_kernels

    module, kernels = load_kernels(rendered_config(variant, 64, **{**packed(variant), **overrides}))
    x = packed_inputs(variant, seed=2, device="cuda")
    bounds = x["cu_seqlens"].tolist()
    # The first sequence that ends inside a chunk, and the one after it.
    n = next(n for n, (start, end) in enumerate(zip(bounds, bounds[1:-1])) if (end - start) % 64)
    start, end = bounds[n + 1], bounds[n + 2]

    def run(q, k, v, g):
        return module.forward(kernels, q, k, v, g=g, scale=x["scale"], initial_state=x["initial_state"],
                              cu_seqlens=x["cu_seqlens"])

    o, ht = run(x["q"], x["k"], x["v"], x["g"])
    poisoned = [t.clone() for t in (x["q"], x["k"], x["v"])]
    for t in poisoned:
        t[:, start:end] = float("nan")
    g = x["g"]
    if g is not None and g.dim() > 1:  # simple_gla's gate is per token; decay's per head
        g = g.clone()
        g[:, start:end] = float("nan")
    o_p, ht_p = run(*poisoned, g)
    keep = torch.ones(o.shape[1], dtype=torch.bool, device="cuda")
    keep[start:end] = False
    assert torch.equal(o_p[:, keep], o[:, keep]) and torch.isfinite(o_p[:, keep]).all()
    others = [m for m in range(len(bounds) - 1) if m != n + 1]
    assert torch.equal(ht_p[others], ht[others])
