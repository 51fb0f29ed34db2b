"""diffusion/data.py: real tiny image files written by the test, resized and cropped as specified."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image

from lora_lab.diffusion.data import (
    BucketBatchSampler,
    DatasetError,
    ImageCaptionDataset,
    aspect_buckets,
    collate,
    folder_fingerprint,
)
from lora_lab.errors import LoraLabError

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
    torch.testing.assert_close(img[:, :, 2:-2].mean((1, 2)), torch.tensor([-1.0, -1.0, 1.0]),
                               atol=0.02, rtol=0)
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
    with pytest.raises(DatasetError, match=r"nocap\.png: no caption file nocap\.txt") as err:
        ImageCaptionDataset(tmp_path)
    assert "--skip-bad-images" in str(err.value)  # the CLI's flag: it said only `skip_bad=True`
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


# ----------------------------------------------------------------------------- bad files, image modes


def _png(w: int, h: int, bit_depth: int, color_type: int, rows: bytes) -> bytes:
    """A PNG written by hand (PIL cannot write every kind): IHDR, one IDAT of the filtered rows, IEND."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def _item(folder, resolution=RES):
    return ImageCaptionDataset(folder, resolution=resolution)[0]["image"]


def _pixels(values) -> torch.Tensor:
    """uint8 RGB values (H, W, 3) -> the dataset's (3, H, W) in [-1, 1]."""
    return torch.tensor(np.asarray(values, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1


def test_16_bit_grayscale_png_keeps_its_values(tmp_path):
    v16 = np.array([[0, 1000, 30000, 65535]] * 4, dtype=">u2")  # (4, 4) 16-bit samples
    (tmp_path / "g16.png").write_bytes(_png(4, 4, 16, 0, b"".join(b"\0" + r.tobytes() for r in v16)))
    (tmp_path / "g16.txt").write_text("sixteen bits")
    with Image.open(tmp_path / "g16.png") as im:
        assert im.mode.startswith("I;16")  # PIL reads it as 16-bit; its convert("RGB") clips to white
    v8 = np.rint(v16.astype(np.float64) / 257).astype(np.uint8)  # 0, 4, 117, 255
    torch.testing.assert_close(_item(tmp_path, 4), _pixels(np.repeat(v8[..., None], 3, -1)), rtol=0, atol=0)


def test_palette_grayscale_and_rgba_pngs_load_with_their_colours(tmp_path):
    rgb = np.array([[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [40, 80, 120]]], dtype=np.uint8)  # (2, 2, 3)
    Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=4).save(tmp_path / "pal.png")
    (tmp_path / "pal.txt").write_text("palette")
    torch.testing.assert_close(_item(tmp_path, 2), _pixels(rgb), rtol=0, atol=0)
    (tmp_path / "pal.png").unlink()

    gray = np.array([[0, 50], [200, 255]], dtype=np.uint8)
    Image.fromarray(gray, mode="L").save(tmp_path / "pal.png")
    torch.testing.assert_close(_item(tmp_path, 2), _pixels(np.repeat(gray[..., None], 3, -1)), rtol=0, atol=0)

    rgba = np.dstack([rgb, np.array([[255, 0], [128, 255]], dtype=np.uint8)])  # opaque, clear, half, opaque
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "pal.png")
    a = rgba[..., 3:4].astype(np.float64) / 255  # composited over white
    want = np.rint(rgb * a + 255 * (1 - a))
    torch.testing.assert_close(_item(tmp_path, 2), _pixels(want), rtol=0, atol=1 / 127.5)
    # the transparent pixel is white, not green
    assert _item(tmp_path, 2)[:, 0, 1].tolist() == [1.0, 1.0, 1.0]


def test_non_utf8_caption_is_a_dataset_error_naming_it(tmp_path):
    _write(tmp_path, "good", 20, 20)
    _write(tmp_path, "latin", 20, 20)
    (tmp_path / "latin.txt").write_bytes("un caf\xe9".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin\.txt: the caption is not UTF-8 text"):
        ImageCaptionDataset(tmp_path)
    with pytest.warns(UserWarning, match=r"skipped 1 of 2 images; first: .*latin\.txt"):
        assert [p.name for p in ImageCaptionDataset(tmp_path, skip_bad=True).paths] == ["good.png"]


def test_decompression_bomb_is_a_dataset_error_naming_the_file(tmp_path):
    # 60000 x 60000 pixels declared in a ~100-byte file: PIL refuses it before allocating anything
    (tmp_path / "bomb.png").write_bytes(_png(60000, 60000, 8, 0, b"\0"))
    (tmp_path / "bomb.txt").write_text("boom")
    with pytest.raises(DatasetError, match=r"bomb\.png: refused as a decompression bomb"):
        ImageCaptionDataset(tmp_path)


@pytest.mark.parametrize("kind", ["garbage", "dangling_link", "fifo", "changed_after_the_check"])
def test_unreadable_images_are_dataset_errors_naming_the_file(tmp_path, kind):
    _write(tmp_path, "good", 20, 20)
    bad = tmp_path / "bad.png"
    (tmp_path / "bad.txt").write_text("bad")
    if kind == "garbage":
        bad.write_bytes(np.random.default_rng(SEED).integers(0, 256, 300, dtype=np.uint8).tobytes())
    elif kind == "dangling_link":
        bad.symlink_to(tmp_path / "gone.png")
    elif kind == "fifo":  # opening a pipe would wait forever: it is refused without being opened
        os.mkfifo(bad)
    else:
        _write(tmp_path, "bad", 20, 20)
        ds = ImageCaptionDataset(tmp_path)
        bad.write_bytes(b"overwritten while training")
        with pytest.raises(DatasetError, match=r"bad\.png: unreadable image"):
            ds[0]
        return
    with pytest.raises(DatasetError, match=r"bad\.png: unreadable image"):
        ImageCaptionDataset(tmp_path)
    with pytest.warns(UserWarning, match="skipped 1 of 2"):
        assert len(ImageCaptionDataset(tmp_path, skip_bad=True)) == 1


def test_folder_fingerprint_changes_with_the_files(tmp_path):
    _write(tmp_path, "a", 20, 20)
    first = folder_fingerprint(tmp_path)
    assert folder_fingerprint(tmp_path) == first
    (tmp_path / "a.txt").write_text("a digit seven\n")  # the same size, another text
    second = folder_fingerprint(tmp_path)
    _write(tmp_path, "b", 20, 20)
    assert len({first, second, folder_fingerprint(tmp_path)}) == 3


def test_fuzzed_images_load_or_raise_dataset_error(tmp_path):
    """240 seeded mutants of PNG, JPEG, WebP and BMP files: each loads or is a DatasetError naming the
    file."""
    import random

    rng = random.Random(SEED)
    arr = np.random.default_rng(SEED).integers(0, 256, size=(24, 24, 3), dtype=np.uint8)
    (tmp_path / "x.txt").write_text("a mutant")
    refused = 0
    for ext, mode in [(".png", "RGB"), (".png", "P"), (".png", "RGBA"), (".jpg", "RGB"), (".webp", "RGB"),
                      (".bmp", "RGB")]:
        for stale in tmp_path.glob("x.*"):
            if stale.suffix != ".txt":
                stale.unlink()
        path = tmp_path / f"x{ext}"
        Image.fromarray(arr).convert(mode).save(path)
        data = path.read_bytes()
        for _ in range(40):
            b = bytearray(data)
            if rng.random() < 0.5:
                for _ in range(rng.randrange(1, 8)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
            else:
                del b[rng.randrange(len(b)):]
            path.write_bytes(bytes(b))
            try:
                ds = ImageCaptionDataset(tmp_path, resolution=RES)
                assert ds[0]["image"].shape == (3, RES, RES)
            except DatasetError as e:
                assert path.name in str(e)
                refused += 1
    assert refused > 40


def test_the_caption_cap_is_what_the_shipped_tokenizers_can_read():
    """512 tokens (T5's longest input) of at most 16 characters (T5's longest token); CLIP's 77 tokens of its
    longest merge read less: MAX_CAPTION_CHARS is the most any base reads."""
    import gzip
    import json
    from pathlib import Path

    from lora_lab.diffusion.data import MAX_CAPTION_CHARS

    tokenizers = Path(__file__).resolve().parents[2] / "data" / "tokenizers"
    t5 = json.loads(gzip.open(tokenizers / "t5_tokenizer.json.gz").read())["model"]["vocab"]
    merges = gzip.open(tokenizers / "bpe_simple_vocab_16e6.txt.gz").read().decode().split("\n")[1:]
    clip_longest = max(len("".join(m.split()).replace("</w>", "")) for m in merges if m)
    assert MAX_CAPTION_CHARS == 512 * max(len(piece) for piece, _ in t5) >= 77 * clip_longest


def test_a_10_mb_caption_with_shuffled_tags_is_cut_with_one_warning_and_trains(tmp_path, digits_folder):
    """A 10 MB caption with --shuffle-captions took over 120 s and wrote 100+ MB of tokenizer warnings: it
    is cut at the last whole tag before MAX_CAPTION_CHARS, with one warning naming its file."""
    import warnings

    from lora_lab.diffusion import TrainConfig, train
    from lora_lab.diffusion.data import MAX_CAPTION_CHARS

    folder = digits_folder(2)
    huge = folder / "00.txt"
    huge.write_text(", ".join(f"tag{i}" for i in range(1_200_000)))
    assert huge.stat().st_size > 10**7
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ds = ImageCaptionDataset(folder, 16)
    said = [str(w.message) for w in record if "the caption is" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"{huge}: the caption is {huge.stat().st_size} characters")
    kept = ds.captions[0]
    assert len(kept) <= MAX_CAPTION_CHARS and kept.startswith("tag0, tag1, ") and not kept.endswith(",")
    assert huge.read_text().startswith(kept + ", ")  # whole tags, in order
    with pytest.warns(UserWarning, match="the caption is"):
        train(TrainConfig(model="sd15", dataset=str(folder), output=str(tmp_path / "o"), steps=1, rank=2,
                          shuffle_captions=True, caption_variants=2, sample_steps=0, progress=False))
