"""Block swapping: the swapped blocks' weights really leave the model (host copies, put back after each
run), are copied in for the forward and again for the checkpointed recomputation, and the gradients equal
the unswapped run's, with a plain and with a quantized base."""

from __future__ import annotations

import copy

import pytest
import torch

from lora_lab import LoRAConfig, add_lora
from lora_lab.checkpointing import BlockSwapError, block_swap, enable_block_swap, enable_checkpointing
from lora_lab.models import model_kind
from lora_lab.models.builders import build_components, predict
from lora_lab.quant import quantize_base


def _grads(model, kind, swap_n: int | None, policy: str = "full"):
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    embeds = {"prompt_embeds": torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2)),
              "pooled_prompt_embeds": torch.randn(2, 32, generator=torch.Generator().manual_seed(3))}
    if swap_n:
        swap = enable_block_swap(model, kind.checkpoint_blocks(), swap_n, "cpu")
        frozen = {t.data_ptr() for t in [*swap.blocks[0].parameters(), *swap.blocks[0].buffers()]
                  if not t.requires_grad}
        assert frozen == {t.data_ptr() for t in swap.host[0].values()}  # between runs: the host copies
    enable_checkpointing(model, kind.checkpoint_blocks(), policy)
    model.train()
    out = predict(kind, model, x, torch.tensor([0.3, 0.7]), embeds)
    out.square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("quantized, policy", [(False, "full"), (True, "full"), (False, "selective"),
                                               (True, "budget:0.5")])
def test_swapped_gradients_equal_unswapped(quantized, policy):
    """Under every policy: selective and budgets number a block's ops, and the swap's copies (which copies a
    block call makes depends on what the call before prefetched) must not shift that numbering."""
    kind = model_kind("flux")
    base = build_components("flux", 0, only=["transformer"])["transformer"]
    if quantized:
        quantize_base(base.requires_grad_(False), "int8")
    add_lora(base, LoRAConfig(rank=4, alpha=4.0, targets=["to_q", "to_k", "to_v", "proj_mlp"]))
    for n, p in base.named_parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)  # B nonzero: every adapter's gradient matters
    swapped = copy.deepcopy(base)
    want = _grads(base, kind, None, policy)
    got = _grads(swapped, kind, 2, policy)
    assert want.keys() == got.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)
    swap = block_swap(swapped)
    # the copy path ran: each swapped block copied in for its forward and again for its recomputation (a
    # budget's first forward also copies each block once more, to measure it)
    copies = 3 if policy.startswith("budget") else 2
    assert swap.copied == copies * swap.bytes_per_step() // 2 > 0


def test_swap_refuses_too_many_blocks_and_wrong_order():
    kind = model_kind("flux")
    model = build_components("flux", 0, only=["transformer"])["transformer"]
    with pytest.raises(BlockSwapError, match="3 blocks"):
        enable_block_swap(model, kind.checkpoint_blocks(), 4, "cpu")
    enable_checkpointing(model, kind.checkpoint_blocks())
    with pytest.raises(BlockSwapError, match="before gradient checkpointing"):
        enable_block_swap(model, kind.checkpoint_blocks(), 1, "cpu")


@pytest.mark.slow
def test_training_with_swapping_has_the_same_losses(digits_folder, tmp_path):
    from lora_lab.diffusion import TrainConfig, TrainConfigError, train

    common = dict(model="flux", dataset=str(digits_folder(count=2)), steps=2, rank=4, sample_steps=0,
                  device="cpu", progress=False, gradient_checkpointing=True)
    plain = train(TrainConfig(output=str(tmp_path / "a"), **common))
    swapped = train(TrainConfig(output=str(tmp_path / "b"), blocks_to_swap=2, **common))
    assert swapped.losses == plain.losses
    with pytest.raises(TrainConfigError, match="needs gradient checkpointing"):
        TrainConfig(blocks_to_swap=2)


@pytest.mark.slow
def test_plan_counts_swapped_blocks_off_the_device():
    """The plan's frozen weights lose the swapped blocks' bytes, and it says the bytes each step copies:
    those blocks twice (forward, recomputation)."""
    from lora_lab.checkpointing.swap import swappable
    from lora_lab.planning import plan_memory

    kind = model_kind("flux")
    model = build_components("flux", 0, only=["transformer"])["transformer"]
    blocks = swappable(model, kind.checkpoint_blocks())[-2:]
    block_bytes = sum(p.numel() * 4 for b in blocks for p in b.parameters())
    total = sum(p.numel() * 4 for p in model.parameters())
    p = plan_memory("flux", size="tiny", gradient_checkpointing=True, blocks_to_swap=2, device="cpu",
                    sample_steps=0, rank=4)
    assert p.moved_per_step == 2 * block_bytes
    assert p.parts["frozen weights"] == total - block_bytes
    assert "2 blocks in host memory" in p.table()


def test_fit_swaps_the_fewest_blocks_as_its_last_resort(monkeypatch):
    """Where nothing else fits, fit_vram plans every block swapped, then the fewest its room allows, and
    says the bytes copied per step (plans faked: each swapped block takes 10 off a peak of 100, copies 10
    twice)."""
    from lora_lab.planning import fit_vram, planner

    calls = []

    def fake_plan(config, **kw):
        blocks_to_swap = config.blocks_to_swap
        calls.append(blocks_to_swap)
        peak = 100 - 10 * blocks_to_swap
        options = {k: getattr(config, k) for k in ("batch_size", "grad_accum", "gradient_checkpointing",
                                                   "optimizer", "vae_tiling", "blocks_to_swap")}
        plan = planner.MemoryPlan(config.model, "tiny", options, "flash",
                                  {"train step": peak}, {"frozen weights": peak}, peak, "train step",
                                  "backward", 0, 0, moved_per_step=20 * blocks_to_swap)
        return plan

    monkeypatch.setattr(planner, "plan_memory", fake_plan)
    r = fit_vram(75, "flux", size="tiny")  # tiny flux: 3 blocks; all 3 swapped: 70 fits, 2 would be 80
    assert r.settings["blocks_to_swap"] == 3 and calls[-1] == 3
    assert "3 blocks swapped" in r.reason() and "60 B from host memory" in r.reason()
    calls.clear()
    r = fit_vram(95, "flux", size="tiny")  # room for two blocks on the device: one swapped is planned, fits
    assert calls[-2:] == [3, 1] and r.settings["blocks_to_swap"] == 1
    with pytest.raises(Exception, match="nothing fits"):
        fit_vram(65, "flux", size="tiny")
