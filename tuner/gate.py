"""The correctness gate: run a config against the fp64 oracle in a child process with a watchdog.

A kernel that deadlocks hangs the process that launched it (a kernel whose barrier
not every thread reaches never returns), so every check runs in a child (``tuner._gate_worker``) in its own process group; when
the watchdog fires the whole group is killed and the result is ``hang``. The caller never blocks
for longer than ``timeout_s``.

The child takes the candidate's source (and its twin's; it renders nothing), compiles with
``tuner.compile.build_kernels`` and stops at a compile error or a screen rejection. Then, for each regime of ``tuner.inputs.regimes_for``,
each sequence length (a multiple of the chunk and not: 1024 and 1000 by default) and each seed, it
runs ``forward`` and compares ``o`` and the final state with ``tuner.reference.chunked`` in fp64 on
the same device by relative L2. A staged config (``num_stages > 0``) is also compared with its
``num_stages = 0`` twin (TileLang issues #2668, #2957: pipelining can miscompile).
A config of kernels that take packed sequences (``packed``) also runs the ``packed`` regime: sequences
of several lengths, initial states and grouped value heads in one call, against the oracle on each
sequence. ``gate_and_time`` also times a passing config at the problem's shape in the same child, so a
trial costs one child.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from . import limits, status
from .candidate import Candidate

__all__ = ["GateResult", "STATUSES", "run_gate", "gate_and_time", "shape_timing", "outcome_at"]

STATUSES = tuple(s.value for s in status.GATE)
# The end of the child's output kept in a crash message.
LOG_TAIL_CHARS = 3000


@dataclass
class GateResult:
    """The gate's verdict on one config.

    Attributes:
        status: one of :data:`STATUSES`.
        errors: regime -> {"o": rel L2, "final_state": rel L2, "seqlen": T} for the worst length and
            seed of that regime (by the error of ``o``), plus "twin_o"/"twin_final_state" (the
            difference from the ``num_stages = 0`` twin) for staged configs.
        message: why it did not pass (compiler message, screen finding, where it hung, ...).
        seconds: wall time of the child, compile included.
        timing: ``bench.Timing.as_dict()`` plus ``floor_ms``, from ``gate_and_time`` on a pass.
        timing_at: shape ``BxTxH`` -> the same for each shape of ``gate_and_time``'s ``also_at``, or
            {"error": message} where timing at that shape failed (say, out of memory).
        compile: ``CompileReport.as_dict()`` of the config (None when the child died before it).
    """

    status: str
    errors: dict = field(default_factory=dict)
    message: str = ""
    seconds: float = 0.0
    timing: dict | None = None
    compile: dict | None = None
    timing_at: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GateResult":
        if d.get("status") not in STATUSES:
            raise ValueError(f"unknown gate status {d.get('status')!r}; expected one of {STATUSES}")
        return cls(**d)


def shape_timing(timing_at: dict, shape: str) -> tuple[dict | None, str]:
    """The timing ``gate_and_time`` took at ``shape``, one of its ``also_at`` (``GateResult.timing_at``),
    or None and why there is none."""
    timing = timing_at.get(shape)
    if timing is None or "error" in timing:
        return None, f"timing at {shape} failed: {(timing or {}).get('error', 'not timed')}"
    return timing, ""


def outcome_at(result: GateResult, shape: str, timed_shape: str) -> tuple[str, dict, str]:
    """What a ``gate_and_time`` result says of ``shape``: the status, the timing (empty unless it
    passed) and why a passing config has no timing there. ``timed_shape`` is the candidate's own
    shape, any other one of its ``also_at``; a shape whose timing failed is a crash."""
    if result.status != "pass":
        return result.status, {}, ""
    if shape == timed_shape:
        return "pass", result.timing or {}, ""
    timing, failure = shape_timing(result.timing_at, shape)
    return ("pass", timing, "") if timing is not None else ("crash", {}, failure)


def run_gate(candidate: Candidate, *, regimes: list[str] | None = None, timeout_s: float = limits.GATE_S,
             device: int = 0, tolerance: float | None = None,
             seeds: tuple[int, ...] = (0, 1), seqlens: tuple[int, ...] = (1024, 1000), batch: int = 2,
             heads: int = 4, cache_dir=None) -> GateResult:
    """Check ``candidate`` against the fp64 oracle, in a child process with a watchdog.

    Args:
        candidate (Candidate): the rendered config (its problem's shape is what ``gate_and_time``
            times); a staged one is also compared with its twin (``Candidate.twin``). A test may
            build one from any module source with the ``programs()``/``forward()`` contract.
        regimes (list[str]): input regimes. Default: None (``tuner.inputs.regimes_for(variant, packed)``,
            packed when the config states it).
        timeout_s (float): wall-clock limit of the child, compile included; then its process group
            is killed and the status is "hang". Default: ``limits.GATE_S``.
        device (int): CUDA device index; the CPU when CUDA is absent. Default: 0.
        tolerance (float): relative L2 limit. Default: None (``problem.tolerance``, per dtype).
        seeds (tuple[int]): input seeds. Default: (0, 1).
        seqlens (tuple[int]): sequence lengths checked. Default: (1024, 1000).
        batch, heads (int): B and H of the check. Default: 2, 4.
        cache_dir: kernels cache root (see ``tuner.compile``). Default: None.

    Returns:
        GateResult
    """
    job = _job(candidate, regimes=regimes, device=device, tolerance=tolerance, seeds=seeds,
               seqlens=seqlens, batch=batch, heads=heads, cache_dir=cache_dir)
    return _run_child(job, timeout_s)


def gate_and_time(candidate: Candidate, *, also_at: tuple[str, ...] = (), warmup_ms: float = 25.0,
                  rep: int = 100, timeout_s: float = limits.GATE_S, **gate_args) -> GateResult:
    """:func:`run_gate`, then on a pass time ``forward`` at the problem's (B, T, H) in the same child,
    and at each shape of ``also_at``: the gate does not depend on the shape, so one gate serves all.

    Args:
        candidate (Candidate): as in :func:`run_gate`.
        also_at (tuple[str]): more shapes (``BxTxH``) to time a passing config at (``timing_at``).
        warmup_ms (float), rep (int): passed to ``tuner.bench.time_forward``. Default: 25, 100.
        timeout_s (float): as in :func:`run_gate`; make it cover the timing too. Default: ``limits.GATE_S``.
        **gate_args: the other keyword arguments of :func:`run_gate`.

    Returns:
        GateResult with ``timing`` (and ``timing_at``) filled on a pass.
    """
    job = _job(candidate, **gate_args)
    job.update(time=True, also_at=list(also_at), warmup_ms=warmup_ms, rep=rep)
    return _run_child(job, timeout_s)


def _job(candidate: Candidate, *, regimes=None, device=0, tolerance=None, seeds=(0, 1),
         seqlens=(1024, 1000), batch=2, heads=4, cache_dir=None) -> dict:
    """What the child needs, as JSON."""
    twin = candidate.twin
    return dict(problem=candidate.problem.as_dict(), config=candidate.config, source=candidate.source,
                twin=None if twin is None else dict(config=twin.config, source=twin.source),
                regimes=regimes, device=device,
                tolerance=candidate.problem.tolerance if tolerance is None else tolerance, seeds=list(seeds),
                seqlens=list(seqlens), batch=batch, heads=heads, cache_dir=str(cache_dir) if cache_dir else None,
                time=False)


def _run_child(job: dict, timeout_s: float) -> GateResult:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="linattn-gate-") as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        progress_path, log_path = os.path.join(tmp, "progress"), os.path.join(tmp, "log")
        with open(job_path, "w") as f:
            json.dump(dict(job, progress=progress_path), f)
        with open(log_path, "w") as log:
            # A new session is a new process group: the watchdog kills the child and all it started.
            proc = subprocess.Popen([sys.executable, "-m", "tuner._gate_worker", job_path, result_path],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                step = _read(progress_path).strip() or "starting"
                return GateResult("hang", message=f"no result after {timeout_s:g} s; killed during: {step}",
                                  seconds=round(time.perf_counter() - start, 3))
        seconds = round(time.perf_counter() - start, 3)
        if os.path.exists(result_path):
            result = GateResult.from_dict(json.loads(_read(result_path)))
            result.seconds = seconds
            return result
        tail = _read(log_path)[-LOG_TAIL_CHARS:]
        step = _read(progress_path).strip() or "starting"
        return GateResult("crash", message=f"child exited with code {proc.returncode} during: {step}\n{tail}",
                          seconds=seconds)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""
