"""The package's import structure: every module imports alone, first, in a fresh interpreter, and the
import graph drawn from the code (every `import`, lazy ones included, and every package `__init__` an import
runs on its way) has no cycle."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lora_lab"

# Imports lora_lab's dependencies once (torch is most of the start-up time), then forks one child per
# module: each child starts with no lora_lab module loaded and imports only that one, so a module that
# works only after another was imported first fails here. TRITON_INTERPRET=1 lets the Triton kernel
# modules import on a machine without a GPU.
_CHILDREN = r"""
import importlib, json, os, sys, traceback
for name in json.loads(sys.argv[2]):
    importlib.import_module(name)
failed = {}
for name in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        failed[name] = status
print(json.dumps(failed))
"""


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package `root` (a package is its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules its imports run (at the top or inside a function), from the source's
    ast.

    `from .a import b` counts as an import of module `a.b` if there is one, else of `a` (whose names b are).
    Importing `p.q.m` first runs the `__init__` of `p` and `p.q`: the importer gets an edge to each of those
    packages too, except its own (they are already running when it runs).
    """
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own = {".".join(package.split(".")[:i]) for i in range(1, len(package.split(".")) + 1)}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                           for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                on_the_way = {".".join(parts[:i]) for i in range(1, len(parts))} - own
                graph[name] |= {t for t in (target, *on_the_way) if t in modules and t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    # the graph is real
    assert len(graph) > 30 and "lora_lab.formats.reading" in graph["lora_lab.formats.writing"]
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_find_cycles_names_a_cycle():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": set()}
    assert find_cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert find_cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_import_graph_sees_relative_and_lazy_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g  # lazy, still an edge\n")
    (pkg / "c.py").write_text("import pkg.a\nfrom . import sub\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": set(), "pkg.sub": set(), "pkg.a": {"pkg.sub", "pkg.sub.b"},
                     "pkg.sub.b": {"pkg.a"}, "pkg.c": {"pkg.a", "pkg.sub"}}
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_import_graph_counts_the_package_inits_an_import_runs(tmp_path):
    # the cycle lora_lab 0.1 had: formats imported diffusion.kinds, which ran diffusion/__init__, which
    # imported the trainer, which imported formats; no two modules import each other directly
    pkg = tmp_path / "pkg"
    for d in ("formats", "diffusion"):
        (pkg / d).mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "formats" / "__init__.py").write_text("from .names import N\n")
    (pkg / "formats" / "names.py").write_text("from ..diffusion.kinds import K\nN = 1\n")
    (pkg / "diffusion" / "__init__.py").write_text("from .train import train\n")
    (pkg / "diffusion" / "kinds.py").write_text("K = 1\n")
    (pkg / "diffusion" / "train.py").write_text("from ..formats import N\ndef train(): pass\n")
    graph = import_graph(pkg)
    assert "pkg.diffusion" in graph["pkg.formats.names"]  # the package __init__ on the way to diffusion.kinds
    assert "pkg" not in graph["pkg.formats.names"]  # its own package is already running
    assert find_cycles(graph) == [["pkg.diffusion", "pkg.diffusion.train", "pkg.formats",
                                   "pkg.formats.names"]]
    (pkg / "formats" / "names.py").write_text("N = 1\n")  # the cycle broken
    assert find_cycles(import_graph(pkg)) == []


def imports_alone(names: list[str], path: Path, preload: tuple[str, ...] = ()) -> tuple[list[str], str]:
    """(the modules of `names` that fail to import when imported first, stderr), each in a fresh child
    process of one interpreter that has imported only `preload`, with `path` first on sys.path."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(path)}
    proc = subprocess.run([sys.executable, "-c", _CHILDREN, json.dumps(names), json.dumps(preload)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sorted(json.loads(proc.stdout.strip().splitlines()[-1])), proc.stderr


# imported before the fork, so that each child pays only for lora_lab's own modules (what the test is about)
THIRD_PARTY = ("numpy", "safetensors.torch", "torch", "triton", "PIL.Image", "tqdm", "diffusers",
               "diffusers.models", "transformers")
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="forks one child per module")


@pytest.mark.slow
@needs_fork
def test_every_module_imports_alone_in_a_fresh_interpreter():
    failed, stderr = imports_alone(sorted(module_names(PACKAGE)), PACKAGE.parent,
                                   THIRD_PARTY)
    assert not failed, f"modules that do not import alone: {failed}\n{stderr[-3000:]}"


@needs_fork
def test_imports_alone_reports_a_module_that_needs_another_first(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\nA = 1\n")  # a cycle of names: whichever comes first fails
    (pkg / "b.py").write_text("from .a import A\nB = 2\n")
    (pkg / "c.py").write_text("X = 3\n")
    failed, stderr = imports_alone(["pkg.a", "pkg.b", "pkg.c"], tmp_path)
    assert failed == ["pkg.a", "pkg.b"] and "partially initialized" in stderr


def test_importing_lora_lab_leaves_triton_language_unimported():
    """The batch runner's kernels import lora_lab at start (their log filter), and notebook 06 sets
    TRITON_INTERPRET=1 after that: `import lora_lab` must not import triton.language (torch's flop counter
    does, so it is imported where it is used)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import sys, lora_lab, lora_lab.quiet; print('triton.language' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", (proc.stdout, proc.stderr[-2000:])
