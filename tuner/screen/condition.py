"""A C condition over ``threadIdx.x``, evaluated for every thread of a block.

Conditions may use ``threadIdx.x``, integer arithmetic, ``tl::tl_shuffle_elect<n>()`` and
``cute::elect_one_sync()`` (one thread per n, resp. per warp), and local integer variables
defined once from such expressions. A condition that does not depend on the thread index is
uniform across the block.
"""
from __future__ import annotations

import re

import numpy as np


class CannotEvaluate(Exception):
    """A condition, or a kernel body, that the screen cannot read."""


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
