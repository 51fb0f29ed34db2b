"""diffusion/train.py: config checks, the lr schedule, exact resume after a real kill, NaN handling,
the memory features, and the saved LoRA loading into diffusers with the same image as lora_lab's sampling."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from safetensors.torch import load_file

from lora_lab.cli import main as cli_main
from lora_lab.diffusion.train import (
    NonFiniteLossError,
    TrainConfig,
    TrainConfigError,
    global_batch_indices,
    lr_factor,
    train,
)

REPO = Path(__file__).resolve().parents[1]
SEED = 5
N_IMAGES = 6  # a small dataset: 6 digits, 32 x 32
DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
FAST = {"rank": 4, "lr": 1e-3, "batch_size": 2, "sample_steps": 0, "progress": False, "seed": SEED}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Six scikit-learn digits, white on black, upscaled to 32 x 32, captioned 'a digit <name>'."""
    from PIL import Image
    from sklearn.datasets import load_digits

    folder = tmp_path_factory.mktemp("digits")
    d = load_digits()
    for i in range(N_IMAGES):
        img = (d.images[i] * 16).clip(0, 255).astype(np.uint8)
        Image.fromarray(img).resize((32, 32), Image.BILINEAR).convert("RGB").save(folder / f"{i:02d}.png")
        (folder / f"{i:02d}.txt").write_text(f"a digit {DIGITS[d.target[i]]}")
    return folder


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- config and schedule


@pytest.mark.parametrize(
    "field, value",
    [("model", "sd2"), ("rank", 0), ("optimizer", "sgd"), ("mixed_precision", "fp8"), ("lr", -1.0),
     ("warmup_steps", 2000), ("resolution", 30), ("dataset", "/no/such/folder"), ("schedule", "step")],
)
def test_bad_config_is_a_clear_error(field, value):
    with pytest.raises(TrainConfigError, match=f"TrainConfig.{field}="):
        TrainConfig(**{field: value})


def test_cli_bad_value_exits_2(capsys, tmp_path):
    assert cli_main(["train", "--model", "sdxl", "--dataset", str(tmp_path / "none"), "--output", str(tmp_path)]) == 2
    assert "lora-lab: error: TrainConfig.dataset=" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["train", "--rank", "many"])
    assert e.value.code == 2


def test_lr_schedule_warmup_then_cosine_and_linear():
    cfg = TrainConfig(steps=10, warmup_steps=2, schedule="cosine")
    got = [lr_factor(s, cfg) for s in range(10)]
    want = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
    assert got == pytest.approx(want)
    lin = TrainConfig(steps=4, schedule="linear")
    assert [lr_factor(s, lin) for s in range(4)] == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_data_order_is_a_permutation_per_epoch():
    n, g = 7, 3
    seen = torch.cat([global_batch_indices(SEED, s, g, n) for s in range(7)])  # 21 slots = 3 epochs
    for e in range(3):
        assert sorted(seen[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert not torch.equal(seen[:n], seen[n:2 * n])  # a new order each epoch


# ----------------------------------------------------------------------------- resume, NaN


def test_killed_run_resumed_ends_bit_for_bit_like_an_uninterrupted_one(dataset, tmp_path):
    """SIGKILL a CLI run after its first checkpoint, resume it, compare with a run that was never stopped."""
    steps, every = 12, 4
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "lora_lab.cli", "train", "--model", "flux", "--dataset", str(dataset),
           "--output", str(killed), "--steps", str(steps), "--save-every", str(every), "--rank", "4",
           "--lr", "1e-3", "--batch-size", "2", "--seed", str(SEED), "--sample-steps", "0", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    first = killed / "checkpoints" / f"step_{every:07d}.pt"
    deadline = time.time() + 240
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0].decode()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed:\n{out[-2000:]}"
    assert not (killed / "lora.safetensors").exists()
    done_before_kill = sorted(p.name for p in (killed / "checkpoints").glob("step_*.pt"))
    assert done_before_kill and done_before_kill[-1] != f"step_{steps:07d}.pt"

    base = dict(model="flux", dataset=str(dataset), steps=steps, save_every=every, **FAST)
    resumed = train(TrainConfig(output=str(killed), resume=True, **base))
    whole = train(TrainConfig(output=str(tmp_path / "whole"), **base))
    assert resumed.steps == whole.steps == steps
    assert resumed.losses == whole.losses  # the whole history, the killed part included
    for key in ("lora_kohya", "lora_diffusers"):
        assert _same_bits(_tensors(resumed.outputs[key]), _tensors(whole.outputs[key])), key
    log = [json.loads(line) for line in (killed / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, steps + 1))  # no duplicated steps after the resume


def test_fresh_run_into_a_used_folder_and_resume_without_checkpoint_are_errors(dataset, tmp_path):
    with pytest.raises(TrainConfigError, match="holds no checkpoint"):
        train(TrainConfig(model="flux", dataset=str(dataset), output=str(tmp_path), resume=True, steps=1, **FAST))


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_checkpoint(dataset, tmp_path, monkeypatch):
    from lora_lab.diffusion import objectives

    real, calls = objectives.diffusion_loss, []

    def loss_nan_at_step_4(pred, target):
        calls.append(1)
        loss = real(pred, target)
        return loss * float("nan") if len(calls) == 4 else loss

    monkeypatch.setattr(objectives, "diffusion_loss", loss_nan_at_step_4)
    out = tmp_path / "nan"
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 4 .*step_0000002\.pt"):
        train(TrainConfig(model="flux", dataset=str(dataset), output=str(out), steps=6, save_every=2, **FAST))
    kept = sorted(p.name for p in (out / "checkpoints").glob("*.pt"))
    assert kept == ["step_0000002.pt"]
    state = torch.load(out / "checkpoints" / kept[0], weights_only=False)
    assert all(torch.isfinite(v).all() for v in state["adapter"].values())
    assert not (out / "lora.safetensors").exists()


# ----------------------------------------------------------------------------- the files in diffusers


@pytest.mark.parametrize("model", ["sd15", "sdxl", "sd3", "flux"])
def test_saved_lora_loads_in_diffusers_and_gives_lora_labs_image(dataset, tmp_path, model):
    """pipe.load_lora_weights(file) on a fresh pipeline samples the same image as the trained pipeline."""
    from lora_lab.diffusion.models import build_pipeline, shipped_base
    from lora_lab.diffusion.sampling import sample

    result = train(TrainConfig(model=model, dataset=str(dataset), output=str(tmp_path), steps=3, rank=4, lr=2e-2,
                               batch_size=2, seed=SEED, sample_steps=0, progress=False))
    prompt, steps = "a digit three", 4
    ours = sample(result.pipe, prompt, seed=SEED, steps=steps)  # (1, 3, H, W) in [0, 1]
    formats = ["lora_diffusers", "lora_kohya"] if model in ("sd15", "sdxl") else ["lora_diffusers"]
    for key in formats:
        pipe = build_pipeline(model, shipped_base(model))
        plain = sample(pipe, prompt, seed=SEED, steps=steps)
        pipe.load_lora_weights(str(result.outputs[key]))
        theirs = sample(pipe, prompt, seed=SEED, steps=steps)
        effect = (ours - plain).abs().max().item()
        assert effect > 0.02, f"the LoRA hardly changes the image ({effect:.3g}): the test would prove nothing"
        torch.testing.assert_close(theirs, ours, atol=2e-3, rtol=0, msg=f"{model} {key}")
    if model == "sdxl":  # `lora-lab sample` with the kohya file: a [base | base + LoRA] two-row PNG
        from PIL import Image

        png = tmp_path / "sample.png"
        args = ["sample", "--model", model, "--lora", f"{result.outputs['lora_kohya']}:1.0", "--prompt", prompt,
                "--seed", str(SEED), "--steps", str(steps), "--output", str(png)]
        assert cli_main(args) == 0
        grid = np.asarray(Image.open(png).convert("L"), dtype=float)  # 1-pixel padding around and between rows
        h = (grid.shape[0] - 3) // 2
        top, bottom = grid[1:1 + h], grid[2 + h:2 + 2 * h]
        assert top.shape == bottom.shape and np.abs(top - bottom).max() > 5  # the LoRA row differs


# ----------------------------------------------------------------------------- notebook 07


@pytest.mark.parametrize("model", ["sd15", "sdxl", "sd3", "flux"])
def test_notebook_07_runs_for_each_model(run_notebook, model):
    """Small parameters: the mechanics claims must hold (the quality targets need the full run, `make run`)."""
    data = run_notebook("07_diffusion_lora", MODEL=model, STEPS=8, BATCH_SIZE=8, SAMPLE_STEPS=2, EVAL_SEEDS=1,
                        UNET_STEPS=8, CHECK_TARGETS=False)
    assert data["passed"], data.get("error") or data["claims"]
    n = data["numbers"]
    assert n["adapted_modules"] > 0 and 0 < n["trainable_fraction"] < 0.2
    assert n["strength0_vs_base_max_abs_diff"] < 1e-5
    assert n["diffusers_vs_lora_lab_max_abs_diff"] < 2e-3
    assert set(n["inverted_rate_by_strength"]) == {"0.0", "0.25", "0.5", "0.75", "1.0", "1.25", "1.5"}


# ----------------------------------------------------------------------------- DoRA, LoCon and the memory features


def test_checkpointing_gives_the_same_dora_locon_adapter_and_mixed_precision_trains(dataset, tmp_path):
    """Gradient checkpointing recomputes the same activations: the trained adapter must not change.
    bf16 / fp16 autocast must train to a finite loss near fp32's (8-bit AdamW, DoRA and LoCon on)."""
    base = dict(model="sdxl", dataset=str(dataset), steps=2, dora=True, conv=True, optimizer="adamw8bit", **FAST)
    plain = train(TrainConfig(output=str(tmp_path / "plain"), **base))
    ckpt = train(TrainConfig(output=str(tmp_path / "ckpt"), gradient_checkpointing=True, **base))
    a, b = _tensors(plain.outputs["lora_kohya"]), _tensors(ckpt.outputs["lora_kohya"])
    assert any(k.endswith(".dora_scale") for k in a) and any("conv1" in k for k in a)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    for dtype in ("bf16", "fp16"):
        low = train(TrainConfig(output=str(tmp_path / dtype), mixed_precision=dtype, gradient_checkpointing=True, **base))
        assert all(math.isfinite(x) for x in low.losses)
        assert low.losses[0] == pytest.approx(plain.losses[0], rel=0.05)  # the same batch, rounded inputs
