"""The batch runner: `python -m lora_lab.notebook [--out DIR] [--jobs N] [-p NAME VALUE ...] [NAME ...]`
(__main__.py) executes the notebooks with papermill into the output folder and writes `summary.json`; it
exits 1 if any claim failed. The kernels it starts draw with matplotlib's inline backend, so the executed
copies hold the figures.

Several notebooks run at once, one per core (at most 4): each kernel does its work on one torch thread
(`lora_lab.threads.notebook_threads`), so N kernels on N cores do not oversubscribe them, and a batch run
on 2 cores takes about half the time of one after the other. The longest notebooks (by the last run's
`summary.json` in the same folder) start first; the summary keeps the notebooks' order.
"""

from __future__ import annotations

import ast
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fileio import atomic_write_bytes
from ..quiet import kernel_log_config
from .parameters import expected_parameters, literal_value
from .provenance import provenance
from .record import BATCH_ENV, NOTEBOOKS, REPORTS_ENV, jsonable

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


def default_jobs() -> int:
    """Notebooks run at once by default: one per core this process may use, at most 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


def longest_first(paths: list[Path], out_dir: Path) -> list[Path]:
    """`paths` ordered by their wall time in the last `summary.json` in `out_dir` (unknown ones first: they
    may be long), ties in name order; a missing or unreadable summary leaves the order as it is."""
    try:
        last = json.loads((out_dir / "summary.json").read_text())
        seconds = {r["notebook"]: float(r["wall_seconds"]) for r in last["notebooks"]}
    except (OSError, ValueError, KeyError, TypeError):
        return list(paths)
    return sorted(paths, key=lambda p: -seconds.get(p.stem, float("inf")))


@dataclass(frozen=True)
class Job:
    """One notebook run: `path` with `parameters` into `out_dir` (a batch run's folder, a sweep's point)."""

    path: Path
    out_dir: Path
    parameters: dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def __str__(self) -> str:
        return self.label or self.path.name


def _timed_run(job: Job) -> dict:
    t0 = time.time()
    r = run_notebook(job.path, job.out_dir, job.parameters)
    r["wall_seconds"] = round(time.time() - t0, 1)
    return r


def run_jobs(jobs: list[Job], workers: int = 1) -> list[dict]:
    """Run `jobs` (up to `workers` at once, each in its own worker process, in the order given) and return
    their records in that order, each with its `wall_seconds`. A failed run is a record with `passed` False
    and its `error`: the others go on."""
    if workers <= 1 or len(jobs) <= 1:
        results = []
        for job in jobs:
            print(f"running {job} ...", flush=True)
            results.append(_timed_run(job))
        return results
    ensure_kernel()  # once here, not by every worker at the same time
    done: dict[int, dict] = {}
    # spawn: a fresh interpreter per worker (no fork of this process's threads or open kernels)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_timed_run, job): i for i, job in enumerate(jobs)}
        print(f"running {len(jobs)} notebooks, {workers} at a time ...", flush=True)
        for f in as_completed(futures):
            i = futures[f]
            done[i] = f.result()
            verdict = "" if done[i].get("passed") else "  FAILED"
            print(f"  done {jobs[i]} in {done[i]['wall_seconds']} s{verdict}", flush=True)
    return [done[i] for i in range(len(jobs))]


def run_notebooks(paths: list[Path], out_dir: Path, parameters: dict[str, Any] | None = None,
                  jobs: int = 1) -> list[dict]:
    """Run `paths` into `out_dir` (up to `jobs` at once, the longest of the last run first) and return their
    records in the order of `paths`, each with its `wall_seconds`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    order = longest_first(paths, out_dir) if jobs > 1 else list(paths)
    records = run_jobs([Job(p, out_dir, dict(parameters or {})) for p in order], jobs)
    by_path = dict(zip(order, records))
    return [by_path[p] for p in paths]


def run_batch(names: list[str], out: Path, parameters: dict[str, Any], jobs: int) -> int:
    """`python -m lora_lab.notebook [NAME ...]`: the notebooks through papermill into `out`, `summary.json`
    (with the runner's provenance), one verdict line each; 1 if a claim failed, 2 if no notebook matched."""
    paths = select_notebooks(names)
    if not paths:
        print(f"no notebooks found in {NOTEBOOKS} matching {names}", file=sys.stderr)
        return 2
    for path in paths:  # every value against each notebook's declared ranges, before anything runs
        expected_parameters(path, parameters)
    t0 = time.time()
    jobs = min(jobs, len(paths))
    results = run_notebooks(paths, out, parameters, jobs=jobs)
    summary = {"notebooks": results, "passed": all(r["passed"] for r in results), "jobs": jobs,
               "wall_seconds": round(time.time() - t0, 1), "provenance": provenance(t0)}
    atomic_write_bytes(out / "summary.json", json.dumps(summary, indent=2, default=jsonable).encode())
    print(f"\nreports: {out}  (summary: {out / 'summary.json'})")
    for r in results:
        n = len(r.get("claims", {}))
        held = sum(c["held"] for c in r.get("claims", {}).values())
        verdict = "PASS" if r["passed"] else "FAIL"
        extra = f"  {r['error']}" if r.get("error") else ""
        print(f"  {verdict}  {r['notebook']}: {held}/{n} claims held in "
              f"{r.get('wall_seconds', '?')} s{extra}")
    print(f"  all: {summary['wall_seconds']} s, {jobs} at a time")
    return 0 if summary["passed"] else 1
