"""Packed sequences and grouped value heads in the pre_seq and chunked kernels of gdn and kda (the
config's ``packed``): the tests of both, each parametrized over the variant (its id says which), and
gdn's own; kda's own are in test_packed_kda.py.

CPU: the packed kernels compile for sm_90a without spills or screen rejections, the model's shared memory
exact; the fused split refuses packed, saying why; every load and store of a token tensor is masked at its
sequence's end (no whole-tile copy, which would read or write across it); packed is set by the caller,
never searched; the chunk index the host glue builds on the device matches one counted out sequence by
sequence; the glue reads no tensor's values on the host. GPU (the ``cuda`` marker): the packed kernels
against each sequence run alone through the dense kernels and against the fp64 oracle, FLA's chunk index
against the one built on the device, grouped value heads against repeated query/key heads, the gate's
packed regime, and ``tuner.ops`` with packed sequences: no host sync, no new compile for a new mix of
lengths.
"""
from __future__ import annotations

import re

import pytest
import torch
from packed_checks import (CONFIGS, PACKED, VARIANTS, Launched, bounds_of, compiled_configs, counted_index,
                           delta_inputs, launched, mixed_lengths, module_of, refuse_host_reads, rel_l2,
                           token_accesses)
from template_checks import assert_compiles_as_modelled, cuda, rendered_config

from tuner import reference, space
from tuner.inputs import PACKED_LENGTHS
from tuner.candidate import Candidate
from tuner.errors import ConstraintError
from tuner.problem import Problem

# Each variant's packed kernels per split (CONFIGS, its packed configs, are in packed_checks.py).
KERNELS = {"gdn": {"pre_seq": ["prepare", "sequential"], "chunked": ["chunk_wu", "chunk_state", "chunk_o"]},
           "kda": {"pre_seq": ["prepare", "sequential"], "chunked": ["chunk_intra", "chunk_state", "chunk_o"]}}
# The tensors of tokens (rows [S, heads, ...]) that each variant's packed kernels read, and write, per split.
READ = {"gdn": {"pre_seq": {"Q", "K", "V", "G", "Beta", "WQ", "WK", "AB", "AQK"},
                "chunked": {"Q", "K", "V", "G", "Beta", "GC", "W", "U", "VN"}},
        "kda": {"pre_seq": {"Q", "K", "G", "Beta", "QG", "KW", "KG", "V", "AB", "AQK"},
                "chunked": {"Q", "K", "V", "G", "Beta", "GC", "AQK", "W", "U", "VN"}}}
WRITTEN = {"gdn": {"pre_seq": {"WQ", "WK", "AB", "AQK", "O"}, "chunked": {"GC", "W", "U", "VN", "O"}},
           "kda": {"pre_seq": {"QG", "KW", "KG", "AB", "AQK", "O"}, "chunked": {"GC", "AQK", "W", "U", "VN", "O"}}}
# The tensors copied as whole tiles: the states, the chunked split's state entering each chunk, and kda's
# per-chunk decay GL.
WHOLE = {"gdn": {"pre_seq": {"H0", "HT"}, "chunked": {"H0", "HT", "Hs"}},
         "kda": {"pre_seq": {"H0", "HT", "GL"}, "chunked": {"H0", "HT", "Hs"}}}
# Each variant's op in tuner.ops.
OPS = {"gdn": "chunk_gated_delta_rule", "kda": "chunk_kda"}


def configs(*names, ids=None):
    """(variant, config) of each variant's packed configs named ``names`` (those it has), each with the id
    "variant-name", or "variant-" + ids[name]."""
    return [pytest.param(variant, name, id=f"{variant}-{(ids or {}).get(name, name)}")
            for variant in VARIANTS for name in names if name in CONFIGS[variant]]


def tolerance(variant):
    return Problem(variant, 64, 64).tolerance


# ---- CPU: what is rendered and compiled ----

@pytest.mark.parametrize("variant,dim,config", [
    pytest.param(variant, dim, name, id=f"{variant}-k{dim}" + ("" if name == "default" else f"-{name}"))
    for variant, dim, name in [("gdn", 64, "default"), ("gdn", 128, "default"), ("gdn", 128, "all"),
                               ("gdn", 128, "chunked"), ("gdn", 64, "roles"), ("gdn", 128, "roles"),
                               ("kda", 64, "default"), ("kda", 128, "default"),
                               ("kda", 128, "all"), ("kda", 64, "chunked"), ("kda", 128, "chunked"),
                               ("kda", 128, "chunked-all"), ("kda", 64, "roles"), ("kda", 128, "roles"),
                               ("kda", 64, "roles-rows-once"), ("kda", 128, "caller-default"),
                               ("gdn", 64, "roles-segments"), ("gdn", 128, "segments"),
                               ("kda", 64, "roles-segments"), ("kda", 128, "segments"),
                               ("gdn", 128, "roles-prepared-scores"), ("gdn", 128, "roles-whole-tail"),
                               ("gdn", 64, "roles-whole-tail"), ("kda", 64, "roles-whole-tail"),
                               ("gdn", 64, "roles-groups"), ("gdn", 128, "roles-groups-whole-tail"),
                               ("kda", 64, "roles-groups"), ("kda", 64, "roles-groups-whole-tail"),
                               ("gdn", 128, "roles-values-ahead-whole-tail"), ("gdn", 64, "roles-values-ahead-whole-tail"),
                               ("kda", 64, "roles-values-ahead-whole-tail"), ("gdn", 128, "roles-v-swizzled-whole-tail"),
                               ("kda", 64, "roles-v-swizzled-whole-tail"),
                               ("gdn", 64, "roles-values-loads-first-whole-tail"),
                               ("kda", 64, "roles-values-loads-first-whole-tail"),
                               ("gdn", 128, "roles-gate-warp-groups-whole-tail"),
                               ("gdn", 128, "roles-gc-tma-groups-whole-tail"), ("gdn", 64, "roles-gc-tma")]])
def test_packed_kernels_compile_without_spills_or_screen_rejection(variant, dim, config, tmp_path):
    overrides = CONFIGS[variant][config]
    rendered = rendered_config(variant, dim, **overrides)
    kernels = KERNELS[variant][overrides["split"]]
    if overrides.get("segments", 1) > 1:  # the state pass of the segments runs between the two
        kernels = [kernels[0], "segment_state", kernels[1]]
    # The shared-memory constraint is judged on the model's figures: they must be ptxas'.
    assert_compiles_as_modelled(rendered, kernels, tmp_path)


@pytest.mark.parametrize("variant,config", configs("default", "all", "chunked", "chunked-all"))
def test_every_token_load_and_store_is_masked_at_the_sequence_end(variant, config):
    split = CONFIGS[variant][config]["split"]
    source = rendered_config(variant, 128, **CONFIGS[variant][config]).source
    copied, read, written = token_accesses(source, KERNELS[variant][split][0])
    assert copied == WHOLE[variant][split]
    assert read == READ[variant][split]
    assert written == dict.fromkeys(WRITTEN[variant][split], "if c * C + i < seqlen:")
    assert "h = hv // (HV // H)" in source  # grouped value heads: q and k read at the query/key head


# The tiles the role-split kernel's producer loads by TMA, per variant.
ROLE_TILES = {"gdn": {"Q", "K", "V", "AB"}, "kda": {"QG", "KW", "KG", "V", "AB", "AQK"}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_role_split_kernel_copies_whole_tiles_of_whole_chunks_only(variant):
    """Its producer loads a chunk by TMA, and its output role stores one as a tile, only where the chunk
    ends inside its sequence; a last, partial chunk is read and written row by row through the mask."""
    source = rendered_config(variant, 128, **CONFIGS[variant]["roles"]).source
    lines = source[source.index("def sequential"):source.index("def programs")].splitlines()
    whole = [n for n, line in enumerate(lines) if "T.tma_copy(" in line or "T.copy(O_s, O[" in line]
    assert {re.search(r"copy\((?:O_s, )?(\w+)\[", lines[n]).group(1) for n in whole} == ROLE_TILES[variant] | {"O"}
    for n in whole:
        indent = len(lines[n]) - len(lines[n].lstrip())
        outer = next(up for up in reversed(lines[:n]) if len(up) - len(up.lstrip()) < indent)
        assert outer.strip() == "if (c + 1) * C <= seqlen:", lines[n]
    copied, read, written = token_accesses(source, "sequential")
    assert copied == {"H0", "HT", "S_s", "O"}  # the states, S_s (shared), and O under the whole-chunk test above
    assert read == ROLE_TILES[variant]
    assert written == {"O": "if c * C + i < seqlen:"}


def test_the_gdn_role_split_kernel_reads_gate_rows_inside_the_sequence_and_copies_k_asynchronously():
    source = rendered_config("gdn", 128, **CONFIGS["gdn"]["roles"]).source
    # gc and the row weights read rows up to the last one inside the sequence only
    assert "GC[bos + c * C + T.min(i, last), hv]" in source and "last = T.min(C, seqlen - c * C) - 1" in source
    # Its precompute kernel copies K asynchronously for a whole chunk only, else element by element.
    prepare = source[source.index("def prepare"):source.index("return prepare")].splitlines()
    (n,) = [n for n, line in enumerate(prepare) if "T.async_copy(" in line]
    assert prepare[n - 1].strip() == "if (c + 1) * C <= seqlen:" and prepare[n + 1].strip() == "else:"
    assert prepare[n + 3].strip() == "K_s[i, d] = T.if_then_else(c * C + i < seqlen, K[bos + c * C + i, h, d], 0)"


@pytest.mark.parametrize("variant,split", [("gdn", "pre_seq"), ("kda", "pre_seq")], ids=VARIANTS)
def test_packed_is_set_by_the_caller_and_never_searched(variant, split):
    """A packed call's default is ``split``: pre_seq for both (kda's role-split form)."""
    variant_space, problem = space.load(variant), Problem(variant, 128, 128)
    # The search draws from values alone, and a config states packed only at a caller's value (kda's grid,
    # millions of configs, is not listed).
    assert variant_space.params["packed"].values == (False,) and variant_space.params["packed"].caller_values == (True,)
    assert all("packed" not in variant_space.normalise({**c, "packed": False}) for c in
               (variant_space.default(problem), {**variant_space.default(problem), "split": "pre_seq"}))
    assert "packed" not in variant_space.default(problem)
    default = variant_space.default(problem, {"packed": True})
    assert default["split"] == split and default["packed"] is True
    dense = {**default, "packed": False}
    assert variant_space.normalise(dense) == {k: v for k, v in default.items() if k != "packed"}
    assert variant_space.fix({"packed": "true"}).params["packed"].values == (True,)


def test_gdns_dense_default_split_takes_packed_too():
    gdn, problem = space.load("gdn"), Problem("gdn", 128, 128)
    assert gdn.normalise({**gdn.default(problem), "packed": True})["packed"] is True  # chunked has them too


@pytest.mark.parametrize("variant", [*VARIANTS, "linear", "decay", "simple_gla", "gla"])
def test_the_fused_split_refuses_packed_saying_why(variant):
    problem = Problem(variant, 128, 128)
    config = space.load(variant).complete(problem, {"split": "fused", "packed": True})
    assert config["packed"] is True  # stated, not dropped: a dense kernel would read packed rows as one batch
    with pytest.raises(ConstraintError, match="the fused kernel has no packed form"):
        Candidate.from_config(problem, config)


@pytest.mark.parametrize("split", ["pre_seq", "chunked"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_packed_kernels_are_other_kernels_than_the_dense_ones(variant, split):
    dense = rendered_config(variant, 128, split=split).source
    packed = rendered_config(variant, 128, split=split, packed=True).source
    assert dense != packed
    assert "CuSeqlens" in packed and "CuSeqlens" not in dense
    assert "def chunk_index" in packed and "def chunk_index" not in dense


# ---- CPU: the host glue ----

@pytest.mark.parametrize("overrides", [PACKED, {**PACKED, "chunk_size": 32, "prepare_chunks": 4}],
                         ids=["C64", "C32-four-per-block"])
@pytest.mark.parametrize("lengths", [PACKED_LENGTHS, (0, 5, 0, 64, 0), (1,), (200,), "mix"],
                         ids=["regime", "empty", "one-token", "one", "mix"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_chunk_index_matches_one_counted_out_sequence_by_sequence(overrides, lengths, dtype, tmp_path):
    lengths = mixed_lengths(7) if lengths == "mix" else lengths
    rendered = rendered_config("gdn", 64, **overrides)
    module = module_of(rendered, tmp_path)
    C, per_block = rendered.config["chunk_size"], rendered.config["prepare_chunks"]
    built = module.chunk_index(bounds_of(lengths, dtype), sum(lengths))
    assert built.dtype == torch.int32
    assert [tuple(row) for row in built.tolist()] == counted_index(lengths, C, per_block)


def test_fla_chunk_indices_are_used_as_given_and_padded_to_whole_blocks(tmp_path):
    rendered = rendered_config("gdn", 64, **{**PACKED, "prepare_chunks": 4})
    module = module_of(rendered, tmp_path)
    lengths = (70, 3, 130)
    exact = torch.tensor([(n, c) for n, length in enumerate(lengths) for c in range(-(-length // 64))])
    built = module.chunk_index(bounds_of(lengths), sum(lengths), exact)
    assert [tuple(row) for row in built.tolist()] == [*map(tuple, exact.tolist()), (-1, 0), (-1, 0)]


def test_the_glue_reads_no_value_on_the_host_and_launches_on_the_packed_rows(monkeypatch, tmp_path):
    lengths = PACKED_LENGTHS
    kernels, x, cu_seqlens, o, ht = launched("gdn", PACKED, lengths, 2, 4, monkeypatch, tmp_path, torch.int32)
    assert o.shape == (1, sum(lengths), 4, 64) and ht.shape == (len(lengths), 4, 64, 64)
    q, k, g, beta, wq, wk, ab, aqk, bounds, chunks = kernels.calls["prepare"]
    assert q.shape == (sum(lengths), 2, 64) and g.shape == (sum(lengths), 4) and ab.shape == (sum(lengths), 4, 64)
    assert bounds.dtype == torch.int64 and torch.equal(bounds, cu_seqlens.long())
    assert [tuple(row) for row in chunks.tolist()] == counted_index(lengths, 64, 1)
    sequential = kernels.calls["sequential"]
    assert sequential[10] is bounds and torch.equal(sequential[7], x["initial_state"])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lengths", [PACKED_LENGTHS, (0, 5, 0, 64, 0, 700, 1), "mix"], ids=["regime", "empty", "mix"])
def test_sequence_groups_cover_every_sequence_once_and_walk_its_chunks_in_the_index_order(variant, lengths,
                                                                                         monkeypatch, tmp_path):
    """sequence_groups: the glue cuts the sequences into SEQUENCE_GROUPS runs of whole sequences (empty ones
    too: their final state is the initial one), each run's chunk slots the contiguous range of the chunk
    index from its first sequence's first chunk; the state role's chunk c of sequence n is then the
    (ChunkStarts[n] - first slot + c)-th of its block's walk, the slot the other roles read (n, c) from.
    No value is read on the host."""
    lengths = mixed_lengths(7) if lengths == "mix" else lengths
    kernels, _, cu_seqlens, _, _ = launched(variant, CONFIGS[variant]["roles-groups"], lengths, 2, 4, monkeypatch,
                                            tmp_path)
    *_, chunks, starts, groups, _ = kernels.calls["sequential"]
    index, starts, groups = [tuple(r) for r in chunks.tolist()], starts.tolist(), groups.tolist()
    counts = [-(-length // 64) for length in lengths]
    assert len(groups) == 5 and groups[0] == [0, 0] and groups[-1] == [len(lengths), sum(counts)]
    for (seq_begin, first_slot), (seq_end, end_slot) in zip(groups, groups[1:]):
        assert seq_begin <= seq_end and end_slot - first_slot == sum(counts[seq_begin:seq_end])
        walk = [(n, c) for n in range(seq_begin, seq_end) for c in range(counts[n])]
        assert index[first_slot:end_slot] == walk  # the other roles' walk: slot first_slot + nth
        assert [starts[n] - first_slot + c for n, c in walk] == list(range(len(walk)))  # the state role's nth
    # About an equal share of the chunks each: a group ends at the first sequence that starts past its share.
    shares = [g * sum(counts) // 4 for g in range(4)]
    assert [seq_begin for seq_begin, _ in groups[:-1]] == [
        next((n for n in range(len(lengths)) if starts[n] >= share), len(lengths)) for share in shares]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_chunked_glue_reads_no_value_on_the_host_and_gives_each_sequence_its_first_chunk(variant, monkeypatch,
                                                                                              tmp_path):
    lengths = (0, 130, 1, 64, 65)
    kernels = launched(variant, CONFIGS[variant]["chunked"], lengths, 1, 2, monkeypatch, tmp_path)[0]
    chunks = kernels.calls[KERNELS[variant]["chunked"][0]][-1]
    assert kernels.calls["chunk_o"][-2] is chunks
    hs, starts = kernels.calls["chunk_state"][5], kernels.calls["chunk_state"][-1]
    index = [tuple(row) for row in chunks.tolist()]
    assert index == counted_index(lengths, 64, 1)
    # Sequence n's chunk c is slot starts[n] + c of the index: where chunk_o reads the state chunk_state wrote.
    assert starts.dtype == torch.int32 and starts.tolist() == [0, 0, 3, 4, 5]
    assert all(index[starts[n] + c] == (n, c) for n, c in index if n >= 0)
    assert hs.shape == (len(index), 2, 64, 64)


def test_the_host_read_guard_catches_a_read(monkeypatch):
    with monkeypatch.context() as patch, pytest.raises(AssertionError, match="read on the host"):
        refuse_host_reads(patch)
        torch.tensor([1, 2]).tolist()


def test_a_dense_batch_goes_through_as_one_sequence_per_row(tmp_path):
    module = module_of(rendered_config("gdn", 64, **PACKED), tmp_path)
    x = delta_inputs("gdn", (100,), H=1, HV=3)
    x = {name: t.expand(2, *t.shape[1:]).contiguous() for name, t in x.items()}  # B = 2 rows of 100
    kernels = Launched()
    o, ht = module.forward(kernels, **x)
    assert o.shape == (2, 100, 3, 64) and ht.shape == (2, 3, 64, 64)
    bounds = kernels.calls["prepare"][8]
    assert bounds.tolist() == [0, 100, 200]


# ---- GPU: the kernels against independent truth ----

@pytest.fixture(scope="module")
def compiled():
    """(module, kernels) per variant and config, compiled once for the GPU tests."""
    return {variant: compiled_configs(variant) for variant in VARIANTS}


@cuda
@pytest.mark.parametrize("variant,config", configs("default", "all", "chunked", "chunked-all", "roles",
                                                   "roles-store-warp", "roles-rows-once", "roles-async-gates",
                                                   "caller-default", "roles-segments", "segments",
                                                   "roles-prepared-scores", "roles-whole-tail", "roles-groups",
                                                   "roles-groups-whole-tail", "roles-values-ahead-whole-tail",
                                                   "roles-v-swizzled-whole-tail",
                                                   "roles-values-loads-first-whole-tail",
                                                   "roles-gate-warp-groups-whole-tail",
                                                   "roles-gc-tma-groups-whole-tail", "roles-gc-tma"))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lengths", [PACKED_LENGTHS, "mix"], ids=["regime", "mix"])
def test_packed_outputs_and_states_match_each_sequence_alone_and_the_oracle(compiled, variant, config, dtype,
                                                                           lengths):
    lengths = mixed_lengths(11) if lengths == "mix" else lengths
    H, HV = 2, 4
    x = delta_inputs(variant, lengths, H, HV, device="cuda")
    cu_seqlens = bounds_of(lengths, dtype, "cuda")
    overrides = CONFIGS[variant][config]
    module, kernels = compiled[variant](**overrides)
    o, ht = module.forward(kernels, **x, cu_seqlens=cu_seqlens)
    o_ref, ht_ref = reference.chunked(variant, **x, output_final_state=True, cu_seqlens=cu_seqlens)
    assert rel_l2(o, o_ref) < tolerance(variant) and rel_l2(ht, ht_ref) < tolerance(variant)
    # Each sequence alone through the dense kernels of the same config, q and k repeated to HV heads.
    dense_module, dense_kernels = compiled[variant](**{**overrides, "packed": False})
    bounds = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        alone = {name: t[:, start:end] for name, t in x.items() if name != "initial_state"}
        alone["q"], alone["k"] = (alone[name].repeat_interleave(HV // H, dim=2) for name in ("q", "k"))
        o_n, ht_n = dense_module.forward(dense_kernels, **alone, initial_state=x["initial_state"][n:n + 1])
        assert rel_l2(o[:, start:end], o_n) < 1e-3, (n, end - start)
        assert rel_l2(ht[n:n + 1], ht_n) < 1e-3, (n, end - start)


@cuda
@pytest.mark.parametrize("variant,config", configs("roles-whole-tail", "roles-values-ahead-whole-tail",
                                                   "roles-v-swizzled-whole-tail",
                                                   "roles-values-loads-first-whole-tail",
                                                   "roles-gate-warp-groups-whole-tail",
                                                   "roles-gc-tma-groups-whole-tail"))
def test_a_whole_chunk_tail_never_lets_the_next_sequence_reach_this_one(compiled, variant, config):
    """tail_loads=whole_chunks reads the rows past a sequence's end from the next sequence: with that
    sequence all NaN, every other sequence's output and final state are finite and as they were."""
    lengths = (65, 200, 15, 64)  # the first ends one row into a chunk, the third inside one
    x = delta_inputs(variant, lengths, 2, 4, device="cuda")
    cu_seqlens = bounds_of(lengths, torch.int64, "cuda")
    module, kernels = compiled[variant](**CONFIGS[variant][config])
    o, ht = module.forward(kernels, **x, cu_seqlens=cu_seqlens)
    poisoned = dict(x)
    for name in ("q", "k", "v", "g", "beta"):
        poisoned[name] = x[name].clone()
        poisoned[name][:, 65:265] = float("nan")  # the second sequence
    o_p, ht_p = module.forward(kernels, **poisoned, cu_seqlens=cu_seqlens)
    keep = torch.ones(o.shape[1], dtype=torch.bool, device="cuda")
    keep[65:265] = False
    assert torch.equal(o_p[:, keep], o[:, keep]) and torch.isfinite(o_p[:, keep]).all()
    for n in (0, 2, 3):
        assert torch.equal(ht_p[n], ht[n])


@cuda
@pytest.mark.parametrize("variant,config", [  # each split's config with every parameter off its default
    pytest.param("gdn", "all", id="gdn-pre_seq"), pytest.param("gdn", "chunked", id="gdn-chunked"),
    pytest.param("kda", "all", id="kda-pre_seq"), pytest.param("kda", "chunked-all", id="kda-chunked")])
def test_fla_chunk_indices_give_the_same_outputs_as_the_index_built_on_the_device(compiled, variant, config):
    lengths = mixed_lengths(3)
    x = delta_inputs(variant, lengths, 2, 4, device="cuda")
    cu_seqlens = bounds_of(lengths, torch.int64, "cuda")
    module, kernels = compiled[variant](**CONFIGS[variant][config])
    exact = torch.tensor([(n, c) for n, length in enumerate(lengths) for c in range(-(-length // module.C))],
                         device="cuda")
    o, ht = module.forward(kernels, **x, cu_seqlens=cu_seqlens)
    o_given, ht_given = module.forward(kernels, **x, cu_seqlens=cu_seqlens, chunk_indices=exact)
    assert torch.equal(o, o_given) and torch.equal(ht, ht_given)


@cuda
@pytest.mark.parametrize("variant,config", configs("default", "chunked", "roles", ids={"default": "pre_seq"}))
def test_grouped_value_heads_of_a_dense_batch_match_repeated_query_and_key_heads(compiled, variant, config):
    H, HV = 2, 6
    x = delta_inputs(variant, (200,), H, HV, device="cuda")
    x = {name: t.expand(3, *t.shape[1:]).contiguous() for name, t in x.items()}
    x["v"] = x["v"] * torch.linspace(0.5, 1.5, 3, device="cuda")[:, None, None, None].to(x["v"].dtype)
    overrides = CONFIGS[variant][config]
    module, kernels = compiled[variant](**overrides)
    o, ht = module.forward(kernels, **x)
    repeated = {**x, "q": x["q"].repeat_interleave(HV // H, dim=2), "k": x["k"].repeat_interleave(HV // H, dim=2)}
    dense_module, dense_kernels = compiled[variant](**{**overrides, "packed": False})
    o_ref, ht_ref = dense_module.forward(dense_kernels, **repeated)
    assert rel_l2(o, o_ref) < 1e-3 and rel_l2(ht, ht_ref) < 1e-3
    o_oracle, ht_oracle = reference.chunked(variant, **x, output_final_state=True)
    assert rel_l2(o, o_oracle) < tolerance(variant) and rel_l2(ht, ht_oracle) < tolerance(variant)


@cuda
@pytest.mark.parametrize("variant,config", configs("default", "chunked", "roles", ids={"default": "pre_seq"}))
def test_the_gate_runs_and_passes_the_packed_regime(variant, config):
    from tuner.gate import run_gate

    result = run_gate(rendered_config(variant, 64, **CONFIGS[variant][config]), seqlens=(1000,), seeds=(0, 1))
    assert result.passed, result.message
    assert "packed" in result.errors and result.errors["packed"]["o"] < tolerance(variant)


@cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_ops_takes_packed_sequences_without_a_host_sync_or_a_new_compile_for_a_new_mix(variant):
    from tuner import ops

    op = getattr(ops, OPS[variant])
    x = delta_inputs(variant, mixed_lengths(5), 2, 4, device="cuda")
    T = x["q"].shape[1]
    # The tuner's kernels, whatever FLA's stored baselines say (FLA reads cu_seqlens on the host).
    call = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], output_final_state=True, backend="tuner")
    compiles = ops._compiled.cache_info().misses
    for seed in (5, 6):  # two mixes of lengths over the same tokens
        lengths = mixed_lengths(seed, total=T)
        cu_seqlens = bounds_of(lengths, torch.int32, "cuda")
        h0 = torch.randn(len(lengths), 4, 64, 64, device="cuda")
        op(**call, initial_state=h0, cu_seqlens=cu_seqlens)  # compiled on the first
        misses = ops._compiled.cache_info().misses
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            o, ht = op(**call, initial_state=h0, cu_seqlens=cu_seqlens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert ops._compiled.cache_info().misses == misses
        o_ref, ht_ref = reference.chunked(variant, **{**x, "initial_state": h0}, output_final_state=True,
                                          cu_seqlens=cu_seqlens)
        assert rel_l2(o, o_ref) < tolerance(variant) and rel_l2(ht, ht_ref) < tolerance(variant)
    assert ops._compiled.cache_info().misses - compiles <= 1  # one kernel for both mixes


@cuda
@pytest.mark.parametrize("variant", VARIANTS)
def test_ops_grouped_value_heads_of_a_dense_batch_match_the_oracle(variant):
    from tuner import ops

    x = delta_inputs(variant, (300,), 2, 8, device="cuda")
    x = {name: t.expand(2, *t.shape[1:]).contiguous() for name, t in x.items()}
    o, ht = getattr(ops, OPS[variant])(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                       output_final_state=True, backend="tuner")
    o_ref, ht_ref = reference.chunked(variant, **x, output_final_state=True)
    assert o.shape == (2, 300, 8, 64)
    assert rel_l2(o, o_ref) < tolerance(variant) and rel_l2(ht, ht_ref) < tolerance(variant)
