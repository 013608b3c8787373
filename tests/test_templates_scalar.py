"""The scalar-decay templates (linear, decay, simple_gla): defaults compile for sm_90a without
spills (ptxas), placements change the generated code, constraints refuse before rendering, and on a
GPU the fused kernel matches the fp64 chunked oracle, tails and initial state included."""
from __future__ import annotations

import math

import pytest

from tuner import space
from tuner.compile import build_kernels, load_kernels
from tuner.errors import ConstraintError
from tuner.problem import Problem
from tuner.render import render

SCALAR = ("linear", "decay", "simple_gla")
WEIGHTED = ("decay", "simple_gla")


def default_rendered(variant, dk, dtype="bf16", **overrides):
    problem = Problem(variant, dk, dk, dtype)
    config = {**space.load(variant).default(problem), **overrides}
    return render(problem, config)


@pytest.mark.parametrize("variant,dk,dtype", [(v, dk, "bf16") for v in SCALAR for dk in (64, 128)]
                         + [(v, 128, "fp16") for v in SCALAR])
def test_default_compiles_without_spills(variant, dk, dtype, tmp_path):
    report, _, _ = build_kernels(default_rendered(variant, dk, dtype), cache_dir=tmp_path)
    assert report.error is None, report.error
    assert [k.name for k in report.kernels] == ["fused"]
    kernel = report.kernels[0]
    assert kernel.registers is not None, "no ptxas figures captured"
    assert (kernel.spill_stores, kernel.spill_loads) == (0, 0), kernel
    assert not kernel.wgmma_serialized, kernel
    assert not report.rejected, report.rejected  # no barrier that fewer threads reach than it waits for


@pytest.mark.parametrize("variant", WEIGHTED)
@pytest.mark.parametrize("param,value,needle", [
    ("qk_in", "shared", "Qw = T.alloc_shared([C, DK], DTYPE)"),
    ("qk_in", "fragment", "Qw = T.alloc_fragment([C, DK], DTYPE)"),
    ("decay_in", "fragment", "Gam = T.alloc_fragment([C, C], ACCUM)"),
    ("decay_in", "shared", "Gam = T.alloc_shared([C, C], ACCUM)"),
    ("decay_in", "inline", "A[i, j] = T.if_then_else(j <= i, A[i, j] * T.exp2("),
    ("scores_in", "fragment", "A_cast = T.alloc_fragment([C, C], DTYPE)"),
    ("scores_in", "shared", "A_cast = T.alloc_shared([C, C], DTYPE)"),
])
def test_each_placement_emits_its_own_code(variant, param, value, needle):
    source = default_rendered(variant, 64, **{param: value}).source
    assert needle in source
    others = {v for v in space.load(variant).params[param].values if v != value}
    for other in others:
        assert default_rendered(variant, 64, **{param: other}).source != source
    if param == "decay_in" and value == "inline":
        assert "Gam" not in source


def test_linear_has_no_decay_weights():
    source = default_rendered("linear", 64).source
    assert "T.exp2" not in source and "Gam" not in source
    assert "A[i, j] = T.if_then_else(j <= i, A[i, j], 0.0)" in source


@pytest.mark.parametrize("variant", SCALAR)
def test_block_dv_not_dividing_dv_is_refused_before_rendering(variant):
    problem = Problem(variant, 64, 64)
    config = {**space.load(variant).default(problem), "block_dv": 128}
    with pytest.raises(ConstraintError, match="block_dv must divide dv"):
        render(problem, config)


@pytest.mark.parametrize("variant", SCALAR)
def test_every_parameter_is_declared_with_doc(variant):
    sp = space.load(variant)
    assert sp.params["split"].values == ("fused",)
    for p in sp.params.values():
        assert p.doc.strip(), f"{variant}.{p.name} has no doc"


cuda = pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("variant", SCALAR)
@pytest.mark.parametrize("dk", (64, 128))
def test_forward_matches_fp64_oracle(variant, dk):
    from tuner import reference, variants
    from tuner.inputs import make_inputs

    rendered = default_rendered(variant, dk)
    module, compiled = load_kernels(rendered)
    C = rendered.config["chunk_size"]
    tolerance = variants.get(variant).tolerance
    # One compile serves every length: a multiple of C, and a ragged tail, each with an initial state.
    for seqlen in (4 * C, 3 * C + 17):
        x = make_inputs(rendered.problem, "initial_state", seed=1, device="cuda", batch=2, seqlen=seqlen, heads=3)
        o, ht = module.forward(compiled, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=x["scale"],
                               initial_state=x["initial_state"])
        o_ref, ht_ref = reference.chunked(variant, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                          scale=x["scale"], initial_state=x["initial_state"],
                                          output_final_state=True)
        err_o = ((o.double() - o_ref).norm() / o_ref.norm()).item()
        err_h = ((ht.double() - ht_ref).norm() / ht_ref.norm()).item()
        assert math.isfinite(err_o) and err_o < tolerance, (seqlen, err_o)
        assert math.isfinite(err_h) and err_h < tolerance, (seqlen, err_h)
