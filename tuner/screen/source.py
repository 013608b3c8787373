"""Reading generated CUDA: its kernels, the ``if``/``else`` regions of a kernel body, the barriers
in it and the integer locals defined once. Comments and string literals are blanked first, so
braces and keywords in them do not count.

Barriers recognised: ``__syncthreads()`` (and ``_count/_and/_or``; the whole block),
``tl::__sync_thread_partial(id, n)`` (n threads), inline ``bar.sync``/``barrier.sync`` asm, and
``tl::AllReduce<op, threads, scale, offset, Barrier>::run`` whose butterfly reaches a shared-memory
stage (``threads >= 64``; ``tl::NamedBarrier<n>`` waits for n, the default for the block).
Also the mbarrier arrays a kernel initialises and their arrivals, and its ``setmaxnreg`` calls.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .condition import CannotEvaluate


@dataclass(frozen=True)
class Kernel:
    """A ``__global__`` function with a body; offsets index the source text."""

    name: str
    launch_bound: int | None
    body_start: int  # index just after the opening brace
    body_end: int  # index of the closing brace
    line: int


@dataclass(frozen=True)
class Branch:
    """A region entered by the threads for which all ``conditions`` hold.

    conditions: (C expression text, wanted truth value) pairs; an ``else`` of ``if (a) ... else if
    (b)`` has ``[(a, False), (b, False)]``.
    """

    start: int
    end: int
    conditions: list[tuple[str, bool]]
    line: int


_KERNEL_RE = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\(\s*(\d+)[^)]*\)\s*)?(\w+)\s*\(")
_KEYWORD_RE = re.compile(r"\b(if|else|for|while|switch|do)\b|[{};]")


def line_of(text: str, pos: int) -> int:
    """The line (from 1) of offset ``pos``."""
    return text.count("\n", 0, pos) + 1


def blank_comments_and_strings(src: str) -> str:
    """``src`` with comments and the insides of string/char literals replaced by spaces, so braces
    and keywords in them do not count; newlines and offsets are kept."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                if out[k] != "\n":
                    out[k] = " "
            i = j + 1
            continue
        else:
            i += 1
            continue
        for k in range(i, j):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def _matching(text: str, pos: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one at ``pos``."""
    depth = 0
    for i in range(pos, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i
    raise CannotEvaluate(f"unbalanced {open_!r} at offset {pos}")


def kernels(text: str) -> list[Kernel]:
    """The kernels defined in ``text`` (declarations without a body are skipped)."""
    found = []
    for m in _KERNEL_RE.finditer(text):
        close = _matching(text, m.end() - 1, "(", ")")
        rest = text[close + 1:].lstrip()
        if not rest.startswith("{"):
            continue  # a declaration
        body = text.index("{", close)
        found.append(Kernel(m.group(2), int(m.group(1)) if m.group(1) else None, body + 1,
                            _matching(text, body, "{", "}"), line_of(text, m.start())))
    return found


def branches(text: str, start: int, end: int) -> list[Branch]:
    """Every ``if``/``else`` region between ``start`` and ``end``, braced or single-statement."""
    found = []
    # Per brace depth: the conditions of the last if-chain closed at that depth, for its ``else``.
    chain_at: dict[int, list] = {}
    open_scopes: list[tuple] = []  # (depth, start, conditions, chain); conditions None: not a branch
    depth, pos = 0, start
    while pos < end:
        m = _KEYWORD_RE.search(text, pos, end)
        if m is None:
            break
        word, pos = m.group(1), m.end()
        if word in ("if", "else"):
            if word == "if":
                cond_open = text.index("(", pos)
                cond_close = _matching(text, cond_open, "(", ")")
                cond = text[cond_open + 1:cond_close]
                conditions, chain = [(cond, True)], [cond]
                pos = cond_close + 1
            else:
                chain = chain_at.get(depth, [])
                conditions = [(c, False) for c in chain]
                after = re.match(r"\s*if\s*\(", text[pos:end])
                if after:
                    cond_open = pos + after.end() - 1
                    cond_close = _matching(text, cond_open, "(", ")")
                    cond = text[cond_open + 1:cond_close]
                    conditions.append((cond, True))
                    chain = chain + [cond]
                    pos = cond_close + 1
            body = re.match(r"\s*\{", text[pos:end])
            if body:
                open_scopes.append((depth, pos + body.end(), conditions, chain))
                depth += 1
                pos += body.end()
            else:  # a single statement: up to the next ';' outside parentheses
                stmt_end = _statement_end(text, pos, end)
                found.append(Branch(pos, stmt_end, conditions, line_of(text, m.start())))
                chain_at[depth] = chain
                pos = stmt_end
        elif word in ("for", "while", "switch"):
            header = re.match(r"\s*\(", text[pos:end])
            if header:
                pos = _matching(text, pos + header.end() - 1, "(", ")") + 1
        elif m.group(0) == "{":
            open_scopes.append((depth, pos, None, None))
            depth += 1
        elif m.group(0) == "}":
            depth -= 1
            if not open_scopes:
                raise CannotEvaluate(f"unbalanced '}}' at line {line_of(text, m.start())}")
            scope_depth, scope_start, conditions, chain = open_scopes.pop()
            if conditions is not None:
                found.append(Branch(scope_start, m.start(), conditions, line_of(text, scope_start)))
                chain_at[scope_depth] = chain
    return found


def _statement_end(text: str, pos: int, end: int) -> int:
    depth = 0
    for i in range(pos, end):
        c = text[i]
        if c in "({":
            depth += 1
        elif c in ")}":
            depth -= 1
        elif c == ";" and depth == 0:
            return i + 1
    return end


# ---------------------------------------------------------------------------------------------
# Barriers

_SYNCTHREADS_RE = re.compile(r"\b__syncthreads(?:_count|_and|_or)?\s*\(")
_PARTIAL_RE = re.compile(r"\btl::__sync_thread_partial\s*\(")
_ASM_BAR_RE = re.compile(r"\basm\s*(?:volatile\s*)?\(\s*\"\s*(?:bar|barrier)(?:\.cta)?\.sync(?:\.aligned)?\s+([^;\"]*)")
_ALLREDUCE_RE = re.compile(r"\btl::AllReduce\s*<")


@dataclass(frozen=True)
class Barrier:
    """A barrier at offset ``pos`` that waits for ``count`` threads (None: the whole block).
    ``count_is_constant`` is False where the count is an expression this scan cannot read."""

    pos: int
    count: int | None
    text: str
    count_is_constant: bool = True


def barriers(src: str, text: str, start: int, end: int) -> list[Barrier]:
    """The barriers between offsets ``start`` and ``end``, in source order. ``src`` is the
    source as generated (inline asm is read from its string literals), ``text`` the same with
    comments and strings blanked."""
    found = []
    for m in _SYNCTHREADS_RE.finditer(text, start, end):
        found.append(Barrier(m.start(), None, "__syncthreads()"))
    for m in _PARTIAL_RE.finditer(text, start, end):
        close = _matching(text, m.end() - 1, "(", ")")
        args = [a.strip() for a in text[m.end():close].split(",")]
        call = text[m.start():close + 1]
        count = args[1] if len(args) > 1 else "0"
        if re.fullmatch(r"\d+", count):
            found.append(Barrier(m.start(), int(count) or None, call))
        else:
            found.append(Barrier(m.start(), None, call, count_is_constant=False))
    for m in _ASM_BAR_RE.finditer(src, start, end):
        operands = [o.strip() for o in m.group(1).split(",")]
        if len(operands) < 2:
            found.append(Barrier(m.start(), None, m.group(0)))
            continue
        count = operands[1]
        ref = re.fullmatch(r"%(\d+)", count)
        if ref:  # an asm operand: "r"(expr) in order
            tail = src[m.end():src.find(";", src.find(")", m.end()))]
            values = re.findall(r"\"[a-z]\"\s*\(([^()]*)\)", tail)
            count = values[int(ref.group(1))].strip() if int(ref.group(1)) < len(values) else count
        if re.fullmatch(r"\d+", count):
            found.append(Barrier(m.start(), int(count), m.group(0)))
        else:
            found.append(Barrier(m.start(), None, m.group(0), count_is_constant=False))
    for m in _ALLREDUCE_RE.finditer(text, start, end):
        close = _matching(text.replace("<", "(").replace(">", ")"), m.end() - 1, "(", ")")
        args = _split_template_args(text[m.end():close])
        # AllReduce<op, threads, scale, thread_offset, Barrier>: the butterfly syncs through shared
        # memory while the exchange distance threads/2 is >= 32 (tl_templates/cuda/reduce.h).
        if len(args) < 2 or not args[1].isdigit() or int(args[1]) < 64:
            continue
        barrier = args[4] if len(args) > 4 else "tl::SyncThreadsBarrier"
        named = re.fullmatch(r"tl::NamedBarrier\s*<\s*(\d+)\s*>", barrier)
        found.append(Barrier(m.start(), int(named.group(1)) if named else None, text[m.start():close + 1]))
    return sorted(found, key=lambda b: b.pos)


_MBAR_INIT_RE = re.compile(r"\b(\w+)\s*\[\s*(\d+)\s*\]\s*\.\s*init\s*\(\s*(\d+)\s*\)")
_MBAR_ARRIVE_RE = re.compile(r"\b(\w+)\s*\[[^;]*?\]\s*\.\s*(?:arrive|arrive_and_expect_tx)\s*\(")
# TileLang's own pipeline barriers: one array of several arrive counts, indexed by stage and role.
_TILELANG_MBARRIERS = "mbarrier"


@dataclass(frozen=True)
class MBarrierArrival:
    """An arrival at one of the mbarriers of array ``name`` (``name[i].arrive()`` or
    ``.arrive_and_expect_tx(bytes)``), at offset ``pos``; each thread that reaches it arrives once."""

    pos: int
    name: str


def mbarriers(text: str, start: int, end: int) -> tuple[dict[str, int], list[MBarrierArrival]]:
    """The mbarrier arrays a kernel body initialises with one arrive count for every entry
    (name -> count), and the arrivals at them, in source order. TileLang's own pipeline barriers
    (one array of several counts) are left out: their arrivals are not one per phase per site."""
    counts: dict[str, set[int]] = {}
    for m in _MBAR_INIT_RE.finditer(text, start, end):
        counts.setdefault(m.group(1), set()).add(int(m.group(3)))
    arrays = {name: c.pop() for name, c in counts.items() if len(c) == 1 and name != _TILELANG_MBARRIERS}
    arrivals = [MBarrierArrival(m.start(), m.group(1))
                for m in _MBAR_ARRIVE_RE.finditer(text, start, end) if m.group(1) in arrays]
    return arrays, arrivals


# TileLang's setmaxnreg: tl::warpgroup_reg_alloc<N>() is .inc, tl::warpgroup_reg_dealloc<N>() is .dec.
_REGISTER_HANDOFF_RE = re.compile(r"\btl::warpgroup_reg_(alloc|dealloc)\s*<\s*(\d+)\s*>")


@dataclass(frozen=True)
class RegisterHandoff:
    """A ``setmaxnreg`` at offset ``pos``: the executing warpgroup's registers per thread set to
    ``count``, raised (``increases``, .inc) or lowered (.dec)."""

    pos: int
    increases: bool
    count: int


def register_handoffs(text: str, start: int, end: int) -> list[RegisterHandoff]:
    """The setmaxnreg calls of a kernel body, in source order."""
    return [RegisterHandoff(m.start(), m.group(1) == "alloc", int(m.group(2)))
            for m in _REGISTER_HANDOFF_RE.finditer(text, start, end)]


def _split_template_args(s: str) -> list[str]:
    args, depth, cur = [], 0, ""
    for c in s:
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        if c == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += c
    return args + [cur.strip()]


# ---------------------------------------------------------------------------------------------
# Integer locals

_DEF_RE = re.compile(r"\b(?:const\s+)?(?:int|unsigned|unsigned int|uint|uint32_t|int32_t|int64_t|bool)\s+(\w+)\s*=\s*([^;]+);")


def integer_definitions(body: str) -> dict[str, str]:
    """Integer locals defined exactly once: name -> defining expression (for substitution)."""
    seen: dict[str, list[str]] = {}
    for m in _DEF_RE.finditer(body):
        seen.setdefault(m.group(1), []).append(m.group(2))
    return {name: exprs[0] for name, exprs in seen.items() if len(exprs) == 1}
