"""The gate with real child processes: hand-written pure-torch modules that pass, hang, return NaN,
return wrong values or die run on the CPU; TileLang modules that fail to compile or that the
screen rejects stop the child before anything runs. A CUDA test gates a rendered config."""
import json
import math
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from tuner.bench import memory_floor_ms
from tuner.candidate import Candidate
from tuner.gate import GateResult, gate_and_time, run_gate
from tuner.inputs import regimes_for
from tuner.problem import Problem

FIXTURES = Path(__file__).parent / "fixtures"
PROBLEM = Problem("decay", 64, 64, "bf16", batch=1, seqlen=128, heads=2)
# Small shapes for the CPU: a length that is a multiple of the chunk and one that is not.
SMALL = dict(seqlens=(64, 50), batch=1, heads=2, seeds=(0,))
# Generous: two processes share two loaded cores, and importing torch alone can take seconds.
TIMEOUT_S = 240


def source(name: str, **constants) -> str:
    src = (FIXTURES / name).read_text()
    for key, value in constants.items():
        src, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", src, flags=re.M)
        assert n == 1, key
    return src


def behaving(behaviour: str) -> str:
    return source("torch_forward.py", BEHAVIOUR=repr(behaviour))


def test_correct_module_passes_every_regime(tmp_path):
    result = run_gate(Candidate(PROBLEM, {}, behaving("correct")), timeout_s=TIMEOUT_S, cache_dir=tmp_path, **SMALL)
    assert result.status == "pass", result.message
    assert set(result.errors) == set(regimes_for("decay"))
    for e in result.errors.values():
        # Only the rounding of o to bf16 separates the oracles: far under the 2e-2 tolerance.
        assert e["o"] < 1e-2 and e["final_state"] < 1e-6 and e["seqlen"] in (64, 50)
    assert result.compile["kernels"] == [] and result.seconds > 0
    assert GateResult.from_dict(json.loads(json.dumps(result.as_dict()))) == result


GDN_PACKED = Problem("gdn", 64, 64, "bf16", batch=1, seqlen=128, heads=2)


@pytest.mark.parametrize("behaviour, status", [("correct", "pass"), ("unpacked", "mismatch")])
def test_kernels_of_packed_sequences_are_gated_on_packed_sequences_too(behaviour, status, tmp_path):
    module = source("torch_forward.py", BEHAVIOUR=repr(behaviour), VARIANT=repr("gdn"))
    result = run_gate(Candidate(GDN_PACKED, {"packed": True}, module), timeout_s=TIMEOUT_S, cache_dir=tmp_path,
                      **SMALL)
    assert result.status == status, result.message
    assert set(result.errors) == set(regimes_for("gdn", packed=True))
    if status == "mismatch":  # only the packed regime has several sequences in one call
        assert "regime packed" in result.message and result.errors["default"]["o"] < 1e-2


def test_hanging_forward_is_killed_and_reported(tmp_path):
    timeout_s = 40
    start = time.perf_counter()
    result = run_gate(Candidate(PROBLEM, {}, behaving("hang")), timeout_s=timeout_s, regimes=["default"],
                      cache_dir=tmp_path, **SMALL)
    assert time.perf_counter() - start < timeout_s + 15
    assert result.status == "hang"
    assert "forward: regime default, T=64, seed 0" in result.message


def test_nan_is_caught(tmp_path):
    result = run_gate(Candidate(PROBLEM, {}, behaving("nan")), timeout_s=TIMEOUT_S, regimes=["default"],
                      cache_dir=tmp_path, **SMALL)
    assert result.status == "nan" and "o" in result.message
    assert math.isnan(result.errors["default"]["o"]) and result.errors["default"]["final_state"] < 1e-6


def test_wrong_values_mismatch_and_tolerance_is_overridable(tmp_path):
    result = run_gate(Candidate(PROBLEM, {}, behaving("wrong")), timeout_s=TIMEOUT_S, regimes=["default"],
                      cache_dir=tmp_path, **SMALL)
    assert result.status == "mismatch" and f"above {PROBLEM.tolerance:g}" in result.message
    assert 0.045 < result.errors["default"]["o"] < 0.055  # o scaled by 1.05
    loose = run_gate(Candidate(PROBLEM, {}, behaving("wrong")), timeout_s=TIMEOUT_S, regimes=["default"],
                     tolerance=0.1, cache_dir=tmp_path, **SMALL)
    assert loose.status == "pass"


def test_dying_child_is_a_crash(tmp_path):
    result = run_gate(Candidate(PROBLEM, {}, behaving("crash")), timeout_s=TIMEOUT_S, regimes=["default"],
                      cache_dir=tmp_path, **SMALL)
    assert result.status == "crash" and "exited with code 3" in result.message


def test_compile_error_is_reported_with_the_message(tmp_path):
    result = run_gate(Candidate(PROBLEM, {}, source("gemm_kernel.py", BLOCK_K_OF_B=32)), timeout_s=TIMEOUT_S,
                      cache_dir=tmp_path, **SMALL)
    assert result.status == "compile_error"
    assert "K shape check failed: K_A = 64, K_B = 32" in result.message


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is needed to compile for sm_90a")
def test_screen_rejects_before_running(tmp_path):
    result = run_gate(Candidate(Problem("decay", 128, 128, "fp16"), {}, source("seed_decay_kernel.py")),
                      timeout_s=TIMEOUT_S, cache_dir=tmp_path, **SMALL)
    assert result.status == "screen"
    assert "barrier for 128 threads inside a branch entered by 64 threads" in result.message
    assert result.errors == {}


def test_gate_and_time_fills_the_timing(tmp_path):
    # One gate, timed at the problem's shape and at two more: one 16 times larger, one that no
    # memory can hold (its failure is that shape's outcome only).
    larger, too_large = "2x512x4", "4096x1048576x64"
    result = gate_and_time(Candidate(PROBLEM, {}, behaving("correct")), timeout_s=TIMEOUT_S, regimes=["default"],
                           also_at=(larger, too_large), warmup_ms=1, rep=3, cache_dir=tmp_path, **SMALL)
    assert result.status == "pass", result.message
    t, at = result.timing, result.timing_at
    for timing in (t, at[larger]):
        assert timing["reps"] == 3 and 0 < timing["p10_ms"] <= timing["median_ms"] <= timing["p90_ms"]
        assert timing["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert at[larger]["floor_ms"] == pytest.approx(memory_floor_ms(PROBLEM.at(larger)))
    assert at[larger]["floor_ms"] > 10 * t["floor_ms"]
    assert at[larger]["median_ms"] > t["median_ms"]
    assert set(at) == {larger, too_large} and "memory" in at[too_large]["error"].lower()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rendered_default_config_passes_on_the_gpu(tmp_path):
    from tuner import space

    problem = Problem("decay", 128, 128, "bf16")
    config = space.load("decay").default(problem)
    result = gate_and_time(Candidate.from_config(problem, config), timeout_s=600, cache_dir=tmp_path)
    assert result.status == "pass", result.message
    assert result.timing["device"] == "cuda" and result.timing["median_ms"] > result.timing["floor_ms"]
