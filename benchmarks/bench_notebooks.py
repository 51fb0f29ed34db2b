"""A notebook's wall time on a quiet and on a busy machine, with the notebook thread policy and without it.

    python benchmarks/bench_notebooks.py [--rounds 1] [--threads 1] [--lab] [NAME ...]   # default: 07

Each run executes the notebook as `make run` does (`python -m lora_lab.notebook NAME`, papermill, a fresh
kernel) into a temporary folder, in four settings interleaved per round:
  quiet, 1 thread      the policy (`lora_lab.threads.notebook_threads()`, set by Record.start): `make run` now
  busy,  1 thread      the same while a second process spins on one core (busy.py)
  quiet, 2 threads     LORA_LAB_THREADS=2: torch's default on this 2-core machine, what kernels ran before
  busy,  2 threads
Prints wall seconds (the runner's, kernel start included), the notebook's own seconds (its record's
`seconds`: from `Record.start` to `finish`, the same measure in papermill and in JupyterLab) and its training
seconds. `--threads 1` runs only the two 1-thread settings (the 2-thread ones can take 10x longer on a shared
machine). `--lab` adds "lab busy": the notebook run in JupyterLab in Chromium (`tests/notebook/test_lab.py`,
as `make test-lab` runs it, Run All from the menu) while a second process spins on one core; its wall time
includes starting JupyterLab and the browser, so compare the notebook's own seconds.

Target (issue 30): notebook 07 in JupyterLab with one core busy within 1.5x of `make run`'s time for it on a
quiet machine: the "lab busy" row's notebook seconds over the "quiet, 1 thread" row's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from busy import machine_load, one_core_busy

SETTINGS = (("quiet", "1"), ("busy", "1"), ("quiet", "2"), ("busy", "2"))


REPO = Path(__file__).resolve().parents[1]


def run_once(name: str, threads: str, out: Path) -> tuple[float, float | None, float | None]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MPLBACKEND")}
    env["LORA_LAB_THREADS"] = threads
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lora_lab.notebook", name, "--out", str(out), "--jobs", "1"],
                   env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    report = out / f"{name}.json"
    data = json.loads(report.read_text()) if report.exists() else {}
    if not data.get("passed"):
        print(f"  {name} did not pass ({threads} thread(s)): see {out}", flush=True)
    return wall, data.get("seconds"), data.get("numbers", {}).get("train_seconds")


def run_in_lab(name: str) -> tuple[float, float | None, float | None]:
    """The notebook in JupyterLab in Chromium, as `make test-lab` runs it (its own seconds: the test prints
    them)."""
    env = {k: v for k, v in os.environ.items() if k != "LORA_LAB_THREADS"}
    env.update(LORA_LAB_REQUIRE_BROWSER="1", MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    env.setdefault("LORA_LAB_CHROMIUM", "/usr/bin/chromium")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                           "tests/notebook/test_lab.py", "-k",
                           f"test_notebook_runs_in_jupyterlab and {name}"],
                          cwd=REPO, env=env, check=False, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    found = re.search(rf"{name}: the notebook ran in JupyterLab in ([0-9.]+) s", done.stdout)
    if done.returncode or not found:
        print(f"  {name} did not pass in JupyterLab:\n{done.stdout[-2000:]}", flush=True)
    return wall, float(found.group(1)) if found else None, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=["07_diffusion_lora"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", choices=("1", "2"), help="only the settings with this many threads")
    ap.add_argument("--lab", action="store_true", help="add the notebook in JupyterLab with one core busy")
    args = ap.parse_args(argv)
    settings = [s for s in SETTINGS if args.threads in (None, s[1])]
    settings += [("lab busy", "1")] if args.lab else []
    print(f"{machine_load()} at the start", flush=True)
    times: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_notebooks_") as tmp:
        for r in range(args.rounds):
            for name in args.names:
                for load, threads in settings:
                    out = Path(tmp) / f"{name}_{load}_{threads}_{r}"
                    with one_core_busy() if "busy" in load else contextlib.nullcontext():
                        before = machine_load()
                        wall, own, train = (run_in_lab(name) if load == "lab busy"
                                            else run_once(name, threads, out))
                    print(f"  {name}, {load}, {threads} thread(s): {wall:.1f} s (notebook {own} s, training "
                          f"{train} s; {before} before)", flush=True)
                    times.setdefault((name, load, threads), []).append((wall, own or 0.0, train or 0.0))
    first = f"{settings[0][0]}, {settings[0][1]} thread(s)"
    print(f"\n| notebook | setting | wall s | notebook s | training s | notebook s / {first} |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name in args.names:
        base = statistics.median(o for _, o, _ in times[name, settings[0][0], settings[0][1]])
        for load, threads in settings:
            wall, own, train = (statistics.median(x) for x in zip(*times[name, load, threads]))
            train = "n/a" if load == "lab busy" else f"{train:.1f}"  # the browser test does not read it
            print(f"| {name} | {load}, {threads} thread(s) | {wall:.1f} | {own:.1f} | {train} | "
                  f"{own / base if base else float('nan'):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
