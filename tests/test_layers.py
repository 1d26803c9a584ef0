"""docs/design.md's layers, checked on the source: each part of src/selfattn imports only from
below it.

Every import counts, at module level or inside a function (a lazy import is still a dependency).
The rules are data: ``LAYERS`` from bottom to top (a part may import its own layer and those
below), and ``SAME_LAYER`` for the order inside a layer.
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
    ("ground floor", {"_log", "_optional", "_validate", "call", "masks", "positions", "scores"}),
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
}
# The logger and the optional-import helper import nothing from selfattn either.
SAME_LAYER |= {
    (helper, part)
    for helper in ("_log", "_optional")
    for part in ("_log", "_optional", "_validate", "call", "masks", "positions", "scores")
    if helper != part
}


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
