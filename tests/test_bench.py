"""Timing and the memory-bound floor. Floors are checked against hand counts of the bytes."""
import pytest
import torch
from template_checks import benchmark_module

from tuner.bench import H200_COPY_GBPS, floor_bytes, memory_floor_ms, time_forward, time_side_by_side
from tuner.problem import Problem


def test_floor_of_the_reference_shape_is_the_bytes_counted_by_hand():
    # Reading q, k, v and writing o in bf16 at 4 x 8192 x 16, D = 128 is 0.54 GB, ~0.125 ms.
    p = Problem("linear", 128, 128, "bf16", batch=4, seqlen=8192, heads=16)
    qkvo = 4 * 8192 * 16 * 128 * 4 * 2
    state = 4 * 16 * 128 * 128 * 4
    assert floor_bytes(p) == qkvo + state
    assert floor_bytes(p, final_state=False) == qkvo == 536_870_912
    assert memory_floor_ms(p, final_state=False) == pytest.approx(0.1249, abs=1e-4)
    assert H200_COPY_GBPS == 4300.0


@pytest.mark.parametrize("variant, gate_elems, beta", [
    pytest.param("decay", 16, False, id="decay-per-head"),
    pytest.param("simple_gla", 4 * 8192 * 16, False, id="simple_gla-per-token"),
    pytest.param("gla", 4 * 8192 * 16 * 64, False, id="gla-per-channel"),
    pytest.param("gdn", 4 * 8192 * 16, True, id="gdn-token-and-beta"),
    pytest.param("kda", 4 * 8192 * 16 * 64, True, id="kda-channel-and-beta"),
])
def test_floor_counts_gates_beta_and_states(variant, gate_elems, beta):
    p = Problem(variant, 64, 128, "fp16", batch=4, seqlen=8192, heads=16)
    tokens = 4 * 8192 * 16
    expected = 2 * tokens * (64 + 64 + 128 + 128) + 4 * gate_elems + (4 * tokens if beta else 0)
    states = 4 * 16 * 64 * 128 * 4
    assert floor_bytes(p) == expected + states
    assert floor_bytes(p, initial_state=True) == expected + 2 * states
    assert memory_floor_ms(p, bandwidth_gbps=1000) == pytest.approx((expected + states) / 1e12 * 1e3)


def test_floor_at_another_shape():
    p = Problem("linear", 64, 64, "bf16")
    assert floor_bytes(p, batch=1, seqlen=10, heads=1, final_state=False) == 2 * 10 * 4 * 64


def test_host_timing_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    t = time_forward(lambda: calls.append(1), warmup_ms=0, rep=7)
    assert t.device == "cpu" and t.reps == 7 and len(calls) == 8  # one warm-up call at least
    assert 0 <= t.p10_ms <= t.median_ms <= t.p90_ms


def test_side_by_side_timing_interleaves_the_calls_in_rotating_order(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in "abc"}
    timings = time_side_by_side(calls, warmup_ms=0, rep=6, rounds=3)
    assert order[:3] == ["a", "b", "c"]  # one warm-up call each
    timed = order[3:]
    assert timed == ["a"] * 2 + ["b"] * 2 + ["c"] * 2 + ["b"] * 2 + ["c"] * 2 + ["a"] * 2 + ["c"] * 2 + ["a"] * 2 + ["b"] * 2
    assert all(t.reps == 6 and t.device == "cpu" for t in timings.values()) and list(timings) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="multiple of rounds"):
        time_side_by_side(calls, rep=10, rounds=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_timing_of_a_copy_is_near_the_copy_rate():
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_forward(lambda: dst.copy_(src), rep=20)
    assert t.device == "cuda" and t.reps == 20
    rate_gbps = 2 * src.numel() / (t.median_ms * 1e-3) / 1e9
    assert 0.5 * H200_COPY_GBPS < rate_gbps < 1.2 * H200_COPY_GBPS


def load_vs_fla():
    """benchmarks/vs_fla.py as a module (it is a script, not part of the package)."""
    return benchmark_module("vs_fla")


def test_vs_fla_merge_replaces_remeasured_rows_and_keeps_the_rest(tmp_path):
    """benchmarks/vs_fla.py --merge: the committed table is built over several runs on the GPU."""
    vs_fla = load_vs_fla()

    def row(variant, dk, shape, ms, run):
        b, t, h = shape
        return {"variant": variant, "dk": dk, "dv": dk, "dtype": "bf16", "batch": b, "seqlen": t, "heads": h,
                "ours_ms": ms, "run": run}

    earlier = [row("gdn", 128, (4, 8192, 16), 2.09, "old"), row("linear", 128, (4, 8192, 16), 0.18, "old"),
               row("gdn", 128, (1, 32768, 32), 5.18, "old")]
    new = [row("gdn", 128, (4, 8192, 16), 1.51, "new"), row("gdn", 64, (4, 8192, 16), 0.79, "new")]
    merged = vs_fla.merge(earlier, new)
    assert [(r["variant"], r["dk"], r["seqlen"], r["run"]) for r in merged] == [
        ("linear", 128, 8192, "old"), ("gdn", 128, 8192, "new"), ("gdn", 128, 32768, "old"), ("gdn", 64, 8192, "new")]
    assert vs_fla.load_rows(str(tmp_path / "absent.json")) == []


def test_vs_fla_judges_the_dispatch_against_the_faster_of_ours_and_fla():
    vs_fla = load_vs_fla()

    def row(ours, fla, dispatch, backend, **extra):
        r = {"variant": "gla", "dk": 128, "dv": 128, "dtype": "bf16", "batch": 4, "seqlen": 8192, "heads": 16,
             "ours_ms": ours, "fla_ms": fla, "ratio": ours / fla, "floor_ms": 0.188, "floor_fraction": 0.188 / ours,
             "rel_l2_vs_fla": 3e-3, "within_tolerance": True, "dispatch_ms": dispatch, "dispatch_backend": backend,
             **extra}
        return {**r, "dispatch_vs_best": vs_fla.dispatch_vs_best(r)}

    fla_wins, ours_win, slow = row(4.34, 1.389, 1.40, "fla"), row(0.807, 0.845, 0.81, "tuner"), row(0.8, 1.0, 0.9, "tuner")
    assert fla_wins["dispatch_vs_best"] == pytest.approx(1.40 / 1.389) and vs_fla.DISPATCH_LIMIT == 1.02
    assert slow["dispatch_vs_best"] == pytest.approx(1.125)
    error = {**fla_wins, "error": "RuntimeError: out of memory"}
    assert vs_fla.over_the_limit([fla_wins, ours_win, slow, error]) == [slow, error]
    old = {k: v for k, v in ours_win.items() if not k.startswith("dispatch")}  # measured before the column
    lines = vs_fla.table([fla_wins, old]).splitlines()
    assert "disp/best" in lines[0] and "runs" in lines[0]
    assert "    1.400     1.008  fla" in lines[2] and "4.340    1.389     3.12" in lines[2]
    assert "        -         -  -" in lines[3]


def test_vs_fla_times_flashqla_only_where_it_is_installed_and_shows_it_beside_ours(monkeypatch):
    """gdn's D 128 rows get FlashQLA's column: its time (the call timed as ours is, on the same inputs) and
    its output against FLA's; nothing where it cannot be imported, its error where its call fails."""
    import sys
    import types

    vs_fla = load_vs_fla()
    x = {name: object() for name in ("q", "k", "v", "g", "beta")} | {"scale": 0.125}
    fla_o = torch.ones(8, dtype=torch.float64)
    timed = []

    def fake_time_forward(call):
        timed.append(call()[0])
        return types.SimpleNamespace(median_ms=0.40, p10_ms=0.39, p90_ms=0.41)

    monkeypatch.setattr(vs_fla, "time_forward", fake_time_forward)
    monkeypatch.setitem(sys.modules, "flash_qla", None)  # not installed: import fails
    assert vs_fla.flashqla_columns(x, lambda: (fla_o, None), 1e-2) == {}

    def chunk_gated_delta_rule(q, k, v, g, beta, scale):
        assert (q, k, v, g, beta, scale) == tuple(x[n] for n in ("q", "k", "v", "g", "beta", "scale"))
        return fla_o * 1.001, None

    monkeypatch.setitem(sys.modules, "flash_qla", types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule))
    cols = vs_fla.flashqla_columns(x, lambda: (fla_o, None), 1e-2)
    assert cols["flashqla_ms"] == 0.40 and cols["flashqla_p10_p90_ms"] == [0.39, 0.41]
    assert cols["flashqla_rel_l2_vs_fla"] == pytest.approx(1e-3) and cols["flashqla_within_tolerance"]
    assert len(timed) == 1

    def broken(*args, **kwargs):
        raise AssertionError("K must be 128")

    monkeypatch.setitem(sys.modules, "flash_qla", types.SimpleNamespace(chunk_gated_delta_rule=broken))
    assert vs_fla.flashqla_columns(x, lambda: (fla_o, None), 1e-2) == {"flashqla_error": "AssertionError: K must be 128"}

    row = {"variant": "gdn", "dk": 128, "dv": 128, "dtype": "bf16", "batch": 4, "seqlen": 8192, "heads": 16,
           "ours_ms": 0.695, "fla_ms": 0.844, "ratio": 0.695 / 0.844, "floor_ms": 0.127, "floor_fraction": 0.18,
           "rel_l2_vs_fla": 4.7e-3, "within_tolerance": True, **cols}
    lines = vs_fla.table([row]).splitlines()
    assert "FlashQLA" in lines[-2] and lines[-1].split() == ["4x8192x16", "0.695", "0.400", "1.74", "1.0e-03"]
