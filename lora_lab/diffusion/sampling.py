"""Sampling with and without LoRAs, and image grids.

API:
    prompt_inputs(pipe, prompts) -> the embeddings the sampler takes instead of the text encoders
    sample(pipe, prompts, seed=0, steps=20, guidance=4.0, height=None, width=None, loras=(), inputs=None)
        -> images (N, 3, H, W) in [0, 1]; one fixed generator per call: the same seed and prompts give
        the same images. loras: [(lora file or LoraFile, strength), ...] applied for this call only.
    loras_applied(pipe, loras)  context manager: LoRA files on the denoiser at run time (lora_lab's
        `apply_loras(..., mode="runtime")`), the original modules put back on exit, even on error.
    image_grid(images, rows, scale=1, pad=1) -> PIL.Image (images in [0, 1], (N, 3, H, W), row-major)
    to_pil(image) -> PIL.Image
    sample_grid(pipe, prompts, seed, steps, path)   a PNG: the base's images above,
        with the trained LoRA below
    sample_with_without(model, base, loras, prompts, ...)   `lora-lab sample`: the same with LoRA files
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ..fileio import atomic_write_bytes
from ..lora import lora_disabled
from ..merge import apply_loras
from ..models import build_pipeline, default_resolution, denoiser, encode_prompts, shipped_base
from ..models.kinds import kind_of, t5_length
from ..modules import swap_module
from .distributed import resolve_device
from .encoded import unconditional_embeds

# diffusers and transformers are imported where used: ~4 s to import, which `import lora_lab` should not pay.
# PIL too: Pillow is optional (the diffusion extra).


@contextlib.contextmanager
def loras_applied(pipe, loras: Sequence[tuple] = ()):
    """LoRA files at strengths on the pipeline's denoiser for the duration of the block.

    Each adapted layer is wrapped (runtime mode, so the base weights are never written); on exit every
    wrapper is replaced by the layer it wrapped. Yields the `AppliedLoras` (strengths can change inside).
    """
    if not loras:
        yield None
        return
    model = denoiser(pipe)
    applied = apply_loras(model, list(loras), mode="runtime")
    try:
        yield applied
    finally:
        for key in applied.weights:
            path = key[: -len(".weight")]
            # LoRALinear / LoRAConv2d / LoRAStack .base
            swap_module(model, path, model.get_submodule(path).base)


def prompt_inputs(pipe, prompts: list[str]) -> dict[str, torch.Tensor]:
    """What the pipeline's sampler takes for `prompts` instead of its text encoders: the prompts' embeddings
    (`encode_prompts`) and, for classifier-free guidance, the unconditional input beside each (negative_*: ""
    encoded for sd15/sd3, zero embeddings for SDXL, as the pipeline makes it; Flux has none). (N, ...) each,
    fp32, on the host: encoded once (a training run does it while caching), sampled from without the text
    encoders."""
    embeds = encode_prompts(pipe, prompts)
    if kind_of(pipe).guidance_embedding:  # guidance-distilled: no unconditional branch
        return embeds
    empty = unconditional_embeds(pipe)
    return {**embeds, **{f"negative_{k}": empty[k].expand_as(v) for k, v in embeds.items()}}


@torch.no_grad()
def sample(pipe, prompts: list[str] | str, seed: int = 0, steps: int = 20, guidance: float = 4.0,
           height: int | None = None, width: int | None = None, loras: Sequence[tuple] = (),
           tiled: bool = False, inputs: dict[str, torch.Tensor] | None = None,
           noise_per_prompt: bool = False) -> torch.Tensor:
    """Images for `prompts` from the pipeline's own sampler: (N, 3, H, W) in [0, 1], fp32, CPU.

    The prompts are encoded with `prompt_inputs` (what training caches), then the pipeline runs with
    `prompt_embeds` and its negative counterparts; `inputs` (their `prompt_inputs`, encoded before) skips the
    text encoders, which may then be off the device. guidance: classifier-free guidance scale (sd15/sdxl/sd3;
    1 = off), or Flux's guidance-embedding value (Flux is guidance-distilled: no second pass).
    loras: LoRA files with strengths, applied at run time for this call only (see `loras_applied`).
    The VAE decodes one image at a time (slicing: the same images, less memory), in tiles with `tiled`.
    noise_per_prompt: each prompt starts from the seed's own noise (a generator per prompt), so its image is
    the one a call with that prompt alone makes (up to float rounding of the batch); else one generator draws
    the prompts' noises one after another.
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    kind = kind_of(pipe)
    height = height or default_resolution(pipe)  # 16 for the tiny bases,
                                                 # the model's native size for real ones
    width = width or default_resolution(pipe)
    inputs = prompt_inputs(pipe, prompts) if inputs is None else inputs
    dtype = denoiser(pipe).dtype
    embeds = {k: v.to(pipe.device, dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    kwargs = {"max_sequence_length": t5_length(pipe)} if kind.t5_encoder is not None else {}
    embeds = (kind.pipeline_inputs(embeds, guidance) if kind.pipeline_inputs
              else {**embeds, "guidance_scale": guidance})
    with loras_applied(pipe, loras), vae_decoding(pipe.vae, tiled):
        out = pipe(**embeds, num_inference_steps=steps, height=height, width=width,
                   generator=generators(seed, len(prompts) if noise_per_prompt else None), output_type="pt",
                   **kwargs)
    images = out.images.float().cpu()
    check_finite_images(pipe, images)
    return images.clamp(0, 1)


def check_finite_images(pipe, images: torch.Tensor) -> None:
    """A warning where images hold NaN or Inf (drawn black), naming the VAE decoder's first non-finite weight
    if it has one. A warning, not an error: the adapter trained on latents the encoder made, so the run and
    its LoRA files are right; only the pictures are lost (a broken decoder, or a VAE overflowing in fp16)."""
    bad = int((~torch.isfinite(images)).flatten(1).any(1).sum())
    if not bad:
        return
    weights = (n for n, p in pipe.vae.named_parameters() if not bool(torch.isfinite(p).all()))
    culprit = next(weights, None)
    why = (f"the VAE's {culprit} holds non-finite values" if culprit is not None else
           f"the VAE overflows in {pipe.vae.dtype} (its weights are finite)")
    warnings.warn(f"{bad} of {len(images)} sample image(s) decoded to NaN/Inf and are drawn black: {why}",
                  stacklevel=3)


def generators(seed: int, n: int | None = None) -> torch.Generator | list[torch.Generator]:
    """The sampler's generator from `seed`; with n, n of them (one per prompt, each from `seed`)."""
    if n is None:
        return torch.Generator().manual_seed(seed)
    return [torch.Generator().manual_seed(seed) for _ in range(n)]


@contextlib.contextmanager
def vae_decoding(vae, tiled: bool = False):
    """The VAE decodes image by image (diffusers' slicing), and in tiles when `tiled`, inside the block."""
    vae.enable_slicing()
    if tiled:
        vae.enable_tiling()
    try:
        yield vae
    finally:
        vae.disable_slicing()
        vae.disable_tiling()


def to_pil(image: torch.Tensor):
    """(3, H, W) in [0, 1] -> an RGB PIL image."""
    from PIL import Image

    arr = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(arr, "RGB")


def image_grid(images: torch.Tensor, rows: int, scale: int = 1, pad: int = 1):
    """Images (N, 3, H, W) in [0, 1] laid out row-major in `rows` rows, each pixel `scale`x`scale`
    (nearest: tiny images stay sharp), `pad` grey pixels between them; a PIL image. Each tile is scaled and
    pasted by PIL as 8-bit pixels (no enlarged float copy of the images)."""
    from PIL import Image

    n, _, h, w = images.shape
    cols = -(-n // rows)
    h, w = h * scale, w * scale
    grid = Image.new("RGB", (cols * (w + pad) + pad, rows * (h + pad) + pad), (128, 128, 128))
    for i, img in enumerate(images):
        r, k = divmod(i, cols)
        grid.paste(to_pil(img).resize((w, h), Image.Resampling.NEAREST),
                   (pad + k * (w + pad), pad + r * (h + pad)))
    return grid


# ----------------------------------------------------------------------------- with and without a LoRA


def sample_grid(pipe, prompts: list[str], seed: int, steps: int, path: Path,
                guidance: float | None = None, tiled: bool = False,
                inputs: dict[str, torch.Tensor] | None = None,
                base_inputs: dict[str, torch.Tensor] | None = None,
                without: torch.Tensor | None = None, with_lora: torch.Tensor | None = None) -> Path:
    """A PNG of two rows, one column per prompt: the base model (LoRA disabled) above, with the LoRA below.

    Each image is sampled on its own, from the same seed in both rows, so only the adapter differs; one at a
    time, the sampler's memory does not grow with the number of prompts. inputs: the prompts' `prompt_inputs`
    (then the text encoders need not be on the device); base_inputs: the base row's, where they differ (the
    base text encoders' before a text-encoder LoRA trained; default: `inputs`). without / with_lora: the
    upper / lower row's images where they were made already (a watched run's samples of step 0, where the
    adapter as initialised adds nothing (B = 0; a zero LoKr/LoHa factor; DoRA's magnitude the base's norm),
    and of its last step, made with `noise_per_prompt`: the same noise, so the same images up to float
    rounding).
    """
    inputs = prompt_inputs(pipe, prompts) if inputs is None else inputs
    base_inputs = inputs if base_inputs is None else base_inputs
    kw = {"tiled": tiled} if guidance is None else {"guidance": guidance, "tiled": tiled}

    def one(i: int, given: dict) -> torch.Tensor:
        return sample(pipe, [prompts[i]], seed=seed, steps=steps,
                      inputs={k: v[i: i + 1] for k, v in given.items()}, **kw)

    if without is None:
        with lora_disabled(denoiser(pipe)):
            without = torch.cat([one(i, base_inputs) for i in range(len(prompts))])  # (P, 3, H, W)
    if with_lora is None:
        with_lora = torch.cat([one(i, inputs) for i in range(len(prompts))])
    return _save_pair_grid(without, with_lora, path)


def _save_pair_grid(top: torch.Tensor, bottom: torch.Tensor, path: Path) -> Path:
    """Two rows of images (top above bottom) as one PNG, written atomically."""
    grid = image_grid(torch.cat([top, bottom]), rows=2, scale=max(1, 128 // top.shape[-1]))
    buf = io.BytesIO()
    grid.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())
    return path


def sample_with_without(model: str, base: str | None, loras: list[tuple[Path, float]], prompts: list[str],
                        seed: int = 0, steps: int = 20, guidance: float | None = None, device: str = "auto",
                        path: Path = Path("sample.png")) -> Path:
    """`lora-lab sample`: the base model's images, and the same seed's images with LoRA files applied at
    run time at their strengths (stacked when several), as a two-row grid PNG."""

    pipe = build_pipeline(model, base if base is not None else shipped_base(model))
    pipe.to(resolve_device(device))
    kw = {} if guidance is None else {"guidance": guidance}
    without = sample(pipe, prompts, seed=seed, steps=steps, **kw)
    with_loras = sample(pipe, prompts, seed=seed, steps=steps, loras=[(str(p), s) for p, s in loras], **kw)
    return _save_pair_grid(without, with_loras, path)
