"""The compile pool: candidates compile in worker processes ahead of the GPU.

Each worker leads a process group of its own (its nvcc with it) and tells the pool its pid when it
starts, so the pool can kill a stuck compile, or every compile at a Ctrl-C, compiler included: an
interrupted compile must not finish into the kernel cache unseen.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import os
import signal
import time

from ..candidate import Candidate


def compile_for_gate(candidate: Candidate) -> dict:
    """Compile a candidate (in a pool process; a plain dict crosses back) and, when it compiles, its
    ``num_stages = 0`` twin: the gate's child then loads both from the caches and runs no nvcc."""
    from ..compile import compile_candidate

    start = time.monotonic()
    report = compile_candidate(candidate)
    if candidate.twin is not None and report.ok:
        compile_candidate(candidate.twin)
    print(report.summary(), flush=True)  # the compile log: ptxas' figures, or the error, per kernel
    return {"error": report.error, "rejected": [f.message for f in report.rejected],
            "report": report.as_dict(), "seconds": time.monotonic() - start}


class CompilePool:
    """``jobs`` compile processes writing their output to ``log_path``.

    Args:
        jobs (int): processes.
        log_path (str): the compile log (TVM prints tracebacks of failed compiles; the errors are
            in the trial rows, and the terminal keeps the progress).
    """

    def __init__(self, jobs: int, log_path: str):
        context = multiprocessing.get_context("spawn")  # no CUDA state or torch threads forked
        self._started = context.SimpleQueue()
        self._pids: set[int] = set()
        self._executor = cf.ProcessPoolExecutor(jobs, mp_context=context, initializer=_start_worker,
                                                initargs=(log_path, self._started))

    def submit(self, candidate: Candidate) -> cf.Future:
        """Compile ``candidate`` (and its twin) with :func:`compile_for_gate`."""
        return self._executor.submit(compile_for_gate, candidate)

    def kill(self) -> None:
        """Kill every worker and its compiler. A compile killed leaves no report behind: it is
        compiled again when asked again."""
        while not self._started.empty():
            self._pids.add(self._started.get())
        for pid in self._pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # gone
                pass
        self.shutdown()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _start_worker(log_path: str, started) -> None:
    """A compile process's set-up: its own session, the log as its output, its pid told."""
    # A Ctrl-C is the tuner's to handle, not a compile's: in a session of its own, the process and its
    # nvcc are out of the terminal's reach (an nvcc stopped by it would pass for a compile error).
    os.setsid()
    started.put(os.getpid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # A kernel shared by several configs is found in TileLang's memory cache each time, with a
    # warning that drowns the errors (thousands of them in a run).
    logging.getLogger("tilelang.cache.kernel_cache").addFilter(lambda r: "in memory cache" not in r.getMessage())
