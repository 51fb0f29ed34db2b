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
    DatasetError (LoraLabError, ValueError): missing/empty folder, unreadable image (corrupt, truncated, not
        a regular file, over PIL's decompression-bomb limit), missing or non-UTF-8 caption; each names the file
    folder_fingerprint(folder) -> hex digest of the images' names and sizes and the captions' text
    to_rgb(img) -> the RGB image a PIL image shows (16-bit scaled to 8, alpha composited over white)

Each image is resized (bicubic) so it covers its target size, then center-cropped to it. Without
buckets every image becomes resolution x resolution; with buckets each image gets the bucket whose
aspect ratio is closest to its own (kohya-style), and batches come from one bucket at a time.
Every image mode PIL reads becomes the RGB it shows: 16-bit grayscale PNGs are scaled to 8 bits (round(v/257)),
palette and grayscale images are expanded, and transparent pixels (RGBA, LA, a palette with transparency)
are composited over white.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import LoraLabError
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


def to_rgb(img):
    """The RGB image a PIL image shows: 16-bit integer modes scaled to 8 bits (PIL's own convert("RGB") clips
    them, so a 16-bit PNG would turn white), alpha and palette transparency composited over white."""
    from PIL import Image

    if img.mode.startswith("I"):  # "I;16", "I;16B", "I": 16-bit grayscale PNG samples, 0..65535
        arr = np.asarray(img, dtype=np.float64)
        img = Image.fromarray(np.clip(np.rint(arr / 257.0), 0, 255).astype(np.uint8), mode="L")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info):
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img.convert("RGBA")).convert("RGB")
    return img.convert("RGB")


def _to_tensor(img) -> torch.Tensor:
    """RGB PIL image -> (3, H, W) fp32 in [-1, 1]."""
    arr = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())  # (H, W, 3)
    return arr.permute(2, 0, 1).float() / 127.5 - 1.0


class ImageCaptionDataset(torch.utils.data.Dataset):
    """A folder of images with same-stem .txt captions (see the module docstring)."""

    def __init__(self, folder: str | Path, resolution: int = RESOLUTION,
                 buckets: list[tuple[int, int]] | None = None, skip_bad: bool = False):
        self.folder = Path(folder)
        self.resolution = resolution
        self.buckets = buckets
        if not self.folder.is_dir():
            raise DatasetError(f"{self.folder}: no such dataset folder")
        files = sorted(p for p in self.folder.iterdir() if p.suffix.lower() in IMAGE_EXTS and not p.is_dir())
        if not files:
            raise DatasetError(f"{self.folder}: no images ({', '.join(IMAGE_EXTS)}) in the dataset folder")

        self.paths: list[Path] = []
        self.captions: list[str] = []
        self.sizes: list[tuple[int, int]] = []
        bad: list[str] = []
        for path in files:
            caption_path = path.with_suffix(".txt")
            try:
                caption = _read_caption(path, caption_path)
                w, h = _open_image(path).size
            except DatasetError as e:
                if not skip_bad:
                    raise DatasetError(f"{e} (pass skip_bad=True to skip such files with a warning)") from None
                bad.append(str(e))
                continue
            self.paths.append(path)
            self.captions.append(caption)
            self.sizes.append(_nearest_bucket(h, w, buckets) if buckets else (resolution, resolution))
        if bad:
            warnings.warn(f"{self.folder}: skipped {len(bad)} of {len(files)} images; first: {bad[0]}",
                          stacklevel=2)
        if not self.paths:
            raise DatasetError(f"{self.folder}: every one of the {len(files)} images was skipped as bad")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        h, w = self.sizes[i]
        img = resize_center_crop(_open_image(self.paths[i]), h, w)
        return {"image": _to_tensor(img), "caption": self.captions[i], "path": str(self.paths[i])}


def _read_caption(image: Path, path: Path) -> str:
    if not path.is_file():
        raise DatasetError(f"{image}: no caption file {path.name}")
    try:
        return path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: the caption is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DatasetError(f"{path}: unreadable caption ({e.strerror})") from None


def _open_image(path: Path):
    """The image at `path` as RGB (`to_rgb`), decoded fully; DatasetError naming the file if it cannot be.

    PIL refuses images over 2 x Image.MAX_IMAGE_PIXELS (DecompressionBombError) before decoding them."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():  # a dangling link, a pipe (opening it would wait forever), a device
        raise DatasetError(f"{path}: unreadable image (not a regular file)")
    try:
        with Image.open(path) as img:
            img.load()  # decode fully: a truncated file fails here, not mid-training
            return to_rgb(img)
    except Image.DecompressionBombError as e:
        raise DatasetError(f"{path}: refused as a decompression bomb ({e})") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DatasetError(f"{path}: unreadable image ({e})") from None


def folder_fingerprint(folder: str | Path) -> str:
    """A digest that changes when a training folder's images or captions change: sha256 over the sorted
    names and byte sizes of its image files, and the bytes of its .txt captions (images are not read)."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).iterdir()):
        suffix = p.suffix.lower()
        if p.is_file() and (suffix in IMAGE_EXTS or suffix == ".txt"):
            h.update(f"{p.name}\0{p.stat().st_size}\0".encode())
            if suffix == ".txt":
                h.update(p.read_bytes())
    return h.hexdigest()


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
