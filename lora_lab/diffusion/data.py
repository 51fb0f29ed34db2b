"""Image + caption folders for diffusion LoRA training.

API:
    ImageCaptionDataset(folder, resolution=16, buckets=None, skip_bad=False)
        a folder of images (png, jpg, jpeg, webp, bmp) each with a same-stem .txt caption;
        every file is opened and checked at construction, so a bad file fails before training starts.
        ds[i] -> {"image": (3, H, W) fp32 in [-1, 1], "caption": str, "path": str}
        ds.paths, ds.captions, ds.sizes (H, W) per item after bucketing
    aspect_buckets(resolution, multiple=8, max_ratio=2.0) -> [(H, W), ...] of about resolution^2 pixels
    BucketBatchSampler(dataset, batch_size, seed=0, drop_last=False) -> batches of indices of one size
    collate(items) -> {"images": (B, 3, H, W), "captions": [str], "paths": [str]}
    DatasetError (LoraLabError, ValueError): missing/empty folder, unreadable image, missing caption

Each image is resized (bicubic) so it covers its target size, then center-cropped to it. Without
buckets every image becomes resolution x resolution; with buckets each image gets the bucket whose
aspect ratio is closest to its own (kohya-style), and batches come from one bucket at a time.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import torch

from ..params import LoraLabError
from .models import RESOLUTION

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class DatasetError(LoraLabError, ValueError):
    """A training folder that cannot be used: missing, empty, an unreadable image, a missing caption."""


def aspect_buckets(resolution: int, multiple: int = 8, max_ratio: float = 2.0) -> list[tuple[int, int]]:
    """(H, W) sizes, both multiples of `multiple`, each about resolution^2 pixels, aspect ratio at most
    `max_ratio`; symmetric (with (H, W) also (W, H)); always includes the square (resolution, resolution)."""
    area = resolution * resolution
    out = {(resolution, resolution)}
    h = multiple
    while h <= resolution * max_ratio:
        w = max(multiple, round(area / h / multiple) * multiple)
        if max(h / w, w / h) <= max_ratio:
            out |= {(h, w), (w, h)}
        h += multiple
    return sorted(out)


def _nearest_bucket(h: int, w: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    ratio = np.log(h / w)
    return min(buckets, key=lambda b: abs(np.log(b[0] / b[1]) - ratio))


def resize_center_crop(img, height: int, width: int):
    """A PIL image scaled (bicubic) to cover height x width, then cropped at its centre to exactly that."""
    from PIL import Image

    scale = max(height / img.height, width / img.width)
    new_w, new_h = max(width, round(img.width * scale)), max(height, round(img.height * scale))
    img = img.resize((new_w, new_h), Image.BICUBIC)
    left, top = (new_w - width) // 2, (new_h - height) // 2
    return img.crop((left, top, left + width, top + height))


def _to_tensor(img) -> torch.Tensor:
    """RGB PIL image -> (3, H, W) fp32 in [-1, 1]."""
    arr = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())  # (H, W, 3)
    return arr.permute(2, 0, 1).float() / 127.5 - 1.0


class ImageCaptionDataset(torch.utils.data.Dataset):
    """A folder of images with same-stem .txt captions (see the module docstring)."""

    def __init__(self, folder: str | Path, resolution: int = RESOLUTION,
                 buckets: list[tuple[int, int]] | None = None, skip_bad: bool = False):
        from PIL import Image, UnidentifiedImageError

        self.folder = Path(folder)
        self.resolution = resolution
        self.buckets = buckets
        if not self.folder.is_dir():
            raise DatasetError(f"{self.folder}: no such dataset folder")
        files = sorted(p for p in self.folder.iterdir() if p.suffix.lower() in IMAGE_EXTS and p.is_file())
        if not files:
            raise DatasetError(f"{self.folder}: no images ({', '.join(IMAGE_EXTS)}) in the dataset folder")

        self.paths: list[Path] = []
        self.captions: list[str] = []
        self.sizes: list[tuple[int, int]] = []
        bad: list[str] = []
        for path in files:
            caption_path = path.with_suffix(".txt")
            problem = None
            if not caption_path.is_file():
                problem = f"{path}: no caption file {caption_path.name}"
            else:
                try:
                    with Image.open(path) as img:
                        img.load()  # decode fully: a truncated file fails here, not mid-training
                        h, w = img.height, img.width
                except (UnidentifiedImageError, OSError, ValueError) as e:
                    problem = f"{path}: unreadable image ({e})"
            if problem is not None:
                if not skip_bad:
                    raise DatasetError(problem + " (pass skip_bad=True to skip such files with a warning)")
                bad.append(problem)
                continue
            self.paths.append(path)
            self.captions.append(caption_path.read_text(encoding="utf-8").strip())
            self.sizes.append(_nearest_bucket(h, w, buckets) if buckets else (resolution, resolution))
        if bad:
            warnings.warn(f"{self.folder}: skipped {len(bad)} of {len(files)} images; first: {bad[0]}",
                          stacklevel=2)
        if not self.paths:
            raise DatasetError(f"{self.folder}: every one of the {len(files)} images was skipped as bad")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        from PIL import Image

        h, w = self.sizes[i]
        with Image.open(self.paths[i]) as img:
            img = resize_center_crop(img.convert("RGB"), h, w)
        return {"image": _to_tensor(img), "caption": self.captions[i], "path": str(self.paths[i])}


class BucketBatchSampler(torch.utils.data.Sampler):
    """Batches of indices whose images share one size; the order is shuffled per epoch from `seed`.

    `set_epoch(e)` picks the epoch (the same epoch gives the same batches: a resumed run sees the data
    an uninterrupted run would have seen).
    """

    def __init__(self, dataset: ImageCaptionDataset, batch_size: int, seed: int = 0, drop_last: bool = False):
        self.sizes, self.batch_size, self.seed, self.drop_last = dataset.sizes, batch_size, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        rng = random.Random(self.seed * 100003 + self.epoch)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, size in enumerate(self.sizes):
            groups.setdefault(size, []).append(i)
        batches = []
        for size in sorted(groups):
            idx = groups[size]
            rng.shuffle(idx)
            for k in range(0, len(idx), self.batch_size):
                b = idx[k: k + self.batch_size]
                if len(b) == self.batch_size or not self.drop_last:
                    batches.append(b)
        rng.shuffle(batches)
        return batches

    def __iter__(self):
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def collate(items: list[dict]) -> dict:
    """Stack a batch of same-size items: {"images": (B, 3, H, W), "captions": [...], "paths": [...]}."""
    return {"images": torch.stack([it["image"] for it in items]),
            "captions": [it["caption"] for it in items], "paths": [it["path"] for it in items]}
