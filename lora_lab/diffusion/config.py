"""The settings of one diffusion LoRA training run: `TrainConfig`, its validation, the layers an adapter
targets (what only the base model can tell: `adapters.check_config_for_base`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from ..checkpointing import CheckpointingError, parse_policy
from ..errors import LoraLabError
from ..models import DATA_DIR, KINDS, ModelLoadError, model_kind
from ..models.bases import base_family, check_base
from ..precision import MODES
from .bounds import check_bounds
from .options import check_adapter_fields, check_knob_fields, check_quantization_fields, check_watch_fields

MODELS, DEFAULT_MODEL = KINDS, "sdxl"  # DEFAULT_MODEL: a run whose base names no family trains it
OPTIMIZERS = ("adamw", "adamw8bit", "bnb-adamw8bit", "prodigy", "adafactor")
SCHEDULES = ("constant", "linear", "cosine")
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_DATASET = "lora_inverted"  # in data/: digits drawn dark on light, captioned "... inverted"
# Attention projections of every diffusers attention block: self- and cross-attention (UNets), and the
# text stream's projections of SD3's and Flux's joint attention. Suffixes of module names (LoRAConfig).
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                     "to_add_out")
# Flux.2's single-stream blocks: attention fused with the MLP, one projection in and one out.
ATTENTION_TARGETS += ("to_qkv_mlp_proj", "to_out")
# The UNets' ResNet convolutions (LoCon), with --conv.
CONV_TARGETS = ("conv1", "conv2")
# The feed-forward layers (the MLP after attention) of every diffusers transformer block, image stream: the
# UNets' transformer blocks, SD3's and Flux's joint blocks, Qwen-Image's img_mlp; Z-Image's SwiGLU (w1, w2,
# w3); Flux.2's double-stream blocks (linear_in, linear_out). With --feed-forward.
FEED_FORWARD_TARGETS = ("ff.net.0.proj", "ff.net.2", "img_mlp.net.0.proj", "img_mlp.net.2", "feed_forward.w1",
                        "feed_forward.w2", "feed_forward.w3", "ff.linear_in", "ff.linear_out")
# A CLIP text encoder's attention and MLP layers (kohya's text-encoder LoRA targets), with --text-encoder-lr.
TEXT_ENCODER_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
# the knobs of one objective only (a changed value for the other objective's model is an error)


class TrainConfigError(LoraLabError, ValueError):
    """A training configuration that cannot run: a value out of range, a missing path, a bad combination."""


@dataclass
class TrainConfig:
    """Everything one training run needs; the CLI (`lora-lab train --rank 32 ...`) and the notebook build it.

    Each field's `help` is the CLI's help text; `None` means "the default described there".
    """

    model: str | None = field(default=None, metadata={
        "help": "model family: sd15 | sdxl | sd3 | flux | chroma | z-image | qwen-image | flux2 (default: "
                "the one --base names, else sdxl)"})
    dataset: str | None = field(
        default=None,
        metadata={"help": "folder of images with same-stem .txt captions (default: the set in data/)"},
    )
    output: str = field(default="lora_output", metadata={"help": "output folder"})
    base: str | None = field(
        default=None,
        metadata={"help": "a local diffusers folder, or real:NAME (sd15 | sdxl | sd35-medium | sd35-large | "
                  "flux-dev: the published architecture with random weights, to measure or --dry-run a real "
                  "size) (default: the tiny base in data/)"},
    )
    base_dtype: str = field(
        default="auto",
        metadata={"help": "dtype the frozen base is loaded in: fp32 | bf16 | fp16 | auto (on CUDA bf16, fp16 "
                  "under fp16 mixed precision; fp32 on the CPU); the adapters stay fp32"},
    )
    resolution: int | None = field(
        default=None, metadata={"help": "image side in pixels (default: the base's)"}
    )
    skip_bad_images: bool = field(
        default=False,
        metadata={"help": "skip unreadable images and images without a caption, with a warning"},
    )
    buckets: bool = field(
        default=False,
        metadata={"help": "aspect-ratio buckets: each image keeps its shape at about resolution^2 pixels "
                  "(kohya-style), batches come from one bucket; off: every image is cropped square"},
    )
    reg_dataset: str | None = field(
        default=None,
        metadata={"help": "folder of regularization images in the base's own style, with captions: "
                  "prior preservation (DreamBooth; kohya's reg images), their loss added to each step"},
    )
    prior_loss_weight: float = field(
        default=1.0, metadata={"help": "weight of the regularization images' loss (with --reg-dataset)"}
    )
    caption_dropout: float = field(
        default=0.0,
        metadata={"help": "probability that an example is trained with the pipeline's unconditional "
                  "input (SDXL: zeros, others: the empty prompt) instead of its caption, so "
                  "classifier-free guidance's negative branch learns the new data too"},
    )
    masked_loss: bool = field(
        default=False,
        metadata={"help": "train only where each image's mask says: NAME.mask.png beside NAME.png "
                  "(greyscale, the image's size; white trains, black is ignored, grey weighs between), "
                  "resized and cropped as its image, area-averaged onto the latent grid (kohya's "
                  "--masked_loss); each example's loss averaged over its mask's weight; regularization "
                  "images train whole"})
    alpha_mask: bool = field(
        default=False,
        metadata={"help": "with --masked-loss: each image's alpha channel is its mask (kohya's "
                  "--alpha_mask)"})
    flip: bool = field(
        default=False,
        metadata={"help": "mirror each training example left-right with probability 1/2 at each step, "
                  "captions untouched; the VAE's latent of each mirrored image is cached too (the latents' "
                  "host memory doubles) (kohya's --flip_aug)"})
    # the adapter
    rank: int = field(default=16, metadata={"help": "LoRA rank r"})
    alpha: float | None = field(default=None, metadata={"help": "LoRA alpha (default: = rank, i.e. scale 1)"})
    dora: bool = field(default=False, metadata={"help": "DoRA: also learn a per-output-channel magnitude"})
    adapter: str = field(
        default="lora",
        metadata={"help": "lora | lokr (LyCORIS LoKr: dW = kron(W1, W2), W2 = W2a W2b of --rank, whole where "
                  "--rank is at least half its larger side, as LyCORIS keeps it) | loha "
                  "(LyCORIS LoHa: dW = (W1a W1b) * (W2a W2b), each of --rank); lokr/loha files carry the "
                  "LyCORIS keys ComfyUI reads (lora.safetensors only: diffusers loads no SD/Flux LoKr)"})
    lokr_factor: int = field(
        default=-1, metadata={"help": "lokr: each dimension d splits as f x d/f (LyCORIS' factor; -1: the "
                                      "most square split)"})
    conv: bool = field(default=False, metadata={"help": "also adapt the denoiser's conv layers (LoCon)"})
    feed_forward: bool = field(
        default=False,
        metadata={"help": "also adapt the transformer blocks' feed-forward layers (ff.net.0.proj, ff.net.2): "
                  "a style that changes every pixel needs more than attention"})
    base_quantization: str | None = field(
        default=None, metadata={"help": "store the frozen denoiser's Linear weights quantized (QLoRA), each "
                                        "as it is loaded: int8 | int8-block | nf4 | fp8 | fp8-row"})
    text_encoder_quantization: str | None = field(
        default=None, metadata={"help": "cache with the text encoders' Linear weights quantized, each on the "
                                        "device as it arrives (--base-quantization's formats)"})
    # the optimization
    steps: int = field(default=1000, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=1, metadata={"help": "examples per micro-batch per process"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches accumulated per optimizer step"})
    lr: float = field(default=1e-4, metadata={"help": "peak learning rate"})
    schedule: str = field(default="constant", metadata={"help": "after warm-up: constant | linear | cosine"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps from lr/warmup to lr"})
    optimizer: str = field(
        default="adamw",
        metadata={"help": "adamw (torch) | adamw8bit (lora_lab) | bnb-adamw8bit (bitsandbytes) | prodigy "
                  "(prodigyopt; --lr multiplies its own step size estimate: 1.0) | adafactor (transformers)"},
    )
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay on the adapter"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip the global gradient norm (0: off)"})
    noise_offset: float = field(
        default=0.0,
        metadata={"help": "sd15/sdxl: add this times per-channel N(0,1) constants to the noise, so the model "
                  "can change an image's overall brightness (kohya's --noise_offset)"},
    )
    # the knobs of loss weighting, timesteps (weighting.py), EMA and LoRA+
    min_snr_gamma: float | None = field(
        default=None,
        metadata={"help": "sd15/sdxl: min-SNR-gamma loss weighting (Hang et al. 2023; 5 is the paper's), "
                  "min(snr, gamma)/snr for epsilon, /(snr+1) for v (default: off)"})
    debiased_estimation: bool = field(
        default=False,
        metadata={"help": "sd15/sdxl: weight each example's loss by 1/sqrt(snr) (v: 1/(snr+1)), kohya's "
                  "--debiased_estimation_loss"})
    loss: str = field(
        default="mse",
        metadata={"help": "the loss of the prediction: mse | l1 | huber | smooth_l1 (pseudo-Huber, threshold "
                  "by --huber-schedule; kohya's --loss_type; diffusion/losses.py)"})
    huber_schedule: str = field(
        default="snr",
        metadata={"help": "with --loss huber or smooth_l1: the threshold over timesteps: snr | exponential | "
                  "constant (kohya's --huber_schedule)"})
    huber_c: float = field(
        default=0.1, metadata={"help": "with --loss huber or smooth_l1: the threshold c in (0, 1] (kohya's "
                               "--huber_c)"})
    huber_scale: float = field(
        default=1.0, metadata={"help": "with --loss huber or smooth_l1: the exponential and constant "
                               "schedules' scale, > 0 (kohya's --huber_scale)"})
    timestep_sampling: str = field(
        default="logit-normal",
        metadata={"help": "sd3/flux: how sigmas are drawn: uniform | logit-normal (sigmoid of "
                  "N(logit_mean, logit_std^2)) | mode (with mode_scale) (Esser et al. 2024, sec. 3.1) | "
                  "chroma (its trainer's 2 - 7.7 (s - 1/2)^2, unshifted: chroma's default)"})
    logit_mean: float = field(default=0.0, metadata={"help": "sd3/flux: logit-normal's mean m"})
    logit_std: float = field(default=1.0, metadata={"help": "sd3/flux: logit-normal's standard deviation s"})
    mode_scale: float = field(
        default=1.29, metadata={"help": "sd3/flux: the mode sampling's scale, in [-1, 2/(pi-2)]"})
    timestep_shift: float | None = field(
        default=None,
        metadata={"help": "sd3/flux: a fixed shift s' = shift s/(1 + (shift-1) s) of the drawn sigmas "
                  "(default: the scheduler's: its shift, or with its use_dynamic_shifting the "
                  "resolution-dependent one)"})
    dynamic_shift: bool = field(
        default=False,
        metadata={"help": "sd3/flux: Flux's resolution-dependent shift e^mu, mu linear in the image's token "
                  "count (the scheduler's base/max shift), even where the scheduler does not use it"})
    loss_weighting: str = field(
        default="none",
        metadata={"help": "sd3/flux: the SD3 paper's loss weighting: none | sigma_sqrt | cosmap"})
    train_guidance: float = field(
        default=1.0, metadata={"help": "flux: the guidance-embedding value the denoiser sees while training"})
    ema_decay: float | None = field(
        default=None,
        metadata={"help": "keep an exponential moving average of the adapter with this decay in (0, 1), "
                  "saved beside the raw one as lora_ema.safetensors (default: off)"})
    ema_warmup: bool = field(
        default=True,
        metadata={"help": "with --ema-decay: the decay is 0 after step 1 (the average starts at the "
                  "weights), then min(decay, n/(n + 9)) after step n (off: decay from the first step)"})
    text_encoder_lr: float | None = field(
        default=None,
        metadata={"help": "also train a LoRA on the CLIP text encoders (sd15, sdxl, sd3: all; flux: CLIP-L, "
                  "not T5) at this lr; their embeddings are then computed at each step, and the encoders "
                  "stay on the device (default: off)"})
    loraplus_ratio: float | None = field(
        default=None,
        metadata={"help": "LoRA+ (Hayou et al. 2024): the up matrices B learn at ratio x lr (16 is the "
                  "paper's) (default: off, one lr)"})
    # memory features
    mixed_precision: str = field(
        default="no", metadata={"help": "autocast dtype: no | bf16 | fp16 (no: fp32 throughout)"}
    )
    keep_encoders: bool = field(
        default=False,
        metadata={"help": "keep the text encoders and VAE on the device for the whole run (default: on the "
                  "device only while caching the dataset and sampling)"},
    )
    vae_tiling: bool = field(
        default=False, metadata={"help": "decode samples in tiles (VAE tiling): less memory at large sizes"}
    )
    gradient_checkpointing: bool | str = field(
        default=False,
        metadata={"help": "recompute activations in backward: full | selective | every_k | budget:F (keep at "
                  "most the fraction F of the activation bytes) | none; true = full"},
    )
    cache_dir: str | None = field(
        default=None,
        metadata={"help": "cache the encoded data (latents, text embeddings) in this folder, one file per "
                  "encoder call keyed by all it depends on, memory-mapped when read: a later run with the "
                  "same base, data and settings reads them instead of encoding (default: off, in memory)"})
    cache_to_disk: bool = field(
        default=False, metadata={"help": "--cache-dir <output>/cache (a resumed run reads it)"})
    # a single-file base's parts, and block swapping (issue 31)
    clip_l: str | None = field(
        default=None, metadata={"help": "a single-file base's CLIP-L text encoder as a file (Flux; kohya's "
                                        "--clip_l), else the one inside --base FILE"})
    clip_g: str | None = field(
        default=None, metadata={"help": "a single-file base's CLIP-G text encoder as a file (SD3.5)"})
    t5xxl: str | None = field(
        default=None, metadata={"help": "a single-file base's T5-XXL as a file (Flux, SD3.5, Chroma)"})
    text_encoder: str | None = field(
        default=None, metadata={"help": "a single-file base's text encoder (Qwen3, Qwen2.5-VL, Mistral)"})
    vae: str | None = field(
        default=None, metadata={"help": "a single-file base's VAE as a file (Flux: BFL's ae.safetensors; "
                                        "kohya's --ae)"})
    blocks_to_swap: int = field(
        default=0, metadata={"help": "keep this many of the denoiser's blocks in (pinned) host memory, each "
                                     "copied to the device just before it runs, forward and backward "
                                     "(kohya's --blocks_to_swap): less memory, more copying"})
    # bookkeeping
    seed: int = field(
        default=0, metadata={"help": "seed of the adapter init, data order, noise and timesteps"}
    )
    save_every: int = field(
        default=0, metadata={"help": "write a checkpoint every N steps (0: only at the end)"}
    )
    keep_checkpoints: int = field(default=2, metadata={"help": "how many recent checkpoints to keep"})
    resume: bool = field(
        default=False, metadata={"help": "continue from the latest checkpoint in the output folder"}
    )
    sample_prompts: list[str] | None = field(
        default=None, metadata={"help": "prompts of the with/without sample grid (default: from the dataset)"}
    )
    sample_steps: int = field(
        default=20, metadata={"help": "denoising steps of the sample grid (0: no grid)"}
    )
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N"})
    progress: bool = field(default=True, metadata={"help": "show a tqdm progress bar"})
    # watching a run: samples and validation loss during training, logs, data folders (diffusion/watch.py,
    # diffusion/datasets.py, diffusion/runfile.py)
    sample_every: int = field(
        default=0,
        metadata={"help": "also sample the prompts (with the LoRA, fixed seeds) at step 0 and every N steps "
                  "into samples/step_NNNNNNN.png, and a strip over the steps at the end (0: only the "
                  "end's grid)"},
    )
    validation_split: float | None = field(
        default=None,
        metadata={"help": "hold out this fraction of the dataset's images (0 < F < 1, chosen by a fixed "
                  "seed) for the validation loss; they are never trained on"},
    )
    validation_dataset: str | None = field(
        default=None, metadata={"help": "a folder of held-out images with captions for the validation loss"}
    )
    validate_every: int = field(
        default=0,
        metadata={"help": "with a validation set: its loss at step 0, every N steps and at the end (0: at "
                  "step 0 and the end)"},
    )
    log_with: str | None = field(
        default=None,
        metadata={"help": "also log to: tensorboard (event files in <output>/tensorboard); loss.jsonl is "
                  "always written"},
    )
    datasets: list[dict] | None = field(
        default=None,
        metadata={"help": "several folders: [[datasets]] tables of path, repeats, caption_extension, is_reg "
                  "(a --config file only)"},
    )
    shuffle_captions: bool = field(
        default=False,
        metadata={"help": "shuffle each caption's comma-separated tags (the first --keep-tokens stay)"},
    )
    keep_tokens: int = field(
        default=0,
        metadata={"help": "with shuffling and tag dropout: the first K tags stay in place, never dropped"},
    )
    tag_dropout: float = field(
        default=0.0, metadata={"help": "probability that a tag (after the first --keep-tokens) is dropped"}
    )
    caption_variants: int = field(
        default=8,
        metadata={"help": "with shuffling or tag dropout: caption variants per image, encoded while caching "
                  "(the text encoders leave the device); each step draws one"},
    )

    def __post_init__(self) -> None:
        if self.model is None:  # the family the base names (a real model, a file's keys, a folder's index)
            try:
                self.model = base_family(self.base) or DEFAULT_MODEL
            except ModelLoadError as e:
                raise TrainConfigError(f"TrainConfig.base={self.base!r}: {e}") from None
        self.validate()

    def validate(self) -> None:
        """Raise TrainConfigError naming the first field whose value cannot run."""

        def bad(name: str, why: str) -> None:
            raise TrainConfigError(f"TrainConfig.{name}={getattr(self, name)!r}: {why}")

        check_bounds(self, bad)  # every number in its range (NaN passes every < and > test): bounds.py
        for name, allowed in [
            ("model", MODELS),
            ("optimizer", OPTIMIZERS),
            ("schedule", SCHEDULES),
            ("mixed_precision", MODES),
            ("base_dtype", ("auto", *BASE_DTYPES)),
        ]:
            if getattr(self, name) not in allowed:
                bad(name, f"must be one of {', '.join(allowed)}")
        if self.warmup_steps > self.steps:
            bad("warmup_steps", f"is longer than the run (steps={self.steps})")
        if {base := self.base_dtype, mixed := self.mixed_precision} == {"bf16", "fp16"}:
            bad("base_dtype", f"{base} under {mixed} mixed precision: torch's autocast to {mixed} fails on "
                f"{base} inputs (the UNet's torch.cat); use {mixed}, fp32 or auto")
        if self.resolution is not None and self.resolution % 8:
            bad("resolution", "must be a multiple of 8 (the VAE's downsampling)")
        if self.dataset is not None and not Path(self.dataset).is_dir():
            bad("dataset", "is not a folder")
        existing = next(p for p in (Path(self.output).absolute(), *Path(self.output).absolute().parents)
                        if p.exists())
        if not existing.is_dir():
            bad("output", f"{existing} is a file, not a folder")
        if self.checkpointing_policy() is not None:
            try:
                parse_policy(self.checkpointing_policy())
            except CheckpointingError as e:
                bad("gradient_checkpointing", str(e))
        if self.reg_dataset is not None and not Path(self.reg_dataset).is_dir():
            bad("reg_dataset", "is not a folder")
        if self.base is not None:
            try:
                check_base(self.base, model_kind(self.model), self.base_parts())
            except ModelLoadError as e:
                bad("base", str(e))
        given = [p for p, f in self.base_parts().items() if f is not None]
        if given and not str(self.base or "").endswith(".safetensors"):
            bad(given[0], "is a part of a single-file base: give --base FILE.safetensors too")
        if self.blocks_to_swap and not self.gradient_checkpointing:
            bad("blocks_to_swap", "needs gradient checkpointing (a swapped block's recomputation in backward "
                "brings it back to the device)")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            bad("device", "must be auto, cpu, cuda or cuda:N")
        check_watch_fields(self, bad)
        check_knob_fields(self, bad)
        check_adapter_fields(self, bad)
        check_quantization_fields(self, bad)

    def keeps_encoders(self) -> bool:
        """The text encoders and VAE stay on the device all run: keep_encoders, or a text-encoder LoRA."""
        return self.keep_encoders or self.text_encoder_lr is not None

    def base_parts(self) -> dict[str, str | None]:
        """A single-file base's part files by part (None: inside the base file)."""
        return {"clip_l": self.clip_l, "clip_g": self.clip_g, "t5xxl": self.t5xxl,
                "text_encoder": self.text_encoder, "vae": self.vae}

    def base_torch_dtype(self, device: torch.device) -> torch.dtype:
        """The frozen base's dtype: `base_dtype`, or for "auto" on CUDA bf16 (fp16 under fp16 mixed precision:
        autocast to one half precision cannot take the other's inputs) and fp32 elsewhere."""
        cuda = "fp16" if self.mixed_precision == "fp16" else "bf16"
        name = self.base_dtype if self.base_dtype != "auto" else (cuda if device.type == "cuda" else "fp32")
        return BASE_DTYPES[name]

    def checkpointing_policy(self) -> str | None:
        """The checkpointing policy for enable_checkpointing, or None for none."""
        value = self.gradient_checkpointing
        return None if value is False or value == "none" else "full" if value is True else value

    def adapter_alpha(self) -> float:
        """LoRA alpha: `alpha`, or the rank (scale 1)."""
        return float(self.rank if self.alpha is None else self.alpha)

    def adapter_targets(self) -> list[str]:
        """The suffixes of the denoiser's module names that get adapters: attention, with `conv` the convs,
        with `feed_forward` the transformer blocks' feed-forward layers."""
        return (list(ATTENTION_TARGETS) + (list(CONV_TARGETS) if self.conv else [])
                + (list(FEED_FORWARD_TARGETS) if self.feed_forward else []))

    def dataset_dir(self) -> Path:
        """The training images' folder: `dataset`, or the set shipped in data/."""
        return Path(self.dataset) if self.dataset is not None else DATA_DIR / DEFAULT_DATASET

    def resolved(self, base: Path | str | None, resolution: int, dtype: torch.dtype) -> TrainConfig:
        """The config with every default made explicit: what config.json records and a resume must match."""
        def absolute(path):  # config.json repeats the run from any folder (`--config out/config.json`)
            return None if path is None or str(path).startswith("real:") else str(Path(path).absolute())

        return replace(
            self, base=absolute(base), resolution=resolution, alpha=self.adapter_alpha(),
            base_dtype=next(k for k, v in BASE_DTYPES.items() if v == dtype),
            dataset=None if self.datasets is not None else absolute(self.dataset_dir()),
            reg_dataset=absolute(self.reg_dataset), validation_dataset=absolute(self.validation_dataset),
            **{part: absolute(file) for part, file in self.base_parts().items()},
            datasets=None if self.datasets is None else [{**t, "path": absolute(t["path"])}
                                                         for t in self.datasets])

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> TrainConfig:
        """The config a run wrote as config.json (unknown keys are an error, not silently dropped)."""
        data = json.loads(Path(path).read_text())
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise TrainConfigError(f"{path}: unknown TrainConfig field(s) {unknown}")
        return cls(**data)
