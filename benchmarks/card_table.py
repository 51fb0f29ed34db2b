"""docs/planning.md's card table for one real model: at 1024 px, LoRA rank 16, batch 1, what `fit_vram`
chooses on 12, 16, 24 and 48 GiB cards with a bf16, fp8 and NF4 base (block swapping where nothing else
fits), and the cache phase (the text encoder's) of each base.

    PYTHONPATH=. python benchmarks/card_table.py --model z-image-turbo     # ~15-30 min on a loaded CPU

Every plan is made once per base: the options `fit_vram` plans for one card are reused for the others.
Prints one markdown row per (base, card): the option chosen, its predicted peak and the phase that sets it.
"""

from __future__ import annotations

import argparse
import time

from lora_lab.planning import PlanError, fit_vram
from lora_lab.planning.fit import _label
from lora_lab.planning.planner import format_bytes

CARDS = ("12GiB", "16GiB", "24GiB", "48GiB")
BASES = {"bf16": None, "fp8": "fp8", "nf4": "nf4"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="z-image-turbo")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    print(f"| model | base | card | chosen | predicted peak | set by | cache phase |\n|{' --- |' * 7}")
    for base, quant in BASES.items():
        plans: list = []
        for card in CARDS:
            t0 = time.time()
            try:
                fit = fit_vram(card, args.model, resolution=args.resolution, rank=args.rank,
                               base_quantization=quant, plans=plans)
            except PlanError as e:
                print(f"| {args.model} | {base} | {card} | does not fit: {e} | | | |", flush=True)
                continue
            plans += [p for p in fit.tried if p not in plans]
            p = fit.chosen
            print(f"| {args.model} | {base} | {card} | {_label(p.options)} | {format_bytes(p.peak)} | "
                  f"{p.peak_phase} | {format_bytes(p.phases['cache'])} |  <!-- {time.time() - t0:.0f} s -->",
                  flush=True)


if __name__ == "__main__":
    main()
