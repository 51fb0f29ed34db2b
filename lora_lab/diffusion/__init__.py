"""LoRA training for diffusers models: model builders, objectives, image+caption data, sampling.

    from lora_lab.diffusion import build_pipeline, encode_prompts, objective_for, predict
"""

from .models import (
    KINDS,
    ModelLoadError,
    build_components,
    build_pipeline,
    build_tokenizer,
    decode_latents,
    denoiser,
    encode_images,
    encode_prompts,
    kind_of,
    predict,
    shipped_base,
)
from .objectives import DDPM, FlowMatching, ObjectiveError, diffusion_loss, objective_for

__all__ = [
    "DDPM",
    "KINDS",
    "FlowMatching",
    "ModelLoadError",
    "ObjectiveError",
    "build_components",
    "build_pipeline",
    "build_tokenizer",
    "decode_latents",
    "denoiser",
    "diffusion_loss",
    "encode_images",
    "encode_prompts",
    "kind_of",
    "objective_for",
    "predict",
    "shipped_base",
]
