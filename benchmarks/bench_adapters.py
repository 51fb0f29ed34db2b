"""Forward+backward time of one adapted Linear: lora_lab vs PEFT, LoRA and DoRA, fp32 (CPU by default).

    python benchmarks/bench_adapters.py [--reps 7] [--budget 10] [--threads 1] [--quick] [--device cpu|cuda]

Runs are interleaved (each repetition times every variant once, in turn), so a change in the machine's
load hits all variants alike; the tables show medians and ratios taken from the same run. Each shape
gets at least --reps repetitions, more (up to 400) where a step is short enough to fit --budget seconds
per variant: on a shared machine the median of a few short steps is mostly noise. A step is
y = layer(x); y.backward(dy) with x requiring grad (a layer in the middle of a network).

On a CPU shared with other jobs, wall time mostly measures the other jobs. The script therefore runs
torch on `--threads` threads (default 1) and reports the process's CPU time per step (time.process_time,
all threads of this process), which waiting for a core does not inflate; wall times are printed beside.

The floor of DoRA over LoRA counts multiply-adds: a LoRA step costs 2 T out in (base forward and
input gradient; the frozen W gets none) + 3 T r (in + out) (the adapter), and DoRA adds out x in x r for
B A in the norm, whatever the batch: so it weighs most when the tokens T are few.

Targets (issue 3; read here, not a timed test): LoRA no slower than PEFT's; DoRA at most 1.5x lora_lab's
LoRA at 4096 tokens and at most 2x at 64 tokens.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from lora_lab import LoRAConfig, LoRALinear

# (features, tokens, rank): 1024x1024 with 64 tokens; 4096x4096 with 4096 tokens (a 64x64 latent)
SHAPES = [(1024, 64, 16), (4096, 4096, 64)]
QUICK_SHAPES = [(256, 32, 8), (512, 256, 16)]
TARGET_DORA_OVER_LORA = {64: 2.0, 4096: 1.5}  # by tokens


class Holder(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


def build(features: int, rank: int, device: str) -> dict[str, nn.Module]:
    """The four layers on one base weight, with the same non-zero adapter weights."""
    import peft

    base = nn.Linear(features, features, bias=True)
    down = torch.randn(rank, features) / features**0.5
    up = torch.randn(features, rank) / rank**0.5
    layers = {}
    for dora in (False, True):
        ours = LoRALinear(copy.deepcopy(base), LoRAConfig(rank=rank, alpha=rank, use_dora=dora))
        cfg = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=["layer"], use_dora=dora)
        theirs = peft.get_peft_model(Holder(copy.deepcopy(base)), cfg)
        pl = theirs.base_model.model.layer
        with torch.no_grad():
            ours.down.copy_(down), ours.up.copy_(up)
            pl.lora_A["default"].weight.copy_(down), pl.lora_B["default"].weight.copy_(up)
        kind = "DoRA" if dora else "LoRA"
        layers[f"lora_lab {kind}"] = ours.to(device)
        layers[f"PEFT {kind}"] = theirs.to(device)
    return layers


def step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, device: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one forward+backward."""
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    layer(x).backward(dy)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.process_time() - c0, time.perf_counter() - t0


def floor(features: int, tokens: int, rank: int) -> float:
    lora = 2 * tokens * features * features + 3 * tokens * rank * (2 * features)
    return (lora + features * features * rank) / lora


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7,
                    help="least timed repetitions per variant (after one warm-up)")
    ap.add_argument("--budget", type=float, default=10.0,
                    help="seconds per variant that decide the repetitions")
    ap.add_argument("--quick", action="store_true", help="small shapes, to check the script runs")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for this run (default 1)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    clock = "wall" if args.device == "cuda" else "CPU"  # on a GPU the host's CPU time means nothing
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, fp32, "
          f"interleaved reps (at least {args.reps})")
    rows = []
    for features, tokens, rank in shapes:
        layers = build(features, rank, args.device)
        x = torch.randn(tokens, features, device=args.device, requires_grad=True)
        dy = torch.randn(tokens, features, device=args.device)
        cpu: dict[str, list[float]] = {k: [] for k in layers}
        wall: dict[str, list[float]] = {k: [] for k in layers}
        warm = max(step(layer, x, dy, args.device)[1] for layer in layers.values())
        reps = max(args.reps, min(400, int(args.budget / warm)))
        for _ in range(reps):
            for k, layer in layers.items():
                c, w = step(layer, x, dy, args.device)
                cpu[k].append(c)
                wall[k].append(w)
        med = {k: statistics.median(cpu[k] if clock == "CPU" else wall[k]) * 1e3 for k in layers}
        wall_med = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
        rows.append((features, tokens, rank, med, wall_med, reps))
        del layers

    print(f"\nmedian {clock} time per forward+backward step (wall-clock medians in brackets)\n")
    print("| shape (out x in), tokens, rank | reps | lora_lab LoRA | PEFT LoRA | lora_lab DoRA | PEFT DoRA |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for f, t, r, m, w, n in rows:
        cells = " | ".join(f"{m[k]:.2f} ms ({w[k]:.1f})"
                           for k in ("lora_lab LoRA", "PEFT LoRA", "lora_lab DoRA", "PEFT DoRA"))
        print(f"| {f}x{f}, {t}, {r} | {n} | {cells} |")
    print(f"\nratios of the {clock}-time medians\n")
    print("| shape (out x in), tokens, rank | LoRA ours/PEFT | DoRA ours/PEFT | DoRA/LoRA ours "
          "| DoRA/LoRA PEFT | DoRA/LoRA floor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for f, t, r, m, *_ in rows:
        print(
            f"| {f}x{f}, {t}, {r} | {m['lora_lab LoRA'] / m['PEFT LoRA']:.2f} "
            f"| {m['lora_lab DoRA'] / m['PEFT DoRA']:.2f} "
            f"| {m['lora_lab DoRA'] / m['lora_lab LoRA']:.2f} | {m['PEFT DoRA'] / m['PEFT LoRA']:.2f} "
            f"| {floor(f, t, r):.3f} |"
        )
    print()
    for f, t, r, m, *_ in rows:
        checks = [(f"LoRA no slower than PEFT's LoRA ({f}x{f}, {t} tokens)",
                   m["lora_lab LoRA"] / m["PEFT LoRA"], 1.0)]
        if t in TARGET_DORA_OVER_LORA:
            lim = TARGET_DORA_OVER_LORA[t]
            checks.append((f"DoRA <= {lim}x lora_lab LoRA ({f}x{f}, {t} tokens)",
                           m["lora_lab DoRA"] / m["lora_lab LoRA"], lim))
        for name, ratio, lim in checks:
            print(f"target: {name}: {ratio:.2f} -> {'met' if ratio <= lim else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
