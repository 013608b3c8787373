"""The per-channel gate templates (gla, kda): defaults (and kda's chunked and pre_seq splits, gla's pre_seq
split) compile for sm_90a without spills (ptxas), placements change the generated code, constraints refuse
before rendering, the pre_seq sequential kernels scan no gate and write only o and the final state,
the model knows its shared memory, and on a GPU every split (kda's chunked one also with an output
kernel's own DV block, gla's pre_seq one also off its defaults) matches the fp64 chunked oracle with
and without the 0.9 lower bound on the gate, tails and initial state included."""
from __future__ import annotations

import re

import pytest
from template_checks import (assert_compiles_clean, assert_every_value_changes_source, cuda, oracle_errors,
                             rendered_config)

from tuner import space
from tuner.compile import load_kernels
from tuner.errors import ConstraintError
from tuner.problem import Problem
from tuner.candidate import Candidate

CHANNEL = ("gla", "kda")
# (variant, split, the programs in launch order)
SPLITS = [("gla", "fused", ["fused"]), ("gla", "pre_seq", ["prepare", "sequential"]), ("kda", "fused", ["fused"]),
          ("kda", "chunked", ["chunk_intra", "chunk_state", "chunk_o"]), ("kda", "pre_seq", ["prepare", "sequential"])]
# gla and kda pre_seq with every parameter they have off its default (two stages need warp specialisation,
# which excludes kda's several chunks per precompute block: those have a config of their own).
GLA_PRE_SEQ_ALL = {"split": "pre_seq", "chunk_size": 32, "sub_chunk": 16, "block_dv": 32, "block_dk": 64,
                   "num_stages": 2, "threads": 128, "warp_specialized": True}
KDA_PRE_SEQ_ALL = {"split": "pre_seq", "sub_chunk": 32, "block_dv": 32, "block_dk": 64, "num_stages": 2,
                   "threads": 128, "warp_specialized": True, "overlap": True, "solve": "doubling",
                   "system_in": "shared"}
KDA_PRE_SEQ_BLOCKS = {"split": "pre_seq", "prepare_chunks": 2, "overlap": True, "solve": "doubling"}
# gla segmented with every parameter it has off its default.
GLA_SEGMENTED_ALL = {**GLA_PRE_SEQ_ALL, "split": "segmented", "segments": 8}


@pytest.mark.parametrize("variant,split,kernels", SPLITS)
@pytest.mark.parametrize("dk", (64, 128))
def test_default_compiles_without_spills(variant, split, kernels, dk, tmp_path):
    assert_compiles_clean(rendered_config(variant, dk, split=split), kernels, tmp_path)


def test_kda_declares_three_splits_and_pre_seq_keeps_no_q_or_w_tile():
    kda = space.load("kda")
    assert kda.params["split"].values == ("fused", "chunked", "pre_seq")
    for name in ("qk_in", "wu_in"):
        assert kda.active(name, {"split": "chunked"}) and not kda.active(name, {"split": "pre_seq"})
    for name in ("solve", "overlap", "prepare_chunks"):
        assert kda.active(name, {"split": "pre_seq"}) and not kda.active(name, {"split": "fused"})


def test_kda_pre_seq_refuses_warp_specialisation_over_several_chunks_per_precompute_block_saying_why():
    kda, problem = space.load("kda"), Problem("kda", 128, 128)
    both = kda.complete(problem, {"split": "pre_seq", "prepare_chunks": 2, "warp_specialized": True})
    with pytest.raises(ConstraintError, match="warp specialisation of the precompute kernel's loop over several chunks"):
        Candidate.from_config(problem, both)
    for alone in ({"prepare_chunks": 2}, {"warp_specialized": True, "num_stages": 2}):
        Candidate.from_config(problem, kda.complete(problem, {"split": "pre_seq", **alone}))


def test_gla_declares_three_splits_and_pre_seq_has_no_q_placement():
    gla = space.load("gla")
    assert gla.params["split"].values == ("fused", "pre_seq", "segmented")
    assert gla.active("qk_in", {"split": "fused"}) and not gla.active("qk_in", {"split": "pre_seq"})
    assert gla.active("segments", {"split": "segmented"}) and not gla.active("segments", {"split": "pre_seq"})


@pytest.mark.parametrize("dk,overrides", [(64, {}), (128, GLA_SEGMENTED_ALL)], ids=["default-64", "all-128"])
def test_gla_segmented_compiles_clean_and_the_model_knows_its_shared_memory(dk, overrides, tmp_path):
    rendered = rendered_config("gla", dk, **{"split": "segmented", **overrides})
    report = assert_compiles_clean(rendered, ["prepare", "segment_state", "sequential"], tmp_path)
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == {
        k.name: k.dynamic_smem_bytes for k in report.kernels}


def test_gla_segmented_chains_the_per_channel_transitions_and_the_last_segment_writes_the_final_state():
    sources = assert_every_value_changes_source("gla", 128, "segments", split="segmented")
    source = sources[4]
    pre_seq = rendered_config("gla", 128, split="pre_seq").source
    # The precompute kernel is pre_seq's.
    prepare = slice(source.index("def prepare"), source.index("def segment_state"))
    assert source[prepare] == pre_seq[pre_seq.index("def prepare"):pre_seq.index("def sequential")]
    assert "transition_s[k] *= gl_s[k]" in source
    assert "S_f[k, d] = S_f[k, d] * GS[bb, bh, j, k] + SL[bb, bh, j, k, dv0 + d]" in source
    assert "if seg == SEGMENTS - 1:\n                T.copy(S_f, HT[" in source


@pytest.mark.parametrize("variant", CHANNEL)
def test_pre_seq_sequential_kernel_scans_no_gate_and_writes_only_o_and_the_state(variant):
    source = rendered_config(variant, 128, split="pre_seq").source
    sequential = source[source.index("def sequential"):source.index("def programs")]
    assert "T.cumsum" not in sequential and "T.exp2" not in sequential and "T.if_then_else" not in sequential
    assert set(re.findall(r"T\.copy\(.*, (\w+)\[", sequential)) == {"O", "HT"}


@pytest.mark.parametrize("variant,dk,overrides", [("gla", 128, GLA_PRE_SEQ_ALL), ("gla", 64, {"split": "pre_seq"}),
                                                  ("kda", 128, KDA_PRE_SEQ_ALL), ("kda", 64, {"split": "pre_seq"})],
                         ids=("gla-all-off-default-128", "gla-default-64", "kda-all-off-default-128", "kda-default-64"))
def test_pre_seq_compiles_clean_and_the_model_knows_its_shared_memory(variant, dk, overrides, tmp_path):
    rendered = rendered_config(variant, dk, **overrides)
    report = assert_compiles_clean(rendered, ["prepare", "sequential"], tmp_path)
    smem = {k.name: k.dynamic_smem_bytes for k in report.kernels}
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == smem


@pytest.mark.parametrize("overrides,reason", [
    ({"num_stages": 2}, "deeper than one stage"),
    ({"chunk_size": 32, "sub_chunk": 32}, "one sub-chunk per chunk"),
])
def test_gla_pre_seq_constraints_refuse_before_rendering(overrides, reason):
    problem = Problem("gla", 64, 64)
    config = space.load("gla").complete(problem, {"split": "pre_seq", **overrides})
    with pytest.raises(ConstraintError, match=reason):
        Candidate.from_config(problem, config)


# (variant, split, placement, the allocation it switches, other parameters its values need)
PLACEMENTS = [
    ("gla", "fused", "qk_in", "Qg = T.alloc_{}([C, DK], DTYPE)", {}),
    ("kda", "fused", "qk_in", "Qg = T.alloc_{}([C, DK], DTYPE)", {}),
    ("kda", "fused", "system_in", "Tb = T.alloc_{}([C, C], DTYPE)", {}),
    ("kda", "fused", "wu_in", "W_op = T.alloc_{}([C, DK], DTYPE)", {"threads": 128}),
    ("kda", "chunked", "qk_in", "Qg = T.alloc_{}([C, DK], DTYPE)", {}),
    ("kda", "chunked", "system_in", "Tb = T.alloc_{}([C, C], DTYPE)", {}),
    ("kda", "chunked", "wu_in", "W_op = T.alloc_{}([C, DK], DTYPE)", {"threads": 128}),
    ("kda", "pre_seq", "system_in", "Tb = T.alloc_{}([C, C], DTYPE)", {}),
]


@pytest.mark.parametrize("param", ["solve", "overlap", "prepare_chunks"])
def test_every_kda_pre_seq_parameter_changes_the_code(param):
    assert_every_value_changes_source("kda", 128, param, split="pre_seq")


@pytest.mark.parametrize("variant,split,param,needle,others", PLACEMENTS)
def test_each_placement_emits_its_own_code(variant, split, param, needle, others):
    sources = assert_every_value_changes_source(variant, 64, param, split=split, **others)
    for value, source in sources.items():
        assert needle.format(value) in source


@pytest.mark.parametrize("variant,split", [(v, s) for v, s, _ in SPLITS])
def test_every_declared_placement_is_tested(variant, split):
    sp = space.load(variant)
    declared = {name for name in sp.params if name.endswith("_in") and sp.active(name, {"split": split})}
    assert declared == {param for v, s, param, _, _ in PLACEMENTS if (v, s) == (variant, split)}


@pytest.mark.parametrize("variant", CHANNEL)
def test_sub_chunk_not_dividing_chunk_is_refused_before_rendering(variant):
    problem = Problem(variant, 64, 64)
    config = {**space.load(variant).default(problem), "chunk_size": 32, "sub_chunk": 64}
    with pytest.raises(ConstraintError, match="sub_chunk must divide the chunk size"):
        Candidate.from_config(problem, config)


@pytest.mark.parametrize("variant,split", [(v, s) for v, s, _ in SPLITS])
def test_sub_chunks_split_the_exponent(variant, split):
    """Every exponent of the score factors is a difference against the sub-chunk's first row, so
    no factor carries the whole chunk's decay (whose exponential underflows or overflows in fp16)."""
    source = rendered_config(variant, 64, split=split, sub_chunk=16).source
    assert "SUB = 16" in source
    gate = "gam_s" if split == "fused" else "G_s"
    assert f"{gate}[a * SUB, kb * BLOCK_DK + d] - {gate}[i, kb * BLOCK_DK + d]" in source
    assert "T.exp2(-" not in source  # no e^{-gamma} against the chunk start


@cuda
@pytest.mark.parametrize("variant,overrides", [(v, {"split": s}) for v, s, _ in SPLITS]
                         + [("kda", {"split": "chunked", "block_dv": 32, "block_dv_o": 64}),
                            ("gla", GLA_PRE_SEQ_ALL), ("kda", KDA_PRE_SEQ_ALL), ("kda", KDA_PRE_SEQ_BLOCKS),
                            ("gla", {"split": "segmented"}), ("gla", GLA_SEGMENTED_ALL)],
                         ids=[f"{v}-{s}" for v, s, _ in SPLITS] + ["kda-chunked-block_dv_o", "gla-pre_seq-all",
                                                                   "kda-pre_seq-all", "kda-pre_seq-blocks",
                                                                   "gla-segmented", "gla-segmented-all"])
@pytest.mark.parametrize("dk,dtype", [(64, "fp16"), (128, "bf16")])
def test_forward_matches_fp64_oracle(variant, overrides, dk, dtype):
    rendered = rendered_config(variant, dk, dtype, **overrides)
    module, compiled = load_kernels(rendered)
    C = rendered.config["chunk_size"]
    # Both gate regimes; a multiple of C and ragged tails; an initial state; where the sequence is split,
    # segments of several chunks (and, with 8 segments at 4 chunks, empty ones).
    cases = (("channel_lb0.9", 4 * C), ("channel_free", 3 * C + 17), ("initial_state", 2 * C + 1))
    if overrides["split"] == "segmented":
        cases += (("initial_state", 9 * C + 5),)
    for regime, seqlen in cases:
        oracle_errors(module, compiled, rendered, regime, seqlen)
