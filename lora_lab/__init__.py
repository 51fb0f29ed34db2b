"""lora_lab: adapter training on frozen models in PyTorch, verified."""

__version__ = "0.1.0"

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
from .merge import AppliedLoras, LoRAStack, apply_loras, load_merged, merge_loras, save_merged
from .params import (
    LoraLabError,
    TensorKindError,
    WeightFileError,
    count_parameters,
    load_frozen,
    var_from_tensor,
)

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
]
