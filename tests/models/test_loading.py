"""Loading a base for training: the denoiser module by module in the base dtype, quantized as it loads, from
the same sources the trainer uses; the text encoders and VAE on the device only while they work."""

import weakref

import pytest
import torch

from lora_lab.diffusion import TrainConfig, train
from lora_lab.diffusion.trainer import PHASES
from lora_lab.memory import LiveBytes, model_bytes
from lora_lab.models import build_pipeline, denoiser, model_kind, shipped_base
from lora_lab.models.bases import open_base
from lora_lab.models.kinds import ModelLoadError
from lora_lab.models.loading import FolderWeights, RandomWeights, fill, skeleton
from lora_lab.quant import QuantLinear

FAST = {"rank": 4, "steps": 2, "sample_steps": 0, "progress": False}


@pytest.mark.parametrize("kind", ["sd15", "sdxl", "sd3", "flux"])
def test_a_filled_skeleton_equals_the_pipeline_diffusers_loads(kind):
    base = shipped_base(kind)
    opened = open_base(model_kind(kind), base, torch.float32)
    assert all(p.is_meta for p in denoiser(opened.pipe).parameters())  # nothing loaded yet
    fill(denoiser(opened.pipe), opened.source, dtype=torch.float32, device="cpu")
    ref, got = denoiser(build_pipeline(kind, base)).state_dict(), denoiser(opened.pipe).state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_fill_casts_to_the_base_dtype_and_quantizes_every_linear():
    opened = open_base(model_kind("sdxl"), shipped_base("sdxl"), torch.bfloat16)
    model = fill(denoiser(opened.pipe), opened.source, dtype=torch.bfloat16, device="cpu", quantization="nf4")
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())


def test_quantized_loading_never_holds_the_full_precision_denoiser():
    """Peak bytes while loading NF4: at most the quantized model plus the largest layer in the base dtype (and
    one chunk's quantization temporaries); the whole denoiser in that dtype never exists."""
    kind, base = "sdxl", shipped_base("sdxl")
    opened = open_base(model_kind(kind), base, torch.float32)
    sizes = [m.weight.numel() * 4 for m in denoiser(opened.pipe).modules() if type(m) is torch.nn.Linear]
    full = sum(p.numel() * 4 for p in denoiser(opened.pipe).parameters())
    tracker = LiveBytes()
    with tracker:
        model = fill(denoiser(opened.pipe), opened.source, dtype=torch.float32, device="cpu",
                     quantization="nf4")
    quantized = model_bytes(model)
    assert quantized < 0.6 * full
    # the largest layer in fp32, its fp32 working copy and the chunk's codes
    assert tracker.peak <= quantized + 3 * max(sizes)
    assert tracker.peak < full


def test_fill_refuses_weights_that_do_not_fit_the_model(tmp_path):
    from diffusers import UNet2DConditionModel

    from lora_lab.models.builders import CONFIGS

    other = dict(CONFIGS["sdxl"]["unet"], block_out_channels=[32, 32])
    model = skeleton(UNet2DConditionModel, other)
    with pytest.raises(ModelLoadError, match="shape|missing|unexpected"):
        fill(model, FolderWeights(shipped_base("sdxl") / "unet"), dtype=torch.float32, device="cpu")
    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ModelLoadError, match="pickle files are not read"):
        FolderWeights(tmp_path)


def test_random_weights_are_seeded_per_tensor():
    like = torch.empty(4, 6, device="meta")
    a, b = RandomWeights(0).tensor("x.weight", like), RandomWeights(0).tensor("x.weight", like)
    assert torch.equal(a, b) and not torch.equal(a, RandomWeights(1).tensor("x.weight", like))
    assert torch.equal(RandomWeights(0).tensor("norm.weight", torch.empty(6, device="meta")), torch.ones(6))


def test_training_on_a_bf16_base(tmp_path):
    result = train(TrainConfig(model="sdxl", output=str(tmp_path), base_dtype="bf16", **FAST))
    model = denoiser(result.pipe)
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert TrainConfig.from_json(result.outputs["config"]).base_dtype == "bf16"


def test_auto_base_dtype_is_fp32_on_the_cpu_and_bf16_on_cuda():
    config = TrainConfig()
    assert config.base_torch_dtype(torch.device("cpu")) == torch.float32
    assert config.base_torch_dtype(torch.device("cuda")) == torch.bfloat16
    assert TrainConfig(base_dtype="fp16").base_torch_dtype(torch.device("cpu")) == torch.float16


def test_lora_lab_train_says_which_dtype_auto_chose(tmp_path, capsys):
    from lora_lab.cli import main

    assert main(["train", "--model", "sdxl", "--output", str(tmp_path / "out"), "--steps", "1", "--rank", "2",
                 "--sample-steps", "0", "--no-progress"]) == 0
    assert "the frozen base loads in float32 (--base-dtype auto on cpu" in capsys.readouterr().err
    assert main(["train", "--model", "sdxl", "--output", str(tmp_path / "b"), "--steps", "1", "--rank", "2",
                 "--sample-steps", "0", "--no-progress", "--base-dtype", "fp32"]) == 0
    assert "loads in" not in capsys.readouterr().err  # chosen, so nothing to say


def _encoder_refs(pipe) -> list:
    return [weakref.ref(next(getattr(pipe, n).parameters()))
            for n in ("text_encoder", "text_encoder_2", "vae")]


def test_encoders_leave_the_device_after_caching_and_only_the_vae_comes_back_to_sample(tmp_path, monkeypatch):
    """During the training steps, the text encoders and VAE are gone (a CPU run drops them: the host is its
    device); while sampling only the VAE is back (the sample prompts were encoded while caching); the pipeline
    returned is whole. --keep-encoders keeps them all."""
    from lora_lab.diffusion import stages, trainer

    seen = {}
    real_loop, real_grid = trainer.TrainingRun.train_loop, stages.sample_grid
    names = ("text_encoder", "text_encoder_2", "vae")

    def spy_loop(run):
        seen["during steps"] = [getattr(run.pipe, n) for n in names]
        return real_loop(run)

    def spy_grid(pipe, *args, **kwargs):
        seen["sampling"] = [getattr(pipe, n) is not None for n in names]
        return real_grid(pipe, *args, **kwargs)

    monkeypatch.setattr(trainer.TrainingRun, "train_loop", spy_loop)
    monkeypatch.setattr(stages, "sample_grid", spy_grid)
    sampled = {**FAST, "sample_steps": 1}
    result = train(TrainConfig(model="sdxl", output=str(tmp_path / "a"), **sampled))
    assert seen["during steps"] == [None, None, None]
    assert seen["sampling"] == [False, False, True]
    assert all(getattr(result.pipe, n) is not None for n in names)
    kept = train(TrainConfig(model="sdxl", output=str(tmp_path / "b"), keep_encoders=True, **sampled))
    assert all(m is not None for m in seen["during steps"]) and seen["sampling"] == [True, True, True]
    assert kept.pipe.vae is not None


def test_device_bytes_during_the_steps_are_the_denoiser_adapter_optimizer_and_cache(tmp_path):
    """Live bytes at the end of a training step, measured: the denoiser, its adapter, the optimizer's state
    and the cached dataset, nothing else (within the small tensors the loop keeps: lr, losses, rng)."""
    from lora_lab.diffusion import trainer
    from lora_lab.memory import optimizer_state_bytes

    parts = {}
    tracker = LiveBytes()
    real_save = trainer.save_checkpoint

    def at_the_last_save(run, learner, main):  # after the last step, before saving: what the steps hold
        model = denoiser(train_pipe[0])
        parts["live"] = tracker.current
        parts["denoiser"] = model_bytes(model)
        parts["optimizer"] = optimizer_state_bytes(learner.optimizer)
        return real_save(run, learner, main)

    train_pipe = []
    real_encode = trainer.TrainingRun.encode_data

    def spy_encode(run):
        out = real_encode(run)
        train_pipe.append(run.encoders.pipe)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*out[0].latents, *out[0].embeds.values()]}  # a group's latents share one
        parts["cache"] = sum(storages.values())
        return out

    trainer.save_checkpoint, trainer.TrainingRun.encode_data = at_the_last_save, spy_encode
    try:
        with tracker:
            train(TrainConfig(model="sdxl", output=str(tmp_path), **FAST))
    finally:
        trainer.save_checkpoint, trainer.TrainingRun.encode_data = real_save, real_encode
    expected = parts["denoiser"] + parts["optimizer"] + parts["cache"]
    assert expected <= parts["live"] <= expected * 1.02 + 64 * 1024


def test_a_run_goes_through_the_phases_in_the_order_the_plan_runs_them(tmp_path):
    order = []
    from contextlib import contextmanager

    @contextmanager
    def phase(name):
        order.append(name)
        yield

    train(TrainConfig(model="sd3", output=str(tmp_path), **{**FAST, "sample_steps": 1}), phase=phase)
    assert list(dict.fromkeys(order)) == list(PHASES)
