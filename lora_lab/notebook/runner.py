"""The batch runner: `python -m lora_lab.notebook [--out DIR] [-p NAME VALUE ...] [NAME ...]` executes the
notebooks with papermill into the output folder and writes `summary.json`; it exits 1 if any claim failed.
The kernels it starts draw with matplotlib's inline backend, so the executed copies hold the figures.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..fileio import atomic_write_bytes
from ..quiet import kernel_log_config
from .parameters import literal_value
from .record import BATCH_ENV, NOTEBOOKS, REPORTS_ENV, jsonable, report_dir

KERNEL_NAME = "lora-lab"
# The kernels the runner starts draw inline (figures in the executed copies), headless as Agg is.
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


# ----------------------------------------------------------------------------- the batch runner


def isolate_caches(root: Path | None = None) -> None:
    """Point matplotlib/IPython/Jupyter/inductor caches inside `root` (default .venv/cache or a temp dir)."""
    if root is None:
        venv = Path(sys.prefix)
        root = (venv / "cache" if os.access(venv, os.W_OK)
                else Path(os.environ.get("TMPDIR", "/tmp")) / "lora_lab_cache")
    for var, sub in [
        ("MPLCONFIGDIR", "matplotlib"),
        ("IPYTHONDIR", "ipython"),
        ("JUPYTER_CONFIG_DIR", "jupyter_config"),
        ("JUPYTER_RUNTIME_DIR", "jupyter_runtime"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("TRITON_CACHE_DIR", "triton"),
    ]:
        os.environ.setdefault(var, str(root / sub))
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")


@contextlib.contextmanager
def kernel_environment(reports: Path):
    """What a kernel started by the runner inherits: results in `reports`, `batch_run()` true, figures
    inline (not a forced MPLBACKEND=Agg from the calling shell, which would leave the executed copies
    without images)."""
    saved = {k: os.environ.get(k) for k in (REPORTS_ENV, "MPLBACKEND", BATCH_ENV)}
    os.environ[REPORTS_ENV] = str(reports)
    os.environ[BATCH_ENV] = "1"
    os.environ["MPLBACKEND"] = INLINE_BACKEND
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ensure_kernel() -> str:
    """Register the `lora-lab` Jupyter kernel for this interpreter (inside sys.prefix) if missing."""
    # jupyter_client, ipykernel and papermill are the `notebooks` extra: imported by the runner only
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


def run_notebook(path: Path, out_dir: Path, parameters: dict[str, Any] | None = None,
                 timeout: int = 1800) -> dict:
    """Execute one notebook with papermill into `out_dir`; return its recorded JSON (or a failure record)."""
    import papermill as pm  # the `notebooks` extra (see ensure_kernel)

    isolate_caches()
    out_dir.mkdir(parents=True, exist_ok=True)
    name = path.stem
    result_path = out_dir / f"{name}.json"
    result_path.unlink(missing_ok=True)
    error = None
    try:
        with kernel_environment(out_dir), tempfile.TemporaryDirectory() as tmp:
            kernel_config = Path(tmp) / "lora_lab_kernel.json"  # the kernel's log without known noise
            kernel_config.write_text(json.dumps(kernel_log_config()))
            pm.execute_notebook(
                str(path),
                str(out_dir / path.name),
                parameters=parameters or {},
                kernel_name=ensure_kernel(),
                language="python",
                cwd=str(path.parent),
                progress_bar=False,
                execution_timeout=timeout,
                extra_arguments=[f"--config={kernel_config}"],
            )
    except Exception as e:  # noqa: BLE001 (any failure of the notebook is recorded, not raised)
        # the kernel-side exception, not papermill's wrapper
        ename = getattr(e, "ename", None) or type(e).__name__
        error = f"{ename}: {getattr(e, 'evalue', None) or e}".splitlines()[0][:500]
    if result_path.exists():
        data = json.loads(result_path.read_text())
    else:
        data = {"notebook": name, "parameters": parameters or {}, "claims": {}, "passed": False}
    if error:
        data["passed"] = False
        data["error"] = error
    return data


def _cli_value(text: str) -> Any:
    """`-p NAME VALUE`: a Python literal (3, 0.5, True, [1, 2], float('nan')), else the text as a string."""
    try:
        return literal_value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return text


def select_notebooks(names: list[str]) -> list[Path]:
    """The notebooks in notebooks/ that `names` name (a stem, a file name or a path; none: all), in order."""
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    wanted = {Path(n).name for n in names}  # a path names the notebook of that name in notebooks/
    return [p for p in paths if p.stem in wanted or p.name in wanted] if names else paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lora_lab.notebook",
                                 description="Execute the notebooks with papermill.")
    ap.add_argument("names", nargs="*",
                    help="notebook names or paths, e.g. 03_lora_dora or notebooks/03_lora_dora.ipynb "
                    "(default: all in notebooks/)")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="inject a parameter (a Python literal, else a string), as papermill's -p; "
                    "repeatable")
    ap.add_argument("--out", default=None,
                    help=f"output folder (default: ${REPORTS_ENV}, else reports/ at the repository root)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve() if args.out else report_dir()
    paths = select_notebooks(args.names)
    if not paths:
        print(f"no notebooks found in {NOTEBOOKS} matching {args.names}", file=sys.stderr)
        return 2
    parameters = {name: _cli_value(value) for name, value in args.parameter}
    results = []
    for p in paths:
        t0 = time.time()
        print(f"running {p.name} ...", flush=True)
        r = run_notebook(p, out, parameters)
        r["wall_seconds"] = round(time.time() - t0, 1)
        results.append(r)
    summary = {"notebooks": results, "passed": all(r["passed"] for r in results)}
    atomic_write_bytes(out / "summary.json", json.dumps(summary, indent=2, default=jsonable).encode())
    print(f"\nreports: {out}  (summary: {out / 'summary.json'})")
    for r in results:
        n = len(r.get("claims", {}))
        held = sum(c["held"] for c in r.get("claims", {}).values())
        verdict = "PASS" if r["passed"] else "FAIL"
        extra = f"  {r['error']}" if r.get("error") else ""
        print(f"  {verdict}  {r['notebook']}: {held}/{n} claims held in "
              f"{r.get('wall_seconds', '?')} s{extra}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
