"""Gated DeltaNet templates (templates/gdn.py.j2, templates/delta.py.j2, search_spaces/gdn.yaml).

CPU: the defaults of the three splits compile for sm_90a at DK = DV = 64 and 128 without spills (ptxas)
and without a screen rejection (tuner.screen: a barrier inside a thread-index branch that fewer
threads enter than it waits for, a deadlock); every placement changes the generated code;
a constraint-breaking config is refused before anything is rendered; an output kernel with its own
DV block (block_dv_o) compiles clean and the model knows its shared memory. GPU: forward() against
the fp64 oracle.
"""
from __future__ import annotations

import ast
import re

import pytest
from template_checks import (assert_compiles_as_modelled, assert_compiles_clean, assert_every_value_changes_source,
                             cuda, oracle_errors, rendered_config)

from tuner import space
from tuner import render as rendering
from tuner.candidate import Candidate, violations
from tuner.compile import build_kernels, load_kernels
from tuner.errors import ConstraintError
from tuner.problem import Problem
from tuner.screen import screen

KERNELS = {"fused": ["fused"], "chunked": ["chunk_wu", "chunk_state", "chunk_o"], "pre_seq": ["prepare", "sequential"]}
PLACEMENTS = ("system_in", "wu_in", "decay_in", "qk_in", "scores_in", "output_scores_in")
# The placements each split has (pre_seq keeps no W and no Q * exp(gc) tile; only the chunked split's
# output kernel has a placement of its score tile; output_scores_in is the role-split kernel's).
SPLIT_PLACEMENTS = {"fused": PLACEMENTS[:4], "chunked": PLACEMENTS[:5], "pre_seq": ("system_in", "decay_in")}
# The fastest pre_seq shape on the H200 and one with every pre_seq parameter off its default.
PRE_SEQ_FAST = {"split": "pre_seq", "block_dv": 32}
PRE_SEQ_ALL = {"split": "pre_seq", "block_dv": 64, "threads": 256, "solve": "doubling", "overlap": True,
               "prepare_chunks": 2}
# The H200 winner's form: the merged solve in the precompute kernel; and at 32-token chunks (one merge).
PRE_SEQ_MERGED = {"split": "pre_seq", "solve": "merged", "block_dv": 32}
PRE_SEQ_MERGED_32 = {**PRE_SEQ_MERGED, "chunk_size": 32}
# The sequential kernel as four warpgroups with roles (two ring buffers), after the merged solve.
PRE_SEQ_ROLES = {**PRE_SEQ_MERGED, "block_dv": 64, "sequential_roles": True, "num_stages": 2}
# Each variant's role-split form (delta.py.j2 writes both).
ROLES = {"gdn": PRE_SEQ_ROLES, "kda": {"split": "pre_seq", "block_dv": 64, "sequential_roles": True, "num_stages": 2}}
# Both precompute kernels with their Q and K tiles copied asynchronously (the role split's reads no Q).
PRE_SEQ_ROLES_ASYNC = {**PRE_SEQ_ROLES, "gc_loads": "once", "fast_math": True, "prepare_loads": "async"}
PRE_SEQ_MERGED_ASYNC = {**PRE_SEQ_MERGED, "prepare_loads": "async"}
# The role split's precompute kernel with its g and beta columns copied asynchronously too.
PRE_SEQ_ROLES_ASYNC_GATES = {**PRE_SEQ_ROLES_ASYNC, "prepare_loads": "async_gates"}
# Each sequence walked as segments in parallel: the role-split kernel (with the o store warp) and the one-warpgroup one.
PRE_SEQ_SEGMENTS = {"roles": {**PRE_SEQ_ROLES_ASYNC, "o_store": "store_warp", "segments": 4},
                    "one-warpgroup": {**PRE_SEQ_MERGED, "segments": 2}}
# The role-split kernel whose in-chunk scores and row weights come from the precompute kernel.
PRE_SEQ_ROLES_PREPARED_SCORES = {**PRE_SEQ_ROLES_ASYNC, "o_store": "store_warp", "output_scores": "prepare"}
# The role-split kernel whose values role forms AB V and W = AB diag(WQ) K before the state comes in.
PRE_SEQ_ROLES_VALUES_AHEAD = {**PRE_SEQ_ROLES_ASYNC, "o_store": "store_warp", "new_values": "ahead"}
# The chunked split at 256 threads: its output kernel takes the score tile from shared memory.
CHUNKED_256 = {"split": "chunked", "threads": 256, "scores_in": "shared"}


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("split", ["fused", "chunked", "pre_seq"])
def test_default_compiles_without_spills_or_screen_rejection(split, dim, tmp_path):
    assert_compiles_clean(rendered_config("gdn", dim, split=split), KERNELS[split], tmp_path)


def test_every_placement_is_tested():
    assert {name for name in space.load("gdn").params if name.endswith("_in")} == set(PLACEMENTS)


@pytest.mark.parametrize("split,placement", [(s, p) for s, ps in SPLIT_PLACEMENTS.items() for p in ps])
def test_every_placement_changes_the_code(split, placement):
    assert_every_value_changes_source("gdn", 128, placement, split=split)


def test_the_role_split_placement_changes_the_code():
    assert_every_value_changes_source("gdn", 128, "output_scores_in", **STORE_WARP["gdn"])


@pytest.mark.parametrize("param", ["solve", "overlap", "prepare_chunks", "prepare_loads", "prepare_grid"])
def test_every_pre_seq_parameter_changes_the_code(param):
    assert_every_value_changes_source("gdn", 128, param, split="pre_seq")


def test_pre_seq_sequential_kernel_solves_nothing_and_writes_only_o_and_the_state():
    source = rendered_config("gdn", 128, split="pre_seq").source
    sequential = source[source.index("def sequential"):source.index("def programs")]
    assert "T.cumsum" not in sequential and "x_col" not in sequential and "T.exp2" not in sequential
    written = set(re.findall(r"T\.copy\(.*, (\w+)\[", sequential))
    assert written == {"O", "HT"}


def test_pre_seq_every_parameter_compiles_clean_and_the_model_knows_its_shared_memory(tmp_path):
    rendered = rendered_config("gdn", 128, **PRE_SEQ_ALL)
    report = assert_compiles_clean(rendered, KERNELS["pre_seq"], tmp_path)
    smem = {k.name: k.dynamic_smem_bytes for k in report.kernels}
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == smem


@pytest.mark.parametrize("dim,overrides", [(128, PRE_SEQ_MERGED), (64, PRE_SEQ_MERGED), (128, PRE_SEQ_MERGED_32)],
                         ids=("128", "64", "128-chunk32"))
def test_merged_solve_compiles_clean_with_no_square_fp32_system_and_the_model_knows_its_shared_memory(
        dim, overrides, tmp_path):
    rendered = rendered_config("gdn", dim, **overrides)
    prepare = rendered.source[rendered.source.index("def prepare"):rendered.source.index("def sequential")]
    # The point of the form: no C x C fp32 copy of the system or its inverse in shared memory.
    assert "T.alloc_shared([C, C], ACCUM)" not in prepare and "L16_s" in prepare
    assert ("T.gemm(L32_s, T32_0_s" in prepare) == (overrides.get("chunk_size", 64) == 64)
    report = assert_compiles_clean(rendered, KERNELS["pre_seq"], tmp_path)
    smem = {k.name: k.dynamic_smem_bytes for k in report.kernels}
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == smem
    # Less shared memory than the column solve's precompute kernel, which keeps the system in fp32.
    column = assert_compiles_clean(rendered_config("gdn", dim, **{**overrides, "solve": "column"}),
                                   KERNELS["pre_seq"], tmp_path)
    assert smem["prepare"] < {k.name: k.dynamic_smem_bytes for k in column.kernels}["prepare"]


@pytest.mark.parametrize("decay_in", ["fragment", "shared"])
def test_merged_precompute_fills_its_decay_table_before_the_scores_read_it(decay_in):
    prepare = rendered_config("gdn", 128, **{**PRE_SEQ_MERGED, "decay_in": decay_in}).source
    prepare = prepare[prepare.index("def prepare"):prepare.index("def sequential")]
    # Filled once, before its first read (the H200 returned NaN in o when the scores came first).
    assert prepare.count("Gamma[i, j] = ") == 1
    assert prepare.index("Gamma[i, j] = ") < prepare.index("* Gamma[i, j]")


def test_merged_solve_is_refused_outside_the_precompute_kernel_and_in_registers_saying_why(tmp_path):
    gdn, problem = space.load("gdn"), Problem("gdn", 128, 128)
    for split in ("fused", "chunked"):
        reasons = violations(problem, gdn.complete(problem, {"split": split, "solve": "merged"}))
        assert any("only the precompute kernel" in r for r in reasons), reasons
    in_registers = gdn.complete(problem, {**PRE_SEQ_MERGED, "system_in": "fragment"})
    reasons = violations(problem, in_registers)
    assert len(reasons) == 1 and "StructuralEqual" in reasons[0], reasons
    # The truth behind the second: emitted without the constraint, TileLang refuses it with that error.
    report, _, _ = build_kernels(Candidate(problem, in_registers, rendering.render(problem, in_registers)),
                                 cache_dir=tmp_path)
    assert report.error and "StructuralEqual()(it->second.indices, indices)" in report.error, report.error


@pytest.mark.parametrize("dim,block_dv", [(128, 64), (64, 64), (128, 32)])
def test_role_split_kernel_compiles_clean_and_the_model_knows_its_roles_and_shared_memory(dim, block_dv, tmp_path):
    rendered = rendered_config("gdn", dim, **{**PRE_SEQ_ROLES, "block_dv": block_dv})
    report = assert_compiles_clean(rendered, KERNELS["pre_seq"], tmp_path)
    sequential = next(k for k in report.kernels if k.name == "sequential")
    assert sequential.threads == 512
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == {
        k.name: k.dynamic_smem_bytes for k in report.kernels}
    roles = next(k for k in rendered.kernels if k.name == "sequential").roles
    # State, new values, output and producer, 128 threads each, caps that share out 64 Ki registers.
    assert [r.threads for r in roles] == [128] * 4 and sum(r.register_cap for r in roles) == 512
    # The state role holds DK x block_dv fp32 over its 128 threads, values a C x block_dv tile, output
    # its C x C scores and then its C x block_dv output tile.
    assert [r.live_registers for r in roles] == [dim * block_dv / 128, 64 * block_dv / 128, 64 * 64 / 128, 0]
    # The output role computes the scores: the precompute kernel reads no Q and writes no scores.
    prepare = rendered.source[rendered.source.index("def prepare"):rendered.source.index("def sequential")]
    assert "Q:" not in prepare and "AQK" not in prepare and "GC:" in prepare
    assert not next(k for k in rendered.prediction.per_kernel if k.name == "sequential").spills


@pytest.mark.parametrize("dim,packed", [(128, False), (64, True)], ids=["k128-dense", "k64-packed"])
def test_the_role_split_producer_reads_each_gate_row_once_and_fast_math_is_the_sequential_kernels_alone(
        dim, packed, tmp_path):
    config = {**PRE_SEQ_ROLES, "gc_loads": "once", "fast_math": True, **({"packed": True} if packed else {})}
    rendered = rendered_config("gdn", dim, **config)
    per_weight = rendered_config("gdn", dim, **{**config, "gc_loads": "per_weight", "fast_math": False})
    kernel = lambda r: r.source[r.source.index("def sequential"):r.source.index("def programs")]  # noqa: E731
    # per_weight: four global gate reads per row (gc, WQ, twice WK); once: one, before the TMA copies
    assert kernel(per_weight).count("GC[") == 4 and kernel(rendered).count("GC[") == 1
    producer = kernel(rendered)[kernel(rendered).index("T.set_max_nreg(PRODUCER_REGISTERS"):]
    assert producer.index("GC[") < producer.index("T.tma_copy(")
    assert "T.exp2(gc_s[s, i] * LOG2E)" in producer
    start = rendered.source.index("def programs")
    programs = rendered.source[start:rendered.source.index("\n    ]", start)].split("\n")
    assert [("tl.enable_fast_math" in line) for line in programs if line.strip().startswith('("')] == [False, True]
    assert "tl.enable_fast_math" not in per_weight.source
    for candidate in (rendered, per_weight):
        assert_compiles_clean(candidate, KERNELS["pre_seq"], tmp_path / candidate.digest[:8])


def test_the_model_sees_a_role_starved_of_registers_as_ptxas_does(tmp_path):
    rendered = rendered_config("gdn", 128, **PRE_SEQ_ROLES)
    # The state role's 64 registers of state alone fill a cap of 64; the loader needs few.
    source = rendered.source.replace("STATE_REGISTERS = 168", "STATE_REGISTERS = 64").replace(
        "PRODUCER_REGISTERS = 56", "PRODUCER_REGISTERS = 24")
    starved = Candidate(rendered.problem, rendered.config, source)
    predicted = next(k for k in starved.prediction.per_kernel if k.name == "sequential")
    assert predicted.spills and predicted.budget == 64
    report, _, _ = build_kernels(starved, cache_dir=tmp_path)
    assert report.error is None, report.error
    assert next(k for k in report.kernels if k.name == "sequential").spill_stores > 0


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_role_split_kernel_needs_64_token_chunks_and_two_ring_buffers_saying_why_and_takes_packed_batches(variant):
    variant_space, problem = space.load(variant), Problem(variant, 128, 128)
    config = variant_space.complete(problem, ROLES[variant])
    assert not violations(problem, config)
    for change in ({"chunk_size": 32}, {"block_dv": 128}, {"num_stages": 1}, {"overlap": True},
                   {"warp_specialized": True}):
        reasons = violations(problem, {**config, **change})
        assert reasons and any("64 rows per warpgroup" in r for r in reasons), (change, reasons)
    packed = variant_space.complete(problem, {**ROLES[variant], "packed": True})
    assert not violations(problem, packed)
    # The gate compares it with the one-warpgroup kernel, unstaged; a config without it means one warpgroup.
    one_warpgroup = {**ROLES[variant], "sequential_roles": False, "num_stages": 0}
    assert variant_space.unstaged_twin(config) == variant_space.complete(problem, one_warpgroup)
    assert "sequential_roles" not in variant_space.normalise({**config, "sequential_roles": False})


@pytest.mark.parametrize("dim,packed", [(128, False), (64, True)])
def test_scores_from_the_precompute_kernel_leave_the_output_role_its_two_products(dim, packed, tmp_path):
    rendered = rendered_config("gdn", dim, **PRE_SEQ_ROLES_PREPARED_SCORES, **({"packed": True} if packed else {}))
    assert_compiles_as_modelled(rendered, KERNELS["pre_seq"], tmp_path)
    source = rendered.source
    prepare = source[source.index("def prepare"):source.index("def sequential")]
    kernel = source[source.index("def sequential"):source.index("return sequential")]
    output = kernel[kernel.index("T.set_max_nreg(OUTPUT_REGISTERS"):kernel.index("T.set_max_nreg(PRODUCER_REGISTERS")]
    producer = kernel[kernel.index("T.set_max_nreg(PRODUCER_REGISTERS"):kernel.index("elif tx < 448:")]
    # The precompute kernel reads Q and writes the scores and both row weights; the sequential kernel
    # reads them and no cumulative gate.
    assert all(f"{name}:" in prepare for name in ("Q", "WQ", "WK", "AQK")) and "GC:" not in prepare
    assert all(f"{name}:" in kernel for name in ("WQ", "WK", "AQK")) and "GC" not in kernel
    # The output role: Q S and A U only, A as the producer copied it; no exponential anywhere in the kernel.
    assert [line.strip().split("(")[1].split(",")[0] for line in output.splitlines() if "T.gemm(" in line] == [
        "Q_s[s", "Aqk_s[s"]
    assert "exp2" not in kernel and "T.tma_copy(AQK[" in producer
    # The row weights by the producer warp, zero past the end of the sequence, before the tile copies.
    assert producer.index("WQ[") < producer.index("T.tma_copy(") and "T.if_then_else(i <= last, WK[" in producer
    roles = next(k for k in rendered.kernels if k.name == "sequential").roles
    assert [r.live_registers for r in roles][2] == 64 * 64 / 128  # the output tile only, no C x C scores


def values_role(source: str) -> list[str]:
    """The stripped lines of the role-split kernel's values role."""
    kernel = source[source.index("def sequential"):source.index("return sequential")]
    role = kernel[kernel.index("T.set_max_nreg(VALUES_REGISTERS"):kernel.index("T.set_max_nreg(OUTPUT_REGISTERS")]
    return [line.strip() for line in role.splitlines()]


@pytest.mark.parametrize("variant,dim,packed", [("gdn", 128, False), ("gdn", 64, True), ("kda", 128, False),
                                                ("kda", 64, True)])
def test_new_values_ahead_leave_one_product_between_the_state_and_the_new_values(variant, dim, packed, tmp_path):
    overrides = {**STORE_WARP[variant], "new_values": "ahead"}
    if packed:  # whole-chunk tails: the rows past a sequence's end are the next sequence's
        overrides.update(packed=True, tail_loads="whole_chunks")
    rendered = rendered_config(variant, dim, **overrides)
    assert_compiles_as_modelled(rendered, KERNELS["pre_seq"], tmp_path)
    lines = values_role(rendered.source)
    products = [n for n, line in enumerate(lines) if line.startswith("T.gemm(")]
    state_in = lines.index(next(line for line in lines if line.startswith("T.barrier_wait(state_ready[b]")))
    # Before the state: AB V, then W = AB {diag(WQ) K | KW} 64 columns at a time; after it, W S alone.
    before = [lines[n] for n in products if n < state_in]
    assert before[0] == "T.gemm(Ab_s[s, :, :], V_s[s, :, :], U_f, clear_accum=True)"
    tile, slot = ("W_s", "") if variant == "gdn" else ("Kw_s", "s, ")
    assert before[1:] == [f"T.gemm(Ab_s[s, :, :], {tile}[{slot}:, {c}:{c + 64}], W_f, clear_accum=True)"
                          for c in range(0, dim, 64)]
    assert [lines[n] for n in products if n > state_in] == [f"T.gemm({tile}[{slot}:, :], S_s[b, :, :], U_f)"]
    # U = AB V - W S: W is stored negated over the tile it came from; no difference tile, no K S product.
    assert all(f"{tile}[{slot}i, {c} + k] = -W_f[i, k]" in lines for c in range(0, dim, 64))
    assert "Vr_s" not in rendered.source and "KS_f" not in rendered.source
    if variant == "gdn":
        assert ("W_s[i, k] = T.if_then_else(" in " ".join(lines)) == packed  # WQ * K, zero past the end
    if packed:  # the values (and kda's weighted keys) of the next sequence's rows zeroed before any product
        zeroed = lines.index("V_s[s, i, d] = 0")
        assert zeroed < products[0] and ("Kw_s[s, i, k] = 0" in lines) == (variant == "kda")
    roles = next(k for k in rendered.kernels if k.name == "sequential").roles
    # The values role holds U and 64 columns of W: no more registers than the on_state form's K S and U.
    assert roles[1].live_registers == 64 * 64 / 128 + 64 * 64 / 128


@pytest.mark.parametrize("dim,packed", [(128, False), (64, True)])
def test_scores_in_registers_feed_the_output_roles_product_from_registers(dim, packed, tmp_path):
    """output_scores_in=fragment: the scores the output role forms stay in registers, in the layout of
    the A operand of A U (a register-sourced wgmma), so no C x C tile is written, fenced and read back."""
    overrides = {**STORE_WARP["gdn"], "output_scores_in": "fragment", **({"packed": True} if packed else {})}
    rendered = rendered_config("gdn", dim, **overrides)
    report = assert_compiles_as_modelled(rendered, KERNELS["pre_seq"], tmp_path)
    kernel = rendered.source[rendered.source.index("def sequential"):rendered.source.index("return sequential")]
    output = kernel[kernel.index("T.set_max_nreg(OUTPUT_REGISTERS"):kernel.index("T.set_max_nreg(PRODUCER_REGISTERS")]
    assert "Attn_s" not in rendered.source and "Attn_f = T.alloc_fragment([C, C], DTYPE)" in kernel
    assert "T.gemm(Attn_f, U_s, acc_o)" in output
    # The scores are written to registers: the only fence left in the role is the one before the o hand-over.
    assert output.count("T.fence_proxy_async()") == 1
    cuda = next(k for k in report.kernels if k.name == "sequential").cuda_source
    assert cuda.count("wgmma_rs<") == 1 and "Attn_f[" in cuda
    shared = rendered_config("gdn", dim, **{**overrides, "output_scores_in": "shared"})
    assert shared.source == rendered_config("gdn", dim, **{k: v for k, v in overrides.items()
                                                           if k != "output_scores_in"}).source
    # The tile's 8 KB of shared memory less (modelled, and compiled as modelled above); the role holds the
    # bf16 scores beside QK while it forms them, then beside acc_o (QK is dead by then).
    smem = [next(k.smem_bytes for k in c.prediction.per_kernel if k.name == "sequential") for c in (shared, rendered)]
    assert smem[0] - smem[1] == 64 * 64 * 2
    roles = next(k for k in rendered.kernels if k.name == "sequential").roles
    assert roles[2].live_registers == (64 * 64 + 64 * 64 / 2) / 128


def tensor_map_swizzles(host_source: str) -> dict[str, int]:
    """The swizzle mode (CUtensorMapSwizzle: 0 none, 3 128 bytes) of each TMA tensor map a compiled
    kernel's host code creates, by the map's name."""
    swizzles = {}
    for tensor_map in re.finditer(r"void\* (\w+)_desc = stack_\d+;(.*?)TVMFFIFunctionCall", host_source, re.S):
        # cuTensorMapEncodeTiled's arguments after the map: dtype, rank, address, then per dimension the
        # size, stride, box and element stride, then interleave and swizzle.
        args = dict(re.findall(r"\[(\d+)\]\.v_int64\) = \(\(int64_t\)(\d+)\);", tensor_map.group(2)))
        swizzles[tensor_map.group(1)] = int(args[str(5 + 4 * int(args["2"]))])
    return swizzles


@pytest.mark.parametrize("variant,dim,packed", [("gdn", 128, False), ("kda", 64, True)])
def test_v_swizzle_has_tma_write_the_v_tile_swizzled_for_the_values_roles_reads(variant, dim, packed, tmp_path):
    """v_swizzle: the V tile, which the values role reads element by element, gets TileLang's swizzled
    layout, so the TMA copy that fills it swizzles 128 bytes (the tiles the tensor cores read do already)
    and the reads follow; false renders the earlier kernel."""
    overrides = {**STORE_WARP[variant], **({"packed": True, "tail_loads": "whole_chunks"} if packed else {})}
    plain, swizzled = (rendered_config(variant, dim, **overrides, v_swizzle=on) for on in (False, True))
    assert plain.source == rendered_config(variant, dim, **overrides).source
    assert "T.annotate_layout({V_s: tilelang.layout.make_swizzled_layout(V_s)})" in swizzled.source
    swizzles = {}
    for name, rendered in (("plain", plain), ("swizzled", swizzled)):
        assert_compiles_as_modelled(rendered, KERNELS["pre_seq"], tmp_path / name)
        _, _, kernels = build_kernels(rendered, cache_dir=tmp_path / name)
        swizzles[name] = tensor_map_swizzles(kernels["sequential"].get_host_source())
    assert swizzles["plain"]["V"] == 0 and swizzles["swizzled"]["V"] == 3
    assert {k: v for k, v in swizzles["plain"].items() if k != "V"} == \
        {k: v for k, v in swizzles["swizzled"].items() if k != "V"}


@pytest.mark.parametrize("variant,dim,packed", [("gdn", 128, False), ("gdn", 64, True), ("kda", 128, False)])
def test_values_loads_first_forms_the_difference_in_registers_and_stores_whole_tiles(variant, dim, packed, tmp_path):
    """values_loads=first: the values role's loops load from shared memory without a store between, the
    difference replacing K S in registers; each tile then goes out by one copy of the fragment (stmatrix),
    Vr, U and (gdn) WK * U."""
    overrides = {**STORE_WARP[variant], **({"packed": True, "tail_loads": "whole_chunks"} if packed else {})}
    inline, first = (rendered_config(variant, dim, **overrides, values_loads=v) for v in ("inline", "first"))
    assert inline.source == rendered_config(variant, dim, **overrides).source
    lines = values_role(first.source)
    copies = ["T.copy(KS_f, Vr_s)", "T.copy(U_f, U_s)"] + (["T.copy(U_f, Ud_s)"] if variant == "gdn" else [])
    assert [line for line in lines if line.startswith("T.copy(")] == copies
    assert not any(line.startswith(("Vr_s[", "U_s[", "Ud_s[")) for line in lines)
    assert any(line.startswith("KS_f[i, d] = ") and "V_s[s, i, d]" in line for line in lines)
    stmatrix = {}
    for name, rendered in (("inline", inline), ("first", first)):
        report = assert_compiles_as_modelled(rendered, KERNELS["pre_seq"], tmp_path / name)
        stmatrix[name] = next(k for k in report.kernels if k.name == "sequential").cuda_source.count("ptx_stmatrix")
    assert stmatrix["first"] - stmatrix["inline"] == len(copies)


@pytest.mark.parametrize("store_warp", [True, False])
def test_the_gate_warp_loads_gc_and_forms_the_row_weights_off_the_tma_warps_path(store_warp, tmp_path):
    """gc_loads=gate_warp: a warp of the producer's warpgroup of its own (beside the store warp, if any)
    loads gc into the ring slot and forms the row weights; the TMA warp only copies tiles; loaded[s]
    counts both warps' arrivals, which the screen checks against the threads that arrive."""
    overrides = {**PRE_SEQ_ROLES_ASYNC, "gc_loads": "gate_warp", "num_stages": 3,
                 **({"o_store": "store_warp"} if store_warp else {})}
    rendered = rendered_config("gdn", 128, **overrides)
    assert_compiles_as_modelled(rendered, KERNELS["pre_seq"], tmp_path)
    kernel = rendered.source[rendered.source.index("def sequential"):rendered.source.index("return sequential")]
    assert "loaded = T.alloc_barrier(arrive_count=[64] * NUM_STAGES)" in kernel
    tma = kernel[kernel.index("if tx < 416:"):kernel.index("elif tx < 448:")]
    gate = kernel[kernel.index(f"elif tx < {480 if store_warp else 448}:"):]
    assert "GC[" not in tma and "wq_s" not in tma and tma.count("T.tma_copy(") == 4
    assert "gc_s[s, i] = GC[" in gate and "wq_s[s, i] = " in gate and "wk_s[s, i] = " in gate
    assert tma.count("T.barrier_arrive(loaded[s])") == gate.count("T.barrier_arrive(loaded[s])") == 1
    # Counted for the TMA warp alone, the barrier would wait for arrivals that the gate warp's overrun.
    miscounted = Candidate(rendered.problem, rendered.config,
                           rendered.source.replace("arrive_count=[64] * NUM_STAGES", "arrive_count=[32] * NUM_STAGES"))
    report, _, _ = build_kernels(miscounted, cache_dir=tmp_path / "miscounted")
    assert [f.kind for f in report.rejected] == ["mbarrier_arrivals_not_its_count"]


@pytest.mark.parametrize("dim,extra", [(128, {}), (64, {"segments": 2})], ids=["dense", "segments"])
def test_gc_loads_tma_copies_head_major_gc_as_one_box_for_the_gate_warp(dim, extra, tmp_path):
    """gc_loads=tma: the precompute kernel writes gc head-major (a row per head, each packed sequence's
    part of it starting 16-byte aligned), the TMA
    warp copies a chunk's gc as one box first, on gc_landed (its 32 arrivals, which the screen checks),
    and the gate warp, which loads nothing from global memory, clamps the rows past the last valid one and
    forms the row weights; with segments the state pass reads the same layout by cp.async."""
    overrides = {**STORE_WARP["gdn"], "gc_loads": "tma", "num_stages": 3, **extra}
    rendered = rendered_config("gdn", dim, **overrides)
    kernels = KERNELS["pre_seq"] if not extra else ["prepare", "segment_state", "sequential"]
    report = assert_compiles_as_modelled(rendered, kernels, tmp_path)
    source = rendered.source
    kernel = source[source.index("def sequential"):source.index("return sequential")]
    packed = bool(extra)  # segments run the packed kernels
    layout = "T.Tensor([HV, SC], ACCUM)" if packed else "T.Tensor([B, H, SC], ACCUM)"
    assert source.count(f"GC: {layout},") == (3 if packed else 2)
    tma = kernel[kernel.index("if tx < 416:"):kernel.index("elif tx < 448:")]
    gate = kernel[kernel.index("elif tx < 480:"):]
    # Packed, each sequence's gc starts 16-byte aligned (a TMA box's innermost start must be).
    start = "(bos // 4 + n) * 4"
    box = f"hv, {start} + c * C:{start} + (c + 1) * C" if packed else "bb, bh, c * C:(c + 1) * C"
    copies = [line.strip() for line in tma.splitlines() if "T.tma_copy(" in line]
    assert copies[0] == f"T.tma_copy(GC[{box}], gc_s[s, :], barrier=gc_landed[s])" and len(copies) == 5
    assert "gc_landed = T.alloc_barrier(arrive_count=[32] * NUM_STAGES)" in kernel
    assert "GC[" not in gate and "T.barrier_wait(gc_landed[s]" in gate
    assert "gc_s[s, i] = gc_s[s, T.min(i, last)]" in gate and "wq_s[s, i] = " in gate
    if packed:
        assert f"T.async_copy(GC[hv, {start}:{start} + C]" in source[source.index("def segment_state"):]
    compiled = {k.name: k for k in report.kernels}
    _, _, built = build_kernels(rendered, cache_dir=tmp_path)
    assert tensor_map_swizzles(built["sequential"].get_host_source())["GC"] == 0
    rows = "HV, -(-(tokens + 4 * (bounds.shape[0] - 1)) // C) * C" if packed else "B, H, -(-T_len // C) * C"
    assert f"gc = torch.empty({rows}" in source
    cuda = compiled["sequential"].cuda_source
    wrong = cuda
    for slot in range(3):
        wrong = wrong.replace(f"gc_landed[{slot}].init(32);", f"gc_landed[{slot}].init(64);")
    assert wrong != cuda and any(f.kind == "mbarrier_arrivals_not_its_count" and f.rejects for f in screen(wrong))


# The role-split kernels (delta.py.j2's, gdn's and kda's) with o stored by a warp of its own.
STORE_WARP = {"gdn": {**PRE_SEQ_ROLES_ASYNC, "o_store": "store_warp"}, "kda": {**ROLES["kda"], "o_store": "store_warp"}}


@pytest.mark.parametrize("variant,dim,packed", [("gdn", 128, False), ("gdn", 64, True), ("kda", 128, False),
                                                ("kda", 64, True)])
def test_the_store_warp_takes_the_o_store_off_the_output_roles_path(variant, dim, packed, tmp_path):
    rendered = rendered_config(variant, dim, **STORE_WARP[variant], **({"packed": True} if packed else {}))
    report = assert_compiles_as_modelled(rendered, KERNELS["pre_seq"], tmp_path)
    kernel = rendered.source[rendered.source.index("def sequential"):rendered.source.index("return sequential")]
    output = kernel[kernel.index("T.set_max_nreg(OUTPUT_REGISTERS"):kernel.index("T.set_max_nreg(PRODUCER_REGISTERS")]
    store = kernel[kernel.index("elif tx < 448:"):]
    # The output role fills O_s[b] and copies no tile out; the store warp copies each whole chunk.
    assert "O_s[b, i, j] = acc_o[i, j] * scale" in output and "T.copy(O_s" not in output
    copies = [line.strip() for line in store.splitlines() if "T.copy(" in line]
    assert len(copies) == 1 and copies[0].startswith("T.copy(O_s[b, :, :], O[")
    if packed:  # a sequence's last, partial chunk: stored row by row by the output role, not by the warp
        assert "if (c + 1) * C > seqlen:" in output and "if (c + 1) * C <= seqlen:" in store
    else:
        assert "O[" not in output
    # Two buffers, each handed over by the output role's 128 threads and given back by the warp's 32.
    assert "output_ready = T.alloc_barrier(arrive_count=[128] * 2)" in kernel
    assert "output_free = T.alloc_barrier(arrive_count=[32] * 2)" in kernel
    cuda = next(k for k in report.kernels if k.name == "sequential").cuda_source
    wrong = cuda.replace("output_free[0].init(32);", "output_free[0].init(64);").replace(
        "output_free[1].init(32);", "output_free[1].init(64);")
    assert wrong != cuda and any(f.kind == "mbarrier_arrivals_not_its_count" and f.rejects for f in screen(wrong))


@pytest.mark.parametrize("overrides", [PRE_SEQ_ROLES_ASYNC, PRE_SEQ_MERGED_ASYNC], ids=["roles", "merged"])
def test_asynchronous_precompute_loads_compile_clean_and_land_before_the_first_product(overrides, tmp_path):
    rendered = rendered_config("gdn", 128, **overrides)
    assert_compiles_as_modelled(rendered, KERNELS["pre_seq"], tmp_path)
    body = rendered.source[rendered.source.index("def prepare"):rendered.source.index("return prepare")]
    lines = [line.strip() for line in body.splitlines()]
    copies = [n for n, line in enumerate(lines) if line.startswith("T.async_copy(")]
    tiles = ["K"] if overrides.get("sequential_roles") else ["Q", "K"]
    assert [lines[n][len("T.async_copy("):].split("[")[0] for n in copies] == tiles
    gates = [n for n, line in enumerate(lines) if line.startswith(("T.copy(G[", "T.copy(Beta["))]
    wait = lines.index("T.ptx_wait_group(0)")
    first_product = next(n for n, line in enumerate(lines) if line.startswith("T.gemm("))
    # The tiles are issued first, the gate loads and their sum run under them, the wait comes before any product.
    assert max(copies) < min(gates) and max(gates) < lines.index("T.cumsum(g_s, gc_s, dim=0)") < wait < first_product


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_asynchronous_gate_loads_issue_g_and_beta_behind_the_tile_and_wait_once_before_the_sum(packed, tmp_path):
    rendered = rendered_config("gdn", 128, **PRE_SEQ_ROLES_ASYNC_GATES, packed=packed)
    assert_compiles_as_modelled(rendered, KERNELS["pre_seq"], tmp_path)
    body = rendered.source[rendered.source.index("def prepare"):rendered.source.index("return prepare")]
    lines = [line.strip() for line in body.splitlines()]
    copies = [n for n, line in enumerate(lines) if line.startswith("T.async_copy(")]
    assert [lines[n][len("T.async_copy("):].split("[")[0] for n in copies] == ["K", "G", "Beta"]
    # No synchronous copy of the gate columns is left (packed: only a sequence's partial chunk loads by element).
    assert not [line for line in lines if line.startswith(("T.copy(G[", "T.copy(Beta["))]
    assert max(copies) < lines.index("T.ptx_wait_group(0)") < lines.index("T.cumsum(g_s, gc_s, dim=0)")
    assert lines.count("T.ptx_wait_group(0)") == 1


@pytest.mark.parametrize("variant,overrides", [("gdn", PRE_SEQ_ROLES_ASYNC), ("kda", {**ROLES["kda"], "prepare_loads": "async"}),
                                               ("gdn", {**PRE_SEQ_ROLES_ASYNC, "packed": True}),
                                               ("kda", {**ROLES["kda"], "packed": True}), ("gdn", {"split": "pre_seq", "prepare_chunks": 2})],
                         ids=["gdn", "kda", "gdn-packed", "kda-packed", "gdn-two-chunks"])
def test_heads_first_precompute_grid_swaps_only_the_grids_dimensions(variant, overrides, tmp_path):
    rendered = rendered_config(variant, 128, **overrides, prepare_grid="heads_first")
    plain = rendered_config(variant, 128, **overrides)
    assert_compiles_as_modelled(rendered, KERNELS["pre_seq"], tmp_path)
    launch = re.compile(r"^\s*with T\.Kernel\((.*)\) as \((.*)\):$", re.M)
    swapped, kept = launch.findall(rendered.source), launch.findall(plain.source)
    # The precompute kernel's first two grid dimensions and their indices trade places; nothing else changes.
    def arguments(text):  # the grid's extents (threads= last) or its index names
        return [ast.unparse(a) for a in ast.parse(f"f({text})", mode="eval").body.args]

    (dims, names), (plain_dims, plain_names) = swapped[0], kept[0]
    assert arguments(dims)[:2] == arguments(plain_dims)[:2][::-1] and arguments(dims)[2:] == arguments(plain_dims)[2:]
    assert dims.endswith("threads=THREADS") and plain_dims.endswith("threads=THREADS")
    assert arguments(names)[:2] == arguments(plain_names)[:2][::-1]
    assert arguments(names)[0] in ("bh", "hv") and swapped[1:] == kept[1:]
    def body_without_launch(source):
        body = source[source.index("def prepare"):source.index("return prepare")]
        return [line for line in launch.sub("", body).splitlines() if "The head index runs fastest" not in line]

    assert body_without_launch(rendered.source) == body_without_launch(plain.source)


def test_pre_seq_parameters_do_not_apply_to_the_other_splits():
    gdn = space.load("gdn")
    for name in ("overlap", "prepare_chunks", "sequential_roles"):
        assert not gdn.active(name, {"split": "chunked"}) and gdn.active(name, {"split": "pre_seq"})
    assert not gdn.active("qk_in", {"split": "pre_seq"}) and not gdn.active("wu_in", {"split": "pre_seq"})


def test_constraint_breaking_config_refused_before_rendering(monkeypatch):
    def no_render():
        raise AssertionError("the template was loaded for a refused config")

    monkeypatch.setattr(rendering, "jinja_environment", no_render)
    problem = Problem("gdn", 64, 64, "bf16")
    with pytest.raises(ConstraintError, match="block_dv must divide DV"):
        Candidate.from_config(problem, {**space.load("gdn").default(problem), "block_dv": 128})


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_overlap_needs_64_token_chunks_and_tilelang_refuses_it_at_32(variant, tmp_path):
    problem = Problem(variant, 128, 128)
    sp = space.load(variant)
    config = sp.complete(problem, {"split": "pre_seq", "overlap": True, "chunk_size": 32})
    reasons = violations(problem, config)
    assert len(reasons) == 1 and "64 rows per warpgroup" in reasons[0], reasons
    assert not violations(problem, {**config, "chunk_size": 64})
    # The truth behind the constraint: the template as emitted without it does not compile.
    report, _, _ = build_kernels(Candidate(problem, config, rendering.render(problem, config)), cache_dir=tmp_path)
    assert report.error and "T.wgmma_gemm() requires Hopper WGMMA lowering" in report.error, report.error


def test_an_output_block_of_its_own_compiles_clean_and_the_model_knows_its_shared_memory(tmp_path):
    rendered = rendered_config("gdn", 64, split="chunked", block_dv=16, block_dv_o=64)
    assert "BLOCK_DV_O = 64" in rendered.source and "(DV // BLOCK_DV_O)" in rendered.source
    report = assert_compiles_clean(rendered, KERNELS["chunked"], tmp_path)
    smem = {k.name: k.dynamic_smem_bytes for k in report.kernels}
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == smem
    # Only the output kernel's tiles widen: the state pass keeps its 16 columns.
    narrow = {k.name: k.smem_bytes for k in Candidate.from_config(
        rendered.problem, {**rendered.config, "block_dv_o": 16}).prediction.per_kernel}
    assert narrow["chunk_state"] == smem["chunk_state"] and narrow["chunk_o"] < smem["chunk_o"]


@pytest.mark.parametrize("dim", [64, 128])
def test_the_chunked_split_runs_256_threads_with_the_score_tile_in_shared_memory(dim, tmp_path):
    rendered = rendered_config("gdn", dim, **CHUNKED_256)
    assert "Attn = T.alloc_shared([C, C], DTYPE)" in rendered.source and "THREADS = 256" in rendered.source
    report = assert_compiles_clean(rendered, KERNELS["chunked"], tmp_path)
    smem = {k.name: k.dynamic_smem_bytes for k in report.kernels}
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == smem
    # With the tile in registers TileLang finds no layout at 256 threads: the space refuses it, saying why.
    gdn, problem = space.load("gdn"), Problem("gdn", dim, dim)
    in_registers = gdn.complete(problem, {**CHUNKED_256, "scores_in": "fragment"})
    assert any("Layout infer conflict" in r for r in violations(problem, in_registers))
    assert not violations(problem, gdn.complete(problem, CHUNKED_256))


def test_the_score_tile_placement_leaves_every_earlier_config_as_it_was():
    gdn = space.load("gdn")
    assert gdn.normalise({**gdn._defaults(), "scores_in": "fragment"}) == gdn.normalise(gdn._defaults())
    assert "scores_in" not in gdn.normalise({**gdn._defaults(), "split": "pre_seq", "scores_in": "shared"})


@cuda
@pytest.mark.parametrize("split,overrides", [("fused", {}), ("chunked", {}), ("chunked", {"block_dv_o": 64}),
                                             ("pre_seq", PRE_SEQ_FAST), ("pre_seq", PRE_SEQ_ALL),
                                             ("chunked", {"solve": "doubling"}), ("chunked", CHUNKED_256),
                                             ("pre_seq", PRE_SEQ_MERGED), ("pre_seq", PRE_SEQ_MERGED_32),
                                             ("pre_seq", PRE_SEQ_ROLES), ("pre_seq", {**PRE_SEQ_MERGED, "decay_in": "shared"}),
                                             ("pre_seq", PRE_SEQ_ROLES_ASYNC), ("pre_seq", PRE_SEQ_MERGED_ASYNC),
                                             ("pre_seq", STORE_WARP["gdn"]),
                                             ("pre_seq", {**PRE_SEQ_ROLES_ASYNC, "prepare_grid": "heads_first"}),
                                             ("pre_seq", PRE_SEQ_ROLES_ASYNC_GATES),
                                             ("pre_seq", PRE_SEQ_SEGMENTS["roles"]),
                                             ("pre_seq", PRE_SEQ_SEGMENTS["one-warpgroup"]),
                                             ("pre_seq", PRE_SEQ_ROLES_PREPARED_SCORES),
                                             ("pre_seq", {**PRE_SEQ_ROLES_PREPARED_SCORES, "segments": 4}),
                                             ("pre_seq", PRE_SEQ_ROLES_VALUES_AHEAD),
                                             ("pre_seq", {**PRE_SEQ_ROLES_VALUES_AHEAD, "segments": 4}),
                                             ("pre_seq", {**STORE_WARP["gdn"], "output_scores_in": "fragment"}),
                                             ("pre_seq", {**STORE_WARP["gdn"], "output_scores_in": "fragment",
                                                          "v_swizzle": True}),
                                             ("pre_seq", {**PRE_SEQ_MERGED, "v_swizzle": True}),
                                             ("pre_seq", {**PRE_SEQ_SEGMENTS["one-warpgroup"], "v_swizzle": True}),
                                             ("pre_seq", {**STORE_WARP["gdn"], "output_scores_in": "fragment",
                                                          "v_swizzle": True, "values_loads": "first"}),
                                             ("pre_seq", {**PRE_SEQ_ROLES_VALUES_AHEAD, "values_loads": "first"}),
                                             ("pre_seq", {**STORE_WARP["gdn"], "gc_loads": "gate_warp", "num_stages": 3}),
                                             ("pre_seq", {**PRE_SEQ_ROLES_ASYNC, "gc_loads": "gate_warp"}),
                                             ("pre_seq", {**STORE_WARP["gdn"], "gc_loads": "tma", "num_stages": 3}),
                                             ("pre_seq", {**PRE_SEQ_SEGMENTS["roles"], "gc_loads": "tma"})],
                         ids=("fused", "chunked", "chunked-block_dv_o", "pre_seq", "pre_seq-all", "chunked-doubling",
                              "chunked-256", "pre_seq-merged", "pre_seq-merged-32", "pre_seq-roles",
                              "pre_seq-merged-table", "pre_seq-roles-async", "pre_seq-merged-async",
                              "pre_seq-roles-store-warp", "pre_seq-roles-heads-first", "pre_seq-roles-async-gates",
                              "pre_seq-roles-segments", "pre_seq-segments", "pre_seq-roles-prepared-scores",
                              "pre_seq-roles-prepared-scores-segments", "pre_seq-roles-values-ahead",
                              "pre_seq-roles-values-ahead-segments", "pre_seq-roles-scores-in-registers",
                              "pre_seq-roles-v-swizzled", "pre_seq-merged-v-swizzled", "pre_seq-segments-v-swizzled",
                              "pre_seq-roles-values-loads-first", "pre_seq-roles-values-ahead-values-loads-first",
                              "pre_seq-roles-gate-warp-store-warp", "pre_seq-roles-gate-warp",
                              "pre_seq-roles-gc-tma-store-warp", "pre_seq-roles-gc-tma-segments"))
def test_forward_matches_fp64_oracle(split, overrides):
    assert_matches_oracle(rendered_config("gdn", 64, **{"split": split, **overrides}))


@cuda
@pytest.mark.parametrize("overrides", [PRE_SEQ_ROLES_VALUES_AHEAD], ids=["pre_seq-roles-values-ahead-dk128"])
def test_values_ahead_at_dk_128_matches_fp64_oracle(overrides):
    """At DK 128 the values role forms W in two halves of 64 columns, the second read from the second
    swizzled panel of its tile (DK 64 has one)."""
    assert_matches_oracle(rendered_config("gdn", 128, **{"split": "pre_seq", **overrides}))


def assert_matches_oracle(rendered):
    module, compiled = load_kernels(rendered)
    # T a multiple of C, a tail, a tail with an initial state, and strong decay (with 4 segments: empty
    # ones after a short sequence's first, and segments of several chunks at T 1000).
    cases = ((128, "default"), (200, "default"), (77, "initial_state"), (150, "alpha0.5"))
    if rendered.config.get("segments", 1) > 1:
        cases += ((1000, "initial_state"), (700, "alpha0.5"))
    for seqlen, regime in cases:
        oracle_errors(module, compiled, rendered, regime, seqlen)
