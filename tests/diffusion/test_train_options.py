"""diffusion/trainer.py's data options: aspect-ratio buckets, prior preservation (reg_dataset,
prior_loss_weight) and caption dropout; their validation and CLI flags."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from safetensors.torch import load_file

from lora_lab.cli import build_parser
from lora_lab.diffusion import TrainConfig, TrainConfigError, train
from lora_lab.diffusion import step as trainer_step
from lora_lab.diffusion.data import bucket_batch_indices
from lora_lab.diffusion.encoded import EncodedExamples

SEED = 3
FAST = {"rank": 4, "lr": 1e-2, "batch_size": 2, "sample_steps": 0, "progress": False, "seed": SEED}
SIZES = [(24, 24), (24, 24), (16, 32), (16, 32), (32, 16), (32, 16), (24, 24)]  # (H, W) of each image


# `--dist loadgroup` (the Makefile) spreads single tests over the workers; this file stays together:
# the module's fixture is built once, on one worker
pytestmark = pytest.mark.xdist_group("test_train_options")


@pytest.fixture(scope="module")
def folders(digits_folder) -> dict[str, Path]:
    return {"mixed": digits_folder(sizes=SIZES, caption="a digit {digit}"),
            "reg": digits_folder(sizes=[(32, 32)] * 4, caption="a digit {digit}")}


@pytest.mark.parametrize("field, value", [("reg_dataset", "/no/such/folder"), ("prior_loss_weight", -1.0),
                                          ("prior_loss_weight", float("inf")), ("caption_dropout", 1.0),
                                          ("caption_dropout", -0.1)])
def test_bad_option_is_a_clear_error(field, value):
    with pytest.raises(TrainConfigError, match=f"TrainConfig.{field}="):
        TrainConfig(**{field: value})


def test_cli_flags(folders):
    args = build_parser().parse_args(["train", "--reg-dataset", str(folders["reg"]),
                                      "--prior-loss-weight", "0.5", "--caption-dropout", "0.1", "--buckets"])
    assert (args.reg_dataset, args.prior_loss_weight, args.caption_dropout, args.buckets) == \
        (str(folders["reg"]), 0.5, 0.1, True)
    assert build_parser().parse_args(["train"]).buckets is False
    assert build_parser().parse_args(["train", "--feed-forward"]).feed_forward is True
    targets = TrainConfig(feed_forward=True).adapter_targets()
    assert "ff.net.2" in targets and "to_q" in targets and "ff.net.2" not in TrainConfig().adapter_targets()


def test_bucket_batches_are_one_size_cover_the_epoch_and_repeat():
    sizes = [(16, 16)] * 5 + [(8, 24)] * 3 + [(24, 8)] * 2
    steps_per_epoch = 3 + 2 + 1  # batches of 2: ceil(5/2) + ceil(3/2) + ceil(2/2)
    seen = []
    for step in range(steps_per_epoch):
        idx = bucket_batch_indices(SEED, step, 2, sizes)
        assert len(idx) == 2 and len({sizes[i] for i in idx.tolist()}) == 1
        # a function of (seed, step)
        torch.testing.assert_close(idx, bucket_batch_indices(SEED, step, 2, sizes))
        seen += idx.tolist()
    assert set(seen) == set(range(len(sizes)))  # every example in one epoch (a short batch is filled up)


def _x0_shapes(monkeypatch) -> list:
    shapes = []
    real = trainer_step.denoising_loss

    def spy(config, kind, pipe, objective, x0, *rest, **kw):
        shapes.append(tuple(x0.shape[-2:]))
        return real(config, kind, pipe, objective, x0, *rest, **kw)

    monkeypatch.setattr(trainer_step, "denoising_loss", spy)
    return shapes


@pytest.mark.slow
def test_buckets_train_mixed_sizes_without_cropping_square(folders, tmp_path, monkeypatch):
    shapes = _x0_shapes(monkeypatch)
    cfg = dict(model="sdxl", dataset=str(folders["mixed"]), resolution=24, steps=4, **FAST)
    result = train(TrainConfig(output=str(tmp_path / "b"), buckets=True, **cfg))
    assert all(np.isfinite(result.losses))
    # latents are half the image size (the tiny VAE); 16x32 and 32x16 images keep their aspect ratio
    assert {(8, 16), (16, 8)} <= set(shapes) and len(shapes) == 4
    shapes.clear()
    train(TrainConfig(output=str(tmp_path / "square"), buckets=False, **cfg))
    assert set(shapes) == {(12, 12)}


@pytest.mark.slow
def test_prior_preservation_adds_the_weighted_reg_loss(folders, tmp_path, monkeypatch):
    cfg = dict(model="sd3", dataset=str(folders["mixed"]), resolution=16, steps=3, **FAST)
    plain = train(TrainConfig(output=str(tmp_path / "plain"), **cfg))
    zero = train(TrainConfig(output=str(tmp_path / "zero"), reg_dataset=str(folders["reg"]),
                             prior_loss_weight=0.0, **cfg))
    shapes = _x0_shapes(monkeypatch)
    one = train(TrainConfig(output=str(tmp_path / "one"), reg_dataset=str(folders["reg"]),
                            prior_loss_weight=1.0, **cfg))
    assert len(shapes) == 2 * 3  # one style and one regularization micro-batch per step
    a, b, c = (load_file(str(r.outputs["lora_diffusers"])) for r in (plain, zero, one))
    assert all(torch.equal(a[k], b[k]) for k in a)  # weight 0: exactly the run without regularization
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert one.losses[0] > plain.losses[0]  # the first step's loss adds the (positive) reg loss


def test_caption_dropout_swaps_in_the_empty_prompt():
    embeds = {"prompt_embeds": torch.arange(12.0).reshape(3, 2, 2), "pooled_prompt_embeds": torch.ones(3, 4)}
    empty = {"prompt_embeds": torch.full((1, 2, 2), -1.0), "pooled_prompt_embeds": torch.zeros(1, 4)}
    ex = EncodedExamples([torch.zeros(4, 2, 2)] * 3, embeds, ["a", "b", "c"], [(4, 4)] * 3)
    out = ex.embeds_of(torch.tensor([2, 0]), torch.tensor([True, False]), empty, "cpu")
    torch.testing.assert_close(out["prompt_embeds"],
                               torch.stack([-torch.ones(2, 2), embeds["prompt_embeds"][0]]))
    torch.testing.assert_close(out["pooled_prompt_embeds"], torch.tensor([[0.0] * 4, [1.0] * 4]))


@pytest.mark.slow
def test_the_base_dtype_goes_with_the_mixed_precision():
    """torch's autocast to one half precision fails on the other's inputs (the UNet's torch.cat): "auto"
    loads the base in fp16 on CUDA under fp16 mixed precision, and a bf16 base under fp16 (or the reverse) is
    refused by name; the plan of an fp16 run on CUDA (which raised torch's RuntimeError) is made."""
    from lora_lab.planning import plan_memory

    cuda = torch.device("cuda")
    assert TrainConfig(mixed_precision="fp16").base_torch_dtype(cuda) == torch.float16
    assert TrainConfig(mixed_precision="bf16").base_torch_dtype(cuda) == torch.bfloat16
    assert TrainConfig(mixed_precision="fp16").base_torch_dtype(torch.device("cpu")) == torch.float32
    for base, mixed in (("bf16", "fp16"), ("fp16", "bf16")):
        with pytest.raises(TrainConfigError, match=rf"^TrainConfig.base_dtype='{base}': {base} under"):
            TrainConfig(base_dtype=base, mixed_precision=mixed)
    plan = plan_memory("sdxl", size="tiny", cache=False, sample_steps=0, device="cuda",
                       mixed_precision="fp16")
    assert plan.peak > 0 and plan.base_dtype == "fp16"
