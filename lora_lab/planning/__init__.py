"""Memory planning: the peak memory of a LoRA training run from the real model graph on fake tensors, before
the run, and the fastest options that fit a card's memory.

    fakedevice.py  a device without memory: fake tensors, the GPU's attention kernel and autocast rules
    step.py        one training step of the trainer, in live bytes (and a real step measured, to check plans)
    planner.py     plan_memory(...) -> MemoryPlan (the peak and its parts), plan_options, parse_bytes
    fit.py         fit_vram(vram, ...) -> FitResult (the fastest option that fits), options_table, fit_config
"""

from .fit import FitResult, fit_config, fit_vram, options_table
from .planner import MemoryPlan, PlanError, format_bytes, parse_bytes, plan_memory, plan_options
from .step import measure_training_step

__all__ = ["FitResult", "MemoryPlan", "PlanError", "fit_config", "fit_vram", "format_bytes",
           "measure_training_step", "options_table", "parse_bytes", "plan_memory", "plan_options"]
