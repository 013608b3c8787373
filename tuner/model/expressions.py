"""Reading constant expressions and statements of a generated kernel module with ``ast``: the
values of constant expressions over the module's constants, the ``T.name`` a call targets, the names
a node mentions, and a body's leaf statements in program order."""
from __future__ import annotations

import ast
import operator

BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def evaluate(node: ast.AST, env: dict):
    """The value of a constant expression over ``env``; KeyError/ValueError when it has none."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if call_name(node) is not None:  # a dtype spelled T.float32
        return call_name(node)
    if isinstance(node, ast.BinOp) and type(node.op) in BINOPS:
        return BINOPS[type(node.op)](evaluate(node.left, env), evaluate(node.right, env))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand, env)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [evaluate(e, env) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {evaluate(k, env): evaluate(v, env) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        merged = {}
        for arg in node.args:
            merged.update(evaluate(arg, env))
        for kw in node.keywords:
            merged.update(evaluate(kw.value, env) if kw.arg is None else {kw.arg: evaluate(kw.value, env)})
        return merged
    if isinstance(node, ast.Call) and call_name(node.func) == "ceildiv" and len(node.args) == 2:
        a, b = (evaluate(x, env) for x in node.args)
        return -(-a // b)
    raise ValueError(f"not a constant expression: {ast.unparse(node)}")


def call_name(func: ast.AST) -> str | None:
    """``name`` of a call target ``T.name``."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "T":
        return func.attr
    return None


def bind_constants(statements: list[ast.stmt], env: dict) -> None:
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
                    env[name.id] = evaluate(value, env)
                except (KeyError, ValueError, TypeError, ZeroDivisionError):
                    pass


def names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def leaf_steps(statements: list[ast.stmt], steps: list, loops: list) -> None:
    """Append the leaf statements of ``statements`` to ``steps`` in program order, every loop and
    branch opened up (the merge pass's unit of liveness under the aggressive merge); each loop's
    ``(first step, last step, loop node)`` goes to ``loops``."""
    for stmt in statements:
        if isinstance(stmt, ast.For):
            first = len(steps)
            leaf_steps(stmt.body, steps, loops)
            loops.append((first, len(steps) - 1, stmt))
        elif isinstance(stmt, ast.If):
            leaf_steps(stmt.body + stmt.orelse, steps, loops)
        elif isinstance(stmt, ast.With):
            leaf_steps(stmt.body, steps, loops)
        else:
            steps.append(stmt)
