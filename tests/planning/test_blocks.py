"""Identical blocks in a plan (lora_lab/planning/blocks.py): the sample phase runs one block of each run of
identical blocks, and the training step replays the blocks between a run's first and last; both count what
running every block counts, to the byte, and a run whose blocks differ is not replayed."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lora_lab.memory import LiveBytes
from lora_lab.planning import blocks, run
from lora_lab.planning.planner import plan_memory

TINY = dict(size="tiny", device="cpu", base_dtype="fp32", rank=4, mixed_precision="no", sample_steps=0)


def test_one_block_of_each_run_of_identical_blocks_runs_and_all_come_back():
    stack = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8), torch.nn.Linear(8, 8),
             torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    model = torch.nn.Module()
    model.transformer_blocks = torch.nn.ModuleList(stack)
    with torch.no_grad(), blocks.one_of_identical_blocks(model):
        assert list(model.transformer_blocks) == [stack[0], stack[2], stack[3]]
    assert list(model.transformer_blocks) == stack
    with pytest.raises(RuntimeError, match="without gradients"), blocks.one_of_identical_blocks(model):
        pass


@pytest.mark.slow
def test_the_sample_phase_is_the_same_with_one_block_of_each_run(monkeypatch):
    """Tiny SDXL's UNet has stacks of 2 identical transformer blocks: the sample phase's peak (and every other
    phase) is the same when every block runs."""
    options = dict(TINY, sample_steps=1, cache=False)
    fast = plan_memory("sdxl", **options)
    monkeypatch.setattr(run, "one_of_identical_blocks", lambda model: contextlib.nullcontext())
    every = plan_memory("sdxl", **options)
    assert fast.phases == every.phases and fast.phases["sample"] > 0


class Block(nn.Module):
    """A pre-norm residual block with a frozen layer and a trainable one; `extra` (not in its signature) makes
    it keep one more tensor for backward."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.norm, self.frozen, self.train_me = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)
        self.frozen.requires_grad_(False)
        self.extra = extra

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = torch.relu(self.frozen(self.norm(x)))
        if self.extra:
            h = torch.sigmoid(h)
        return x + self.train_me(h) * scale


def _step(model: nn.Module, replay: bool, micro_batches: int) -> tuple:
    """Forward and backward of `model.transformer_blocks` under LiveBytes: what it counted."""
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = None
    tracker, rules = LiveBytes(), SimpleNamespace(used={})
    replayed = blocks.replayed_blocks(model, tracker, rules) if replay else contextlib.nullcontext()
    with tracker, torch.autograd.graph.saved_tensors_hooks(tracker.mark_saved, lambda t: t), replayed:
        tracker.track(model.parameters())
        for _ in range(micro_batches):
            tracker.in_forward = True
            x = torch.randn(64, 16, requires_grad=True) @ torch.ones(16, 16)  # a non-leaf, as a stack's input
            for block in model.transformer_blocks:
                x = block(x, scale=0.5)
            tracker.in_forward = False
            x.square().sum().backward()
            del x
    return (tracker.peak, tracker.saved_bytes, tracker.current,
            [p.grad is not None for p in model.parameters() if p.requires_grad])


def _count_replays(monkeypatch, calls: list) -> None:
    real = blocks._Replay.apply
    monkeypatch.setattr(blocks._Replay, "apply", lambda *a: calls.append(1) or real(*a))


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_replayed_blocks_count_what_every_block_counts(micro_batches, monkeypatch):
    """Six identical blocks on real tensors: the same peak, saved bytes and live bytes after the step with the
    middle blocks replayed, and every trainable parameter gets its gradient."""
    model = nn.Module()
    model.transformer_blocks = nn.ModuleList(Block() for _ in range(6))
    calls = []
    _count_replays(monkeypatch, calls)
    every = _step(model, replay=False, micro_batches=micro_batches)
    replayed = _step(model, replay=True, micro_batches=micro_batches)
    assert replayed == every and all(every[3])
    assert len(calls) == 2 * micro_batches  # blocks 0, 1, 4 and 5 run, 2 and 3 are replayed


def test_a_run_whose_blocks_differ_is_not_replayed():
    """The last block keeps more than the first: the check of its forward fails, and the plan would be made
    again with every block running."""
    model = nn.Module()
    model.transformer_blocks = nn.ModuleList([Block(), Block(), Block(), Block(), Block(), Block(extra=True)])
    with pytest.raises(blocks.Unreplayable, match="block's forward differs from the first's"):
        _step(model, replay=True, micro_batches=1)


@pytest.fixture(scope="module")
def deep_sdxl(tmp_path_factory) -> Path:
    """The shipped tiny SDXL's configs with stacks of 6 identical transformer blocks."""
    folder = tmp_path_factory.mktemp("deep_sdxl")
    source = Path(__file__).resolve().parents[2] / "data" / "base" / "sdxl"
    for config in source.rglob("*.json"):
        (folder / config.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(config, folder / config.relative_to(source))
    for tokenizer in source.rglob("*.txt"):
        shutil.copy(tokenizer, folder / tokenizer.relative_to(source))
    unet = folder / "unet" / "config.json"
    cfg = json.loads(unet.read_text())
    unet.write_text(json.dumps({**cfg, "transformer_layers_per_block": [6, 6]}))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, "full", "selective"])
def test_a_plan_is_the_same_with_the_middle_blocks_replayed(deep_sdxl, monkeypatch, checkpointing):
    """An SDXL UNet with runs of 6 identical blocks, planned for CUDA (bf16 autocast: its cache of weight
    casts) with two micro-batches, without checkpointing and with each per-block policy (the recomputation
    runs inside the backward window a replay reproduces): every field of the plan (each phase, the step's
    parts, the saved activations, the attention kernels) is the same with the middle blocks replayed as with
    every block running, and the replayed plan is not one made again after a failed check."""
    kw = dict(TINY, size=str(deep_sdxl), resolution=16, cache=False, device="cuda", mixed_precision="bf16",
              grad_accum=2, gradient_checkpointing=checkpointing)
    calls, plans = [], []
    _count_replays(monkeypatch, calls)
    monkeypatch.setattr(run, "_plan_once", lambda *a, real=run._plan_once, **k: plans.append(k["replay"])
                        or real(*a, **k))
    replayed = plan_memory("sdxl", **kw)
    assert plans == [True] and calls
    monkeypatch.setattr(run, "replayed_blocks", lambda *a: contextlib.nullcontext())
    every = plan_memory("sdxl", **kw)
    assert {**vars(replayed), "seconds": 0} == {**vars(every), "seconds": 0}


def test_a_policy_that_chooses_by_a_blocks_place_plans_every_block(deep_sdxl, monkeypatch):
    """every_k checkpoints segments of k block calls: the blocks of a run do not do alike, so none is
    replayed (the plan runs every block from the start, not after a failed check)."""
    plans = []
    monkeypatch.setattr(run, "_plan_once", lambda *a, real=run._plan_once, **k: plans.append(k["replay"])
                        or real(*a, **k))
    plan_memory("sdxl", **dict(TINY, size=str(deep_sdxl), resolution=16, cache=False,
                               gradient_checkpointing="every_k"))
    assert plans == [False]
