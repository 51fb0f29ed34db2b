"""planning/run.py: each phase's host memory beside its device memory, against a measured run's cache phase,
with and without the disk cache (whose latents and prompts' embeddings are mapped files' pages)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")
from lora_lab.diffusion import TrainConfig
from lora_lab.diffusion.trainer import TrainingRun
from lora_lab.planning import plan_memory

# every part of the host cache: held-out copies, caption variants, the empty caption, the sample prompts
FIELDS = dict(model="sdxl", rank=4, steps=2, sample_steps=1, progress=False, shuffle_captions=True,
              caption_variants=2, caption_dropout=0.1, validation_split=0.2, base_dtype="fp32")


def measured_host(run: TrainingRun, encoders: int) -> int:
    """What a run holds in host memory after its cache phase, as a GPU run parks it there: every distinct
    storage of its cached tensors that is the process's own memory (not a mapped file: resizable), and the
    text encoders' and VAE's bytes (`encoders`)."""
    c = run.cached
    tensors = [*(c.samples[1].values() if c.samples else ()), *(c.empty.values() if c.empty else ())]
    for part in (c.data, c.reg, c.val):
        if part is not None:
            tensors += [*part.latents, *part.embeds.values()]
    own = {s.data_ptr(): s.nbytes() for t in tensors for s in [t.untyped_storage()] if s.resizable()}
    return sum(own.values()) + encoders


@pytest.mark.slow  # two tiny plans (~8 s each on a loaded machine) and two cache phases
def test_the_host_bytes_of_a_gpu_plan_are_a_measured_runs_with_and_without_the_disk_cache(tmp_path):
    plans, measured, latents = {}, {}, 0
    for disk in (False, True):
        fields = dict(FIELDS, cache_to_disk=disk)
        run = TrainingRun(TrainConfig(**fields, device="cpu", output=str(tmp_path / f"run{disk}")))
        run.setup()
        run.open_base()
        encoders = sum(t.untyped_storage().nbytes() for name in run.encoders.names
                       for m in [getattr(run.pipe, name)] for t in (*m.parameters(), *m.buffers()))
        run.cache()
        measured[disk] = measured_host(run, encoders)
        latents = sum(t.numel() * t.element_size() for t in run.data.latents)
        plans[disk] = plan_memory(TrainConfig(**fields, device="cuda", output=str(tmp_path / "plan")),
                                  cache=False)
        # exact: nothing but the cache and the parked encoders on the host (no swapping)
        assert plans[disk].host["load"] == plans[disk].host["train step"] == measured[disk], disk
    assert measured[False] - measured[True] >= latents // 2  # the mapped latents: off the process's memory
    assert plans[True].phases == plans[False].phases  # the device holds the same
    assert "host" in plans[True].table().splitlines()[1]
