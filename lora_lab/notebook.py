"""What every notebook shares: checked parameters, recorded results, and the batch runner.

In a notebook:

    nb = Record.start("01_autograd", globals())   # right after the `parameters` cell
    ...
    nb.number("dy_dx", 4.0)
    nb.claim("dy/dx = 4 at x = 2", dy_dx == 4.0)
    nb.figure(fig, "loss_curve")
    nb.finish()                                   # writes the JSON, then fails if a claim failed

`Record.start` reads the defaults from the notebook's `parameters` cell (from the IPython input
history, so it works in JupyterLab and under papermill alike) and rejects injected names that
the notebook does not define, and injected values whose type differs from the default's.

Batch: `python -m lora_lab.notebook [--out reports] [NAME ...]` executes the notebooks with
papermill into the output folder and writes `summary.json`; it exits 1 if any claim failed.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .formats import atomic_write_bytes
from .params import LoraLabError

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
REPORTS_ENV = "LORA_LAB_REPORTS"
KERNEL_NAME = "lora-lab"


class NotebookParameterError(LoraLabError):
    """An injected parameter that the notebook does not define, or of the wrong type."""


class ClaimFailed(LoraLabError):
    """A notebook's recorded claim did not hold."""


def report_dir() -> Path:
    """Where results go: $LORA_LAB_REPORTS (set by the runner and the tests), else ./reports."""
    return Path(os.environ.get(REPORTS_ENV, "reports")).resolve()


def _literal_assignments(source: str) -> dict[str, Any] | None:
    """{NAME: value} if `source` is only `UPPER_CASE = literal` lines (and comments), else None."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if not tree.body:
        return None
    out = {}
    for stmt in tree.body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            return None
        name = stmt.targets[0].id
        if not name.isupper():
            return None
        try:
            out[name] = ast.literal_eval(stmt.value)
        except ValueError:
            return None
    return out


def _same_kind(default: Any, value: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return type(default) is type(value)
    if isinstance(default, float):
        return isinstance(value, (int, float))  # papermill injects 1 for 1.0
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))  # papermill turns tuples into lists
    return type(default) is type(value)


def check_parameters(defaults: dict[str, Any], injected: dict[str, Any]) -> None:
    """Raise NotebookParameterError for unknown names or changed types."""
    unknown = sorted(set(injected) - set(defaults))
    if unknown:
        raise NotebookParameterError(
            f"unknown parameter(s) {unknown}; this notebook takes {sorted(defaults)}"
        )
    for name, value in injected.items():
        if not _same_kind(defaults[name], value):
            raise NotebookParameterError(
                f"parameter {name}={value!r} is a {type(value).__name__}, "
                f"but its default {defaults[name]!r} is a {type(defaults[name]).__name__}"
            )


def _parameters_from_history(inputs: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(defaults, injected) from the executed cells: the last literal-only cell is the
    defaults; papermill's injected cell (it begins with '# Parameters') follows it."""
    defaults: dict[str, Any] = {}
    injected: dict[str, Any] = {}
    for src in inputs:
        values = _literal_assignments(src)
        if values is None:
            continue
        if src.lstrip().startswith("# Parameters"):
            injected = values
        else:
            defaults, injected = values, {}
    return defaults, injected


@dataclass
class Record:
    """Named numbers, named claims and figures of one notebook run, written to <reports>/<name>.json."""

    name: str
    parameters: dict[str, Any]
    numbers: dict[str, Any] = field(default_factory=dict)
    claims: dict[str, dict[str, Any]] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    @classmethod
    def start(cls, name: str, namespace: dict[str, Any]) -> Record:
        """Check the parameters in `namespace` (a notebook's globals()) and start a record."""
        inputs = namespace.get("In")
        if isinstance(inputs, list):
            defaults, injected = _parameters_from_history(inputs)
            check_parameters(defaults, injected)
        else:  # not IPython: nothing injected, take the UPPER_CASE globals as they are
            defaults = {}
        params = {k: namespace[k] for k in defaults if k in namespace}
        return cls(name=name, parameters=params)

    def number(self, key: str, value: Any) -> Any:
        """Record a named number (or small list/dict of numbers) and return it."""
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()
        self.numbers[key] = value
        return value

    def claim(self, key: str, held: bool, detail: str = "") -> bool:
        """Record whether a claim held; `finish()` fails the notebook if any did not."""
        held = bool(held)
        self.claims[key] = {"held": held, "detail": detail}
        print(f"[{'PASS' if held else 'FAIL'}] {key}" + (f"  ({detail})" if detail else ""))
        return held

    def figure(self, fig, key: str) -> Path:
        """Save a matplotlib figure as PNG beside the report and return its path."""
        out = report_dir() / "figures" / f"{self.name}_{key}.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110, bbox_inches="tight")
        self.figures.append(str(out.relative_to(report_dir())))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "notebook": self.name,
            "parameters": self.parameters,
            "numbers": self.numbers,
            "claims": self.claims,
            "figures": self.figures,
            "passed": all(c["held"] for c in self.claims.values()),
            "seconds": round(time.time() - self.started, 2),
        }

    def finish(self) -> dict[str, Any]:
        """Write <reports>/<name>.json (atomically), then raise ClaimFailed if a claim failed."""
        data = self.to_json()
        atomic_write_bytes(report_dir() / f"{self.name}.json", json.dumps(data, indent=2, default=_jsonable).encode())
        failed = [k for k, c in self.claims.items() if not c["held"]]
        if not self.claims:
            raise ClaimFailed(f"{self.name}: recorded no claims")
        if failed:
            raise ClaimFailed(f"{self.name}: claim(s) did not hold: {failed}")
        return data


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)


# ----------------------------------------------------------------------------- the batch runner


def isolate_caches(root: Path | None = None) -> None:
    """Point matplotlib/IPython/Jupyter/inductor caches inside `root` (default .venv/cache or a temp dir)."""
    if root is None:
        venv = Path(sys.prefix)
        root = venv / "cache" if os.access(venv, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp")) / "lora_lab_cache"
    for var, sub in [
        ("MPLCONFIGDIR", "matplotlib"),
        ("IPYTHONDIR", "ipython"),
        ("JUPYTER_CONFIG_DIR", "jupyter_config"),
        ("JUPYTER_RUNTIME_DIR", "jupyter_runtime"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("TRITON_CACHE_DIR", "triton"),
    ]:
        os.environ.setdefault(var, str(root / sub))
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")


def ensure_kernel() -> str:
    """Register the `lora-lab` Jupyter kernel for this interpreter (inside sys.prefix) if missing."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
        if Path(spec.argv[0]).resolve() == Path(sys.executable).resolve():
            return KERNEL_NAME
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    install(kernel_name=KERNEL_NAME, display_name="Python (lora-lab)", prefix=sys.prefix)
    return KERNEL_NAME


def run_notebook(path: Path, out_dir: Path, parameters: dict[str, Any] | None = None, timeout: int = 1800) -> dict:
    """Execute one notebook with papermill into `out_dir`; return its recorded JSON (or a failure record)."""
    import papermill as pm

    isolate_caches()
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ[REPORTS_ENV] = str(out_dir)
    name = path.stem
    result_path = out_dir / f"{name}.json"
    result_path.unlink(missing_ok=True)
    error = None
    try:
        pm.execute_notebook(
            str(path),
            str(out_dir / path.name),
            parameters=parameters or {},
            kernel_name=ensure_kernel(),
            language="python",
            cwd=str(path.parent),
            progress_bar=False,
            execution_timeout=timeout,
        )
    except Exception as e:  # noqa: BLE001 (any failure of the notebook is recorded, not raised)
        ename = getattr(e, "ename", None) or type(e).__name__  # the kernel-side exception, not papermill's wrapper
        error = f"{ename}: {getattr(e, 'evalue', None) or e}".splitlines()[0][:500]
    if result_path.exists():
        data = json.loads(result_path.read_text())
    else:
        data = {"notebook": name, "parameters": parameters or {}, "claims": {}, "passed": False}
    if error:
        data["passed"] = False
        data["error"] = error
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lora_lab.notebook", description="Execute the notebooks with papermill.")
    ap.add_argument("names", nargs="*", help="notebook names (default: all in notebooks/)")
    ap.add_argument("--out", default="reports", help="output folder (default: reports)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.names:
        paths = [p for p in paths if p.stem in args.names or p.name in args.names]
    if not paths:
        print(f"no notebooks found in {NOTEBOOKS} matching {args.names}", file=sys.stderr)
        return 2
    results = []
    for p in paths:
        t0 = time.time()
        print(f"running {p.name} ...", flush=True)
        r = run_notebook(p, out)
        r["wall_seconds"] = round(time.time() - t0, 1)
        results.append(r)
    summary = {"notebooks": results, "passed": all(r["passed"] for r in results)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_jsonable))
    print(f"\nreports: {out}  (summary: {out / 'summary.json'})")
    for r in results:
        n = len(r.get("claims", {}))
        held = sum(c["held"] for c in r.get("claims", {}).values())
        verdict = "PASS" if r["passed"] else "FAIL"
        extra = f"  {r['error']}" if r.get("error") else ""
        print(f"  {verdict}  {r['notebook']}: {held}/{n} claims held in {r.get('wall_seconds', '?')} s{extra}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
