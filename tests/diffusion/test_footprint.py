"""One vocabulary of a run: every TrainConfig field is declared as changing a run's memory or not
(`diffusion/footprint.py`), and each field declared as changing it changes a tiny plan of the trainer's stages
(or a line says why it cannot at tiny size). A field added without a declaration fails here."""

from __future__ import annotations

import pytest

from lora_lab.diffusion import TrainConfig
from lora_lab.diffusion.footprint import MEMORY, undeclared
from lora_lab.planning import plan_memory

TINY = dict(model="sdxl", device="cpu", rank=4, steps=2, sample_steps=1, progress=False)

# a field declared as changing memory: (the baseline's fields, the changed run's fields), planned both ways
CHANGES = {
    "model": ({}, {"model": "sd15"}),
    "base_dtype": ({}, {"base_dtype": "bf16"}),
    "base_quantization": ({}, {"base_quantization": "nf4"}),
    "text_encoder_quantization": ({}, {"text_encoder_quantization": "fp8"}),
    "device": ({}, {"device": "cuda"}),
    "dataset": ({}, {"dataset": "DIGITS"}),
    "datasets": ({}, {"datasets": [{"path": "DIGITS", "repeats": 3}]}),
    "reg_dataset": ({}, {"reg_dataset": "DIGITS"}),
    "validation_dataset": ({}, {"validation_dataset": "DIGITS"}),
    "resolution": ({}, {"resolution": 32}),
    "caption_dropout": ({}, {"caption_dropout": 0.1}),
    "shuffle_captions": ({}, {"shuffle_captions": True}),
    "tag_dropout": ({}, {"tag_dropout": 0.2}),
    "flip": ({}, {"flip": True}),
    "caption_variants": ({"shuffle_captions": True}, {"shuffle_captions": True, "caption_variants": 2}),
    "sample_prompts": ({}, {"sample_prompts": ["one", "two", "three", "four", "five", "six"]}),
    "rank": ({}, {"rank": 8}),
    "dora": ({}, {"dora": True}),
    "adapter": ({}, {"adapter": "loha"}),
    "lokr_factor": ({"adapter": "lokr"}, {"adapter": "lokr", "lokr_factor": 2}),
    "conv": ({}, {"conv": True}),
    "feed_forward": ({}, {"feed_forward": True}),
    "text_encoder_lr": ({}, {"text_encoder_lr": 1e-4}),
    "batch_size": ({}, {"batch_size": 2}),
    "grad_accum": ({}, {"grad_accum": 2}),
    "optimizer": ({}, {"optimizer": "prodigy", "lr": 1.0}),
    "mixed_precision": ({}, {"mixed_precision": "bf16"}),
    "blocks_to_swap": ({"gradient_checkpointing": True},
                       {"gradient_checkpointing": True, "blocks_to_swap": 1}),
    "keep_encoders": ({}, {"keep_encoders": True}),
    "ema_decay": ({}, {"ema_decay": 0.9}),
    "gradient_checkpointing": ({}, {"gradient_checkpointing": True}),
    "sample_steps": ({}, {"sample_steps": 0}),
    "sample_every": ({}, {"sample_every": 1}),
    "cache_dir": ({}, {"cache_dir": "unused-cache"}),  # latents mapped, not held (CPU: the device's bytes)
    "cache_to_disk": ({}, {"cache_to_disk": True}),
}
# a field declared as changing memory that cannot change a tiny plan of the shipped base, and why
CANNOT_AT_TINY = {
    "base": "another base is another model: its files are in the plan key (tests/planning/test_cache.py)",
    "clip_l": "a part file of a single-file base (tests/models/test_single_file.py trains with one)",
    "clip_g": "a part file of a single-file base",
    "t5xxl": "a part file of a single-file base",
    "text_encoder": "a part file of a single-file base (tests/models/test_single_file_families.py)",
    "vae": "a part file of a single-file base",
    "skip_bad_images": "only drops unreadable images; the shipped data has none",
    "vae_tiling": "a tiny sample (16 px) is smaller than one tile: decoded whole either way",
    "save_every": "a per-step file's host copy is the final save's, in the same phase",
    "buckets": "a bucket holds about resolution^2 pixels: as many bytes as the square crop (the plan trains "
               "at the square size; measured 0.994-1.000 of bucketed tiny runs)",
    "masked_loss": "the digits have no masks; a mask (one channel of the latent grid) is counted with its "
                   "latent (planning/examples.py CacheLedger's `latent`), the device's with the step's",
    "validation_split": "held-out images are cached as the trained ones are, and a tiny validation batch "
                        "is no larger than a training micro-batch (test_plan_matrix measures the run)",
}


def test_every_field_is_declared():
    assert undeclared(TrainConfig) == [], "declare each TrainConfig field in diffusion/footprint.py MEMORY"


def test_every_field_that_changes_memory_is_shown_to():
    changing = {name for name, how in MEMORY.items() if how is not None}
    assert changing == set(CHANGES) | set(CANNOT_AT_TINY)
    assert not set(CHANGES) & set(CANNOT_AT_TINY)


@pytest.fixture(scope="module")
def folders(digits_folder):
    return {"DIGITS": str(digits_folder(count=3))}


_PLANS: dict[str, tuple] = {}


def _plan(fields: dict, folders: dict) -> tuple:
    """The phases and parts of a tiny plan of TINY with `fields` (DIGITS: a folder), once each."""
    def real(value):
        if isinstance(value, list):
            return [{k: folders.get(v, v) for k, v in t.items()} if isinstance(t, dict) else t for t in value]
        return folders.get(value, value) if isinstance(value, str) else value

    config = TrainConfig(**{**TINY, **{k: real(v) for k, v in fields.items()}}, output="unused")
    key = repr(sorted(fields.items()))
    if key not in _PLANS:
        plan = plan_memory(config, cache=False)
        _PLANS[key] = (plan.phases, plan.parts, plan.host)
    return _PLANS[key]


@pytest.mark.slow  # a tiny plan per field (the first with the baseline): one field alone took 22 s
@pytest.mark.parametrize("name", sorted(CHANGES))
def test_a_field_that_changes_memory_changes_the_plan(name, folders):
    base, changed = CHANGES[name]
    assert _plan(base, folders) != _plan(changed, folders), f"{name}: the plan did not change"
