"""LoRA training for diffusers models: model builders, objectives, image+caption data, sampling.

    from lora_lab.diffusion import build_pipeline, encode_prompts, objective_for, predict
    from lora_lab.diffusion import TrainConfig, train
"""

from .data import BucketBatchSampler, DatasetError, ImageCaptionDataset, aspect_buckets, collate
from .kinds import KINDS, ModelLoadError, kind_of
from .models import (
    build_components,
    build_pipeline,
    build_tokenizer,
    decode_latents,
    denoiser,
    encode_images,
    encode_prompts,
    predict,
    shipped_base,
)
from .objectives import DDPM, FlowMatching, ObjectiveError, diffusion_loss, objective_for
from .sampling import image_grid, loras_applied, sample
from .train import TrainConfig, TrainConfigError, TrainResult, train

__all__ = [
    "DDPM",
    "KINDS",
    "BucketBatchSampler",
    "DatasetError",
    "FlowMatching",
    "ImageCaptionDataset",
    "ModelLoadError",
    "ObjectiveError",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "aspect_buckets",
    "build_components",
    "build_pipeline",
    "build_tokenizer",
    "collate",
    "decode_latents",
    "denoiser",
    "diffusion_loss",
    "encode_images",
    "encode_prompts",
    "image_grid",
    "kind_of",
    "loras_applied",
    "objective_for",
    "predict",
    "sample",
    "shipped_base",
    "train",
]
