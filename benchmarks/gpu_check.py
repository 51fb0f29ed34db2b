"""`make gpu`: everything that needs a CUDA GPU, in one command, into one table and reports/gpu.json.

    python benchmarks/gpu_check.py            # on a CUDA machine: the three checks below
    python benchmarks/gpu_check.py --quick    # the planner check at 512 px only

1. The Triton kernels compiled: tests/kernels/test_kernels.py without the interpreter (TRITON_INTERPRET
   unset).
2. benchmarks/bench_kernels.py: the kernels timed against PyTorch, PEFT and bitsandbytes.
3. The planner at real size against the GPU's own count: the real SDXL architecture (`base="real:sdxl"`,
   seeded random weights) trained for 3 steps in bf16 at 512 and 1024 px, checkpointing on and off, NF4 base
   on and off, each phase's `torch.cuda.max_memory_allocated` (`planning.measure_run(config, "cuda")`) against
   `plan_memory` of the same run.

On a machine without CUDA it says so and exits 0 (nothing is run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lora_lab.diffusion.trainer import PHASES

ROOT = Path(__file__).resolve().parent.parent


def kernel_tests() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/kernels/test_kernels.py"], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    return {"passed": proc.returncode == 0, "seconds": round(time.perf_counter() - t, 1),
            "summary": (proc.stdout.strip().splitlines() or [""])[-1]}


def kernel_bench() -> dict:
    proc = subprocess.run([sys.executable, "benchmarks/bench_kernels.py"], cwd=ROOT, capture_output=True,
                          text=True)
    return {"passed": proc.returncode == 0, "table": proc.stdout, "error": proc.stderr[-2000:]}


def planner_rows(resolutions: list[int]) -> list[dict]:
    from bench_planner import four_examples

    from lora_lab.diffusion import TrainConfig
    from lora_lab.planning import measure_run, plan_memory

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = four_examples(Path(tmp))
        for res in resolutions:
            for quantization in (None, "nf4"):
                for ckpt in (False, True):
                    config = TrainConfig(model="sdxl", base="real:sdxl", base_dtype="bf16", dataset=str(data),
                                         output=f"{tmp}/run", resolution=res, rank=16, steps=3,
                                         sample_steps=2, sample_prompts=["a photo"],
                                         gradient_checkpointing=ckpt, optimizer="adamw8bit",
                                         mixed_precision="bf16", base_quantization=quantization,
                                         progress=False, device="cuda")
                    measured = measure_run(config, "cuda")
                    plan = plan_memory(config)  # the same run
                    rows.append({"resolution": res, "base": quantization or "bf16", "checkpointing": ckpt,
                                 "measured": measured, "planned": dict(plan.phases)})
                    shutil.rmtree(config.output, ignore_errors=True)
    return rows


def table(report: dict) -> str:
    lines = [f"device: {report['device']}",
             f"Triton kernels compiled (tests/kernels/test_kernels.py): {report['kernels']['summary']}",
             "", "| resolution | base | checkpointing | phase | measured GiB | planned GiB | error |",
             "| ---: | --- | --- | --- | ---: | ---: | ---: |"]
    for row in report["planner"]:
        for phase in PHASES:
            m, p = row["measured"][phase], row["planned"][phase]
            err = f"{100 * (p / m - 1):+.1f}%" if m else "-"
            lines.append(
                f"| {row['resolution']} | {row['base']} | {'yes' if row['checkpointing'] else 'no'} | "
                f"{phase} | {m / 2**30:.2f} | {p / 2**30:.2f} | {err} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the planner check at 512 px only")
    ap.add_argument("--out", default=str(ROOT / "reports" / "gpu.json"))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "make gpu: no CUDA device on this machine (torch.cuda.is_available() is False); nothing to run. "
            "The kernels and the planner are checked on the CPU by `make test`.")
        return 0
    from lora_lab.fileio import atomic_write_bytes

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": kernel_tests(),
              "bench_kernels": kernel_bench(), "planner": planner_rows([512] if args.quick else [512, 1024])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(args.out), json.dumps(report, indent=1).encode())
    print(table(report))
    print(report["bench_kernels"]["table"])
    print(f"written: {args.out}")
    return 0 if report["kernels"]["passed"] and report["bench_kernels"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
