"""docs/architecture.md is the map of the package, kept true here: every module has one row, each folder's
imports are what its code imports; and the house's size rules (modules, functions)."""

from __future__ import annotations

import ast
import re

import pytest
from test_imports import PACKAGE, import_graph, module_names

PAGE = PACKAGE.parent / "docs" / "architecture.md"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def table(section: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table under the `## section` heading of the page."""
    text = PAGE.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]
    return rows[2:]  # after the header and the |---| line


def code_names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def unit(module: str) -> str:
    """A module's folder (`lora`, `models`, ...) or its own name for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_exactly_one_row_on_the_architecture_page():
    rows = [code_names(r[0])[0] for r in table("Modules")]
    on_disk = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
    assert len(rows) == len(set(rows)), "a module has two rows"
    assert sorted(rows) == on_disk, (f"missing rows: {sorted(set(on_disk) - set(rows))}; "
                                     f"rows of no module: {sorted(set(rows) - set(on_disk))}")


def test_each_folders_imports_are_what_the_page_says():
    graph = import_graph(PACKAGE)
    imports: dict[str, set[str]] = {}
    for module, targets in graph.items():
        imports.setdefault(unit(module), set()).update(unit(t) for t in targets)
    listed_units = set()
    for first, _, listed in table("The layers"):
        units = {n.removesuffix("/").removesuffix(".py") for n in code_names(first)}
        listed_units |= units
        if units == {"__init__"}:
            continue  # the top-level surface imports what a user meets
        actual = set().union(*(imports[u] for u in units)) - units - {"__init__"}
        assert set(code_names(listed)) == actual, (f"{sorted(units)} import {sorted(actual)}, "
                                                   f"the page says {listed}")
    assert listed_units == set(imports), f"folders without a row: {sorted(set(imports) - listed_units)}"


def test_no_module_and_no_function_is_too_long():
    long_modules, long_functions = [], []
    for name, path in module_names(PACKAGE).items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            long_modules.append(f"{name} ({source.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name} ({length} lines)")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_the_page_checker_sees_a_module_without_a_row(tmp_path, monkeypatch):
    page = tmp_path / "architecture.md"
    text = PAGE.read_text()
    page.write_text(text.replace("| `lora/layer.py` |", "| `lora/layerz.py` |"))
    monkeypatch.setattr(__import__(__name__), "PAGE", page)
    with pytest.raises(AssertionError, match="lora/layer.py"):
        test_every_module_has_exactly_one_row_on_the_architecture_page()


def test_the_tests_mirror_the_package():
    """tests/ mirrors lora_lab/: a test of a folder's code in tests/<folder>/, of a top-level module `m.py` as
    tests/test_m.py; tests/house/ holds the tests of the project itself (this page, imports, docs, packaging,
    boundaries)."""
    tests = PACKAGE.parent / "tests"
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} | {"house"}
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    for path in sorted(tests.rglob("test_*.py")):
        where = path.relative_to(tests)
        if len(where.parts) == 1:
            assert path.stem.removeprefix("test_") in modules, f"tests/{where}: no such lora_lab module"
        else:
            assert len(where.parts) == 2 and where.parts[0] in folders, f"tests/{where}: no lora_lab folder"
