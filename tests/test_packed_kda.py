"""Packed sequences and grouped value heads in kda's pre_seq and chunked kernels (the config's ``packed``),
tested as gdn's are in test_packed.py.

CPU: both forms compile for sm_90a at DK 64 and 128, packed and with every parameter off its default,
without spills or screen rejections, the model's shared memory exact; every load and store of a token
tensor is masked at its sequence's end and the per-chunk decay GL is kept per chunk slot; the fused split
refuses packed, saying why; a packed call's default is the chunked split; the glue reads no tensor's values
on the host and launches on the packed rows (g per value head and channel). GPU (the ``cuda`` marker): the
packed kernels against each sequence run alone through the dense kernels and against the fp64 oracle,
FLA's chunk index against the one built on the device, grouped value heads against repeated query/key
heads, the gate's packed regime, and ``tuner.ops.chunk_kda`` with packed sequences: no host sync, no new
compile for a new mix of lengths.
"""
from __future__ import annotations

import re

import pytest
import torch
from packed_checks import (Launched, bounds_of, compiled_configs, counted_index, delta_inputs, mixed_lengths, module_of,
                           refuse_host_reads, rel_l2, token_accesses)
from template_checks import assert_compiles_clean, cuda, rendered_config

from tuner import reference, space
from tuner.candidate import Candidate
from tuner.errors import ConstraintError
from tuner.inputs import PACKED_LENGTHS
from tuner.problem import Problem

KERNELS = {"pre_seq": ["prepare", "sequential"], "chunked": ["chunk_intra", "chunk_state", "chunk_o"]}
# The default packed config of each form, and each with every parameter it has off its default (two
# stages need warp specialisation; several chunks per precompute block pad the chunk index to whole blocks).
PACKED = {"split": "pre_seq", "packed": True}
PACKED_ALL = {**PACKED, "sub_chunk": 32, "block_dv": 32, "block_dk": 64, "num_stages": 2, "threads": 128,
              "warp_specialized": True, "prepare_chunks": 2, "overlap": True, "solve": "doubling",
              "system_in": "shared"}
PACKED_CHUNKED = {"split": "chunked", "packed": True}
PACKED_CHUNKED_ALL = {**PACKED_CHUNKED, "chunk_size": 32, "sub_chunk": 32, "block_dv": 32, "block_dv_o": 128,
                      "block_dk": 64, "num_stages": 2, "threads": 128, "warp_specialized": True, "qk_in": "shared",
                      "system_in": "shared", "wu_in": "fragment"}
# The tensors of tokens (rows [S, heads, ...]) that each form's packed kernels read, and write; and those
# copied as whole tiles: the states and the per-chunk entries (GL, the state entering each chunk).
READ = {"pre_seq": {"Q", "K", "G", "Beta", "QG", "KW", "KG", "V", "AB", "AQK"},
        "chunked": {"Q", "K", "V", "G", "Beta", "GC", "AQK", "W", "U", "VN"}}
WRITTEN = {"pre_seq": {"QG", "KW", "KG", "AB", "AQK", "O"}, "chunked": {"GC", "AQK", "W", "U", "VN", "O"}}
WHOLE = {"pre_seq": {"H0", "HT", "GL"}, "chunked": {"H0", "HT", "Hs"}}
TOLERANCE = Problem("kda", 64, 64).tolerance


# ---- CPU: what is rendered and compiled ----

@pytest.mark.parametrize("dim,overrides", [(64, PACKED), (128, PACKED), (128, PACKED_ALL), (64, PACKED_CHUNKED),
                                           (128, PACKED_CHUNKED), (128, PACKED_CHUNKED_ALL)],
                         ids=["k64", "k128", "k128-all", "k64-chunked", "k128-chunked", "k128-chunked-all"])
def test_packed_kernels_compile_without_spills_or_screen_rejection(dim, overrides, tmp_path):
    rendered = rendered_config("kda", dim, **overrides)
    report = assert_compiles_clean(rendered, KERNELS[overrides["split"]], tmp_path)
    # The shared-memory constraint is judged on the model's figures: they must be ptxas'.
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == {
        k.name: k.dynamic_smem_bytes for k in report.kernels}


@pytest.mark.parametrize("overrides", [PACKED, PACKED_ALL, PACKED_CHUNKED, PACKED_CHUNKED_ALL],
                         ids=["default", "all", "chunked", "chunked-all"])
def test_every_token_load_and_store_is_masked_at_the_sequence_end(overrides):
    split = overrides["split"]
    source = rendered_config("kda", 128, **overrides).source
    copied, read, written = token_accesses(source, KERNELS[split][0])
    assert copied == WHOLE[split]
    assert read == READ[split]
    assert written == dict.fromkeys(WRITTEN[split], "if c * C + i < seqlen:")
    assert "h = hv // (HV // H)" in source  # grouped value heads: q and k read at the query/key head
    if split == "pre_seq":
        # GL is written per chunk slot, only for a chunk of a sequence (a padding slot has length 0), and
        # read at the slot of the sequence's first chunk plus the chunk.
        slot = "cc * 2 + cb" if overrides.get("prepare_chunks", 1) == 2 else "slot"
        assert re.findall(r"\n\s*(.*)\n\s+GL\[(.*)\] = ", source) == [("if c * C < seqlen:", f"{slot}, hv, d")]
        sequential = source[source.index("def sequential"):source.index("def programs")]
        assert "T.copy(GL[first + c, hv, :], gl_s)" in sequential and "ChunkStarts" in sequential
        assert "h = " not in sequential  # its operands are all per value head


def test_the_fused_split_refuses_packed_saying_why():
    problem = Problem("kda", 128, 128)
    config = space.load("kda").complete(problem, {"split": "fused", "packed": True})
    assert config["packed"] is True
    with pytest.raises(ConstraintError, match="the fused kernel has no packed form"):
        Candidate.from_config(problem, config)


def test_packed_is_set_by_the_caller_and_never_searched():
    kda, problem = space.load("kda"), Problem("kda", 128, 128)
    assert not any(c.get("packed") for c in kda.grid())
    assert "packed" not in kda.default(problem)
    default = kda.default(problem, {"packed": True})
    assert default["split"] == "chunked" and default["packed"] is True
    assert kda.normalise({**default, "packed": False}) == {k: v for k, v in default.items() if k != "packed"}
    assert kda.fix({"packed": "true"}).params["packed"].values == (True,)
    assert kda.normalise({**default, "split": "pre_seq"})["packed"] is True


@pytest.mark.parametrize("split", ["pre_seq", "chunked"])
def test_the_packed_kernels_are_other_kernels_than_the_dense_ones(split):
    dense = rendered_config("kda", 128, split=split).source
    packed = rendered_config("kda", 128, split=split, packed=True).source
    assert dense != packed
    assert "CuSeqlens" in packed and "CuSeqlens" not in dense
    assert "def chunk_index" in packed and "def chunk_index" not in dense


# ---- CPU: the host glue ----

def test_the_pre_seq_glue_reads_no_value_on_the_host_and_keeps_gl_per_chunk_slot(monkeypatch, tmp_path):
    module = module_of(rendered_config("kda", 64, **PACKED_ALL), tmp_path)
    lengths = PACKED_LENGTHS
    x = delta_inputs("kda", lengths, H=2, HV=4)
    cu_seqlens = bounds_of(lengths, torch.int32)
    kernels = Launched()
    with monkeypatch.context() as patch:
        refuse_host_reads(patch)
        o, ht = module.forward(kernels, **x, cu_seqlens=cu_seqlens)
    T = sum(lengths)
    assert o.shape == (1, T, 4, 64) and ht.shape == (len(lengths), 4, 64, 64)
    q, k, g, beta, qg, kw, kg, gl, ab, aqk, bounds, chunks = kernels.calls["prepare"]
    assert q.shape == (T, 2, 64) and g.shape == (T, 4, 64) and beta.shape == (T, 4)
    assert qg.shape == kw.shape == kg.shape == (T, 4, 64) and ab.shape == (T, 4, 64)
    assert bounds.dtype == torch.int64 and torch.equal(bounds, cu_seqlens.long())
    index = [tuple(row) for row in chunks.tolist()]
    assert index == counted_index(lengths, 64, 2)
    assert gl.shape == (len(index), 4, 64)
    sequential = kernels.calls["sequential"]
    assert all(sequential[i] is t for i, t in ((0, qg), (1, kw), (2, kg), (4, gl), (10, bounds)))
    assert torch.equal(sequential[7], x["initial_state"])
    # Sequence n's chunk c is slot starts[n] + c: where the sequential kernel reads the GL prepare wrote.
    starts = sequential[11]
    assert starts.dtype == torch.int32 and starts.tolist() == [0, 1, 2, 3, 5]
    assert all(index[starts[n] + c] == (n, c) for n, c in index if n >= 0)


def test_the_chunked_glue_reads_no_value_on_the_host_and_gives_each_sequence_its_first_chunk(monkeypatch, tmp_path):
    module = module_of(rendered_config("kda", 64, **PACKED_CHUNKED), tmp_path)
    lengths = (0, 130, 1, 64, 65)
    x = delta_inputs("kda", lengths, H=1, HV=2)
    kernels = Launched()
    with monkeypatch.context() as patch:
        refuse_host_reads(patch)
        module.forward(kernels, **x, cu_seqlens=bounds_of(lengths))
    q, k, v, g, beta, gc, aqk, w, u, bounds, chunks = kernels.calls["chunk_intra"]
    T = sum(lengths)
    assert q.shape == k.shape == (T, 1, 64) and g.shape == gc.shape == (T, 2, 64) and aqk.shape == (T, 2, 64)
    assert w.shape == (T, 2, 64)
    chunk_o = kernels.calls["chunk_o"]
    assert chunk_o[1] is gc and chunk_o[2] is aqk and chunk_o[-2] is chunks
    hs, starts = kernels.calls["chunk_state"][5], kernels.calls["chunk_state"][-1]
    index = [tuple(row) for row in chunks.tolist()]
    assert index == counted_index(lengths, 64, 1)
    assert starts.dtype == torch.int32 and starts.tolist() == [0, 0, 3, 4, 5]
    assert all(index[starts[n] + c] == (n, c) for n, c in index if n >= 0)
    assert hs.shape == (len(index), 2, 64, 64)


# ---- GPU: the kernels against independent truth ----

@pytest.fixture(scope="module")
def compiled():
    """(module, kernels) per config, compiled once for the GPU tests."""
    return compiled_configs("kda")


@cuda
@pytest.mark.parametrize("overrides", [PACKED, PACKED_ALL, PACKED_CHUNKED, PACKED_CHUNKED_ALL],
                         ids=["default", "all", "chunked", "chunked-all"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("lengths", [PACKED_LENGTHS, "mix"], ids=["regime", "mix"])
def test_packed_outputs_and_states_match_each_sequence_alone_and_the_oracle(compiled, overrides, dtype, lengths):
    lengths = mixed_lengths(11) if lengths == "mix" else lengths
    H, HV = 2, 4
    x = delta_inputs("kda", lengths, H, HV, device="cuda")
    cu_seqlens = bounds_of(lengths, dtype, "cuda")
    module, kernels = compiled(**overrides)
    o, ht = module.forward(kernels, **x, cu_seqlens=cu_seqlens)
    o_ref, ht_ref = reference.chunked("kda", **x, output_final_state=True, cu_seqlens=cu_seqlens)
    assert rel_l2(o, o_ref) < TOLERANCE and rel_l2(ht, ht_ref) < TOLERANCE
    # Each sequence alone through the dense kernels of the same config, q and k repeated to HV heads.
    dense_module, dense_kernels = compiled(**{**overrides, "packed": False})
    bounds = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        alone = {name: t[:, start:end] for name, t in x.items() if name != "initial_state"}
        alone["q"], alone["k"] = (alone[name].repeat_interleave(HV // H, dim=2) for name in ("q", "k"))
        o_n, ht_n = dense_module.forward(dense_kernels, **alone, initial_state=x["initial_state"][n:n + 1])
        assert rel_l2(o[:, start:end], o_n) < 1e-3, (n, end - start)
        assert rel_l2(ht[n:n + 1], ht_n) < 1e-3, (n, end - start)


@cuda
@pytest.mark.parametrize("overrides", [PACKED_ALL, PACKED_CHUNKED_ALL], ids=["pre_seq", "chunked"])
def test_fla_chunk_indices_give_the_same_outputs_as_the_index_built_on_the_device(compiled, overrides):
    lengths = mixed_lengths(3)
    x = delta_inputs("kda", lengths, 2, 4, device="cuda")
    cu_seqlens = bounds_of(lengths, torch.int64, "cuda")
    module, kernels = compiled(**overrides)
    exact = torch.tensor([(n, c) for n, length in enumerate(lengths) for c in range(-(-length // module.C))],
                         device="cuda")
    o, ht = module.forward(kernels, **x, cu_seqlens=cu_seqlens)
    o_given, ht_given = module.forward(kernels, **x, cu_seqlens=cu_seqlens, chunk_indices=exact)
    assert torch.equal(o, o_given) and torch.equal(ht, ht_given)


@cuda
@pytest.mark.parametrize("overrides", [PACKED, PACKED_CHUNKED], ids=["pre_seq", "chunked"])
def test_grouped_value_heads_of_a_dense_batch_match_repeated_query_and_key_heads(compiled, overrides):
    H, HV = 2, 6
    x = delta_inputs("kda", (200,), H, HV, device="cuda")
    x = {name: t.expand(3, *t.shape[1:]).contiguous() for name, t in x.items()}
    x["v"] = x["v"] * torch.linspace(0.5, 1.5, 3, device="cuda")[:, None, None, None].to(x["v"].dtype)
    module, kernels = compiled(**overrides)
    o, ht = module.forward(kernels, **x)
    repeated = {**x, "q": x["q"].repeat_interleave(HV // H, dim=2), "k": x["k"].repeat_interleave(HV // H, dim=2)}
    dense_module, dense_kernels = compiled(**{**overrides, "packed": False})
    o_ref, ht_ref = dense_module.forward(dense_kernels, **repeated)
    assert rel_l2(o, o_ref) < 1e-3 and rel_l2(ht, ht_ref) < 1e-3
    o_oracle, ht_oracle = reference.chunked("kda", **x, output_final_state=True)
    assert rel_l2(o, o_oracle) < TOLERANCE and rel_l2(ht, ht_oracle) < TOLERANCE


@cuda
@pytest.mark.parametrize("overrides", [PACKED, PACKED_CHUNKED], ids=["pre_seq", "chunked"])
def test_the_gate_runs_and_passes_the_packed_regime(overrides):
    from tuner.gate import run_gate

    result = run_gate(rendered_config("kda", 64, **overrides), seqlens=(1000,), seeds=(0, 1))
    assert result.passed, result.message
    assert "packed" in result.errors and result.errors["packed"]["o"] < TOLERANCE


@cuda
def test_ops_takes_packed_sequences_without_a_host_sync_or_a_new_compile_for_a_new_mix():
    from tuner import ops

    x = delta_inputs("kda", mixed_lengths(5), 2, 4, device="cuda")
    T = x["q"].shape[1]
    # The tuner's kernels, whatever FLA's stored baselines say (FLA reads cu_seqlens on the host).
    call = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], output_final_state=True, backend="tuner")
    compiles = ops._compiled.cache_info().misses
    for seed in (5, 6):  # two mixes of lengths over the same tokens
        lengths = mixed_lengths(seed, total=T)
        cu_seqlens = bounds_of(lengths, torch.int32, "cuda")
        h0 = torch.randn(len(lengths), 4, 64, 64, device="cuda")
        ops.chunk_kda(**call, initial_state=h0, cu_seqlens=cu_seqlens)  # compiled on the first
        misses = ops._compiled.cache_info().misses
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            o, ht = ops.chunk_kda(**call, initial_state=h0, cu_seqlens=cu_seqlens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert ops._compiled.cache_info().misses == misses
        o_ref, ht_ref = reference.chunked("kda", **{**x, "initial_state": h0}, output_final_state=True,
                                          cu_seqlens=cu_seqlens)
        assert rel_l2(o, o_ref) < TOLERANCE and rel_l2(ht, ht_ref) < TOLERANCE
    assert ops._compiled.cache_info().misses - compiles <= 1  # one kernel for both mixes


@cuda
def test_ops_grouped_value_heads_of_a_dense_batch_match_the_oracle():
    from tuner import ops

    x = delta_inputs("kda", (300,), 2, 8, device="cuda")
    x = {name: t.expand(2, *t.shape[1:]).contiguous() for name, t in x.items()}
    o, ht = ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                          output_final_state=True, backend="tuner")
    o_ref, ht_ref = reference.chunked("kda", **x, output_final_state=True)
    assert o.shape == (2, 300, 8, 64) and rel_l2(o, o_ref) < TOLERANCE and rel_l2(ht, ht_ref) < TOLERANCE
