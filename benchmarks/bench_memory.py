"""Memory benchmark: gradient checkpointing (activation bytes, step time) and 8-bit Adam (state bytes, step time).

    python benchmarks/bench_memory.py [--threads 1] [--rounds 7] [--no-torchao]

Activation and state bytes are exact counts (lora_lab.memory), not allocator readings. Times are
medians of interleaved runs (each round runs every variant once), so a load change on the machine
hits all variants alike; ratios come from the same run. Prints a markdown table with the targets.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

import torch
import torch.utils.checkpoint

from lora_lab import Adam8bit, AdamW8bit, BlockStack, enable_checkpointing, optimizer_state_bytes
from lora_lab.memory import saved_activation_bytes
from lora_lab.notebook import isolate_caches

STACK = {"n_blocks": 12, "width": 256, "hidden": 1024, "out": 10, "dropout": 0.1}
STACK_BATCH = 128
# the sd15-like tiny UNet of the project's tiny diffusers configs
TINY_UNET = {
    "sample_size": 16, "in_channels": 4, "out_channels": 4, "layers_per_block": 1, "block_out_channels": [32, 64],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "cross_attention_dim": 32, "norm_num_groups": 32, "attention_head_dim": 8,
}
UNET_BATCH = 4
WEIGHT = (4096, 4096)  # 16.7M parameters


def _median_times(fns: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def checkpointing_rows(rounds: int) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    stack = BlockStack(**STACK).train()
    x = torch.randn(STACK_BATCH, STACK["width"])

    def torch_reference(m):  # PyTorch's own non-reentrant checkpoint on each block
        for b in m.blocks:
            b.forward = functools.partial(torch.utils.checkpoint.checkpoint, b.forward, use_reentrant=False)

    subjects = [("12-block residual MLP stack", stack, lambda m: m(x).square().mean(), lambda m: m.blocks,
                 "torch.utils.checkpoint", torch_reference)]
    try:
        import diffusers
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.transformers.transformer_2d import Transformer2DModel

        unet = diffusers.UNet2DConditionModel(**TINY_UNET).train()
        sample, t, text = torch.randn(UNET_BATCH, 4, 16, 16), torch.tensor([10, 300, 600, 900]), torch.randn(UNET_BATCH, 8, 32)
        subjects.append(("tiny diffusers UNet2DConditionModel", unet,
                         lambda m: m(sample, t, encoder_hidden_states=text).sample.square().mean(),
                         lambda m: (ResnetBlock2D, Transformer2DModel),
                         "diffusers' enable_gradient_checkpointing", lambda m: m.enable_gradient_checkpointing()))
    except ImportError:
        print("diffusers not installed: UNet rows skipped")
    for name, model, loss_fn, blocks, ref_name, make_reference in subjects:
        def step(m, f=loss_fn):
            f(m).backward()
            m.zero_grad(set_to_none=True)

        ckpt_model = copy.deepcopy(model)  # the same weights
        enable_checkpointing(ckpt_model, blocks(ckpt_model))
        ref_model = copy.deepcopy(model)
        make_reference(ref_model)
        plain = saved_activation_bytes(loss_fn, model)
        ckpt = saved_activation_bytes(loss_fn, ckpt_model)
        ref = saved_activation_bytes(loss_fn, ref_model)
        step(model), step(ckpt_model), step(ref_model)  # warm-up
        times = _median_times({k: functools.partial(step, m) for k, m in
                               (("plain", model), ("ckpt", ckpt_model), ("ref", ref_model))}, rounds)
        rows.append({"model": name, "plain_bytes": plain, "ckpt_bytes": ckpt, "ref_bytes": ref, "ref_name": ref_name,
                     "plain_s": times["plain"], "ckpt_s": times["ckpt"], "ref_s": times["ref"]})
    return rows


def optimizer_rows(rounds: int, use_torchao: bool) -> list[dict]:
    torch.manual_seed(0)
    w0 = torch.randn(WEIGHT) * 0.02
    grad = torch.randn(WEIGHT) * 1e-3
    makers = {
        "torch AdamW (fp32 state)": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "lora_lab Adam8bit": lambda ps: Adam8bit(ps, lr=1e-3),
        "lora_lab AdamW8bit": lambda ps: AdamW8bit(ps, lr=1e-3),
    }
    try:
        import bitsandbytes as bnb

        makers["bitsandbytes Adam8bit"] = lambda ps: bnb.optim.Adam8bit(ps, lr=1e-3)
    except ImportError:
        print("bitsandbytes not installed: its row is skipped")
    if use_torchao:
        try:
            from torchao.optim import AdamW8bit as AoAdamW8bit

            makers["torchao AdamW8bit (compiled)"] = lambda ps: AoAdamW8bit(ps, lr=1e-3)
        except ImportError:
            print("torchao not installed: its row is skipped")
    opts, steps = {}, {}
    for name, make in makers.items():
        p = torch.nn.Parameter(w0.clone())
        p.grad = grad.clone()
        opts[name] = make([p])
        t0 = time.perf_counter()
        opts[name].step()  # the first step allocates the state (and compiles, for torchao)
        print(f"  first step of {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        steps[name] = opts[name].step
    times = _median_times(steps, rounds)
    return [{"optimizer": k, "state_bytes": optimizer_state_bytes(o), "step_s": times[k]} for k, o in opts.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: see the README note)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (median)")
    ap.add_argument("--no-torchao", action="store_true", help="skip torchao (its first step compiles for ~1 min)")
    args = ap.parse_args()
    isolate_caches()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.rounds} interleaved rounds\n", flush=True)

    print("| model | activation bytes, plain | lora_lab checkpointing | ratio (target <= 0.40) | step s, plain "
          "| lora_lab checkpointing | time overhead (target <= +35%) | reference checkpointing: bytes ratio, overhead |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in checkpointing_rows(args.rounds):
        ratio = r["ckpt_bytes"] / r["plain_bytes"]
        over = r["ckpt_s"] / r["plain_s"] - 1
        print(f"| {r['model']} | {r['plain_bytes']:,} | {r['ckpt_bytes']:,} | {ratio:.3f} ({'met' if ratio <= 0.40 else 'not met'}) "
              f"| {r['plain_s']:.4f} | {r['ckpt_s']:.4f} | {over:+.0%} ({'met' if over <= 0.35 else 'not met'}) "
              f"| {r['ref_name']}: {r['ref_bytes'] / r['plain_bytes']:.3f}, {r['ref_s'] / r['plain_s'] - 1:+.0%} |")
    print()
    rows = optimizer_rows(args.rounds, not args.no_torchao)
    n = WEIGHT[0] * WEIGHT[1]
    bnb_row = next((r for r in rows if r["optimizer"].startswith("bitsandbytes")), None)
    print(f"\n| optimizer on a {WEIGHT[0]}x{WEIGHT[1]} weight ({n / 1e6:.1f}M params) | state bytes | bytes/param | step s | vs bitsandbytes |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        rel = ""
        if bnb_row and r["optimizer"].startswith("lora_lab"):
            t = r["step_s"] / bnb_row["step_s"]
            b_ok = r["state_bytes"] <= bnb_row["state_bytes"]
            rel = (f"time x{t:.2f} (target <= 1.5: {'met' if t <= 1.5 else 'not met'}); "
                   f"bytes {'<=' if b_ok else '>'} bnb ({'met' if b_ok else 'not met'})")
        print(f"| {r['optimizer']} | {r['state_bytes']:,} | {r['state_bytes'] / n:.3f} | {r['step_s']:.3f} | {rel} |")


if __name__ == "__main__":
    main()
