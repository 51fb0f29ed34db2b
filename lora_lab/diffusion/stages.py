"""The parts of a training run's stages that are plain functions of their values (`trainer.TrainingRun` calls
them): the device, the cache phase's result and its key, the denoiser loaded, the output folder opened, the
LoRA files written, the sample grid.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from ..checkpointing import disable_checkpointing
from ..formats import file_formats, save_lora
from ..lora import lora_state_dict
from ..models import ModelKind, denoiser, model_kind
from ..models.bases import OpenedBase
from ..models.loading import fill
from ..quant import quantize_base
from .adapters import clip_encoders
from .config import TrainConfig, TrainConfigError
from .distributed import DistEnv, resolve_device
from .encoded import EncodedExamples
from .encoders import Encoders
from .sampling import prompt_inputs, sample_grid
from .state import Learner, RunState, move_aside, restore, truncate_log, write_config
from .watch import train_config_metadata

SAMPLE_PROMPTS = 4  # default prompts of the sample grid: the first distinct captions of the dataset


def setup_device(name: str) -> tuple[torch.device, DistEnv]:
    """The device to train on and this process's place in a torchrun job (its own GPU under torchrun)."""
    device = resolve_device(name)
    env = DistEnv.from_environ(device.type)
    if device.type == "cuda" and name in ("auto", "cuda"):
        device = torch.device("cuda", env.local_rank)
    return device, env


class Cached(NamedTuple):
    """What the cache phase leaves on the host: the dataset's latents and embeddings, the regularization set's
    (or None), what a dropped caption becomes (None without caption dropout), the sample prompts with
    their `prompt_inputs` (None when the run samples nothing), and the held-out examples (or None)."""

    data: EncodedExamples
    reg: EncodedExamples | None
    empty: dict | None
    samples: tuple[list[str], dict] | None
    val: EncodedExamples | None = None
    key: dict | None = None  # `cache_key` of the run that encoded them


# the TrainConfig fields the cache phase's result depends on (with the resolution and dtype resolved)
CACHE_FIELDS = ("model", "base", "clip_l", "clip_g", "t5xxl", "text_encoder", "vae",
                "text_encoder_quantization", "device", "dataset", "datasets", "reg_dataset", "buckets",
                "skip_bad_images", "seed", "validation_split", "validation_dataset",
                "shuffle_captions", "keep_tokens", "tag_dropout", "caption_variants", "sample_prompts",
                "flip", "masked_loss", "alpha_mask")


def cache_key(config: TrainConfig, resolution: int, dtype: torch.dtype) -> dict:
    """What a run's encoded data depend on: the CACHE_FIELDS, the resolution and dtype, whether captions are
    dropped (the unconditional input is encoded) and whether it samples (the prompts are)."""
    return {**{f: getattr(config, f) for f in CACHE_FIELDS}, "resolution": resolution, "dtype": str(dtype),
            "caption_dropout": config.caption_dropout > 0, "sample_steps": config.sample_steps > 0}


def check_cached(cached: Cached, key: dict) -> None:
    """TrainConfigError naming the first field where `cached` was encoded for another run than `key`'s."""
    for name, value in key.items():
        theirs = (cached.key or {}).get(name, "(unknown)")
        if theirs != value:
            raise TrainConfigError(f"cached data: encoded for {name}={theirs!r}, this run has {value!r}; "
                                   "train without `cached` to encode its own")


def load_denoiser(config: TrainConfig, opened: OpenedBase, device: torch.device, dtype: torch.dtype) -> None:
    """The denoiser's weights onto the device in the base dtype, one module at a time; with
    `base_quantization`, each frozen Linear quantized as it arrives (QLoRA: never the whole model in
    `dtype`)."""
    fill(denoiser(opened.pipe), opened.source, dtype=dtype, device=device,
         quantization=config.base_quantization)


def quantize_encoders(config: TrainConfig, pipe, device: torch.device) -> None:
    """With `text_encoder_quantization`, each text encoder's Linear layers onto the device one at a time and
    quantized there (`quant.quantize_base`, the base's formats): the cache phase holds their codes, never an
    encoder's float weights whole; the rest of each encoder follows when it comes onto the device."""
    if config.text_encoder_quantization is None:
        return
    for encoder in model_kind(config.model).text_encoders:
        module = getattr(pipe, encoder.component)
        if module is not None:  # frozen: no text-encoder LoRA with it (`options.check_quantization_fields`)
            quantize_base(module.requires_grad_(False), config.text_encoder_quantization, device=device)


def open_run(run: RunState, learner: Learner, env: DistEnv, bad_checkpoints: list[Path],
             resume_from: Path | None, state: dict | None) -> None:
    """The output folder (only now, with base, dataset and rank checked: a failed start leaves none), the bad
    newer checkpoints moved aside, the checkpoint resumed from, the loss log cut back to it, config.json."""
    if env.main:
        (run.output / "checkpoints").mkdir(parents=True, exist_ok=True)
    env.barrier()
    if env.main:  # every rank holds its resume state now: move the bad newer checkpoints out of the way
        move_aside(bad_checkpoints)
    if resume_from is not None:
        restore(run, learner, state, resume_from)
    if env.main:
        truncate_log(run.output / "loss.jsonl", run.step)
        write_config(run)


def write_lora(kind: ModelKind, pipe, path: Path, format: str, config: TrainConfig, step: int) -> Path:
    """The denoiser's adapter (and the CLIP text encoders' with a text-encoder LoRA) as a LoRA file
    (kohya/ComfyUI: lora_unet_/lora_transformer_, lora_te_ or lora_te1_/lora_te2_; PEFT/diffusers: unet./
    transformer., text_encoder./text_encoder_2.), or a LoKr/LoHa as a LyCORIS file (`save_lora` picks by the
    layers), its metadata holding the resolved config and the step."""
    model = denoiser(pipe)
    layout = model if kind.ldm_names else None  # sd-scripts' LDM names need the UNet's structure
    text = config.text_encoder_lr is not None
    components = {kind.component: model,
                  **({c: getattr(pipe, c) for c in clip_encoders(kind)} if text else {})}
    # fp32 host copies, each module named by its pipeline path (LoKr/LoHa: their LyCORIS keys, which
    # save_lora writes as such)
    tensors = {f"{c}.{k}": v for c, m in components.items() for k, v in lora_state_dict(m).items()}
    return save_lora(path, tensors, format=format, base=kind.name, unet=layout,
                     metadata=train_config_metadata(config, step))


def save_outputs(config: TrainConfig, kind: ModelKind, pipe, run: RunState, env: DistEnv,
                 learner: Learner | None = None) -> dict[str, Path]:
    """The LoRA files (kohya/ComfyUI and diffusers/PEFT keys) of the adapter (rank 0); with an EMA, its files
    beside them (lora_ema.safetensors, pytorch_lora_weights_ema.safetensors)."""
    out = run.output
    outputs = {"config": out / "config.json", "loss_log": out / "loss.jsonl", "checkpoint": run.last_good}
    if env.main:
        outputs.update(save_adapter(kind, pipe, run, ""))
        if learner is not None and learner.ema is not None:
            with learner.ema.applied(learner.named):
                outputs.update(save_adapter(kind, pipe, run, "_ema"))
    env.barrier()
    return outputs


def save_adapter(kind: ModelKind, pipe, run: RunState, suffix: str) -> dict[str, Path]:
    """The adapter as lora{suffix}.safetensors (kohya) and pytorch_lora_weights{suffix}.safetensors (PEFT);
    a LoKr/LoHa as lora{suffix}.safetensors only (LyCORIS' keys: no PEFT file diffusers would load)."""
    out = run.output
    names = {"lora_kohya": ("lora", "kohya"), "lora_diffusers": ("pytorch_lora_weights", "peft")}
    formats = file_formats(denoiser(pipe))  # LoKr/LoHa: kohya's naming only
    return {f"{key}{suffix}": write_lora(kind, pipe, out / f"{stem}{suffix}.safetensors", format, run.config,
                                         run.step)
            for key, (stem, format) in names.items() if format in formats}


def sample_outputs(config: TrainConfig, encoders: Encoders, run: RunState, env: DistEnv,
                   samples: tuple[list[str], dict] | None, first: torch.Tensor | None = None,
                   last: torch.Tensor | None = None) -> dict[str, Path]:
    """The samples with and without the LoRA (rank 0) from the sample prompts encoded while caching: only the
    VAE comes back to the device for them. `first` / `last`: the watch's samples of step 0 and of the last
    step, the base row's and the LoRA row's images (the same prompts, seed and noise; at step 0 the adapter
    as initialised adds nothing), used where the text encoders did not train."""
    outputs = {}
    if env.main and samples is not None:
        model = denoiser(encoders.pipe)
        if config.checkpointing_policy():
            disable_checkpointing(model)
        model.eval()
        prompts, inputs = samples
        with encoders.on_device(["vae"]) as pipe:
            # a text-encoder LoRA: the LoRA row's prompts through the trained encoders, the base row's cached
            with torch.no_grad():
                trained = prompt_inputs(pipe, prompts) if config.text_encoder_lr is not None else inputs
            reuse = config.text_encoder_lr is None  # the watch's prompts went through the encoders as cached
            outputs["samples"] = sample_grid(pipe, prompts, config.seed, config.sample_steps,
                                             run.output / "samples.png", tiled=config.vae_tiling,
                                             inputs=trained, base_inputs=inputs,
                                             without=first if reuse else None,
                                             with_lora=last if reuse else None)
    env.barrier()
    return outputs
