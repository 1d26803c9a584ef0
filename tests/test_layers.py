"""docs/design.md's layers, checked on the source: each part of src/selfattn imports only from
below it.

Every import counts, at module level or inside a function (a lazy import is still a dependency).
The rules are data: ``LAYERS`` from bottom to top (a part may import its own layer and those
below), and ``SAME_LAYER`` for the order inside a layer. Inside a part the arrows run one way
too: no two modules import each other, however long the circle (``test_no_import_circle``), and
a private name (``_x``) stays in its file (``test_private_names_stay_private``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import selfattn

ROOT = Path(selfattn.__file__).parent
PACKAGE = "<selfattn>"  # selfattn/__init__.py: it loads every public part on first use

# Bottom to top, as in docs/design.md "Layers". A part of src/selfattn missing here fails
# test_every_part_has_a_layer: a new part must be placed before it can be checked.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "ground floor",
        {"_console", "_log", "_optional", "_validate", "call", "masks", "positions", "scores"},
    ),
    ("kernels", {"kernels"}),
    ("functional, backends", {"backends", "functional"}),
    ("cache", {"cache"}),
    ("nn, alternatives", {"alternatives", "nn"}),
    ("distributed, inspect", {"distributed", "inspect"}),
    ("models", {"models"}),
    ("integrations, compat", {"compat", "integrations"}),
    ("serving", {"serving"}),
    ("cli, package, testing", {"benchmarks", "cli", "__main__", "testing", PACKAGE}),
]
# (importer, imported) pairs forbidden although both share a layer.
SAME_LAYER = {
    ("backends", "functional"),  # functional runs backends; explain uses call.prepare
    ("nn", "alternatives"),  # attention's layers and its alternatives stay apart
    ("alternatives", "nn"),
    ("_validate", "call"),  # _validate imports nothing from selfattn
    ("_validate", "masks"),
    ("_validate", "positions"),
    ("_validate", "scores"),
    ("benchmarks", "cli"),  # the CLI runs the benchmarks; what both need sits below both
}
# The logger and the optional-import helper import nothing from selfattn either.
SAME_LAYER |= {
    (helper, part)
    for helper in ("_log", "_optional")
    for part in ("_log", "_optional", "_validate", "call", "masks", "positions", "scores")
    if helper != part
}
# The command line's printer and argument types (shared by cli and benchmarks) import only the
# optional-import helper.
SAME_LAYER |= {
    ("_console", part) for part in ("_log", "_validate", "call", "masks", "positions", "scores")
}
# Private names (``from M import _x``, ``_x`` not a module) imported from another file: each with
# the reason it cannot be public. A helper two modules share is public API between them (a
# public name, in ``__all__`` where the module has one) or moves to where its users are.
PRIVATE_IMPORTS_ALLOWED: dict[tuple[str, str, str], str] = {}
PRIVATE_IMPORTS_MAX = 9


def _part(module: str) -> str:
    """``selfattn.cache.paged`` -> ``cache``; ``selfattn`` -> the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every selfattn import in ``path`` (``from selfattn import nn`` names
    ``selfattn.nn``; relative imports resolved)."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    package = ["selfattn", *rel[:-1]]  # the package the file sits in
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base == "selfattn":
                found += [(node.lineno, f"selfattn.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, base))
    return [(line, m) for line, m in found if m == "selfattn" or m.startswith("selfattn.")]


def _files() -> dict[str, list[Path]]:
    by_part: dict[str, list[Path]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        part = PACKAGE if rel.as_posix() == "__init__.py" else rel.with_suffix("").parts[0]
        by_part.setdefault(part, []).append(path)
    return by_part


def _level(part: str) -> int:
    return next(i for i, (_, parts) in enumerate(LAYERS) if part in parts)


def test_every_part_has_a_layer():
    placed = set().union(*(parts for _, parts in LAYERS))
    assert not set(_files()) - placed, "parts of src/selfattn with no layer in LAYERS"


@pytest.mark.parametrize("level", range(len(LAYERS)), ids=[name for name, _ in LAYERS])
def test_layer_imports_nothing_above_it(level):
    files = _files()
    violations = []
    for part in sorted(LAYERS[level][1]):
        for path in files.get(part, []):
            for line, module in _imports(path):
                target = _part(module)
                if target == part:
                    continue
                if _level(target) > level or (part, target) in SAME_LAYER:
                    rel = path.relative_to(ROOT.parent).as_posix()
                    violations.append(f"{rel}:{line} imports {module} ({target})")
    assert not violations, f"{LAYERS[level][0]} imports from above it:\n" + "\n".join(violations)


def _modules() -> dict[str, Path]:
    """``{"selfattn.masks.base": path}`` for every module of the package."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``: annotations only, never run."""
    found = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        name = getattr(test, "id", None) or getattr(test, "attr", None)
        if isinstance(node, ast.If) and name == "TYPE_CHECKING":
            found |= {id(n) for part in node.body for n in ast.walk(part)}
    return found


def _from_imports(path: Path, modules: dict[str, Path], runtime_only: bool = False):
    """``(line, module, name, target)`` per name of each selfattn ``from M import name`` in
    ``path`` (relative ones resolved); ``target`` is ``M.name`` where that is a module (``from
    selfattn.masks import tiles``), else ``M``. ``runtime_only``: leave out the imports under
    ``if TYPE_CHECKING:``."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    package = ["selfattn", *rel[:-1]]  # the package the file sits in
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    yield node.lineno, a.name, None, a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base != "selfattn" and not base.startswith("selfattn."):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                yield node.lineno, base, a.name, full if full in modules else base


def _graph() -> dict[str, set[str]]:
    """Module -> the selfattn modules it imports when run (lazy imports included; those under
    ``if TYPE_CHECKING:`` name a type for annotations and import nothing)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for _, _, _, target in _from_imports(path, modules, runtime_only=True):
            if target in modules and target != module:
                graph[module].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle():
    """No module imports itself through others: the package's arrows form a DAG. A helper two
    modules need goes below both; a choice among kinds defined above goes through a registry
    the kinds fill on import (backends, mask conversions, checkpoint formats)."""
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_private_names_stay_private():
    """Cross-file imports of private names (a private module imported as a module, such as
    ``from selfattn.cli import _common``, is not one) stay few, each listed with its reason."""
    modules = _modules()
    found = {}
    for module, path in sorted(modules.items()):
        for line, base, name, target in _from_imports(path, modules):
            private = name is not None and name.startswith("_") and not name.startswith("__")
            if private and target == base:
                found[(module, base, name)] = f"{path.relative_to(ROOT.parent)}:{line}"
    unlisted = {key: where for key, where in found.items() if key not in PRIVATE_IMPORTS_ALLOWED}
    assert not unlisted, "private names imported across files (make them public):\n" + "\n".join(
        f"{where}: from {base} import {name}" for (_, base, name), where in unlisted.items()
    )
    assert len(PRIVATE_IMPORTS_ALLOWED) <= PRIVATE_IMPORTS_MAX


def test_type_checking_imports_are_no_arrow(tmp_path, monkeypatch):
    """An import under ``if TYPE_CHECKING:`` names a type for annotations: no run-time arrow."""
    pkg = tmp_path / "selfattn"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from selfattn.b import B\nfrom selfattn import c\n"
    )
    for name in ("b", "c"):
        (pkg / f"{name}.py").write_text("")
    monkeypatch.setattr(f"{__name__}.ROOT", pkg)
    modules = _modules()
    found = [t for *_, t in _from_imports(pkg / "a.py", modules, runtime_only=True)]
    assert found == ["selfattn.c"] and len(list(_from_imports(pkg / "a.py", modules))) == 2


def test_the_walk_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: a function-level import and a relative one are both found."""
    pkg = tmp_path / "selfattn" / "masks"
    pkg.mkdir(parents=True)
    src = pkg / "x.py"
    src.write_text("def f():\n    from selfattn.nn import attention\nfrom ..cache import paged\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path / "selfattn")
    assert sorted(_imports(src)) == [(2, "selfattn.nn"), (3, "selfattn.cache")]


MAX_SERVING_FUNCTION_LINES = 100  # a route, a step or a loop that outgrows this is split in rooms


def test_serving_functions_are_short():
    """No function in src/selfattn/serving (routes, the engine, the loop) over 100 lines."""
    long = []
    for path in sorted((ROOT / "serving").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_SERVING_FUNCTION_LINES:
                    rel = path.relative_to(ROOT.parent).as_posix()
                    long.append(f"{rel}:{node.lineno} {node.name}() has {n} lines")
    assert not long, f"split these (at most {MAX_SERVING_FUNCTION_LINES} lines):\n" + "\n".join(
        long
    )


MAX_CACHE_FILE_LINES = 500  # a cache module that outgrows this has a second job: give it a room


def test_cache_files_are_small():
    """No file in src/selfattn/cache over 500 lines (the paged cache is a package of rooms)."""
    big = [
        f"{path.relative_to(ROOT.parent).as_posix()} has {n} lines"
        for path in sorted((ROOT / "cache").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_CACHE_FILE_LINES
    ]
    assert not big, f"split these (at most {MAX_CACHE_FILE_LINES} lines):\n" + "\n".join(big)
