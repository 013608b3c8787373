"""Stand-ins for the compile step of a search, for tests that look at the search rather than at
kernels. The compile pool's processes import them by name (this folder is on their path), so they
live in a module of their own."""
from __future__ import annotations

import time

from tuner.compile import CompileReport


def compile_nothing(candidate) -> dict:
    """A compile that succeeds at once with no kernels, as :func:`tuner.search.compile_for_gate` reports."""
    report = CompileReport(candidate.name, candidate.digest, "sm_90a")
    return {"error": None, "rejected": [], "report": report.as_dict(), "seconds": 0.0}


def compile_stuck_at_two_stages(candidate) -> dict:
    """A compile that never returns for a config of two stages, and succeeds at once otherwise."""
    if candidate.config.get("num_stages") == 2:
        time.sleep(3600)
    return compile_nothing(candidate)
