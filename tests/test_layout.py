"""The package's layout: every import in ``tuner/`` follows the pipeline's order written in
docs/ARCHITECTURE.md (lazy imports included, none against it, so no loop), no module is over 500
lines, and a proposal is rendered through Jinja once on its way down the pipeline."""
from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path

import pytest

import search_doubles
from tuner import candidate as candidates, space
from tuner.problem import Problem

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tuner"


def import_order() -> list[str]:
    """The layers, lowest first, from the ``import-order`` block of docs/ARCHITECTURE.md."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = re.search(r"```import-order\n(.*?)```", text, re.S).group(1)
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The ``tuner`` modules ``path`` imports, at module level or inside functions, but not under
    ``if TYPE_CHECKING`` (annotations only)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                self.generic_visit(node)

        def visit_ImportFrom(self, node):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                found.update([target] if node.module else [f"{target}.{a.name}" for a in node.names])
            elif node.module and node.module.split(".")[0] == "tuner":
                found.add(node.module)

        def visit_Import(self, node):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "tuner")

    Visitor().visit(ast.parse(path.read_text()))
    return found


def component(module: str) -> str:
    """The layer a module belongs to: a top-level module, or a package as a whole."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_import_follows_the_pipelines_order():
    order = import_order()
    layers = {component(module_name(p)) for p in MODULES} - {"__init__"}
    assert layers == set(order), f"not in docs/ARCHITECTURE.md: {layers - set(order)}; gone: {set(order) - layers}"
    rank = {name: i for i, name in enumerate(order)}
    against = [(module_name(p), target) for p in MODULES for target in imports(p)
               if component(module_name(p)) != "__init__" and component(target) in rank
               and component(target) != component(module_name(p))
               and rank[component(target)] >= rank[component(module_name(p))]]
    assert not against, against


def test_the_modules_of_a_package_import_each_other_without_a_loop():
    graph = {module_name(p): {t for t in imports(p) if t in {module_name(q) for q in MODULES}} for p in MODULES}
    for module, targets in graph.items():  # a package's __init__ re-exports its modules: the package itself
        graph[module] = {t for t in targets if not module.startswith(f"{t}.")}
    state: dict[str, str] = {}

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", f"import loop: {' -> '.join([*path, module])}"
        state[module] = "open"
        for target in graph[module]:
            visit(target, [*path, module])
        state[module] = "done"

    for module in graph:
        visit(module, [])


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_over_500_lines(path):
    assert len(path.read_text().splitlines()) <= 500


def test_a_proposal_is_rendered_once(tmp_path, monkeypatch):
    """Through a whole compile-only tuning run (the search, nearest valid configs after refusals,
    compiles, records, the summary), no config is rendered twice, and every trial's config that got
    past the constraints needing nothing rendered was rendered (with its twin)."""
    from tuner import search
    from tuner.search import compiling
    from tuner.store import Store

    rendered = Counter()
    real = candidates.render

    def counting(problem, config):
        rendered[json.dumps(config, sort_keys=True)] += 1
        return real(problem, config)

    candidates._checked.cache_clear()
    monkeypatch.setattr(candidates, "render", counting)
    monkeypatch.setattr(compiling, "compile_for_gate", search_doubles.compile_nothing)
    monkeypatch.setenv("LINATTN_CACHE", str(tmp_path / "cache"))
    problem = Problem("linear", 64, 64, batch=1, seqlen=128, heads=1)
    search.tune(problem, trials=4, db=str(tmp_path / "r.db"), jobs=1, seed=1)

    assert rendered and set(rendered.values()) == {1}
    sp = space.load("linear")
    for row in Store(tmp_path / "r.db").trials():
        if row.status != "constraint":
            assert json.dumps(row.config, sort_keys=True) in rendered
            twin = sp.unstaged_twin(row.config)
            assert twin is None or json.dumps(twin, sort_keys=True) in rendered
