"""LoRA files: kohya/ComfyUI and PEFT/diffusers safetensors, the key-name maps between them, validation.

    lora_file.py  LoraWeights (one module's tensors on file), LoraFile, their checks   (in memory)
    names.py      pipeline paths <-> kohya names per model family, SDXL's LDM names, Flux's BFL names
    reading.py    load_lora: a file read and checked
    writing.py    save_lora, convert_lora, file_formats: a file written with its metadata (LoKr/LoHa
                  adapters with LyCORIS' keys, through lycoris.py)
    lycoris.py    LoKr/LoHa files: LyCORIS' (ComfyUI's) keys, LycorisWeights
    matching.py   match_modules: which LoRA module adapts which weight of a model

On disk (safetensors only, never pickle):

    kohya / ComfyUI   lora_unet_<path, dots as _>.lora_down.weight  .lora_up.weight  .alpha  .dora_scale
                      (an SDXL UNet's path in the LDM/sgm layout sd-scripts' SDXL UNet has, when its
                      structure is known: lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q,
                      see `UnetLayout`)
                      lora_te_ (SD1.5) / lora_te1_, lora_te2_ (SDXL), lora_te3_ for the text encoders
                      (CLIP always as lora_te*_text_model_..., see `canonical_name`),
                      lora_transformer_ for the SD3 / Flux transformer (OneTrainer's names, read by ComfyUI);
                      diffusion_model.<dotted path> for Z-Image's transformer (ComfyUI's key map for it);
                      read also: kohya's Flux files in BFL's layout
                      (lora_unet_double_blocks_0_img_attn_qkv, ...), whose fused projections split exactly
                      into diffusers' modules by output rows
    PEFT / diffusers  unet.<path>.lora_A.weight  .lora_B.weight  .lora_magnitude_vector (out,)
                      with the alphas in metadata["lora_adapter_metadata"] (JSON, "unet.lora_alpha", ...)
                      as diffusers' `save_lora_weights` writes it: without it diffusers takes alpha = rank.

kohya files always get an `.alpha`: a missing alpha means scale 1 to ComfyUI and diffusers, whatever the rank.
"""

from ..errors import LoraFormatError
from .lora_file import FORMATS, METADATA_KEY, LoraFile, LoraWeights
from .matching import match_modules
from .names import (
    COMPONENTS,
    LDM_LAYERS_PER_BLOCK,
    UNET_LAYOUT_KEY,
    UnetLayout,
    canonical_name,
    diffusers_name,
    kohya_name,
    unet_layout,
)
from .reading import load_lora
from .writing import convert_lora, file_formats, guess_component_and_base, save_lora

__all__ = [
    "COMPONENTS",
    "FORMATS",
    "LDM_LAYERS_PER_BLOCK",
    "METADATA_KEY",
    "UNET_LAYOUT_KEY",
    "LoraFile",
    "LoraFormatError",
    "LoraWeights",
    "UnetLayout",
    "canonical_name",
    "convert_lora",
    "diffusers_name",
    "file_formats",
    "guess_component_and_base",
    "kohya_name",
    "load_lora",
    "match_modules",
    "save_lora",
    "unet_layout",
]
