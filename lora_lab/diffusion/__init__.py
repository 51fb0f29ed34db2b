"""LoRA training of diffusion models through diffusers: the trainer, its data, objectives and sampling.

    trainer.py     train(TrainConfig(...)) -> TrainResult: a TrainingRun through its stages
    stages.py      the stages' plain functions: the cache's key, the LoRA files, the sample grid
    step.py        one optimizer step: its draws, micro-batches and their loss
    config.py      TrainConfig, its validation (TrainConfigError), the adapter's targets, the lr schedule
    state.py       a run's state on disk: checkpoints (written, read, checked), resumption
    data.py        image+caption folders, aspect-ratio buckets, the dataset encoded once
    datasets.py    several folders (kohya's N_name/, [[datasets]]), the held-out split, caption variants
    watch.py       during a run: the validation loss, samples every N steps, loss.jsonl and TensorBoard
    runfile.py     lora-lab train --config run.toml
    options.py     the checks of the fields for watching a run and for several folders
    objectives.py  DDPM (epsilon / v) and flow matching behind one interface
    sampling.py    sample(pipe, prompts, loras=...) with and without LoRA files, image_grid

The models themselves (kinds, builders, real configs) are `lora_lab.models`.
"""

from .checkpoints import ResumeError
from .data import BucketBatchSampler, DatasetError, ImageCaptionDataset, aspect_buckets, collate
from .objectives import DDPM, FlowMatching, ObjectiveError, diffusion_loss, objective_for
from .sampling import image_grid, loras_applied, sample
from .state import NonFiniteLossError
from .trainer import TrainConfig, TrainConfigError, TrainResult, train

__all__ = [
    "DDPM", "BucketBatchSampler", "DatasetError", "FlowMatching", "ImageCaptionDataset", "NonFiniteLossError",
    "ObjectiveError", "ResumeError",
    "TrainConfig", "TrainConfigError", "TrainResult", "aspect_buckets", "collate", "diffusion_loss",
    "image_grid", "loras_applied", "objective_for", "sample", "train",
]
