"""Chroma (lodestones' Chroma1: Flux.1-schnell pruned to 8.9B parameters): its prompt encoding, its denoiser
call, its tiny config and its trainer's timestep draw. The `chroma` entry of kinds.py reads these.

    encode(pipe, prompts, device)   -> {"prompt_embeds": (B, T, D), "prompt_attention_mask": (B, T) bool}
    predict(model, x, t, ctx, embeds, guidance, vae_scale_factor) -> (B, C, h, w)
    TINY_TRANSFORMER, TINY_SCHEDULER   the tiny base's ChromaTransformer2DModel and scheduler configs
    T5_TOKENS                       -> 512, the pipeline's default max_sequence_length
    modulation_indices(like)        -> the transformer's `time_text_embed.mod_proj` buffer (no file holds it)

What Chroma is, from diffusers' ChromaPipeline / ChromaTransformer2DModel (0.42) and the authors' trainer
(github.com/lodestone-rock/flow, src/trainer/train_chroma*.py, src/models/chroma/model.py):

- Flux.1's transformer (19 double, 38 single blocks; 2x2 packed latents, Flux's rotary ids: `inputs.py`) with
  no per-block modulation: one "distilled guidance layer" (`ChromaApproximator`, an MLP) maps the timestep
  to every block's shift/scale/gate at once. No CLIP, no pooled input, no guidance embedding (its guidance
  input is fixed at 0): the pipeline samples with real classifier-free guidance, a negative prompt's pass
  beside the prompt's (`guidance_scale`, default 5), so lora_lab samples it like sd3 (`prompt_inputs`).
- T5-XXL alone, masked: T5 sees the tokenizer's attention mask, and the transformer's attention sees the
  prompt's tokens and the first padding token only (the `mask_indices <= seq_lengths` of the pipeline's
  `_get_t5_prompt_embeds`; the trainer's `modify_mask_to_attend_padding(mask, len, 1)`).
  diffusers 0.42 returns that mask as floats (the T5 encoder's dtype), and a float mask reaches
  `scaled_dot_product_attention` as an *additive* bias of 0 and 1, which masks nothing (diffusers issue
  #12116: short prompts come out wrong). lora_lab keeps the mask boolean, as the authors' trainer builds it
  (`.bool()` on the text-image mask), in its cache, in `predict` and in the embeddings it hands the sampler,
  so training and sampling both mask the padding: a tested fact (`test_chroma.py`), not an assumption.
- The objective is rectified flow, x_t = (1 - s) x0 + s noise, target noise - x0, with sigmas s drawn from the
  authors' density p(s) proportional to 2 - 7.7 (s - 1/2)^2 on [0, 1] and no shift (the trainer's
  `create_distribution` / `prepare_sot_pairings`; its `time_shift` is commented out): lora_lab's `chroma`
  timestep sampling (`diffusion/weighting.py`), the kind's default. The scheduler's resolution-dependent
  shift is its sampler's only. (The trainer also pairs noise to latents by minibatch optimal transport; with
  lora_lab's batches of a few examples that pairing is left out.)

The tiny tokenizer is `builders.build_tokenizer("t5")` (the pipeline's encode_prompt runs unchanged on it:
no template, no chat format), 16 tokens long; the tiny T5 and VAE are the configs sd3/flux use.
"""

from __future__ import annotations

import torch

from .inputs import flux_latent_ids, flux_text_ids, pack_latents, unpack_latents

T5_TOKENS = 512  # ChromaPipeline's default max_sequence_length

# in_channels = 4 latent channels * 2x2 packing; joint_attention_dim = the tiny T5's d_model; rope axes add up
# to the head dim (4 + 4 + 8 = 16). The approximator keeps its structure (in_proj, residual MLP layers with
# RMSNorms, out_proj) at 16 input channels (the real 64) and width 32 (the real 5120), 2 layers (the real 5).
TINY_TRANSFORMER = {"patch_size": 1, "in_channels": 16, "out_channels": None, "num_layers": 1,
                    "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                    "joint_attention_dim": 64, "axes_dims_rope": [4, 4, 8], "approximator_num_channels": 16,
                    "approximator_hidden_dim": 32, "approximator_layers": 2}
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}


def encode(pipe, prompts: list[str], device) -> dict[str, torch.Tensor]:
    """The pipeline's own T5 embeddings of `prompts` and their text mask, boolean (see the module doc)."""
    length = min(T5_TOKENS, pipe.tokenizer.model_max_length)
    embeds, _, mask, *_ = pipe.encode_prompt(prompts, device=device, do_classifier_free_guidance=False,
                                             max_sequence_length=length)
    return {"prompt_embeds": embeds, "prompt_attention_mask": mask.bool()}


def predict(model, x, t, ctx, embeds, guidance, vae_scale_factor) -> torch.Tensor:
    """ChromaTransformer2DModel on (B, C, h, w) latents as the pipeline calls it: packed 2x2, the sigma as
    the timestep (the model multiplies it by 1000), Flux's rotary ids, and the text mask followed by the
    image tokens (all attended) as one boolean mask. `guidance` is unused: Chroma has no guidance input."""
    B, _, h, w = x.shape
    packed = pack_latents(x)
    text = embeds["prompt_attention_mask"].to(x.device).bool()
    mask = torch.cat([text, text.new_ones(B, packed.shape[1])], dim=1)
    out = model(hidden_states=packed, timestep=t.to(x.dtype), encoder_hidden_states=ctx,
                txt_ids=flux_text_ids(ctx.shape[1]).to(x.device, x.dtype),
                img_ids=flux_latent_ids(h, w).to(x.device, x.dtype), attention_mask=mask).sample
    return unpack_latents(out, h, w)


def modulation_indices(like: torch.Tensor) -> torch.Tensor:
    """The buffer `time_text_embed.mod_proj` of a ChromaTransformer2DModel of its shape (n, 2c), as the
    constructor computes it (sinusoidal embeddings of 0, 1000, ..., 1000 (n - 1)): non-persistent, so no
    weights file holds it and a model built on the meta device lacks it."""
    from diffusers.models.embeddings import get_timestep_embedding

    n, width = like.shape
    return get_timestep_embedding(torch.arange(n) * 1000, width, flip_sin_to_cos=True, downscale_freq_shift=0)
