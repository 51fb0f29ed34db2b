"""Pre-train the tiny bases shipped in data/base/: SDXL-like (DDPM), SD3-like, Chroma-like, Z-Image-like,
Qwen-Image-like and FLUX.2-like (flow matching), on sklearn's digits.

    PYTHONPATH=. python data/make_base.py --kind sdxl           # ~10 minutes on 2 shared CPU cores
    PYTHONPATH=. python data/make_base.py --kind sd3 --resume   # continues from its last saved state
    PYTHONPATH=. python data/make_base.py --kind chroma         # as sd3, with Chroma's transformer and T5
    PYTHONPATH=. python data/make_base.py --kind z-image        # after sdxl: takes its VAE
    PYTHONPATH=. python data/make_base.py --kind sdxl --measure-only   # re-measure a shipped base

What it does, seeded (SEED) and in this order:
1. the first N_TRAIN of sklearn's 1797 digits, upscaled 8x8 -> 16x16, white ink on black, captions
   "a digit three" (the rest are held out: data/make_lora_data.py draws the LoRA set from them);
2. sdxl: trains the AutoencoderKL (MSE + KL_WEIGHT * KL) as a general codec of these images: half of each
   batch is inverted (black ink on white), so the VAE can also encode and decode the style that the
   LoRA in data/lora_inverted teaches (a VAE trained on white-on-black only cannot draw a white
   background: reconstruction MSE 0.86 on inverted digits, measured). The denoiser never sees inversion.
   Then the VAE's scaling_factor is set to 1 / std of the latents of the (normal) training digits.
   sd3, chroma, z-image: take that VAE from data/base/sdxl unchanged (same config for every kind), so the
   bases share one codec and the comparison between them is about the denoiser and its objective only;
3. trains the denoiser and all its text encoders together with the model's own objective on the cached
   latent posteriors: sdxl's UNet with DDPM epsilon; sd3's transformer (SD3_TRANSFORMER: wider and deeper
   than the random tiny sd3 config, still ~2 MB) with rectified flow, logit-normal sigmas shifted by 3;
   chroma's transformer (CHROMA_TRANSFORMER) and T5 with rectified flow and its trainer's own sigmas (the
   kind's `own_flow`: density 2 - 7.7 (s - 1/2)^2, no shift), on its masked T5 embeddings;
   z-image's transformer (ZIMAGE_TRANSFORMER, 4 layers of width 64) and its Qwen3 encoder as sd3's
   (its scheduler's shift, 3).
   10% of captions are dropped to the pipeline's own unconditional input for classifier-free guidance:
   zero embeddings for SDXL, the empty prompt "" for the others (what each pipeline feeds its negative
   branch);
   with --resume the run continues from the state saved every SAVE_EVERY steps in --work;
   flux2 (FLUX2_TRANSFORMER): its own VAE class trained as sdxl's, its batch norm's statistics set from the
   digits' patchified latents; the transformer and its Mistral train (see FLUX2_TRANSFORMER), on the
   posterior's mode, rectified flow with unshifted sigmas and the guidance embedding's values drawn in
   FLUX2_GUIDANCE (guidance-distilled: no unconditional branch to distil from);
   with --init BASE the denoiser and encoders start from a saved base (its VAE kept, not retrained) and train
   --steps more, the learning-rate schedule anew;
4. saves the pipeline with `save_pretrained` (safetensors, tokenizers included) to data/base/<kind>;
5. samples SAMPLE_SEEDS seeds of every digit with classifier-free guidance and writes
   data/base/<kind>_samples.png and data/base/<kind>_metrics.json: the accuracy of a digit classifier
   fitted on the training digits, and its mean probability for the digit asked for, on the samples; the
   strict reader's rate (notebook 07's: read as the digit asked for, 4 of its 5 nearest training digits
   agreeing).

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

from lora_lab.diffusion import diffusion_loss, image_grid, objective_for, sample
from lora_lab.models import build_pipeline, flux2
from lora_lab.models import builders as M
from lora_lab.models.kinds import model_kind, t5_length
from lora_lab.notebook.effect import DigitClassifier, InvertedClassifier, StrictReader, digit_images

SEED = 0
N_TRAIN = 1600        # digits 0..1599 train the base; 1600..1796 are held out
VAE_STEPS = 120       # AutoencoderKL steps (sdxl; sd3 reuses that VAE)
VAE_BATCH = 32
VAE_LR = 2e-3
KL_WEIGHT = 1e-5      # times the summed KL per image
# denoiser + encoders; the shipped flux2, qwen-image and chroma bases then ran `--init` for more (their
# metrics json's `continued_from` lists each run)
STEPS = {"sdxl": 600, "sd3": 1500, "chroma": 2000, "z-image": 1500, "qwen-image": 1500, "flux2": 1500}
BATCH = 64
LR = {"sdxl": 2e-3, "sd3": 1e-3, "chroma": 1e-3, "z-image": 1e-3, "qwen-image": 1e-3, "flux2": 1e-3}
WARMUP = 30
DROP_PROB = 0.1       # caption dropout (unconditional training for classifier-free guidance)
SAVE_EVERY = 100      # steps between saved training states (--resume)
SAMPLE_SEEDS = 10     # samples per digit for the metrics (10 x 10 = 100)
SAMPLE_STEPS = 20
GUIDANCE = 4.0
# The SD3-like base's transformer: patch 1 (each of the 8x8 latent pixels is a token), 4 joint blocks of
# width 64. The random tiny sd3 config (models.CONFIGS) is too small to learn ten digits well.
SD3_TRANSFORMER = {"sample_size": M.RESOLUTION // 2, "patch_size": 1, "in_channels": 4, "out_channels": 4,
                   "num_layers": 4, "attention_head_dim": 16, "num_attention_heads": 4,
                   "caption_projection_dim": 64, "joint_attention_dim": 64, "pooled_projection_dim": 64,
                   "pos_embed_max_size": 16}
# The Z-Image-like base's transformer: models.CONFIGS' tiny one with 4 main layers, 2 refiners of each kind.
ZIMAGE_TRANSFORMER = {**M.CONFIGS["z-image"]["transformer"], "n_layers": 4, "n_refiner_layers": 2}

# The Chroma-like base's transformer: 2 double and 2 single blocks of width 64 (4 heads of 16), its modulation
# approximator 64 wide; the tiny chroma config (models/chroma.py) is the random one the tests use.
CHROMA_TRANSFORMER = {"patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 2,
                      "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 4,
                      "joint_attention_dim": 64, "axes_dims_rope": [4, 4, 8], "approximator_num_channels": 16,
                      "approximator_hidden_dim": 64, "approximator_layers": 2}
TRANSFORMERS = {"sd3": ("SD3Transformer2DModel", SD3_TRANSFORMER),
                "chroma": ("ChromaTransformer2DModel", CHROMA_TRANSFORMER),
                "z-image": ("ZImageTransformer2DModel", ZIMAGE_TRANSFORMER)}

# The Qwen-Image-like base's transformer: the family's 2x2 packing (16 tokens of an 8x8 latent), 4 blocks of
# width 64; its VAE (AutoencoderKLQwenImage, the tiny config) is trained here as the sdxl one is.
QWEN_TRANSFORMER = {**M.CONFIGS["qwen-image"]["transformer"], "num_layers": 4, "num_attention_heads": 4}
FRAMED = ("qwen-image",)  # kinds whose VAE takes (B, C, frames, H, W): one frame
# Qwen-Image's text encoder is causal: the template's closing tokens, which the denoiser reads, see every word
# of a caption, and a base trained on the ten captions alone draws no digit for "a digit three, inverted"
# (strict reader 0.00 against 0.80 without ", inverted", measured). So half its captions end in ", <word>", a
# word of builders.WORDS but "inverted" and the digit names: it learns to read the digit through a trailing
# word, and "inverted" stays unseen (the LoRA teaches it).
# flux2's Mistral is causal too: the same, measured: strict reader 0.86 on "a digit three" against 0.68 on
# "a digit three, inverted" (its first base, without suffixes, 5 seeds). chroma's T5 is bidirectional, so the
# unseen word changes every token's state: its first base read 0.78 with ", inverted" against 0.92 without;
# after `--init` with suffixes (600 steps), 0.94 (notebook 07's 50 samples).
SUFFIX_PROB = {"qwen-image": 0.5, "flux2": 0.5, "chroma": 0.5}
SUFFIXES = [w for w in M.WORDS if w not in ("inverted", *M.DIGIT_NAMES)]

# The Flux.2-like base's transformer: 2 double-stream and 2 single-stream blocks of width 64 (the random tiny
# flux2 config is too small, as sd3's), the tiny Mistral's 3 stacked layers (3 x 16) as its text input.
# FLUX.2 keeps its Mistral frozen, but the real one is pre-trained and the tiny one is random: frozen, its
# embeddings barely tell the digits apart (|e(one) - e(two)| 0.19 against |e(one) - e(one, inverted)| 0.29;
# sd3's trained encoders: 55 against 22). So it trains with the transformer, as a pre-trained encoder would
# have. (That was not why notebook 07's LoRA stopped reading the digit: on this base it still does at 200
# steps, 0.92 -> 0.06, and reads it again with more steps, 0.80 at 2400.)
FLUX2_TRANSFORMER = {**flux2.CONFIG["transformer"], "num_layers": 2, "num_single_layers": 2,
                     "attention_head_dim": 16, "num_attention_heads": 4}
# flux2 is guidance-distilled: no unconditional branch to distil from here, so the guidance embedding is
# trained on values drawn uniformly from this range and learns to ignore them: sampling at any guidance in it
# (the metrics' GUIDANCE, a LoRA run's train_guidance 1.0) is in distribution.
FLUX2_GUIDANCE = (1.0, 5.0)

HERE = Path(__file__).resolve().parent


def captions_for(labels: torch.Tensor, suffix: str = "") -> list[str]:
    return [f"a digit {M.DIGIT_NAMES[int(y)]}{suffix}" for y in labels]


def lr_at(step: int, steps: int, base: float) -> float:
    """Linear warm-up, then cosine decay to 10% of `base`."""
    if step < WARMUP:
        return base * (step + 1) / WARMUP
    p = (step - WARMUP) / max(1, steps - WARMUP)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def build(kind: str):
    """The untrained pipeline: sdxl from the tiny config; qwen-image and flux2 with their transformers
    (QWEN_TRANSFORMER, FLUX2_TRANSFORMER) and their own VAE classes, trained here as sdxl's; the others with
    their TRANSFORMERS entry (SD3_TRANSFORMER, CHROMA_TRANSFORMER, ZIMAGE_TRANSFORMER) and data/base/sdxl's
    VAE."""
    if kind == "sdxl":
        return M.build_pipeline("sdxl", seed=SEED)
    import diffusers

    if kind in ("qwen-image", "flux2"):  # their own VAE classes, trained here (no AutoencoderKL to share)
        parts = M.build_components(kind, seed=SEED)
        torch.manual_seed(SEED)
        cls, cfg = (("QwenImageTransformer2DModel", QWEN_TRANSFORMER) if kind == "qwen-image"
                    else ("Flux2Transformer2DModel", FLUX2_TRANSFORMER))
        parts["transformer"] = getattr(diffusers, cls)(**cfg).eval()
        pipe = M.pipeline_class(model_kind(kind))(**parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    parts = M.build_components(kind, seed=SEED)
    torch.manual_seed(SEED)
    cls, cfg = TRANSFORMERS[kind]
    parts["transformer"] = getattr(diffusers, cls)(**cfg).eval()
    parts["vae"] = diffusers.AutoencoderKL.from_pretrained(HERE / "base" / "sdxl" / "vae",
                                                           local_files_only=True)
    pipe = M.pipeline_class(model_kind(kind))(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def train_vae(pipe, images: torch.Tensor, steps: int, g: torch.Generator, frame: bool = False) -> None:
    """The VAE as a codec of the digits and of their inverted style (`frame`: a 3D VAE, one frame)."""
    vae = pipe.vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, weight_decay=0.0)
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, VAE_LR)
        x = images[torch.randint(0, len(images), (VAE_BATCH,), generator=g)]
        flip = (torch.rand(VAE_BATCH, generator=g) < 0.5).float()[:, None, None, None]
        x = x * (1 - 2 * flip)  # inverted style for about half the batch
        x = x[:, :, None] if frame else x
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(g)).sample
        kl = post.kl()  # summed over each image (a framed VAE's sums leave its last axis)
        loss = diffusion_loss(rec, x) + KL_WEIGHT * kl.reshape(len(kl), -1).sum(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"vae  {step:4d}/{steps} loss {loss.item():.4f}  {time.time() - t0:6.1f}s", flush=True)
    vae.eval()


def trained_modules(pipe, kind: str) -> dict[str, torch.nn.Module]:
    spec = model_kind(kind)  # every kind's text encoders too (flux2: see FLUX2_TRANSFORMER)
    names = [spec.component] + [e.component for e in spec.text_encoders]
    return {n: getattr(pipe, n) for n in names}


def conditioning(pipe, kind: str, captions: list[str], keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """Text embeddings with gradients; a dropped caption (keep = 0) becomes the pipeline's unconditional
    input: zero embeddings for SDXL, the encoded empty prompt for the others."""
    if kind == "sdxl":
        embeds, _, pooled, _ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds * keep[:, None, None], "pooled_prompt_embeds": pooled * keep[:, None]}
    captions = [c if k else "" for c, k in zip(captions, keep.tolist())]
    if kind != "sd3":  # the kind's own encode (sd3's: the pipeline's, every encoder with gradients)
        return model_kind(kind).encode(pipe, captions, "cpu")
    embeds, _, pooled, _ = pipe.encode_prompt(captions, captions, captions, device="cpu",
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=t5_length(pipe))
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def train_denoiser(pipe, kind: str, mean: torch.Tensor, std: torch.Tensor, captions: list[str], steps: int,
                   g: torch.Generator, work: Path, resume: bool) -> list[float]:
    """Denoiser + text encoders with the kind's objective; latents drawn from the cached posteriors.
    The training state is saved to work/state.pt every SAVE_EVERY steps; `resume` continues from it."""
    modules = trained_modules(pipe, kind)
    for m in modules.values():
        m.train().requires_grad_(True)  # a loaded base (--init) comes frozen
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR[kind], weight_decay=1e-2)
    # sdxl: DDPM epsilon (the scheduler's betas); sd3: flow, shift 3; chroma, flux2: their trainers' sigmas,
    # no shift (the kind's own_flow)
    objective = objective_for(pipe, **dict(model_kind(kind).own_flow))
    units = latent_units(pipe, kind)
    losses, start = [], 0
    state_path = work / "state.pt"
    if resume and state_path.is_file():
        state = torch.load(state_path, weights_only=True)  # tensors, numbers and lists: nothing runs
        for n, m in modules.items():
            m.load_state_dict(state["modules"][n])
        opt.load_state_dict(state["optimizer"])
        g.set_state(state["generator"])
        losses, start = state["losses"], state["step"]
        print(f"resumed {kind} at step {start} from {state_path}", flush=True)
    t0 = time.time()
    for step in range(start, steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, LR[kind])
        idx = torch.randint(0, len(mean), (BATCH,), generator=g)
        # (B, 4, 8, 8): sampled from the posterior; flux2: its mode, as diffusers' Flux.2 trainer and pipeline
        z = mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=g)
        x0 = units(mean[idx] if kind == "flux2" else z)
        keep = (torch.rand(BATCH, generator=g) >= DROP_PROB).float()
        batch = [captions[i] for i in idx]
        if kind in SUFFIX_PROB:
            extra = torch.randint(len(SUFFIXES), (BATCH,), generator=g).tolist()
            use = (torch.rand(BATCH, generator=g) < SUFFIX_PROB[kind]).tolist()
            batch = [f"{c}, {SUFFIXES[e]}" if u else c for c, e, u in zip(batch, extra, use)]
        cond = conditioning(pipe, kind, batch, keep)
        noise = torch.randn(x0.shape, generator=g)
        t = objective.sample_timesteps(BATCH, g)
        low, high = FLUX2_GUIDANCE
        guidance = low + (high - low) * torch.rand(BATCH, generator=g) if kind == "flux2" else 1.0
        pred = M.predict(kind, M.denoiser(pipe), objective.noisy(x0, noise, t), t, cond, guidance=guidance)
        loss = diffusion_loss(pred, objective.target(x0, noise, t))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            avg = sum(losses[-25:]) / len(losses[-25:])
            print(f"{kind} {step:4d}/{steps} loss {avg:.4f}  {time.time() - t0:6.1f}s", flush=True)
        if (step + 1) % SAVE_EVERY == 0 and step + 1 < steps:
            work.mkdir(parents=True, exist_ok=True)
            torch.save({"step": step + 1, "modules": {n: m.state_dict() for n, m in modules.items()},
                        "optimizer": opt.state_dict(), "generator": g.get_state(), "losses": losses},
                       work / "state.tmp")
            (work / "state.tmp").replace(state_path)
    for m in modules.values():
        m.eval()
    return losses


def latent_units(pipe, kind: str):
    """VAE latents -> the denoiser's units: times scaling_factor, or (Qwen-Image) per channel
    (z - latents_mean) / latents_std."""
    if kind == "flux2":  # the VAE's batch-norm statistics over 2x2 patches
        return lambda z: flux2.normalize(pipe.vae, z)
    if kind not in FRAMED:
        return lambda z: z * pipe.vae.config.scaling_factor
    cfg = pipe.vae.config
    m, s = (torch.tensor(v).view(1, -1, 1, 1) for v in (cfg.latents_mean, cfg.latents_std))
    return lambda z: (z - m) / s


def measure(pipe, kind: str) -> tuple[dict, torch.Tensor]:
    """Which digit do samples show (classifier fitted on the training digits, checked on the held-out
    ones), how sure is it, and are any of them inverted (they should not be: the base never saw it). The
    strict reader (notebook 07's: every pixel against the training digits) reads them too."""
    images, labels = digit_images(range(N_TRAIN))
    real_x, real_y = digit_images(range(N_TRAIN, 1797))
    digits = DigitClassifier().fit(images, labels)
    strict = StrictReader.fit(indices=range(N_TRAIN))
    inverted = InvertedClassifier().fit(images, digit_images(range(N_TRAIN), inverted=True)[0])
    want = torch.arange(10).repeat(SAMPLE_SEEDS)
    # (10*S, 3, 16, 16) in [0, 1]
    samples = torch.cat([sample(pipe, captions_for(torch.arange(10)), seed=s, steps=SAMPLE_STEPS,
                                guidance=GUIDANCE) for s in range(SAMPLE_SEEDS)])
    samples_pm = samples * 2 - 1
    metrics = {
        "digit_classifier_accuracy_on_heldout_real": digits.accuracy(real_x, real_y),
        "digit_classifier_confidence_on_heldout_real": digits.confidence(real_x, real_y),
        "digit_accuracy_of_samples": digits.accuracy(samples_pm, want),
        "digit_confidence_of_samples": digits.confidence(samples_pm, want),
        "strict_reader_rate_on_heldout_real": strict.rate(real_x, real_y),
        "strict_reader_rate_of_samples": strict.rate(samples_pm, want),
        "inverted_rate_of_samples": inverted.rate(samples_pm),
        "inverted_rate_of_heldout_real": inverted.rate(real_x),
        "samples": f"{SAMPLE_SEEDS} seeds x 10 digits, {SAMPLE_STEPS} Euler steps, guidance {GUIDANCE}",
    }
    return metrics, samples


def write_measurements(out: Path, kind: str, pipe, extra: dict) -> None:
    metrics, samples = measure(pipe, kind)
    metrics.update(extra)
    (out.parent / f"{kind}_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    image_grid(samples, rows=SAMPLE_SEEDS, scale=4).save(out.parent / f"{kind}_samples.png")
    print(json.dumps(metrics, indent=1))


EARLIER_RUN = ("steps", "train_seconds", "note", "continued_from")  # what --init's metrics keep of its base's


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=list(STEPS), default="sdxl")
    ap.add_argument("--out", type=Path, default=None, help="default: data/base/<kind>")
    ap.add_argument("--vae-steps", type=int, default=VAE_STEPS)
    ap.add_argument("--steps", type=int, default=None, help="denoiser steps (default: STEPS[kind])")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    ap.add_argument("--work", type=Path, default=None,
                    help="training state folder (default: /tmp/make_base_<kind>)")
    ap.add_argument("--resume", action="store_true", help="continue from the state saved in --work")
    ap.add_argument("--measure-only", action="store_true", help="re-measure the base in --out; train nothing")
    ap.add_argument("--init", type=Path, default=None,
                    help="a saved base to continue training from (its VAE kept): --steps more denoiser steps")
    return ap.parse_args()


def main() -> None:
    args = arguments()
    kind = args.kind
    out = args.out or HERE / "base" / kind
    steps = args.steps or STEPS[kind]
    work = args.work or Path(f"/tmp/make_base_{kind}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)

    if args.measure_only:
        old = out.parent / f"{kind}_metrics.json"
        kept = {k: v for k, v in json.loads(old.read_text()).items()
                if k in ("vae_reconstruction_mse", "vae_reconstruction_mse_inverted", "vae_scaling_factor",
                         "vae_latents_mean", "vae_latents_std", "continued_from",
                         "final_loss_avg100", "unet_final_loss_avg100", "train_seconds", "steps", "threads",
                         "seed", "note")}
        write_measurements(out, kind, build_pipeline(kind, out), kept)
        return

    t_start = time.time()
    images, labels = digit_images(range(N_TRAIN))  # (N, 3, 16, 16) in [-1, 1]
    captions = captions_for(labels)
    before = {} if args.init is None else json.loads((args.init.parent / f"{kind}_metrics.json").read_text())
    pipe = build(kind) if args.init is None else build_pipeline(kind, args.init)
    frame = kind in FRAMED
    trains_vae = kind in ("sdxl", "flux2", *FRAMED) and args.init is None
    if trains_vae:
        train_vae(pipe, images, args.vae_steps, g, frame)
    with torch.no_grad():
        x, inv = (images[:, :, None], -images[:, :, None]) if frame else (images, -images)
        post = pipe.vae.encode(x).latent_dist
        mean, std = post.mean, post.std  # (N, 4, 8, 8); framed: (N, 4, 1, 8, 8)
        rec_mse = diffusion_loss(pipe.vae.decode(mean).sample, x).item()
        inv_mse = diffusion_loss(pipe.vae.decode(pipe.vae.encode(inv).latent_dist.mean).sample, inv).item()
        mean, std = (mean[:, :, 0], std[:, :, 0]) if frame else (mean, std)
    if kind == "sdxl":
        pipe.vae.register_to_config(scaling_factor=1.0 / mean.std().item())
    if frame:  # the family's per-channel normalisation, measured on the training digits
        pipe.vae.register_to_config(latents_mean=mean.mean((0, 2, 3)).tolist(),
                                    latents_std=mean.std((0, 2, 3)).tolist())
    if kind == "flux2":  # its batch norm's statistics: the training digits' patchified latents, per channel
        patches = flux2.patchify(mean)
        pipe.vae.bn.running_mean.copy_(patches.mean((0, 2, 3)))
        pipe.vae.bn.running_var.copy_(patches.var((0, 2, 3)))
    scaling = pipe.vae.config.latents_std if frame else pipe.vae.config.get("scaling_factor", 1.0)
    shown = f"latents_std {[round(v, 4) for v in scaling]}" if frame else f"scaling_factor {scaling:.4f}"
    print(f"vae reconstruction MSE {rec_mse:.4f} (inverted {inv_mse:.4f}), {shown}", flush=True)

    losses = train_denoiser(pipe, kind, mean, std, captions, steps, g, work, args.resume)

    # Save next to the target, then swap, so a half-written folder never replaces a good one.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    shutil.rmtree(work, ignore_errors=True)
    write_measurements(out, kind, pipe, {
        "vae_reconstruction_mse": rec_mse,
        "vae_reconstruction_mse_inverted": inv_mse,
        **({"vae_latents_mean": pipe.vae.config.latents_mean, "vae_latents_std": scaling} if frame
           else {"vae_scaling_factor": scaling}),
        "final_loss_avg100": sum(losses[-100:]) / len(losses[-100:]),
        "train_seconds": round(time.time() - t_start, 1),
        "steps": {"vae": args.vae_steps if trains_vae else 0, kind: steps},
        **({"continued_from": {k: v for k, v in before.items() if k in EARLIER_RUN}} if args.init else {}),
        "threads": args.threads, "seed": SEED,
    })


if __name__ == "__main__":
    main()
