"""docs/planning.md's rows with a quantized text encoder for caching (Qwen-Image, FLUX.2; Chroma's and
Z-Image's cache phase): one real-size plan per row (1024 px, rank 16, batch 1, bf16 autocast, CUDA's rules),
every phase printed.

    PYTHONPATH=. python benchmarks/plan_card_rows.py --row qwen-nf4-te-nf4     # one row (a few minutes)
    PYTHONPATH=. python benchmarks/plan_card_rows.py                           # every row, one at a time

    PYTHONPATH=. python benchmarks/plan_card_rows.py --fake-quantization     # why a 20 B NF4 plan was slow

A row whose name ends in `-cache` stops after its load phase (`plan_memory(limit=1)`: the cache and load
phases come before every option of the adapter, optimizer, checkpointing and swapping, so they are the same
in all of them): what the text encoder's caching takes in that format, quickly.
"""

from __future__ import annotations

import argparse
import time

import torch

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
    "chroma-te-nf4-cache": ("chroma1-hd", dict(base_quantization="nf4", text_encoder_quantization="nf4")),
    "zimage-te-nf4-cache": ("z-image-turbo", dict(base_quantization="nf4", text_encoder_quantization="nf4")),
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


def fake_quantization(shape=(3072, 12288)) -> None:
    """`quantize_weight` on one fake weight (a plan's: Qwen-Image's feed-forward, 37.7 M values) working
    through every chunk, as it did, against the first two only, as it does: per format, and scaled to the
    20.43 B values of Qwen-Image's transformer."""
    from lora_lab.planning.fakedevice import fake_device
    from lora_lab.quant import warm_tables, weights

    warm_tables()
    first_two = weights._starts
    every = {"every chunk": lambda total, step, real: range(0, total, step), "first two": first_two}
    scale = 20.43e9 / (shape[0] * shape[1])
    print("| format | every chunk s | first two s | ratio | 20.43 B: every chunk s | first two s |")
    print("|" + " --- |" * 6)
    for fmt in ("nf4", "fp8", "int8"):
        seconds = []
        for starts in every.values():
            weights._starts = starts
            try:
                with fake_device():
                    w = torch.empty(shape, dtype=torch.bfloat16)
                    t0 = time.perf_counter()
                    weights.quantize_weight(w, fmt)
                    seconds.append(time.perf_counter() - t0)
            finally:
                weights._starts = first_two
        print(f"| {fmt} | {seconds[0]:.3f} | {seconds[1]:.4f} | {seconds[0] / seconds[1]:.0f} | "
              f"{seconds[0] * scale:.0f} | {seconds[1] * scale:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row", action="append", choices=list(ROWS), help="a row to plan (default: every row)")
    ap.add_argument("--fake-quantization", action="store_true",
                    help="time quantize_weight on a fake weight: every chunk against the first two")
    args = ap.parse_args()
    if args.fake_quantization:
        fake_quantization()
        return
    print("| row | model | options | " + " | ".join(PHASES) + " | peak | copied per step | plan s |")
    print("|" + " --- |" * (len(PHASES) + 6))
    for name in args.row or ROWS:
        print(plan_row(name), flush=True)


if __name__ == "__main__":
    main()
