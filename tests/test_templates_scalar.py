"""The scalar-decay templates (linear, decay, simple_gla): defaults, the chunked and the segmented
split compile for sm_90a without spills (ptxas), placements and segment counts change the generated
code, constraints refuse before rendering (among them 16-column GEMMs on 256 threads, which TileLang
refuses to compile), and on a GPU every split (the chunked one also with an output kernel's own DV
block, the segmented one with 4 and 8 segments; decay's and simple_gla's with row weights too, and
simple_gla's with its gate's cumulative sum taken by a prepass) matches the fp64 chunked oracle, tails,
empty segments and initial state included."""
from __future__ import annotations

import pytest
from template_checks import (assert_compiles_as_modelled, assert_compiles_clean, assert_every_value_changes_source,
                             cuda, oracle_errors, rendered_config)

from tuner import space
from tuner.compile import build_kernels, load_kernels
from tuner.errors import ConstraintError
from tuner.problem import Problem
from tuner.candidate import Candidate, violations
from tuner.render import render

SCALAR = ("linear", "decay", "simple_gla")
WEIGHTED = ("decay", "simple_gla")


@pytest.mark.parametrize("variant,dk,dtype", [(v, dk, "bf16") for v in SCALAR for dk in (64, 128)]
                         + [(v, 128, "fp16") for v in SCALAR])
def test_default_compiles_without_spills(variant, dk, dtype, tmp_path):
    assert_compiles_clean(rendered_config(variant, dk, dtype), ["fused"], tmp_path)


@pytest.mark.parametrize("variant", WEIGHTED)
@pytest.mark.parametrize("param,value,needle", [
    ("qk_in", "shared", "Qw = T.alloc_shared([C, DK], DTYPE)"),
    ("qk_in", "fragment", "Qw = T.alloc_fragment([C, DK], DTYPE)"),
    ("decay_in", "fragment", "Gam = T.alloc_fragment([C, C], ACCUM)"),
    ("decay_in", "shared", "Gam = T.alloc_shared([C, C], ACCUM)"),
    ("decay_in", "inline", "A[i, j] = T.if_then_else(j <= i, A[i, j] * T.exp2("),
    ("scores_in", "fragment", "A_cast = T.alloc_fragment([C, C], DTYPE)"),
    ("scores_in", "shared", "A_cast = T.alloc_shared([C, C], DTYPE)"),
    ("qk_in", "rows", "acc_o[i, d] *= wq_s[i]"),
])
def test_each_placement_emits_its_own_code(variant, param, value, needle):
    source = assert_every_value_changes_source(variant, 64, param)[value]
    assert needle in source
    if param == "decay_in" and value == "inline":
        assert "Gam" not in source
    if value == "rows":  # no weighted copies: Q and K go to the products as loaded, V's rows are weighted
        assert "Qw" not in source and "Kw" not in source
        assert "T.gemm(Q_s, S_s, acc_o, clear_accum=True)" in source and "T.gemm(K_s, Vw, S_f, transpose_A=True)" in source


@pytest.mark.parametrize("variant", WEIGHTED)
@pytest.mark.parametrize("dk,split,kernels", [(64, "fused", ["fused"]), (128, "chunked", ["chunk_state", "chunk_o"]),
                                              (128, "segmented", ["segment_state", "fused"])])
def test_row_weights_compile_without_spills_in_every_split_and_the_model_knows_their_shared_memory(
        variant, dk, split, kernels, tmp_path):
    rendered = rendered_config(variant, dk, split=split, qk_in="rows")
    assert_compiles_as_modelled(rendered, kernels, tmp_path)


def test_linear_has_no_decay_weights():
    source = rendered_config("linear", 64).source
    assert "T.exp2" not in source and "Gam" not in source
    assert "A[i, j] = T.if_then_else(j <= i, A[i, j], 0.0)" in source


@pytest.mark.parametrize("variant", SCALAR)
def test_block_dv_not_dividing_dv_is_refused_before_rendering(variant):
    problem = Problem(variant, 64, 64)
    config = {**space.load(variant).default(problem), "block_dv": 128}
    with pytest.raises(ConstraintError, match="block_dv must divide dv"):
        Candidate.from_config(problem, config)


@pytest.mark.parametrize("overrides", [{"split": "fused", "block_dv": 16},
                                       {"split": "chunked", "block_dv": 32, "block_dv_o": 16}], ids=("fused", "chunked"))
def test_sixteen_columns_on_256_threads_fail_to_compile_and_the_space_refuses_them(overrides, tmp_path):
    # The truth behind the two "seen" constraints: TileLang itself refuses these kernels.
    problem = Problem("simple_gla", 128, 128)
    config = space.load("simple_gla").normalise(
        {**space.load("simple_gla").default(problem), "threads": 256, "scores_in": "shared", **overrides})
    # Rendered past the constraint check, as the template would emit it without the constraints.
    rendered = Candidate(problem, config, render(problem, config))
    report, _, _ = build_kernels(rendered, cache_dir=tmp_path)
    assert report.error and ("GMMA_MN layout" in report.error or "No valid warp partition" in report.error), report.error
    reasons = violations(rendered.problem, rendered.config)
    assert len(reasons) == 1 and "256 threads" in reasons[0], reasons
    assert not violations(rendered.problem, {**rendered.config, "threads": 128})


@pytest.mark.parametrize("variant", SCALAR)
def test_every_parameter_is_declared_with_doc(variant):
    sp = space.load(variant)
    assert sp.params["split"].values == ("fused", "chunked", "segmented")
    for p in sp.params.values():
        assert p.doc.strip(), f"{variant}.{p.name} has no doc"


@pytest.mark.parametrize("variant", SCALAR)
@pytest.mark.parametrize("dk,overrides", [(64, {}), (128, {}), (128, {"block_dv_o": 128})])
def test_chunked_split_compiles_without_spills_and_the_model_knows_its_shared_memory(variant, dk, overrides, tmp_path):
    rendered = rendered_config(variant, dk, split="chunked", **overrides)
    assert_compiles_as_modelled(rendered, ["chunk_state", "chunk_o"], tmp_path)


@pytest.mark.parametrize("variant", SCALAR)
@pytest.mark.parametrize("dk,overrides", [(64, {}), (128, {"segments": 8})])
def test_segmented_split_compiles_without_spills_and_the_model_knows_its_shared_memory(variant, dk, overrides,
                                                                                      tmp_path):
    rendered = rendered_config(variant, dk, split="segmented", **overrides)
    assert_compiles_as_modelled(rendered, ["segment_state", "fused"], tmp_path)


@pytest.mark.parametrize("variant", SCALAR)
def test_segments_change_the_code_and_the_segment_chain_carries_the_segments_decay(variant):
    sources = assert_every_value_changes_source(variant, 128, "segments", split="segmented")
    source = sources[4]
    assert "SEGMENTS = 4" in source and "for j in T.serial(seg):" in source
    chain = {"linear": "S_f[k, d] += SL[bb, bh, j, k, dv0 + d]",
             "decay": "S_f[k, d] * T.exp2(lg * T.Cast(ACCUM, T.max(T.min(per_segment * C, S - j * per_segment * C), 0)))",
             "simple_gla": "S_f[k, d] * T.exp2(GS[bb, bh, j] * LOG2E) + SL[bb, bh, j, k, dv0 + d]"}[variant]
    assert chain in source
    # Only the last segment's block writes the final state.
    assert "if seg == SEGMENTS - 1:\n                T.copy(S_f, HT[" in source


@pytest.mark.parametrize("dk,split,qk_in,kernels", [(64, "fused", "fragment", ["gate_cumsum", "fused"]),
                                                    (128, "segmented", "rows", ["gate_cumsum", "segment_state", "fused"])])
def test_the_gate_prepass_takes_the_cumulative_sum_off_the_loop_and_compiles_without_spills(dk, split, qk_in, kernels,
                                                                                           tmp_path):
    rendered = rendered_config("simple_gla", dk, split=split, qk_in=qk_in, gate_cumsum="prepass")
    source = rendered.source
    loop = source[source.index("for c"):]  # the sequential kernels' chunk loops
    assert "for r in T.serial(i + 1):" not in loop and "gc_s[i] = G[bb, T.min(c * C + i, S - 1), bh]" in loop
    assert 'kernels["gate_cumsum"](g, gc)' in source and ", gc, h0," in source
    assert_compiles_as_modelled(rendered, kernels, tmp_path)


@cuda
@pytest.mark.parametrize("variant", SCALAR)
@pytest.mark.parametrize("dk", (64, 128))
@pytest.mark.parametrize("overrides", ({"split": "fused"}, {"split": "chunked"},
                                       {"split": "chunked", "block_dv": 32, "block_dv_o": 64},
                                       {"split": "segmented"}, {"split": "segmented", "segments": 8}),
                         ids=("fused", "chunked", "chunked-block_dv_o", "segmented", "segmented-8"))
def test_forward_matches_fp64_oracle(variant, dk, overrides):
    check_against_oracle(rendered_config(variant, dk, **overrides))


@cuda
@pytest.mark.parametrize("variant", WEIGHTED)
@pytest.mark.parametrize("dk", (64, 128))
@pytest.mark.parametrize("split", ("fused", "chunked", "segmented"))
def test_row_weights_match_fp64_oracle(variant, dk, split):
    check_against_oracle(rendered_config(variant, dk, split=split, qk_in="rows"))


@cuda
@pytest.mark.parametrize("dk", (64, 128))
@pytest.mark.parametrize("split,qk_in", [("fused", "fragment"), ("segmented", "fragment"), ("fused", "rows")])
def test_the_gate_prepass_matches_fp64_oracle(dk, split, qk_in):
    check_against_oracle(rendered_config("simple_gla", dk, split=split, qk_in=qk_in, gate_cumsum="prepass"))


def check_against_oracle(rendered):
    module, compiled = load_kernels(rendered)
    C = rendered.config["chunk_size"]
    # One compile serves every length: a multiple of C, and a ragged tail, each with an initial state;
    # segments of several chunks and empty trailing segments where the sequence is split.
    seqlens = (4 * C, 3 * C + 17) + ((9 * C + 5,) if rendered.config["split"] == "segmented" else ())
    for seqlen in seqlens:
        oracle_errors(module, compiled, rendered, "initial_state", seqlen)
