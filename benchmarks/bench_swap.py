"""Block swapping: the bytes one training step copies from host memory, and (where CUDA is) the step's time
and peak against no swapping, side by side in one run.

    python benchmarks/bench_swap.py                       # the tiny Flux transformer, on the CPU
    python benchmarks/bench_swap.py --layers 4 --width 8  # a larger Flux-like transformer (8 heads x 128)
    python benchmarks/bench_swap.py --device cuda         # a GPU: step time and peak, swapped or not

One forward and backward of the transformer with LoRA on its attention (rank 16), full checkpointing, batch
1, `--tokens` image tokens; `--swap` blocks swapped (default: all but 2). On the CPU the "device copy" is a
clone: the bytes are those a GPU would copy, the times say nothing about overlap. Prints the thread count.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from lora_lab import LoRAConfig, add_lora
from lora_lab.checkpointing import block_swap, enable_block_swap, enable_checkpointing
from lora_lab.memory import peak_memory
from lora_lab.models import model_kind
from lora_lab.models.builders import CONFIGS
from lora_lab.models.inputs import flux_latent_ids


def build(layers: int, width: int, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    cfg = dict(CONFIGS["flux"]["transformer"])
    if width:
        cfg.update(num_layers=layers, num_single_layers=2 * layers, num_attention_heads=width,
                   attention_head_dim=128, axes_dims_rope=[16, 56, 56], in_channels=64,
                   joint_attention_dim=4096, pooled_projection_dim=768)
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**cfg).to(device, dtype).requires_grad_(False)
    add_lora(model, LoRAConfig(rank=16, alpha=16.0, targets=["to_q", "to_k", "to_v", "to_out.0"]))
    return model


def step(model, device: str, dtype: torch.dtype, tokens: int) -> float:
    cfg = model.config
    x = torch.randn(1, tokens, cfg.in_channels, device=device, dtype=dtype)
    ctx = torch.randn(1, 64, cfg.joint_attention_dim, device=device, dtype=dtype)
    pooled = torch.randn(1, cfg.pooled_projection_dim, device=device, dtype=dtype)
    side = int(tokens ** 0.5)
    img_ids = flux_latent_ids(2 * side, 2 * side).to(device, dtype)  # packed 2x2: side x side tokens
    t0 = time.perf_counter()
    out = model(hidden_states=x, timestep=torch.full((1,), 0.5, device=device, dtype=dtype),
                guidance=torch.full((1,), 3.5, device=device, dtype=dtype), pooled_projections=pooled,
                encoder_hidden_states=ctx, txt_ids=torch.zeros(64, 3, device=device, dtype=dtype),
                img_ids=img_ids).sample
    out.float().square().mean().backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=1, help="double blocks (single blocks: twice as many)")
    ap.add_argument("--width", type=int, default=0, help="heads of 128 (0: the tiny config)")
    ap.add_argument("--tokens", type=int, default=16, help="image tokens (a square number)")
    ap.add_argument("--swap", type=int, default=None, help="blocks swapped (default: all but 2)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    kind = model_kind("flux")
    plain = build(args.layers, args.width, args.device, dtype)
    swapped = copy.deepcopy(plain)
    blocks = kind.checkpoint_blocks()
    n = args.swap if args.swap is not None else max(1, len(list(plain.transformer_blocks))
                                                     + len(list(plain.single_transformer_blocks)) - 2)
    enable_block_swap(swapped, blocks, n, args.device)
    for m in (plain, swapped):
        enable_checkpointing(m, blocks)
        m.train()
    print(f"threads {torch.get_num_threads()}, device {args.device}, {n} blocks swapped, "
          f"{args.tokens} tokens")
    print("| run | step s (median) | peak MiB | host -> device MiB per step |")
    print("| --- | ---: | ---: | ---: |")
    times: dict[str, list[float]] = {"no swapping": [], "swapping": []}
    for _ in range(args.repeats):  # interleaved
        times["no swapping"].append(step(plain, args.device, dtype, args.tokens))
        times["swapping"].append(step(swapped, args.device, dtype, args.tokens))
    swap = block_swap(swapped)
    for name, model in (("no swapping", plain), ("swapping", swapped)):
        peak = (peak_memory(lambda m=model: step(m, args.device, dtype, args.tokens)) / 2**20
                if args.device == "cuda" else float("nan"))
        moved = swap.bytes_per_step() / 2**20 if model is swapped else 0.0
        t = sorted(times[name])[len(times[name]) // 2]
        print(f"| {name} | {t:.3f} | {peak:.0f} | {moved:.2f} |")
    steps = args.repeats + (args.device == "cuda")
    print(f"copied per step, counted: {swap.copied / steps / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
