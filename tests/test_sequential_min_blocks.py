"""sequential_min_blocks (gdn): the role-split sequential kernel compiled for two blocks an SM.

Held to ptxas: the launch bounds reach the CUDA, every warp starts at the SM's share for two blocks
and the roles' setmaxnreg caps move it, ptxas fits the roles in their caps without spilling, and
the model prunes two blocks whose shared memory (ptxas' figure) an SM cannot hold."""
from __future__ import annotations

import re

import pytest

from template_checks import assert_every_value_changes_source, cuda, oracle_errors, rendered_config
from tuner import candidate, space
from tuner.compile import build_kernels, load_kernels
from tuner.model import launch_register_cap
from tuner.model.registers import SMEM_PER_SM, SMEM_RESERVED_PER_BLOCK
from tuner.problem import Problem

# gdn's role-split form as the H200 winners run it.
GDN = {"split": "pre_seq", "sequential_roles": True, "gc_loads": "tma", "fast_math": True, "prepare_loads": "async",
       "o_store": "store_warp", "output_scores_in": "fragment", "values_loads": "first", "v_swizzle": True,
       "solve": "merged", "num_stages": 2}


def sequential_kernel(report):
    return next(k for k in report.kernels if k.name == "sequential")


def test_two_blocks_change_the_code():
    assert_every_value_changes_source("gdn", 64, "sequential_min_blocks", **GDN, block_dv=16)


@pytest.mark.parametrize("dim,block_dv", [(64, 16), (64, 32), (128, 16)], ids=("64-16", "64-32", "128-16"))
def test_ptxas_fits_the_roles_in_two_blocks_share(dim, block_dv, tmp_path):
    rendered = rendered_config("gdn", dim, **GDN, block_dv=block_dv, sequential_min_blocks=2)
    report, _, _ = build_kernels(rendered, cache_dir=tmp_path)
    assert report.error is None, report.error
    kernel = sequential_kernel(report)
    assert re.search(r"__launch_bounds__\(512, 2\)", kernel.cuda_source)
    # Every warp starts at the share of two blocks of 512 threads; the caps raise or lower it.
    share = launch_register_cap(512, 2)
    assert share == 64 and kernel.registers == share
    caps = [int(n) for n in re.findall(r"warpgroup_reg_(?:alloc|dealloc)<(\d+)>", kernel.cuda_source)]
    assert sorted(caps) == [32, 72, 72, 80] and sum(caps) == 4 * share
    assert re.findall(r"warpgroup_reg_dealloc<(\d+)>", kernel.cuda_source) == ["32"]
    assert kernel.spill_stores == 0 and kernel.spill_loads == 0
    # Two blocks' shared memory fits an SM by ptxas' figure, and the model agrees and keeps it.
    assert 2 * (kernel.dynamic_smem_bytes + SMEM_RESERVED_PER_BLOCK) <= SMEM_PER_SM
    predicted = next(k for k in rendered.prediction.per_kernel if k.name == "sequential")
    assert predicted.min_blocks_per_sm == 2 and predicted.smem_bytes == kernel.dynamic_smem_bytes
    assert rendered.prediction.prune_reason() is None


def test_two_blocks_whose_shared_memory_does_not_fit_are_pruned(tmp_path):
    # D 64, block_dv 32 at three stages: about 117 KB a block, one an SM.
    overrides = {**GDN, "block_dv": 32, "num_stages": 3}
    report, _, _ = build_kernels(rendered_config("gdn", 64, **overrides), cache_dir=tmp_path)
    smem = sequential_kernel(report).dynamic_smem_bytes
    assert SMEM_PER_SM // (smem + SMEM_RESERVED_PER_BLOCK) == 1
    assert rendered_config("gdn", 64, **overrides, sequential_min_blocks=2).prediction.prune_reason() == (
        f"sequential: 2 blocks an SM asked, but its {smem} bytes of shared memory let 1 reside")


def test_packed_sequences_refuse_two_blocks():
    problem = Problem("gdn", 64, 64, "bf16", batch=1, seqlen=32768, heads=32, packed=True)
    config = space.load("gdn").complete(problem, {**GDN, "block_dv": 16, "packed": True})
    assert not candidate.violations(problem, config)
    refused = candidate.violations(problem, {**config, "sequential_min_blocks": 2})
    assert len(refused) == 1 and "packed role-split kernel's producer" in refused[0]


@cuda
@pytest.mark.parametrize("dim,block_dv", [(64, 16), (64, 32)], ids=("64-16", "64-32"))
def test_two_blocks_an_sm_match_fp64_oracle(dim, block_dv):
    rendered = rendered_config("gdn", dim, **GDN, block_dv=block_dv, sequential_min_blocks=2)
    module, compiled = load_kernels(rendered)
    C = rendered.config["chunk_size"]
    for regime, seqlen in zip(("default", "initial_state", "alpha0.5"), (4 * C, 3 * C + 17, 2 * C + 1)):
        oracle_errors(module, compiled, rendered, regime, seqlen)
