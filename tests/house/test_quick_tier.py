"""`make test-quick` runs `pytest -m "not slow"`: every folder of lora_lab/ keeps at least one quick test.

A test is slow when it is marked `@pytest.mark.slow` (its class, or its module by `pytestmark`, likewise); the
slow ones are the longest of `pytest --durations` (docs/measurements.md, "Test tiers"). A folder's quick tests
are the unmarked tests in tests/<folder>/; a folder without a test folder of its own (functional/, whose maths
the layers, kernels and optimizer tests check) is covered by the quick tests of the files that import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_imports import PACKAGE

TESTS = PACKAGE.parent / "tests"
FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


def is_slow(mark: ast.expr) -> bool:
    """Whether a decorator or `pytestmark` value is (or lists) `pytest.mark.slow`."""
    if isinstance(mark, (ast.List, ast.Tuple)):
        return any(is_slow(m) for m in mark.elts)
    if isinstance(mark, ast.Call):
        mark = mark.func
    return isinstance(mark, ast.Attribute) and mark.attr == "slow"


def quick_tests(tree: ast.Module) -> list[str]:
    """The names of a test module's tests that are not marked slow (by themselves, their class or module)."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
                and is_slow(node.value)):
            return []

    def unmarked(node) -> bool:
        return not any(is_slow(d) for d in node.decorator_list)

    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and unmarked(node):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test") and unmarked(node):
            names += [f"{node.name}.{m.name}" for m in node.body
                      if isinstance(m, ast.FunctionDef) and m.name.startswith("test") and unmarked(m)]
    return names


def imported_folders(tree: ast.Module) -> set[str]:
    """The lora_lab folders a test module imports (`from lora_lab.F...`, `import lora_lab.F`,
    `from lora_lab import F`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lora_lab":
            parts = node.module.split(".")
            found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("lora_lab.")}
    return found & set(FOLDERS)


def quick_coverage(tests: Path) -> dict[str, list[str]]:
    """{folder: its quick tests as "file::name"}: in tests/<folder>/, else those of the files importing it."""
    own: dict[str, list[str]] = {f: [] for f in FOLDERS}
    importing: dict[str, list[str]] = {f: [] for f in FOLDERS}
    for path in sorted(tests.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        names = [f"{path.relative_to(tests)}::{n}" for n in quick_tests(tree)]
        where = path.relative_to(tests).parts
        if len(where) == 2 and where[0] in own:
            own[where[0]] += names
        for folder in imported_folders(tree):
            importing[folder] += names
    return {f: own[f] if (tests / f).is_dir() else importing[f] for f in FOLDERS}


def test_every_package_folder_has_a_quick_test():
    coverage = quick_coverage(TESTS)
    missing = [f for f, names in coverage.items() if not names]
    assert not missing, f"no quick test (one not marked slow) for lora_lab/{', '.join(missing)}"


def test_the_checker_sees_slow_marks(tmp_path):
    """A folder whose every test is marked slow (decorator, class, module) is reported; one unmarked test,
    or a file importing a folder without a test folder, covers it."""
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "test_a.py").write_text(
        "import pytest\n\n@pytest.mark.slow\ndef test_a():\n    pass\n\n"
        "@pytest.mark.slow\nclass TestB:\n    def test_b(self):\n        pass\n")
    (tmp_path / "lora" / "test_c.py").write_text("import pytest\npytestmark = [pytest.mark.slow]\n\n"
                                                 "def test_c():\n    pass\n")
    (tmp_path / "test_optim.py").write_text("from lora_lab.functional import adam\n\n"
                                            "def test_d():\n    pass\n")
    coverage = quick_coverage(tmp_path)
    assert coverage["lora"] == [] and coverage["functional"] == ["test_optim.py::test_d"]
    (tmp_path / "lora" / "test_c.py").write_text("def test_c():\n    pass\n")
    assert quick_coverage(tmp_path)["lora"] == [str(Path("lora", "test_c.py")) + "::test_c"]
