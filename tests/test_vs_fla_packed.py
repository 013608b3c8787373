"""benchmarks/vs_fla.py's packed rows (issue 19), checked on the CPU: the inputs, the row's key, the floor,
which variants get them, and that ours, FLA and the dispatch are all called with the packed sequences.
The timings themselves need the H200 and FLA."""
import types

import pytest
import torch
from template_checks import benchmark_module

from tuner import ops
from tuner.bench import H200_COPY_GBPS, Timing, inputs_floor_ms, memory_floor_ms
from tuner.inputs import make_inputs, packed_lengths, timing_inputs
from tuner.problem import Problem
from tuner.variants import VARIANTS


@pytest.fixture(scope="module")
def vs_fla():
    """benchmarks/vs_fla.py as a module (it is a script, not part of the package)."""
    return benchmark_module("vs_fla")


@pytest.fixture
def on_cpu(vs_fla, monkeypatch):
    """vs_fla's inputs made on the CPU (it puts them on the GPU)."""
    monkeypatch.setattr(vs_fla, "timing_inputs", lambda problem, device: timing_inputs(problem, "cpu"))
    return vs_fla


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_packed_inputs_are_one_row_of_the_gates_fixed_mix_with_grouped_value_heads(on_cpu, variant):
    T, HV, D = 1000, 8, 64
    problem, x, row = on_cpu.packed_inputs(variant, D, "bf16", (T, HV))
    lengths = packed_lengths(T, torch.Generator().manual_seed(0))  # seed 0: the same mix every run
    N, H = len(lengths), HV // 2
    assert problem == Problem(variant, D, D, "bf16", 1, T, HV, packed=True)  # as the tuner times a packed problem
    bounds = x["cu_seqlens"].tolist()
    assert len(bounds) == N + 1 and bounds[0] == 0 and bounds[-1] == T
    assert [b - a for a, b in zip(bounds, bounds[1:])] == lengths and min(lengths) >= 1
    assert x["q"].shape == x["k"].shape == (1, T, H, D) and x["v"].shape == (1, T, HV, D)
    assert x["beta"].shape == (1, T, HV) and x["g"].shape == ((1, T, HV) if variant == "gdn" else (1, T, HV, D))
    assert x["initial_state"].shape == (N, HV, D, D)
    assert {k: row[k] for k in ("batch", "seqlen", "heads", "qk_heads", "sequences")} == {
        "batch": 1, "seqlen": T, "heads": HV, "qk_heads": H, "sequences": N}
    assert on_cpu.shape_label(row) == f"packed {N}x{T} H{H}/HV{HV}"
    # Bytes by hand: q, k (H heads) and v read, o written in bf16; g, beta read in fp32; the fp32 state of
    # every sequence read and written.
    gate = T * HV * (1 if variant == "gdn" else D)
    moved = 2 * T * (2 * H * D + 2 * HV * D) + 4 * gate + 4 * T * HV + 2 * 4 * N * HV * D * D
    assert row["floor_ms"] == pytest.approx(moved / (H200_COPY_GBPS * 1e9) * 1e3)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_packed_floor_counts_as_memory_floor_ms_does_on_dense_inputs(variant):
    """Where memory_floor_ms can count (q, k and v with the same heads, a state per batch row), the
    count from the tensors agrees with it, gates and beta where the variant has them, with an initial
    state read or none."""
    problem = Problem(variant, 64, 64, "bf16", batch=2, seqlen=256, heads=4)
    x = make_inputs(problem, regime="initial_state")
    assert inputs_floor_ms(x) == pytest.approx(memory_floor_ms(problem, initial_state=True))
    assert inputs_floor_ms(make_inputs(problem)) == pytest.approx(memory_floor_ms(problem))


@pytest.mark.parametrize("variant", ["decay", "simple_gla", "gla", "gdn", "kda"])
def test_the_packed_variants_ops_take_the_packed_inputs(vs_fla, variant):
    """Every tuner.ops call of a packed row passes the checks of cu_seqlens, grouped value heads and a
    state per sequence: on the CPU it stops at the device check only."""
    assert variant in vs_fla.PACKED_VARIANTS
    x = make_inputs(Problem(variant, 64, 64, "bf16", 1, 300, 8), regime="packed")
    for call in vs_fla.op_calls(ops, variant, x, backend="tuner").values():
        with pytest.raises(ops.InputError, match="must be on a CUDA device"):
            call()


def recorder(calls: list, side: str, o_scale: float = 1.0, state_scale: float = 1.0):
    """A stand-in for tuner.ops or FLA's ops: notes each call's keyword arguments; o is v (in fp32) times
    ``o_scale``, the final state the initial one (zeros without) times ``state_scale``."""
    def op(name):
        def call(q, k, v, g, beta, initial_state=None, output_final_state=False, **options):
            calls.append((side, name, {"initial_state": initial_state, "output_final_state": output_final_state,
                                       **options}))
            state = initial_state if initial_state is not None else torch.zeros(q.shape[0], v.shape[2], q.shape[3],
                                                                                v.shape[3])
            return v.float() * o_scale, (state * state_scale if output_final_state else None)
        return call

    return types.SimpleNamespace(chunk_gated_delta_rule=op("chunk_gated_delta_rule"), chunk_kda=op("chunk_kda"))


@pytest.fixture
def recorded(on_cpu, monkeypatch):
    """vs_fla with recording stand-ins for tuner.ops and FLA (FLA's o 0.1% larger, its final state 0.2%),
    each call timed once at 1 ms, and the dispatch's lookup noted."""
    calls = []
    monkeypatch.setattr(on_cpu, "ops", recorder(calls, "ours"))
    fla = recorder(calls, "fla", o_scale=1.001, state_scale=1.002)
    monkeypatch.setattr(on_cpu, "fla_ops", lambda: fla)

    def time_once(fn):
        fn()
        return Timing(1.0, 0.9, 1.2, 1)

    def lookup(*shape, **options):
        calls.append(("lookup", shape, options))
        return types.SimpleNamespace(backend="tuner")

    monkeypatch.setattr(on_cpu, "time_forward", time_once)
    monkeypatch.setattr(on_cpu, "time_side_by_side", lambda calls: {name: time_once(fn) for name, fn in calls.items()})
    monkeypatch.setattr(on_cpu, "best_config", lookup)
    return on_cpu, calls


@pytest.mark.parametrize("variant, op", [("gdn", "chunk_gated_delta_rule"), ("kda", "chunk_kda")])
def test_a_packed_row_calls_ours_fla_and_the_dispatch_with_the_packed_sequences(recorded, variant, op):
    vs_fla, calls = recorded
    T, HV = 600, 8
    row = vs_fla.measure(variant, 64, "bf16", (T, HV), packed=True)
    assert "error" not in row, row.get("error")
    N = row["sequences"]
    ours = [kw for side, name, kw in calls if side == "ours"]
    fla = [kw for side, name, kw in calls if side == "fla"]
    assert {name for side, name, _ in calls if side != "lookup"} == {op}
    # Compared with the final state out, then timed: ours and the dispatch through tuner.ops, FLA's op.
    assert [kw["backend"] for kw in ours] == ["tuner", "tuner", "auto"] and len(fla) == 2
    assert all("backend" not in kw for kw in fla)
    bounds = ours[0]["cu_seqlens"]
    assert bounds.tolist() == [0, *torch.tensor(packed_lengths(T, torch.Generator().manual_seed(0))).cumsum(0).tolist()]
    for kw in ours + fla:
        assert kw["cu_seqlens"] is bounds and kw["initial_state"].shape == (N, HV, 64, 64)
    assert [c for c in calls if c[0] == "lookup"] == [("lookup", (variant, 64, 64, "bf16", 1, T, HV),
                                                        {"backend": "auto", "packed": True})]
    # Both outputs of the packed call are compared: FLA's stand-in makes o 0.1% larger, the final states 0.2%.
    assert row["vs_fla"][op]["o"] == pytest.approx(1e-3 / 1.001, rel=1e-3)  # v * 1.001 rounded in fp32
    assert row["vs_fla"][op]["final_state"] == pytest.approx(2e-3 / 1.002, rel=1e-3)
    assert row["rel_l2_vs_fla"] == row["vs_fla"][op]["final_state"]
    assert row["within_tolerance"] and row["ours_ms"] == row["fla_ms"] == row["dispatch_ms"] == 1.0
    assert row["ours_p10_p90_ms"] == row["fla_p10_p90_ms"] == row["dispatch_p10_p90_ms"] == [0.9, 1.2]
    assert row["dispatch_vs_best"] == 1.0 and vs_fla.over_the_limit([row]) == []


def test_a_dense_row_calls_the_ops_without_packed_sequences(recorded):
    vs_fla, calls = recorded
    row = vs_fla.measure("gdn", 64, "bf16", (2, 128, 4))
    assert "error" not in row, row.get("error")
    assert all("cu_seqlens" not in kw and kw["initial_state"] is None for side, _, kw in calls if side != "lookup")
    assert [c for c in calls if c[0] == "lookup"] == [("lookup", ("gdn", 64, 64, "bf16", 2, 128, 4),
                                                        {"backend": "auto", "packed": False})]


def test_packed_and_dense_rows_of_one_shape_stay_apart_under_merge(vs_fla):
    """A packed row is 1 x T x HV as the dense anchor 1x32768x32 is: the label keeps them apart."""
    def row(run, **packed):
        return {"variant": "gdn", "dk": 128, "dv": 128, "dtype": "bf16", "batch": 1, "seqlen": 32768, "heads": 32,
                "run": run, **packed}

    packed = {"sequences": 205, "qk_heads": 16}
    dense_old, packed_old = row("old"), row("old", **packed)
    reference = {**row("old"), "batch": 4, "seqlen": 8192, "heads": 16}
    assert vs_fla.row_key(dense_old) != vs_fla.row_key(packed_old)
    assert vs_fla.shape_label(packed_old) == "packed 205x32768 H16/HV32"
    merged = vs_fla.merge([packed_old, dense_old, reference], [row("new", **packed)])
    assert [(vs_fla.shape_label(r), r["run"]) for r in merged] == [
        ("4x8192x16", "old"), ("1x32768x32", "old"), ("packed 205x32768 H16/HV32", "new")]
    merged = vs_fla.merge([packed_old, dense_old], [row("new")])
    assert [(vs_fla.shape_label(r), r["run"]) for r in merged] == [
        ("1x32768x32", "new"), ("packed 205x32768 H16/HV32", "old")]
    # A merge keyed by the sequences' count too: another mix of lengths is another row.
    assert len(vs_fla.merge([packed_old], [row("new", sequences=64, qk_heads=16)])) == 2


def test_the_table_and_the_error_lines_name_a_packed_row_by_its_label(vs_fla):
    r = {"variant": "kda", "dk": 128, "dv": 128, "dtype": "bf16", "batch": 1, "seqlen": 32768, "heads": 32,
         "qk_heads": 16, "sequences": 205, "ours_ms": 2.0, "fla_ms": 4.0, "ratio": 0.5, "floor_ms": 0.4,
         "floor_fraction": 0.2, "rel_l2_vs_fla": 5e-3, "within_tolerance": True, "dispatch_ms": 2.0,
         "dispatch_vs_best": 1.0, "dispatch_backend": "tuner"}
    lines = vs_fla.table([r, {**r, "error": "RuntimeError: boom"}]).splitlines()
    assert "kda         128 packed 205x32768 H16/HV32     2.000    4.000     0.50" in lines[2]
    assert "packed 205x32768 H16/HV32   error: RuntimeError: boom" in lines[3]


def test_packed_rows_are_planned_for_the_packed_variants_by_default_and_on_request(vs_fla):
    default = vs_fla.planned(vs_fla.parse_args([]))
    assert [(v, shape) for v, _, shape, packed in default if packed] == [
        (v, (32768, 32)) for v in ("decay", "simple_gla", "gla", "gdn", "kda")]
    assert vs_fla.PACKED_SHAPES == ((32768, 32),)
    assert [shape for v, _, shape, packed in default if v == "linear"] == list(vs_fla.SHAPES)
    # --shape alone: those dense rows only; --packed alone: those packed rows only.
    assert vs_fla.planned(vs_fla.parse_args(["--variant", "gdn", "--shape", "4x8192x16"])) == [
        ("gdn", 128, (4, 8192, 16), False)]
    assert vs_fla.planned(vs_fla.parse_args(["--variant", "gdn", "--variant", "linear", "--packed", "4096x8",
                                             "--dk", "64"])) == [("gdn", 64, (4096, 8), True)]


@pytest.mark.parametrize("argv", [["--variant", "linear", "--packed", "32768x32"], ["--packed", "32768"],
                                  ["--packed", "0x32"]])
def test_a_packed_request_that_cannot_be_measured_is_refused(vs_fla, argv, capsys):
    with pytest.raises(SystemExit) as e:
        vs_fla.parse_args(argv)
    assert e.value.code == 2 and "--packed" in capsys.readouterr().err
