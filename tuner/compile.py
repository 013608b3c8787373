"""Compile a candidate's kernel module for Hopper and report what ptxas says about each kernel.

The candidate's source is written to ``<cache>/kernels/<candidate.name>.py`` (kept for inspection;
``<cache>`` is ``$LINATTN_CACHE`` or ``~/.cache/linattn-tuner``), imported from that file (TileLang
reads a ``prim_func``'s source through ``inspect``, so it must live in a file), and every program
of ``programs()`` is compiled with ptxas in verbose mode. The figures come from the ``PTXAS
verbose output`` record that TileLang 0.1.15 logs to the ``tilelang`` logger.

Caching: a TileLang cache hit skips nvcc, and with it ptxas' lines and the device function's launch
attributes (dynamic shared memory, threads). ``build_kernels`` compiles with ptxas in verbose mode,
keeps each kernel's report in its TileLang cache entry (``KEPT_REPORT``) and stores the report of the
module beside it as ``<name>.<arch>.report.json`` (the name holds the source
digest). Asked again, ``compile_candidate`` and ``build_kernels`` reuse the stored report and load
the kernels from TileLang's cache: what the tuner's compile pool built is what the gate runs,
without a second nvcc. ``load_kernels`` (for running: the gate, the ops) passes the same compile
flags, so it shares the cache entries. A kernel shared by several configs (the output kernel of
configs that differ in the state pass) is compiled once: its report comes from the cache entry.
Without one (an entry made by ``load_kernels``) it is compiled again with TileLang's cache off.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

from . import paths
from .screen import Finding, screen

__all__ = ["CompilerKilled", "KernelReport", "CompileReport", "compile_candidate", "build_kernels", "load_kernels",
           "kernels_dir", "parse_ptxas"]

# Error messages keep their tail (where nvcc and TVM put the cause), at most this many characters.
ERROR_CHARS = 4000


class CompilerKilled(RuntimeError):
    """The compiler was killed while it ran: no outcome of the kernel's, so none is stored."""


@dataclass
class KernelReport:
    """What ptxas and TileLang say about one compiled program.

    Attributes:
        name: the program's name in ``programs()``.
        entry: the ``__global__`` function ptxas compiled.
        registers: registers per thread (with warp specialisation on, the ``setmaxnreg`` cap).
        spill_stores, spill_loads, stack_frame: bytes, per thread.
        smem_bytes: static shared memory (ptxas). dynamic_smem_bytes: the dynamic shared memory
            TileLang launches with (None where it depends on a symbolic shape or is unknown).
        barriers: named barriers used. threads: threads per block (producer warps included).
        wgmma_serialized: ptxas warned C7512 (wgmma serialised for lack of registers).
    """

    name: str
    entry: str | None = None
    registers: int | None = None
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    smem_bytes: int = 0
    dynamic_smem_bytes: int | None = None
    barriers: int = 0
    threads: int | None = None
    wgmma_serialized: bool = False
    cuda_source: str = field(default="", repr=False)

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)


@dataclass
class CompileReport:
    """The outcome of compiling one candidate module: a compile failure is a result, not an exception.

    ``ok``: compiled and no screen finding rejects it. ``error``: the compiler's message, trimmed.
    """

    name: str
    digest: str
    arch: str
    kernels: list[KernelReport] = field(default_factory=list)
    compile_seconds: float = 0.0
    error: str | None = None
    screen_findings: list[Finding] = field(default_factory=list)
    source_path: str = ""
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.rejected

    @property
    def rejected(self) -> list[Finding]:
        """The screen findings that reject the kernel."""
        return [f for f in self.screen_findings if f.rejects]

    @property
    def spills(self) -> bool:
        return any(k.spills for k in self.kernels)

    @property
    def wgmma_serialized(self) -> bool:
        return any(k.wgmma_serialized for k in self.kernels)

    def as_dict(self, with_source: bool = False) -> dict:
        d = asdict(self)
        d["screen_findings"] = [f.as_dict() for f in self.screen_findings]
        if not with_source:
            for k in d["kernels"]:
                k.pop("cuda_source")
        d.update(ok=self.ok, spills=self.spills)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CompileReport":
        d = {k: v for k, v in d.items() if k not in ("ok", "spills")}
        d["kernels"] = [KernelReport(**k) for k in d.get("kernels", [])]
        d["screen_findings"] = [Finding.from_dict(f) for f in d.get("screen_findings", [])]
        return cls(**d)

    def summary(self) -> str:
        """A short human table."""
        head = f"{self.name} ({self.arch}): "
        if self.error is not None:
            return head + f"COMPILE ERROR after {self.compile_seconds:.1f} s\n{self.error}"
        verdict = "ok" if self.ok else "REJECTED by the screen"
        lines = [head + f"{verdict}, {len(self.kernels)} kernel(s), {self.compile_seconds:.1f} s"
                 + (" (cached report)" if self.cached else "")]
        lines.append(f"  {'kernel':<24}{'thr':>5}{'regs':>6}{'spill st/ld':>13}{'stack':>7}"
                     f"{'smem':>8}{'dyn smem':>10}{'bars':>6}  wgmma")
        for k in self.kernels:
            dyn = "?" if k.dynamic_smem_bytes is None else str(k.dynamic_smem_bytes)
            lines.append(f"  {k.name:<24}{k.threads or '?':>5}{k.registers if k.registers is not None else '?':>6}"
                         f"{f'{k.spill_stores}/{k.spill_loads}':>13}{k.stack_frame:>7}{k.smem_bytes:>8}{dyn:>10}"
                         f"{k.barriers:>6}  {'SERIALIZED (C7512)' if k.wgmma_serialized else 'ok'}")
        for f in self.screen_findings:
            lines.append(f"  screen {'REJECT' if f.rejects else 'note'} line {f.line}: {f.message}")
        return "\n".join(lines)


def kernels_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where candidate modules and reports are kept: ``<cache_dir or $LINATTN_CACHE or
    ~/.cache/linattn-tuner>/kernels`` (:func:`tuner.paths.cache_dir`)."""
    path = Path(cache_dir or paths.cache_dir()) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_candidate(candidate, *, arch: str = "sm_90a", cache_dir=None) -> CompileReport:
    """Compile every program of a candidate module and report ptxas' figures and the screen's findings.

    Args:
        candidate (Candidate): a rendered config (anything with ``name``, ``digest``, ``source`` and
            optionally ``config``).
        arch (str): CUDA architecture. Default: "sm_90a".
        cache_dir (str or Path): cache root. Default: None ($LINATTN_CACHE or ~/.cache/linattn-tuner).

    Returns:
        CompileReport: reused from ``<name>.<arch>.report.json`` when present (``cached`` set).
    """
    stored = _stored_report(candidate, arch, cache_dir)
    if stored is not None:
        return stored
    report, _, _ = build_kernels(candidate, arch=arch, cache_dir=cache_dir)
    return report


def build_kernels(candidate, *, arch: str = "sm_90a", cache_dir=None):
    """Compile (ptxas verbose), screen, store the report, and return the kernels too, for callers
    that run them right away (the gate). A config compiled before (its report is stored) is loaded
    from TileLang's cache instead, with its stored report.

    Returns:
        (CompileReport, module or None, dict name -> JITKernel). The kernels are empty on a compile error.
    """
    stored = _stored_report(candidate, arch, cache_dir)
    if stored is not None:
        if stored.error is not None:
            return stored, None, {}
        module, kernels = load_kernels(candidate, arch, cache_dir)
        return stored, module, kernels
    source_path = _write_source(candidate, cache_dir)
    report = CompileReport(candidate.name, candidate.digest, arch, source_path=str(source_path))
    threads = (getattr(candidate, "config", None) or {}).get("threads")
    kernels = {}
    module = None
    start = time.perf_counter()
    with _interrupts_seen() as interrupted:
        try:
            module = _import(candidate.name, source_path)
            programs = module.programs()
            if programs:  # a module without programs (a pure-torch test double) needs no TileLang
                with _verbose_compile() as capture:
                    for name, prim_func, pass_configs in programs:
                        kernels[name], kernel_report = _compile_reported(name, prim_func, arch, pass_configs,
                                                                         capture)
                        report.kernels.append(kernel_report)
        except Exception as e:  # noqa: BLE001 - any failure to build is the compile result
            # Neither is the kernel's outcome: stored, it would pass for a compile error in every later run.
            # A Ctrl-C reaches nvcc's stages too, and one may die of it (signal 2) before this
            # process has run its own handler.
            if interrupted or "died due to signal 2" in str(e):
                raise KeyboardInterrupt(f"compile of {candidate.name} interrupted") from e
            if "died due to signal" in str(e):  # nvcc's words for a stage killed (the OOM killer, a kill)
                raise CompilerKilled(f"{_trim(e)} (not cached: compiled again when asked again)") from e
            report.error = _trim(e)
            kernels = {}
    report.compile_seconds = round(time.perf_counter() - start, 3)
    for k in report.kernels:
        report.screen_findings += screen(k.cuda_source, k.threads or threads, k.registers or None)
    _write_atomically(_report_path(candidate, arch, cache_dir), json.dumps(report.as_dict(with_source=False), indent=1))
    return report, module, kernels


@contextlib.contextmanager
def _interrupts_seen():
    """A list that a SIGINT arriving meanwhile is noted in, then handled as before. TVM turns the
    KeyboardInterrupt raised inside its compile callbacks (nvcc runs in one) into a RuntimeError
    with no message, which must not be taken for the kernel's compile error."""
    seen: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield seen  # ignored (a compile pool's process) or not ours to watch
        return

    def note(signum, frame):
        seen.append(signum)
        previous(signum, frame)

    signal.signal(signal.SIGINT, note)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def load_kernels(candidate, arch: str = "sm_90a", cache_dir=None) -> tuple[ModuleType, dict]:
    """The imported module and its compiled programs for running, from TileLang's cache when the
    config was compiled before (by ``build_kernels`` too: the flags, and so the keys, are the same).

    Returns:
        (module, dict name -> JITKernel).
    """
    module = _import(candidate.name, _write_source(candidate, cache_dir))
    kernels = {name: _compile(f, arch, pc) for name, f, pc in module.programs()}
    return module, kernels


# ---------------------------------------------------------------------------------------------


def _report_path(candidate, arch: str, cache_dir) -> Path:
    return kernels_dir(cache_dir) / f"{candidate.name}.{arch}.report.json"


def _stored_report(candidate, arch: str, cache_dir) -> CompileReport | None:
    """The report of an earlier compile of this source, or None (none, or an unreadable older format)."""
    path = _report_path(candidate, arch, cache_dir)
    if not path.exists():
        return None
    try:
        report = CompileReport.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError):
        return None
    report.cached = True
    return report


def _write_source(candidate, cache_dir) -> Path:
    """Write the module once (atomically: other processes may compile the same config)."""
    path = kernels_dir(cache_dir) / f"{candidate.name}.py"
    if not path.exists() or path.read_text() != candidate.source:
        _write_atomically(path, candidate.source)
    return path


def _write_atomically(path: Path, text: str) -> None:
    """Other processes may write the same file, and a killed one must leave no half of it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


# ptxas' figures ride on nvcc's verbose output; every compile passes these flags (they are part of
# TileLang's cache key), so a kernel built for its report is the kernel loaded to run.
COMPILE_FLAGS = ["-Xptxas", "-v"]


# A kernel's report (ptxas' figures and its launch attributes), kept in its TileLang cache entry: a
# kernel shared by several configs (the output kernel of configs that differ in the state pass) is
# compiled once, not once each, and a cache hit (which brings neither ptxas' lines nor the device
# function's attributes) still reports it whole.
KEPT_REPORT = "linattn-kernel-report.json"


def _compile_reported(name: str, prim_func, arch: str, pass_configs: dict | None,
                      capture: "_Capture") -> tuple[object, KernelReport]:
    """(kernel, its report): from nvcc's output, else (a TileLang cache hit) from the report kept in
    the cache entry, else from a compile with TileLang's cache off."""
    capture.clear()
    kernel = _compile(prim_func, arch, pass_configs)
    ptxas = capture.ptxas_output()
    entry = getattr(kernel, "_tilelang_cache_path", None)
    kept = Path(entry) / KEPT_REPORT if entry and Path(entry).is_dir() else None
    if ptxas:
        report = _kernel_report(name, kernel, ptxas)
        if kept is not None:
            kept.write_text(json.dumps({k: v for k, v in asdict(report).items() if k not in ("name", "cuda_source")}))
        return kernel, report
    if kept is not None and kept.exists():
        return kernel, KernelReport(name=name, cuda_source=kernel.get_kernel_source(), **json.loads(kept.read_text()))
    with _tilelang_cache_off():
        capture.clear()
        kernel = _compile(prim_func, arch, pass_configs)
    return kernel, _kernel_report(name, kernel, capture.ptxas_output())


def _compile(prim_func, arch: str, pass_configs: dict | None):
    import tilelang

    return tilelang.compile(prim_func, target={"kind": "cuda", "arch": arch}, pass_configs=pass_configs or {},
                            compile_flags=COMPILE_FLAGS)


class _Capture(logging.Handler):
    """Collects the ``tilelang`` logger's records while a compile runs."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def clear(self):
        self.messages.clear()

    def ptxas_output(self) -> str:
        return "\n".join(m for m in self.messages if "ptxas" in m)


@contextlib.contextmanager
def _env_vars(**values: str):
    """Set environment variables for the duration (TileLang reads its switches at compile time)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _tilelang_cache_off():
    return _env_vars(TILELANG_DISABLE_CACHE="1")


@contextlib.contextmanager
def _verbose_compile():
    """Verbose ptxas on; the ``tilelang`` logger's records captured, its console handlers quiet.

    With verbose on, TileLang also passes ``-w`` to nvcc, which silences ptxas warnings, C7512
    included (checked: ``-Xptxas -warn-spills`` prints its warning without ``-w``, nothing with
    it). ``-w`` is dropped from the options for the duration.
    """
    from tilelang.contrib import nvcc

    compile_cuda = nvcc.compile_cuda

    def compile_cuda_keeping_warnings(code, target_format="ptx", arch=None, options=None, path_target=None,
                                      verbose=False):
        if isinstance(options, list):
            options = [o for o in options if o != "-w"]
        return compile_cuda(code, target_format, arch, options, path_target, verbose)

    nvcc.compile_cuda = compile_cuda_keeping_warnings
    logger = logging.getLogger("tilelang")
    saved_level = logger.level
    quieted = [(h, h.level) for h in logger.handlers]
    for h, _ in quieted:
        h.setLevel(logging.WARNING)
    capture = _Capture()
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    try:
        with _env_vars(TILELANG_VERBOSE="1"):
            yield capture
    finally:
        nvcc.compile_cuda = compile_cuda
        logger.removeHandler(capture)
        logger.setLevel(saved_level)
        for h, level in quieted:
            h.setLevel(level)


_ENTRY_RE = re.compile(r"Compiling entry function '(\w+)'")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers")
_BARRIERS_RE = re.compile(r"used (\d+) barriers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_C7512_RE = re.compile(r"C7512")


def parse_ptxas(text: str) -> dict[str, dict]:
    """ptxas ``-v`` output -> {entry function: {registers, barriers, smem_bytes, stack_frame,
    spill_stores, spill_loads, wgmma_serialized}}. A C7512 warning naming no function is given
    to every entry of the output."""
    entries: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            current = entries.setdefault(m.group(1), dict(registers=None, barriers=0, smem_bytes=0, stack_frame=0,
                                                          spill_stores=0, spill_loads=0, wgmma_serialized=False))
            continue
        if current is None:
            continue
        if m := _FRAME_RE.search(line):
            current.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif m := _USED_RE.search(line):
            barriers, smem = _BARRIERS_RE.search(line), _SMEM_RE.search(line)
            current.update(registers=int(m.group(1)), barriers=int(barriers.group(1)) if barriers else 0,
                           smem_bytes=int(smem.group(1)) if smem else 0)
    for line in text.splitlines():
        if _C7512_RE.search(line):
            named = re.search(r"function '(\w+)'", line)
            for entry, figures in entries.items():
                if named is None or named.group(1) == entry:
                    figures["wgmma_serialized"] = True
    return entries


def _kernel_report(name: str, kernel, ptxas_output: str) -> KernelReport:
    entries = parse_ptxas(ptxas_output)
    if not entries:
        raise RuntimeError(f"no ptxas figures were logged for program {name!r}; was nvcc skipped?")
    # One program may lower to several entry functions: report the heaviest of each figure.
    fig = {key: max(e[key] or 0 for e in entries.values()) for key in next(iter(entries.values()))}
    fig["wgmma_serialized"] = any(e["wgmma_serialized"] for e in entries.values())
    entry = max(entries, key=lambda e: entries[e]["registers"] or 0)
    dynamic_smem, threads = _launch_attributes(kernel, entry)
    return KernelReport(name=name, entry=entry, dynamic_smem_bytes=dynamic_smem, threads=threads,
                        cuda_source=kernel.get_kernel_source(), **fig)


def _launch_attributes(kernel, entry: str) -> tuple[int | None, int | None]:
    """Dynamic shared memory and threads per block, from the device function's attributes."""
    try:
        for gv, func in kernel.artifact.device_mod.functions.items():
            if gv.name_hint != entry:
                continue
            attrs = func.attrs
            dyn = attrs.get("dyn_shared_memory_buf") if attrs is not None else None
            extent = attrs.get("thread_extent") if attrs is not None else None
            threads = None
            if extent is not None:
                dims = [extent.get(f"threadIdx.{d}", 1) for d in "xyz"]
                if all(str(x).isdigit() for x in dims):
                    threads = int(dims[0]) * int(dims[1]) * int(dims[2])
            return (int(dyn) if dyn is not None and str(dyn).isdigit() else None), threads
    except AttributeError:
        pass
    return None, None


def _trim(e: BaseException) -> str:
    """The useful part of a compile failure: nvcc's output, or the tail of the message."""
    text = str(e)
    if "Compilation error:" in text:  # tilelang.contrib.nvcc: source, then nvcc's output, then the command
        text = text.split("Compilation error:", 1)[1].split("\nCommand:", 1)[0]
    text = f"{type(e).__name__}: {text.strip()}"
    return text if len(text) <= ERROR_CHARS else "..." + text[-ERROR_CHARS:]
