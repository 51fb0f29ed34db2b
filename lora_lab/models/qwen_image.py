"""Qwen-Image (Qwen/Qwen-Image): what differs from the other kinds, in one place.

    TINY                                 -> the tiny base's component configs (builders.CONFIGS["qwen-image"])
    SCHEDULER                            -> Qwen/Qwen-Image/scheduler/scheduler_config.json
    build_tokenizer(words, max_length)   -> a Qwen2Tokenizer (byte-level BPE) made offline
    text_encoder(cfg, tokenizer=None)    -> a Qwen2_5_VLForConditionalGeneration from a {text_config,
                                            vision_config} dict (random weights, the current device context)
    prompt_tokens(pipe)                  -> text tokens per prompt lora_lab caches (the real pipeline: 512)
    encode(pipe, prompts, device)        -> {"prompt_embeds": (B, L, D), "prompt_embeds_mask": (B, L)}
    predict(model, x, t, ctx, embeds, guidance, vae_scale_factor) -> the velocity (B, C, h, w)
    to_latents(vae, images, generator) / from_latents(vae, latents)  -> the VAE's normalised latents
    pipeline_inputs(embeds, guidance)    -> the pipeline's keywords: guidance as its `true_cfg_scale`

The pipeline (diffusers' QwenImagePipeline) writes each prompt into a chat template, runs Qwen2.5-VL over it
and keeps the last hidden states after the template's first 34 tokens (`prompt_template_encode_start_idx`: the
system turn and "<|im_start|>user\\n"), so each prompt's embeddings are its own tokens and the 5 that close
the template ("<|im_end|>\\n<|im_start|>assistant\\n"). `encode` runs the same template, encoder and drop with
fixed shapes: right-padded to `prompt_tokens(pipe)` tokens with a mask (the pipeline pads to the batch's
longest prompt; the transformer masks padding out of its attention and gives the text tokens their rotary
positions from the start, so the padding changes no output; tests/models/test_qwen_image.py checks it against
`pipe.encode_prompt`). Fixed shapes are what the cache stacks and what a plan on fake tensors can run (the
pipeline's boolean gather cannot).

The tiny tokenizer is the real one's construction (transformers' Qwen2Tokenizer: its pre-tokenizer regex,
byte-level alphabet, the special tokens <|endoftext|>, <|im_start|>, <|im_end|>) over a vocabulary made by
hand: the 256 byte symbols, every word of the template and of `words` (with and without the leading space) as
one token each. So the template's prefix is 34 tokens as with the real vocabulary, and the pipeline's drop
index holds. What differs: the vocabulary (~500 tokens instead of 151,646; other words fall back to bytes).

The tiny base keeps every structural feature: the 2x2 packed latents with the transformer's `patch_size` 2
(the packing is the patch: lora_lab's kind has latent_packing 1, the patch is in the config), dual-stream
blocks with joint attention and 3-axis rotary positions (frame, row, column), RMS-normed text input, the
causal 3D VAE with its frame axis and per-channel latents_mean / latents_std, Qwen2.5-VL with grouped-query
attention, multimodal rotary sections and a vision tower, the scheduler's dynamic shift. Its VAE has 4 latent
channels (the real one 16), as the other tiny bases have 4, and downsamples 2x (16x16 images, 8x8 latents, 4x4
tokens).

Training: flow matching, sigma = the logit-normal draw shifted by e^mu, mu linear in the image's tokens from
(256, 0.5) to (8192, 0.9): the scheduler's `use_dynamic_shifting` settings, and what kohya's musubi-tuner does
with `--timestep_sampling qwen_shift` (src/musubi_tuner/hv_train_network.py: get_lin_function(x1=256, y1=0.5,
x2=8192, y2=0.9) of (h // 2) * (w // 2); qwen_image/qwen_image_utils.py: SCHEDULER_BASE_IMAGE_SEQ_LEN 256,
SCHEDULER_BASE_SHIFT 0.5, SCHEDULER_MAX_IMAGE_SEQ_LEN 8192, SCHEDULER_MAX_SHIFT 0.9): 1024 px -> 4096 tokens,
shift 2.0. The denoiser takes sigma itself as its timestep (the pipeline passes t / 1000); sampling uses
"true" classifier-free guidance (`true_cfg_scale`, the combined prediction rescaled to the conditional one's
norm), no guidance embedding.
"""

from __future__ import annotations

import torch

from .inputs import pack_latents, unpack_latents

# diffusers and transformers are imported where used: ~4 s to import, which `import lora_lab` should not pay.

PROMPT_TOKENS = 512  # QwenImagePipeline.__call__'s max_sequence_length: text tokens per prompt at most
DROPPED = 34  # QwenImagePipeline.prompt_template_encode_start_idx: the template's tokens before the prompt
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
            "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
            "<|im_end|>\n<|im_start|>assistant\n")  # QwenImagePipeline.prompt_template_encode
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen/Qwen-Image/scheduler/scheduler_config.json
SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
             "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
             "time_shift_type": "exponential"}
# the tiny base's: the same but shift_terminal, which divides 0 by 0 in a 1-step sampling (the tests' and the
# plans' `sample_steps=1`; the real pipeline's too)

TINY = {
    # in_channels = 4 latent channels * 2x2 packing; rope axes add up to the head dim (4 + 6 + 6 = 16);
    # joint_attention_dim = the text encoder's hidden size.
    "transformer": {"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2,
                    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 64,
                    "axes_dims_rope": [4, 6, 6]},
    # one spatial downsampling (2x), no temporal one; latents_mean / std: make_base.py sets the trained VAE's
    "vae": {"base_dim": 32, "z_dim": 4, "dim_mult": [1, 2], "num_res_blocks": 1,
            "temperal_downsample": [False],
            "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4},
    # Qwen2.5-VL: grouped-query attention (4 heads, 2 key/value heads), mrope sections adding up to half the
    # head dim (2 + 3 + 3 = 8), a two-block vision tower projecting to the text hidden size
    "text_encoder": {
        "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
                        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64, "fullatt_block_indexes": [1]},
    },
    "scheduler": {k: v for k, v in SCHEDULER.items() if k != "shift_terminal"},
}


# ----------------------------------------------------------------------------- the text encoder


def _template_words() -> list[str]:
    """The words of the template's fixed text, each as the pre-tokenizer cuts it (a leading space kept)."""
    import re

    text = TEMPLATE.replace("{}", "")
    for special in SPECIAL:
        text = text.replace(special, "\n")
    return re.findall(r" ?[A-Za-z]+", text)


def _learn_merges(words: list[str]) -> list[tuple[str, str]]:
    """Byte-pair merges learned on `words` (each once) until each is one symbol: at each step the most
    frequent adjacent pair, ties to the smallest. Encoding replays merges in this order, so each word ends as
    one token; deterministic (no hash order)."""
    pieces = [list(w) for w in words]
    merges: list[tuple[str, str]] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for p in pieces:
            for pair in zip(p, p[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            return merges
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        for i, p in enumerate(pieces):
            j, out = 0, []
            while j < len(p):
                if j + 1 < len(p) and (p[j], p[j + 1]) == best:
                    out.append(p[j] + p[j + 1])
                    j += 2
                else:
                    out.append(p[j])
                    j += 1
            pieces[i] = out


def build_tokenizer(words: tuple[str, ...], max_length: int):
    """A Qwen2Tokenizer over the byte-level alphabet plus one token per template word and per word of `words`
    (with and without a leading space); `max_length` its model_max_length (the tokens `encode` keeps)."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    stripped = dict.fromkeys(w.strip() for w in (*_template_words(), *words))
    # byte-level symbols: " " is "Ġ"
    corpus = [form.replace(" ", "\u0120") for w in stripped for form in (w, " " + w)]
    merges = _learn_merges(corpus)
    vocab = {SPECIAL[0]: 0}
    for token in [*sorted(pre_tokenizers.ByteLevel.alphabet()), *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
    tok.add_tokens(list(SPECIAL[1:]), special_tokens=True)
    return tok


def text_encoder(cfg: dict, tokenizer=None):
    """Qwen2_5_VLForConditionalGeneration from {"text_config": ..., "vision_config": ...} (the vocabulary's
    size and special ids from `tokenizer` where given), in eval mode, built in the caller's device context."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(cfg["text_config"])
    if tokenizer is not None:
        text.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                    bos_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    config = Qwen2_5_VLConfig(text_config=text, vision_config=dict(cfg["vision_config"]),
                              **{k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")})
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def stored_names(model: torch.nn.Module):
    """For a Qwen2.5-VL model, the module name of each key its checkpoints hold (Qwen/Qwen-Image/text_encoder
    and transformers' save_pretrained: `model.*` the language model, `visual.*` the vision tower; transformers
    5's modules: `model.language_model.*`, `model.visual.*`, renamed by its conversion mapping on load);
    None for any other model (its keys are its names)."""
    if type(model).__name__ != "Qwen2_5_VLForConditionalGeneration":
        return None

    def rename(key: str) -> str:
        if key.startswith("visual."):
            return "model." + key
        if key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
            return "model.language_model." + key.removeprefix("model.")
        return key

    return rename


def prompt_tokens(pipe) -> int:
    """Text tokens per prompt in lora_lab's cache: the pipeline's 512, capped by its tokenizer's length less
    the dropped prefix (the tiny tokenizer: 32)."""
    return min(PROMPT_TOKENS, pipe.tokenizer.model_max_length - pipe.prompt_template_encode_start_idx)


def encode(pipe, prompts: list[str], device) -> dict[str, torch.Tensor]:
    """The pipeline's prompt embeddings (its template, encoder and dropped prefix), right-padded to
    `prompt_tokens(pipe)` with their mask (1 a token, 0 padding); see the module docstring."""
    drop, length = pipe.prompt_template_encode_start_idx, prompt_tokens(pipe)
    tokens = pipe.tokenizer([pipe.prompt_template_encode.format(p) for p in prompts], padding="max_length",
                            max_length=drop + length, truncation=True, padding_side="right",
                            return_tensors="pt").to(device)
    encoder = pipe.text_encoder
    out = encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True)
    mask = tokens.attention_mask[:, drop:]
    embeds = out.hidden_states[-1][:, drop:] * mask[..., None].to(encoder.dtype)  # padding 0, as the pipe's
    return {"prompt_embeds": embeds.to(encoder.dtype), "prompt_embeds_mask": mask}


# ----------------------------------------------------------------------------- the denoiser and the VAE


def rope_tables(model: torch.nn.Module, device: torch.device | str) -> None:
    """The rotary tables of a Qwen-Image transformer built on the meta device (`loading.skeleton`), made on
    `device` when its weights are loaded (`loading.fill`): plain attributes, not buffers, so no weights hold
    them (a buffer's complex values would lose their imaginary part in `module.to(dtype)`). A no-op for any
    other model."""
    for name, m in list(model.named_modules()):
        freqs = getattr(m, "pos_freqs", None)
        if isinstance(freqs, torch.Tensor) and freqs.is_meta and hasattr(m, "scale_rope"):
            with torch.device(device):
                fresh = type(m)(theta=m.theta, axes_dim=list(m.axes_dim), scale_rope=m.scale_rope)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, fresh)


def predict(model, x, t, ctx, embeds, guidance, vae_scale_factor):
    """The transformer on 2x2-packed latents (one frame), its text masked where padded; sigma as timestep."""
    B, _, h, w = x.shape
    mask = embeds.get("prompt_embeds_mask")
    out = model(hidden_states=pack_latents(x), timestep=t.to(x.dtype), encoder_hidden_states=ctx,
                encoder_hidden_states_mask=None if mask is None else mask.to(x.device),
                img_shapes=[[(1, h // 2, w // 2)]] * B).sample
    return unpack_latents(out, h, w)


def _stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latents_mean and latents_std, (1, C, 1, 1) in `like`'s device and dtype."""
    shape = (1, vae.config.z_dim, 1, 1)
    return (torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype),
            torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype))


def to_latents(vae, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] as one frame through the causal 3D VAE, the posterior sampled with
    `generator`, normalised per channel: (z - latents_mean) / latents_std, (B, C, h, w)."""
    z = vae.encode(images.to(vae.device, vae.dtype)[:, :, None]).latent_dist.sample(generator)[:, :, 0]
    mean, std = _stats(vae, z)
    return (z - mean) / std


def from_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_latents` as the pipeline decodes: images (B, 3, H, W) in [-1, 1]."""
    z = latents.to(vae.device, vae.dtype)
    mean, std = _stats(vae, z)
    return vae.decode((z * std + mean)[:, :, None]).sample[:, :, 0].clamp(-1, 1)


def pipeline_inputs(embeds: dict, guidance: float) -> dict:
    """The pipeline's __call__ keywords of cached embeddings and a guidance scale: QwenImagePipeline's
    classifier-free guidance is `true_cfg_scale` (its `guidance_scale` is for guidance-distilled models)."""
    return {**embeds, "true_cfg_scale": guidance}
