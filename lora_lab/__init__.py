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

__all__ = [
    "Frozen",
    "Linear",
    "LoraLabError",
    "TensorKindError",
    "Trainable",
    "WeightFileError",
    "count_parameters",
    "load_frozen",
    "var_from_tensor",
    # lora.py / dora.py (issue 3)
    "LoRAConfig",
    "LoRAConfigError",
    "LoRAConv2d",
    "LoRALinear",
    "LoRAModule",
    "LoRAStateError",
    "LoRATargetError",
    "add_lora",
    "lora_disabled",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "remove_lora",
    "set_lora_strength",
    "unmerge_lora",
    # formats.py / merge.py (issue 4)
    "AppliedLoras",
    "LoRAStack",
    "LoraFile",
    "LoraFormatError",
    "LoraModule",
    "apply_loras",
    "convert_lora",
    "diffusers_name",
    "kohya_name",
    "load_lora",
    "load_merged",
    "merge_loras",
    "save_lora",
    "save_merged",
    # diffusion/ models, objectives, data, sampling (issue 7, dcore)
    "DatasetError",
    "ImageCaptionDataset",
    "ModelLoadError",
    "ObjectiveError",
    "build_pipeline",
    "encode_prompts",
    "objective_for",
    "sample",
    # checkpoint.py / memory.py / optim.py / precision.py (issue 5)
    "Adam8bit",
    "AdamW8bit",
    "BlockStack",
    "CheckpointError",
    "MemoryMeasurementUnavailable",
    "MixedPrecision",
    "OptimizerError",
    "PrecisionError",
    "checkpoint",
    "dequantize_blockwise",
    "disable_checkpointing",
    "dynamic_map",
    "enable_checkpointing",
    "optimizer_state_bytes",
    "peak_memory",
    "quantize_blockwise",
    "saved_activation_bytes",
    # kernels/ (issue 6): the kernel functions live in lora_lab.kernels.lora/dora/adam8bit, imported
    # on use (on a CPU they need TRITON_INTERPRET=1 set before their first import)
    "KernelBackendError",
    "KernelInputError",
    "resolve_backend",
]
