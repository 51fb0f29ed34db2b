"""Tiny configs of the real diffusers classes, real weights from a local folder, prompt encoding.

API (stable; the trainer `diffusion/trainer.py` and the CLI build on it):

    CONFIGS[kind]                      -> {component name: config literal dict} (kinds.KINDS: the kinds)
    build_tokenizer("clip" | "t5")     -> a CLIPTokenizer / T5Tokenizer made offline from `WORDS`
    build_components(kind, seed=0)     -> {name: module} ready for the pipeline class, random init from `seed`
    shipped_base(kind)                 -> Path of the pre-trained tiny base in data/base/<kind>, or None
    denoiser(pipe)                     -> pipe.unet or pipe.transformer (the module a LoRA trains)
    encode_prompts(pipe, prompts)      -> {"prompt_embeds": (B, T, D), "pooled_prompt_embeds": (B, P)?}
                                          (keys are the pipeline's own __call__ keywords, so cached
                                          embeddings go straight back into `pipe(**embeds)`)
    encode_images(pipe, images, generator=None) -> latents (B, C, h, w), already shifted and scaled
    decode_latents(pipe, latents)      -> images in [-1, 1], (B, 3, H, W)
    predict(kind, model, latents, t, embeds, guidance=1.0, vae_scale_factor=2)
                                       -> the denoiser's output (B, C, h, w), one call for every kind
                                          (t: DDPM step index for sd15/sdxl, sigma in [0, 1] for sd3/flux)

What differs between the kinds (classes, text encoders, how each encodes and predicts) is kinds.py's
`ModelKind`; this module reads it. `kind` is a resolved ModelKind (`model_kind(name)` at the caller's
boundary: the CLI, TrainConfig, a notebook), except in the entry points a user types: `build_components`,
`shipped_base` and `predict` (and bases.`build_pipeline`), which also take a name and resolve it once.

The tiny configs keep every structural feature of the real models (SDXL's second text encoder and
text_time add-embedding; SD3's joint attention over CLIP+T5 text; Flux's 2x2 latent packing, rotary position
ids and guidance embedding) at a size that trains on a CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from pathlib import Path

import torch

from . import flux2, qwen_image, z_image
from .chroma import TINY_SCHEDULER as _CHROMA_SCHEDULER
from .chroma import TINY_TRANSFORMER as _CHROMA
from .kinds import ModelKind, ModelLoadError, kind_of, model_kind

# diffusers and transformers are imported where used: ~4 s to import, which `import lora_lab` should not pay.

TEXT_LEN = 16  # tokens per prompt; the tiny CLIP encoders have this many positions
RESOLUTION = 16  # pixels of the tiny models' images (sklearn's 8x8 digits, upscaled 2x); latents are 8x8
DATA_DIR = Path(__file__).resolve().parents[2] / "data"

# The caption vocabulary: every word here is one token for both tokenizers; other words fall back
# to single characters. "inverted" is deliberately here: the base model never sees it in training,
# a LoRA teaches it (see data/make_lora_data.py).
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
WORDS = ("a", "an", "the", "digit", "number", "photo", "of", "image", "picture", "drawing",
         "handwritten", "white", "black", "on", "inverted", "style", "colours", "colors") + DIGIT_NAMES


# Text encoders: CLIP-L-like (hidden 32) and CLIP-G-like (hidden 32, projection 32), T5-like (d_model 64).
_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "max_position_embeddings": TEXT_LEN, "projection_dim": 32, "hidden_act": "quick_gelu"}
_T5 = {"d_model": 64, "d_ff": 128, "d_kv": 16, "num_layers": 2, "num_heads": 4,
       "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32,
       "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0}
# One VAE for every kind: 3 -> 4 channels, 2x down (16x16 images <-> 8x8 latents).
_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [32, 64],
        "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
        "layers_per_block": 1, "norm_num_groups": 32, "sample_size": RESOLUTION,
        "scaling_factor": 1.0, "shift_factor": 0.0}
_UNET = {"sample_size": RESOLUTION // 2, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
         "block_out_channels": [32, 64], "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
         "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "norm_num_groups": 32}
_DDPM = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
         "beta_schedule": "scaled_linear", "prediction_type": "epsilon", "timestep_spacing": "trailing",
         "steps_offset": 1}

CONFIGS: dict[str, dict[str, dict]] = {
    "sd15": {
        "unet": {**_UNET, "cross_attention_dim": 32, "attention_head_dim": 8},
        "vae": _VAE,
        "text_encoder": _CLIP,
        "scheduler": _DDPM,
    },
    "sdxl": {
        # cross_attention_dim = 32 + 32 (both encoders' hidden states side by side);
        # projection_class_embeddings_input_dim = 6 time ids * 8 + 32 (text_encoder_2's pooled projection).
        "unet": {**_UNET, "cross_attention_dim": 64, "attention_head_dim": [2, 4],
                 "use_linear_projection": True, "transformer_layers_per_block": [1, 2],
                 "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
                 "projection_class_embeddings_input_dim": 80},
        "vae": _VAE,
        "text_encoder": _CLIP,
        "text_encoder_2": _CLIP,
        "scheduler": _DDPM,
    },
    "sd3": {
        # joint_attention_dim = T5 d_model (CLIP states, 32 + 32, are zero-padded to it);
        # pooled_projection_dim = 32 + 32 (both CLIP projections).
        "transformer": {"sample_size": RESOLUTION // 2, "patch_size": 2, "in_channels": 4, "out_channels": 4,
                        "num_layers": 2, "attention_head_dim": 8, "num_attention_heads": 4,
                        "caption_projection_dim": 32, "joint_attention_dim": 64, "pooled_projection_dim": 64,
                        "pos_embed_max_size": 16},
        "vae": _VAE,
        "text_encoder": _CLIP,
        "text_encoder_2": _CLIP,
        "text_encoder_3": _T5,
        "scheduler": {"num_train_timesteps": 1000, "shift": 3.0},  # SD3's shifted flow schedule
    },
    "flux": {
        # in_channels = 4 latent channels * 2x2 packing; pooled_projection_dim = CLIP hidden size;
        # joint_attention_dim = T5 d_model; rope axes add up to the head dim (4 + 4 + 8 = 16).
        "transformer": {"patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 1,
                        "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                        "joint_attention_dim": 64, "pooled_projection_dim": 32, "guidance_embeds": True,
                        "axes_dims_rope": [4, 4, 8]},
        "vae": _VAE,
        "text_encoder": _CLIP,
        "text_encoder_2": _T5,
        "scheduler": {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False},
    },
    "chroma": {"transformer": _CHROMA, "vae": _VAE, "text_encoder": _T5, "scheduler": _CHROMA_SCHEDULER},
    # the transformer's 2x2 patches cut inside it (in_channels = latent channels); cap_feat_dim = Qwen3 hidden
    "z-image": {"transformer": z_image.TRANSFORMER, "vae": _VAE, "text_encoder": z_image.TEXT_ENCODER,
                "scheduler": z_image.SCHEDULER},
    "flux2": flux2.CONFIG,  # its Mistral text encoder, its VAE with batch-norm statistics: flux2.py
}
CONFIGS["qwen-image"] = qwen_image.TINY  # models/qwen_image.py


# ----------------------------------------------------------------------------- tokenizers

def _clip_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's byte-level BPE vocabulary, made by hand: 256 byte symbols, each also with the
    end-of-word mark, and one merge chain per word of `WORDS` so each word is a single token."""
    # GPT-2/CLIP byte-level alphabet: printable bytes stand for themselves, the others are moved
    # to code points from 256 up, so every byte is one visible symbol.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = [b for b in range(256) if b not in printable]
    symbols = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(extra))]
    tokens = symbols + [s + "</w>" for s in symbols]
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        left = parts[0]
        for right in parts[1:]:
            merges.append((left, right))
            left = left + right
            tokens.append(left)
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab: dict[str, int] = {}
    for tok in tokens:
        vocab.setdefault(tok, len(vocab))
    return vocab, list(dict.fromkeys(merges))


def build_tokenizer(family: str = "clip"):
    """The tiny tokenizer of a text encoder's arch (`kinds.TextEncoder.arch`) over `WORDS`, built offline: a
    CLIPTokenizer ("clip", "clip_projection"), T5Tokenizer ("t5"), Qwen2 tokenizer ("qwen2_5_vl", "qwen3")
    or FLUX.2's Mistral processor ("mistral3"); the families' modules build the last three."""
    if family in ("clip", "clip_projection"):
        from transformers import CLIPTokenizer

        vocab, merges = _clip_vocab()
        return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=TEXT_LEN)
    if family == "t5":
        from transformers import T5Tokenizer

        # A unigram model: whole words score higher than their letters, so a known word is one piece.
        letters = sorted(set("".join(WORDS)) | set("abcdefghijklmnopqrstuvwxyz0123456789,.-'"))
        pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
        pieces += [("\u2581" + w, -1.0) for w in WORDS] + [(c, -5.0) for c in letters]
        return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=TEXT_LEN)
    if family == "qwen2_5_vl":  # the template's prefix, then 2 TEXT_LEN: the prompt and the template's end
        return qwen_image.build_tokenizer(WORDS, qwen_image.DROPPED + 2 * TEXT_LEN)
    if family == "qwen3":  # Z-Image's: Qwen3's special tokens and chat template
        return z_image.build_tokenizer(WORDS)
    if family == "mistral3":
        return flux2.build_processor(WORDS)
    raise ModelLoadError(f"unknown tokenizer family {family!r}; choose clip, t5, qwen2_5_vl, qwen3, mistral3")


# the text encoders their family's module builds from a config dict and the tiny tokenizer (or processor)
FAMILY_ENCODERS = {"qwen3": z_image.text_model, "qwen2_5_vl": qwen_image.text_encoder,
                   "mistral3": flux2.text_encoder}


def _clip_text_model(cfg: dict, tokenizer, with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **cfg)
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def _t5_model(cfg: dict, tokenizer):
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0, **cfg)
    return T5EncoderModel(config)


# ----------------------------------------------------------------------------- building

def build_components(kind: str | ModelKind, seed: int = 0, only: Collection[str] | None = None) -> dict:
    """The keyword arguments of the kind's pipeline class: tiny modules, randomly initialised from `seed`.

    Every module is built after `torch.manual_seed(seed + i)` for its own fixed i, so one component's
    weights do not depend on which others were built first (`only`: build just these modules; the
    scheduler, tokenizers and extras always come). Modules are in eval mode, fp32, CPU.
    """
    import diffusers

    spec = model_kind(kind)  # a user's name resolved here, once
    cfg = CONFIGS[spec.name]
    clip_tok, t5_tok = build_tokenizer("clip"), build_tokenizer("t5")

    def seeded(i, make):
        torch.manual_seed(seed + i)
        return make().eval()

    def wanted(name: str) -> bool:
        return only is None or name in only

    out: dict = {}
    if wanted("vae"):
        out["vae"] = seeded(1, lambda: getattr(diffusers, spec.vae)(**cfg["vae"]))
    if wanted(spec.component):
        out[spec.component] = seeded(0, lambda: spec.denoiser_class()(**cfg[spec.component]))
    out["scheduler"] = getattr(diffusers, spec.scheduler)(**cfg["scheduler"])
    for i, enc in enumerate(spec.text_encoders):
        if enc.arch in FAMILY_ENCODERS:  # Z-Image's Qwen3, Qwen-Image's Qwen2.5-VL, FLUX.2's Mistral
            tok = build_tokenizer(enc.arch)
            if wanted(enc.component):
                out[enc.component] = seeded(
                    enc.seed, lambda c=cfg[enc.component], t=tok, m=FAMILY_ENCODERS[enc.arch]: m(c, t))
            out[enc.tokenizer] = tok
        elif enc.arch == "t5":
            if wanted(enc.component):
                out[enc.component] = seeded(enc.seed, lambda c=cfg[enc.component]: _t5_model(c, t5_tok))
            out[enc.tokenizer] = t5_tok
        else:
            projection = enc.arch == "clip_projection"
            if wanted(enc.component):
                out[enc.component] = seeded(
                    enc.seed, lambda c=cfg[enc.component], p=projection: _clip_text_model(c, clip_tok, p))
            # the second CLIP tokenizer a copy
            out[enc.tokenizer] = clip_tok if i == 0 else copy.deepcopy(clip_tok)
    out.update(spec.pipeline_extras)
    return out


def pipeline_class(kind: ModelKind):
    """The diffusers pipeline class of a kind."""
    import diffusers

    return getattr(diffusers, kind.pipeline)


def shipped_base(kind: str | ModelKind) -> Path | None:
    """The pre-trained tiny base of a kind shipped in `data/base/<kind>`, or None where none ships."""
    path = DATA_DIR / "base" / model_kind(kind).name
    return path if (path / "model_index.json").is_file() else None


TINY_MAX_RESOLUTION = 8 * RESOLUTION  # 128 pixels: 64 x 64 latents, 64x the tiny models' native tokens


def is_tiny(pipe) -> bool:
    """A pipeline of this project's tiny components (their VAE downsamples 2x; real SD/SDXL/SD3/Flux VAEs
    8x)."""
    return pipe.vae_scale_factor < 8


def default_resolution(pipe) -> int:
    """The base's native image side: the tiny models' RESOLUTION,
    else latent sample size x VAE downsampling."""
    if is_tiny(pipe):
        return RESOLUTION
    return (int(getattr(denoiser(pipe).config, "sample_size", None) or 128)
            * pipe.vae_scale_factor)  # Flux: 1024


def denoiser(pipe) -> torch.nn.Module:
    """The module a LoRA is trained on: the UNet (sd15, sdxl) or the transformer (sd3, flux)."""
    return pipe.unet if hasattr(pipe, "unet") and pipe.unet is not None else pipe.transformer


# ----------------------------------------------------------------------------- encoding

@torch.no_grad()
def encode_prompts(pipe, prompts: list[str] | str) -> dict[str, torch.Tensor]:
    """Text embeddings exactly as the pipeline computes them, keyed by its __call__ keywords.

    sd15: prompt_embeds (B, T, 32). sdxl: prompt_embeds (B, T, 64), pooled_prompt_embeds (B, 32).
    sd3: prompt_embeds (B, 2T, 64) (CLIP then T5 tokens), pooled_prompt_embeds (B, 64).
    flux: prompt_embeds (B, T, 64) (T5), pooled_prompt_embeds (B, 32) (CLIP). fp32, on the CPU.
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    out = kind_of(pipe).encode(pipe, prompts, pipe.device)
    return {k: (v.float() if v.is_floating_point() else v).cpu() for k, v in out.items()}  # masks stay bool


@torch.no_grad()
def encode_images(pipe, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Images in [-1, 1], (B, 3, H, W) -> latents (B, 4, H/2, W/2) (tiny VAE) in the denoiser's units:
    (z - shift_factor) * scaling_factor, z sampled from the VAE posterior with `generator`."""
    vae = pipe.vae
    if kind_of(pipe).to_latents is not None:
        return kind_of(pipe).to_latents(vae, images, generator)
    z = vae.encode(images.to(vae.device, vae.dtype)).latent_dist.sample(generator)
    shift = vae.config.shift_factor or 0.0
    return (z - shift) * vae.config.scaling_factor


@torch.no_grad()
def decode_latents(pipe, latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `encode_images` (up to the VAE's error): latents -> images in [-1, 1]."""
    vae = pipe.vae
    if kind_of(pipe).from_latents is not None:
        return kind_of(pipe).from_latents(vae, latents)
    shift = vae.config.shift_factor or 0.0
    z = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + shift
    return vae.decode(z).sample.clamp(-1, 1)


def predict(kind: str | ModelKind, model: torch.nn.Module, latents: torch.Tensor, t: torch.Tensor,
            embeds: dict[str, torch.Tensor], guidance: float = 1.0,
            vae_scale_factor: int = 2) -> torch.Tensor:
    """One denoiser call for every kind, with the inputs each pipeline gives it; returns (B, C, h, w).

    latents (B, 4, h, w) in `encode_images` units. t (B,): the DDPM step index (sd15, sdxl) or the
    flow-matching sigma in [0, 1] (sd3, flux). embeds: `encode_prompts` output for the batch.
    The output is what the model predicts: epsilon or v (sd15/sdxl), the velocity noise - x0 (sd3/flux).
    sdxl: embeds["time_ids"] (B, 6) if given, else `inputs.sdxl_time_ids` for an image of the latents' size
    times `vae_scale_factor` (2 for the tiny VAE, 8 for real SDXL: `pipe.vae_scale_factor`), as the pipeline
    does.
    """
    dtype = next(model.parameters()).dtype
    x = latents.to(dtype)
    ctx = embeds["prompt_embeds"].to(x.device, dtype)
    return model_kind(kind).predict(model, x, t, ctx, embeds, guidance, vae_scale_factor)
