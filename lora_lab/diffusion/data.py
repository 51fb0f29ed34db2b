"""Image + caption folders for diffusion LoRA training.

API:
    ImageCaptionDataset(folder, resolution=16, buckets=None, skip_bad=False, mask=None)
        a folder of images (png, jpg, jpeg, webp, bmp) each with a same-stem .txt caption;
        every file is opened and checked at construction, so a bad file fails before training starts.
        ds[i] -> {"image": (3, H, W) fp32 in [-1, 1], "caption": str, "path": str}; with mask "file" (each
        image's NAME.mask.png) or "alpha" (its alpha channel) also "mask": (1, H, W) fp32 in [0, 1]
        ds.paths, ds.captions, ds.sizes (H, W) per item after bucketing
    aspect_buckets(resolution, multiple=8, max_ratio=2.0) -> [(H, W), ...] of about resolution^2 pixels
    bucket_batches(sizes, batch_size, seed, epoch) -> one epoch's batches of indices, each of one size
    BucketBatchSampler(dataset, batch_size, seed=0, drop_last=False) -> bucket_batches as a DataLoader sampler
    batch_indices(seed, step, global_batch, sizes) -> (G,) the examples of training step `step`, a function of
        (seed, step): consecutive slots of per-epoch permutations, or with several sizes one bucket's batch
    derived_seed(name, *numbers) -> a generator seed of its own stream (a hash of them)
    collate(items) -> {"images": (B, 3, H, W), "captions": [str], "paths": [str]}
    DatasetError (LoraLabError, ValueError): missing/empty folder, unreadable image (corrupt, truncated, not
        a regular file, over PIL's decompression-bomb limit), missing or non-UTF-8 caption, a missing or bad
        mask (not greyscale, not the image's size, all zero; no alpha channel); each names the file
    is_image_file(path) -> whether a folder's file is a training image (NAME.mask.png files are masks)
    folder_fingerprint(folder) -> hex digest of the images' and captions' names, sizes and contents
    file_digest(path) -> a blake2b of a file's bytes (a disk cache entry's key holds its images')
    to_rgb(img) -> the RGB image a PIL image shows (16-bit scaled to 8, alpha composited over white)

Each image is resized (bicubic) so it covers its target size, then center-cropped to it. Without
buckets every image becomes resolution x resolution; with buckets each image gets the bucket whose
aspect ratio is closest to its own (kohya-style), and batches come from one bucket at a time.
Each image is read as it is shown: its EXIF orientation applied (`PIL.ImageOps.exif_transpose`, as
diffusers' training scripts do: examples/dreambooth/train_dreambooth_lora*.py, `exif_transpose(image)`), so a
phone's portrait photo, stored sideways with an orientation tag, trains upright. Every image mode PIL reads
becomes the RGB it shows: 16-bit grayscale PNGs are scaled to 8 bits
(round(v/257)), palette and grayscale images are expanded, and transparent pixels (RGBA, LA, a palette
with transparency) are composited over white.

A mask (`--masked-loss`) is a greyscale image of the image's size (white: trained, black: ignored, grey:
weighted between), NAME.mask.png beside NAME.png (or the image's alpha channel, `--alpha-mask`); it is
resized and cropped exactly as its image (`resize_center_crop`), then put on the latent grid when cached
(`losses.latent_mask`).
"""

from __future__ import annotations

import hashlib
import random
import warnings
from pathlib import Path

import numpy as np
import torch

from ..errors import LoraLabError
from ..models import RESOLUTION

# PIL is imported in the functions that read images: Pillow is optional (the diffusion extra), and
# `import lora_lab` imports this module.
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
EXIF_ORIENTATION = 0x0112  # the EXIF tag a camera records its rotation in (1: upright, 2-8: flipped, turned)
MASK_SUFFIX = ".mask.png"  # NAME.mask.png: the mask of NAME.png (or .jpg ...) beside it
MASK_MODES = ("1", "L", "I;16", "I;16B", "I;16L", "I")  # the greyscale modes a mask file may have


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


def nearest_bucket(h: int, w: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
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
        img = _grey(img)
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info):
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img.convert("RGBA")).convert("RGB")
    return img.convert("RGB")


def is_image_file(path: Path) -> bool:
    """Whether a file of a training folder is an image to train on: an image extension, and not a mask
    (NAME.mask.png)."""
    return path.suffix.lower() in IMAGE_EXTS and not path.name.lower().endswith(MASK_SUFFIX)


def mask_file(image: Path) -> Path:
    """The mask file of `image`: NAME.mask.png beside it."""
    return image.with_name(image.stem + MASK_SUFFIX)


def _grey(img):
    """A greyscale PIL image (1, L or 16-bit) as 8-bit L: 16-bit samples scaled to 8 bits (round(v/257))."""
    from PIL import Image

    if img.mode.startswith("I"):
        arr = np.asarray(img, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(arr / 257.0), 0, 255).astype(np.uint8), mode="L")
    return img.convert("L")


def open_mask(image: Path, kind: str, size: tuple[int, int] | None = None):
    """The mask of `image` as an L image of the image's shown size (`size`, (width, height), where the caller
    has it): its NAME.mask.png (kind "file") or its alpha channel (kind "alpha"); DatasetError naming the
    file where it is missing, not greyscale, not the image's size, or all zero."""
    from PIL import Image, ImageOps

    size = size or _open_image(image).size
    path = mask_file(image) if kind == "file" else image
    if kind == "file" and not path.is_file():
        raise DatasetError(f"{image}: no mask file {path.name} (--masked-loss; or --alpha-mask to read the "
                           "image's alpha channel)")
    try:
        with Image.open(path) as opened:
            img = ImageOps.exif_transpose(opened)
            img.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DatasetError(f"{path}: unreadable mask ({e})") from None
    if kind == "alpha":
        if not (img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info)):
            raise DatasetError(f"{path}: no alpha channel (mode {img.mode}) to read the mask from "
                               "(--alpha-mask)")
        mask = img.convert("RGBA").getchannel("A")
    elif img.mode not in MASK_MODES:
        raise DatasetError(f"{path}: the mask is a {img.mode} image, not greyscale (white trains, black is "
                           "ignored)")
    else:
        mask = _grey(img)
    if mask.size != size:
        raise DatasetError(f"{path}: the mask is {mask.size[0]} x {mask.size[1]}, its image {size[0]} x "
                           f"{size[1]}: a mask must be its image's size")
    if mask.getextrema()[1] == 0:
        raise DatasetError(f"{path}: the mask is all zero (black): nothing of {image.name} would be trained")
    return mask


def _to_tensor(img) -> torch.Tensor:
    """RGB PIL image -> (3, H, W) fp32 in [-1, 1]."""
    arr = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())  # (H, W, 3)
    return arr.permute(2, 0, 1).float() / 127.5 - 1.0


class ImageCaptionDataset(torch.utils.data.Dataset):
    """A folder of images with same-stem .txt captions (see the module docstring)."""

    def __init__(self, folder: str | Path, resolution: int = RESOLUTION,
                 buckets: list[tuple[int, int]] | None = None, skip_bad: bool = False,
                 caption_extension: str = ".txt", mask: str | None = None):
        self.folder = Path(folder)
        self.resolution = resolution
        self.buckets = buckets
        self.mask = mask  # None, "file" (NAME.mask.png) or "alpha" (the image's alpha channel)
        if not self.folder.is_dir():
            raise DatasetError(f"{self.folder}: no such dataset folder")
        if problem := caption_extension_problem(caption_extension):
            raise DatasetError(f"caption_extension {caption_extension!r}: {problem}")
        files = sorted(p for p in self.folder.iterdir() if is_image_file(p) and not p.is_dir())
        if not files:
            raise DatasetError(f"{self.folder}: no images ({', '.join(IMAGE_EXTS)}) in the dataset folder")

        self.paths: list[Path] = []
        self.captions: list[str] = []
        self.sizes: list[tuple[int, int]] = []
        bad: list[str] = []
        for path in files:
            caption_path = path.with_suffix(caption_extension)
            try:
                caption = _read_caption(path, caption_path)
                w, h = _open_image(path).size
                if mask is not None:
                    open_mask(path, mask, (w, h))
            except DatasetError as e:
                if not skip_bad:
                    raise DatasetError(f"{e} (lora-lab train --skip-bad-images, skip_bad_images=True, skips "
                                       "such files with a warning)") from None
                bad.append(str(e))
                continue
            self.paths.append(path)
            self.captions.append(caption)
            self.sizes.append(nearest_bucket(h, w, buckets) if buckets else (resolution, resolution))
        if bad:
            warnings.warn(f"{self.folder}: skipped {len(bad)} of {len(files)} images; first: {bad[0]}",
                          stacklevel=2)
        if not self.paths:
            raise DatasetError(f"{self.folder}: every one of the {len(files)} images was skipped as bad")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict:
        h, w = self.sizes[i]
        shown = _open_image(self.paths[i])
        item = {"image": _to_tensor(resize_center_crop(shown, h, w)), "caption": self.captions[i],
                "path": str(self.paths[i])}
        if self.mask is not None:  # resized and cropped as its image
            mask = resize_center_crop(open_mask(self.paths[i], self.mask, shown.size), h, w)
            item["mask"] = torch.from_numpy(np.asarray(mask, dtype=np.float32) / 255.0)[None]
        return item


def caption_extension_problem(extension: str) -> str | None:
    """What is wrong with a captions' extension (None: nothing): a dot and a name, as `.txt` or `.caption`;
    "." or "./x" would name no file beside the image (pathlib's ValueError)."""
    if not extension.startswith(".") or extension == "." or "/" in extension or "\\" in extension:
        return "must be a dot and a name without a folder, e.g. .txt or .caption"
    return None


# The most characters of a caption any base's text encoders can read: no encoder reads more than 512 tokens
# (T5's longest; CLIP's 77) and no token of theirs spans more than 16 characters (T5's vocabulary; CLIP's
# longest, 64, times 77 is less): text past 512 x 16 is never read, shuffled tags only mix the kept ones.
MAX_CAPTION_CHARS = 512 * 16


def _read_caption(image: Path, path: Path) -> str:
    if not path.is_file():
        raise DatasetError(f"{image}: no caption file {path.name}")
    try:
        return cap_caption(path.read_text(encoding="utf-8").strip(), path)
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: the caption is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DatasetError(f"{path}: unreadable caption ({e.strerror})") from None


def cap_caption(text: str, path: Path) -> str:
    """`text` cut to MAX_CAPTION_CHARS (at its last comma before them: whole tags), with a warning naming the
    file: the rest can never be read, and a 10 MB caption took minutes to shuffle and tokenize."""
    if len(text) <= MAX_CAPTION_CHARS:
        return text
    kept = text[:MAX_CAPTION_CHARS]
    kept = kept[:kept.rindex(",")] if "," in kept else kept
    warnings.warn(f"{path}: the caption is {len(text)} characters; kept the first {len(kept)} (no base's "
                  f"text encoders read past {MAX_CAPTION_CHARS}: 512 tokens of at most 16 characters)",
                  stacklevel=2)
    return kept.strip()


def _open_image(path: Path):
    """The image at `path` as RGB (`to_rgb`), decoded fully; DatasetError naming the file if it cannot be.

    PIL refuses images over 2 x Image.MAX_IMAGE_PIXELS (DecompressionBombError) before decoding them."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not path.is_file():  # a dangling link, a pipe (opening it would wait forever), a device
        raise DatasetError(f"{path}: unreadable image (not a regular file)")
    try:
        with Image.open(path) as img:
            img.load()  # decode fully: a truncated file fails here, not mid-training
            return to_rgb(ImageOps.exif_transpose(img))  # as it is shown (a phone's portrait photo upright)
    except Image.DecompressionBombError as e:
        raise DatasetError(f"{path}: refused as a decompression bomb ({e})") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DatasetError(f"{path}: unreadable image ({e})") from None


def shown_size(img) -> tuple[int, int]:
    """(width, height) of an opened PIL image as it is shown: its EXIF orientation 5 to 8 (a quarter turn)
    swaps them (what `_open_image`'s exif_transpose gives, read from the header only)."""
    w, h = img.size
    return (h, w) if img.getexif().get(EXIF_ORIENTATION, 1) in (5, 6, 7, 8) else (w, h)


# what begins a run's fingerprint of its data since it covers the images' contents (a checkpoint whose
# fingerprint lacks it was written before: its images' names and sizes only)
CONTENTS_FINGERPRINT = "contents:"


def folder_fingerprint(folder: str | Path, caption_extension: str = ".txt") -> str:
    """A digest that changes when a training folder's images or captions change: sha256 over the sorted
    names and byte sizes of its image and caption files and a blake2b of each one's bytes (an image replaced
    by another of the same size and name changes it; hashing a 1024 x 1024 PNG takes a fifth of the time
    decoding it takes, a JPEG a hundredth: benchmarks/bench_fingerprint.py)."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).iterdir()):
        suffix = p.suffix.lower()
        if p.is_file() and (suffix in IMAGE_EXTS or suffix == caption_extension):
            h.update(f"{p.name}\0{p.stat().st_size}\0".encode())
            h.update(file_digest(p))
    return h.hexdigest()


def file_digest(path: str | Path) -> bytes:
    """A blake2b of a file's bytes."""
    contents = hashlib.blake2b()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            contents.update(chunk)
    return contents.digest()


def bucket_batches(sizes: list[tuple[int, int]], batch_size: int, seed: int, epoch: int,
                   drop_last: bool = False) -> list[list[int]]:
    """One epoch's batches of indices whose images share one size: each bucket shuffled and cut into batches
    of `batch_size` (the last one short, or dropped with `drop_last`), then the batches shuffled; a function
    of (sizes, batch_size, seed, epoch) only."""
    rng = random.Random(seed * 100003 + epoch)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, size in enumerate(sizes):
        groups.setdefault(size, []).append(i)
    batches = []
    for size in sorted(groups):
        idx = groups[size]
        rng.shuffle(idx)
        for k in range(0, len(idx), batch_size):
            b = idx[k: k + batch_size]
            if len(b) == batch_size or not drop_last:
                batches.append(b)
    rng.shuffle(batches)
    return batches


class BucketBatchSampler(torch.utils.data.Sampler):
    """`bucket_batches` of a dataset as a DataLoader's batch sampler; the order is shuffled per epoch from
    `seed`.

    `set_epoch(e)` picks the epoch (the same epoch gives the same batches: a resumed run sees the data
    an uninterrupted run would have seen).
    """

    def __init__(self, dataset: ImageCaptionDataset, batch_size: int, seed: int = 0, drop_last: bool = False):
        self.sizes, self.batch_size, self.seed, self.drop_last = dataset.sizes, batch_size, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(bucket_batches(self.sizes, self.batch_size, self.seed, self.epoch, self.drop_last))

    def __len__(self) -> int:
        return len(bucket_batches(self.sizes, self.batch_size, self.seed, self.epoch, self.drop_last))


# ---------------------------------------------------------------------------- the examples of a training step


def derived_seed(*parts) -> int:
    """A generator seed that is a function of `parts` (a name and numbers) alone, in [0, 2^63): a stream of
    its own, apart from any other name's or numbers' (a hash, not a sum that another seed could repeat)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The data order of epoch `epoch`: a permutation of range(n), a function of (seed, epoch) only."""
    g = torch.Generator().manual_seed((seed * 7_919 + epoch) % (2**63))
    return torch.randperm(n, generator=g)


def global_batch_indices(seed: int, step: int, global_batch: int, n: int) -> torch.Tensor:
    """Dataset indices of optimizer step `step`: consecutive slots of the concatenated epoch orders."""
    slots = torch.arange(step * global_batch, (step + 1) * global_batch)
    epochs = slots // n
    out = torch.empty(global_batch, dtype=torch.long)
    for e in epochs.unique().tolist():
        mask = epochs == e
        out[mask] = epoch_order(seed, e, n)[slots[mask] % n]
    return out


def bucket_batch_indices(seed: int, step: int, global_batch: int,
                         sizes: list[tuple[int, int]]) -> torch.Tensor:
    """Dataset indices of optimizer step `step` when images keep their aspect ratio: all from one bucket.

    One epoch is `bucket_batches` of `global_batch` for (seed, epoch); a bucket's last, short batch is filled
    up cyclically from the same bucket, so every step has exactly `global_batch` examples.
    """
    n_batches = len(bucket_batches(sizes, global_batch, seed, 0))  # the same for every epoch
    batch = bucket_batches(sizes, global_batch, seed, step // n_batches)[step % n_batches]
    return torch.tensor([batch[i % len(batch)] for i in range(global_batch)])


def batch_indices(seed: int, step: int, global_batch: int, sizes: list[tuple[int, int]]) -> torch.Tensor:
    """Step `step`'s examples: `global_batch_indices` when every example has one size, else one bucket's."""
    if len(set(sizes)) == 1:
        return global_batch_indices(seed, step, global_batch, len(sizes))
    return bucket_batch_indices(seed, step, global_batch, sizes)


def collate(items: list[dict]) -> dict:
    """Stack a batch of same-size items: {"images": (B, 3, H, W), "captions": [...], "paths": [...]}."""
    return {"images": torch.stack([it["image"] for it in items]),
            "captions": [it["caption"] for it in items], "paths": [it["path"] for it in items]}
