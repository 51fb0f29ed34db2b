"""What a run's memory depends on: every `TrainConfig` field declared once, read by the plan cache.

    MEMORY["rank"]          "value": another value, another plan
    MEMORY["ema_decay"]     "whether set": only None (0, False) or not matters (an EMA's copy is the same at
                            any decay)
    MEMORY["lr"]            None: nothing a run holds depends on it
    MEMORY[name] = f        what f(config) says (one spelling of equal values: True and "full" checkpointing)
    memory_view(config)     {field: what of it the plan depends on}, for the fields that matter

The planner plans the whole `TrainConfig` (the trainer's own stages on fake tensors); this table says which
fields can change that plan, so that a cached plan is reused exactly where the run it was made for holds the
same memory (`planning/cache.py`). A field added to `TrainConfig` without a row here fails
`tests/diffusion/test_footprint.py`, which also shows, for each field declared as changing memory, that
changing it changes a tiny plan (or says in one line why it cannot at tiny size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

VALUE, SET = "value", "whether set"

MEMORY: dict[str, str | Callable | None] = {
    # the base and its parts (their files' contents are in the plan key too)
    "model": VALUE, "base": VALUE, "base_dtype": VALUE, "clip_l": VALUE, "clip_g": VALUE, "t5xxl": VALUE,
    "text_encoder": VALUE, "vae": VALUE, "base_quantization": VALUE, "text_encoder_quantization": VALUE,
    "device": VALUE,
    # the data: how many examples are cached, their sizes, the captions the text encoders see at once
    "dataset": VALUE, "datasets": VALUE, "reg_dataset": VALUE, "validation_dataset": VALUE,
    "validation_split": VALUE, "resolution": VALUE, "buckets": VALUE, "skip_bad_images": VALUE,
    "caption_dropout": SET, "shuffle_captions": VALUE, "tag_dropout": SET, "caption_variants": VALUE,
    "keep_tokens": None, "sample_prompts": VALUE,
    "flip": VALUE, "masked_loss": VALUE,  # the mirrored images' latents, the masks: cached beside the latents
    "alpha_mask": None,  # a mask from the alpha channel or from a file: the same cached mask
    # the adapter
    "rank": VALUE, "dora": VALUE, "adapter": VALUE, "lokr_factor": VALUE, "conv": VALUE,
    "feed_forward": VALUE, "text_encoder_lr": SET, "alpha": None,
    # the step
    "batch_size": VALUE, "grad_accum": VALUE, "optimizer": VALUE, "mixed_precision": VALUE,
    "blocks_to_swap": VALUE, "keep_encoders": VALUE, "ema_decay": SET,
    "gradient_checkpointing": lambda config: config.checkpointing_policy(),  # True is "full", "none" None
    # what the run writes and samples on the way
    "sample_steps": SET, "sample_every": SET, "vae_tiling": VALUE, "save_every": SET,
    # the disk cache: the latents memory-mapped from its files, not held in host memory (the plan's host
    # bytes); where it is does not matter
    "cache_dir": SET, "cache_to_disk": VALUE,
    # nothing a run holds depends on these: numbers the step reads, schedules, bookkeeping
    "output": None, "steps": None, "lr": None, "schedule": None, "warmup_steps": None, "weight_decay": None,
    "noise_offset": None, "min_snr_gamma": None, "debiased_estimation": None, "timestep_sampling": None,
    "logit_mean": None, "logit_std": None, "mode_scale": None, "timestep_shift": None, "dynamic_shift": None,
    "loss_weighting": None, "train_guidance": None, "ema_warmup": None, "loraplus_ratio": None,
    "prior_loss_weight": None, "seed": None, "keep_checkpoints": None, "resume": None, "progress": None,
    "validate_every": None, "log_with": None,
    # a loss's own tensors are latent-sized, made after the forward's peak (tiny plans of each are equal)
    "loss": None, "huber_schedule": None, "huber_c": None, "huber_scale": None,
    "max_grad_norm": None,  # clipping's norms: a scalar per parameter, after the backward's peak
}


def undeclared(config_class) -> list[str]:
    """The fields of `config_class` (TrainConfig) without a row in MEMORY, and the rows naming no field."""
    names = {f.name for f in fields(config_class)}
    return sorted(names ^ set(MEMORY))


def memory_view(config) -> dict[str, Any]:
    """What a plan of `config` depends on: each VALUE field's value, each SET field's being set."""
    view = {}
    for name, how in MEMORY.items():
        value = getattr(config, name)
        if callable(how):
            view[name] = how(config)
        elif how == VALUE:
            view[name] = value
        elif how == SET:
            view[name] = value is not None and value is not False and value != 0
    return view
