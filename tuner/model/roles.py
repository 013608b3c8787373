"""Warpgroup roles of a kernel that splits its threads by hand, read from its source: each role's
threads, the register cap its ``T.set_max_nreg`` gives it and the fragments it holds at once."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .expressions import call_name, evaluate, leaf_steps, names

if TYPE_CHECKING:
    from .source import Buffer


@dataclass(frozen=True)
class Role:
    """A warpgroup role of a kernel that splits its threads by hand: a branch on the thread index
    (``if tx < N`` / ``elif`` / ``else``) that opens with ``T.set_max_nreg(cap, ...)``.

    Args:
        threads (int): the threads that take the branch.
        register_cap (int): the registers per thread its ``setmaxnreg`` gives it.
        live_registers (float): registers per thread of the fragments live at once in the branch,
            spread over its own threads.
    """

    threads: int
    register_cap: int
    live_registers: float


def read_roles(body: list[ast.stmt], threads: int, env: dict, buffers: list["Buffer"], steps: list[ast.stmt],
               live: dict[str, tuple[int, int]]) -> tuple[Role, ...]:
    """The roles of a kernel split by hand: the first ``if tx < N`` / ``elif`` / ``else`` chain of
    the body whose every branch opens with ``T.set_max_nreg``, ``tx`` bound to
    ``T.get_thread_binding()``; empty for any other kernel. Each role's fragments are those its
    branch names, over its threads, live at its busiest step.

    Args:
        body: the kernel block's statements. threads: threads per block. env: the module's constants.
        buffers: the kernel's allocations. steps, live: the kernel's leaf statements and each
            buffer's live range over them (positions 2 i and 2 i + 1 of step i).
    """
    binding = next((s.targets[0].id for s in body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                    and call_name(s.value.func) == "get_thread_binding"), None)
    chain = next((s for s in body if isinstance(s, ast.If)), None)
    roles, start = [], 0
    while binding is not None and chain is not None:
        branches = [(chain.test, chain.body)]
        orelse = chain.orelse
        chain = orelse[0] if len(orelse) == 1 and isinstance(orelse[0], ast.If) else None
        if chain is None and orelse:
            branches.append((None, orelse))
        for test, branch in branches:
            cap = _max_nreg(branch[0], env)
            if cap is None:
                return ()
            if test is None:
                end = threads
            elif (isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.Lt)
                  and names(test.left) == {binding}):
                end = evaluate(test.comparators[0], env)
            else:
                return ()
            leaves: list[ast.stmt] = []
            leaf_steps(branch, leaves, [])
            in_branch = {id(leaf) for leaf in leaves}
            positions = [2 * i + j for i, leaf in enumerate(steps) if id(leaf) in in_branch for j in (0, 1)]
            named = set().union(*(names(x) for x in branch))
            fragments = [b for b in buffers if b.scope == "fragment" and b.name in named and b.name in live]
            busiest = max((sum(b.nbytes / 4 / (end - start) for b in fragments
                               if live[b.name][0] <= p <= live[b.name][1]) for p in positions), default=0.0)
            roles.append(Role(end - start, cap, busiest))
            start = end
    return tuple(roles)


def _max_nreg(stmt: ast.stmt, env: dict) -> int | None:
    """The cap of a ``T.set_max_nreg(cap, ...)`` statement; None for any other statement."""
    if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and call_name(stmt.value.func) == "set_max_nreg"):
        return int(evaluate(stmt.value.args[0], env))
    return None
