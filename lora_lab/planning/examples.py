"""The examples a planned run caches, read from its data description, and the cache's bytes for them.

    counts = count_examples(config, resolution)   # DataCounts: each part's images (sizes, repeats), captions
    ledger = CacheLedger(start, group, ...)        # the cache phase replayed in bytes, part by part

A plan encodes one group of examples on fake tensors (`PlannedExamples`: what one VAE call takes) and counts
the others from `count_examples`: the same folders the trainer reads (`diffusion.datasets.data_sources`:
the dataset folder, kohya's `N_name/` subfolders, the `[[datasets]]` tables with their repeats, the
regularization and validation folders), the held-out split (`split`), the caption variants. No image is
decoded: the files are listed and the captions read; with buckets each image's size comes from its header.
`CacheLedger` follows `diffusion.datasets.encode_run_data` step by step (which embeddings are copied, which
stay alive until it returns), with the bytes one latent, one caption's embeddings and the encoders' working
sets have in the planned group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..diffusion.config import TrainConfig
from ..diffusion.data import (
    IMAGE_EXTS,
    DatasetError,
    aspect_buckets,
    is_image_file,
    mask_file,
    nearest_bucket,
    shown_size,
)
from ..diffusion.datasets import (
    DataSource,
    check_disjoint,
    check_epoch,
    data_sources,
    kohya_sources,
    mask_kind,
    split,
)
from ..diffusion.encoded import ENCODE_BATCH, image_groups


class PlannedExamples:
    """Examples of one size (h, w) with `distinct` different captions, as `diffusion.encoded.encode_examples`
    reads a dataset."""

    def __init__(self, n: int, size: tuple[int, int], distinct: int, masked: bool = False):
        self.sizes = [size] * n
        self.captions = [f"a photo {i % distinct}" for i in range(n)]
        self.masked = masked  # each item has a mask (`--masked-loss`)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> dict:
        h, w = self.sizes[i]
        item = {"image": torch.zeros(3, h, w), "caption": self.captions[i]}
        if self.masked:
            item["mask"] = torch.ones(1, h, w)
        return item


@dataclass
class Part:
    """The distinct images of some folders, as one `encode_examples` call takes them: each one's size (its
    bucket), caption and repeats."""

    sizes: list[tuple[int, int]] = field(default_factory=list)
    captions: list[str] = field(default_factory=list)
    repeats: list[int] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sizes)

    def pixels(self) -> int:
        return sum(h * w for h, w in self.sizes)

    def largest_group(self) -> tuple[int, tuple[int, int]]:
        """The largest VAE call (in pixels) `encode_examples` makes of these images: (images, their size),
        of its calls (`encoded.image_groups`)."""
        calls = [(stop - start, self.sizes[start]) for start, stop in image_groups(self.sizes)]
        return max(calls, key=lambda c: c[0] * c[1][0] * c[1][1], default=(0, (0, 0)))

    def add(self, source: DataSource, resolution: int, buckets, skip_bad: bool,
            mask: str | None = None) -> None:
        for path, size, caption in _scan(source, resolution, buckets, skip_bad, mask):
            self.paths.append(path)
            self.sizes.append(size)
            self.captions.append(caption)
            self.repeats.append(source.repeats)


@dataclass
class DataCounts:
    """What a run's cache phase encodes: the training folders' images (the held-out ones among them), the
    validation folder's, the regularization folders', and the caption variants of each training example."""

    train: Part
    held_out: list[int] = field(default_factory=list)  # the training images held out for validation
    trained: list[int] = field(default_factory=list)  # the training images trained on (`datasets.split`)
    validation: Part | None = None
    reg: Part | None = None
    variants: int = 1


def count_examples(config: TrainConfig, resolution: int) -> DataCounts:
    """The examples the trainer caches for `config` at `resolution`, counted from the files (DatasetError
    where the trainer's reading would fail: no folder, no images, a missing caption without
    skip_bad_images)."""
    buckets = aspect_buckets(resolution) if config.buckets else None
    sources, mask = data_sources(config), mask_kind(config)
    parts, epoch = {False: Part(), True: Part()}, {}
    for s in sources:
        before = len(parts[s.is_reg])
        parts[s.is_reg].add(s, resolution, buckets, config.skip_bad_images, None if s.is_reg else mask)
        if not s.is_reg:
            epoch[s.path] = (len(parts[False]) - before, s.repeats)
    check_epoch(epoch, config)  # the trainer's refusal, before a plan is made
    train = parts[False]
    counts = DataCounts(train, reg=parts[True] if any(s.is_reg for s in sources) else None)
    counts.trained, counts.held_out = split(train.paths, config.validation_split)
    if config.validation_dataset is not None:
        counts.validation = Part()
        for s in kohya_sources(Path(config.validation_dataset)):
            counts.validation.add(s, resolution, buckets, config.skip_bad_images, mask)
        check_disjoint(train.paths, counts.validation.paths, config.validation_dataset)
    if config.shuffle_captions or config.tag_dropout:
        counts.variants = config.caption_variants
    return counts


def _scan(source: DataSource, resolution: int, buckets, skip_bad: bool, mask: str | None = None
          ) -> list[tuple[Path, tuple[int, int], str]]:
    """Each image of a folder with a caption (and with `mask` "file" a mask file): its path, size (its
    bucket's, from the file's header) and caption."""
    from PIL import Image

    folder = Path(source.path)
    if not folder.is_dir():
        raise DatasetError(f"{folder}: no such dataset folder")
    out = []
    for path in sorted(p for p in folder.iterdir() if is_image_file(p) and p.is_file()):
        caption = path.with_suffix(source.caption_extension)
        if not caption.is_file():
            if skip_bad:
                continue
            raise DatasetError(f"{path}: no caption file {caption.name}")
        if mask == "file" and not mask_file(path).is_file():
            if skip_bad:
                continue
            raise DatasetError(f"{path}: no mask file {mask_file(path).name} (--masked-loss)")
        size = (resolution, resolution)
        if buckets:
            with Image.open(path) as img:  # the header only
                w, h = shown_size(img)
            size = nearest_bucket(h, w, buckets)
        out.append((path, size, caption.read_text(encoding="utf-8", errors="replace").strip()))
    if not out:
        raise DatasetError(f"{folder}: no images ({', '.join(IMAGE_EXTS)}) in the dataset folder")
    return out


class CacheLedger:
    """The cache phase of a CPU run in bytes (the host is the device): `encode_run_data`'s steps replayed on
    counts, from what the planned group cost. `group`: its images and their size; `latent`: what one
    training image caches beside its embeddings (its latent; with `--flip` its mirrored image's, with
    `--masked-loss` its mask), `plain`: one latent alone (a regularization image's; default `latent`; a
    validation folder's images are counted as training images), `embed`: one caption's embeddings; `vae`:
    the VAE call's working set (its latents in it) over what was live before, `text`: the text encoders'
    (beyond the group's embeddings), `after`: what encoding the sample prompts and the empty caption adds;
    `start`: the live bytes before encoding. The VAE's working set scales with a call's pixels; the text
    encoders' is the group's in every call (measured on tiny bases, it does not grow in proportion to the
    captions of a call: 16 took less than 10 in the group)."""

    def __init__(self, start: int, group: tuple[int, tuple[int, int]], latent: int, embed: int, vae: int,
                 text: int, after: int, plain: int | None = None):
        self.current = self.peak = start
        n, (h, w) = group
        self.per_pixel, self.vae_per_pixel = latent / (h * w), vae / (n * h * w)
        self.plain_per_pixel = (latent if plain is None else plain) / (h * w)
        self.latent, self.embed, self.text, self.after = latent, embed, text, after

    def _rise(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)

    def encode(self, part: Part, plain: bool = False) -> None:
        """`encode_examples`: the images through the VAE group by group (the largest call's working set with
        every other latent), then the captions' embeddings (all rows, with the text encoders' working
        set). `plain`: latents alone (regularization images: no mirror, no mask)."""
        n, (h, w) = part.largest_group()
        per_pixel = self.plain_per_pixel if plain else self.per_pixel
        latents = round(part.pixels() * per_pixel)
        group = round(n * h * w * per_pixel)
        self.peak = max(self.peak, self.current + latents - group + round(n * h * w * self.vae_per_pixel))
        self.current += latents
        self.captions(len(part), len(set(part.captions)))

    def captions(self, rows: int, distinct: int | None = None) -> None:
        """`encode_captions` of `rows` captions: their embeddings, the text encoders working beside them. With
        `distinct` captions that one encoder call takes (at most ENCODE_BATCH), the rows are made after the
        call, beside its output only (Flux.2's Mistral: a working set as large as the rows)."""
        if distinct is not None and distinct <= ENCODE_BATCH:
            self.peak = max(self.peak, self.current + max(self.text, (rows + distinct) * self.embed))
        else:
            self.peak = max(self.peak, self.current + rows * self.embed + self.text)
        self.current += rows * self.embed

    def copy(self, rows: int) -> None:
        """`EncodedExamples.select`: a copy of `rows` embeddings."""
        self._rise(rows * self.embed)

    def free(self, rows: int) -> None:
        self.current -= rows * self.embed

    def run_data(self, counts: DataCounts) -> None:
        """`encode_run_data`: the training images with their held-out ones, the split, the caption variants,
        the repeats expanded, the validation folder, the regularization folders; the embeddings no example
        keeps freed when it returns."""
        train = counts.train
        n, held, v = len(train), len(counts.held_out), counts.variants
        trained = counts.trained
        self.encode(train)
        kept = [train.repeats[i] for i in trained]
        rows, own = n, False  # the training embeddings' rows, and whether they are a copy (not `encoded`'s)
        if len(trained) != n:
            self.copy(len(trained))
            rows, own = len(trained), True
        if v > 1:  # with_variants: every trained example's variants through the text encoders
            self.captions(len(trained) * v)
            if own:
                self.free(rows)
            rows, own = len(trained) * v, True
        expanded = sum(kept) * v
        if expanded != rows:  # the repeats: a copy of the rows
            self.copy(expanded)
            if own:
                self.free(rows)
            rows, own = expanded, True
        if held:
            self.copy(held)
        if counts.validation is not None:
            self.encode(counts.validation)
            if held:
                self.free(held)
        if counts.reg is not None:
            self.encode(counts.reg, plain=True)
            if sum(counts.reg.repeats) != len(counts.reg):  # the repeats: a copy, the encoded rows go
                self.copy(sum(counts.reg.repeats))
                self.free(len(counts.reg))
        if own:
            self.free(n)  # `encoded`'s rows
        self.peak = max(self.peak, self.current + self.after)  # then the sample prompts, the empty caption
