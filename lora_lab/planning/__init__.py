"""Memory planning: the peak memory of a LoRA training run from the real model graph on fake tensors, before
the run, and the fastest options that fit a card's memory.

    fakedevice.py  a device without memory: fake tensors, the GPU's attention kernel and autocast rules
    run.py         plan_run: the trainer's own run (a TrainingRun subclass) on fake tensors, each phase's peak
    examples.py    the examples a run caches, read from its config's data; the cache phase in bytes
    measure.py     a real run measured phase by phase (what plans are checked against)
    planner.py     plan_memory(TrainConfig | model, ...) -> MemoryPlan (each phase's peak, the step's parts),
                   plan_config (the TrainConfig of a model's plan), parse_bytes
    fit.py         fit_vram(vram, ...) -> FitResult (the fastest option that fits), options_table, fit_config
"""

from .fit import FitResult, fit_config, fit_vram, options_table
from .measure import measure_run, measure_training_step
from .planner import MemoryPlan, PlanError, format_bytes, parse_bytes, plan_config, plan_memory, plan_options

__all__ = ["FitResult", "MemoryPlan", "PlanError", "fit_config", "fit_vram", "format_bytes", "measure_run",
           "measure_training_step", "options_table", "parse_bytes", "plan_config", "plan_memory",
           "plan_options"]
