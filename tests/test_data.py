"""diffusion/data.py: real tiny image files written by the test, resized and cropped as specified."""

from __future__ import annotations

import numpy as np
import pytest
import torch

PIL = pytest.importorskip("PIL")
from PIL import Image

from lora_lab.diffusion.data import (
    BucketBatchSampler,
    DatasetError,
    ImageCaptionDataset,
    aspect_buckets,
    collate,
)
from lora_lab.params import LoraLabError

SEED = 5
RES = 16


def _write(folder, stem, h, w, caption="a digit three", ext=".png", seed=SEED):
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    Image.fromarray(arr).save(folder / f"{stem}{ext}")
    if caption is not None:
        (folder / f"{stem}.txt").write_text(caption + "\n")
    return arr


def test_items_are_resized_center_cropped_and_scaled(tmp_path):
    # A 32 x 64 (H x W) image whose left and right quarters are red and the middle half blue:
    # scaling to cover 16 x 16 gives 16 x 32, the centre crop keeps only the blue middle.
    arr = np.zeros((32, 64, 3), dtype=np.uint8)
    arr[:, :16, 0] = arr[:, 48:, 0] = 255
    arr[:, 16:48, 2] = 255
    Image.fromarray(arr).save(tmp_path / "b.png")
    (tmp_path / "b.txt").write_text("  a blue picture \n")
    _write(tmp_path, "a", 20, 20, caption="a digit seven", ext=".jpg")
    ds = ImageCaptionDataset(tmp_path, resolution=RES)
    assert len(ds) == 2 and [p.name for p in ds.paths] == ["a.jpg", "b.png"]
    item = ds[1]
    assert item["caption"] == "a blue picture"
    img = item["image"]
    assert img.shape == (3, RES, RES) and img.dtype == torch.float32
    assert img.min() >= -1 and img.max() <= 1
    # bicubic may ring near the crop edge; the inner 12 columns are pure blue
    torch.testing.assert_close(img[:, :, 2:-2].mean((1, 2)), torch.tensor([-1.0, -1.0, 1.0]), atol=0.02, rtol=0)
    batch = collate([ds[0], ds[1]])
    assert batch["images"].shape == (2, 3, RES, RES) and batch["captions"][0] == "a digit seven"


def test_exact_size_image_is_unchanged(tmp_path):
    arr = _write(tmp_path, "x", RES, RES)
    img = ImageCaptionDataset(tmp_path, resolution=RES)[0]["image"]
    torch.testing.assert_close(img, torch.from_numpy(arr).permute(2, 0, 1).float() / 127.5 - 1)


def test_errors_name_the_file(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset folder"):
        ImageCaptionDataset(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(DatasetError, match="no images"):
        ImageCaptionDataset(tmp_path)
    _write(tmp_path, "good", 20, 20)
    _write(tmp_path, "nocap", 20, 20, caption=None)
    with pytest.raises(DatasetError, match=r"nocap\.png: no caption file nocap\.txt"):
        ImageCaptionDataset(tmp_path)
    (tmp_path / "nocap.png").unlink()
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    (tmp_path / "broken.txt").write_text("a broken file")
    with pytest.raises(DatasetError, match=r"broken\.png: unreadable image") as err:
        ImageCaptionDataset(tmp_path)
    assert isinstance(err.value, LoraLabError) and isinstance(err.value, ValueError)


def test_truncated_image_is_caught_at_construction(tmp_path):
    _write(tmp_path, "cut", 40, 40)
    data = (tmp_path / "cut.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match="cut.png: unreadable image"):
        ImageCaptionDataset(tmp_path)


def test_skip_bad_warns_with_a_count(tmp_path):
    _write(tmp_path, "good", 20, 20)
    _write(tmp_path, "nocap", 20, 20, caption=None)
    (tmp_path / "broken.jpg").write_bytes(b"garbage")
    (tmp_path / "broken.txt").write_text("x")
    with pytest.warns(UserWarning, match="skipped 2 of 3 images"):
        ds = ImageCaptionDataset(tmp_path, skip_bad=True)
    assert [p.name for p in ds.paths] == ["good.png"]
    (tmp_path / "good.txt").unlink()
    with pytest.warns(UserWarning), pytest.raises(DatasetError, match="every one of the 3 images"):
        ImageCaptionDataset(tmp_path, skip_bad=True)


def test_aspect_buckets_and_batches_share_a_size(tmp_path):
    buckets = aspect_buckets(64, multiple=8)
    assert buckets == [(48, 80), (48, 88), (56, 72), (64, 64), (72, 56), (80, 48), (88, 48)]
    for h, w in buckets:
        assert h % 8 == 0 and w % 8 == 0 and max(h / w, w / h) <= 2.0
        assert abs(h * w - 64 * 64) / (64 * 64) < 0.25
    for i, (h, w) in enumerate([(64, 64), (60, 64), (40, 80), (36, 80), (80, 40), (64, 66), (40, 82)]):
        _write(tmp_path, f"im{i}", h, w, seed=i)
    ds = ImageCaptionDataset(tmp_path, resolution=64, buckets=buckets)
    # nearest aspect ratio: 60x64 and 64x66 -> square; 40x80, 36x80, 40x82 -> 48x88; tall 80x40 -> 88x48
    assert ds.sizes == [(64, 64), (64, 64), (48, 88), (48, 88), (88, 48), (64, 64), (48, 88)]
    for i in range(len(ds)):
        assert ds[i]["image"].shape[1:] == ds.sizes[i]
    sampler = BucketBatchSampler(ds, batch_size=2, seed=SEED)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(ds)))
    for b in batches:
        assert len({ds.sizes[i] for i in b}) == 1
    assert list(sampler) == batches  # same epoch, same batches
    sampler.set_epoch(1)
    assert sorted(i for b in sampler for i in b) == list(range(len(ds)))
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=collate)
    assert sum(len(b["captions"]) for b in loader) == len(ds)
