"""The per-channel gate templates (gla, kda): defaults (and kda's chunked and pre_seq splits, gla's pre_seq
split) compile for sm_90a without spills (ptxas), placements change the generated code, constraints refuse
before rendering, the pre_seq sequential kernels scan no gate and write only o and the final state,
the model knows its shared memory, and on a GPU every split (kda's chunked one also with an output
kernel's own DV block, gla's pre_seq one also off its defaults) matches the fp64 chunked oracle with
and without the 0.9 lower bound on the gate, tails and initial state included."""
from __future__ import annotations

import math
import re

import pytest
from template_checks import (assert_compiles_as_modelled, assert_compiles_clean, assert_every_value_changes_source,
                             cuda, oracle_errors, rendered_config)

from tuner import space
from tuner.compile import load_kernels
from tuner.errors import ConstraintError
from tuner.problem import Problem
from tuner.candidate import Candidate, violations

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
# kda's sequential kernel as four warpgroups with roles (two ring buffers); its precompute kernel's Q, K
# and g tiles copied asynchronously.
KDA_PRE_SEQ_ROLES = {"split": "pre_seq", "block_dv": 64, "sequential_roles": True, "num_stages": 2}
KDA_PRE_SEQ_ROLES_STORE_WARP = {**KDA_PRE_SEQ_ROLES, "o_store": "store_warp"}
# Its values role forming AB V and W = AB KW before the state comes in.
KDA_PRE_SEQ_ROLES_VALUES_AHEAD = {**KDA_PRE_SEQ_ROLES_STORE_WARP, "new_values": "ahead"}
# Its V tile swizzled (the values role reads it element by element).
KDA_PRE_SEQ_ROLES_V_SWIZZLED = {**KDA_PRE_SEQ_ROLES_STORE_WARP, "v_swizzle": True}
# kda's sequences walked as segments in parallel: the role-split kernel and the one-warpgroup one.
KDA_PRE_SEQ_ROLES_SEGMENTS = {**KDA_PRE_SEQ_ROLES_STORE_WARP, "prepare_loads": "async", "segments": 4}
KDA_PRE_SEQ_SEGMENTS = {"split": "pre_seq", "segments": 2}
KDA_PRE_SEQ_ASYNC = {"split": "pre_seq", "prepare_loads": "async"}
# kda's precompute kernel with the blocks within each sub-chunk summed term by term.
KDA_PRE_SEQ_ELEMENTWISE = {"split": "pre_seq", "diagonal_blocks": "elementwise"}
# kda's precompute kernel with each sub-chunk's score products on its own rows.
KDA_PRE_SEQ_SUB_CHUNK_ROWS = {"split": "pre_seq", "score_rows": "sub_chunk"}
# kda's (and gla's) precompute kernel scanning its gate with a thread per channel.
PRE_SEQ_CHANNEL_SCAN = {"split": "pre_seq", "gate_scan": "per_channel"}
# kda's precompute kernel with its score factors staged in bf16.
KDA_PRE_SEQ_BF16_OPERANDS = {"split": "pre_seq", "score_operands": "bfloat16"}
# kda's precompute kernel with its row factors formed once a chunk (whole rows of DK: block_dk = DK).
KDA_PRE_SEQ_ROWS_ONCE = {"split": "pre_seq", "row_factors": "once"}
# gla's precompute kernel with the blocks within each sub-chunk by products; with its row factors formed once
# (whole rows of DK: block_dk = DK).
GLA_PRE_SEQ_PRODUCTS = {"split": "pre_seq", "diagonal_blocks": "products"}
GLA_PRE_SEQ_ROWS_ONCE = {**GLA_PRE_SEQ_PRODUCTS, "row_factors": "once"}
# gla's precompute kernel with its Q, K and g tiles copied asynchronously.
GLA_PRE_SEQ_ASYNC = {**GLA_PRE_SEQ_PRODUCTS, "prepare_loads": "async"}


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
    assert_compiles_as_modelled(rendered, ["prepare", "segment_state", "sequential"], tmp_path)


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


@pytest.mark.parametrize("variant,overrides", [("gla", {}), ("kda", {}), ("kda", KDA_PRE_SEQ_ROLES)],
                         ids=["gla", "kda", "kda-roles"])
def test_pre_seq_sequential_kernel_scans_no_gate_and_writes_only_o_and_the_state(variant, overrides):
    source = rendered_config(variant, 128, **{"split": "pre_seq", **overrides}).source
    sequential = source[source.index("def sequential"):source.index("def programs")]
    assert "T.cumsum" not in sequential and "T.exp2" not in sequential and "T.if_then_else" not in sequential
    # The role-split kernel also hands the state to its other roles through shared memory.
    shared = {"S_s"} if overrides.get("sequential_roles") else set()
    assert set(re.findall(r"T\.copy\(.*, (\w+)\[", sequential)) == {"O", "HT"} | shared


@pytest.mark.parametrize("dk,block_dv", [(128, 64), (64, 64), (128, 32)])
def test_kda_role_split_kernel_compiles_clean_and_the_model_knows_its_roles_and_shared_memory(dk, block_dv, tmp_path):
    rendered = rendered_config("kda", dk, **{**KDA_PRE_SEQ_ROLES, "block_dv": block_dv})
    report = assert_compiles_clean(rendered, ["prepare", "sequential"], tmp_path)
    assert next(k for k in report.kernels if k.name == "sequential").threads == 512
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == {
        k.name: k.dynamic_smem_bytes for k in report.kernels}
    roles = next(k for k in rendered.kernels if k.name == "sequential").roles
    # State, new values, output and producer, 128 threads each, caps that share out 64 Ki registers.
    assert [r.threads for r in roles] == [128] * 4 and sum(r.register_cap for r in roles) == 512
    # The state role holds DK x block_dv fp32 over its 128 threads, values and output a C x block_dv tile
    # each (the output role forms no scores: the precompute kernel wrote them).
    assert [r.live_registers for r in roles] == [dk * block_dv / 128, 64 * block_dv / 128, 64 * block_dv / 128, 0]
    assert not next(k for k in rendered.prediction.per_kernel if k.name == "sequential").spills
    # Only the sequential kernel changes: the precompute kernel is the one-warpgroup form's, byte for byte.
    one_warpgroup = rendered_config("kda", dk, **{**KDA_PRE_SEQ_ROLES, "block_dv": block_dv,
                                                  "sequential_roles": False, "num_stages": 0}).source
    prepare = lambda source: source[source.index("def prepare"):source.index("return prepare")]  # noqa: E731
    assert prepare(rendered.source) == prepare(one_warpgroup)
    # The producer loads the six tiles of a chunk by TMA and the chunk's GL row by element loads.
    producer = rendered.source[rendered.source.index("T.set_max_nreg(PRODUCER_REGISTERS"):]
    assert re.findall(r"T\.tma_copy\((\w+)\[", producer) == ["QG", "KW", "KG", "V", "AB", "AQK"]
    assert "gl_s[s, d] = GL[bb, c, bh, d]" in producer


@pytest.mark.parametrize("dk,packed", [(128, False), (64, True)], ids=["k128-dense", "k64-packed"])
def test_kda_asynchronous_precompute_loads_compile_clean_and_land_before_the_gates_scan(dk, packed, tmp_path):
    rendered = rendered_config("kda", dk, **KDA_PRE_SEQ_ASYNC, **({"packed": True} if packed else {}))
    assert_compiles_as_modelled(rendered, ["prepare", "sequential"], tmp_path)
    prepare = rendered.source[rendered.source.index("def prepare"):rendered.source.index("return prepare")]
    copies = [m.start() for m in re.finditer(r"T\.async_copy\(", prepare)]
    assert [prepare[i:].split("[", 1)[0] for i in copies] == ["T.async_copy(Q", "T.async_copy(K", "T.async_copy(G"]
    # beta loads under the copies; the wait comes before the scan, the first reader of a copied tile.
    beta, wait, scan = (prepare.index(s) for s in ("beta_s[i] = ", "T.ptx_wait_group(0)", "T.cumsum("))
    assert copies[-1] < beta < wait < scan
    if packed:  # a sequence's last, partial chunk loads through the mask
        assert prepare.count("if (c + 1) * C <= seqlen:") == 3
    # Several chunks per precompute block pipeline their loads already: refused, saying why.
    problem, kda = Problem("kda", dk, dk), space.load("kda")
    reasons = violations(problem, kda.complete(problem, {**KDA_PRE_SEQ_ASYNC, "prepare_chunks": 2}))
    assert any("written for one chunk per block" in r for r in reasons), reasons


@pytest.mark.parametrize("dk,overrides", [(128, {}), (64, {}), (128, {"packed": True, "prepare_loads": "async"})],
                         ids=["k128", "k64", "k128-packed-async"])
def test_kda_elementwise_diagonal_compiles_clean_and_takes_one_exponential_per_term(dk, overrides, tmp_path):
    rendered = rendered_config("kda", dk, **KDA_PRE_SEQ_ELEMENTWISE, **overrides)
    assert_compiles_as_modelled(rendered, ["prepare", "sequential"], tmp_path)
    prepare = rendered.source[rendered.source.index("def prepare"):rendered.source.index("return prepare")]
    # The products start at the second sub-chunk and take the earlier sub-chunks' columns only ...
    assert "for a in T.serial(1, C // SUB):" in prepare and "i // SUB < a," in prepare and "i // SUB <= a" not in prepare
    # ... and the sums within a sub-chunk share one exponential between the two score tiles.
    sums = prepare[prepare.index("for i, jj in T.Parallel(C, SUB):"):prepare.index("Dk_s[i, jj] = ")]
    assert sums.count("T.exp2(") == 1 and "score_q += " in sums and "score_k += " in sums
    for tile, sums_tile in (("Aqk", "Dq_s"), ("Akk", "Dk_s")):
        assert f"{tile}[i, j] = T.if_then_else(j // SUB == i // SUB, {sums_tile}[i, j % SUB], {tile}[i, j])" in prepare
    # One sub-chunk per chunk would leave no product: refused, saying why.
    problem = Problem("kda", dk, dk)
    whole = space.load("kda").complete(problem, {**KDA_PRE_SEQ_ELEMENTWISE, "sub_chunk": 64})
    assert any("leaves no product" in r for r in violations(problem, whole))


@pytest.mark.parametrize("dk,overrides", [(128, {}), (64, {"diagonal_blocks": "elementwise"}),
                                          (128, {"packed": True, "prepare_loads": "async", "sub_chunk": 32}),
                                          (128, {"threads": 128, "block_dk": 64}), (64, {"chunk_size": 32, "threads": 128})],
                         ids=["k128", "k64-elementwise", "k128-packed-async-sub32", "k128-threads128-bk64",
                              "k64-c32-threads128"])
def test_kda_sub_chunk_score_rows_compile_clean_and_multiply_only_their_own_rows(dk, overrides, tmp_path):
    rendered = rendered_config("kda", dk, **KDA_PRE_SEQ_SUB_CHUNK_ROWS, **overrides)
    assert_compiles_as_modelled(rendered, ["prepare", "sequential"], tmp_path)
    prepare = rendered.source[rendered.source.index("def prepare"):rendered.source.index("return prepare")]
    # The query-side factors are one sub-chunk's rows (no condition: every factor <= 1) ...
    assert "Xq_s = T.alloc_shared([SUB, BLOCK_DK], ACCUM)" in prepare
    assert "for i, d in T.Parallel(SUB, BLOCK_DK):" in prepare and "Q_s[a * SUB + i, kb * BLOCK_DK + d]" in prepare
    # ... the keys past the sub-chunk's end (its own keys too with the elementwise diagonal) are set to zero
    # in a branch of their own, so their overflowing exponentials are never taken ...
    keys = prepare[prepare.index("for i, d in T.Parallel(C, BLOCK_DK):"):prepare.index("T.gemm(Xq_s")]
    earlier = overrides.get("diagonal_blocks") == "elementwise"
    assert f"if i // SUB {'<' if earlier else '<='} a:" in keys and "else:\n" in keys and "Kr_s[i, d] = 0.0" in keys
    assert "T.if_then_else" not in keys
    # ... and each sub-chunk's products fill SUB x C accumulators, merged into the chunk's scores by row.
    assert "T.gemm(Xq_s, Kr_s, Aqk_rows, transpose_B=True)" in prepare
    assert "T.gemm(Xk_s, Kr_s, Akk_rows, transpose_B=True)" in prepare
    for tile in ("Aqk", "Akk"):
        assert f"{tile}[i, j] = T.if_then_else(i // SUB == a, {tile}_rows_s[i % SUB, j], {tile}[i, j])" in prepare
    # Half the shared memory of the chunk-row products at the default block_dk: two blocks fit an SM at DK 128.
    if (dk, overrides) == (128, {}):
        chunk_rows = rendered_config("kda", dk, split="pre_seq").prediction.per_kernel[0].smem_bytes
        assert rendered.prediction.per_kernel[0].smem_bytes < chunk_rows < 228 * 1024 // 2 - 1024 < 2 * rendered.prediction.per_kernel[0].smem_bytes + 2048


@pytest.mark.parametrize("variant,dk,overrides,kernels", [
    ("kda", 128, {}, ["prepare", "sequential"]), ("kda", 64, {"prepare_chunks": 2}, ["prepare", "sequential"]),
    ("kda", 128, {"packed": True, "prepare_loads": "async", "score_rows": "sub_chunk"}, ["prepare", "sequential"]),
    ("gla", 128, {}, ["prepare", "sequential"]), ("gla", 128, {"packed": True}, ["prepare", "sequential"]),
    ("gla", 64, {"split": "segmented"}, ["prepare", "segment_state", "sequential"])],
    ids=["kda-k128", "kda-k64-two-chunks", "kda-k128-packed-async-sub-chunk-rows", "gla-k128", "gla-k128-packed",
         "gla-k64-segmented"])
def test_per_channel_gate_scan_compiles_clean_and_walks_the_rows_in_one_thread(variant, dk, overrides, kernels,
                                                                                tmp_path):
    rendered = rendered_config(variant, dk, **{**PRE_SEQ_CHANNEL_SCAN, **overrides})
    report = assert_compiles_as_modelled(rendered, kernels, tmp_path)
    prepare = rendered.source[rendered.source.index("def prepare"):rendered.source.index("return prepare")]
    assert "T.cumsum(" not in prepare
    gam = "gam_s" if overrides.get("prepare_chunks", 1) > 1 else "G_s"
    scan = [line.strip() for line in prepare[prepare.index("gate_sum = T.alloc_var(ACCUM)"):].splitlines()[:6]]
    assert scan == ["gate_sum = T.alloc_var(ACCUM)", "for d in T.Parallel(DK):", "gate_sum = 0.0",
                    "for i in T.unroll(C):", "gate_sum += G_s[i, d]", f"{gam}[i, d] = gate_sum"]
    # In CUDA: the first DK threads, one channel each, the running sum in a register; consecutive threads
    # read consecutive floats of a row, so no two lanes of a warp share a bank.
    cuda_source = next(k.cuda_source for k in report.kernels if k.name == "prepare")
    assert re.search(rf"if \(\(\(int\)threadIdx\.x\) < {dk}\) {{\s*gate_sum = 0x0p\+0f", cuda_source)
    assert re.search(rf"gate_sum = \(gate_sum \+ \(\(float\*\)G_s\)\[\(\((?:i_\d+ \* {dk}|\d+)\) \+ \(\(int\)threadIdx\.x\)\)\]\);",
                     cuda_source)


@pytest.mark.parametrize("dk,overrides", [(128, {"score_operands": "bfloat16"}), (128, {}),
                                          (64, {"score_operands": "bfloat16", "solve": "blocked", "threads": 128}),
                                          (128, {"score_operands": "bfloat16", "packed": True, "prepare_loads": "async",
                                                 "gate_scan": "per_channel"})],
                         ids=["k128-bf16", "k128-fp32", "k64-bf16-blocked-threads128", "k128-bf16-packed-async-scan"])
def test_kda_rows_once_compile_as_modelled_and_form_each_row_factor_once(dk, overrides, tmp_path):
    rendered = rendered_config("kda", dk, **KDA_PRE_SEQ_ROWS_ONCE, block_dk=dk, **overrides)
    assert_compiles_as_modelled(rendered, ["prepare", "sequential"], tmp_path)
    prepare = rendered.source[rendered.source.index("def prepare"):rendered.source.index("return prepare")]
    stage = '"bfloat16"' if overrides.get("score_operands") == "bfloat16" else "ACCUM"
    for tile in ("Xq_s", "Xk_s", "Kd_s", "Kr_s"):
        assert f"{tile} = T.alloc_shared([C, DK], {stage})" in prepare
    # No C x C score accumulator: one product fragment, its rows stored where they are kept.
    assert "P_f = T.alloc_fragment([C, C], ACCUM)" in prepare and "Aqk = T.alloc_fragment" not in prepare
    # Every exponential of the factors against the row's own sub-chunk start comes before the loop over
    # sub-chunks, once, a statement each; inside it the keys are rescaled to sub-chunk a's start by the
    # references alone (gamma's tile is no longer read), the later ones set to zero in a branch of their own.
    rows, loop = prepare.split("for a in T.serial(C // SUB):", 1)
    rows = rows[rows.index("# Every row against its own"):]
    assert rows.count("for i, d in T.Parallel(C, DK):") == 3
    assert "Xq_s[i, d] = T.Cast(ACCUM, Q_s[i, d]) * T.exp2((G_s[i, d] - G_s[i // SUB * SUB, d]) * LOG2E)" in rows
    assert "Kd_s[i, d] = T.Cast(ACCUM, K_s[i, d]) * T.exp2((G_s[i // SUB * SUB, d] - G_s[i, d]) * LOG2E)" in rows
    assert "R_s[b, d] = G_s[b * SUB, d]" in rows
    assert "G_s" not in loop and "Xq_s[i, d] =" not in loop and "Xk_s[i, d] =" not in loop
    keys = loop[:loop.index("T.gemm(")]
    assert "Kr_s[i, d] = Kd_s[i, d] * T.exp2((R_s[a, d] - R_s[i // SUB, d]) * LOG2E)" in keys
    assert "if i // SUB <= a:" in keys and "Kr_s[i, d] = 0.0" in keys and "T.if_then_else" not in keys
    assert loop.count("T.gemm(") == 2 and loop.count("clear_accum=True") == 2
    # Sub-chunk a's rows go to the causal scores and the transposed system (no separate mask pass).
    assert "A_cast[i, j] = T.if_then_else(j <= i, P_f[i, j], 0.0)" in loop
    assert "L_s[j, i] = T.if_then_else(j < i, P_f[i, j] * beta_s[j], 0.0)" in loop
    assert prepare.count("if i // SUB == a:") == 2
    assert "T.copy(Aqk, A_cast)" not in prepare
    # The Q, K and gamma tiles are free once read: two precompute blocks fit an SM at DK 128 in bf16.
    if (dk, overrides) == (128, {"score_operands": "bfloat16"}):
        assert rendered.prediction.per_kernel[0].smem_bytes <= 228 * 1024 // 2 - 1024


def test_kda_rows_once_constraints_refuse_saying_why():
    problem, kda = Problem("kda", 128, 128), space.load("kda")
    sliced = kda.complete(problem, {**KDA_PRE_SEQ_ROWS_ONCE, "block_dk": 64})
    assert any("whole rows of DK" in r for r in violations(problem, sliced))
    for other in ({"diagonal_blocks": "elementwise"}, {"score_rows": "sub_chunk"}):
        config = kda.complete(problem, {**KDA_PRE_SEQ_ROWS_ONCE, "block_dk": 128, **other})
        assert any("no C x C accumulator" in r for r in violations(problem, config))
    assert not violations(problem, kda.complete(problem, {**KDA_PRE_SEQ_ROWS_ONCE, "block_dk": 128}))


def test_kda_score_operands_stage_the_factors_in_their_dtype():
    for rows, overrides in (("per_sub_chunk", {}), ("sub_chunk", {"score_rows": "sub_chunk"}),
                            ("once", {**KDA_PRE_SEQ_ROWS_ONCE, "block_dk": 128})):
        sources = assert_every_value_changes_source("kda", 128, "score_operands", **{"split": "pre_seq", **overrides})
        for dtype, stage in (("float32", "ACCUM"), ("bfloat16", '"bfloat16"')):
            allocations = re.findall(r"(?:Xq_s|Xk_s|Kd_s|Kr_s) = T\.alloc_shared\(\[\w+, \w+\], (.+)\)", sources[dtype])
            assert allocations == [stage] * (4 if rows == "once" else 3), (rows, dtype, allocations)


def test_kda_sub_chunk_score_rows_constraints_refuse_saying_why():
    problem, kda = Problem("kda", 128, 128), space.load("kda")
    whole = kda.complete(problem, {**KDA_PRE_SEQ_SUB_CHUNK_ROWS, "sub_chunk": 64})
    assert any("would only add the merge" in r for r in violations(problem, whole))
    # A 16 x 32 score tile cannot be shared out over 8 warps (it compiles over 4: see above).
    small = kda.complete(problem, {**KDA_PRE_SEQ_SUB_CHUNK_ROWS, "chunk_size": 32, "threads": 256})
    assert any("No valid warp partition" in r for r in violations(problem, small))
    assert not violations(problem, {**small, "threads": 128})


@pytest.mark.parametrize("variant,dk,overrides", [("gla", 128, GLA_PRE_SEQ_ALL), ("gla", 64, {"split": "pre_seq"}),
                                                  ("kda", 128, KDA_PRE_SEQ_ALL), ("kda", 64, {"split": "pre_seq"}),
                                                  ("kda", 128, KDA_PRE_SEQ_BLOCKS)],
                         ids=("gla-all-off-default-128", "gla-default-64", "kda-all-off-default-128", "kda-default-64",
                              "kda-two-chunks-128"))
def test_pre_seq_compiles_clean_and_the_model_knows_its_shared_memory(variant, dk, overrides, tmp_path):
    rendered = rendered_config(variant, dk, **overrides)
    report = assert_compiles_clean(rendered, ["prepare", "sequential"], tmp_path)
    smem = {k.name: k.dynamic_smem_bytes for k in report.kernels}
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == smem


@pytest.mark.parametrize("overrides,reason", [
    ({"num_stages": 2}, "deeper than one stage"),
    ({"chunk_size": 32, "sub_chunk": 32}, "one sub-chunk per chunk"),
    ({"row_factors": "once", "block_dk": 32, "diagonal_blocks": "products"}, "stages whole rows of DK"),
    ({"row_factors": "once", "block_dk": 64}, "no C x C accumulator for the elementwise diagonal"),
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


@pytest.mark.parametrize("param", ["solve", "overlap", "prepare_chunks", "prepare_loads", "diagonal_blocks",
                                   "score_rows", "gate_scan", "row_factors", "score_operands"])
def test_every_kda_pre_seq_parameter_changes_the_code(param):
    # row_factors once takes whole rows of DK.
    assert_every_value_changes_source("kda", 128, param, split="pre_seq", **({"block_dk": 128} if param == "row_factors" else {}))


@pytest.mark.parametrize("param", ["gate_scan", "score_operands", "diagonal_blocks", "row_factors", "prepare_loads"])
@pytest.mark.parametrize("split", ["pre_seq", "segmented"])
def test_gla_precompute_parameters_change_the_code_of_both_precompute_splits(split, param):
    # row_factors once takes whole rows of DK and forms the diagonal blocks by products.
    others = {"block_dk": 128, "diagonal_blocks": "products"} if param == "row_factors" else {}
    assert_every_value_changes_source("gla", 128, param, split=split, **others)


@pytest.mark.parametrize("overrides", [GLA_PRE_SEQ_PRODUCTS, {**GLA_PRE_SEQ_ROWS_ONCE, "block_dk": 128},
                                       {**GLA_PRE_SEQ_ROWS_ONCE, "block_dk": 128, "score_operands": "bfloat16"}],
                         ids=["products", "rows-once", "rows-once-bf16"])
def test_gla_product_diagonal_forms_compile_as_modelled_with_no_elementwise_sum(overrides, tmp_path):
    rendered = rendered_config("gla", 128, **overrides)
    assert_compiles_as_modelled(rendered, ["prepare", "sequential"], tmp_path)
    assert "Diag_s" not in rendered.source and "for d in T.serial(DK)" not in rendered.source


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_gla_asynchronous_loads_issue_the_three_tiles_together_and_wait_once_before_the_scan(packed, tmp_path):
    rendered = rendered_config("gla", 128, **GLA_PRE_SEQ_ASYNC, packed=packed)
    assert_compiles_as_modelled(rendered, ["prepare", "sequential"], tmp_path)
    body = rendered.source[rendered.source.index("def prepare"):rendered.source.index("return prepare")]
    lines = [line.strip() for line in body.splitlines()]
    copies = [n for n, line in enumerate(lines) if line.startswith("T.async_copy(")]
    assert [lines[n][len("T.async_copy("):].split("[")[0] for n in copies] == ["Q", "K", "G"]
    assert not [line for line in lines if line.startswith(("T.copy(Q[", "T.copy(K[", "T.copy(G["))]
    scan = next(n for n, line in enumerate(lines) if line.startswith("gate_sum = 0.0") or line.startswith("T.cumsum("))
    assert max(copies) < lines.index("T.ptx_wait_group(0)") < scan and lines.count("T.ptx_wait_group(0)") == 1


def test_gla_bf16_score_operands_compile_as_modelled(tmp_path):
    rendered = rendered_config("gla", 128, split="pre_seq", score_operands="bfloat16")
    assert_compiles_as_modelled(rendered, ["prepare", "sequential"], tmp_path)
    assert re.findall(r'(?:Xq_s|Kr_s) = T\.alloc_shared\(\[C, BLOCK_DK\], "bfloat16"\)', rendered.source) == [
        'Xq_s = T.alloc_shared([C, BLOCK_DK], "bfloat16")', 'Kr_s = T.alloc_shared([C, BLOCK_DK], "bfloat16")']


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
                            ("gla", {"split": "segmented"}), ("gla", GLA_SEGMENTED_ALL),
                            ("kda", KDA_PRE_SEQ_ROLES), ("kda", KDA_PRE_SEQ_ASYNC), ("kda", KDA_PRE_SEQ_ELEMENTWISE),
                            ("kda", KDA_PRE_SEQ_ROLES_STORE_WARP), ("kda", KDA_PRE_SEQ_SUB_CHUNK_ROWS),
                            ("kda", PRE_SEQ_CHANNEL_SCAN), ("gla", PRE_SEQ_CHANNEL_SCAN),
                            ("kda", KDA_PRE_SEQ_BF16_OPERANDS), ("gla", {"split": "pre_seq", "score_operands": "bfloat16"}),
                            ("kda", {**KDA_PRE_SEQ_ROLES, "prepare_grid": "heads_first"}),
                            ("gla", GLA_PRE_SEQ_PRODUCTS), ("gla", GLA_PRE_SEQ_ASYNC),
                            ("kda", KDA_PRE_SEQ_ROLES_SEGMENTS), ("kda", KDA_PRE_SEQ_SEGMENTS),
                            ("kda", KDA_PRE_SEQ_ROLES_VALUES_AHEAD), ("kda", KDA_PRE_SEQ_ROLES_V_SWIZZLED),
                            ("kda", {**KDA_PRE_SEQ_SEGMENTS, "v_swizzle": True}),
                            ("kda", {**KDA_PRE_SEQ_ROLES_V_SWIZZLED, "values_loads": "first"})],
                         ids=[f"{v}-{s}" for v, s, _ in SPLITS] + ["kda-chunked-block_dv_o", "gla-pre_seq-all",
                                                                   "kda-pre_seq-all", "kda-pre_seq-blocks",
                                                                   "gla-segmented", "gla-segmented-all",
                                                                   "kda-pre_seq-roles", "kda-pre_seq-async",
                                                                   "kda-pre_seq-elementwise",
                                                                   "kda-pre_seq-roles-store-warp",
                                                                   "kda-pre_seq-sub-chunk-rows",
                                                                   "kda-pre_seq-channel-scan",
                                                                   "gla-pre_seq-channel-scan",
                                                                   "kda-pre_seq-bf16-operands",
                                                                   "gla-pre_seq-bf16-operands",
                                                                   "kda-pre_seq-roles-heads-first",
                                                                   "gla-pre_seq-products", "gla-pre_seq-async",
                                                                   "kda-pre_seq-roles-segments",
                                                                   "kda-pre_seq-segments",
                                                                   "kda-pre_seq-roles-values-ahead",
                                                                   "kda-pre_seq-roles-v-swizzled",
                                                                   "kda-pre_seq-segments-v-swizzled",
                                                                   "kda-pre_seq-roles-values-loads-first"])
@pytest.mark.parametrize("dk,dtype", [(64, "fp16"), (128, "bf16")])
def test_forward_matches_fp64_oracle(variant, overrides, dk, dtype):
    rendered = rendered_config(variant, dk, dtype, **overrides)
    module, compiled = load_kernels(rendered)
    C = rendered.config["chunk_size"]
    # Both gate regimes; a multiple of C and ragged tails; an initial state; where the sequence is split,
    # segments of several chunks (and, with 8 segments at 4 chunks, empty ones).
    cases = (("channel_lb0.9", 4 * C), ("channel_free", 3 * C + 17), ("initial_state", 2 * C + 1))
    if overrides["split"] == "segmented" or overrides.get("segments", 1) > 1:
        cases += (("initial_state", 9 * C + 5),)
    for regime, seqlen in cases:
        oracle_errors(module, compiled, rendered, regime, seqlen)


@cuda
@pytest.mark.parametrize("variant,overrides", [("kda", {**KDA_PRE_SEQ_ROWS_ONCE, "solve": "blocked"}),
                                               ("gla", GLA_PRE_SEQ_ROWS_ONCE)], ids=["kda", "gla"])
@pytest.mark.parametrize("operands", ["float32", "bfloat16"])
@pytest.mark.parametrize("dk,dtype", [(64, "fp16"), (128, "bf16")])
def test_rows_once_matches_fp64_oracle(variant, overrides, operands, dk, dtype):
    rendered = rendered_config(variant, dk, dtype, **overrides, block_dk=dk, score_operands=operands)
    module, compiled = load_kernels(rendered)
    C = rendered.config["chunk_size"]
    for regime, seqlen in (("channel_lb0.9", 4 * C), ("channel_free", 3 * C + 17), ("initial_state", 2 * C + 1)):
        oracle_errors(module, compiled, rendered, regime, seqlen)


@cuda
def test_kda_elementwise_diagonal_stays_finite_where_the_products_column_factors_overflow():
    """A channel decaying by e^-7 a token: over the 15 steps of a 16-token sub-chunk the products' column
    factor reaches e^105, past fp32's range; the elementwise sums take only exponents <= 0."""
    from tuner import reference
    from tuner.inputs import make_inputs

    results = {}
    for diagonal in ("products", "elementwise"):
        rendered = rendered_config("kda", 64, "bf16", split="pre_seq", diagonal_blocks=diagonal)
        module, kernels = load_kernels(rendered)
        x = make_inputs(rendered.problem, "channel_free", seed=1, device="cuda", batch=1, seqlen=256, heads=2)
        x["g"][..., 0] = -7.0
        o, _ = module.forward(kernels, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=x["scale"])
        o_ref, _ = reference.chunked("kda", x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=x["scale"])
        results[diagonal] = ((o.double() - o_ref).norm() / o_ref.norm()).item()
    assert not math.isfinite(results["products"]), results
    assert results["elementwise"] < Problem("kda", 64, 64).tolerance, results
