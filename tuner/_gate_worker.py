"""The gate's child process: ``python -m tuner._gate_worker JOB.json RESULT.json``.

Reads the job ``tuner.gate`` wrote, writes a ``GateResult`` dict as JSON, and notes each step in
the job's progress file so that the parent can say where a killed child was.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import torch

from . import inputs, reference
from .candidate import Candidate
from .compile import build_kernels
from .problem import Problem

# Bytes of NaN written through the caching allocator before each forward: outputs that forward
# allocates tend to reuse this memory, so elements the kernel never writes read as NaN (best
# effort: the allocator gives no guarantee).
POISON_BYTES = 64 * 1024 * 1024


class _Progress:
    def __init__(self, path: str):
        self.path = path

    def __call__(self, step: str) -> None:
        with open(self.path, "w") as f:
            f.write(step)


def main(argv: list[str]) -> int:
    job_path, result_path = argv
    with open(job_path) as f:
        job = json.load(f)
    start = time.perf_counter()
    try:
        result = gate(job, _Progress(job["progress"]))
    except Exception:  # noqa: BLE001 - anything the kernel or its glue raises is a crash verdict
        result = dict(status="crash", message=traceback.format_exc()[-3000:])
    result["seconds"] = round(time.perf_counter() - start, 3)
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    # The parent treats a missing result as a crash: write it whole or not at all.
    os.replace(result_path + ".tmp", result_path)
    return 0


def gate(job: dict, progress) -> dict:
    """Run the job: compile, screen, compare with the oracle, maybe time. Returns the result dict."""
    problem = Problem(**job["problem"])
    config = job["config"]
    device = _device(job["device"])

    progress("compile")
    report, module, kernels = build_kernels(Candidate(problem, config, job["source"]), cache_dir=job["cache_dir"])
    out = dict(status="pass", errors={}, message="", timing=None, compile=report.as_dict())
    if report.error is not None:
        return dict(out, status="compile_error", message=report.error)
    if report.rejected:
        return dict(out, status="screen", message="; ".join(f"line {f.line}: {f.message}" for f in report.rejected))

    twin = None
    if job["twin"] is not None:
        progress("compile num_stages=0 twin")
        twin_report, twin_module, twin_kernels = build_kernels(Candidate(problem, **job["twin"]),
                                                               cache_dir=job["cache_dir"])
        if twin_report.ok:
            twin = (twin_module, twin_kernels)
        else:
            out["message"] = f"num_stages=0 twin not comparable: {twin_report.error or 'rejected by the screen'}"

    tolerance = job["tolerance"]
    worst_failure = None
    packed = problem.packed or config.get("packed", False)
    for regime in job["regimes"] or inputs.regimes_for(problem.variant, packed=packed):
        for T in job["seqlens"]:
            for seed in job["seeds"]:
                where = f"regime {regime}, T={T}, seed {seed}"
                progress(f"forward: {where}")
                x = inputs.make_inputs(problem, regime, seed, device, batch=job["batch"], seqlen=T, heads=job["heads"])
                o, state = _forward(module, kernels, x, device)
                progress(f"reference: {where}")
                ref_o, ref_state = reference.chunked(problem.variant, **x, output_final_state=True)
                errors = dict(o=_rel_l2(o, ref_o), final_state=_rel_l2(state, ref_state), seqlen=T)
                if twin is not None:
                    progress(f"twin forward: {where}")
                    twin_o, twin_state = _forward(*twin, x, device)
                    errors.update(twin_o=_rel_l2(o, twin_o), twin_final_state=_rel_l2(state, twin_state))
                kept = out["errors"].get(regime)
                if kept is None or not errors["o"] <= kept["o"]:  # NaN counts as the worst
                    out["errors"][regime] = errors
                failure = _failure(errors, tolerance, where)
                if failure and (worst_failure is None or (failure[0] == "nan" and worst_failure[0] != "nan")):
                    worst_failure = failure
    if worst_failure is not None:
        return dict(out, status=worst_failure[0], message=worst_failure[1])

    if job["time"]:
        from . import bench

        timing = dict(warmup_ms=job["warmup_ms"], rep=job["rep"], device=device if device.type == "cuda" else None)
        progress("timing")
        x = inputs.timing_inputs(problem, device)
        out["timing"] = bench.time_module(problem, module, kernels, x, **timing)
        out["timing_at"] = {}
        for shape in job["also_at"]:
            progress(f"timing at {shape}")
            at = problem.at(shape)
            x = None  # the inputs of one shape are freed before the next is made
            try:
                x = inputs.timing_inputs(at, device)
                out["timing_at"][shape] = bench.time_module(at, module, kernels, x, **timing)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at a larger shape: that shape's outcome
                out["timing_at"][shape] = {"error": f"{type(e).__name__}: {e}"[:1000]}
    return out


def _device(index: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _forward(module, kernels, x: dict, device: torch.device):
    if device.type == "cuda":
        torch.full((POISON_BYTES // 4,), float("nan"), device=device)
    o, state = module.forward(kernels, **x)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return o, state


def _rel_l2(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN when ``out`` holds a NaN or Inf (or is missing)."""
    if out is None or out.shape != ref.shape:
        return math.nan
    out = out.double()
    if not torch.isfinite(out).all():
        return math.nan
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _failure(errors: dict, tolerance: float, where: str) -> tuple[str, str] | None:
    values = {k: v for k, v in errors.items() if k != "seqlen"}
    bad = [k for k, v in values.items() if math.isnan(v)]
    if bad:
        return "nan", f"NaN/Inf or wrong shape in {', '.join(bad)} ({where})"
    over = [f"{k} {v:.3g}" for k, v in values.items() if v > tolerance]
    if over:
        return "mismatch", f"relative L2 above {tolerance:g}: {', '.join(over)} ({where})"
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
