"""Pre-train the tiny SDXL-like base pipeline shipped in data/base/sdxl, on scikit-learn's digits.

    PYTHONPATH=. python data/make_base.py            # ~10 minutes on 2 shared CPU cores

What it does, seeded (SEED) and in this order:
1. the first N_TRAIN of sklearn's 1797 digits, upscaled 8x8 -> 16x16, white ink on black, captions
   "a digit three" (the rest are held out: data/make_lora_data.py draws the LoRA set from them);
2. trains the AutoencoderKL (MSE + KL_WEIGHT * KL) as a general codec of these images: half of each
   batch is inverted (black ink on white), so the VAE can also encode and decode the style that the
   LoRA in data/lora_inverted teaches (a VAE trained on white-on-black only cannot draw a white
   background: reconstruction MSE 0.86 on inverted digits, measured). The UNet never sees inversion.
   Then the VAE's scaling_factor is set to 1 / std of the latents of the (normal) training digits;
3. trains the UNet (SDXL-like, text_time conditioning) and both CLIP text encoders together with the
   DDPM epsilon objective on the cached latent posteriors, dropping 10% of captions to zero
   embeddings (what StableDiffusionXLPipeline uses as the unconditional input);
4. saves the pipeline with `save_pretrained` (safetensors, tokenizers included) to data/base/sdxl;
5. samples every digit with classifier-free guidance and writes data/base/sdxl_samples.png and
   data/base/sdxl_metrics.json: the accuracy of a digit classifier fitted on real digits, on samples.

The result depends on the seed and on the CPU's float summation order (thread count), so a re-run on
another machine gives a model of the same quality, not the same bits.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch

from lora_lab.diffusion import models as M
from lora_lab.diffusion.effect import DigitClassifier, InvertedClassifier, digit_images
from lora_lab.diffusion.objectives import DDPM, diffusion_loss
from lora_lab.diffusion.sampling import image_grid, sample

SEED = 0
N_TRAIN = 1600        # digits 0..1599 train the base; 1600..1796 are held out
VAE_STEPS = 120       # AutoencoderKL steps
VAE_BATCH = 32
VAE_LR = 2e-3
KL_WEIGHT = 1e-5      # times the summed KL per image
UNET_STEPS = 600      # UNet + text encoder steps
UNET_BATCH = 64
UNET_LR = 2e-3
WARMUP = 30
DROP_PROB = 0.1       # caption dropout (unconditional training for classifier-free guidance)
SAMPLE_SEEDS = 5      # samples per digit for the metrics
SAMPLE_STEPS = 20
GUIDANCE = 4.0

HERE = Path(__file__).resolve().parent


def captions_for(labels: torch.Tensor, suffix: str = "") -> list[str]:
    return [f"a digit {M.DIGIT_NAMES[int(y)]}{suffix}" for y in labels]


def lr_at(step: int, steps: int, base: float) -> float:
    """Linear warm-up, then cosine decay to 10% of `base`."""
    if step < WARMUP:
        return base * (step + 1) / WARMUP
    p = (step - WARMUP) / max(1, steps - WARMUP)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train_vae(pipe, images: torch.Tensor, steps: int, g: torch.Generator) -> None:
    vae = pipe.vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, weight_decay=0.0)
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, VAE_LR)
        x = images[torch.randint(0, len(images), (VAE_BATCH,), generator=g)]
        flip = (torch.rand(VAE_BATCH, generator=g) < 0.5).float()[:, None, None, None]
        x = x * (1 - 2 * flip)  # inverted style for about half the batch
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(g)).sample
        loss = diffusion_loss(rec, x) + KL_WEIGHT * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"vae  {step:4d}/{steps} loss {loss.item():.4f}  {time.time() - t0:6.1f}s", flush=True)
    vae.eval()


def train_unet(pipe, mean: torch.Tensor, std: torch.Tensor, captions: list[str], steps: int,
               g: torch.Generator) -> list[float]:
    """UNet + both text encoders, epsilon objective; latents drawn from the cached posteriors."""
    unet, te1, te2 = pipe.unet.train(), pipe.text_encoder.train(), pipe.text_encoder_2.train()
    params = [*unet.parameters(), *te1.parameters(), *te2.parameters()]
    opt = torch.optim.AdamW(params, lr=UNET_LR, weight_decay=1e-2)
    ddpm = M.CONFIGS["sdxl"]["scheduler"]
    objective = DDPM(prediction_type=ddpm["prediction_type"], beta_start=ddpm["beta_start"],
                     beta_end=ddpm["beta_end"])
    sf = pipe.vae.config.scaling_factor
    losses = []
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, UNET_LR)
        idx = torch.randint(0, len(mean), (UNET_BATCH,), generator=g)
        x0 = (mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=g)) * sf  # (B, 4, 8, 8)
        embeds, _, pooled, _ = pipe.encode_prompt([captions[i] for i in idx], device="cpu",
                                                  do_classifier_free_guidance=False)
        keep = (torch.rand(UNET_BATCH, generator=g) >= DROP_PROB).float()
        cond = {"prompt_embeds": embeds * keep[:, None, None], "pooled_prompt_embeds": pooled * keep[:, None]}
        noise = torch.randn(x0.shape, generator=g)
        t = objective.sample_timesteps(UNET_BATCH, g)
        pred = M.predict("sdxl", unet, objective.noisy(x0, noise, t), t, cond)
        loss = diffusion_loss(pred, objective.target(x0, noise, t))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            avg = sum(losses[-25:]) / len(losses[-25:])
            print(f"unet {step:4d}/{steps} loss {avg:.4f}  {time.time() - t0:6.1f}s", flush=True)
    for m in (unet, te1, te2):
        m.eval()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "base" / "sdxl")
    ap.add_argument("--vae-steps", type=int, default=VAE_STEPS)
    ap.add_argument("--unet-steps", type=int, default=UNET_STEPS)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    t_start = time.time()

    images, labels = digit_images(range(N_TRAIN))  # (N, 3, 16, 16) in [-1, 1]
    captions = captions_for(labels)
    pipe = M.build_pipeline("sdxl", seed=SEED)

    train_vae(pipe, images, args.vae_steps, g)
    with torch.no_grad():
        post = pipe.vae.encode(images).latent_dist
        mean, std = post.mean, post.std  # (N, 4, 8, 8)
        rec_mse = diffusion_loss(pipe.vae.decode(mean).sample, images).item()
        inv_mse = diffusion_loss(pipe.vae.decode(pipe.vae.encode(-images).latent_dist.mean).sample, -images).item()
    scaling = 1.0 / mean.std().item()
    pipe.vae.register_to_config(scaling_factor=scaling)
    print(f"vae reconstruction MSE {rec_mse:.4f} (inverted {inv_mse:.4f}), scaling_factor {scaling:.4f}", flush=True)

    losses = train_unet(pipe, mean, std, captions, args.unet_steps, g)

    # Save next to the target, then swap, so a half-written folder never replaces a good one.
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    train_seconds = time.time() - t_start

    # Measure: which digit do samples show (classifier fitted on the training digits, checked on the
    # held-out ones), and are any of them inverted (they should not be: the base never saw it).
    held = range(N_TRAIN, 1797)
    digits = DigitClassifier().fit(images, labels)
    inverted = InvertedClassifier().fit(images, digit_images(range(N_TRAIN), inverted=True)[0])
    real_x, real_y = digit_images(held)
    want = torch.arange(10).repeat(SAMPLE_SEEDS)
    samples = torch.cat([sample(pipe, captions_for(torch.arange(10)), seed=s, steps=SAMPLE_STEPS,
                                guidance=GUIDANCE) for s in range(SAMPLE_SEEDS)])  # (10*S, 3, 16, 16) in [0, 1]
    samples_pm = samples * 2 - 1
    metrics = {
        "vae_reconstruction_mse": rec_mse,
        "vae_reconstruction_mse_inverted": inv_mse,
        "vae_scaling_factor": scaling,
        "unet_final_loss_avg100": sum(losses[-100:]) / len(losses[-100:]),
        "digit_classifier_accuracy_on_heldout_real": digits.accuracy(real_x, real_y),
        "digit_accuracy_of_samples": digits.accuracy(samples_pm, want),
        "inverted_rate_of_samples": inverted.rate(samples_pm),
        "inverted_rate_of_heldout_real": inverted.rate(real_x),
        "samples": f"{SAMPLE_SEEDS} seeds x 10 digits, {SAMPLE_STEPS} Euler steps, guidance {GUIDANCE}",
        "train_seconds": round(train_seconds, 1),
        "steps": {"vae": args.vae_steps, "unet": args.unet_steps}, "threads": args.threads, "seed": SEED,
    }
    (args.out.parent / "sdxl_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    image_grid(samples, rows=SAMPLE_SEEDS, scale=4).save(args.out.parent / "sdxl_samples.png")
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
