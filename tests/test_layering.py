"""The package tree's shape: imports run downward only, no circles, few top-level modules, small files.

Read from the source with `ast` (every import, function-level ones included), so a lazy import that
climbs a level is caught as well as a top-of-file one.
"""
import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "hybridrl"

RANK = {
    "config": 0, "parallel": 0, "algos": 0, "metrics": 0, "tokenizer": 0, "log": 0, "timeline": 0, "_startup": 0,
    "rewards": 1,
    "models": 2,
    "checkpoint": 3, "placement": 3,
    "rollout": 4,
    "data": 5,
    "workers": 6,
    "planner": 7,
    "trainer": 8,
    "reward_model": 9, "sft": 9,
}
"""A part may import only parts of a lower rank (or itself); README's layout table lists them top down."""


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def _imports(name, path):
    """Every hybridrl module or package the file imports, resolved to the deepest existing module."""
    known = {m for m, _ in _modules()}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{name}: relative import; spell it from hybridrl"
            out.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                       for a in node.names)
    return {m for m in out if m.split(".")[0] == "hybridrl" and m != name}


def _part(module):
    return module.split(".")[1] if "." in module else ""


GRAPH = {name: _imports(name, path) for name, path in _modules()}


def test_every_part_has_a_rank():
    parts = {_part(m) for m in GRAPH} - {""}
    assert parts == set(RANK), f"parts without a rank (add them to RANK and the README): {parts ^ set(RANK)}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _part(m)))
def test_imports_run_downward(module):
    up = sorted(d for d in GRAPH[module] if _part(d) and _part(d) != _part(module)
                and RANK[_part(d)] >= RANK[_part(module)])
    assert not up, f"{module} imports {up}, at or above its own rank {RANK[_part(module)]}"


def test_no_import_circles():
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(GRAPH.get(m, ())):
            if d.startswith(m + "."):
                continue  # a package's face importing its own modules
            if state.get(d) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def test_few_top_level_modules_and_small_files():
    top = sorted(p.stem for p in SRC.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 8, f"{len(top)} modules directly under hybridrl/: {top}; give them a package"
    big = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not big, f"files over 500 lines: {big}; split them by concept"


def test_every_package_says_what_it_holds():
    bare = sorted(d.name for d in SRC.iterdir() if d.is_dir() and d.name != "__pycache__"
                  and not (d / "__init__.py").exists())
    assert not bare, f"folders without an __init__.py: {bare}"
    for init in SRC.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 25 and "import" in doc, (
            f"{init.parent.name}/__init__.py: say in a paragraph what the package holds and what it must not import")
