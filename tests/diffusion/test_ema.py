"""diffusion/ema.py: the EMA's decay schedule and update against the written-out form and diffusers' EMAModel;
the trainer keeps it in checkpoints and writes it as its own LoRA file, which the sampler takes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lora_lab.diffusion import TrainConfig, train
from lora_lab.diffusion.checkpoints import load_checkpoint
from lora_lab.diffusion.ema import AdapterEMA, ema_decay

FAST = {"rank": 4, "lr": 1e-2, "batch_size": 2, "sample_steps": 0, "progress": False, "seed": 3}


def test_decay_schedule_is_the_written_out_warmup_and_diffusers_emamodel():
    from diffusers.training_utils import EMAModel

    ref = EMAModel([torch.nn.Parameter(torch.zeros(1))], decay=0.999, use_ema_warmup=False)
    for n in range(1, 400, 7):
        k = n - 1
        expect = 0.0 if k == 0 else min(0.999, (1 + k) / (10 + k))
        assert ema_decay(n, 0.999) == pytest.approx(expect, abs=1e-15) == pytest.approx(ref.get_decay(n))
        assert ema_decay(n, 0.9, warmup=False) == 0.9


def test_the_average_follows_diffusers_emamodel_step_by_step():
    from diffusers.training_utils import EMAModel

    p = torch.nn.Parameter(torch.randn(5, 3))
    ema, ref = AdapterEMA([("w", p)], 0.95), EMAModel([p], decay=0.95, use_ema_warmup=False)
    g = torch.Generator().manual_seed(0)
    for n in range(1, 30):
        with torch.no_grad():
            p.add_(torch.randn(p.shape, generator=g))
        ema.update([("w", p)], n)
        ref.step([p])
        torch.testing.assert_close(ema.shadow["w"], ref.shadow_params[0], rtol=1e-5, atol=1e-6)
    kept = p.detach().clone()
    with ema.applied([("w", p)]):
        torch.testing.assert_close(p.detach(), ema.shadow["w"])
    torch.testing.assert_close(p.detach(), kept)  # the trained weights are back


def test_the_trainer_checkpoints_and_saves_the_average(digits_folder, tmp_path):
    from lora_lab.diffusion import sample
    from lora_lab.diffusion.trainer import TrainResult
    from lora_lab.lora import remove_lora
    from lora_lab.models import denoiser

    out = tmp_path / "ema"
    result: TrainResult = train(TrainConfig(model="flux", dataset=str(digits_folder(6)), output=str(out),
                                            steps=2, save_every=1, ema_decay=0.9, **FAST))
    first, second = (load_checkpoint(out / "checkpoints" / f"step_000000{s}.pt") for s in (1, 2))
    d = ema_decay(2, 0.9)  # after step 1 the average is the weights (d_1 = 0), after step 2:
    for name, w2 in second["adapter"].items():
        torch.testing.assert_close(first["ema"][name], first["adapter"][name])
        torch.testing.assert_close(second["ema"][name], d * first["adapter"][name] + (1 - d) * w2)
    raw, averaged = load_file(str(out / "lora.safetensors")), load_file(str(out / "lora_ema.safetensors"))
    assert set(raw) == set(averaged) and (out / "pytorch_lora_weights_ema.safetensors").is_file()
    ema_values = list(second["ema"].values())
    changed = [k for k in averaged if not torch.equal(averaged[k], raw[k])]
    assert changed  # the average is not the last weights
    for k in changed:  # each tensor of the EMA file is one of the averaged weights
        assert any(t.shape == averaged[k].shape and torch.allclose(t, averaged[k].float())
                   for t in ema_values)
    remove_lora(denoiser(result.pipe), merge=False)  # the base again: the sampler applies each file itself
    images = [sample(result.pipe, "a digit 1", steps=2, loras=[(out / f, 1.0)])
              for f in ("lora.safetensors", "lora_ema.safetensors")]  # the sampler takes either
    assert images[0].shape == images[1].shape and not torch.equal(images[0], images[1])
