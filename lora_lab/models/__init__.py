"""The model kinds lora_lab trains (kinds.KINDS: sd15, sdxl, sd3, flux, chroma, z-image) and how to build
them: low in the house, so that LoRA files (formats/), the trainer and the planner all depend on it and it
depends on none of them.

    kinds.py     ModelKind per kind: classes, text encoders, objective, blocks to checkpoint, how it encodes
                 and predicts; KINDS, model_kind(name), kind_of(pipe)
    inputs.py    what the denoisers take besides latents: Flux's packing and ids, guidance, SDXL's time ids
    builders.py  tiny configs of the real diffusers classes, offline tokenizers, denoiser, encode_prompts /
                 encode_images / decode_latents, predict
    loading.py   a denoiser built without memory and filled module by module from its weights, in the base
                 dtype, quantized as it loads
    bases.py     where a base comes from (tiny, a folder, real:NAME), opened for training; build_pipeline
    real.py      the real models' configs as data (REAL_MODELS), build_real
    qwen_image.py  Qwen-Image's own parts: tiny configs, tokenizer, prompt encoding, predict, latents
    flux2.py     FLUX.2 [dev] (kind flux2): its tiny configs, tokenizer, encode, predict, latents, names

diffusers and transformers are imported where a class is needed (they take seconds to import).
"""

from .bases import build_pipeline, open_base
from .builders import (
    DATA_DIR,
    DIGIT_NAMES,
    RESOLUTION,
    TEXT_LEN,
    TINY_MAX_RESOLUTION,
    build_components,
    build_tokenizer,
    decode_latents,
    default_resolution,
    denoiser,
    encode_images,
    encode_prompts,
    is_tiny,
    predict,
    shipped_base,
)
from .kinds import COMPONENTS, KINDS, ModelKind, ModelLoadError, kind_of, model_kind
from .real import REAL_CONFIGS, REAL_MODELS, build_real, real_kind

__all__ = [
    "COMPONENTS", "DATA_DIR", "DIGIT_NAMES", "KINDS", "REAL_CONFIGS", "REAL_MODELS", "RESOLUTION", "TEXT_LEN",
    "TINY_MAX_RESOLUTION", "ModelKind", "ModelLoadError", "build_components", "build_pipeline", "open_base",
    "build_real", "build_tokenizer", "decode_latents", "default_resolution", "denoiser", "encode_images",
    "encode_prompts", "is_tiny", "kind_of", "model_kind", "predict", "real_kind", "shipped_base",
]
