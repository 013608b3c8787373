"""The register and shared-memory model of the generated kernels: about a millisecond per config,
no TileLang import, no compile (docs/model.md has the rules and the accuracy). It reads a
kernel's source and nothing else, so it sits below rendering and the search space in the pipeline.

- :mod:`.source`: each kernel of a rendered module, read with ``ast`` (:func:`parse_kernels`).
- :mod:`.smem`: its shared memory, exact (:func:`shared_memory_plan`, :func:`shared_memory_bytes`).
- :mod:`.registers`: its register demand against its budget (:func:`predict`, :class:`Prediction`).

Calibration against ptxas, which compiles and writes to the database, is a tool over the model:
:mod:`tuner.calibration`.
"""
from .registers import (FITTED, REGISTER_LIMIT, WS_CONSUMER_REGISTERS, KernelPrediction, Prediction, combine,
                        launch_register_cap, predict, predict_kernel, terms)
from .smem import Placement, shared_memory_bytes, shared_memory_plan
from .source import Buffer, Kernel, parse_kernels

__all__ = ["FITTED", "REGISTER_LIMIT", "WS_CONSUMER_REGISTERS", "Buffer", "Kernel", "KernelPrediction", "Placement",
           "Prediction", "combine", "launch_register_cap", "parse_kernels", "predict", "predict_kernel",
           "shared_memory_bytes", "shared_memory_plan", "terms"]
