"""lora_lab: adapter training on frozen models in PyTorch, verified.

The names a notebook or a user types; everything else is in its subpackage (docs/architecture.md has the map):

    functional/  tensor maths          lora/      adapters             checkpointing/  recomputation
    quant/       quantized base        models/    model kinds          formats/        LoRA files
    diffusion/   the trainer           planning/  memory plans         notebook/       the workbook's helpers
    kernels/     Triton kernels
"""

from ._version import __version__ as __version__
from .checkpointing import checkpointed, checkpointing_plan, disable_checkpointing, enable_checkpointing
from .diffusion import TrainConfig, sample, train
from .errors import LoraLabError
from .formats import LoraFile, LoraWeights, convert_lora, load_lora, save_lora
from .layers import Frozen, Linear, Trainable, count_parameters
from .lora import (
    LoRAConfig,
    LoRAConv2d,
    LoRALinear,
    LoRAModule,
    add_lora,
    lora_disabled,
    lora_modules,
    lora_state_dict,
    merge_lora,
    remove_lora,
    set_lora_strength,
    unmerge_lora,
)
from .memory import BlockStack, LiveBytes, optimizer_state_bytes, peak_memory, saved_activation_bytes
from .merge import apply_loras, load_merged, merge_loras, save_merged
from .models import build_pipeline
from .optim import Adam8bit, AdamW8bit
from .params import load_frozen, var_from_tensor
from .planning import MemoryPlan, fit_vram, plan_memory
from .precision import MixedPrecision
from .quant import QuantLinear, quantize_base
from .quiet import install_log_filters as _install_log_filters

__all__ = [
    "Adam8bit", "AdamW8bit", "BlockStack", "Frozen", "Linear", "LiveBytes", "LoRAConfig", "LoRAConv2d",
    "LoRALinear", "LoRAModule", "LoraFile", "LoraLabError", "LoraWeights", "MemoryPlan", "MixedPrecision",
    "QuantLinear", "TrainConfig", "Trainable", "add_lora", "apply_loras", "build_pipeline", "checkpointed",
    "checkpointing_plan", "convert_lora", "count_parameters", "disable_checkpointing", "enable_checkpointing",
    "fit_vram", "load_frozen", "load_lora", "load_merged", "lora_disabled", "lora_modules", "lora_state_dict",
    "merge_lora", "merge_loras", "optimizer_state_bytes", "peak_memory", "plan_memory", "quantize_base",
    "remove_lora", "sample", "save_lora", "save_merged", "saved_activation_bytes", "set_lora_strength",
    "train", "unmerge_lora", "var_from_tensor",
]

_install_log_filters()  # the few third-party import-time log lines that say nothing here (see quiet.py)
