"""lora_lab: adapter training on frozen models in PyTorch, verified."""

__version__ = "0.1.0"

from .checkpoint import CheckpointError, checkpoint, disable_checkpointing, enable_checkpointing
from .diffusion import (
    DatasetError,
    ImageCaptionDataset,
    ModelLoadError,
    ObjectiveError,
    build_pipeline,
    encode_prompts,
    objective_for,
    sample,
)
from .diffusion.train import NonFiniteLossError, TrainConfig, TrainConfigError, train
from .formats import (
    LoraFile,
    LoraFormatError,
    LoraModule,
    convert_lora,
    diffusers_name,
    kohya_name,
    load_lora,
    save_lora,
)
from .kernels import KernelBackendError, KernelInputError, resolve_backend
from .layers import Frozen, Linear, Trainable
from .lora import (
    LoRAConfig,
    LoRAConfigError,
    LoRAConv2d,
    LoRALinear,
    LoRAModule,
    LoRAStateError,
    LoRATargetError,
    add_lora,
    lora_disabled,
    lora_modules,
    lora_state_dict,
    merge_lora,
    remove_lora,
    set_lora_strength,
    unmerge_lora,
)
from .memory import (
    BlockStack,
    MemoryMeasurementUnavailable,
    optimizer_state_bytes,
    peak_memory,
    saved_activation_bytes,
)
from .merge import AppliedLoras, LoRAStack, apply_loras, load_merged, merge_loras, save_merged
from .optim import Adam8bit, AdamW8bit, OptimizerError, dequantize_blockwise, dynamic_map, quantize_blockwise
from .params import (
    LoraLabError,
    TensorKindError,
    WeightFileError,
    count_parameters,
    load_frozen,
    var_from_tensor,
)
from .precision import MixedPrecision, PrecisionError
from .quiet import install_log_filters as _install_log_filters

__all__ = [
    "Adam8bit",
    "AdamW8bit",
    "AppliedLoras",
    "BlockStack",
    "CheckpointError",
    "DatasetError",
    "Frozen",
    "ImageCaptionDataset",
    "KernelBackendError",
    "KernelInputError",
    "Linear",
    "LoRAConfig",
    "LoRAConfigError",
    "LoRAConv2d",
    "LoRALinear",
    "LoRAModule",
    "LoRAStack",
    "LoRAStateError",
    "LoRATargetError",
    "LoraFile",
    "LoraFormatError",
    "LoraLabError",
    "LoraModule",
    "MemoryMeasurementUnavailable",
    "MixedPrecision",
    "ModelLoadError",
    "NonFiniteLossError",
    "ObjectiveError",
    "OptimizerError",
    "PrecisionError",
    "TensorKindError",
    "TrainConfig",
    "TrainConfigError",
    "Trainable",
    "WeightFileError",
    "add_lora",
    "apply_loras",
    "build_pipeline",
    "checkpoint",
    "convert_lora",
    "count_parameters",
    "dequantize_blockwise",
    "diffusers_name",
    "disable_checkpointing",
    "dynamic_map",
    "enable_checkpointing",
    "encode_prompts",
    "kohya_name",
    "load_frozen",
    "load_lora",
    "load_merged",
    "lora_disabled",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "merge_loras",
    "objective_for",
    "optimizer_state_bytes",
    "peak_memory",
    "quantize_blockwise",
    "remove_lora",
    "resolve_backend",
    "sample",
    "save_lora",
    "save_merged",
    "saved_activation_bytes",
    "set_lora_strength",
    "train",
    "unmerge_lora",
    "var_from_tensor",]

_install_log_filters()  # the few third-party import-time log lines that say nothing here (see quiet.py)
