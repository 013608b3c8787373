"""compile_candidate against real ptxas output: TileLang kernels compiled for sm_90a with nvcc.

The expected figures come from the kernels' own parameters (a GEMM's pipelined tiles give its
dynamic shared memory; warp specialisation adds a 128-thread producer warpgroup), not from a
previous run. No GPU is needed.
"""
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tuner.compile import CompileReport, compile_candidate, kernels_dir, load_kernels
from tuner.problem import Problem
from tuner.candidate import Candidate

FIXTURES = Path(__file__).parent / "fixtures"
pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is needed to compile for sm_90a")


def fixture(name: str, **constants) -> Candidate:
    """A fixture module with some of its constants rewritten, as a template would render them."""
    src = (FIXTURES / name).read_text()
    for key, value in constants.items():
        src, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", src, flags=re.M)
        assert n == 1, key
    return Candidate(Problem("decay", 128, 128, "fp16"), {}, src)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("linattn-cache")


@pytest.fixture(scope="module")
def gemm(cache):
    rendered = fixture("gemm_kernel.py")
    return rendered, compile_candidate(rendered, cache_dir=cache)


def test_gemm_figures_come_from_ptxas(gemm):
    rendered, report = gemm
    assert report.ok and report.error is None and not report.cached
    (k,) = report.kernels
    assert k.name == "gemm" and k.entry == "main_kernel"
    assert k.threads == 256 + 128  # THREADS consumers + the producer warpgroup of warp specialisation
    assert k.dynamic_smem_bytes == 3 * (128 * 64 + 64 * 128) * 2  # NUM_STAGES x (A tile + B tile), fp16
    assert 0 < k.registers <= 255 and k.barriers >= 1
    assert (k.spill_stores, k.spill_loads, k.stack_frame) == (0, 0, 0) and not report.spills
    assert not k.wgmma_serialized
    assert "tl::wgmma_ss" in k.cuda_source and report.screen_findings == []
    assert report.compile_seconds > 0


def test_source_is_kept_beside_the_report(gemm, cache):
    rendered, report = gemm
    path = kernels_dir(cache) / f"{rendered.name}.py"
    assert report.source_path == str(path) and path.read_text() == rendered.source
    assert (kernels_dir(cache) / f"{rendered.name}.sm_90a.report.json").exists()


def test_second_call_reuses_the_report_without_compiling(gemm, cache):
    rendered, first = gemm
    start = time.perf_counter()
    again = compile_candidate(rendered, cache_dir=cache)
    assert time.perf_counter() - start < 2.0
    assert again.cached
    assert again.as_dict() == {**first.as_dict(), "cached": True}


def test_report_is_json_and_round_trips(gemm):
    _, report = gemm
    d = json.loads(json.dumps(report.as_dict()))
    assert "cuda_source" not in d["kernels"][0] and d["ok"] is True and d["spills"] is False
    assert CompileReport.from_dict(d).as_dict() == report.as_dict()
    assert "__global__" in report.as_dict(with_source=True)["kernels"][0]["cuda_source"]
    summary = report.summary()
    assert "gemm" in summary and "384" in summary and "98304" in summary


def test_spilling_config_reports_spills_and_serialised_wgmma(cache):
    # The seed kernel with the whole DV in one block: S_f alone is 128 fp32 registers a thread.
    # C7512 only reaches the log because compile drops the -w that TileLang adds in verbose mode.
    report = compile_candidate(fixture("seed_decay_kernel.py", INLINE_WEIGHTS=True, BLOCK_DV=128), cache_dir=cache)
    assert report.error is None, report.error
    (k,) = report.kernels
    assert k.spill_stores > 0 and k.spill_loads > 0 and k.stack_frame > 0 and report.spills
    assert k.wgmma_serialized and report.wgmma_serialized
    assert "SERIALIZED (C7512)" in report.summary()


def test_compile_failure_is_a_result(cache):
    report = compile_candidate(fixture("gemm_kernel.py", BLOCK_K_OF_B=32), cache_dir=cache)
    assert not report.ok and report.kernels == []
    assert "K shape check failed: K_A = 64, K_B = 32" in report.error
    assert len(report.error) <= 4000 + 3
    assert "COMPILE ERROR" in report.summary()


def test_load_kernels_compiles_once_through_the_tilelang_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang"))
    rendered = fixture("gemm_kernel.py", NUM_STAGES=2)
    start = time.perf_counter()
    module, kernels = load_kernels(rendered, cache_dir=tmp_path)
    first = time.perf_counter() - start
    assert set(kernels) == {"gemm"} and callable(module.forward)
    assert "tl::wgmma_ss" in kernels["gemm"].get_kernel_source()
    start = time.perf_counter()
    _, again = load_kernels(rendered, cache_dir=tmp_path)
    assert time.perf_counter() - start < first / 2
    assert again["gemm"].get_kernel_source() == kernels["gemm"].get_kernel_source()


CHILD_LOADS_WITHOUT_NVCC = """
import sys
from tilelang.contrib import nvcc
from tuner.compile import build_kernels
from tuner.problem import Problem
from tuner.candidate import Candidate


def no_nvcc(*args, **kwargs):
    raise AssertionError("nvcc ran")


nvcc.compile_cuda = no_nvcc
source, cache = open(sys.argv[1]).read(), sys.argv[2]
report, module, kernels = build_kernels(Candidate(Problem("decay", 128, 128, "fp16"), {}, source), cache_dir=cache)
print(report.cached, sorted(kernels), report.kernels[0].registers, "tl::wgmma_ss" in kernels["gemm"].get_kernel_source())
"""


def test_a_compiled_config_is_loaded_by_another_process_without_nvcc(tmp_path):
    # The tuner's compile pool builds; the gate's child process runs what it built.
    import subprocess
    import sys

    env = {**__import__("os").environ, "TILELANG_CACHE_DIR": str(tmp_path / "tilelang")}
    rendered = fixture("gemm_kernel.py", NUM_STAGES=2, THREADS=128)
    (tmp_path / "source.py").write_text(rendered.source)
    build = subprocess.run([sys.executable, "-c", "import sys; from tuner.compile import compile_candidate; "
                            "from tuner.problem import Problem; from tuner.candidate import Candidate; "
                            "r = compile_candidate(Candidate(Problem('decay', 128, 128, 'fp16'), {}, "
                            "open(sys.argv[1]).read()), cache_dir=sys.argv[2]); print(r.cached, r.kernels[0].registers)",
                            str(tmp_path / "source.py"), str(tmp_path)], env=env, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    cached, registers = build.stdout.split()
    assert cached == "False" and int(registers) > 0
    load = subprocess.run([sys.executable, "-c", CHILD_LOADS_WITHOUT_NVCC, str(tmp_path / "source.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True)
    assert load.returncode == 0, load.stderr[-2000:]
    assert load.stdout.split() == ["True", "['gemm']", registers, "True"]


def test_a_tilelang_cache_hit_without_a_stored_report_still_gets_ptxas_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang"))
    rendered = fixture("gemm_kernel.py", NUM_STAGES=1)
    load_kernels(rendered, cache_dir=tmp_path)  # the kernel is now in TileLang's cache, no report stored
    report = compile_candidate(rendered, cache_dir=tmp_path)
    assert not report.cached and report.error is None
    (k,) = report.kernels
    assert k.registers > 0 and k.dynamic_smem_bytes == 1 * (128 * 64 + 64 * 128) * 2


def test_a_kernel_shared_with_a_compiled_config_is_not_compiled_again(tmp_path, monkeypatch):
    # Two configs that share a kernel (here: the same source under two names) compile it once.
    from tilelang.contrib import nvcc

    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang"))
    first = compile_candidate(fixture("gemm_kernel.py", NUM_STAGES=2, THREADS=128), cache_dir=tmp_path / "a")

    def no_nvcc(*args, **kwargs):
        raise AssertionError("nvcc ran")

    monkeypatch.setattr(nvcc, "compile_cuda", no_nvcc)
    again = compile_candidate(fixture("gemm_kernel.py", NUM_STAGES=2, THREADS=128), cache_dir=tmp_path / "b")
    assert not again.cached and again.error is None
    assert [asdict_kernel(k) for k in again.kernels] == [asdict_kernel(k) for k in first.kernels]


def test_a_kernel_from_the_tilelang_cache_of_another_process_is_reported_whole(tmp_path, monkeypatch):
    # A cache hit brings neither ptxas' lines nor the device function's launch attributes: a config
    # whose kernel another process compiled still reports its shared memory and threads.
    source = fixture("gemm_kernel.py", NUM_STAGES=2, THREADS=128).source
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "tilelang"))
    first = compile_candidate(Candidate(Problem("decay", 128, 128, "fp16"), {}, source), cache_dir=tmp_path / "a")
    child = subprocess.run([sys.executable, "-c", CHILD_COMPILE, str(tmp_path / "b")], input=source, text=True,
                           capture_output=True, timeout=600)
    assert child.returncode == 0, child.stderr
    again = CompileReport.from_dict(json.loads(child.stdout.splitlines()[-1]))
    assert not again.cached and again.error is None
    assert first.kernels[0].dynamic_smem_bytes and first.kernels[0].threads
    assert [asdict_kernel(k) for k in again.kernels] == [asdict_kernel(k) for k in first.kernels]


CHILD_COMPILE = """
import json, sys
from tuner.compile import compile_candidate
from tuner.problem import Problem
from tuner.candidate import Candidate
report = compile_candidate(Candidate(Problem("decay", 128, 128, "fp16"), {}, sys.stdin.read()), cache_dir=sys.argv[1])
print(json.dumps(report.as_dict()))
"""


def asdict_kernel(k):
    return {f: getattr(k, f) for f in ("registers", "spill_stores", "stack_frame", "barriers", "dynamic_smem_bytes",
                                       "threads", "wgmma_serialized")}
