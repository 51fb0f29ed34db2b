"""Sampling with and without LoRAs, and image grids.

API:
    sample(pipe, prompts, seed=0, steps=20, guidance=4.0, height=None, width=None, loras=())
        -> images (N, 3, H, W) in [0, 1]; one fixed generator per call: the same seed and prompts give
        the same images. loras: [(lora file or LoraFile, strength), ...] applied for this call only.
    loras_applied(pipe, loras)  context manager: LoRA files on the denoiser at run time (lora_lab's
        `apply_loras(..., mode="runtime")`), the original modules put back on exit, even on error.
    image_grid(images, rows, scale=1, pad=1) -> PIL.Image (images in [0, 1], (N, 3, H, W), row-major)
    to_pil(image) -> PIL.Image
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..merge import apply_loras
from ..models import default_resolution, denoiser, encode_prompts
from ..models.kinds import kind_of, model_kind, t5_length
from ..modules import swap_module

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


@torch.no_grad()
def sample(pipe, prompts: list[str] | str, seed: int = 0, steps: int = 20, guidance: float = 4.0,
           height: int | None = None, width: int | None = None, loras: Sequence[tuple] = ()) -> torch.Tensor:
    """Images for `prompts` from the pipeline's own sampler: (N, 3, H, W) in [0, 1], fp32, CPU.

    The prompts are encoded with `encode_prompts` (what training caches), then the pipeline runs with
    `prompt_embeds`. guidance: classifier-free guidance scale (sd15/sdxl/sd3; 1 = off; the unconditional
    input is the pipeline's own: "" encoded for sd15/sd3, zero embeddings for SDXL), or Flux's
    guidance-embedding value (Flux is guidance-distilled: no second pass).
    loras: LoRA files with strengths, applied at run time for this call only (see `loras_applied`).
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    kind = model_kind(kind_of(pipe))
    # 16 for the tiny bases, the model's native size for real ones
    height = height or default_resolution(pipe)
    width = width or default_resolution(pipe)
    embeds = encode_prompts(pipe, prompts)
    embeds = {k: v.to(pipe.device, pipe.dtype) for k, v in embeds.items()}
    kwargs = {"max_sequence_length": t5_length(pipe)} if kind.t5_encoder is not None else {}
    with loras_applied(pipe, loras):
        out = pipe(**embeds, num_inference_steps=steps, guidance_scale=guidance, height=height, width=width,
                   generator=torch.Generator().manual_seed(seed), output_type="pt", **kwargs)
    return out.images.float().cpu().clamp(0, 1)


def to_pil(image: torch.Tensor):
    """(3, H, W) in [0, 1] -> an RGB PIL image."""
    from PIL import Image

    arr = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(arr, "RGB")


def image_grid(images: torch.Tensor, rows: int, scale: int = 1, pad: int = 1):
    """Images (N, 3, H, W) in [0, 1] laid out row-major in `rows` rows, each pixel `scale`x`scale`
    (nearest: tiny images stay sharp), `pad` grey pixels between them; a PIL image."""
    n, c, h, w = images.shape
    cols = -(-n // rows)
    if scale > 1:
        images = images.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
        h, w = h * scale, w * scale
    grid = torch.full((c, rows * (h + pad) + pad, cols * (w + pad) + pad), 0.5)
    for i, img in enumerate(images):
        r, k = divmod(i, cols)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h,
             pad + k * (w + pad): pad + k * (w + pad) + w] = img
    return to_pil(grid)
