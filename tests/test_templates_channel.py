"""The per-channel gate templates (gla, kda): defaults compile for sm_90a without spills (ptxas),
placements change the generated code, constraints refuse before rendering, and on a GPU the fused
kernels match the fp64 chunked oracle with and without the 0.9 lower bound on the gate, tails and
initial state included."""
from __future__ import annotations

import math

import pytest

from tuner import space
from tuner.compile import build_kernels, load_kernels
from tuner.errors import ConstraintError
from tuner.problem import Problem
from tuner.render import render

CHANNEL = ("gla", "kda")


def rendered_config(variant, dk, dtype="bf16", **overrides):
    problem = Problem(variant, dk, dk, dtype)
    config = {**space.load(variant).default(problem), **overrides}
    return render(problem, config)


@pytest.mark.parametrize("variant,dk", [(v, dk) for v in CHANNEL for dk in (64, 128)])
def test_default_compiles_without_spills(variant, dk, tmp_path):
    report, _, _ = build_kernels(rendered_config(variant, dk), cache_dir=tmp_path)
    assert report.error is None, report.error
    assert [k.name for k in report.kernels] == ["fused"]
    kernel = report.kernels[0]
    assert kernel.registers is not None, "no ptxas figures captured"
    assert (kernel.spill_stores, kernel.spill_loads) == (0, 0), kernel
    assert not kernel.wgmma_serialized, kernel
    assert not report.rejected, report.rejected  # no barrier that fewer threads reach than it waits for


# (variant, placement, the allocation it switches, other parameters its values need)
PLACEMENTS = [
    ("gla", "qk_in", "Qg = T.alloc_{}([C, DK], DTYPE)", {}),
    ("kda", "qk_in", "Qg = T.alloc_{}([C, DK], DTYPE)", {}),
    ("kda", "system_in", "Tb = T.alloc_{}([C, C], DTYPE)", {}),
    ("kda", "wu_in", "W_op = T.alloc_{}([C, DK], DTYPE)", {"threads": 128}),
]


@pytest.mark.parametrize("variant,param,needle,others", PLACEMENTS)
def test_each_placement_emits_its_own_code(variant, param, needle, others):
    values = space.load(variant).params[param].values
    sources = {value: rendered_config(variant, 64, **others, **{param: value}).source for value in values}
    for value, source in sources.items():
        assert needle.format(value) in source
    assert len(set(sources.values())) == len(values)


@pytest.mark.parametrize("variant", CHANNEL)
def test_every_declared_placement_is_tested(variant):
    declared = {name for name in space.load(variant).params if name.endswith("_in")}
    assert declared == {param for v, param, _, _ in PLACEMENTS if v == variant}


@pytest.mark.parametrize("variant", CHANNEL)
def test_sub_chunk_not_dividing_chunk_is_refused_before_rendering(variant):
    problem = Problem(variant, 64, 64)
    config = {**space.load(variant).default(problem), "chunk_size": 32, "sub_chunk": 64}
    with pytest.raises(ConstraintError, match="sub_chunk must divide the chunk size"):
        render(problem, config)


@pytest.mark.parametrize("variant", CHANNEL)
def test_sub_chunks_split_the_exponent(variant):
    """Every exponent of the score factors is a difference against the sub-chunk's first row, so
    no factor carries the whole chunk's decay (seed 001 §2.3)."""
    source = rendered_config(variant, 64, sub_chunk=16).source
    assert "SUB = 16" in source
    assert "gam_s[a * SUB, kb * BLOCK_DK + d] - gam_s[i, kb * BLOCK_DK + d]" in source
    assert "T.exp2(-" not in source  # no e^{-gamma} against the chunk start


cuda = pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("variant", CHANNEL)
@pytest.mark.parametrize("dk,dtype", [(64, "fp16"), (128, "bf16")])
def test_forward_matches_fp64_oracle(variant, dk, dtype):
    from tuner import reference, variants
    from tuner.inputs import make_inputs

    rendered = rendered_config(variant, dk, dtype)
    module, compiled = load_kernels(rendered)
    C = rendered.config["chunk_size"]
    tolerance = variants.get(variant).tolerance
    # Both gate regimes; a multiple of C and ragged tails; an initial state.
    for regime, seqlen in (("channel_lb0.9", 4 * C), ("channel_free", 3 * C + 17), ("initial_state", 2 * C + 1)):
        x = make_inputs(rendered.problem, regime, seed=1, device="cuda", batch=2, seqlen=seqlen, heads=3)
        o, ht = module.forward(compiled, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=x["scale"],
                               initial_state=x["initial_state"])
        o_ref, ht_ref = reference.chunked(variant, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                          scale=x["scale"], initial_state=x["initial_state"],
                                          output_final_state=True)
        err_o = ((o.double() - o_ref).norm() / o_ref.norm()).item()
        err_h = ((ht.double() - ht_ref).norm() / ht_ref.norm()).item()
        assert math.isfinite(err_o) and err_o < tolerance, (regime, seqlen, err_o)
        assert math.isfinite(err_h) and err_h < tolerance, (regime, seqlen, err_h)
