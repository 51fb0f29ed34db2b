"""A real training run measured phase by phase: what plans are checked against.

    measure_run(TrainConfig(...))            -> {phase: peak bytes} of a real run on the CPU (LiveBytes)
    measure_run(config, tracker="torch")     -> the same by PyTorch's MemTracker
    measure_run(config, tracker="cuda")      -> the same from torch.cuda.max_memory_allocated (a GPU run)
    measure_phases(config, ("live", "torch")) -> {tracker: {phase: peak bytes}} from one run
    measure_training_step(TrainConfig(...))  -> {"peak", "optimizer_state"}: the second step

Before measuring, the process-wide lookup tables are made (`fakedevice.warm_caches`), as a plan makes them.
On the CPU, `memory.LiveBytes` counts every tensor storage at the dispatch level from the first op that
makes or reads it until it is freed (as a plan counts fake tensors); `train(config, phase=...)` enters each
phase of the run, and each phase's peak is the largest live total while it runs. On a GPU,
`torch.cuda.reset_peak_memory_stats` at each phase's start and `max_memory_allocated` at its end.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..diffusion.trainer import PHASES, TrainingRun, train
from ..memory import LiveBytes, optimizer_state_bytes
from ..torch_private import frozen_aware_mem_tracker, restart_peak
from .fakedevice import warm_caches


class CudaPhases:
    """Each phase's peak of `torch.cuda.max_memory_allocated` (phases do not nest in the trainer)."""

    def __init__(self, device: torch.device | str = "cuda"):
        self.device = torch.device(device)
        self.phase_peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), peak)


class TorchPhases:
    """Each phase's peak by PyTorch's own `torch.distributed._tools.mem_tracker.MemTracker` (a second counter
    beside LiveBytes, any device). MemTracker keeps one peak for its whole context: each phase starts it again
    from the current total (`torch_private.restart_peak`). MemTracker hooks every parameter's gradient, which
    a frozen one refuses, and refuses a model called a second time: `torch_private.frozen_aware_mem_tracker`
    is told not to hook frozen parameters (the adapter's gradients are still counted, as the tensors they
    are) and starts its per-module statistics (not used here) again."""

    def __init__(self):
        self.tracker = frozen_aware_mem_tracker()
        self.phase_peaks: dict[str, int] = {}

    def __enter__(self):
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        return self.tracker.__exit__(*exc)

    def track(self, modules) -> None:
        self.tracker.track_external(*modules)

    def _total(self, kind: str) -> int:
        return sum(snap["Total"] for dev, snap in self.tracker.get_tracker_snapshot(kind).items()
                   if dev.type != "meta")  # a skeleton's meta tensors take no memory

    @contextlib.contextmanager
    def phase(self, name: str):
        restart_peak(self.tracker)
        try:
            yield
        finally:
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self._total("peak"))


class MeasuredRun(TrainingRun):
    """The trainer's run, its base's tensors counted from the moment it is opened (also those no op reads,
    the VAE's decoder) by each of `counters`."""

    def __init__(self, config, phase, counters):
        super().__init__(config, phase)
        self.counters = counters

    def open_base(self) -> None:
        super().open_base()
        modules = [m for m in self.pipe.components.values() if isinstance(m, torch.nn.Module)]
        for counter in self.counters:
            if isinstance(counter, TorchPhases):
                counter.track(modules)
            elif isinstance(counter, LiveBytes):
                counter.track(t for m in modules for t in (*m.parameters(), *m.buffers()) if not t.is_meta)


def measure_run(config, tracker: str = "live") -> dict[str, int]:
    """Run `train(config)` and return each phase's peak of device memory: "live" (LiveBytes, any device; a CPU
    run counts the host), "torch" (PyTorch's MemTracker, likewise) or "cuda" (max_memory_allocated). Phases
    the run does not go through are 0."""
    return measure_phases(config, (tracker,))[tracker]


def measure_phases(config, trackers=("live", "torch")) -> dict[str, dict[str, int]]:
    """One run of `train(config)` counted by several trackers at once: {tracker: {phase: peak bytes}}. The
    process-wide lookup tables (quantization codes) are made first, as a plan makes them."""
    warm_caches()
    make = {"live": LiveBytes, "torch": TorchPhases,
            "cuda": lambda: CudaPhases(config.device if config.device != "auto" else "cuda")}
    counters = {name: make[name]() for name in trackers}

    @contextlib.contextmanager
    def phase(name: str):
        with contextlib.ExitStack() as stack:
            for counter in counters.values():
                stack.enter_context(counter.phase(name))
            yield

    with contextlib.ExitStack() as stack:
        for counter in counters.values():
            if not isinstance(counter, CudaPhases):
                stack.enter_context(counter)
        MeasuredRun(config, phase, counters=list(counters.values())).run()
    return {name: {p: c.phase_peaks.get(p, 0) for p in PHASES} for name, c in counters.items()}


def measure_training_step(config) -> dict[str, int]:
    """Run `train(config)` for 2 steps on the CPU and measure its second step with `LiveBytes`.

    Returns {"peak": live bytes at the peak between the end of optimizer step 1 and the end of step 2
    (everything live then: the denoiser, cached data, adapter, optimizer state, activations),
    "optimizer_state": `optimizer_state_bytes` after step 2}. For checking
    plans (`device="cpu"`) against the trainer on tiny models.
    """
    config = replace(config, steps=2, sample_steps=0, progress=False, save_every=0, device="cpu")
    warm_caches()
    tracker = LiveBytes()
    result: dict[str, int] = {}
    steps = [0]

    def after_step(opt, args, kwargs):
        steps[0] += 1
        if steps[0] == 1:
            tracker.reset_peak()
        elif steps[0] == 2:
            result["peak"] = tracker.peak
            result["optimizer_state"] = optimizer_state_bytes(opt)

    handle = register_optimizer_step_post_hook(after_step)
    try:
        with tracker:
            train(config)
    finally:
        handle.remove()
    return result
