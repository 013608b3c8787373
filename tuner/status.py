"""The outcome of judging one config, in pipeline order, and the groups the tuner reasons with.

A ``Status`` is a ``str``: the value stored in the trial rows, shown to users and told to Optuna.
"""
from __future__ import annotations

from enum import Enum


class Status(str, Enum):
    CONSTRAINT = "constraint"        # broke a constraint of the search space; nothing rendered
    PRUNED = "pruned"                # the register model predicts spills; nothing compiled
    COMPILE_ERROR = "compile_error"  # the template or TileLang/nvcc refused it
    SCREEN = "screen"                # the static screen found a barrier fewer threads reach than it waits for
    COMPILED = "compiled"            # compiled, without a GPU to gate and time it
    HANG = "hang"                    # a compile or the gate outlived its watchdog
    NAN = "nan"                      # the gate saw a non-finite output
    MISMATCH = "mismatch"            # the gate saw an error above the tolerance against the fp64 oracle
    CRASH = "crash"                  # a process died or raised
    PASS = "pass"                    # passed the gate and was timed

    def __str__(self) -> str:
        return self.value


# What the gate's child can report.
GATE = (Status.PASS, Status.COMPILE_ERROR, Status.SCREEN, Status.HANG, Status.NAN, Status.MISMATCH, Status.CRASH)
# Settled before anything compiles: free, so not counted against a run's --trials.
FREE = (Status.CONSTRAINT, Status.PRUNED)
# A kernel that was compiled or run and failed.
FAILED = (Status.COMPILE_ERROR, Status.SCREEN, Status.HANG, Status.NAN, Status.MISMATCH, Status.CRASH)
# Outcomes that mean "this config cannot work", with the name of the constraint that tells the
# sampler so (the space, the register budget, or the kernel itself).
INFEASIBLE = {Status.CONSTRAINT: "space", Status.PRUNED: "registers", **{s: "kernel" for s in FAILED}}
