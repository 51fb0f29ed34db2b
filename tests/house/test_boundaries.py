"""Boundaries that hold: a `_name` is private to its package. No module imports another package's `_name`
(`from ..memory import _tensors`) or reads it as an attribute (`segment._freeze` after
`from ..checkpointing import segment`); within one package (lora_lab/checkpointing/*.py, say) it may.
A top-level module (lora_lab/memory.py) is a package of its own here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lora_lab"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """The package a module belongs to: lora_lab.X for lora_lab/X/... and for lora_lab/X.py."""
    return ".".join(module.split(".")[:2])


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def crossings(path: Path, source: str | None = None) -> list[str]:
    """Each use in `path`'s code of another lora_lab package's private name, as "line: what"."""
    module = _module_name(path)
    tree = ast.parse(source if source is not None else path.read_text())
    bound: dict[str, str] = {}  # local name -> the lora_lab module or object path it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source_module = _absolute(module, path, node)
            if not source_module.startswith("lora_lab"):
                continue
            for alias in node.names:
                target = f"{source_module}.{alias.name}"
                bound[alias.asname or alias.name] = target
                if _private(alias.name) and _unit(source_module) != _unit(module):
                    found.append(f"{node.lineno}: from {source_module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lora_lab"):  # `import lora_lab.x` binds lora_lab; `as y` binds x
                    bound[alias.asname or "lora_lab"] = alias.name if alias.asname else "lora_lab"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, value = [node.attr], node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not (isinstance(value, ast.Name) and value.id in bound):
            continue
        owner = ".".join([bound[value.id]] + chain[:-1])
        if _unit(owner) != _unit(module) and owner.startswith("lora_lab."):
            found.append(f"{node.lineno}: {owner}.{node.attr}")
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_uses_another_packages_private_name(path):
    found = crossings(path)
    assert not found, (f"{path.relative_to(PACKAGE.parent)} uses another package's private name (make it "
                       f"public in its home module): " + "; ".join(found))


def test_the_check_sees_imports_and_attributes_across_packages_only():
    run = PACKAGE / "planning" / "run.py"
    assert crossings(run, "from ..memory import _tensors\n") == ["1: from lora_lab.memory import _tensors"]
    assert crossings(run, "from ..checkpointing import segment\nsegment._freeze(m)\n") == [
        "2: lora_lab.checkpointing.segment._freeze"]
    assert crossings(run, "from .. import checkpointing\ncheckpointing.segment._freeze(m)\n") == [
        "2: lora_lab.checkpointing.segment._freeze"]
    assert crossings(run, "import lora_lab.memory as mem\nmem._tensors(x)\n") == [
        "2: lora_lab.memory._tensors"]
    assert crossings(run, "import lora_lab.memory\nlora_lab.memory._tensors(x)\n") == [
        "2: lora_lab.memory._tensors"]
    # within planning/, a dunder, a public name: allowed
    assert crossings(run, "from .blocks import _helper\nfrom . import blocks\nblocks._x\n"
                          "from .._version import __version__\nfrom ..memory import LiveBytes\n") == []
