"""Z-Image (Tongyi-MAI, diffusers' ZImagePipeline): its tiny configs, its offline tokenizer with the chat
template, how its pipeline encodes prompts, how its transformer is called.

    TRANSFORMER, TEXT_ENCODER, SCHEDULER   the tiny configs (builders.CONFIGS["z-image"] reads them)
    TEXT_TOKENS                            the tiny tokenizer's length (the pipeline's default is 512)
    build_tokenizer(words, length)         a Qwen2TokenizerFast over `words`, with the chat template
    text_model(cfg, tokenizer)             a transformers Qwen3Model (the pipeline's text_encoder)
    encode(pipe, prompts, device)          {"prompt_embeds": (B, T, D), "prompt_embeds_mask": (B, T)}
    predict(model, x, t, ctx, embeds, guidance, vae_scale_factor)   the velocity noise - x0, (B, C, h, w)
    pipeline_inputs(embeds, guidance)      the cached embeddings as ZImagePipeline.__call__ takes them

What the pipeline does (diffusers 0.42, pipelines/z_image/pipeline_z_image.py), and what lora_lab does:

- Text: each prompt goes through the tokenizer's chat template as one user message with
  `add_generation_prompt=True, enable_thinking=True` ("<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>
  assistant\\n"), is padded to `max_sequence_length` (512), and the text encoder's second-to-last hidden
  state is kept at the unpadded tokens only: a list of (T_i, D) tensors, one length per prompt. lora_lab
  caches them padded to the tokenizer's length with zero rows, and the mask beside them
  (`prompt_embeds_mask`, 1.0 at a prompt's tokens): every cache row has one shape (caption dropout, batches),
  and `predict` / `pipeline_inputs` cut each prompt back to its own tokens, so the transformer sees what the
  pipeline gives it. On fake tensors (a memory plan) a mask has no values: every prompt counts at the
  tokenizer's full length, the most a caption can take (the plan's upper bound).
- Denoiser: ZImageTransformer2DModel takes lists: each latent (C, 1, h, w) (a frame axis), each caption's
  embeddings, and t = 1 - sigma (the pipeline's (1000 - timestep) / 1000; the model scales it by t_scale
  1000); it returns x0 - noise, which the pipeline negates. `predict` returns the negated output, the
  velocity noise - x0 that lora_lab's flow matching targets (musubi-tuner's zimage_train_network.py trains
  the raw output on x0 - noise, ai-toolkit's z_image.py the negated one on noise - x0: the same loss).
  Its 2x2 patches are cut inside the model (`all_patch_size`), so latents enter unpacked.
- Shift: a fixed flow shift of 3.0 (Z-Image-Turbo's scheduler_config.json, no dynamic shifting; ai-toolkit
  trains with that scheduler). The pipeline samples sigmas linspace(1, 1/N, N), shifted by the scheduler.
- Guidance: the pipeline's `guidance_scale` w makes pos + w (pos - neg); lora_lab's guidance g (1 = off)
  is w = g - 1. The unconditional input is the encoded empty prompt, as the pipeline makes it.

The tiny tokenizer: byte-level BPE with Qwen2's pre-tokenizer (transformers' Qwen2TokenizerFast), each word of
`words` one token (with and without its leading space), the special tokens <|endoftext|> (padding),
<|im_start|>, <|im_end|> and <think>, </think>. Its chat template writes what Qwen3's writes for
system/user/assistant messages with and without a generation prompt and `enable_thinking`; it has no tools
and drops no reasoning content (Qwen3's template does both; the pipeline uses neither).
"""

from __future__ import annotations

import torch

from ..torch_private import is_fake

# Tiny configs. The transformer keeps every structural part of the real one (noise and context refiners,
# 2x2 patches cut inside, 3-axis rotary ids, the adaLN time embedding, the pad tokens) at width 64;
# axes_dims add up to the head dim (64 / 4 heads). axes_lens: caption positions (first axis) and 32 rows and
# columns of patches (builders.TINY_MAX_RESOLUTION, 128 px: 64 x 64 latents).
TRANSFORMER = {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 4, "dim": 64, "n_layers": 2,
               "n_refiner_layers": 1, "n_heads": 4, "n_kv_heads": 4, "qk_norm": True, "cap_feat_dim": 32,
               "axes_dims": [4, 6, 6], "axes_lens": [128, 32, 32]}
# Qwen3 (grouped-query attention 4 / 2 heads, q/k norms, tied embeddings) at hidden 32.
TEXT_ENCODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
                "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}
# Tongyi-MAI/Z-Image-Turbo/scheduler/scheduler_config.json
SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
TEXT_TOKENS = 32  # the tiny tokenizer's length: the chat template's 11 tokens and a caption
PIPELINE_TOKENS = 512  # ZImagePipeline's max_sequence_length

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK = ("<think>", "</think>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


def _vocab(words) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The byte-level alphabet and the merges BPE training finds on `words` (bare, and after a space: each
    word is a word of the corpus once), run until no pair is left: each word is one token. (A hand-made
    merge chain per word does not do it: BPE applies merges by rank across words.)"""
    import json

    from tokenizers import Tokenizer, models, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=1 << 16, min_frequency=1, show_progress=False,
                                  initial_alphabet=ByteLevel.alphabet())
    corpus = [spelled for w in (*words, "user", "assistant", "system") for spelled in (w, " " + w)]
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    for tok in (*SPECIAL, *THINK):
        vocab.setdefault(tok, len(vocab))
    return vocab, [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def build_tokenizer(words, length: int = TEXT_TOKENS):
    """A Qwen2TokenizerFast over `words` (Qwen3's special tokens, right padding with <|endoftext|>) with the
    chat template, `length` tokens long."""
    from transformers import Qwen2TokenizerFast

    vocab, merges = _vocab(words)
    tok = Qwen2TokenizerFast(vocab=vocab, merges=merges, unk_token=None,
                             eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=length,
                             padding_side="right")
    tok.add_special_tokens({"additional_special_tokens": [SPECIAL[1], SPECIAL[2]]})
    tok.add_tokens(list(THINK))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def text_model(cfg: dict, tokenizer):
    """transformers' Qwen3Model of `cfg`, over the tokenizer's vocabulary where `cfg` gives none."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(**{"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                            "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None, **cfg})
    return Qwen3Model(config)


def encode(pipe, prompts: list[str], device) -> dict[str, torch.Tensor]:
    """The pipeline's `_encode_prompt` (chat template, padding to the tokenizer's length or 512, the
    second-to-last hidden state), its list of per-prompt tensors kept padded: prompt_embeds (B, T, D), zero
    at padding, and prompt_embeds_mask (B, T), 1.0 at each prompt's tokens. The mask is read from the
    tokenizer's lists, so this runs on fake tensors too."""
    tok = pipe.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=True) for p in prompts]
    enc = tok(texts, padding="max_length", max_length=min(PIPELINE_TOKENS, tok.model_max_length),
              truncation=True)
    ids = torch.tensor(enc["input_ids"], device=device)
    mask = torch.tensor(enc["attention_mask"], device=device).bool()
    hidden = pipe.text_encoder(input_ids=ids, attention_mask=mask,
                               output_hidden_states=True).hidden_states[-2]
    keep = mask.to(hidden.dtype)
    return {"prompt_embeds": hidden * keep[..., None], "prompt_embeds_mask": keep}


def prompt_list(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Padded embeddings (B, T, D) and their mask (B, T) -> each prompt's own tokens, (T_i, D) each, as the
    pipeline passes them (on fake tensors: every row whole)."""
    if is_fake(mask):
        return list(embeds.unbind(0))
    return [e[m > 0.5] for e, m in zip(embeds, mask)]


def predict(model, x, t, ctx, embeds, guidance, vae_scale_factor):
    """The transformer on lists, as the pipeline calls it: latents (B, C, h, w) as B (C, 1, h, w), t = 1 -
    sigma (computed as the pipeline does from its timestep 1000 sigma), each caption's own tokens; its
    output negated: noise - x0, (B, C, h, w)."""
    captions = prompt_list(ctx, embeds["prompt_embeds_mask"].to(ctx.device))
    t = t.to(x.device, torch.float32)
    out = model(list(x.unsqueeze(2).unbind(0)), (1000 - t * 1000) / 1000, captions, return_dict=False)[0]
    return -torch.stack(out).squeeze(2)


def pipeline_inputs(embeds: dict[str, torch.Tensor], guidance: float) -> dict:
    """ZImagePipeline.__call__'s keywords for cached embeddings: prompt_embeds (and negative_prompt_embeds)
    as lists of each prompt's tokens, guidance_scale = guidance - 1 (its pos + w (pos - neg))."""
    out: dict = {"guidance_scale": guidance - 1.0}
    for name in ("prompt_embeds", "negative_prompt_embeds"):
        if name in embeds:
            out[name] = prompt_list(embeds[name], embeds[f"{name}_mask"])
    return out
