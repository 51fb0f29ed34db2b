"""The model kinds (families) lora_lab trains, one `ModelKind` each: everything that differs between them.

    KINDS                  -> ("sd15", "sdxl", "sd3", "flux", "chroma", "z-image", "qwen-image", "flux2")
    REGISTRY[name]         -> its ModelKind;  COMPONENTS -> every pipeline component a LoRA may adapt
    model_kind(name)       -> its ModelKind (ModelLoadError for a name not in KINDS)
    kind_of(pipe)          -> the ModelKind of a diffusers pipeline, from its class
    t5_length(pipe)        -> T5 tokens per prompt (sd3: min(256, tokenizer), flux: min(512, tokenizer))

A ModelKind holds, as data, what builders.py builds (pipeline, denoiser, scheduler, text encoders),
what the trainer adapts and checkpoints (`component`, `checkpoint_blocks()`), the objective, and
what formats/ writes into and reads from kohya files; and, as two small functions, how its
pipeline encodes prompts and how its denoiser is called. A new family is one entry in `_KINDS`
(and its tiny config in builders.CONFIGS). diffusers is imported only where a class is needed (it is
heavy and optional for the rest of lora_lab).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import LoraLabError
from . import chroma, flux2, qwen_image, z_image
from .inputs import flux_guidance, flux_latent_ids, flux_text_ids, pack_latents, sdxl_time_ids, unpack_latents

# diffusers and transformers are imported where used: ~4 s to import, which `import lora_lab` should not pay.


class ModelLoadError(LoraLabError, ValueError):
    """An unknown model kind, or a base model path that cannot be loaded as that kind."""


# a text encoder's architecture -> its transformers class (Mistral 3: the whole VLM, as FLUX.2 ships it)
ENCODER_CLASSES = {"clip": "CLIPTextModel", "clip_projection": "CLIPTextModelWithProjection",
                   "t5": "T5EncoderModel", "qwen3": "Qwen3Model",
                   "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                   "mistral3": "Mistral3ForConditionalGeneration"}


@dataclass(frozen=True)
class TextEncoder:
    """One text encoder of a pipeline: its component name, architecture, and the seed offset of its tiny
    init."""

    component: str  # "text_encoder" | "text_encoder_2" | "text_encoder_3"
    arch: str  # a key of ENCODER_CLASSES
    seed: int  # models.build_components seeds it with seed + this

    def __post_init__(self):  # a new architecture names its class
        if self.arch not in ENCODER_CLASSES:
            raise ValueError(f"text encoder arch {self.arch!r}: not one of ENCODER_CLASSES")

    @property
    def class_name(self) -> str:
        """Its transformers class."""
        return ENCODER_CLASSES[self.arch]

    @property
    def tokenizer(self) -> str:
        """The pipeline's tokenizer component that goes with it: text_encoder_2 -> tokenizer_2."""
        return "tokenizer" + self.component.removeprefix("text_encoder")


@dataclass(frozen=True)
class ModelKind:
    """One model family. `encode(pipe, prompts, device)` returns the pipeline's own embeddings keyed by its
    __call__ keywords; `predict(model, x, t, ctx, embeds, guidance, vae_scale_factor)` calls the denoiser with
    x and ctx already in its dtype (see models.predict)."""

    name: str
    component: str  # the pipeline component a LoRA trains: "unet" | "transformer"
    pipeline: str  # diffusers pipeline class
    denoiser: str  # diffusers class of `component`
    scheduler: str  # diffusers scheduler class of the tiny pipeline
    text_encoders: tuple[TextEncoder, ...]
    objective: str  # "ddpm" (epsilon / v-prediction) | "flow" (rectified flow matching)
    blocks: tuple[str, ...]  # "module:Class" of the blocks gradient checkpointing recomputes
    encode: Callable[..., dict[str, torch.Tensor]]
    predict: Callable[..., torch.Tensor]
    t5_tokens: int = 0  # the pipeline's default T5 tokens per prompt (0: no T5 encoder)
    latent_packing: int = 1  # latents enter the denoiser packed in n x n patches (Flux: 2)
    addition_embed_type: str | None = None  # the UNet config's value that tells SDXL from SD1.5
    kohya_version: str = ""  # kohya's ss_base_model_version prefix of this family
    # the full ss_base_model_version lora_lab writes, where kohya has one
    kohya_version_written: str | None = None
    ldm_names: bool = False  # kohya's tools name its UNet modules in the LDM/sgm layout (sd-scripts' SDXL)
    pipeline_extras: tuple[tuple[str, object], ...] = ()  # other keywords of the tiny pipeline's constructor
    # the flow knobs the family's own trainer uses where a config leaves them at their defaults (chroma: its
    # timestep density, unshifted); the scheduler's shift is then its sampler's only
    own_flow: tuple[tuple[str, object], ...] = ()
    # (embeds, guidance) -> the pipeline's __call__ keywords, where cached embeddings and guidance differ
    # from them (None: the embeddings as they are, guidance_scale=guidance)
    pipeline_inputs: Callable[..., dict] | None = None
    # kohya/ComfyUI files name the denoiser's modules by this prefix and their dotted diffusers paths, where
    # ComfyUI's key map for the family takes no lora_transformer_ names (Z-Image: "diffusion_model.")
    kohya_dotted: str = ""
    kohya_prefix: str | None = None  # its denoiser's kohya prefix, where not its component's (lora_unet_)
    # denoiser modules ComfyUI's key map knows only by another name, written `lora_unet_` + that name with
    # "_" for ".": (path -> that name or None, the name after `lora_unet_` -> path or None) (FLUX.2: BFL's)
    kohya_renamed: tuple[Callable[[str], str | None], Callable[[str], str | None]] | None = None
    vae: str = "AutoencoderKL"  # diffusers class of the VAE
    # guidance-distilled: a guidance embedding takes the guidance value (`--train-guidance`), sampling makes
    # no unconditional pass (Flux.1-dev, FLUX.2-dev)
    guidance_embedding: bool = False
    # images (B, 3, H, W) <-> the denoiser's latents (B, C, h, w), where the VAE's own units are not
    # (z - shift_factor) * scaling_factor: (vae, images, generator) -> latents, (vae, latents) -> images
    to_latents: Callable[..., torch.Tensor] | None = None
    from_latents: Callable[..., torch.Tensor] | None = None

    def denoiser_class(self):
        import diffusers

        return getattr(diffusers, self.denoiser)

    def checkpoint_blocks(self) -> tuple[type, ...]:
        """The block classes whose activations gradient checkpointing recomputes."""
        return tuple(getattr(importlib.import_module(m), c) for m, c in (b.split(":") for b in self.blocks))

    @property
    def t5_encoder(self) -> TextEncoder | None:
        return next((e for e in self.text_encoders if e.arch == "t5"), None)


# ----------------------------------------------------------------------------- each family's calls


def _encode_sd15(pipe, prompts, device):
    embeds, _ = pipe.encode_prompt(prompts, device, 1, False)
    return {"prompt_embeds": embeds}


def _encode_sdxl(pipe, prompts, device):
    embeds, _, pooled, _ = pipe.encode_prompt(prompts, device=device, do_classifier_free_guidance=False)
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def _encode_sd3(pipe, prompts, device):
    embeds, _, pooled, _ = pipe.encode_prompt(prompts, prompts, prompts, device=device,
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=t5_length(pipe))
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def _encode_flux(pipe, prompts, device):
    embeds, pooled, _ = pipe.encode_prompt(prompts, prompts, device=device,
                                           max_sequence_length=t5_length(pipe))
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def _predict_sd15(model, x, t, ctx, embeds, guidance, vae_scale_factor):
    return model(x, t, encoder_hidden_states=ctx).sample


def _predict_sdxl(model, x, t, ctx, embeds, guidance, vae_scale_factor):
    B, _, h, w = x.shape
    time_ids = embeds.get("time_ids")
    if time_ids is None:
        time_ids = sdxl_time_ids(B, h * vae_scale_factor, w * vae_scale_factor)
    added = {"text_embeds": embeds["pooled_prompt_embeds"].to(x.device, x.dtype),
             "time_ids": time_ids.to(x.device, x.dtype)}
    return model(x, t, encoder_hidden_states=ctx, added_cond_kwargs=added).sample


def _predict_sd3(model, x, t, ctx, embeds, guidance, vae_scale_factor):
    pooled = embeds["pooled_prompt_embeds"].to(x.device, x.dtype)
    # SD3's pipeline passes the sigma scaled to the 0..1000 timestep range.
    return model(hidden_states=x, timestep=t.to(x.dtype) * 1000, encoder_hidden_states=ctx,
                 pooled_projections=pooled).sample


def _predict_flux(model, x, t, ctx, embeds, guidance, vae_scale_factor):
    B, _, h, w = x.shape
    pooled = embeds["pooled_prompt_embeds"].to(x.device, x.dtype)
    out = model(hidden_states=pack_latents(x), timestep=t.to(x.dtype),  # Flux multiplies by 1000 itself
                guidance=(flux_guidance(B, guidance).to(x.device, x.dtype) if model.config.guidance_embeds
                          else None),
                pooled_projections=pooled, encoder_hidden_states=ctx,
                txt_ids=flux_text_ids(ctx.shape[1]).to(x.device, x.dtype),
                img_ids=flux_latent_ids(h, w).to(x.device, x.dtype)).sample
    return unpack_latents(out, h, w)


# ----------------------------------------------------------------------------- the registry

_UNET_BLOCKS = ("diffusers.models.attention:BasicTransformerBlock", "diffusers.models.resnet:ResnetBlock2D")
_NO_SAFETY_CHECKER = (("safety_checker", None), ("feature_extractor", None),
                      ("requires_safety_checker", False))

_KINDS = (
    ModelKind("sd15", "unet", "StableDiffusionPipeline", "UNet2DConditionModel", "EulerDiscreteScheduler",
              (TextEncoder("text_encoder", "clip", 2),), "ddpm", _UNET_BLOCKS, _encode_sd15, _predict_sd15,
              kohya_version="sd_v1", kohya_version_written="sd_v1", pipeline_extras=_NO_SAFETY_CHECKER),
    ModelKind("sdxl", "unet", "StableDiffusionXLPipeline", "UNet2DConditionModel", "EulerDiscreteScheduler",
              (TextEncoder("text_encoder", "clip", 2), TextEncoder("text_encoder_2", "clip_projection", 3)),
              "ddpm", _UNET_BLOCKS, _encode_sdxl, _predict_sdxl, addition_embed_type="text_time",
              kohya_version="sdxl", kohya_version_written="sdxl_base_v1-0", ldm_names=True),
    ModelKind("sd3", "transformer", "StableDiffusion3Pipeline", "SD3Transformer2DModel",
              "FlowMatchEulerDiscreteScheduler",
              (TextEncoder("text_encoder", "clip_projection", 2),
               TextEncoder("text_encoder_2", "clip_projection", 3),
               TextEncoder("text_encoder_3", "t5", 4)),
              "flow", ("diffusers.models.attention:JointTransformerBlock",), _encode_sd3, _predict_sd3,
              t5_tokens=256, kohya_version="sd3"),
    ModelKind("flux", "transformer", "FluxPipeline", "FluxTransformer2DModel",
              "FlowMatchEulerDiscreteScheduler",
              (TextEncoder("text_encoder", "clip", 2), TextEncoder("text_encoder_2", "t5", 4)),
              "flow", ("diffusers.models.transformers.transformer_flux:FluxTransformerBlock",
                       "diffusers.models.transformers.transformer_flux:FluxSingleTransformerBlock"),
              _encode_flux, _predict_flux, t5_tokens=512, latent_packing=2, kohya_version="flux",
              guidance_embedding=True),
    ModelKind("chroma", "transformer", "ChromaPipeline", "ChromaTransformer2DModel",
              "FlowMatchEulerDiscreteScheduler", (TextEncoder("text_encoder", "t5", 4),),
              "flow", ("diffusers.models.transformers.transformer_chroma:ChromaTransformerBlock",
                       "diffusers.models.transformers.transformer_chroma:ChromaSingleTransformerBlock"),
              chroma.encode, chroma.predict, t5_tokens=chroma.T5_TOKENS, latent_packing=2,
              kohya_version="chroma", own_flow=(("sampling", "chroma"), ("shift", 1.0))),
    ModelKind("z-image", "transformer", "ZImagePipeline", "ZImageTransformer2DModel",
              "FlowMatchEulerDiscreteScheduler", (TextEncoder("text_encoder", "qwen3", 2),), "flow",
              ("diffusers.models.transformers.transformer_z_image:ZImageTransformerBlock",),
              z_image.encode, z_image.predict, pipeline_inputs=z_image.pipeline_inputs,
              kohya_version="z_image", kohya_version_written="z_image",  # musubi-tuner's zimage_train
              kohya_dotted="diffusion_model."),
    # the transformer's patch_size 2 is the 2x2 packing (latent_packing 1: not counted twice)
    ModelKind("qwen-image", "transformer", "QwenImagePipeline", "QwenImageTransformer2DModel",
              "FlowMatchEulerDiscreteScheduler", (TextEncoder("text_encoder", "qwen2_5_vl", 2),), "flow",
              ("diffusers.models.transformers.transformer_qwenimage:QwenImageTransformerBlock",),
              qwen_image.encode, qwen_image.predict, kohya_version="qwen_image", vae="AutoencoderKLQwenImage",
              to_latents=qwen_image.to_latents, from_latents=qwen_image.from_latents,
              pipeline_inputs=qwen_image.pipeline_inputs, kohya_prefix="lora_unet_"),
    ModelKind("flux2", "transformer", "Flux2Pipeline", "Flux2Transformer2DModel",
              "FlowMatchEulerDiscreteScheduler", (TextEncoder("text_encoder", "mistral3", 2),),
              "flow", ("diffusers.models.transformers.transformer_flux2:Flux2TransformerBlock",
                       "diffusers.models.transformers.transformer_flux2:Flux2SingleTransformerBlock"),
              flux2.encode, flux2.predict, latent_packing=2, kohya_version="flux2",
              vae="AutoencoderKLFlux2", to_latents=flux2.to_latents, from_latents=flux2.from_latents,
              guidance_embedding=True, kohya_renamed=(flux2.bfl_name, flux2.from_bfl_kohya),
              own_flow=(("shift", 1.0),)),  # diffusers' Flux.2 trainer: its scheduler's unshifted sigmas
)
REGISTRY: dict[str, ModelKind] = {k.name: k for k in _KINDS}
KINDS = tuple(REGISTRY)
# every pipeline component a LoRA may adapt: the denoisers, then the text encoders
COMPONENTS = tuple(dict.fromkeys([k.component for k in _KINDS]
                                 + [e.component for k in _KINDS for e in k.text_encoders]))


def model_kind(name: str | ModelKind) -> ModelKind:
    """The ModelKind called `name` (a ModelKind is returned as it is); ModelLoadError naming the known ones
    otherwise."""
    if isinstance(name, ModelKind):
        return name
    if name not in REGISTRY:
        raise ModelLoadError(f"unknown model kind {name!r}; choose one of {', '.join(KINDS)}")
    return REGISTRY[name]


def kind_of(pipe) -> ModelKind:
    """The kind of a pipeline object, from its class."""
    import diffusers

    for kind in _KINDS:
        if isinstance(pipe, getattr(diffusers, kind.pipeline)):
            return kind
    raise ModelLoadError(f"not a pipeline lora_lab knows: {type(pipe).__name__}")


def t5_length(pipe) -> int:
    """T5 tokens per prompt for sd3/flux: the pipeline's default (256 / 512) capped by its tokenizer's
    length (TEXT_LEN for the tiny tokenizer), so tiny and real pipelines both get their own."""
    kind = kind_of(pipe)
    if kind.t5_encoder is None:
        raise ModelLoadError(f"a {kind.name} pipeline has no T5 text encoder")
    return min(kind.t5_tokens, getattr(pipe, kind.t5_encoder.tokenizer).model_max_length)
