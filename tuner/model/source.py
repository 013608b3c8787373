"""Reading a generated kernel module without running it: each ``@T.prim_func`` that ``programs()``
returns, with its buffers (``T.alloc_shared``, ``T.alloc_fragment``, ``T.alloc_local``,
``T.alloc_var``, shapes evaluated from the module's constants), threads, ``T.Pipelined`` stages,
copies, GEMMs, pass configs and the live range of every buffer, read with ``ast``.
"""
from __future__ import annotations

import ast
import functools
import math
from dataclasses import dataclass

from . import smem
from .expressions import bind_constants, call_name, evaluate, leaf_steps, names
from .roles import Role, read_roles

DTYPE_BYTES = {
    "float32": 4, "float": 4, "int32": 4, "uint32": 4,
    "float16": 2, "bfloat16": 2, "half": 2, "int16": 2,
    "float8_e4m3": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1, "bool": 1,
    "float64": 8, "int64": 8,
}
ALLOCATORS = {"alloc_shared": "shared", "alloc_fragment": "fragment", "alloc_local": "local", "alloc_var": "var"}


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
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize


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
        pipeline_extent (int | None): that loop's number of iterations where it is a constant (a
            precompute block's several chunks); None where it is symbolic or there is no such loop.
        warp_specialized (bool): warp specialisation is not disabled by its pass configs.
        aggressive_merge (bool): ``tl.enable_aggressive_shared_memory_merge``: shared buffers are
            live per leaf statement, not per top-level statement, and share memory inside loops.
        roles (tuple[Role, ...]): the warpgroup roles of a kernel split by hand, in source order;
            empty for the others.
        min_blocks_per_sm (int): the blocks an SM is to hold at once, from
            ``T.annotate_min_blocks_per_sm`` (``__launch_bounds__(threads, n)``); 1 without it.
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
    roles: tuple[Role, ...] = ()
    pipeline_extent: int | None = None
    min_blocks_per_sm: int = 1

    @functools.cached_property
    def live_registers(self) -> float:
        """Registers per thread of the fragments and per-thread arrays live at once, at the busiest
        step of the body: a loop-carried fragment (the state) is named before and after the loop and
        so lives throughout; a per-chunk intermediate, or a ``T.alloc_local`` array such as the
        triangular solve's column, only between its first and last use. Computed once: the fit
        predicts each kernel many times."""
        steps = [0.0] * (1 + max((last for _, last in self.live.values()), default=0))
        for buf in self.buffers:
            if buf.scope == "shared" or buf.name not in self.live:
                continue
            first, last = self.live[buf.name]
            regs = buf.nbytes / 4 / self.threads if buf.scope == "fragment" else max(1.0, buf.nbytes / 4)
            for i in range(first, last + 1):
                steps[i] += regs
        return max(steps)

    @functools.cached_property
    def smem_plan(self) -> tuple[int, list[smem.Placement]]:
        """:func:`tuner.model.smem.shared_memory_plan`, computed once."""
        return smem.shared_memory_plan(self)

    @property
    def copies_in_pipeline(self) -> bool:
        """Whether a ``T.copy`` loads from global memory in the pipelined loop. TileLang 0.1.15
        multi-buffers and warp-specialises only such a loop: one whose loads are all ``T.Parallel``
        stores (the masked loads of packed sequences) runs as written, one buffer each, on the
        block's own threads (measured: gdn's and kda's packed chunk_state, two stages, warp
        specialised: 128 threads launched, every load allocated once)."""
        return bool(self.pipeline_loads - self.thread_loads)

    @property
    def pipelined(self) -> bool:
        """Whether the loads are multi-buffered: two stages or more (one stage is one buffer)."""
        return (self.num_stages or 0) >= 2 and self.copies_in_pipeline

    @property
    def producer_consumer(self) -> bool:
        """Whether TileLang warp-specialises the kernel: allowed, and a pipelined loop copies."""
        return self.warp_specialized and (self.num_stages or 0) >= 1 and self.copies_in_pipeline

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


def _is_prim_func(fn: ast.FunctionDef) -> bool:
    return any(call_name(d) == "prim_func" for d in fn.decorator_list)


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
        entries.append((evaluate(name_node, env), prim, outer, evaluate(configs_node, env)))
    return entries


def _kernel_block(prim: ast.FunctionDef) -> ast.With:
    for node in ast.walk(prim):
        if isinstance(node, ast.With) and any(
            isinstance(i.context_expr, ast.Call) and call_name(i.context_expr.func) == "Kernel" for i in node.items
        ):
            return node
    raise ValueError(f"{prim.name}: no `with T.Kernel(...)` block")


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
        call_name(loop.iter.func) in ("Pipelined", "serial") or getattr(loop.iter.func, "id", None) == "range")


def _top_level(statements: list[ast.stmt], threads: int, env: dict, shared: dict) -> list[list[ast.stmt]]:
    """The kernel body's statements as the merge pass sees them after lowering, each a list of the
    source statements it holds: a ``T.unroll`` loop is unrolled and a ``T.Parallel`` loop with as
    many iterations as threads leaves its body in place (one iteration per thread); any other loop
    stays one statement (fewer iterations than threads become a guarded branch, one statement
    too). Consecutive ``T.copy`` calls of vectors of ``shared`` (name -> shape) with the same number
    of elements, fewer than threads, are one statement: TileLang lowers each to a branch on the
    thread index and merges those branches (MergeIfStmt) before it plans shared memory. Short
    ``T.Parallel`` loops keep one statement each in that plan, though their branches end up merged
    in the emitted code too (both seen in gdn's dense and packed precompute kernels)."""
    out: list[list[ast.stmt]] = []
    guards: list[int | None] = []
    for stmt in statements:
        kind = call_name(stmt.iter.func) if isinstance(stmt, ast.For) and isinstance(stmt.iter, ast.Call) else None
        if kind == "unroll" or (kind == "Parallel" and _iterations(stmt.iter, env) == threads):
            inner = _top_level(stmt.body, threads, env, shared)
            out += inner
            guards += [None] * len(inner)
            continue
        guard = _copy_guard(stmt, threads, shared)
        if guard is not None and guards and guards[-1] == guard:
            out[-1].append(stmt)
        else:
            out.append([stmt])
            guards.append(guard)
    return out


def _scope_level(merged: list[ast.stmt]) -> int:
    """The merge pass's scope level of a top-level statement: 1 for a loop whose body is a sequence of
    statements (directly or in a branch of a lone ``if``), else 0."""
    stmt = merged[0]
    if len(merged) > 1 or not isinstance(stmt, ast.For):
        return 0
    body = stmt.body
    if len(body) == 1 and isinstance(body[0], ast.If):
        return int(len(body[0].body) > 1 or len(body[0].orelse) > 1)
    return int(len(body) > 1)


def _deferred_kills(uses: dict[str, tuple[int, int]], levels: list[int]) -> dict[str, tuple[int, int]]:
    """``uses`` with the merge pass's kill points moved: a buffer last touched at a deeper scope level
    than it was first touched at lives on to the last statement, among those where some buffer is
    first or last touched, before the next such statement back at its first touch's level."""
    events = sorted({i for span in uses.values() for i in span})
    moved = {}
    for buf, (first, last) in uses.items():
        if levels[last] > levels[first]:
            later = [i for i in events if i > last]
            back = next((k for k, i in enumerate(later) if levels[i] == levels[first]), len(later))
            last = later[back - 1] if back else last
        moved[buf] = (first, last)
    return moved


def _copy_guard(stmt: ast.stmt, threads: int, shared: dict) -> int | None:
    """The thread-index bound a ``T.copy`` of a shared vector lowers under: its elements, when
    fewer than ``threads``; else None."""
    call = stmt.value if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) else None
    if call is None or call_name(call.func) != "copy" or len(call.args) < 2:
        return None
    vectors = [shared[n] for n in (_subscripted(a) for a in call.args[:2]) if n in shared and len(shared[n]) == 1]
    return vectors[0][0] if vectors and vectors[0][0] < threads else None


def _iterations(call: ast.Call, env: dict) -> float:
    """Iterations of a ``T.Parallel(extents...)`` loop; infinite when an extent is not constant."""
    try:
        return math.prod(evaluate(a, env) for a in call.args)
    except (KeyError, ValueError, TypeError):
        return math.inf


def _parse_kernel(name: str, prim: ast.FunctionDef, outer: ast.FunctionDef, configs: dict, env: dict) -> Kernel:
    """Read one prim_func: buffers, copies, GEMMs, the pipelined loop and live ranges."""
    env = dict(env)
    bind_constants(outer.body, env)
    block = _kernel_block(prim)
    launch = next(i.context_expr for i in block.items if call_name(i.context_expr.func) == "Kernel")
    threads = next((evaluate(k.value, env) for k in launch.keywords if k.arg == "threads"), 128)
    bind_constants(block.body, env)
    # Global tensors: the parameters annotated `T.Tensor(...)` (scalars such as `scale` are not).
    params = {a.arg for a in prim.args.args
              if isinstance(a.annotation, ast.Call) and call_name(a.annotation.func) in ("Tensor", "Buffer")}

    nodes = list(ast.walk(block))
    buffers = []
    for node in nodes:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and call_name(node.value.func) in ALLOCATORS:
            call, scope = node.value, ALLOCATORS[call_name(node.value.func)]
            args = list(call.args) + [k.value for k in call.keywords if k.arg in ("shape", "dtype")]
            if scope == "var":
                shape, dtype = (), args[0]
            else:
                shape, dtype = evaluate(args[0], env), args[1]
                shape = tuple(shape) if isinstance(shape, (list, tuple)) else (shape,)
            buffers.append(Buffer(node.targets[0].id, scope, tuple(int(s) for s in shape), evaluate(dtype, env)))
    shared = {b.name for b in buffers if b.scope == "shared"}

    # A T.copy between global and shared memory can be a TMA copy when its global slice is
    # contiguous in the innermost dimension (a slice, not an index) and the shared row holds at
    # least 16 bytes. TileLang lowers stores that way wherever they are, but loads only in a
    # warp-specialised producer (cuda/op/copy_analysis.cc); other loads are cp.async / SIMT copies.
    store_tma, load_tma, loads, thread_loads = set(), set(), set(), set()
    num_stages = pipeline_extent = None
    for node in nodes:
        if isinstance(node, ast.Call) and call_name(node.func) == "copy" and len(node.args) >= 2:
            src, dst = (_subscripted(a) for a in node.args[:2])
            if dst in params and src in shared and _tma_slice(node.args[1], buffers, src):
                store_tma.add(src)
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and call_name(node.iter.func) == "Pipelined":
            stages = next((k.value for k in node.iter.keywords if k.arg == "num_stages"), None)
            num_stages = evaluate(stages, env) if stages is not None else 0
            extent = _iterations(node.iter, env) if len(node.iter.args) == 1 else math.inf
            pipeline_extent = int(extent) if math.isfinite(extent) else None
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and call_name(inner.func) == "copy" and len(inner.args) >= 2:
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
    producer_consumer = warp_specialized and (num_stages or 0) >= 1 and bool(loads - thread_loads)

    # wgmma (M >= 64, 16-bit operands, whole warpgroups, B in shared memory) reads its shared
    # operands through descriptors, which need 1024-byte alignment; other GEMMs are mma.sync.
    by_name = {b.name: b for b in buffers}
    wgmma_shared, accumulators = set(), set()
    for node in nodes:
        if isinstance(node, ast.Call) and call_name(node.func) == "gemm" and len(node.args) >= 3:
            a, b, c = (by_name.get(_subscripted(x)) for x in node.args[:3])
            if None in (a, b, c):
                continue
            if (b.scope == "shared" and c.shape[0] >= 64 and threads % 128 == 0
                    and DTYPE_BYTES[a.dtype] == DTYPE_BYTES[b.dtype] == 2):
                wgmma_shared.update(x.name for x in (a, b) if x.scope == "shared")
                accumulators.add(c.name)

    allocated = {b.name for b in buffers}
    body = [s for s in block.body if not (isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                                          and call_name(s.value.func) in ALLOCATORS)]
    uses: dict[str, tuple[int, int]] = {}
    vectors = {b.name: b.shape for b in buffers if b.scope == "shared"}
    top = _top_level(body, threads, env, vectors)
    for index, merged in enumerate(top):
        for buf in set().union(*(names(stmt) for stmt in merged)) & allocated:
            first, _ = uses.get(buf, (index, index))
            uses[buf] = (first, index)
    uses = _deferred_kills(uses, [_scope_level(merged) for merged in top])

    # Live ranges per leaf statement: a buffer lives from its first to its last mention, and
    # through the end of a sequential loop it is used in but was alive before (the merge pass
    # moves such a kill point out to the loop's end). A store reads (position 2i) before it
    # writes (2i + 1), so its target may take the bytes of a buffer it reads for the last time.
    steps: list[ast.stmt] = []
    loops: list[tuple[int, int, ast.For]] = []
    leaf_steps(body, steps, loops)
    live: dict[str, tuple[int, int]] = {}

    def touch(names: set[str], position: int) -> None:
        for buf in names & allocated:
            live[buf] = (live.get(buf, (position, position))[0], position)

    for index, stmt in enumerate(steps):
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
        if isinstance(target, ast.Subscript):
            reads = names(stmt.value) | names(target.slice)
            if isinstance(stmt, ast.AugAssign):
                reads |= names(target.value)
            touch(reads, 2 * index)
            touch(names(target.value), 2 * index + 1)
        else:
            touch(names(stmt), 2 * index)
    for buf, (first, last) in live.items():
        for start, end, loop in loops:
            if _sequential(loop) and 2 * start <= last <= 2 * end + 1 and not 2 * start <= first <= 2 * end + 1:
                last = max(last, 2 * end + 1)
        live[buf] = (first, last)
    pipeline_steps = next(((2 * a, 2 * b + 1) for a, b, loop in loops
                           if isinstance(loop.iter, ast.Call) and call_name(loop.iter.func) == "Pipelined"), None)
    min_blocks = next((evaluate(n.args[0], env) for n in nodes
                       if isinstance(n, ast.Call) and call_name(n.func) == "annotate_min_blocks_per_sm"), 1)

    return Kernel(
        name=name, threads=int(threads), buffers=tuple(buffers), num_stages=num_stages,
        roles=read_roles(body, int(threads), env, buffers, steps, live),
        pipeline_loads=frozenset(loads), thread_loads=frozenset(thread_loads),
        tma_loads=frozenset(load_tma if producer_consumer else ()), tma_stores=frozenset(store_tma),
        wgmma_shared=frozenset(wgmma_shared), wgmma_accumulators=frozenset(accumulators), uses=uses,
        live=live, pipeline_steps=pipeline_steps, pipeline_extent=pipeline_extent, warp_specialized=warp_specialized,
        aggressive_merge=bool(configs.get("tl.enable_aggressive_shared_memory_merge", False)),
        min_blocks_per_sm=int(min_blocks),
    )


@functools.lru_cache(maxsize=4096)
def parse_kernels(source: str) -> tuple[Kernel, ...]:
    """The kernels of a rendered module, in ``programs()`` order, read without running it.

    Args:
        source (str): the rendered TileLang Python (``tuner.render.render(problem, config)``).

    Returns:
        tuple[Kernel, ...]: one per ``programs()`` entry (cached by source).
    """
    tree = ast.parse(source)
    env: dict = {}
    bind_constants(tree.body, env)
    return tuple(_parse_kernel(*entry, env) for entry in _programs(tree, env))
