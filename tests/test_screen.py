"""The barrier screen: the condition evaluator on hand-written CUDA, then real TileLang output.

The real kernels are the first hand-written fused scalar-decay kernel (tests/fixtures/seed_decay_kernel.py),
which deadlocked on the H200 as written and ran correctly with its weights computed inline, and a
rendered template's default config. They compile for sm_90a without a GPU (nvcc only).
"""
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from tuner.screen import CannotEvaluate, evaluate_condition, screen

FIXTURES = Path(__file__).parent / "fixtures"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is needed to compile for sm_90a")


def entered(cond: str, threads: int, definitions=None) -> int:
    mask = evaluate_condition(cond, np.arange(threads), definitions)
    return threads if mask is None else int(mask.sum())


@pytest.mark.parametrize("cond, threads, expected", [
    pytest.param("(((int)threadIdx.x) >> 6) == 0", 128, 64, id="seed-ws-off"),
    pytest.param("(((int)threadIdx.x) >> 6) == 2", 256, 64, id="seed-ws-on"),
    pytest.param("((int)threadIdx.x) < 128", 384, 128, id="ws-consumer"),
    pytest.param("!(((int)threadIdx.x) < 128)", 384, 256, id="negation"),
    pytest.param("threadIdx.x & 1 == 0", 64, 0, id="c-precedence-and-below-eq"),
    pytest.param("(threadIdx.x & 1) == 0", 64, 32, id="parenthesised"),
    pytest.param("((((int)threadIdx.x) - 100) / 8) == 0", 128, 15, id="c-division-truncates"),
    pytest.param("((((int)threadIdx.x) - 100) % 8) == -3", 128, 13, id="c-remainder-sign"),
    pytest.param("(((int)threadIdx.x) < 64) && ((((int)threadIdx.x) & 31) == 0)", 128, 2, id="and"),
    pytest.param("(((int)threadIdx.x) < 32) || (((int)threadIdx.x) >= 96)", 128, 64, id="or"),
    pytest.param("(threadIdx.x < 64 ? 1 : 0) == 1", 128, 64, id="conditional-operator"),
    pytest.param("tl::tl_shuffle_elect<128>()", 256, 2, id="elect-per-128"),
    pytest.param("tl::tl_shuffle_elect<0>()", 256, 1, id="elect-one"),
    pytest.param("cute::elect_one_sync()", 128, 4, id="elect-per-warp"),
    pytest.param("0x40U <= threadIdx.x", 128, 64, id="hex-and-suffix"),
])
def test_condition_counts_threads(cond, threads, expected):
    assert entered(cond, threads) == expected


def test_uniform_condition_is_none():
    assert evaluate_condition("(k_1 % 3) == 0", np.arange(128)) is None
    assert evaluate_condition("((int)blockIdx.x) < 4", np.arange(128)) is None


def test_local_variable_is_substituted():
    defs = {"warp": "(((int)threadIdx.x) >> 5)", "pair": "(warp >> 1)"}
    assert entered("pair == 1", 256, defs) == 64


def test_thread_condition_with_unknown_is_refused():
    with pytest.raises(CannotEvaluate, match="i_2"):
        evaluate_condition("((i_2 * 8) + ((int)threadIdx.x)) < 100", np.arange(128))


def kernel(body: str, threads: int = 128) -> str:
    return (f'extern "C" __global__ void k(float* x);\n'
            f'extern "C" __global__ void __launch_bounds__({threads}, 1) k(float* x) {{\n{body}\n}}\n')


def test_seed_pattern_is_rejected_with_counts():
    src = kernel("""
  for (int i_s = 0; i_s < 30; ++i_s) {
    __syncthreads();
    if ((((int)threadIdx.x) >> 6) == 0) {
      x[threadIdx.x] = 1.f;
      __syncthreads();
    }
  }""")
    (finding,) = screen(src)
    assert finding.rejects and finding.line == 8
    assert "barrier for 128 threads inside a branch entered by 64 threads" in finding.message


def test_warp_specialised_layout_passes():
    src = kernel("""
  __syncthreads();
  if (((int)threadIdx.x) < 128) {
    if (tl::tl_shuffle_elect<128>()) { x[0] = 1.f; }
    tl::__sync_thread_partial(1, 128);
  } else {
    tl::__sync_thread_partial(2, 256);
    tl::AllReduce<tl::SumOp, 128, 1, 128, tl::NamedBarrier<256>>::run(x[0], x);
  }""", threads=384)
    assert screen(src) == []


def test_else_branch_negates_the_chain():
    src = kernel("""
  if (((int)threadIdx.x) < 128) {
    x[0] = 0.f;
  } else if (((int)threadIdx.x) < 320) {
    tl::__sync_thread_partial(2, 256);
  } else {
    __syncthreads();
  }""", threads=384)
    findings = screen(src)
    assert [f.line for f in findings] == [7, 9]
    assert "barrier for 256 threads inside a branch entered by 192 threads" in findings[0].message
    assert "barrier for 384 threads inside a branch entered by 64 threads" in findings[1].message


def test_nested_branches_combine_and_braceless_if_counts():
    src = kernel("""
  if (((int)threadIdx.x) < 64) {
    if ((((int)threadIdx.x) & 1) == 0)
      asm volatile("bar.sync %0, %1;" : : "r"(1), "r"(64));
  }""")
    (finding,) = screen(src)
    assert "barrier for 64 threads inside a branch entered by 32 threads" in finding.message


def test_allreduce_with_block_barrier_inside_branch():
    src = kernel("""
  if (((int)threadIdx.x) < 64) {
    x[0] = tl::AllReduce<tl::SumOp, 64, 1, 0>::run(x[0], x);
    x[1] = tl::AllReduce<tl::SumOp, 32, 1, 0>::run(x[1], x);
  }""")
    (finding,) = screen(src)
    assert "barrier for 128 threads inside a branch entered by 64 threads" in finding.message


def test_unreadable_condition_is_noted_not_rejected():
    src = kernel("""
  for (int i = 0; i < 4; ++i) {
    if (((i * 32) + ((int)threadIdx.x)) < 100) {
      __syncthreads();
    }
  }""")
    (finding,) = screen(src)
    assert finding.kind == "cannot_evaluate" and not finding.rejects


def test_comments_and_strings_do_not_confuse_the_scanner():
    src = kernel("""
  // if (((int)threadIdx.x) < 1) { __syncthreads(); }
  /* } } */ const char* s = "{ if (threadIdx.x < 1) {";
  __syncthreads();""")
    assert screen(src) == []


def test_threads_argument_is_used_without_launch_bounds():
    src = ('extern "C" __global__ void k(float* x) {\n'
           '  if (((int)threadIdx.x) < 64) { __syncthreads(); }\n}\n')
    assert "entered by 64 threads" in screen(src, threads=256)[0].message
    assert screen(src)[0].kind == "cannot_evaluate"


# ---- real TileLang output


def seed_kernel(**constants) -> str:
    src = (FIXTURES / "seed_decay_kernel.py").read_text()
    for name, value in constants.items():
        src, n = re.subn(rf"^{name} = .*$", f"{name} = {value}", src, flags=re.M)
        assert n == 1, name
    return src


def compile_source(source, tmp_path):
    """Compile a fixture's source text (or a Candidate) for sm_90a; the report."""
    from tuner.compile import build_kernels
    from tuner.problem import Problem
    from tuner.candidate import Candidate

    if isinstance(source, str):
        source = Candidate(Problem("decay", 128, 128, "fp16"), {"threads": 128}, source)
    report, _, _ = build_kernels(source, cache_dir=tmp_path)
    assert report.error is None, report.error
    return report


@needs_nvcc
@pytest.mark.parametrize("warp_specialized, barrier", [
    pytest.param(True, "tl::__sync_thread_partial(3, 128)", id="ws-on"),
    pytest.param(False, "__syncthreads()", id="ws-off"),
])
def test_seed_kernel_as_written_is_rejected(tmp_path, warp_specialized, barrier):
    report = compile_source(seed_kernel(WARP_SPECIALIZED=warp_specialized), tmp_path)
    assert not report.ok and report.rejected
    for finding in report.rejected:
        assert "barrier for 128 threads inside a branch entered by 64 threads" in finding.message
        assert barrier in finding.message
    # The finding points at a real barrier line of the generated CUDA.
    cuda = report.kernels[0].cuda_source.splitlines()
    assert barrier in cuda[report.rejected[0].line - 1]


@needs_nvcc
def test_seed_kernel_with_inline_weights_passes(tmp_path):
    report = compile_source(seed_kernel(INLINE_WEIGHTS=True), tmp_path)
    assert report.ok and report.screen_findings == []
    # Warp specialised: the consumer branch and its partial barriers are there, and accepted.
    src = report.kernels[0].cuda_source
    assert "if (((int)threadIdx.x) < 128) {" in src and "tl::__sync_thread_partial(" in src


@needs_nvcc
def test_rendered_default_config_passes_the_screen(tmp_path):
    from tuner import space
    from tuner.problem import Problem
    from tuner.render import render
    from tuner.variants import get

    if not get("decay").template.exists() or not get("decay").search_space.exists():
        pytest.skip("templates/decay.py.j2 or search_spaces/decay.yaml not written yet")
    problem = Problem("decay", 64, 64, "bf16")
    rendered = render(problem, space.load("decay").default(problem))
    report = compile_source(rendered, tmp_path)
    assert report.kernels and all("__global__" in k.cuda_source for k in report.kernels)
    assert report.rejected == [], report.summary()


@needs_nvcc
def test_role_split_kernel_mbarriers_are_counted(tmp_path):
    from tuner import space
    from tuner.candidate import Candidate
    from tuner.problem import Problem

    problem = Problem("gdn", 128, 128, "bf16")
    config = space.load("gdn").complete(problem, {"split": "pre_seq", "solve": "merged", "block_dv": 64,
                                                  "sequential_roles": True, "num_stages": 2})
    report = compile_source(Candidate.from_config(problem, config), tmp_path)
    src = next(k for k in report.kernels if k.name == "sequential").cuda_source
    assert report.ok and "stage_free[0].init(384);" in src and screen(src) == []
    # Arrivals short of the count (a hang) and beyond it (a phase that completes early) are refused.
    for init, arrive in ((400, 384), (256, 384)):
        wrong = src.replace("stage_free[0].init(384);", f"stage_free[0].init({init});").replace(
            "stage_free[1].init(384);", f"stage_free[1].init({init});")
        findings = screen(wrong)
        assert [f.kind for f in findings] == ["mbarrier_arrivals_not_its_count"] and findings[0].rejects
        assert f"initialised for {init} arrivals a phase and {arrive} threads arrive" in findings[0].message
    # The producer's arrival is one warp's: moved under its elected thread, one thread arrives.
    producer = src.index("loaded[(c_3 & 1)].arrive();")
    elected = src.replace("loaded[(c_3 & 1)].arrive();", "if (tl::tl_shuffle_elect<32>()) { loaded[(c_3 & 1)].arrive(); }")
    assert producer and "initialised for 32 arrivals a phase and 1 threads arrive" in screen(elected)[0].message


@needs_nvcc
def test_setmaxnreg_against_its_direction_is_refused(tmp_path):
    """kda's packed role-split kernel once asked setmaxnreg.inc for 104 registers from the 128 its warps
    start with, and stopped with an illegal instruction on the H100: as rendered now its output role
    lowers (.dec) to 104; turned back into an .inc, the screen refuses it."""
    from packed_checks import CONFIGS
    from template_checks import rendered_config

    report = compile_source(rendered_config("kda", 64, **CONFIGS["kda"]["roles"]), tmp_path)
    kernel = next(k for k in report.kernels if k.name == "sequential")
    src = kernel.cuda_source
    assert report.ok and kernel.registers == 128 and "tl::warpgroup_reg_dealloc<104>();" in src
    assert screen(src, registers=kernel.registers) == []
    raised = src.replace("tl::warpgroup_reg_dealloc<104>();", "tl::warpgroup_reg_alloc<104>();")
    findings = screen(raised, registers=kernel.registers)
    assert [f.kind for f in findings] == ["setmaxnreg_against_its_direction"] and findings[0].rejects
    assert "setmaxnreg.inc to 104 registers in a kernel whose warps start at 128" in findings[0].message
    assert "tl::warpgroup_reg_alloc<104>();" in raised.splitlines()[findings[0].line - 1]
    # Without ptxas' count an .inc cannot be judged (its start may be lower), a .dec above the launch's
    # share of registers (128 at 512 threads) always can.
    assert screen(raised) == []
    lowered = src.replace("tl::warpgroup_reg_alloc<152>();", "tl::warpgroup_reg_dealloc<152>();")
    assert [f.message for f in screen(lowered)] == [
        "setmaxnreg.dec to 152 registers in a kernel whose warps start at 128 (block of 512): .dec can only "
        "lower the count (an illegal instruction on the GPU)"]
