"""A run's data as people lay it out: several folders with repeats, a held-out validation set, caption
shuffling and tag dropout; all encoded once in the cache phase.

API:
    data_sources(config) -> [DataSource(path, repeats, caption_extension, is_reg), ...]: the `[[datasets]]`
        tables, else the dataset folder (kohya's layout: a folder of `N_name/` subfolders, N repeats each)
        and the regularization folder
    encode_run_data(pipe, config, resolution) -> RunData(train, reg, val): the training examples (repeats
        expanded, caption variants encoded), the regularization examples, the held-out examples (or None)
    held_out(n, fraction) -> the indices of n images a validation split holds out (a fixed seed)
    split(paths, fraction) -> (trained, held out): `held_out` over the distinct files of `paths`
    check_disjoint(train, val, folder) -> TrainConfigError where a validation image is trained on too
    caption_variant(caption, rng, keep_tokens, shuffle, tag_dropout) -> one shuffled / thinned caption
    sources_fingerprint(config) -> what a resume checks every data folder against

A held-out image is never trained on: the split is made over the distinct files (by real path: a folder
listed twice, once through a link, is one set of images) before repeats are expanded, so no repeat or copy of
a held-out image is left in the training set; a validation folder sharing a file with the training folders is
refused. The split and the caption variants
are functions of fixed seeds (`VALIDATION_SEED`, the run's seed), so a repeated run holds out the same images.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from .bounds import MAX_REPEATS, epoch_problem
from .config import TrainConfig, TrainConfigError
from .data import (
    CONTENTS_FINGERPRINT,
    DatasetError,
    ImageCaptionDataset,
    aspect_buckets,
    folder_fingerprint,
    is_image_file,
)
from .encoded import EncodedExamples, encode_captions, encode_examples

KOHYA_FOLDER = re.compile(r"^(\d+)_(.+)$")  # kohya's `10_style/`: 10 repeats of the images in it
VALIDATION_SEED = 20_251_125  # the held-out split's seed: the same images held out whatever the run's seed


@dataclass(frozen=True)
class DataSource:
    """One folder of images with captions: how often each image counts per epoch, the captions' extension,
    and whether it holds regularization images (prior preservation)."""

    path: str
    repeats: int = 1
    caption_extension: str = ".txt"
    is_reg: bool = False


def kohya_sources(folder: Path, is_reg: bool = False) -> list[DataSource]:
    """`folder` as its sources: its `N_name/` subfolders (N repeats) where it has such subfolders (kohya's
    layout), else the folder once. As kohya's sd-scripts reads the layout (library/config_util.py,
    `generate_dreambooth_subsets_config_by_subdirs`): a `0_name/` subfolder is skipped (repeats < 1), any
    other subfolder too, each with a warning. Images beside the `N_name/` subfolders, which kohya ignores
    without a word, are refused (DatasetError naming them): either reading of such a folder could be the one
    meant, and the other trains on other data than asked."""
    if not folder.is_dir():
        return [DataSource(str(folder), is_reg=is_reg)]
    entries = sorted(folder.iterdir())
    kohya = [(int(m.group(1)), p) for p in entries if p.is_dir() and (m := KOHYA_FOLDER.match(p.name))]
    if not kohya:
        return [DataSource(str(folder), is_reg=is_reg)]
    for n, p in kohya:
        if n > MAX_REPEATS:
            raise TrainConfigError(f"{p}: {n} repeats (kohya's N_name folder) must be at most {MAX_REPEATS} "
                                   "(their ratio weights the folders)")
    stray = [p.name for p in entries if p.is_file() and is_image_file(p)]
    if stray:
        more = " ..." if len(stray) > 3 else ""
        raise DatasetError(f"{folder}: holds images ({', '.join(stray[:3])}{more}) beside kohya's N_name/ "
                           f"subfolders ({kohya[0][1].name}): move them into a N_name/ subfolder to train on "
                           "them, or out of the folder (kohya ignores them)")
    others = [p.name for p in entries if p.is_dir() and not KOHYA_FOLDER.match(p.name)]
    if others:
        warnings.warn(f"{folder}: skipped the subfolder(s) {', '.join(others)}: not kohya's N_name/ (N "
                      "repeats), as kohya skips them", stacklevel=2)
    zero = [p.name for n, p in kohya if n < 1]
    if zero:
        warnings.warn(f"{folder}: skipped the subfolder(s) {', '.join(zero)}: 0 repeats, as kohya skips them",
                      stacklevel=2)
    sources = [DataSource(str(p), repeats=n, is_reg=is_reg) for n, p in kohya if n >= 1]
    if not sources:
        raise DatasetError(f"{folder}: every kohya subfolder has 0 repeats ({', '.join(zero)}): none to "
                           "train on")
    return sources


def data_sources(config: TrainConfig) -> list[DataSource]:
    """The run's folders: `config.datasets` tables, else the dataset folder and the regularization folder
    (each a kohya `N_name/` layout or a plain folder)."""
    if config.datasets is not None:  # each table's folder, or its N_name/ subfolders (repeats multiplied)
        sources = []
        for table in (DataSource(**t) for t in config.datasets):
            sources += [DataSource(s.path, s.repeats * table.repeats, table.caption_extension, table.is_reg)
                        for s in kohya_sources(Path(table.path))]
    else:
        sources = kohya_sources(config.dataset_dir())
    if config.reg_dataset is not None:
        sources += kohya_sources(Path(config.reg_dataset), is_reg=True)
    return sources


class Images:
    """The distinct images of several folders, in order, as one dataset (what `encode_examples` takes), with
    each image's repeats."""

    def __init__(self, parts: list[ImageCaptionDataset], repeats: list[int]):
        self.parts = parts
        self.where = [(k, i) for k, part in enumerate(parts) for i in range(len(part))]
        self.repeats = [r for part, r in zip(parts, repeats) for _ in range(len(part))]
        self.paths = [p for part in parts for p in part.paths]
        self.captions = [c for part in parts for c in part.captions]
        self.sizes = [s for part in parts for s in part.sizes]
        self.mask = parts[0].mask if parts else None  # where the masks come from (every part's the same)

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, i: int) -> dict:
        k, j = self.where[i]
        return self.parts[k][j]


def mask_kind(config: TrainConfig) -> str | None:
    """Where the training and validation images' masks come from: "file" (NAME.mask.png), "alpha" (the
    image's alpha channel), or None (no masked loss)."""
    return ("alpha" if config.alpha_mask else "file") if config.masked_loss else None


def open_images(sources: list[DataSource], config: TrainConfig, resolution: int,
                mask: str | None = None) -> Images:
    """The sources' folders opened (every file checked now, before anything is encoded), with their masks
    (`mask`: ImageCaptionDataset's)."""
    buckets = aspect_buckets(resolution) if config.buckets else None
    parts = [ImageCaptionDataset(s.path, resolution, buckets=buckets, skip_bad=config.skip_bad_images,
                                 caption_extension=s.caption_extension, mask=mask) for s in sources]
    return Images(parts, [s.repeats for s in sources])


def check_epoch(counts: dict[str, tuple[int, int]], config: TrainConfig) -> None:
    """TrainConfigError where an epoch of `counts` ({folder: (images, repeats)}) is longer than the run can
    use (`bounds.epoch_problem`), before anything is encoded."""
    problem = epoch_problem(counts, config)
    if problem:
        raise TrainConfigError(f"TrainConfig.{'datasets' if config.datasets else 'dataset'}: {problem}")


def held_out(n: int, fraction: float) -> list[int]:
    """The images (of n) a validation split of `fraction` holds out: round(fraction * n), at least one, chosen
    by VALIDATION_SEED; sorted. TrainConfigError if none would be left to train on."""
    count = max(1, round(fraction * n))
    if count >= n:
        raise TrainConfigError(f"TrainConfig.validation_split={fraction}: holds out {count} of the {n} "
                               "images, leaving none to train on")
    return sorted(random.Random(VALIDATION_SEED).sample(range(n), count))


def split(paths: list, fraction: float | None) -> tuple[list[int], list[int]]:
    """(the indices trained on, the indices held out) of images `paths` under a validation split of
    `fraction` (None: none held out). The split is `held_out` over the distinct files (their real paths: a
    folder listed twice, once through a link, is one set of images), and every copy of a held-out file is
    held out, so no held-out image is trained on."""
    if not fraction:
        return list(range(len(paths))), []
    real = [os.path.realpath(p) for p in paths]
    distinct = list(dict.fromkeys(real))
    if len(distinct) < len(real):
        warnings.warn(f"{len(real) - len(distinct)} of the {len(real)} images are files listed twice (one "
                      "folder under two paths or tables): the validation split holds out or trains each file "
                      "as one", stacklevel=2)
    held = {distinct[i] for i in held_out(len(distinct), fraction)}
    first = {r: i for i, r in reversed(list(enumerate(real)))}
    return [i for i, r in enumerate(real) if r not in held], sorted(first[r] for r in held)


def check_disjoint(train: list, val: list, folder) -> None:
    """TrainConfigError naming an image of the validation folder `folder` that is also trained on (the same
    file, by real path): the validation loss would hold none of it out."""
    trained = {os.path.realpath(p) for p in train}
    both = [p for p in val if os.path.realpath(p) in trained]
    if both:
        raise TrainConfigError(f"TrainConfig.validation_dataset={str(folder)!r}: {len(both)} of its images "
                               f"are trained on too (first: {both[0]}); name a folder of other images")


def caption_variant(caption: str, rng: random.Random, keep_tokens: int = 0, shuffle: bool = False,
                    tag_dropout: float = 0.0) -> str:
    """One variant of a caption of comma-separated tags: the first `keep_tokens` tags in place, the others
    each dropped with probability `tag_dropout`, then (with `shuffle`) shuffled."""
    tags = [t.strip() for t in caption.split(",")]
    kept, rest = tags[:keep_tokens], tags[keep_tokens:]
    rest = [t for t in rest if not (tag_dropout and rng.random() < tag_dropout)]
    if shuffle:
        rng.shuffle(rest)
    return ", ".join(t for t in kept + rest if t)


class RunData(NamedTuple):
    """The cache phase's examples: to train on, of the regularization folders (or None), held out (or
    None)."""

    train: EncodedExamples
    reg: EncodedExamples | None
    val: EncodedExamples | None


def encode_run_data(pipe, config: TrainConfig, resolution: int, store=None) -> RunData:
    """Every source's distinct images once through the VAE and the text encoders (the held-out ones and the
    validation folder's too), the training captions' variants encoded, the repeats expanded; each encoder
    call through the disk cache `store` (`diskcache.DiskCache`) where given. The training and validation
    images carry their masks (`--masked-loss`), the training images their mirrored latents (`--flip`); the
    regularization images neither (trained whole, as they are)."""
    sources = data_sources(config)
    train_sources = [s for s in sources if not s.is_reg]
    images = open_images(train_sources, config, resolution, mask_kind(config))
    check_epoch({s.path: (len(part), s.repeats) for s, part in zip(train_sources, images.parts)}, config)
    val_images = None
    if config.validation_dataset is not None:
        val_images = open_images(kohya_sources(Path(config.validation_dataset)), config, resolution,
                                 mask_kind(config))
        check_disjoint(images.paths, val_images.paths, config.validation_dataset)
    train_idx, val_idx = split(images.paths, config.validation_split)
    encoded = encode_examples(pipe, images, config.seed, flip=config.flip, store=store)
    train = with_variants(pipe, encoded.select(train_idx), config, store)
    train = train.select([j for j, i in enumerate(train_idx) for _ in range(images.repeats[i])])
    val = encoded.select(val_idx) if val_idx else None
    if val_images is not None:
        val = encode_examples(pipe, val_images, config.seed, store=store)
    reg_sources = [s for s in sources if s.is_reg]
    reg = None
    if reg_sources:
        reg_images = open_images(reg_sources, config, resolution)
        reg_encoded = encode_examples(pipe, reg_images, config.seed, store=store)
        reg = reg_encoded.select([i for i in range(len(reg_images)) for _ in range(reg_images.repeats[i])])
    return RunData(train, reg, val)


def with_variants(pipe, data: EncodedExamples, config: TrainConfig, store=None) -> EncodedExamples:
    """`data` with `caption_variants` variants of each caption encoded (with caption shuffling or tag
    dropout; else `data` as it is). Variant v of example i: `caption_variant` from a generator seeded by
    (seed, i, v)."""
    if not (config.shuffle_captions or config.tag_dropout):
        return data
    n = config.caption_variants
    captions = [caption_variant(c, random.Random(f"{config.seed}:{i}:{v}"), config.keep_tokens,
                                config.shuffle_captions, config.tag_dropout)
                for i, c in enumerate(data.captions) for v in range(n)]
    return replace(data, embeds=encode_captions(pipe, captions, store), variants=n)


def sources_fingerprint(config: TrainConfig) -> str:
    """What a resume checks the data folders against: every source's files, their contents too
    (`folder_fingerprint`), with its repeats and caption extension."""
    sources = data_sources(config)
    return CONTENTS_FINGERPRINT + "+".join(f"{s.repeats}:{s.caption_extension}:{int(s.is_reg)}:"
                                           f"{folder_fingerprint(s.path, s.caption_extension)}"
                                           for s in sources)
