"""The register and shared-memory model of the generated kernels: about a millisecond per
config, no TileLang import, no compile (docs/model.md has the rules and the accuracy).

The model reads each kernel from the rendered TileLang source with ``ast``: its buffers
(``T.alloc_shared``, ``T.alloc_fragment``, ``T.alloc_local``, ``T.alloc_var``, shapes evaluated
from the module's constants), threads, ``T.Pipelined`` stages, copies, GEMMs and pass configs.

- Shared memory is exact: :func:`shared_memory_plan` replays TileLang 0.1.15's
  ``MergeSharedMemoryAllocations`` (live ranges, stage copies, swizzle alignments, best-fit reuse).
- Registers are a demand: the fragments and local arrays live at the busiest statement, the
  fragments spread over the block's threads (``elements * bytes / 4 / threads`` per
  thread), scaled and offset by terms fitted per variant (:data:`FITTED`), plus a fitted term for
  a pipelined loop whose loads the block's own threads issue. The budget is 240 for the consumers when warp
  specialisation injects ``setmaxnreg``, else what the launch bounds leave (255 up to 256
  threads). With ``setmaxnreg`` ptxas reports the cap, not the demand, so spills and C7512 are
  what the model is judged against.

Public API: :func:`parse_kernels`, :func:`shared_memory_bytes`, :func:`predict`,
:func:`prune_reason`, :func:`calibrate`, :func:`calibrate_main`.
"""
from __future__ import annotations

import ast
import functools
import math
import operator
import random
from dataclasses import asdict, dataclass, field

from .problem import Problem

# Largest register count ptxas gives one thread, and the registers of one SM (sm_90).
REGISTER_LIMIT = 255
REGISTERS_PER_SM = 65536
# Consumer register cap TileLang 0.1.15 sets with `setmaxnreg` under warp specialisation: one
# producer warpgroup at 24 registers, one or two consumer warpgroups at 240
# (annotate_warp_group_reg_alloc.cc; it is set only when the producer issues TMA copies alone,
# and then the producer is one warpgroup).
WS_CONSUMER_REGISTERS = 240
# Alignment of a shared buffer nothing stricter asks for (the merge pass's `align_bytes`).
SMEM_ALIGN = 16

# Fitted terms of the register demand, per variant:
#   demand = fragment_scale * live fragment registers + overhead
#            + pipeline_overhead  (when the block's own threads run a pipelined loop that loads)
# overhead is the indexing, addressing and loop state beside the fragments; pipeline_overhead the
# loads of the next chunk that the threads issue beside the current one's work
# (Kernel.unspecialised_pipeline). A kernel is predicted to spill when demand > budget +
# spill_margin (ptxas rematerialises and shortens live ranges, so some demand above the budget
# still compiles clean), and to serialise its wgmma (C7512) when demand > budget - wgmma_margin.
# "default" serves variants not calibrated yet.
# Produced by model.fit() over the compiles recorded in tests/data (TileLang 0.1.15, CUDA 13.0,
# sm_90a; 2026-11-29), per variant, records marked superseded left out; "default" over all.
# docs/model.md has the command and the accuracy.
FITTED = {
    "default": {"fragment_scale": 0.8362, "overhead": 65.43, "spill_margin": -14, "wgmma_margin": -52,
                "pipeline_overhead": 16},
    "linear": {"fragment_scale": 1.0, "overhead": 33.0, "spill_margin": 0, "wgmma_margin": 0, "pipeline_overhead": 0},
    "decay": {"fragment_scale": 1.0, "overhead": 66.0, "spill_margin": 4, "wgmma_margin": -4, "pipeline_overhead": 0},
    "simple_gla": {"fragment_scale": 0.9131, "overhead": 52.89, "spill_margin": 0, "wgmma_margin": 0,
                   "pipeline_overhead": 0},
    "gdn": {"fragment_scale": 0.9941, "overhead": 37.05, "spill_margin": -24, "wgmma_margin": -38,
            "pipeline_overhead": 76},
    "kda": {"fragment_scale": 0.8704, "overhead": 73.09, "spill_margin": 0, "wgmma_margin": -56, "pipeline_overhead": 4},
}


def terms(variant: str) -> dict:
    """The fitted terms the model uses for ``variant``."""
    return FITTED.get(variant, FITTED["default"])


DTYPE_BYTES = {
    "float32": 4, "float": 4, "int32": 4, "uint32": 4,
    "float16": 2, "bfloat16": 2, "half": 2, "int16": 2,
    "float8_e4m3": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1, "bool": 1,
    "float64": 8, "int64": 8,
}
ALLOCATORS = {"alloc_shared": "shared", "alloc_fragment": "fragment", "alloc_local": "local", "alloc_var": "var"}


# --------------------------------------------------------------------------------------------
# Reading the rendered source


@dataclass(frozen=True)
class Buffer:
    """One allocation of a kernel.

    Args:
        name (str): the Python name it is bound to.
        scope (str): ``shared``, ``fragment`` (spread over the block's threads), ``local``
            (an array per thread) or ``var`` (a scalar per thread).
        shape (tuple[int, ...]): its shape, ``()`` for a ``var``.
        dtype (str): TileLang dtype name.
    """

    name: str
    scope: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.elements * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Kernel:
    """What the model needs to know about one ``@T.prim_func`` of a generated module.

    Args:
        name (str): the name ``programs()`` gives it.
        threads (int): ``threads=`` of its ``T.Kernel`` (consumer threads under warp specialisation).
        buffers (tuple[Buffer, ...]): its allocations in source order.
        num_stages (int | None): ``num_stages`` of its ``T.Pipelined`` loop; None without one.
        pipeline_loads (frozenset[str]): shared buffers filled from global memory inside that loop.
        thread_loads (frozenset[str]): those of them filled by a ``T.Parallel`` loop of stores.
        tma_loads (frozenset[str]): shared buffers a TMA copy fills (warp-specialised kernels only).
        tma_stores (frozenset[str]): shared buffers a TMA copy writes to global memory.
        wgmma_shared (frozenset[str]): shared operands of the wgmma GEMMs.
        wgmma_accumulators (frozenset[str]): fragments the wgmma GEMMs accumulate into.
        uses (dict[str, tuple[int, int]]): per buffer, the first and last top-level statement of
            the kernel body that names it (a loop is one statement).
        live (dict[str, tuple[int, int]]): per buffer, its first and last leaf statement
            (see :func:`_steps`), kept alive to the end of a loop it was alive before.
        pipeline_steps (tuple[int, int] | None): the first and last step of the pipelined loop.
        warp_specialized (bool): warp specialisation is not disabled by its pass configs.
        aggressive_merge (bool): ``tl.enable_aggressive_shared_memory_merge``: shared buffers are
            live per leaf statement, not per top-level statement, and share memory inside loops.
    """

    name: str
    threads: int
    buffers: tuple[Buffer, ...]
    num_stages: int | None
    pipeline_loads: frozenset[str]
    thread_loads: frozenset[str]
    tma_loads: frozenset[str]
    tma_stores: frozenset[str]
    wgmma_shared: frozenset[str]
    wgmma_accumulators: frozenset[str]
    uses: dict[str, tuple[int, int]]
    live: dict[str, tuple[int, int]]
    pipeline_steps: tuple[int, int] | None
    warp_specialized: bool
    aggressive_merge: bool

    @functools.cached_property
    def live_registers(self) -> float:
        """:func:`fragment_registers`, computed once (the fit predicts each kernel many times)."""
        return _live_registers(self)

    @functools.cached_property
    def smem_plan(self) -> tuple[int, list]:
        """:func:`shared_memory_plan`, computed once."""
        return shared_memory_plan(self)

    @property
    def pipelined(self) -> bool:
        """Whether the loads are multi-buffered: two stages or more (one stage is one buffer)."""
        return (self.num_stages or 0) >= 2 and bool(self.pipeline_loads)

    @property
    def producer_consumer(self) -> bool:
        """Whether TileLang warp-specialises the kernel: allowed, and a pipelined loop loads."""
        return self.warp_specialized and (self.num_stages or 0) >= 1 and bool(self.pipeline_loads)

    @property
    def unspecialised_pipeline(self) -> bool:
        """Whether the block's own threads run a pipelined loop that loads from global memory
        (``num_stages >= 1``, no warp specialisation): they issue the next chunk's loads beside the
        current chunk's work, and ptxas keeps those loads' addresses and predicates live through it."""
        return not self.producer_consumer and (self.num_stages or 0) >= 1 and bool(self.pipeline_loads)

    @property
    def launch_threads(self) -> int:
        """Threads per block as launched: warp specialisation adds a producer of 128 threads, or
        of as many as the consumers when it runs ``T.Parallel`` loads (producer_consumer_ws.cc)."""
        if not self.producer_consumer:
            return self.threads
        return self.threads + (self.threads if self.thread_loads else 128)

    @property
    def setmaxnreg(self) -> bool:
        """Whether TileLang splits the registers 24/240 between producer and consumers: the
        kernel is warp specialised and its producer has no loop of stores to shared memory
        (``SimtCopyDetector``; a strided ``T.copy`` does not count)."""
        return self.producer_consumer and not self.thread_loads


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _evaluate(node: ast.AST, env: dict):
    """The value of a constant expression over ``env``; KeyError/ValueError when it has none."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if _attr(node) is not None:  # a dtype spelled T.float32
        return _attr(node)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_evaluate(node.left, env), _evaluate(node.right, env))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, env)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_evaluate(e, env) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_evaluate(k, env): _evaluate(v, env) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        merged = {}
        for arg in node.args:
            merged.update(_evaluate(arg, env))
        for kw in node.keywords:
            merged.update(_evaluate(kw.value, env) if kw.arg is None else {kw.arg: _evaluate(kw.value, env)})
        return merged
    if isinstance(node, ast.Call) and _attr(node.func) == "ceildiv" and len(node.args) == 2:
        a, b = (_evaluate(x, env) for x in node.args)
        return -(-a // b)
    raise ValueError(f"not a constant expression: {ast.unparse(node)}")


def _attr(func: ast.AST) -> str | None:
    """``name`` of a call target ``T.name``."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "T":
        return func.attr
    return None


def _bind_constants(statements: list[ast.stmt], env: dict) -> None:
    """Add every ``NAME = <constant expression>`` among ``statements`` to ``env``."""
    for stmt in statements:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            continue
        target = stmt.targets[0]
        pairs = [(target, stmt.value)]
        if isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple):
            pairs = list(zip(target.elts, stmt.value.elts, strict=True))
        for name, value in pairs:
            if isinstance(name, ast.Name):
                try:
                    env[name.id] = _evaluate(value, env)
                except (KeyError, ValueError, TypeError, ZeroDivisionError):
                    pass


def _is_prim_func(fn: ast.FunctionDef) -> bool:
    return any(_attr(d) == "prim_func" for d in fn.decorator_list)


def _programs(tree: ast.Module, env: dict) -> list[tuple[str, ast.FunctionDef, ast.FunctionDef, dict]]:
    """``programs()``'s entries: (kernel name, its prim_func, the function around it, pass configs).
    A prim_func is defined in ``programs()`` itself or in a module-level factory it calls."""
    module = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    programs = module.get("programs")
    if programs is None:
        raise ValueError("the rendered source defines no programs()")
    returned = [n for n in programs.body if isinstance(n, ast.Return) and isinstance(n.value, (ast.List, ast.Tuple))]
    if not returned:
        raise ValueError("programs() returns no list literal")
    entries = []
    for item in returned[-1].value.elts:
        name_node, func_node, configs_node = item.elts
        if isinstance(func_node, ast.Call):
            outer, wanted = module[func_node.func.id], None
        else:
            outer, wanted = programs, func_node.id
        prim = next(n for n in outer.body if isinstance(n, ast.FunctionDef) and _is_prim_func(n)
                    and wanted in (None, n.name))
        entries.append((_evaluate(name_node, env), prim, outer, _evaluate(configs_node, env)))
    return entries


def _kernel_block(prim: ast.FunctionDef) -> ast.With:
    for node in ast.walk(prim):
        if isinstance(node, ast.With) and any(
            isinstance(i.context_expr, ast.Call) and _attr(i.context_expr.func) == "Kernel" for i in node.items
        ):
            return node
    raise ValueError(f"{prim.name}: no `with T.Kernel(...)` block")


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _reads(node: ast.AST) -> set[str]:
    """Names subscripted in ``node``: the buffers an expression reads."""
    return {n.value.id for n in ast.walk(node) if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)}


def _tma_slice(node: ast.AST, buffers: list[Buffer], shared_name: str) -> bool:
    """Whether a global operand of ``T.copy`` is a TMA box for the shared buffer ``shared_name``."""
    if isinstance(node, ast.Subscript):
        index = node.slice.elts[-1] if isinstance(node.slice, ast.Tuple) else node.slice
        if not isinstance(index, ast.Slice):
            return False
    buf = next(b for b in buffers if b.name == shared_name)
    return buf.shape[-1] * DTYPE_BYTES[buf.dtype] >= 16


def _subscripted(node: ast.AST) -> str | None:
    """The buffer a ``T.copy`` argument names: ``X`` or ``X[...]``."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _sequential(loop: ast.For) -> bool:
    """A loop whose iterations run one after another in each thread (``T.Pipelined``,
    ``T.serial``, ``range``), not a ``T.Parallel``/``T.unroll`` loop spread over threads or unrolled."""
    return isinstance(loop.iter, ast.Call) and (
        _attr(loop.iter.func) in ("Pipelined", "serial") or getattr(loop.iter.func, "id", None) == "range")


def _steps(statements: list[ast.stmt], steps: list, loops: list) -> None:
    """Append the leaf statements of ``statements`` to ``steps`` in program order, every loop and
    branch opened up (the merge pass's unit of liveness under the aggressive merge); each loop's
    ``(first step, last step, loop node)`` goes to ``loops``."""
    for stmt in statements:
        if isinstance(stmt, ast.For):
            first = len(steps)
            _steps(stmt.body, steps, loops)
            loops.append((first, len(steps) - 1, stmt))
        elif isinstance(stmt, ast.If):
            _steps(stmt.body + stmt.orelse, steps, loops)
        elif isinstance(stmt, ast.With):
            _steps(stmt.body, steps, loops)
        else:
            steps.append(stmt)


def _top_level(statements: list[ast.stmt], threads: int, env: dict) -> list[ast.stmt]:
    """The kernel body's statements as the merge pass sees them after lowering: a ``T.unroll``
    loop is unrolled and a ``T.Parallel`` loop with as many iterations as threads leaves its body
    in place (one iteration per thread); any other loop stays one statement (fewer iterations
    than threads become a guarded branch, one statement too)."""
    out = []
    for stmt in statements:
        kind = _attr(stmt.iter.func) if isinstance(stmt, ast.For) and isinstance(stmt.iter, ast.Call) else None
        if kind == "unroll" or (kind == "Parallel" and _iterations(stmt.iter, env) == threads):
            out += _top_level(stmt.body, threads, env)
        else:
            out.append(stmt)
    return out


def _iterations(call: ast.Call, env: dict) -> float:
    """Iterations of a ``T.Parallel(extents...)`` loop; infinite when an extent is not constant."""
    try:
        return math.prod(_evaluate(a, env) for a in call.args)
    except (KeyError, ValueError, TypeError):
        return math.inf


def _parse_kernel(name: str, prim: ast.FunctionDef, outer: ast.FunctionDef, configs: dict, env: dict) -> Kernel:
    """Read one prim_func: buffers, copies, GEMMs, the pipelined loop and live ranges."""
    env = dict(env)
    _bind_constants(outer.body, env)
    block = _kernel_block(prim)
    launch = next(i.context_expr for i in block.items if _attr(i.context_expr.func) == "Kernel")
    threads = next((_evaluate(k.value, env) for k in launch.keywords if k.arg == "threads"), 128)
    _bind_constants(block.body, env)
    # Global tensors: the parameters annotated `T.Tensor(...)` (scalars such as `scale` are not).
    params = {a.arg for a in prim.args.args
              if isinstance(a.annotation, ast.Call) and _attr(a.annotation.func) in ("Tensor", "Buffer")}

    nodes = list(ast.walk(block))
    buffers = []
    for node in nodes:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _attr(node.value.func) in ALLOCATORS:
            call, scope = node.value, ALLOCATORS[_attr(node.value.func)]
            args = list(call.args) + [k.value for k in call.keywords if k.arg in ("shape", "dtype")]
            if scope == "var":
                shape, dtype = (), args[0]
            else:
                shape, dtype = _evaluate(args[0], env), args[1]
                shape = tuple(shape) if isinstance(shape, (list, tuple)) else (shape,)
            buffers.append(Buffer(node.targets[0].id, scope, tuple(int(s) for s in shape), _evaluate(dtype, env)))
    shared = {b.name for b in buffers if b.scope == "shared"}
    fragments = {b.name for b in buffers if b.scope == "fragment"}

    # A T.copy between global and shared memory can be a TMA copy when its global slice is
    # contiguous in the innermost dimension (a slice, not an index) and the shared row holds at
    # least 16 bytes. TileLang lowers stores that way wherever they are, but loads only in a
    # warp-specialised producer (cuda/op/copy_analysis.cc); other loads are cp.async / SIMT copies.
    store_tma, load_tma, loads, thread_loads = set(), set(), set(), set()
    num_stages = None
    for node in nodes:
        if isinstance(node, ast.Call) and _attr(node.func) == "copy" and len(node.args) >= 2:
            src, dst = (_subscripted(a) for a in node.args[:2])
            if dst in params and src in shared and _tma_slice(node.args[1], buffers, src):
                store_tma.add(src)
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and _attr(node.iter.func) == "Pipelined":
            stages = next((k.value for k in node.iter.keywords if k.arg == "num_stages"), None)
            num_stages = _evaluate(stages, env) if stages is not None else 0
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and _attr(inner.func) == "copy" and len(inner.args) >= 2:
                    src, dst = (_subscripted(a) for a in inner.args[:2])
                    if src in params and dst in shared:
                        loads.add(dst)
                        if _tma_slice(inner.args[0], buffers, dst):
                            load_tma.add(dst)
                if isinstance(inner, ast.Assign) and isinstance(inner.targets[0], ast.Subscript):
                    dst = _subscripted(inner.targets[0])
                    if dst in shared and _reads(inner.value) & params:
                        loads.add(dst)
                        thread_loads.add(dst)
    warp_specialized = not configs.get("tl.disable_warp_specialized", False)
    producer_consumer = warp_specialized and (num_stages or 0) >= 1 and bool(loads)

    # wgmma (M >= 64, 16-bit operands, whole warpgroups, B in shared memory) reads its shared
    # operands through descriptors, which need 1024-byte alignment; other GEMMs are mma.sync.
    by_name = {b.name: b for b in buffers}
    wgmma_shared, accumulators = set(), set()
    for node in nodes:
        if isinstance(node, ast.Call) and _attr(node.func) == "gemm" and len(node.args) >= 3:
            a, b, c = (by_name.get(_subscripted(x)) for x in node.args[:3])
            if None in (a, b, c):
                continue
            if (b.scope == "shared" and c.shape[0] >= 64 and threads % 128 == 0
                    and DTYPE_BYTES[a.dtype] == DTYPE_BYTES[b.dtype] == 2):
                wgmma_shared.update(x.name for x in (a, b) if x.scope == "shared")
                accumulators.add(c.name)

    allocated = {b.name for b in buffers}
    body = [s for s in block.body if not (isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                                          and _attr(s.value.func) in ALLOCATORS)]
    uses: dict[str, tuple[int, int]] = {}
    for index, stmt in enumerate(_top_level(body, threads, env)):
        for buf in _names(stmt) & allocated:
            first, _ = uses.get(buf, (index, index))
            uses[buf] = (first, index)

    # Live ranges per leaf statement: a buffer lives from its first to its last mention, and
    # through the end of a sequential loop it is used in but was alive before (the merge pass
    # moves such a kill point out to the loop's end). A store reads (position 2i) before it
    # writes (2i + 1), so its target may take the bytes of a buffer it reads for the last time.
    steps: list[ast.stmt] = []
    loops: list[tuple[int, int, ast.For]] = []
    _steps(body, steps, loops)
    live: dict[str, tuple[int, int]] = {}

    def touch(names: set[str], position: int) -> None:
        for buf in names & allocated:
            live[buf] = (live.get(buf, (position, position))[0], position)

    for index, stmt in enumerate(steps):
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
        if isinstance(target, ast.Subscript):
            reads = _names(stmt.value) | _names(target.slice)
            if isinstance(stmt, ast.AugAssign):
                reads |= _names(target.value)
            touch(reads, 2 * index)
            touch(_names(target.value), 2 * index + 1)
        else:
            touch(_names(stmt), 2 * index)
    for buf, (first, last) in live.items():
        for start, end, loop in loops:
            if _sequential(loop) and 2 * start <= last <= 2 * end + 1 and not 2 * start <= first <= 2 * end + 1:
                last = max(last, 2 * end + 1)
        live[buf] = (first, last)
    pipeline_steps = next(((2 * a, 2 * b + 1) for a, b, loop in loops
                           if isinstance(loop.iter, ast.Call) and _attr(loop.iter.func) == "Pipelined"), None)

    return Kernel(
        name=name, threads=int(threads), buffers=tuple(buffers), num_stages=num_stages,
        pipeline_loads=frozenset(loads), thread_loads=frozenset(thread_loads),
        tma_loads=frozenset(load_tma if producer_consumer else ()), tma_stores=frozenset(store_tma),
        wgmma_shared=frozenset(wgmma_shared), wgmma_accumulators=frozenset(accumulators), uses=uses,
        live=live, pipeline_steps=pipeline_steps, warp_specialized=warp_specialized,
        aggressive_merge=bool(configs.get("tl.enable_aggressive_shared_memory_merge", False)),
    )


@functools.lru_cache(maxsize=4096)
def parse_kernels(source: str) -> tuple[Kernel, ...]:
    """The kernels of a rendered module, in ``programs()`` order, read without running it.

    Args:
        source (str): the rendered TileLang Python (``tuner.render.render(...).source``).

    Returns:
        tuple[Kernel, ...]: one per ``programs()`` entry (cached by source).
    """
    tree = ast.parse(source)
    env: dict = {}
    _bind_constants(tree.body, env)
    return tuple(_parse_kernel(*entry, env) for entry in _programs(tree, env))


# --------------------------------------------------------------------------------------------
# Shared memory


def _swizzle_alignment(buf: Buffer) -> int:
    """Alignment TileLang requires of a TMA/wgmma shared operand: ``128 << swizzle mode``
    (``src/layout/swizzle_mode.h``), the swizzle being the widest of 128/64/32 bytes that the
    buffer's innermost row holds (a one-dimensional buffer is not swizzled)."""
    if len(buf.shape) < 2:
        return 128
    row = buf.shape[-1] * DTYPE_BYTES[buf.dtype]
    for swizzle, alignment in ((128, 1024), (64, 512), (32, 256)):
        if row % swizzle == 0:
            return alignment
    return 128


def _alignment(kernel: Kernel, buf: Buffer) -> int:
    """The merge pass's alignment of a shared buffer. A TMA copy records its swizzle's (a load
    into a buffer no wgmma reads keeps TileLang's linear layout: no swizzle, 128); a wgmma operand
    no TMA copy touches gets the pass's worst case, 1024; anything else ``SMEM_ALIGN``."""
    if buf.name in kernel.tma_stores or (buf.name in kernel.tma_loads and buf.name in kernel.wgmma_shared):
        return _swizzle_alignment(buf)
    if buf.name in kernel.tma_loads:
        return 128
    if buf.name in kernel.wgmma_shared:
        return 1024
    return SMEM_ALIGN


@dataclass(frozen=True)
class Placement:
    """Where the merge pass puts one shared buffer: byte ``offset`` and ``size``."""

    name: str
    offset: int
    size: int
    alignment: int


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


class _FreeList:
    """The merge pass's free list: sorted, coalesced blocks; best-fit allocation."""

    def __init__(self):
        self.blocks: list[list[int]] = []  # [offset, size], sorted by offset

    def free(self, offset: int, size: int) -> None:
        if size == 0:
            return
        self.blocks.append([offset, size])
        self.blocks.sort()
        merged = [self.blocks[0]]
        for off, sz in self.blocks[1:]:
            last = merged[-1]
            if last[0] + last[1] >= off:
                last[1] = max(last[0] + last[1], off + sz) - last[0]
            else:
                merged.append([off, sz])
        self.blocks = merged

    def best_fit(self, need: int, alignment: int) -> int | None:
        best, best_waste = None, None
        for i, (off, sz) in enumerate(self.blocks):
            head = _align(off, alignment) - off
            if head > sz or sz - head < need:
                continue
            if best_waste is None or sz - need < best_waste:
                best, best_waste = i, sz - need
        return None if best is None else self._carve(best, need, alignment)

    def from_tail(self, alignment: int, top: int) -> int | None:
        if not self.blocks or sum(self.blocks[-1]) != top:
            return None
        off, _ = self.blocks[-1]
        aligned = _align(off, alignment)
        if aligned >= top:
            return None
        self.blocks.pop()
        self.free(off, aligned - off)
        return aligned

    def _carve(self, index: int, need: int, alignment: int) -> int:
        off, sz = self.blocks.pop(index)
        aligned = _align(off, alignment)
        self.free(aligned + need, sz - (aligned - off) - need)
        self.free(off, aligned - off)
        return aligned


def _load_start(kernel: Kernel, name: str, first: float) -> float:
    """Where a buffer filled inside the pipelined loop is first used once TileLang has moved its
    load ahead of the loop body. The producer warps issue the TMA loads and the ``T.Parallel``
    loads at once (under the aggressive merge only the latter move, ahead of the TMA); the
    prologue of a pipeline without warp specialisation issues the ``T.copy`` loads, the one whose
    buffer is last used first. Measured on the kernels in tests/data."""
    if name not in kernel.pipeline_loads or not kernel.num_stages:
        return first
    if kernel.producer_consumer:
        if name not in kernel.tma_loads | kernel.thread_loads:
            return first  # a strided T.copy stays with the consumers
        if not kernel.aggressive_merge:
            return first - 0.5
        return kernel.pipeline_steps[0] - 0.5 if name in kernel.thread_loads else first
    if kernel.aggressive_merge or name in kernel.thread_loads:
        return first
    hoisted = sorted((kernel.live[n][1], n) for n in kernel.pipeline_loads - kernel.thread_loads)
    return first - 1 + (1 + [n for _, n in hoisted].index(name)) / (1 + len(hoisted))


def shared_memory_plan(kernel: Kernel) -> tuple[int, list[Placement]]:
    """The dynamic shared memory TileLang allocates for ``kernel`` and where each buffer lies.

    Replays ``LinearScanPack`` of ``merge_shared_memory_allocations.cc`` on live ranges read from
    the source (:attr:`Kernel.uses`, or :attr:`Kernel.live` under the aggressive merge); the
    pipeline's loads come first.

    Returns:
        tuple[int, list[Placement]]: the byte size of the merged allocation and the placements.
    """
    ranges = kernel.live if kernel.aggressive_merge else kernel.uses
    intervals = []
    for buf in kernel.buffers:
        if buf.scope != "shared" or buf.name not in ranges:
            continue
        first, last = ranges[buf.name]
        size = buf.nbytes
        if buf.name in kernel.pipeline_loads and (kernel.pipelined or kernel.producer_consumer):
            size *= max(1, kernel.num_stages)
        first = _load_start(kernel, buf.name, first)
        intervals.append((first, last + 1, size, _alignment(kernel, buf), buf.name))
    intervals.sort(key=lambda iv: (iv[0], -iv[2], iv[4]))

    free, top, active, placements = _FreeList(), 0, [], []
    for start, end, size, alignment, name in intervals:
        for done in sorted((a for a in active if a[0] <= start), key=lambda a: a[0]):
            free.free(done[1], done[2])
            active.remove(done)
        offset = free.best_fit(size, alignment)
        if offset is None:
            offset = free.from_tail(alignment, top)
            if offset is not None:
                top = offset + size
        if offset is None:
            offset = _align(top, alignment)
            free.free(top, offset - top)
            top = offset + size
        active.append((end, offset, size))
        placements.append(Placement(name, offset, size, alignment))
    total = max((p.offset + p.size for p in placements), default=0)
    return _align(total, SMEM_ALIGN), placements


def shared_memory_bytes(problem: Problem, config: dict) -> int:
    """Dynamic shared memory of the config's largest kernel, in bytes, as TileLang allocates it.

    Args:
        problem (Problem): the problem the kernel is rendered for.
        config (dict): a config of the variant's search space.

    Returns:
        int: bytes of ``buf_dyn_shmem`` of the kernel that needs the most.
    """
    return max(shared_memory_plan(k)[0] for k in parse_kernels(_source(problem, config)))


def _source(problem: Problem, config: dict) -> str:
    """The rendered source, without checking the space's constraints: they may ask for
    ``smem_bytes``, which is computed here."""
    from . import render

    return render.render_unchecked(problem, config)


# --------------------------------------------------------------------------------------------
# Registers


def _registers_per_thread(kernel: Kernel, buf: Buffer) -> float:
    if buf.scope == "fragment":
        return buf.nbytes / 4 / kernel.threads
    return max(1.0, buf.nbytes / 4)


def fragment_registers(kernel: Kernel) -> float:
    """Registers per thread of the fragments and per-thread arrays live at once, at the busiest
    step of the body: a loop-carried fragment (the state) is named before and after the loop and
    so lives throughout; a per-chunk intermediate, or a ``T.alloc_local`` array such as the
    triangular solve's column, only between its first and last use (cached on the kernel)."""
    return kernel.live_registers


def _live_registers(kernel: Kernel) -> float:
    steps = [0.0] * (1 + max((last for _, last in kernel.live.values()), default=0))
    for buf in kernel.buffers:
        if buf.scope == "shared" or buf.name not in kernel.live:
            continue
        first, last = kernel.live[buf.name]
        regs = _registers_per_thread(kernel, buf)
        for i in range(first, last + 1):
            steps[i] += regs
    return max(steps)


@dataclass(frozen=True)
class KernelPrediction:
    """The model's figures for one kernel.

    Args:
        name (str): the kernel's name in ``programs()``.
        threads (int): threads per block as launched (producer warpgroup included).
        fragment_registers (float): registers per thread held by the fragments live at the
            busiest step, and by locals (:func:`fragment_registers`).
        registers (int): the predicted register demand per thread.
        budget (int): the registers a thread may use before spilling: 240 for the consumers
            under ``setmaxnreg``, else what the launch bounds leave (:func:`launch_register_cap`).
        spills (bool): demand above the budget.
        wgmma_serialized (bool): demand near the budget with wgmma accumulators in fragments (C7512).
        smem_bytes (int): dynamic shared memory.
        spill_margin (float): the fitted demand above a budget that still compiles without spilling.
    """

    name: str
    threads: int
    fragment_registers: float
    registers: int
    budget: int
    spills: bool
    wgmma_serialized: bool
    smem_bytes: int
    spill_margin: float


@dataclass(frozen=True)
class Prediction:
    """The model's prediction for a config: the worst of its kernels.

    Args:
        registers (int): the largest predicted register demand per thread.
        smem_bytes (int): the largest dynamic shared memory.
        spills (bool): any kernel predicted to spill.
        wgmma_serialized (bool): any kernel predicted to serialise its wgmma (C7512).
        per_kernel (tuple[KernelPrediction, ...]): the figures per kernel.
    """

    registers: int
    smem_bytes: int
    spills: bool
    wgmma_serialized: bool
    per_kernel: tuple[KernelPrediction, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        return asdict(self)

    def prune_reason(self, budget: int = REGISTER_LIMIT) -> str | None:
        """Why to skip the config: a kernel's demand above the smaller of ``budget`` and its own
        cap, by more than the margin ptxas absorbs. None to keep it."""
        for k in self.per_kernel:
            cap = min(budget, k.budget)
            if k.registers > cap + k.spill_margin:
                absorbed = f" + {k.spill_margin:g} that ptxas absorbs" if k.spill_margin else ""
                return f"{k.name}: predicted register demand {k.registers} per thread exceeds {cap}{absorbed}"
        return None

    def summary(self) -> str:
        yes = {True: "yes", False: "no"}
        lines = [f"predicted: {self.registers} registers/thread (demand), {self.smem_bytes} bytes shared memory, "
                 f"spills: {yes[self.spills]}, wgmma serialised: {yes[self.wgmma_serialized]}"]
        for k in self.per_kernel:
            lines.append(f"  {k.name}: {k.threads} threads, fragments {k.fragment_registers:g} reg, "
                         f"demand {k.registers} / budget {k.budget}, smem {k.smem_bytes} B")
        return "\n".join(lines)


def launch_register_cap(threads: int) -> int:
    """Registers per thread ptxas may use in a block of ``threads`` (``__launch_bounds__(threads, 1)``):
    the 64 Ki registers of an SM shared out, in the allocation unit of 8, at most 255."""
    return min(REGISTER_LIMIT, REGISTERS_PER_SM // threads // 8 * 8)


def predict_kernel(kernel: Kernel, fitted: dict) -> KernelPrediction:
    """The model's figures for one parsed kernel with the given fitted terms."""
    fragments = fragment_registers(kernel)
    demand = math.ceil(fitted["fragment_scale"] * fragments + fitted["overhead"]
                       + fitted.get("pipeline_overhead", 0) * kernel.unspecialised_pipeline)
    budget = WS_CONSUMER_REGISTERS if kernel.setmaxnreg else launch_register_cap(kernel.launch_threads)
    wgmma = bool(kernel.wgmma_accumulators) and demand > budget - fitted["wgmma_margin"]
    threads = kernel.launch_threads
    return KernelPrediction(
        name=kernel.name, threads=threads, fragment_registers=fragments, registers=demand, budget=budget,
        spills=demand > budget + fitted["spill_margin"], wgmma_serialized=wgmma,
        smem_bytes=kernel.smem_plan[0], spill_margin=fitted["spill_margin"],
    )


def predict(problem: Problem, config: dict) -> Prediction:
    """Registers, shared memory, spills and wgmma serialisation predicted for a config.

    Args:
        problem (Problem): the problem the kernel is rendered for.
        config (dict): a config of the variant's search space.

    Returns:
        Prediction: the worst figures over the config's kernels, and each kernel's.
    """
    fitted = terms(problem.variant)
    return combine([predict_kernel(k, fitted) for k in parse_kernels(_source(problem, config))])


def combine(kernels: list[KernelPrediction]) -> Prediction:
    """The :class:`Prediction` of a config from its kernels' figures: the worst of each."""
    return Prediction(
        registers=max(k.registers for k in kernels), smem_bytes=max(k.smem_bytes for k in kernels),
        spills=any(k.spills for k in kernels), wgmma_serialized=any(k.wgmma_serialized for k in kernels),
        per_kernel=tuple(kernels),
    )


def prune_reason(problem: Problem, config: dict, budget: int = REGISTER_LIMIT) -> str | None:
    """Why the search should skip ``config``: a kernel's predicted register demand above its budget
    (the smaller of ``budget`` and the kernel's own cap, see :meth:`Prediction.prune_reason`).

    Args:
        problem (Problem): the problem the kernel is rendered for.
        config (dict): a config of the variant's search space.
        budget (int): registers per thread allowed. Default: 255.

    Returns:
        str | None: the reason, or None to keep the config.
    """
    return predict(problem, config).prune_reason(budget)


# --------------------------------------------------------------------------------------------
# Calibration against ptxas


@dataclass(frozen=True)
class Observation:
    """One compiled kernel: the model's view of it beside what TileLang and ptxas reported.

    Args:
        digest (str): the digest of the rendered source (one compiled config).
        config (dict): the config it was rendered from.
        kernel (Kernel): the parsed kernel.
        registers (int): ptxas' "Used N registers" (the ``setmaxnreg`` cap where one is set).
        spill_bytes (int): spill stores plus spill loads, bytes per thread.
        wgmma_serialized (bool): ptxas warned C7512.
        smem_bytes (int | None): the dynamic shared memory TileLang launches the kernel with.
    """

    digest: str
    config: dict
    kernel: Kernel
    registers: int
    spill_bytes: int
    wgmma_serialized: bool
    smem_bytes: int | None

    @property
    def demand_reported(self) -> bool:
        """ptxas' register count is the kernel's demand: no ``setmaxnreg``, no spill, below the cap."""
        return (not self.kernel.setmaxnreg and self.spill_bytes == 0
                and self.registers < launch_register_cap(self.kernel.launch_threads))


@dataclass(frozen=True)
class Accuracy:
    """How well a set of fitted terms predicts a set of observations (counted per config).

    Args:
        configs (int): compiled configs.
        false_prunes (int): configs pruned (a kernel's predicted demand above its budget) that
            compiled without spilling.
        missed_spills (int): configs kept that spilled.
        spilled (int): configs that spilled.
        smem_exact (int): kernels whose shared memory was predicted to the byte, of ``kernels``.
        kernels (int): compiled kernels.
        register_errors (tuple[int, ...]): predicted minus reported registers, for the kernels
            whose reported count is their demand.
        wgmma_wrong (int): kernels whose C7512 prediction was wrong.
    """

    configs: int
    false_prunes: int
    missed_spills: int
    spilled: int
    smem_exact: int
    kernels: int
    register_errors: tuple[int, ...]
    wgmma_wrong: int

    def lines(self) -> list[str]:
        errs = self.register_errors
        mae = sum(abs(e) for e in errs) / len(errs) if errs else float("nan")
        worst = max(errs, key=abs) if errs else 0
        pct = lambda n: f"{100 * n / self.configs:.1f}%" if self.configs else "-"  # noqa: E731
        return [
            f"configs compiled: {self.configs} ({self.spilled} spilled)",
            f"false prunes: {self.false_prunes} ({pct(self.false_prunes)})",
            f"missed spills: {self.missed_spills} ({pct(self.missed_spills)})",
            f"shared memory exact: {self.smem_exact}/{self.kernels} kernels",
            f"register error where ptxas reports demand: mean |err| {mae:.1f}, worst {worst:+d} "
            f"over {len(errs)} kernels",
            f"C7512 mispredicted: {self.wgmma_wrong}/{self.kernels} kernels",
        ]


def recorded_observations(records: list[dict]) -> list[Observation]:
    """Observations from recorded compiles (the format of ``tests/data/calibration_*.json``: per
    record ``config``, the rendered ``source`` and per kernel ptxas' and TileLang's figures).
    Records marked ``superseded`` (rendered from an earlier template) are left out: they still
    check the shared-memory rules, but the register terms describe the current kernels."""
    out = []
    for record in records:
        if record.get("superseded"):
            continue
        kernels = {k.name: k for k in parse_kernels(record["source"])}
        out += [Observation(record["digest"], record["config"], kernels[k["name"]], k["registers"],
                            k["spill_stores"] + k["spill_loads"], k["wgmma_serialized"], k["dynamic_smem_bytes"])
                for k in record["kernels"]]
    return out


def accuracy(observations: list[Observation], fitted: dict) -> Accuracy:
    """Score ``fitted`` on ``observations``: per config, pruned vs spilled; per kernel, smem and registers."""
    by_config: dict[str, list[tuple[Observation, KernelPrediction]]] = {}
    for o in observations:
        by_config.setdefault(o.digest, []).append((o, predict_kernel(o.kernel, fitted)))
    false_prunes = missed = spilled = 0
    for pairs in by_config.values():
        pruned = any(p.spills for _, p in pairs)
        spills = any(o.spill_bytes > 0 for o, _ in pairs)
        spilled += spills
        false_prunes += pruned and not spills
        missed += spills and not pruned
    pairs = [pair for pairs in by_config.values() for pair in pairs]
    return Accuracy(
        configs=len(by_config), false_prunes=false_prunes, missed_spills=missed, spilled=spilled,
        smem_exact=sum(p.smem_bytes == o.smem_bytes for o, p in pairs), kernels=len(pairs),
        register_errors=tuple(p.registers - o.registers for o, p in pairs if o.demand_reported),
        wgmma_wrong=sum(p.wgmma_serialized != o.wgmma_serialized for o, p in pairs),
    )


def fit(observations: list[Observation]) -> dict:
    """Fit the free terms of the register model to ``observations``.

    ``fragment_scale`` and ``overhead``: least squares of ptxas' count on live fragment registers
    over the kernels whose count is their demand (five or more, spread over 32 registers or more,
    slope within 0.25..2); otherwise the scale is 1 and the overhead the mean excess.
    ``pipeline_overhead`` (0..96, steps of 4) and ``spill_margin`` (-64..64, steps of 2) together:
    the pair that misclassifies the fewest configs as spilling or clean (ties: fewer false prunes,
    then the smaller pipeline term, then the margin nearest zero). They are chosen by the spills,
    not by least squares, because the kernels that pay the pipeline term are mostly those ptxas
    holds at its cap, where the count is not the demand. ``wgmma_margin``: the threshold that
    misclassifies the fewest kernels' C7512 (ties: nearest zero).
    """
    points = [(fragment_registers(o.kernel), o.registers) for o in observations if o.demand_reported]
    fitted = dict(FITTED["default"])
    if points:
        fitted.update(fragment_scale=1.0, overhead=round(sum(y - x for x, y in points) / len(points), 2))
    xs = [x for x, _ in points]
    if len(points) >= 5 and max(xs) - min(xs) >= 32:
        n = len(points)
        mx, my = sum(xs) / n, sum(y for _, y in points) / n
        scale = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
        if 0.25 <= scale <= 2:  # else too few or too clustered points to trust a slope
            fitted.update(fragment_scale=round(scale, 4), overhead=round(my - scale * mx, 2))
    best = None
    for pipeline in range(0, 97, 4):
        trial = {**fitted, "pipeline_overhead": pipeline}
        excess = _config_excess(observations, trial)
        (errors, false_prunes, _), margin = _best_spill_margin(excess)
        key = (errors, false_prunes, pipeline, abs(margin))
        if best is None or key < best[0]:
            best = (key, {**trial, "spill_margin": margin})
    if best is not None:
        fitted = best[1]
    # C7512 is predicted when a kernel with wgmma accumulators has demand > budget - wgmma_margin.
    kernels = [(p.registers - p.budget, o.wgmma_serialized) for o in observations
               for p in [predict_kernel(o.kernel, fitted)] if o.kernel.wgmma_accumulators]
    serialised = sum(o.wgmma_serialized for o in observations if not o.kernel.wgmma_accumulators)
    fitted["wgmma_margin"] = min(range(-64, 65, 2), key=lambda m: (
        serialised + sum((e > -m) != w for e, w in kernels), abs(m)))
    return fitted


def _config_excess(observations: list[Observation], fitted: dict) -> list[tuple[int, bool]]:
    """Per config: its kernels' largest predicted demand minus budget, and whether it spilled.
    A config is predicted to spill when that excess is above ``spill_margin``."""
    by_config: dict[str, tuple[int, bool]] = {}
    for o in observations:
        p = predict_kernel(o.kernel, fitted)
        excess, spilled = by_config.get(o.digest, (-REGISTER_LIMIT, False))
        by_config[o.digest] = (max(excess, p.registers - p.budget), spilled or o.spill_bytes > 0)
    return list(by_config.values())


def _best_spill_margin(excess: list[tuple[int, bool]]) -> tuple[tuple[int, int, int], int]:
    """The spill margin in -64..64 (steps of 2) that misclassifies the fewest configs (ties: fewer
    false prunes, then nearest zero), with its (errors, false prunes, |margin|)."""
    def cost(m: int) -> tuple[int, int, int]:
        false_prunes = sum(e > m and not s for e, s in excess)
        missed = sum(e <= m and s for e, s in excess)
        return false_prunes + missed, false_prunes, abs(m)
    margin = min(range(-64, 65, 2), key=cost)
    return cost(margin), margin


@dataclass(frozen=True)
class CalibrationResult:
    """The outcome of :func:`calibrate`.

    Args:
        problem (Problem): the problem calibrated on.
        sampled (int): configs sampled.
        compile_errors (int): sampled configs that failed to compile (not scored).
        observations (tuple[Observation, ...]): the compiled kernels.
        before (Accuracy): the module's terms for the variant (:func:`terms`) on these observations.
        fitted (dict): the terms fitted to these observations.
        after (Accuracy): the fitted terms on these observations (in sample).
    """

    problem: Problem
    sampled: int
    compile_errors: int
    observations: tuple[Observation, ...]
    before: Accuracy
    fitted: dict
    after: Accuracy

    def table(self) -> str:
        """The accuracy as Markdown rows (docs/model.md)."""
        p = self.problem
        rows = []
        for label, a in ((f"module terms {terms(p.variant)}", self.before), (f"refitted {self.fitted}", self.after)):
            errs = a.register_errors
            mae = f"{sum(abs(e) for e in errs) / len(errs):.1f} (n={len(errs)})" if errs else "-"
            rows.append(f"| {p.variant} | {label} | {self.sampled} | {self.compile_errors} | {a.configs} | {a.spilled} "
                        f"| {a.false_prunes} | {a.missed_spills} | {a.smem_exact}/{a.kernels} | {mae} "
                        f"| {a.wgmma_wrong}/{a.kernels} |")
        return "\n".join(rows)

    def report(self) -> str:
        p = self.problem
        lines = [f"calibration of {p.variant} DK={p.dk} DV={p.dv} {p.dtype}: {self.sampled} configs sampled, "
                 f"{self.compile_errors} failed to compile"]
        lines += [f"with the module's terms {terms(p.variant)}:"] + ["  " + s for s in self.before.lines()]
        lines += ["refitted " + repr(self.fitted) + " (in sample):"] + ["  " + s for s in self.after.lines()]
        return "\n".join(lines)


def sample_configs(problem: Problem, samples: int, seed: int) -> list[dict]:
    """``samples`` distinct configs drawn with ``seed`` from the variant's grid, constraints met."""
    from . import space as spaces

    sp = spaces.load(problem.variant)
    valid = [c for c in sp.grid() if not sp.violations(problem, c)]
    random.Random(seed).shuffle(valid)  # a prefix of a longer draw: more samples extend a run
    return valid[:samples]


def calibrate(problem: Problem, samples: int, seed: int, db: str, progress=print) -> CalibrationResult:
    """Compile sampled configs, record prediction beside ptxas in ``db``'s calibration table,
    fit the free terms and score them.

    Args:
        problem (Problem): the variant and head dims to calibrate on.
        samples (int): configs to draw from the search space.
        seed (int): sampling seed.
        db (str): the results database (its ``tuner_calibration`` table receives one row per config).
        progress (callable): called with one line per compiled config. Default: print.

    Returns:
        CalibrationResult
    """
    from .compile import compile_rendered
    from .stack import current
    from .render import render
    from .store import CalibrationPoint, Store

    env, store = current(), Store(db)
    observations, errors, done = [], 0, 0
    configs = sample_configs(problem, samples, seed)
    try:
        for done, config in enumerate(configs, 1):
            rendered = render(problem, config)
            kernels = {k.name: k for k in parse_kernels(rendered.source)}
            prediction = combine([predict_kernel(k, terms(problem.variant)) for k in kernels.values()])
            report = compile_rendered(rendered)
            where = f"[{done}/{len(configs)}] {config}"
            if report.error is not None:
                errors += 1
                progress(f"{where}: compile error ({report.error.splitlines()[0][:100]})")
                continue
            found = [Observation(rendered.digest, config, kernels[r.name], r.registers, r.spill_stores + r.spill_loads,
                                 r.wgmma_serialized, r.dynamic_smem_bytes) for r in report.kernels]
            observations += found
            store.add_calibration(CalibrationPoint(
                variant=problem.variant, dk=problem.dk, dv=problem.dv, dtype=problem.dtype, config=config,
                digest=rendered.digest, predicted_registers=prediction.registers,
                predicted_smem_bytes=prediction.smem_bytes, predicted_spills=prediction.spills,
                ptxas_registers=max(o.registers for o in found),
                ptxas_spill_bytes=max(o.spill_bytes for o in found),
                ptxas_smem_bytes=max(o.smem_bytes or 0 for o in found),
                ptxas_wgmma_serialized=any(o.wgmma_serialized for o in found),
                tilelang=env.tilelang, cuda=env.cuda,
                report={"prediction": prediction.as_dict(), "compile": report.as_dict(),
                        "smem_note": "ptxas_smem_bytes holds the dynamic shared memory TileLang launches with"},
            ))
            progress(f"{where}: " + ", ".join(
                f"{o.kernel.name} {o.registers} reg / {o.spill_bytes} B spill / smem {o.smem_bytes}" for o in found)
                + f" | predicted {prediction.registers} reg, smem {prediction.smem_bytes}")
    except KeyboardInterrupt:  # score what compiled so far; the rest of the draw can be resumed
        progress(f"interrupted after {done - 1} of {len(configs)} configs")
        done -= 1
    fitted = fit(observations)
    return CalibrationResult(problem, done, errors, tuple(observations),
                             accuracy(observations, terms(problem.variant)), fitted, accuracy(observations, fitted))


def calibrate_main(problem: Problem, samples: int, seed: int, db: str) -> int:
    """``tune calibrate``: run :func:`calibrate`, print its report; exit code 1 when nothing compiled."""
    result = calibrate(problem, samples=samples, seed=seed, db=db)
    print(result.report())
    print("Markdown rows (variant | terms | sampled | compile errors | compiled | spilled | false prunes | "
          "missed spills | smem exact | register MAE | C7512 wrong):")
    print(result.table())
    return 0 if result.observations else 1
