"""A notebook's wall time on a quiet and on a busy machine, with the notebook thread policy and without it.

    python benchmarks/bench_notebooks.py [--rounds 1] [--threads 1] [NAME ...]   # default: 07_diffusion_lora

Each run executes the notebook as `make run` does (`python -m lora_lab.notebook NAME`, papermill, a fresh
kernel) into a temporary folder, in four settings interleaved per round:
  quiet, 1 thread      the policy (`lora_lab.threads.notebook_threads()`, set by Record.start): `make run` now
  busy,  1 thread      the same while a second process spins on one core (busy.py)
  quiet, 2 threads     LORA_LAB_THREADS=2: torch's default on this 2-core machine, what kernels ran before
  busy,  2 threads
Prints wall seconds (the runner's, kernel start included) and the notebook's own training seconds.
`--threads 1` runs only the two 1-thread settings (the 2-thread ones can take 10x longer on a shared machine).

Target (issue 30): notebook 07 with one core busy within 1.5x of `make run`'s time for it on a quiet machine.
JupyterLab runs the same kernel and cells (`make test-lab` drives 07 in Chromium); this times papermill.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from busy import machine_load, one_core_busy

SETTINGS = (("quiet", "1"), ("busy", "1"), ("quiet", "2"), ("busy", "2"))


def run_once(name: str, threads: str, out: Path) -> tuple[float, float | None]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MPLBACKEND")}
    env["LORA_LAB_THREADS"] = threads
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lora_lab.notebook", name, "--out", str(out)], env=env, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    report = out / f"{name}.json"
    data = json.loads(report.read_text()) if report.exists() else {}
    if not data.get("passed"):
        print(f"  {name} did not pass ({threads} thread(s)): see {out}", flush=True)
    return wall, data.get("numbers", {}).get("train_seconds")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=["07_diffusion_lora"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", choices=("1", "2"), help="only the settings with this many threads")
    args = ap.parse_args(argv)
    settings = [s for s in SETTINGS if args.threads in (None, s[1])]
    print(f"{machine_load()} at the start", flush=True)
    times: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_notebooks_") as tmp:
        for r in range(args.rounds):
            for name in args.names:
                for load, threads in settings:
                    out = Path(tmp) / f"{name}_{load}_{threads}_{r}"
                    with one_core_busy() if load == "busy" else contextlib.nullcontext():
                        before = machine_load()
                        wall, train = run_once(name, threads, out)
                    print(f"  {name}, {load}, {threads} thread(s): {wall:.1f} s (training {train} s; "
                          f"{before} before)", flush=True)
                    times.setdefault((name, load, threads), []).append((wall, train))
    print(f"\n| notebook | setting | wall s | training s | / {settings[0][0]}, {settings[0][1]} thread(s) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in args.names:
        base = statistics.median(w for w, _ in times[name, settings[0][0], settings[0][1]])
        for load, threads in settings:
            runs = times[name, load, threads]
            wall = statistics.median(w for w, _ in runs)
            train = statistics.median(t or 0.0 for _, t in runs)
            print(f"| {name} | {load}, {threads} thread(s) | {wall:.1f} | {train:.1f} | {wall / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
