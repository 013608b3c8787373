"""A stand-in for FLA in the CPU tests, where FLA's Triton kernels cannot run: ``fla.ops`` has FLA
0.6.0's six chunk ops with its signatures, computed by the tuner's fp64 oracle. Its distribution
metadata (``fla_core-*.dist-info`` beside this folder) says fla-core, as FLA 0.6.0's does. The tests
that need FLA present put this folder on the path (tests/conftest.py, ``fla_standin``); it is never
on it by default."""
__version__ = "0.6.0+standin"
