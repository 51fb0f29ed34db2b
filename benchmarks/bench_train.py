"""Training step time and memory of lora_lab's trainer on the tiny SDXL-like base, against a reference
loop of diffusers + PEFT + torch AdamW on the same config and batch; and each memory feature on/off.

    PYTHONPATH=. python benchmarks/bench_train.py [--steps 10] [--rounds 3] [--batch-size 8] [--rank 8]
                                                  [--threads 2]

Rows: the reference loop; lora_lab's `train()` with plain fp32 AdamW; then with gradient checkpointing,
lora_lab's 8-bit AdamW, bf16 autocast, and all three. Runs are interleaved (every row once per round);
each run's step time is the median over its steps after the first two (warm-up), and the table shows the
median over rounds. lora_lab's step times are those `train()` writes to its loss log (the whole step:
batch, forward, backward, clipping, optimizer, logging), the reference's are timed around the same work.

Memory, exact on any device: `activation bytes` = what autograd keeps for backward during one micro-batch's
forward (`lora_lab.memory.saved_activation_bytes`), `optimizer bytes` = the optimizer's state after a step
(`optimizer_state_bytes`). On a GPU also `peak MiB`: CUDA peak allocated during the whole run.
Targets: lora_lab plain no slower than the reference (ratio <= 1.05, timing noise allowed); each memory
feature lowers the memory it is for. This script sets torch's thread count (--threads) and says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from lora_lab.diffusion import diffusion_loss, objective_for
from lora_lab.diffusion.config import ATTENTION_TARGETS
from lora_lab.diffusion.data import encode_dataset, global_batch_indices
from lora_lab.diffusion.step import denoising_loss, step_generator
from lora_lab.diffusion.trainer import TrainConfig, add_adapter, make_optimizer, train
from lora_lab.memory import optimizer_state_bytes, saved_activation_bytes
from lora_lab.models import RESOLUTION, build_pipeline, denoiser, model_kind, predict, shipped_base

WARMUP = 2  # steps dropped from each run's median
VARIANTS = {  # row name -> TrainConfig changes (None: the reference loop)
    "reference: diffusers + PEFT + torch AdamW": None,
    "lora_lab train(), fp32 AdamW": {},
    "  + gradient checkpointing": {"gradient_checkpointing": True},
    "  + 8-bit AdamW (lora_lab)": {"optimizer": "adamw8bit"},
    "  + bf16 autocast": {"mixed_precision": "bf16"},
    "  + all three": {"gradient_checkpointing": True, "optimizer": "adamw8bit", "mixed_precision": "bf16"},
}


def cuda_peak(fn):
    """(fn(), CUDA peak bytes during it) or (fn(), None) without a GPU."""
    if not torch.cuda.is_available():
        return fn(), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated()


def run_lora_lab(config: TrainConfig) -> tuple[float, int | None]:
    """Median step seconds of one train() run (from its loss log), and its CUDA peak."""
    with tempfile.TemporaryDirectory() as tmp:
        result, peak = cuda_peak(lambda: train(replace(config, output=tmp)))
        log = [json.loads(line) for line in (Path(tmp) / "loss.jsonl").read_text().splitlines()]
    del result
    return statistics.median(r["seconds"] for r in log[WARMUP:]), peak


def encoded(config: TrainConfig, pipe):
    """The dataset as train() caches it (one size): latents (N, C, h, w), text embeddings, captions."""
    data = encode_dataset(pipe, config.dataset_dir(), RESOLUTION, seed=config.seed)
    return torch.stack(data.latents), data.embeds, data.captions


def reference_setup(config: TrainConfig):
    """The same base, data and LoRA targets, with PEFT's adapter and torch's AdamW."""
    from peft import LoraConfig

    pipe = build_pipeline(config.model, shipped_base(config.model))
    latents, embeds, captions = encoded(config, pipe)
    unet = denoiser(pipe)
    unet.requires_grad_(False)
    torch.manual_seed(config.seed)
    unet.add_adapter(LoraConfig(r=config.rank, lora_alpha=config.rank, target_modules=list(ATTENTION_TARGETS),
                                init_lora_weights=True))
    unet.train()
    params = [p for p in unet.parameters() if p.requires_grad]
    return pipe, unet, params, latents, embeds, len(captions)


def reference_step(config, pipe, unet, params, opt, objective, latents, embeds, n, step):
    """One step of the reference loop: the same batch, noise and timesteps as train()'s step `step`."""
    idx = global_batch_indices(config.seed, step, config.batch_size, n)
    g = step_generator(config.seed, step, torch.device("cpu"))
    noise = torch.randn((config.batch_size, *latents.shape[1:]), generator=g)
    t = objective.sample_timesteps(config.batch_size, generator=g)
    x0, cond = latents[idx], {k: v[idx] for k, v in embeds.items()}
    pred = predict(config.model, unet, objective.noisy(x0, noise, t), t, cond,
                   vae_scale_factor=pipe.vae_scale_factor)
    loss = diffusion_loss(pred, objective.target(x0, noise, t))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def run_reference(config: TrainConfig) -> tuple[float, int | None]:
    def loop():
        pipe, unet, params, latents, embeds, n = reference_setup(config)
        opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        objective = objective_for(pipe)
        times = []
        for step in range(config.steps):
            t0 = time.perf_counter()
            reference_step(config, pipe, unet, params, opt, objective, latents, embeds, n, step)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[WARMUP:])

    return cuda_peak(loop)


def memory_of(config: TrainConfig | None, base: TrainConfig) -> tuple[int, int, int]:
    """(activation bytes of one micro-batch forward, optimizer state bytes after one step,
    number of tensors whose moments the optimizer keeps in 8 bits)."""
    cfg = config or base
    g = step_generator(cfg.seed, 0, torch.device("cpu"))
    if config is None:  # the reference
        pipe, model, params, latents, embeds, _n = reference_setup(base)
        opt = torch.optim.AdamW(params, lr=base.lr)
        objective = objective_for(pipe)

        def forward(x0, noise, t, cond):
            pred = predict(base.model, model, objective.noisy(x0, noise, t), t, cond,
                           vae_scale_factor=pipe.vae_scale_factor)
            return diffusion_loss(pred, objective.target(x0, noise, t))
    else:
        from lora_lab.checkpointing import enable_checkpointing

        pipe = build_pipeline(cfg.model, shipped_base(cfg.model))
        latents, embeds, _captions = encoded(cfg, pipe)
        model = denoiser(pipe)
        add_adapter(model, cfg, model_kind(cfg.model))
        if cfg.gradient_checkpointing:
            enable_checkpointing(model, model_kind(cfg.model).checkpoint_blocks())
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_optimizer(params, cfg)
        objective = objective_for(pipe)

        def forward(x0, noise, t, cond):
            return denoising_loss(cfg, model_kind(cfg.model), pipe, objective, x0, noise, t, cond)

    idx = torch.arange(cfg.batch_size) % latents.shape[0]
    noise = torch.randn((cfg.batch_size, *latents.shape[1:]), generator=g)
    t = objective.sample_timesteps(cfg.batch_size, generator=g)
    x0, cond = latents[idx], {k: v[idx] for k, v in embeds.items()}
    act = saved_activation_bytes(forward, x0, noise, t, cond)
    forward(x0, noise, t, cond).backward()
    opt.step()
    quantized = sum(1 for st in opt.state.values()
                    if getattr(st.get("exp_avg"), "dtype", None) == torch.uint8)
    return act, optimizer_state_bytes(opt), quantized


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = TrainConfig(model="sdxl", output="unused", steps=args.steps, batch_size=args.batch_size,
                       rank=args.rank, lr=1e-3, sample_steps=0, progress=False, device="auto")
    print(f"tiny SDXL-like base ({shipped_base('sdxl') or 'random init'}), data {base.dataset_dir()}, "
          f"batch {args.batch_size}, rank {args.rank}, {args.steps} steps x {args.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}, device {'cuda' if torch.cuda.is_available() else 'cpu'}")

    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    peaks: dict[str, int | None] = {}
    for r in range(args.rounds):
        for name, change in VARIANTS.items():
            if change is None:
                sec, peak = run_reference(base)
            else:
                sec, peak = run_lora_lab(replace(base, **change))
            times[name].append(sec)
            peaks[name] = peak
            print(f"  round {r + 1}: {name.strip():45s} {sec * 1000:8.1f} ms/step", flush=True)

    mem = {name: memory_of(None if ch is None else replace(base, **ch), base)
           for name, ch in VARIANTS.items()}
    ref_name, plain_name = list(VARIANTS)[:2]
    ref = statistics.median(times[ref_name])
    gpu = torch.cuda.is_available()
    header = ("| run | ms/step (median) | vs reference | activation KiB | optimizer state KiB |"
              + (" peak MiB |" if gpu else ""))
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    for name in VARIANTS:
        med = statistics.median(times[name])
        act, opt, _ = mem[name]
        row = f"| {name.strip()} | {med * 1000:.1f} | {med / ref:.2f} | {act / 1024:.0f} | {opt / 1024:.1f} |"
        if gpu:
            row += f" {peaks[name] / 2**20:.0f} |"
        print(row)

    plain = statistics.median(times[plain_name])
    a_plain, o_plain, _ = mem[plain_name]
    n_8bit = mem["  + 8-bit AdamW (lora_lab)"][2]
    checks = [
        ("lora_lab plain is no slower than the reference (ratio <= 1.05)", plain / ref <= 1.05,
         f"{plain / ref:.2f}"),
        ("checkpointing keeps fewer activation bytes", mem["  + gradient checkpointing"][0] < a_plain,
         f"{mem['  + gradient checkpointing'][0] / a_plain:.2f}x"),
        ("8-bit AdamW keeps less optimizer state",
         (mem["  + 8-bit AdamW (lora_lab)"][1] < 0.5 * o_plain) if n_8bit else None,
         f"{mem['  + 8-bit AdamW (lora_lab)'][1] / o_plain:.2f}x, {n_8bit} tensors in 8 bits"
         + ("" if n_8bit else ": every adapter tensor has < 4096 elements, whose moments stay fp32 by design"
            " (a larger --rank quantizes the wider ones)")),
        ("bf16 autocast keeps fewer activation bytes", mem["  + bf16 autocast"][0] < a_plain,
         f"{mem['  + bf16 autocast'][0] / a_plain:.2f}x"),
    ]
    print()
    for what, ok, detail in checks:
        verdict = "n/a    " if ok is None else "MET    " if ok else "NOT MET"
        print(f"target {verdict}  {what}: {detail}")


if __name__ == "__main__":
    main()
