"""--masked-loss: the mask's weighted mean of the loss, sd-scripts' area rule onto the latent grid (on a
hand-made mask), masks read beside their images (or from the alpha channel) and cropped as they are, carried
through repeats, the held-out split and the cache, and bad masks refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from lora_lab.cli import build_parser
from lora_lab.diffusion import TrainConfig, TrainConfigError, encoded, step
from lora_lab.diffusion.data import DatasetError, ImageCaptionDataset
from lora_lab.diffusion.datasets import encode_run_data
from lora_lab.diffusion.losses import example_losses, latent_mask, masked_mean
from lora_lab.diffusion.objectives import DDPM
from lora_lab.planning.examples import count_examples


def test_the_area_rule_averages_the_pixels_each_latent_cell_covers():
    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 1, 0],
                         [1, 1, 0, 0, 0, 0, 0, 0],
                         [1, 1, 1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)[None]  # (1, 4, 8)
    want = torch.tensor([[[1.0, 0.0, 0.0, 0.25],  # each cell: the mean of its 2 x 2 pixels
                          [1.0, 0.75, 0.0, 0.0]]])
    torch.testing.assert_close(latent_mask(mask, (2, 4)), want)
    torch.testing.assert_close(latent_mask(mask * 0.5, (1, 2)), torch.tensor([[[0.34375, 0.03125]]]))


def test_the_masked_loss_is_the_mean_weighted_by_the_mask():
    g = torch.Generator().manual_seed(0)
    loss = torch.rand(2, 3, 2, 2, generator=g)
    mask = torch.tensor([[[1.0, 0.0], [0.5, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])[:, None]  # (2, 1, 2, 2)
    first = (loss[0, :, 0, 0].sum() + 0.5 * loss[0, :, 1, 0].sum()) / (3 * 1.5)
    torch.testing.assert_close(masked_mean(loss, mask), torch.stack([first, loss[1].mean()]))
    torch.testing.assert_close(masked_mean(loss, mask * 7), masked_mean(loss, mask))  # its weight, not area


def test_the_step_weights_each_examples_loss_by_its_mask(monkeypatch):
    monkeypatch.setattr(step, "predict", lambda kind, model, x, t, cond, **kw: torch.zeros_like(x))
    monkeypatch.setattr(step, "denoiser", lambda pipe: None)
    pipe = SimpleNamespace(vae_scale_factor=8)
    g = torch.Generator().manual_seed(1)
    x0, noise, t = torch.randn(2, 4, 4, 4, generator=g), torch.randn(2, 4, 4, 4, generator=g), \
        torch.tensor([5, 700])
    mask = torch.zeros(2, 1, 4, 4)
    mask[..., :2] = 1.0  # the left half
    config = TrainConfig(model="sdxl", masked_loss=True)
    got = step.denoising_loss(config, None, pipe, DDPM(), x0, noise, t, {}, mask=mask)
    assert got.item() == pytest.approx((noise[..., :2] ** 2).mean().item(), rel=1e-6)  # the target: the noise
    ones = step.denoising_loss(config, None, pipe, DDPM(), x0, noise, t, {}, mask=torch.ones(2, 1, 4, 4))
    plain = step.denoising_loss(config, None, pipe, DDPM(), x0, noise, t, {})
    assert ones.item() == pytest.approx(plain.item())
    huber = TrainConfig(model="sdxl", masked_loss=True, loss="huber")
    want = example_losses(huber, DDPM(), torch.zeros_like(x0[..., :2]), noise[..., :2], t).mean()
    got = step.denoising_loss(huber, None, pipe, DDPM(), x0, noise, t, {}, mask=mask)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def _save(folder, name, image: np.ndarray, mask: np.ndarray | None = None, mode: str = "L"):
    Image.fromarray(image).save(folder / f"{name}.png")
    (folder / f"{name}.txt").write_text(f"a digit {name}")
    if mask is not None:
        Image.fromarray(mask, mode=mode).save(folder / f"{name}.mask.png")


def _ramp(h: int, w: int) -> np.ndarray:
    """(h, w) uint8: each pixel its column (x 16), so a crop tells which columns it kept."""
    return np.tile((np.arange(w) * 16).astype(np.uint8), (h, 1))


def test_a_mask_is_cropped_and_resized_as_its_image(tmp_path):
    """An 8 x 16 image at resolution 8 is cropped to its 8 middle columns: its mask too (a ramp tells which);
    a mask from the alpha channel likewise; NAME.mask.png is not an image of the folder."""
    rgb = np.zeros((8, 16, 3), np.uint8)
    _save(tmp_path, "a", rgb, _ramp(8, 16))
    ds = ImageCaptionDataset(tmp_path, 8, mask="file")
    assert [p.name for p in ds.paths] == ["a.png"]
    mask = ds[0]["mask"]
    assert mask.shape == (1, 8, 8)
    np.testing.assert_allclose(mask[0, 0].numpy() * 255, np.arange(4, 12) * 16, atol=0.5)
    alpha = tmp_path / "alpha"
    alpha.mkdir()
    Image.fromarray(np.dstack([rgb, _ramp(8, 16)]), mode="RGBA").save(alpha / "b.png")
    (alpha / "b.txt").write_text("a digit b")
    torch.testing.assert_close(ImageCaptionDataset(alpha, 8, mask="alpha")[0]["mask"], mask)


@pytest.mark.parametrize("case, match", [
    ("missing", r"a\.png: no mask file a\.mask\.png"),
    ("size", r"a\.mask\.png: the mask is 4 x 8, its image 8 x 8"),
    ("rgb", r"a\.mask\.png: the mask is a RGB image, not greyscale"),
    ("zero", r"a\.mask\.png: the mask is all zero"),
    ("no alpha", r"a\.png: no alpha channel \(mode RGB\)"),
])
def test_a_bad_mask_is_a_dataset_error_naming_its_file(tmp_path, case, match):
    image, mask = np.full((8, 8, 3), 200, np.uint8), np.full((8, 8), 255, np.uint8)
    mode = "L"
    if case == "size":
        mask = mask[:, :4]
    elif case == "rgb":
        mask, mode = np.full((8, 8, 3), 255, np.uint8), "RGB"
    elif case == "zero":
        mask = mask * 0
    _save(tmp_path, "a", image, None if case == "missing" else mask, mode)
    with pytest.raises(DatasetError, match=match) as e:
        ImageCaptionDataset(tmp_path, 8, mask="alpha" if case == "no alpha" else "file")
    assert "\n" not in str(e.value)
    with pytest.warns(UserWarning, match="skipped 1 of 1"), pytest.raises(DatasetError, match="every one"):
        ImageCaptionDataset(tmp_path, 8, mask="alpha" if case == "no alpha" else "file", skip_bad=True)


def test_the_flags_and_alpha_mask_without_masked_loss():
    args = build_parser().parse_args(["train", "--masked-loss", "--alpha-mask", "--flip"])
    assert (args.masked_loss, args.alpha_mask, args.flip) == (True, True, True)
    with pytest.raises(TrainConfigError, match=r"alpha_mask=True: reads the masks of --masked-loss"):
        TrainConfig(alpha_mask=True)


def test_repeats_the_held_out_split_and_the_cache_carry_the_masks(tmp_path, monkeypatch):
    """A kohya folder (3 repeats) of 4 masked images, one held out: every trained example and the held-out
    one have their own image's mask on the latent grid; the planner counts the images, not the masks."""
    folder = tmp_path / "3_digits"
    folder.mkdir()
    for i in range(4):
        mask = np.zeros((8, 8), np.uint8)
        mask[:, : 2 * (i + 1)] = 255  # image i: its 2 (i + 1) left columns
        _save(folder, f"{i}", np.full((8, 8, 3), 40 * i, np.uint8), mask)
    monkeypatch.setattr(encoded, "encode_images",
                        lambda pipe, images, generator=None: torch.nn.functional.avg_pool2d(images, 2))
    monkeypatch.setattr(encoded, "encode_captions", lambda pipe, c, store=None: {"e": torch.zeros(len(c), 1)})
    pipe = SimpleNamespace(vae=SimpleNamespace(device="cpu"))
    config = TrainConfig(model="sd3", dataset=str(tmp_path), masked_loss=True, validation_split=0.25,
                         resolution=8)
    data = encode_run_data(pipe, config, 8)
    assert len(data.train.masks) == 9 and len(data.val.masks) == 1
    for examples in (data.train, data.val):
        for latent, mask in zip(examples.latents, examples.masks):
            shade = round((latent[0, 0, 0].item() + 1) * 127.5 / 40)  # which image: its shade
            assert mask.shape == (1, 4, 4)
            assert mask[0, 0].tolist() == [1.0] * (shade + 1) + [0.0] * (3 - shade)
    counts = count_examples(config, 8)
    assert len(counts.train) == 4 and counts.train.repeats == [3] * 4
    (folder / "2.mask.png").unlink()  # the planner refuses what the trainer would
    with pytest.raises(DatasetError, match=r"2\.png: no mask file 2\.mask\.png"):
        count_examples(config, 8)
