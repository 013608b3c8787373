"""Checks shared by the template test files (test_templates_{scalar,channel,gdn}.py): render a
variant's config, compile it through `tuner.compile.build_kernels` and hold the report to ptxas'
figures and the barrier screen (and the model's shared memory to ptxas'), compare a placement's sources,
run a module's forward() against the fp64 chunked oracle, and import a script of benchmarks/."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from tuner import space
from tuner.compile import CompileReport, build_kernels
from tuner.problem import Problem
from tuner.candidate import Candidate

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rendered_config(variant: str, dk: int, dtype: str = "bf16", **overrides) -> Candidate:
    """The variant's default config at DK = DV = dk, with ``overrides`` (the defaults of the parameters
    that ``overrides`` make apply, too)."""
    problem = Problem(variant, dk, dk, dtype)
    return Candidate.from_config(problem, space.load(variant).complete(problem, overrides))


def assert_compiles_clean(rendered: Candidate, kernels: list[str], cache_dir) -> CompileReport:
    """Every program compiles for sm_90a, in the order ``kernels``, with ptxas figures, no spills,
    no serialised wgmma (C7512), and no barrier that fewer threads reach than it waits for; returns
    the report."""
    report, _, _ = build_kernels(rendered, cache_dir=cache_dir)
    assert report.error is None, report.error
    assert [k.name for k in report.kernels] == kernels
    for kernel in report.kernels:
        assert kernel.registers is not None, f"{kernel.name}: no ptxas figures captured"
    assert not report.spills, [(k.name, k.spill_stores, k.spill_loads) for k in report.kernels]
    assert not report.wgmma_serialized, [k.name for k in report.kernels if k.wgmma_serialized]
    assert not report.rejected, report.rejected
    return report


def assert_compiles_as_modelled(rendered: Candidate, kernels: list[str], cache_dir) -> CompileReport:
    """``assert_compiles_clean``, and the model's shared memory of every kernel is the launch's, to the byte."""
    report = assert_compiles_clean(rendered, kernels, cache_dir)
    assert {k.name: k.smem_bytes for k in rendered.prediction.per_kernel} == {
        k.name: k.dynamic_smem_bytes for k in report.kernels}
    return report


def benchmark_module(name: str):
    """benchmarks/<name>.py as a module (a script, not part of the package), importing its neighbours."""
    folder = Path(__file__).parents[1] / "benchmarks"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module


def sources_per_value(variant: str, dk: int, param: str, **overrides) -> dict:
    """The rendered source for every declared value of ``param`` (the rest: default + overrides)."""
    return {value: rendered_config(variant, dk, **overrides, **{param: value}).source
            for value in space.load(variant).params[param].values}


def code(source: str) -> str:
    """A rendered module without the lines that quote the config (the docstring's `Problem:` line and
    `CONFIG = ...`), which differ between any two configs."""
    return "\n".join(line for line in source.splitlines()
                     if not line.startswith(("Problem: ", "CONFIG = ")))


def assert_every_value_changes_source(variant: str, dk: int, param: str, **overrides) -> dict:
    """No two values of ``param`` render the same code; returns the sources by value."""
    sources = sources_per_value(variant, dk, param, **overrides)
    assert len({code(s) for s in sources.values()}) == len(sources), f"{variant}.{param} values render identical code"
    return sources


def oracle_errors(module, kernels: dict, rendered: Candidate, regime: str, seqlen: int) -> tuple[float, float]:
    """Relative L2 errors of forward()'s output and final state against ``reference.chunked`` in
    fp64 (batch 2, 3 heads, seed 1, on CUDA); asserts both are finite and within the variant's tolerance."""
    from tuner import reference
    from tuner.inputs import make_inputs

    variant = rendered.problem.variant
    x = make_inputs(rendered.problem, regime, seed=1, device="cuda", batch=2, seqlen=seqlen, heads=3)
    o, ht = module.forward(kernels, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=x["scale"],
                           initial_state=x["initial_state"])
    o_ref, ht_ref = reference.chunked(variant, x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                      scale=x["scale"], initial_state=x["initial_state"], output_final_state=True)
    err_o = ((o.double() - o_ref).norm() / o_ref.norm()).item()
    err_h = ((ht.double() - ht_ref).norm() / ht_ref.norm()).item()
    tolerance = rendered.problem.tolerance
    assert math.isfinite(err_o) and err_o < tolerance, (regime, seqlen, "o", err_o)
    assert math.isfinite(err_h) and err_h < tolerance, (regime, seqlen, "final_state", err_h)
    return err_o, err_h
