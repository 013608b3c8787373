"""One worker process per CUDA device, all on one study.

Each worker is a spawned process that sees only its device (``CUDA_VISIBLE_DEVICES``, set before it
starts), leads a session of its own (a Ctrl-C at the terminal reaches the parent alone, which passes
it on to every worker, so each gives back its running trials) and writes its output to a log file.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable

from ..errors import UserError


def select_gpus(wanted: str | list[int]) -> list[int]:
    """The CUDA device indices of ``--gpus`` ("all" or a list), checked against what torch sees.

    Compile-only tuning needs no GPU and is refused here: its parallelism is ``--jobs``, or
    several ``tune run`` processes on one ``--storage``.
    """
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserError(f"--gpus needs CUDA devices and torch {torch.__version__} sees none "
                        f"(built for CUDA {torch.version.cuda or 'none'}, CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); without a GPU run `tune run` "
                        "without --gpus, or several of them on one --storage")
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    seen = ", ".join(f"{i}: {name}" for i, name in enumerate(names))
    devices = list(range(count)) if wanted == "all" else wanted
    missing = [i for i in devices if i >= count]
    if missing:
        raise UserError(f"--gpus {','.join(map(str, missing))}: no such device; torch sees {seen}")
    if len({names[i] for i in devices}) > 1:
        raise UserError(f"--gpus mixes GPU models ({seen}): each model is its own study, tune them separately")
    return devices


def run_on_gpus(devices: list[int], work: Callable[[int], int], log_base: str,
                started: Callable[[int, int, str], None]) -> list[int]:
    """Run ``work(i)`` for the ``i``-th of ``devices`` in a worker process of its own, each seeing only
    its device, writing to ``<log_base>.gpu<device>.log``; ``started(pid, device, log)`` is called as
    each starts. ``work`` must be picklable (a module-level function, or a partial of one) and
    return an exit code. Returns the workers' exit codes, in the order of ``devices``; a Ctrl-C is
    passed on to every worker, waited for, and raised again."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state inherited
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",") if visible else [str(i) for i in range(max(devices) + 1)]
    workers = []
    try:
        for i, device in enumerate(devices):
            log = f"{log_base}.gpu{device}.log"
            process = context.Process(target=_worker, args=(work, i, log))
            os.environ["CUDA_VISIBLE_DEVICES"] = physical[device]  # what the spawned interpreter inherits
            try:
                process.start()
            finally:
                _restore("CUDA_VISIBLE_DEVICES", visible)
            workers.append(process)
            started(process.pid, device, log)
        for process in workers:
            process.join()
    except KeyboardInterrupt:
        for process in workers:
            if process.is_alive():
                os.kill(process.pid, signal.SIGINT)
        for process in workers:
            process.join()
        raise
    return [process.exitcode for process in workers]


def _worker(work: Callable[[int], int], index: int, log: str) -> None:
    os.setsid()  # out of the terminal's reach: the parent passes a Ctrl-C on
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        code = work(index)
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.exit(code)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
