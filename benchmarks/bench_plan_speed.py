"""The planner's speed from a fresh process (imports included), plan cache off: the targets of issue 44.

    python benchmarks/bench_plan_speed.py                      # this checkout: each target once
    python benchmarks/bench_plan_speed.py --against ../main    # and another checkout, interleaved
    python benchmarks/bench_plan_speed.py --rounds 2 --only plan,fit
    python benchmarks/bench_plan_speed.py --orders             # fit's memory orders at real size (SDXL 1024)

Rows (SDXL, real size, 1024 px, rank 16, a plan's defaults: CUDA's rules, bf16):
    plan     plan_memory("sdxl", resolution=1024, rank=16)                      target <= 20 s
    fit      fit_vram("4GiB", "sdxl", ...): nothing fits                        target <= 20 s
    dry-run  lora-lab train --model sdxl --base real:sdxl --resolution 1024 --vram 24GiB --dry-run
                                                                                target <= 30 s
Each run is a fresh `python -c` with LORA_LAB_PLAN_CACHE=off, OMP_NUM_THREADS=1 and PYTHONPATH set to the
checkout: its wall seconds, its CPU seconds (user + system, the child's rusage: what the machine's other
load does not add to), the 1-minute load before it, and whether every checkout printed the same result (the
plan's phases and parts to the byte; fit's error; the dry run's printed plan). The checkouts alternate
within each round. Prints torch's CPU capability (torch.backends.cpu.get_cpu_capability()).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from busy import machine_load  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
SETUP = "import warnings, json; warnings.filterwarnings('ignore')\n"
CODE = {
    "plan": SETUP + """from lora_lab.planning import plan_memory
p = plan_memory("sdxl", resolution=1024, rank=16)
print(json.dumps([p.phases, p.parts, p.peak_phase, p.step_phase, p.saved_activations, p.attention]))""",
    "fit": SETUP + """from lora_lab.planning import PlanError, fit_vram
try:
    print(fit_vram("4GiB", "sdxl", resolution=1024, rank=16).reason())
except PlanError as e:
    print(e)""",
    "dry-run": SETUP + """import sys
from lora_lab.cli import main
sys.exit(main(["train", "--model", "sdxl", "--base", "real:sdxl", "--resolution", "1024", "--rank", "16",
               "--vram", "24GiB", "--dry-run", "--output", "/tmp/bench_plan_speed_out"]))""",
}
TARGET = {"plan": 20, "fit": 20, "dry-run": 30}


def fresh(checkout: Path, code: str) -> tuple[float, float, str]:
    """One fresh process running `code` with `checkout` first on the path: wall s, CPU s, its stdout."""
    env = {**os.environ, "LORA_LAB_PLAN_CACHE": "off", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(checkout)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=checkout).stdout
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, out


def result_key(what: str, out: str) -> str:
    """What must be the same in every checkout: the plan's figures; fit's verdict (what it chose, or that
    nothing fits); the dry run's printed plan."""
    if what == "fit":
        out = out.split(":")[0]
    elif what == "dry-run":
        out = "\n".join(line for line in out.splitlines() if not line.startswith("lora-lab train --vram"))
    return hashlib.sha256(out.encode()).hexdigest()[:10]


def orders() -> None:
    """The four options fit chooses between, SDXL 1024 rank 16 planned in full (this process): each memory
    order `fit._at_most` relies on, phase by phase; fit's choice (given the four plans: what it skips is
    never looked at) against the fastest that fits, for a card at each peak and just below (below the least:
    tiled decoding or block swapping, planned)."""
    from lora_lab.planning import PlanError, fit, fit_vram, plan_memory
    from lora_lab.planning.run import BEFORE_OPTIONS

    kw = {"resolution": 1024, "rank": 16}
    variants = [(ck, opt) for ck in fit.CHECKPOINTING_ORDER for opt in fit.OPTIMIZER_ORDER]
    full = {v: plan_memory("sdxl", gradient_checkpointing=v[0], optimizer=v[1], cache=False, **kw)
            for v in variants}
    print("| option | " + " | ".join(full[variants[0]].phases) + " |")
    for v, p in full.items():
        print(f"| {v} | " + " | ".join(str(n) for n in p.phases.values()) + " |")
    for a in variants:
        for b in variants:
            if a != b and fit._at_most(a, b):
                held = all(full[a].phases[ph] <= full[b].phases[ph] for ph in full[a].phases)
                print(f"{a} at most {b} in every phase: {'yes' if held else 'NO'}")
    same = all(p.phases[ph] == full[variants[0]].phases[ph] for p in full.values() for ph in BEFORE_OPTIONS)
    print(f"cache and load the same in every option: {'yes' if same else 'NO'}")
    for vram in sorted({p.peak + d for p in full.values() for d in (0, -1)}):
        expected = next((full[v] for v in variants if full[v].fits(vram)), None)
        t = time.perf_counter()
        try:
            chosen = fit_vram(vram, "sdxl", plans=list(full.values()), **kw).chosen
        except PlanError:
            chosen = None
        # past the four: samples decoded in tiles where only sampling does not fit, then blocks swapped
        beyond = chosen is not None and (chosen.options["blocks_to_swap"] or chosen.options["vae_tiling"])
        ok = chosen is expected or (expected is None and beyond)
        print(f"fit {vram} B: {'nothing fits' if chosen is None else fit._label(chosen.options)}, "
              f"{time.perf_counter() - t:.1f} s, the same as planning every option: {'yes' if ok else 'NO'}",
              flush=True)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, action="append", default=[],
                    help="another checkout (e.g. ../main) timed interleaved with this one")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--only", default="plan,fit,dry-run", help="comma-separated rows (plan, fit, dry-run)")
    ap.add_argument("--orders", action="store_true", help="fit's memory orders at real size (see orders())")
    args = ap.parse_args()
    if args.orders:
        return orders()
    checkouts = [HERE, *(p.resolve() for p in args.against)]
    rows = [r.strip() for r in args.only.split(",")]
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} cores")
    print("| row | checkout | wall s | CPU s | 1-min load before | result | target |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- |")
    results: dict[str, set] = {r: set() for r in rows}
    for i in range(args.rounds):
        for row in rows:
            order = checkouts if i % 2 == 0 else checkouts[::-1]
            for checkout in order:
                load = machine_load()
                wall, cpu, out = fresh(checkout, CODE[row])
                key = result_key(row, out)
                results[row].add(key)
                met = "met" if wall <= TARGET[row] else "NOT met"
                print(f"| {row} | {checkout.name} | {wall:.1f} | {cpu:.1f} | {load} | {key} | "
                      f"<= {TARGET[row]} s wall: {met} |", flush=True)
    for row, keys in results.items():
        same = "the same result in every checkout and round" if len(keys) == 1 else "RESULTS DIFFER"
        print(f"{row}: {same}")


if __name__ == "__main__":
    main()
