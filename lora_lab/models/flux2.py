"""FLUX.2 [dev] (kind "flux2"): what differs from the other kinds, read from diffusers' Flux2Pipeline.

    CONFIG                              -> the tiny components' config literals (builders.CONFIGS["flux2"])
    build_processor(words, length)      -> the pipeline's tokenizer: a tiny byte-level BPE, chat template
    text_encoder(cfg, tokenizer)        -> Mistral3ForConditionalGeneration from a {"text_config", ...} dict
    encode(pipe, prompts, device)       -> {"prompt_embeds": (B, T, 3 D)} through the pipeline's encode_prompt
    predict(model, x, t, ctx, ...)      -> the transformer's velocity (B, C, h, w)
    normalize(vae, z) / denormalize     -> the VAE's latents <-> the denoiser's units (batch-norm statistics)

The pipeline (diffusers 0.42 pipelines/flux2/pipeline_flux2.py):
- Text: one encoder, Mistral Small 3.x (Mistral3ForConditionalGeneration, its Pixtral vision tower unused for
  text-to-image). Each prompt is a chat (`format_input`: the system message SYSTEM_MESSAGE, then the user's
  text), rendered by the processor's chat template, padded and truncated to `max_sequence_length` (512), and
  the hidden states of layers 10, 20 and 30 are stacked per token: prompt_embeds (B, T, 3 x 5120 = 15360).
  No pooled embedding. Text position ids (0, 0, 0, token).
- Latents: the VAE (AutoencoderKLFlux2, 32 channels, 8x down) gives z (B, 32, H/8, W/8); the pipeline
  patchifies each 2x2 patch into channels (B, 128, H/16, W/16), normalises them by the VAE's batch-norm
  running mean and variance (`vae.bn`, eps `batch_norm_eps`), and packs them into tokens (B, HW/256, 128),
  image ids (0, row, column, 0). lora_lab keeps latents as (B, 32, H/8, W/8), normalised patch-wise
  (`normalize`): the pipeline's patchify-then-pack equals Flux.1's `pack_latents` (channel order (C, 2, 2)),
  so noise drawn in this layout is the pipeline's Gaussian, reordered; `predict` packs it.
- Guidance: FLUX.2 [dev] is guidance-distilled (transformer config guidance_embeds=True): the guidance value
  enters an embedding (x1000, like the timestep), no unconditional pass, no negative prompt in __call__.
- Objective: rectified flow, target noise - x0, the transformer given sigma (it multiplies by 1000), as
  diffusers' examples/dreambooth/train_dreambooth_lora_flux2.py trains it; that script encodes images with the
  posterior's mode (`latent_dist.mode()`), as `encode_images` does here.

The tiny tokenizer: a byte-level BPE (the `tokenizers` library, like Mistral's Tekken) with Tekken's special
tokens at their ids (<unk> 0, <s> 1, </s> 2, [INST] 3, [/INST] 4, [IMG] 10, <pad> 11, [IMG_BREAK] 12,
[IMG_END] 13, [SYSTEM_PROMPT] 17, [/SYSTEM_PROMPT] 18), one token for each of builders.WORDS and each word of
the system message (bare and after a space), bytes for anything else; its chat template renders the system
and user turns as Mistral Small 3.1's does (<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST], an image
block as [IMG]), without its default system message and date, which the pipeline never uses (it always sends
its own). The system message is ~30 tokens here, so the tiny pipeline encodes `TINY_TOKENS` (64) per prompt.
The real pipeline's `tokenizer` is a PixtralProcessor (tokenizer + image processor); the tiny one is the
tokenizer alone (PixtralProcessor needs torchvision, which lora_lab does not install): encode_prompt calls
only `apply_chat_template`, which both take with the same arguments; only prompt upsampling with images (the
processor's image half) does not apply.
"""

from __future__ import annotations

import re

import torch

from .inputs import pack_latents, unpack_latents

# diffusers, transformers and tokenizers are imported where used (heavy).

TINY_TOKENS = 64  # tokens per prompt of the tiny processor: the system message (~30) and a caption fit
PIPELINE_TOKENS = 512  # Flux2Pipeline.encode_prompt's default max_sequence_length
HIDDEN_LAYERS = (10, 20, 30)  # the pipeline's text_encoder_out_layers: stacked per token

# Tekken's first special tokens at their ids (mistralai/Mistral-Small-3.1-24B-Instruct-2503 tokenizer.json).
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                  "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")

# Mistral Small 3.1's chat template for the turns the pipeline sends (system, user: text or image blocks).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set blocks = [{'type': 'text', 'text': message['content']}] if message['content'] is string"
    " else message['content'] %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' }}{%- endif %}"
    "{%- for block in blocks %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- elif block['type'] in ['image', 'image_url'] %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if message['role'] == 'system' %}{{- '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[/INST]' }}"
    "{%- else %}{{- eos_token }}{%- endif %}"
    "{%- endfor %}"
)

# black-forest-labs/FLUX.2-dev scheduler/scheduler_config.json (FlowMatchEulerDiscreteScheduler)
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}

# The tiny components. Transformer: 1 double-stream + 2 single-stream blocks; in_channels = 4 latent channels
# x 2x2 patch; joint_attention_dim = 3 stacked layers x the text hidden size 16; 4 rope axes (T, H, W, L)
# adding up to the head dim 16. Text encoder: Mistral with 32 layers, so the stacked layers 10, 20, 30 are
# intermediate as in the real 40-layer one; grouped-query attention (2 heads, 1 KV head); a 1-layer Pixtral
# vision tower.
CONFIG: dict[str, dict] = {
    "transformer": {"patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 1,
                    "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                    "joint_attention_dim": 48, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
                    "axes_dims_rope": [4, 4, 4, 4], "rope_theta": 2000, "guidance_embeds": True},
    "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [32, 64],
            "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
            "layers_per_block": 1, "norm_num_groups": 32, "sample_size": 16, "batch_norm_eps": 1e-4,
            "patch_size": [2, 2]},
    "text_encoder": {
        "text_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 32,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                        "max_position_embeddings": TINY_TOKENS, "rope_theta": 1e9, "rms_norm_eps": 1e-5},
        "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "head_dim": 8, "patch_size": 4, "image_size": 16},
        "spatial_merge_size": 2, "projector_hidden_act": "gelu", "multimodal_projector_bias": False},
    # FLUX.2-dev's: sampling shifts by the pipeline's empirical mu (compute_empirical_mu); training draws
    # the scheduler's unshifted sigmas (diffusers' trainer; diffusion/step.training_objective)
    "scheduler": SCHEDULER,
}


# ----------------------------------------------------------------------------- the processor


def _words(words: tuple[str, ...]) -> list[str]:
    """The words the tiny BPE makes single tokens: `words`, and those of the pipeline's system message."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return list(dict.fromkeys([*words, *re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE)]))


def build_processor(words: tuple[str, ...], length: int = TINY_TOKENS):
    """The pipeline's `tokenizer` component: a tiny byte-level BPE tokenizer, offline, with Mistral's chat
    template: `words` and the system message's words one token each, `length` tokens per prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # trained on the words alone and after a space: BPE replays its merges in order, so each is one token
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([p + w for w in _words(words) for p in ("", " ")], trainers.BpeTrainer(
        vocab_size=100_000, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=length, chat_template=CHAT_TEMPLATE)


def text_encoder(cfg: dict, tokenizer=None) -> torch.nn.Module:
    """Mistral3ForConditionalGeneration from a config dict ({"text_config": ..., "vision_config": ..., the
    rest Mistral3Config's}); the vocabulary and special ids from `tokenizer` (a processor or its tokenizer)
    where the config does not give them (the real one does: models/real.py)."""
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    tok = getattr(tokenizer, "tokenizer", tokenizer)
    ids = {} if tok is None else {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id,
                                  "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                                  "image_token_index": tok.convert_tokens_to_ids("[IMG]")}
    image = {"image_token_index": ids.pop("image_token_index")} if ids else {}
    rest = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    config = Mistral3Config(text_config=MistralConfig(**{**ids, **cfg["text_config"]}),
                            vision_config=PixtralVisionConfig(**cfg["vision_config"]), **{**image, **rest})
    return Mistral3ForConditionalGeneration(config).eval()


def sequence_length(pipe) -> int:
    """Tokens per prompt: the pipeline's default (512) capped by its tokenizer's length (64 for the tiny)."""
    tokenizer = getattr(pipe.tokenizer, "tokenizer", pipe.tokenizer)  # the real one is a PixtralProcessor
    return min(PIPELINE_TOKENS, tokenizer.model_max_length)


# ----------------------------------------------------------------------------- the kind's calls


def encode(pipe, prompts: list[str], device) -> dict[str, torch.Tensor]:
    """The pipeline's own encode_prompt: (B, T, 3 D) stacked hidden states; no pooled embedding."""
    embeds, _ = pipe.encode_prompt(prompts, device=device, max_sequence_length=sequence_length(pipe))
    return {"prompt_embeds": embeds}


def latent_ids(batch: int, h: int, w: int) -> torch.Tensor:
    """Image tokens' rotary ids as the pipeline makes them, (B, (h/2)(w/2), 4): (0, row, column, 0)."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(h // 2), torch.arange(w // 2), torch.arange(1))
    return ids.unsqueeze(0).expand(batch, -1, -1)


def text_ids(batch: int, tokens: int) -> torch.Tensor:
    """Text tokens' rotary ids, (B, T, 4): (0, 0, 0, token)."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(tokens))
    return ids.unsqueeze(0).expand(batch, -1, -1)


def predict(model, x, t, ctx, embeds, guidance, vae_scale_factor):
    """The transformer on packed latents (2x2 patches), sigma as its timestep (it multiplies by 1000), the
    guidance embedding's value (a number, or one per example) where the model has one."""
    B, _, h, w = x.shape
    out = model(hidden_states=pack_latents(x), timestep=t.to(x.dtype),
                guidance=(torch.as_tensor(guidance, device=x.device, dtype=x.dtype).expand(B)
                          if model.config.guidance_embeds else None),
                encoder_hidden_states=ctx, txt_ids=text_ids(B, ctx.shape[1]).to(x.device),
                img_ids=latent_ids(B, h, w).to(x.device)).sample
    return unpack_latents(out, h, w)


def _statistics(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch norm's mean and standard deviation per patchified channel, (1, 4C, 1, 1)."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return mean.to(like.device, like.dtype), std.to(like.device, like.dtype)


def patchify(z: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2), channels (C, 2, 2): the pipeline's `_patchify_latents`."""
    B, C, h, w = z.shape
    return z.view(B, C, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(B, C * 4, h // 2, w // 2)


def unpatchify(p: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify`."""
    B, C4, h, w = p.shape
    return p.view(B, C4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(B, C4 // 4, h * 2, w * 2)


def normalize(vae, z: torch.Tensor) -> torch.Tensor:
    """The VAE's latents (B, C, h, w) -> the denoiser's units, same layout: each 2x2-patch channel less the
    batch norm's running mean, over its standard deviation, as the pipeline does to its patchified latents."""
    mean, std = _statistics(vae, z)
    return unpatchify((patchify(z) - mean) / std)


def denormalize(vae, latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `normalize`: the denoiser's units -> the VAE decoder's latents."""
    mean, std = _statistics(vae, latents)
    return unpatchify(patchify(latents) * std + mean)


def to_latents(vae, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] -> the denoiser's latents: the posterior's mode (diffusers' Flux.2
    trainer encodes with it; `generator` unused), normalised by the VAE's batch-norm statistics."""
    return normalize(vae, vae.encode(images.to(vae.device, vae.dtype)).latent_dist.mode())


def from_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_latents` as the pipeline decodes: images (B, 3, H, W) in [-1, 1]."""
    return vae.decode(denormalize(vae, latents.to(vae.device, vae.dtype))).sample.clamp(-1, 1)


# ----------------------------------------------------------------------------- ComfyUI's names

# ComfyUI loads a Flux.2 LoRA by Black Forest Labs' module names (`lora_unet_double_blocks_0_img_mlp_0`: its
# key map names every weight of the model it holds, comfy/lora.py `model_lora_keys_unet`), and by diffusers'
# names only where its Flux map knows them (comfy/utils.py `flux_to_diffusers`: Flux.1's, so the double-stream
# attention's to_q/k/v, to_out.0, add_*_proj and to_add_out, as slices of BFL's fused qkv). The modules whose
# diffusers names are Flux.2's own are written by their BFL name, one to one (same weight, same shape).
_BFL_DOUBLE = {"ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2", "ff_context.linear_in": "txt_mlp.0",
               "ff_context.linear_out": "txt_mlp.2"}
_BFL_SINGLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}
_BLOCKS = (("transformer_blocks", "double_blocks", _BFL_DOUBLE),
           ("single_transformer_blocks", "single_blocks", _BFL_SINGLE))


def bfl_name(path: str) -> str | None:
    """A transformer module's BFL name where ComfyUI knows it only by that:
    `transformer_blocks.0.ff.linear_in` -> `double_blocks.0.img_mlp.0`; None for the others."""
    for ours, theirs, table in _BLOCKS:
        match = re.fullmatch(rf"{ours}\.(\d+)\.(.+)", path)
        if match and match[2] in table:
            return f"{theirs}.{match[1]}.{table[match[2]]}"
    return None


def from_bfl_kohya(name: str) -> str | None:
    """The inverse of `bfl_name` on a kohya name after `lora_unet_` (dots as "_"): `double_blocks_0_img_mlp_0`
    -> `transformer_blocks.0.ff.linear_in`; None for a name that is not one of these modules."""
    for ours, theirs, table in _BLOCKS:
        match = re.fullmatch(rf"{theirs}_(\d+)_(.+)", name)
        inverse = {v.replace(".", "_"): k for k, v in table.items()}
        if match and match[2] in inverse:
            return f"{ours}.{match[1]}.{inverse[match[2]]}"
    return None


# ----------------------------------------------------------------------------- its text encoder's files

# transformers 5 saves Mistral3ForConditionalGeneration in the original checkpoints' layout
# (`language_model.model.`, ...) and builds it as `model.language_model.`, ...: module path <- stored prefix.
_SAVED_PREFIXES = (("model.language_model.", "language_model.model."),
                   ("lm_head.", "language_model.lm_head."), ("model.vision_tower.", "vision_tower."),
                   ("model.multi_modal_projector.", "multi_modal_projector."))
_MODULES = ("model.language_model.", "model.vision_tower.", "model.multi_modal_projector.")


def stored_names(model: torch.nn.Module):
    """For a Mistral3 text encoder, the module name of each key its checkpoints hold: transformers' saved
    layout (`language_model.model.`, ...), its module names, or ComfyUI's language model alone (`model.`);
    None for any other model (its keys are its names)."""
    if not type(model).__name__.startswith("Mistral3"):
        return None

    def rename(key: str) -> str:
        for live, saved in _SAVED_PREFIXES:
            if key.startswith(saved):
                return live + key[len(saved):]
        if key.startswith("model.") and not key.startswith(_MODULES):
            return "model.language_model." + key.removeprefix("model.")
        return key

    return rename
