"""benchmarks/roles_timeline.py's stamps, checked on the CPU: every statement of each role's chunk
loop of the real role-split kernel is bracketed by an SM clock stamp, in order, the stamped kernel
still compiles for sm_90a with the same clean ptxas report, and forward passes the stamp buffer.
The timeline itself needs the GPU."""
import pytest

from template_checks import assert_compiles_clean, benchmark_module, rendered_config
from tuner.candidate import Candidate


@pytest.fixture(scope="module")
def roles_timeline():
    return benchmark_module("roles_timeline")


@pytest.fixture(scope="module", params=["gdn", "kda"])
def roles(request, roles_timeline):
    return rendered_config(request.param, 128, **roles_timeline.ROLES[request.param])


# Per variant: the statements of each role's chunk loop, and three of them (role, index, statement).
STATEMENTS = {"gdn": ([11, 13, 15, 10], [(0, 2, "T.copy(S_f, S_s[b, :, :])"),
                                         (1, 7, "T.gemm(Ab_s[s, :, :], Vr_s, U_f, clear_accum=True)"),
                                         (3, -1, "T.barrier_arrive(loaded[s])")]),
              "kda": ([11, 13, 11, 10], [(0, 8, "T.gemm(Kg_s[s, :, :], U_s, S_f, transpose_A=True)"),
                                         (2, 3, "T.gemm(Qg_s[s, :, :], S_s[b, :, :], acc_o, clear_accum=True)"),
                                         (3, -1, "T.barrier_arrive(loaded[s])")])}


def test_every_statement_of_each_role_loop_is_stamped_in_order(roles_timeline, roles):
    source, labels = roles_timeline.instrument(roles.source)
    counts, statements = STATEMENTS[roles.problem.variant]
    assert [len(role) for role in labels] == counts
    for role, index, statement in statements:
        assert labels[role][index] == statement
    lines = source.splitlines()
    for role, role_labels in enumerate(labels):
        stamps = [i for i, line in enumerate(lines) if f"STAMPS[{role}, c, " in line]
        assert len(stamps) == len(role_labels) + 1
        for point, (stamp, label) in enumerate(zip(stamps, role_labels)):
            assert f"STAMPS[{role}, c, {point}]" in lines[stamp]
            # the statement follows its stamp, past comments only
            following = next(line.strip() for line in lines[stamp + 1:] if not line.strip().startswith("#"))
            assert following == label
    assert "STAMPS.zero_()" in source and "ht, scale, STAMPS)" in source


def test_a_changed_kernel_is_refused_not_misread(roles_timeline, roles):
    with pytest.raises(SystemExit, match="expected 4 chunk loops, found 3"):
        roles_timeline.instrument(roles.source.replace("for c in T.serial(chunks):", "for c in T.serial(chunks + 0):", 1))
    with pytest.raises(SystemExit, match="signature or its call changed"):
        roles_timeline.instrument(roles.source.replace("scale: T.float32,", "scale: T.float64,"))


def test_the_stamped_kernel_compiles_clean_for_hopper(roles_timeline, roles, tmp_path):
    source, _ = roles_timeline.instrument(roles.source)
    report = assert_compiles_clean(Candidate(roles.problem, roles.config, source), ["prepare", "sequential"], tmp_path)
    assert any(k.name == "sequential" and k.registers for k in report.kernels)


def test_the_store_warps_loop_is_stamped_by_its_own_first_thread(roles_timeline):
    """With o_store=store_warp the producer's warpgroup runs a fifth chunk loop in its second warp
    (threads 416-447), where no thread is a multiple of 128: its stamps are the fifth role's, written by
    thread 416."""
    store = rendered_config("gdn", 128, **roles_timeline.ROLES["gdn"], o_store="store_warp")
    source, labels = roles_timeline.instrument(store.source)
    assert len(labels) == 5 and labels[4][-1] == "T.barrier_arrive(output_free[b])"
    lines = source.splitlines()
    warp = next(i for i, line in enumerate(lines) if line.strip() == "elif tx < 448:")
    stamps = [i for i, line in enumerate(lines) if "STAMPS[4, c, " in line]
    assert len(stamps) == len(labels[4]) + 1 and all(i > warp for i in stamps)
    assert all(lines[i - 1].strip() == "if bbh == 0 and bv == 0 and (tx % 128 == 0 or tx == 416 or tx == 448):"
               for i in stamps)


@pytest.mark.parametrize("store_warp", [True, False])
def test_the_gate_warps_loop_is_stamped_by_its_own_first_thread(roles_timeline, store_warp):
    """With gc_loads=gate_warp a warp of the producer's warpgroup loads gc and forms the row weights in a
    chunk loop of its own, the last: threads 448-479 beside a store warp, else 416-447."""
    gate = rendered_config("gdn", 128, **{**roles_timeline.ROLES["gdn"], "gc_loads": "gate_warp",
                                          **({"o_store": "store_warp"} if store_warp else {})})
    source, labels = roles_timeline.instrument(gate.source)
    assert roles_timeline.role_names(gate.source)[-1] == "gate" and len(labels) == 5 + store_warp
    assert labels[-1][-2:] == ["for i in T.Parallel(C):", "T.barrier_arrive(loaded[s])"]
    # The TMA warp's loop forms no row weights.
    assert not any(label.startswith("for i in T.Parallel") for label in labels[3])
    lines = source.splitlines()
    warp = next(i for i, line in enumerate(lines) if line.strip() == f"elif tx < {480 if store_warp else 448}:")
    stamps = [i for i, line in enumerate(lines) if f"STAMPS[{len(labels) - 1}, c, " in line]
    assert len(stamps) == len(labels[-1]) + 1 and all(i > warp for i in stamps)
