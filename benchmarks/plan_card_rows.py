"""docs/planning.md's Qwen-Image and FLUX.2 rows with a quantized text encoder for caching: one real-size plan
per row (1024 px, rank 16, batch 1, bf16 autocast, CUDA's rules), every phase printed.

    PYTHONPATH=. python benchmarks/plan_card_rows.py --row qwen-nf4-te-nf4     # one row (a few minutes)
    PYTHONPATH=. python benchmarks/plan_card_rows.py                           # every row, one at a time

A row whose name ends in `-cache` stops after its load phase (`plan_memory(limit=1)`: the cache and load
phases come before every option of the adapter, optimizer, checkpointing and swapping, so they are the same
in all of them): what the text encoder's caching takes in that format, quickly.
"""

from __future__ import annotations

import argparse
import time

from lora_lab.planning import plan_memory
from lora_lab.planning.planner import format_bytes
from lora_lab.planning.run import OverLimit

STEP = dict(resolution=1024, rank=16, base_dtype="bf16", gradient_checkpointing=True, optimizer="adamw8bit")
# name -> (real model, plan_memory's fields beside STEP)
ROWS = {
    "qwen-nf4-te-nf4": ("qwen-image", dict(base_quantization="nf4", text_encoder_quantization="nf4")),
    "qwen-te-fp8-cache": ("qwen-image", dict(base_quantization="nf4", text_encoder_quantization="fp8")),
    "qwen-nf4-te-nf4-swap": ("qwen-image", dict(base_quantization="nf4", text_encoder_quantization="nf4",
                                                blocks_to_swap=20)),
    "flux2-te-fp8-cache": ("flux2-dev", dict(base_quantization="nf4", text_encoder_quantization="fp8")),
    "flux2-nf4-te-nf4-swap": ("flux2-dev", dict(base_quantization="nf4", text_encoder_quantization="nf4",
                                                blocks_to_swap=16)),
}
PHASES = ("cache", "load", "train step", "save", "sample")


def plan_row(name: str) -> str:
    """One row: the plan's phases (GiB), its peak and the phase that sets it, the bytes swapping copies per
    step, and the plan's wall time."""
    model, fields = ROWS[name]
    t0 = time.time()
    stop = name.endswith("-cache")
    try:
        plan = plan_memory(model, **STEP, **fields, cache=False, limit=1 if stop else None)
        phases, peak = plan.phases, f"{format_bytes(plan.peak)} ({plan.peak_phase})"
        moved = format_bytes(plan.moved_per_step)
    except OverLimit as e:  # stopped after the load phase, as asked
        phases, peak, moved = e.phases, "(stopped after load)", ""
    cells = [format_bytes(phases[p]) if p in phases else "" for p in PHASES]
    options = ", ".join(f"{k}={v}" for k, v in fields.items())
    return (f"| {name} | {model} | {options} | " + " | ".join(cells)
            + f" | {peak} | {moved} | {time.time() - t0:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row", action="append", choices=list(ROWS), help="a row to plan (default: every row)")
    args = ap.parse_args()
    print("| row | model | options | " + " | ".join(PHASES) + " | peak | copied per step | plan s |")
    print("|" + " --- |" * (len(PHASES) + 6))
    for name in args.row or ROWS:
        print(plan_row(name), flush=True)


if __name__ == "__main__":
    main()
