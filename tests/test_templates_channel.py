"""The per-channel gate templates (gla, kda): defaults (and kda's chunked split) compile for sm_90a
without spills (ptxas), placements change the generated code, constraints refuse before rendering,
and on a GPU every split (kda's chunked one also with an output kernel's own DV block) matches the
fp64 chunked oracle with and without the 0.9 lower bound on the gate, tails and initial state
included."""
from __future__ import annotations

import pytest
from template_checks import (assert_compiles_clean, assert_every_value_changes_source, cuda, oracle_errors,
                             rendered_config)

from tuner import space
from tuner.compile import load_kernels
from tuner.errors import ConstraintError
from tuner.problem import Problem
from tuner.render import render

CHANNEL = ("gla", "kda")
# (variant, split, the programs in launch order)
SPLITS = [("gla", "fused", ["fused"]), ("kda", "fused", ["fused"]),
          ("kda", "chunked", ["chunk_intra", "chunk_state", "chunk_o"])]


@pytest.mark.parametrize("variant,split,kernels", SPLITS)
@pytest.mark.parametrize("dk", (64, 128))
def test_default_compiles_without_spills(variant, split, kernels, dk, tmp_path):
    assert_compiles_clean(rendered_config(variant, dk, split=split), kernels, tmp_path)


def test_kda_declares_both_splits():
    assert space.load("kda").params["split"].values == ("fused", "chunked")


# (variant, split, placement, the allocation it switches, other parameters its values need)
PLACEMENTS = [
    ("gla", "fused", "qk_in", "Qg = T.alloc_{}([C, DK], DTYPE)", {}),
    ("kda", "fused", "qk_in", "Qg = T.alloc_{}([C, DK], DTYPE)", {}),
    ("kda", "fused", "system_in", "Tb = T.alloc_{}([C, C], DTYPE)", {}),
    ("kda", "fused", "wu_in", "W_op = T.alloc_{}([C, DK], DTYPE)", {"threads": 128}),
    ("kda", "chunked", "qk_in", "Qg = T.alloc_{}([C, DK], DTYPE)", {}),
    ("kda", "chunked", "system_in", "Tb = T.alloc_{}([C, C], DTYPE)", {}),
    ("kda", "chunked", "wu_in", "W_op = T.alloc_{}([C, DK], DTYPE)", {"threads": 128}),
]


@pytest.mark.parametrize("variant,split,param,needle,others", PLACEMENTS)
def test_each_placement_emits_its_own_code(variant, split, param, needle, others):
    sources = assert_every_value_changes_source(variant, 64, param, split=split, **others)
    for value, source in sources.items():
        assert needle.format(value) in source


@pytest.mark.parametrize("variant,split", [(v, s) for v, s, _ in SPLITS])
def test_every_declared_placement_is_tested(variant, split):
    declared = {name for name in space.load(variant).params if name.endswith("_in")}
    assert declared == {param for v, s, param, _, _ in PLACEMENTS if (v, s) == (variant, split)}


@pytest.mark.parametrize("variant", CHANNEL)
def test_sub_chunk_not_dividing_chunk_is_refused_before_rendering(variant):
    problem = Problem(variant, 64, 64)
    config = {**space.load(variant).default(problem), "chunk_size": 32, "sub_chunk": 64}
    with pytest.raises(ConstraintError, match="sub_chunk must divide the chunk size"):
        render(problem, config)


@pytest.mark.parametrize("variant,split", [(v, s) for v, s, _ in SPLITS])
def test_sub_chunks_split_the_exponent(variant, split):
    """Every exponent of the score factors is a difference against the sub-chunk's first row, so
    no factor carries the whole chunk's decay (seed 001 §2.3)."""
    source = rendered_config(variant, 64, split=split, sub_chunk=16).source
    assert "SUB = 16" in source
    gate = "G_s" if split == "chunked" else "gam_s"
    assert f"{gate}[a * SUB, kb * BLOCK_DK + d] - {gate}[i, kb * BLOCK_DK + d]" in source
    assert "T.exp2(-" not in source  # no e^{-gamma} against the chunk start


@cuda
@pytest.mark.parametrize("variant,overrides", [(v, {"split": s}) for v, s, _ in SPLITS]
                         + [("kda", {"split": "chunked", "block_dv": 32, "block_dv_o": 64})],
                         ids=[f"{v}-{s}" for v, s, _ in SPLITS] + ["kda-chunked-block_dv_o"])
@pytest.mark.parametrize("dk,dtype", [(64, "fp16"), (128, "bf16")])
def test_forward_matches_fp64_oracle(variant, overrides, dk, dtype):
    rendered = rendered_config(variant, dk, dtype, **overrides)
    module, compiled = load_kernels(rendered)
    C = rendered.config["chunk_size"]
    # Both gate regimes; a multiple of C and ragged tails; an initial state.
    for regime, seqlen in (("channel_lb0.9", 4 * C), ("channel_free", 3 * C + 17), ("initial_state", 2 * C + 1)):
        oracle_errors(module, compiled, rendered, regime, seqlen)
