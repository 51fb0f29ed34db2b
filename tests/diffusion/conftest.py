"""The diffusion tests' shared fixture: `cache_phase(config)`, a training run through its cache phase."""

from __future__ import annotations

import pytest

from lora_lab.diffusion import TrainConfig
from lora_lab.diffusion.trainer import TrainingRun


@pytest.fixture
def cache_phase():
    """cache_phase(config) -> the TrainingRun through its cache phase only: its `data`, `empty`, `samples`,
    `val`, `store`."""
    def through_cache(config: TrainConfig) -> TrainingRun:
        run = TrainingRun(config)
        run.setup()
        run.open_base()
        run.cache()
        return run

    return through_cache
