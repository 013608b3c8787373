"""prepare_min_blocks: the precompute kernel of gdn and kda compiled for several blocks an SM.

Held to ptxas: the launch bounds reach the CUDA, ptxas keeps the registers within the SM's share
that the model budgets, and the model prunes a count the kernel's shared memory cannot hold, by the
shared memory ptxas reports."""
from __future__ import annotations

import re

import pytest

from template_checks import assert_every_value_changes_source, code, cuda, oracle_errors, rendered_config
from tuner.compile import build_kernels, load_kernels
from tuner.model import launch_register_cap
from tuner.model.registers import BOUNDED_MIN_REGISTERS, SMEM_PER_SM, SMEM_RESERVED_PER_BLOCK

# The role-split forms of the H200 winners, whose precompute kernels these are.
GDN = {"split": "pre_seq", "block_dv": 64, "num_stages": 3, "sequential_roles": True, "gc_loads": "tma",
       "fast_math": True, "prepare_loads": "async", "o_store": "store_warp", "output_scores_in": "fragment",
       "values_loads": "first", "v_swizzle": True, "solve": "merged"}
KDA = {"split": "pre_seq", "block_dv": 64, "num_stages": 2, "sequential_roles": True, "prepare_loads": "async",
       "gate_scan": "per_channel", "solve": "column", "system_in": "fragment", "row_factors": "once",
       "score_operands": "bfloat16", "o_store": "store_warp", "values_loads": "first", "v_swizzle": True}


def prepare_kernel(report):
    return next(k for k in report.kernels if k.name == "prepare")


@pytest.mark.parametrize("variant,overrides", [("gdn", GDN), ("kda", {**KDA, "block_dk": 128})], ids=("gdn", "kda"))
def test_every_count_changes_the_code(variant, overrides):
    assert_every_value_changes_source(variant, 128, "prepare_min_blocks", **overrides)


@pytest.mark.parametrize("variant,overrides", [("gdn", GDN), ("gdn", {**GDN, "packed": True}),
                                               ("kda", {**KDA, "block_dk": 128}),
                                               ("kda", {**KDA, "block_dk": 128, "packed": True})],
                         ids=("gdn", "gdn-packed", "kda", "kda-packed"))
def test_the_count_adds_only_the_annotation_inside_the_precompute_kernel(variant, overrides):
    plain = code(rendered_config(variant, 128, **overrides).source).splitlines()
    bounded = code(rendered_config(variant, 128, **overrides, prepare_min_blocks=6).source).splitlines()
    added = [line for line in bounded if line not in plain]
    assert [line.strip() for line in added if not line.strip().startswith("#")] == ["T.annotate_min_blocks_per_sm(6)"]
    assert [line for line in bounded if line in plain or line in added] == bounded
    assert len(bounded) == len(plain) + len(added)
    at = bounded.index(next(line for line in added if "annotate" in line))
    prepare = next(n for n, line in enumerate(bounded) if line.strip().startswith("def prepare("))
    sequential = next(n for n, line in enumerate(bounded) if line.strip().startswith("def sequential("))
    assert prepare < at < sequential
    # Inside the kernel's block: the line above it opens the launch (or, packed, reads the query head).
    assert bounded[at].startswith(" " * 12)


@pytest.mark.parametrize("variant,dim,overrides,blocks",
                         [("gdn", 64, GDN, 6), ("gdn", 128, {**GDN, "num_stages": 2}, 8), ("kda", 64, {**KDA, "block_dk": 64}, 3)],
                         ids=("gdn-64-six", "gdn-128-eight", "kda-64-three"))
def test_ptxas_keeps_the_registers_within_the_share_the_model_budgets(variant, dim, overrides, blocks, tmp_path):
    plain = rendered_config(variant, dim, **overrides)
    bounded = rendered_config(variant, dim, **overrides, prepare_min_blocks=blocks)
    free, _, _ = build_kernels(plain, cache_dir=tmp_path)
    report, _, _ = build_kernels(bounded, cache_dir=tmp_path)
    assert free.error is None and report.error is None, (free.error, report.error)
    free_prepare, prepare = prepare_kernel(free), prepare_kernel(report)
    threads = prepare.threads
    assert re.search(rf"__launch_bounds__\({threads}, {blocks}\)", prepare.cuda_source)
    cap = launch_register_cap(threads, blocks)
    predicted = next(k for k in bounded.prediction.per_kernel if k.name == "prepare")
    assert predicted.budget == cap and predicted.min_blocks_per_sm == blocks
    # Unbounded, each of these takes more than the share; bounded, ptxas gives it exactly the share.
    assert free_prepare.registers > cap and prepare.registers == cap
    # A few bytes of spill at most, which is why the model does not prune them.
    assert prepare.spill_stores <= 16 and bounded.prediction.prune_reason() is None
    # The blocks fit the SM's shared memory by ptxas' figure, as the model says.
    assert blocks * (prepare.dynamic_smem_bytes + SMEM_RESERVED_PER_BLOCK) <= SMEM_PER_SM
    assert predicted.smem_bytes == prepare.dynamic_smem_bytes


def test_a_count_the_shared_memory_cannot_hold_is_pruned(tmp_path):
    # kda D 128's precompute kernel holds about 97 KB: two blocks an SM, not three.
    overrides = {**KDA, "block_dk": 128}
    report, _, _ = build_kernels(rendered_config("kda", 128, **overrides), cache_dir=tmp_path)
    smem = prepare_kernel(report).dynamic_smem_bytes
    resident = SMEM_PER_SM // (smem + SMEM_RESERVED_PER_BLOCK)
    assert resident == 2
    assert rendered_config("kda", 128, **overrides, prepare_min_blocks=resident + 1).prediction.prune_reason() == (
        f"prepare: 3 blocks an SM asked, but its {smem} bytes of shared memory let 2 reside")


def test_a_share_too_small_to_compile_is_pruned(tmp_path):
    # gdn's precompute kernel at 256 threads and eight blocks an SM: a share of 32 registers.
    rendered = rendered_config("gdn", 64, **{**GDN, "threads": 256}, prepare_min_blocks=8)
    assert launch_register_cap(256, 8) == 32 < BOUNDED_MIN_REGISTERS
    assert rendered.prediction.prune_reason() == (
        "prepare: 8 blocks an SM of 256 threads leave 32 registers a thread, below the 64 ptxas needs to compile it")
    report, _, _ = build_kernels(rendered, cache_dir=tmp_path)
    assert report.error is not None and "C7602" in report.error and "Insufficient registers (32)" in report.error
    # Four blocks of 256 threads, a share of 64, compile.
    report, _, _ = build_kernels(rendered_config("gdn", 64, **{**GDN, "threads": 256}, prepare_min_blocks=4), cache_dir=tmp_path)
    assert report.error is None and prepare_kernel(report).registers == 64


@cuda
@pytest.mark.parametrize("variant,dim,overrides", [("gdn", 64, {**GDN, "prepare_min_blocks": 8}),
                                                   ("gdn", 128, {**GDN, "num_stages": 2, "prepare_min_blocks": 6}),
                                                   ("kda", 64, {**KDA, "block_dk": 64, "prepare_min_blocks": 3})],
                         ids=("gdn-64-eight", "gdn-128-six", "kda-64-three"))
def test_bounded_precompute_matches_fp64_oracle(variant, dim, overrides):
    rendered = rendered_config(variant, dim, **overrides)
    module, compiled = load_kernels(rendered)
    C = rendered.config["chunk_size"]
    regimes = ("default", "initial_state", "alpha0.5") if variant == "gdn" else ("channel_lb0.9", "channel_free", "initial_state")
    for regime, seqlen in zip(regimes, (4 * C, 3 * C + 17, 2 * C + 1)):
        oracle_errors(module, compiled, rendered, regime, seqlen)
