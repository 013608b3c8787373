"""Static screen of generated CUDA for barriers that not every thread they wait for can reach.

A fused scalar-decay kernel (one block per DV slice, [C]-shaped weight fragments) deadlocked on
the H200 because TileLang 0.1.15 emitted a 128-thread barrier inside
``if ((((int)threadIdx.x) >> 6) == 0) {``, a branch only 64 of the 128 threads enter. Looking for "a barrier under an ``if``" is not
enough: warp-specialised kernels open with ``if (((int)threadIdx.x) < 128) {`` and call
``tl::__sync_thread_partial(id, 128)`` inside, which every entering thread reaches. So the screen
counts: for each barrier it evaluates the conditions of the enclosing branches over
``threadIdx.x`` in ``range(block size)`` (an ``else`` negates the conditions of its chain, nested
branches combine) and rejects when fewer threads enter than the barrier waits for.

Barriers recognised: ``__syncthreads()`` (and ``_count/_and/_or``; the whole block),
``tl::__sync_thread_partial(id, n)`` (n threads), inline ``bar.sync``/``barrier.sync`` asm, and
``tl::AllReduce<op, threads, scale, offset, Barrier>::run`` whose butterfly reaches a shared-memory
stage (``threads >= 64``; ``tl::NamedBarrier<n>`` waits for n, the default for the block). Branch
conditions may use ``threadIdx.x``, integer arithmetic, ``tl::tl_shuffle_elect<n>()`` and
``cute::elect_one_sync()`` (one thread per n, resp. per warp), and local integer variables defined
once from such expressions. A condition that does not depend on the thread index is uniform and
ignored.

A thread-dependent condition the evaluator cannot read (a loop variable, a value loaded from
memory, ``threadIdx.y``) yields a ``cannot_evaluate`` finding that does NOT reject: a false
rejection throws away a config for good, while a missed deadlock costs one watchdog timeout in
the gate, which reports it as ``hang``.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Finding", "screen", "CannotEvaluate", "evaluate_condition"]

# Finding kinds.
PARTIAL_BARRIER = "barrier_in_partial_branch"
CANNOT_EVALUATE = "cannot_evaluate"


@dataclass(frozen=True)
class Finding:
    """One screen result. ``rejects``: the kernel must not be run (it would deadlock)."""

    kind: str
    line: int
    message: str
    kernel: str = ""

    @property
    def rejects(self) -> bool:
        return self.kind == PARTIAL_BARRIER

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Finding":
        return cls(**d)


class CannotEvaluate(Exception):
    """A condition or barrier count the evaluator cannot read."""


def screen(cuda_source: str, threads: int | None = None) -> list[Finding]:
    """Barriers in ``cuda_source`` that fewer threads reach than they wait for.

    Args:
        cuda_source (str): CUDA C++ as TileLang generates it (``kernel.get_kernel_source()``); may
            hold several ``__global__`` kernels.
        threads (int): threads per block. Used for kernels without ``__launch_bounds__``; the
            launch bound wins where present, since warp specialisation adds a producer warpgroup
            to the ``threads`` a program asks for. Default: None.

    Returns:
        list[Finding]: ``barrier_in_partial_branch`` findings (reject) and ``cannot_evaluate``
        findings (for a human; do not reject), in source order. Empty for a clean kernel.
    """
    text = _blank_comments_and_strings(cuda_source)
    findings = []
    for kernel in _kernels(text):
        block = kernel.launch_bound or threads
        if block is None:
            findings.append(Finding(CANNOT_EVALUATE, kernel.line, "no __launch_bounds__ and no thread count given; "
                                                                 "barriers not checked", kernel.name))
            continue
        findings += _screen_kernel(cuda_source, text, kernel, block)
    return findings


# ---------------------------------------------------------------------------------------------
# Source scanning


@dataclass
class _Kernel:
    name: str
    launch_bound: int | None
    body_start: int  # index just after the opening brace
    body_end: int  # index of the closing brace
    line: int


@dataclass
class _Branch:
    """A region entered by the threads for which all ``conditions`` hold.

    conditions: (C expression text, wanted truth value) pairs; an ``else`` of ``if (a) ... else if
    (b)`` has ``[(a, False), (b, False)]``.
    """

    start: int
    end: int
    conditions: list
    line: int


_KERNEL_RE = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\(\s*(\d+)[^)]*\)\s*)?(\w+)\s*\(")
_KEYWORD_RE = re.compile(r"\b(if|else|for|while|switch|do)\b|[{};]")


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _blank_comments_and_strings(src: str) -> str:
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


def _kernels(text: str) -> list[_Kernel]:
    kernels = []
    for m in _KERNEL_RE.finditer(text):
        close = _matching(text, m.end() - 1, "(", ")")
        rest = text[close + 1:].lstrip()
        if not rest.startswith("{"):
            continue  # a declaration
        body = text.index("{", close)
        kernels.append(_Kernel(m.group(2), int(m.group(1)) if m.group(1) else None, body + 1,
                               _matching(text, body, "{", "}"), _line_of(text, m.start())))
    return kernels


def _branches(text: str, start: int, end: int) -> list[_Branch]:
    """Every ``if``/``else`` region between ``start`` and ``end``, braced or single-statement."""
    branches = []
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
                branches.append(_Branch(pos, stmt_end, conditions, _line_of(text, m.start())))
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
                raise CannotEvaluate(f"unbalanced '}}' at line {_line_of(text, m.start())}")
            scope_depth, scope_start, conditions, chain = open_scopes.pop()
            if conditions is not None:
                branches.append(_Branch(scope_start, m.start(), conditions, _line_of(text, scope_start)))
                chain_at[scope_depth] = chain
    return branches


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


@dataclass
class _Barrier:
    pos: int
    count: int | None  # None: the whole block
    text: str


def _barriers(src: str, text: str, start: int, end: int) -> list[_Barrier | Finding]:
    """Barriers between ``start`` and ``end``; a Finding for one whose count cannot be read."""
    found = []
    for m in _SYNCTHREADS_RE.finditer(text, start, end):
        found.append(_Barrier(m.start(), None, "__syncthreads()"))
    for m in _PARTIAL_RE.finditer(text, start, end):
        close = _matching(text, m.end() - 1, "(", ")")
        args = [a.strip() for a in text[m.end():close].split(",")]
        call = text[m.start():close + 1]
        count = args[1] if len(args) > 1 else "0"
        if re.fullmatch(r"\d+", count):
            found.append(_Barrier(m.start(), int(count) or None, call))
        else:
            found.append(Finding(CANNOT_EVALUATE, _line_of(text, m.start()), f"barrier count not a constant: {call}"))
    for m in _ASM_BAR_RE.finditer(src, start, end):
        operands = [o.strip() for o in m.group(1).split(",")]
        if len(operands) < 2:
            found.append(_Barrier(m.start(), None, m.group(0)))
            continue
        count = operands[1]
        ref = re.fullmatch(r"%(\d+)", count)
        if ref:  # an asm operand: "r"(expr) in order
            tail = src[m.end():src.find(";", src.find(")", m.end()))]
            values = re.findall(r"\"[a-z]\"\s*\(([^()]*)\)", tail)
            count = values[int(ref.group(1))].strip() if int(ref.group(1)) < len(values) else count
        if re.fullmatch(r"\d+", count):
            found.append(_Barrier(m.start(), int(count), m.group(0)))
        else:
            found.append(Finding(CANNOT_EVALUATE, _line_of(text, m.start()), f"barrier count not a constant: {m.group(0)}"))
    for m in _ALLREDUCE_RE.finditer(text, start, end):
        close = _matching(text.replace("<", "(").replace(">", ")"), m.end() - 1, "(", ")")
        args = _split_template_args(text[m.end():close])
        # AllReduce<op, threads, scale, thread_offset, Barrier>: the butterfly syncs through shared
        # memory while the exchange distance threads/2 is >= 32 (tl_templates/cuda/reduce.h).
        if len(args) < 2 or not args[1].isdigit() or int(args[1]) < 64:
            continue
        barrier = args[4] if len(args) > 4 else "tl::SyncThreadsBarrier"
        named = re.fullmatch(r"tl::NamedBarrier\s*<\s*(\d+)\s*>", barrier)
        found.append(_Barrier(m.start(), int(named.group(1)) if named else None, text[m.start():close + 1]))
    return sorted(found, key=lambda b: b.pos if isinstance(b, _Barrier) else 0)


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
# The kernel check


_DEF_RE = re.compile(r"\b(?:const\s+)?(?:int|unsigned|unsigned int|uint|uint32_t|int32_t|int64_t|bool)\s+(\w+)\s*=\s*([^;]+);")


def _screen_kernel(src: str, text: str, kernel: _Kernel, block: int) -> list[Finding]:
    try:
        branches = _branches(text, kernel.body_start, kernel.body_end)
    except CannotEvaluate as e:
        return [Finding(CANNOT_EVALUATE, kernel.line, f"could not parse the kernel body: {e}", kernel.name)]
    definitions = _definitions(text[kernel.body_start:kernel.body_end])
    tx = np.arange(block, dtype=np.int64)
    findings = []
    for barrier in _barriers(src, text, kernel.body_start, kernel.body_end):
        if isinstance(barrier, Finding):
            findings.append(Finding(barrier.kind, barrier.line, barrier.message, kernel.name))
            continue
        line = _line_of(text, barrier.pos)
        waits_for = block if barrier.count is None else barrier.count
        entered = np.ones(block, dtype=bool)
        innermost = None
        try:
            for branch in sorted((b for b in branches if b.start <= barrier.pos < b.end), key=lambda b: b.start):
                for cond, wanted in branch.conditions:
                    mask = evaluate_condition(cond, tx, definitions)
                    if mask is None:
                        continue  # uniform across the block
                    entered &= mask if wanted else ~mask
                    innermost = (cond, wanted, branch.line)
        except CannotEvaluate as e:
            findings.append(Finding(CANNOT_EVALUATE, line, f"{barrier.text} inside a branch whose condition "
                                                           f"cannot be evaluated ({e})", kernel.name))
            continue
        count = int(entered.sum())
        if count < waits_for:
            cond, wanted, cond_line = innermost
            where = f"if ({cond})" if wanted else f"else of if ({cond})"
            findings.append(Finding(PARTIAL_BARRIER, line,
                                    f"barrier for {waits_for} threads inside a branch entered by {count} threads: "
                                    f"{barrier.text} under `{where}` (line {cond_line}), block of {block}",
                                    kernel.name))
    return findings


def _definitions(body: str) -> dict[str, str]:
    """Integer locals defined exactly once: name -> defining expression (for substitution)."""
    seen: dict[str, list[str]] = {}
    for m in _DEF_RE.finditer(body):
        seen.setdefault(m.group(1), []).append(m.group(2))
    return {name: exprs[0] for name, exprs in seen.items() if len(exprs) == 1}


# ---------------------------------------------------------------------------------------------
# Condition evaluator: a C expression over threadIdx.x, evaluated for every thread of the block.

_CAST_RE = re.compile(r"\(\s*(?:const\s+)?(?:unsigned\s+|signed\s+)?(?:int|long|long long|short|char|uint|"
                      r"uint32_t|int32_t|int64_t|uint64_t|size_t|bool)\s*\)")
_ELECT_RE = re.compile(r"tl::tl_shuffle_elect\s*<\s*(\d+)\s*>\s*\(\s*\)")
_TOKEN_RE = re.compile(r"\s*(0[xX][0-9a-fA-F]+|\d+|[A-Za-z_][\w.]*|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%<>&|^!~?:()])")
_THREAD_NAMES = ("threadIdx.x", "tl::tl_shuffle_elect", "cute::elect_one_sync")


def evaluate_condition(cond: str, tx: np.ndarray, definitions: dict[str, str] | None = None):
    """Truth of the C condition ``cond`` for each thread index in ``tx``.

    Args:
        cond (str): a C expression, e.g. ``(((int)threadIdx.x) >> 6) == 0``.
        tx (np.ndarray): thread indices (int64).
        definitions (dict): local integer variables, name -> defining C expression. Default: None.

    Returns:
        np.ndarray of bool (one per thread), or None when the condition does not depend on the
        thread index (uniform across the block).

    Raises:
        CannotEvaluate: the condition depends on the thread index through something unreadable.
    """
    definitions = definitions or {}
    expr = _substitute(cond, definitions)
    if not any(name in expr for name in _THREAD_NAMES) and not re.search(r"\bthreadIdx\b", expr):
        return None
    expr = _ELECT_RE.sub(lambda m: f"__elect_{int(m.group(1)) or 'block'}", expr)
    expr = re.sub(r"cute::elect_one_sync\s*\(\s*\)", "__elect_32", expr)
    expr = _CAST_RE.sub("", expr)
    expr = re.sub(r"(?<=\d)[uUlL]+\b", "", expr)
    tokens = _tokenize(expr)
    parser = _Parser(tokens, tx)
    value = parser.parse(0)
    if parser.i != len(tokens):
        raise CannotEvaluate(f"unexpected {tokens[parser.i]!r} in {cond!r}")
    return np.broadcast_to(np.asarray(value) != 0, tx.shape).copy()


def _substitute(cond: str, definitions: dict[str, str]) -> str:
    """Inline the thread-dependent local variables (a few rounds: definitions may chain)."""
    expr = cond
    for _ in range(8):
        changed = False
        for name, value in definitions.items():
            if re.search(rf"\b{name}\b", expr) and any(t in _substitute_once(value, definitions) for t in _THREAD_NAMES):
                expr = re.sub(rf"\b{name}\b", f"({value})", expr)
                changed = True
        if not changed:
            break
    return expr


def _substitute_once(value: str, definitions: dict[str, str]) -> str:
    for name, inner in definitions.items():
        if re.search(rf"\b{name}\b", value):
            value = re.sub(rf"\b{name}\b", f"({inner})", value)
    return value


def _tokenize(expr: str) -> list[str]:
    tokens, pos = [], 0
    expr = expr.rstrip()
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if m is None:
            raise CannotEvaluate(f"cannot read {expr[pos:pos + 20]!r}")
        tokens.append(m.group(1))
        pos = m.end()
    return tokens


# C binary operators: precedence (higher binds tighter) and numpy semantics.
_BINARY = {
    "||": (1, lambda a, b: np.logical_or(a != 0, b != 0)),
    "&&": (2, lambda a, b: np.logical_and(a != 0, b != 0)),
    "|": (3, lambda a, b: np.bitwise_or(a, b)),
    "^": (4, lambda a, b: np.bitwise_xor(a, b)),
    "&": (5, lambda a, b: np.bitwise_and(a, b)),
    "==": (6, lambda a, b: a == b),
    "!=": (6, lambda a, b: a != b),
    "<": (7, lambda a, b: a < b),
    "<=": (7, lambda a, b: a <= b),
    ">": (7, lambda a, b: a > b),
    ">=": (7, lambda a, b: a >= b),
    "<<": (8, lambda a, b: np.left_shift(a, b)),
    ">>": (8, lambda a, b: np.right_shift(a, b)),
    "+": (9, lambda a, b: a + b),
    "-": (9, lambda a, b: a - b),
    "*": (10, lambda a, b: a * b),
    "/": (10, lambda a, b: _c_div(a, b)),
    "%": (10, lambda a, b: a - b * _c_div(a, b)),
}


def _int(x) -> np.ndarray:
    return np.asarray(x).astype(np.int64)


def _c_div(a, b):
    """C integer division (truncates toward zero)."""
    if np.any(b == 0):
        raise CannotEvaluate("division by zero")
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) ^ (b < 0), -q, q)


class _Parser:
    """Precedence climbing over C tokens, evaluating as it goes (values are int64/bool arrays)."""

    def __init__(self, tokens: list[str], tx: np.ndarray):
        self.tokens, self.i, self.tx = tokens, 0, tx

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise CannotEvaluate(f"expected {expected or 'more'}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self, min_prec: int):
        left = self.unary()
        while True:
            tok = self.peek()
            if tok == "?" and min_prec == 0:  # the conditional operator, right associative, lowest
                self.take("?")
                a = self.parse(0)
                self.take(":")
                b = self.parse(0)
                left = np.where(np.asarray(left) != 0, a, b)
                continue
            if tok not in _BINARY or _BINARY[tok][0] < max(min_prec, 1):
                return left
            prec, op = _BINARY[self.take()]
            left = op(_int(left), _int(self.parse(prec + 1)))

    def unary(self):
        tok = self.take()
        if tok == "(":
            value = self.parse(0)
            self.take(")")
            return value
        if tok == "!":
            return np.asarray(self.unary()) == 0
        if tok == "~":
            return np.invert(_int(self.unary()))
        if tok == "-":
            return -_int(self.unary())
        if tok == "+":
            return self.unary()
        if re.fullmatch(r"0[xX][0-9a-fA-F]+", tok):
            return np.int64(int(tok, 16))
        if tok.isdigit():
            return np.int64(int(tok))
        if tok in ("true", "false"):
            return np.bool_(tok == "true")
        if tok == "threadIdx.x":
            return self.tx
        if tok.startswith("__elect_"):
            n = tok[len("__elect_"):]
            # One elected thread per n threads (per block for tl_shuffle_elect<0>); which one does
            # not matter for counting, the first of each group is used.
            return self.tx == 0 if n == "block" else self.tx % int(n) == 0
        raise CannotEvaluate(f"unknown {tok!r}")
