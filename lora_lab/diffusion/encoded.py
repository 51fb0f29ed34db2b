"""A dataset encoded once for training: cached VAE latents and text embeddings.

API:
    EncodedExamples(latents, embeds, captions, sizes, paths=None, variants=1, flipped=None, masks=None): what
        the training loop reads; .select(idx), .latents_of(idx, flip), .masks_of(idx, flip),
        .embeds_of(idx, drop, empty, device, variant)
    encode_dataset(pipe, folder, resolution, ...) -> EncodedExamples of an image+caption folder
    encode_examples(pipe, ds, seed=0, phase=None, flip=False, store=None) -> EncodedExamples of a dataset
        (VAE in bounded groups: `image_groups`, each `encode_group`; with flip the mirrored images' latents
        too; the items' masks on the latent grid; every encoder call through the disk cache `store`)
    encode_group(pipe, items, generator, mirror=False) -> {field: [one tensor per example]} of one VAE call
    encode_captions(pipe, captions, store=None) -> {key: (N, ...)} each distinct caption encoded once
    cached_call(store, kind, parts, compute) -> compute()'s tensors, through the disk cache where given
    unconditional_embeds(pipe) -> the pipeline's own negative-branch input, (1, ...)
    ENCODE_BATCH, ENCODE_PIXELS: the most images / pixels per encoder call (the planner reads them)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import encode_images, encode_prompts
from .data import ImageCaptionDataset, aspect_buckets, derived_seed, file_digest, mask_file
from .losses import latent_mask

ENCODE_BATCH = 16  # images (and captions) per encoder call when caching the dataset, at most
ENCODE_PIXELS = 1 << 20  # image pixels per VAE call, at most (but one image): one 1024 x 1024 image,
                         # 4 of 512 x 512


@dataclass
class EncodedExamples:
    """A dataset as the training loop uses it: one cached latent (C, h, w) per example (shapes differ across
    aspect-ratio buckets, never within a batch), text embeddings (N * variants, ...: example i's caption
    variants in rows i * variants ... (i + 1) * variants - 1), captions, bucket sizes, image files; with
    `--flip` each example's mirrored image's latent (`flipped`: the VAE's latent of the mirrored image, not a
    mirrored latent: the VAE is not mirror-equivariant; sd-scripts caches its `latents_flipped` so), with
    `--masked-loss` each example's mask on the latent grid (1, h, w)."""

    latents: list[torch.Tensor]
    embeds: dict[str, torch.Tensor]
    captions: list[str]
    sizes: list[tuple[int, int]]
    paths: list[str] | None = None
    variants: int = 1  # caption variants per example (shuffled tags, tag dropout), each step draws one
    flipped: list[torch.Tensor] | None = None  # the mirrored images' latents (C, h, w), with `flip`
    masks: list[torch.Tensor] | None = None  # (1, h, w) fp32 in [0, 1] on the latent grid, with masked loss

    def select(self, idx: list[int]) -> EncodedExamples:
        """The examples `idx` (repeats allowed: a repeated latent is the same tensor, not a copy)."""
        if list(idx) == list(range(len(self.captions))):
            return self  # all of them, in order: no copy of the embeddings (the cache phase's peak)
        rows = torch.tensor([i * self.variants + v for i in idx for v in range(self.variants)],
                            dtype=torch.long)

        def pick(items):
            return None if items is None else [items[i] for i in idx]

        return EncodedExamples(pick(self.latents), {k: v[rows] for k, v in self.embeds.items()},
                               pick(self.captions), pick(self.sizes), pick(self.paths), self.variants,
                               pick(self.flipped), pick(self.masks))

    def latents_of(self, idx: list[int] | torch.Tensor, flip: list[bool] | None = None) -> torch.Tensor:
        """(B, C, h, w) the examples' latents; where `flip` (B bools) is True, their mirrored images'."""
        idx = idx.tolist() if isinstance(idx, torch.Tensor) else idx
        flips = flip or [False] * len(idx)
        return torch.stack([(self.flipped if f else self.latents)[i] for i, f in zip(idx, flips)])

    def masks_of(self, idx: list[int] | torch.Tensor,
                 flip: list[bool] | None = None) -> torch.Tensor | None:
        """(B, 1, h, w) the examples' masks, mirrored where `flip` is True (a mirror of the image's mask on
        the latent grid is the mirrored mask's: each cell averages whole 8 x 8 blocks); None without masks."""
        if self.masks is None:
            return None
        idx = idx.tolist() if isinstance(idx, torch.Tensor) else idx
        flips = flip or [False] * len(idx)
        return torch.stack([self.masks[i].flip(-1) if f else self.masks[i] for i, f in zip(idx, flips)])

    def embeds_of(self, idx: list[int] | torch.Tensor, drop: torch.Tensor | None, empty: dict | None,
                  device, variant: torch.Tensor | None = None) -> dict:
        """The examples' text embeddings (of caption variant `variant`, else the first); where `drop` is True,
        the empty prompt's (caption dropout)."""
        if self.variants > 1:
            idx = torch.as_tensor(idx) * self.variants + (0 if variant is None else variant)
        out = {}
        for k, v in self.embeds.items():
            e = v[idx]
            if drop is not None:
                e = torch.where(drop.reshape(-1, *[1] * (e.dim() - 1)), empty[k].expand_as(e), e)
            out[k] = e.to(device)
        return out


def encode_dataset(pipe, folder: str | Path, resolution: int, buckets: bool = False, skip_bad: bool = False,
                   seed: int = 0, caption_extension: str = ".txt") -> EncodedExamples:
    """Every example of `folder` once through the pipeline's frozen VAE and text encoders
    (`encode_examples`)."""
    ds = ImageCaptionDataset(folder, resolution, buckets=aspect_buckets(resolution) if buckets else None,
                             skip_bad=skip_bad, caption_extension=caption_extension)
    return encode_examples(pipe, ds, seed)


def encode_examples(pipe, ds, seed: int = 0, phase=None, flip: bool = False, store=None) -> EncodedExamples:
    """The examples of `ds` (an ImageCaptionDataset, or anything with its `sizes`, `captions` and items) as
    cached latents and text embeddings; with `flip` the mirrored images' latents too (their posterior drawn
    from a generator of their own, `derived_seed("mirror", seed)`: the other latents are those of a run
    without flip); the items' masks ("mask", where they have one) on the latent grid (`losses.latent_mask`).

    The VAE posterior is sampled with a generator seeded by `seed`, so every process (and a resumed run)
    caches the same latents. Images go through the VAE in groups of one size (with buckets, consecutive
    images of the same bucket) of at most ENCODE_BATCH images and ENCODE_PIXELS pixels (`image_groups`);
    each distinct caption through the text encoders once, ENCODE_BATCH at a time: the memory of caching does
    not grow with the dataset, only the cache does. phase: a context for each part, "cache captions" around
    the text encoders' (what a memory plan reads), or None. store: a `diskcache.DiskCache` each VAE and text
    encoder call is read from or written to (None: none).
    """
    g = torch.Generator(device=pipe.vae.device).manual_seed(seed)
    fields = _encode_images(pipe, ds, g, store)
    if flip:  # their own generator: the mirrored latents do not depend on how the others were made
        mirrored = torch.Generator(device=pipe.vae.device).manual_seed(derived_seed("mirror", seed))
        fields["flipped"] = _encode_images(pipe, ds, mirrored, store, mirror=True)["latents"]
    with (phase or _unnamed)("cache captions"):
        embeds = encode_captions(pipe, ds.captions, store)
    paths = getattr(ds, "paths", None)
    return EncodedExamples(**fields, embeds=embeds, captions=list(ds.captions), sizes=list(ds.sizes),
                           paths=None if paths is None else [str(p) for p in paths])


def _encode_images(pipe, ds, g: torch.Generator, store,
                   mirror: bool = False) -> dict[str, list[torch.Tensor]]:
    """Every image of `ds` through the VAE, call by call (`image_groups`), each through the disk cache `store`
    where given (keyed also by the mirroring and where the masks come from, with their files' contents)."""
    mask = None if mirror else getattr(ds, "mask", None)  # the mirrored pass caches latents alone
    fields: dict[str, list[torch.Tensor]] = {}
    for start, stop in image_groups(ds.sizes):
        def compute(start=start, stop=stop) -> dict[str, list[torch.Tensor]]:
            return encode_group(pipe, [ds[i] for i in range(start, stop)], g, mirror)

        if store is None:
            group = compute()
        else:
            masks = ([file_digest(mask_file(Path(ds.paths[i]))).hex() for i in range(start, stop)]
                     if mask == "file" else [])
            group = store.images(ds, start, stop, g, compute, extra=[mirror, mask, masks])
        for name, tensors in group.items():
            fields.setdefault(name, []).extend(tensors)
    return fields


def image_groups(sizes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(start, stop) of each VAE call over images of `sizes`: consecutive images of one size, at most
    ENCODE_BATCH of them and ENCODE_PIXELS pixels (but one image)."""
    groups, start = [], 0
    while start < len(sizes):
        h, w = sizes[start]
        most = min(ENCODE_BATCH, max(1, ENCODE_PIXELS // (h * w)))
        stop = start + 1
        while stop < min(start + most, len(sizes)) and sizes[stop] == sizes[start]:
            stop += 1
        groups.append((start, stop))
        start = stop
    return groups


def encode_group(pipe, items: list[dict], generator: torch.Generator,
                 mirror: bool = False) -> dict[str, list[torch.Tensor]]:
    """One VAE call's examples (dataset items of one size) as their per-example tensors by
    `EncodedExamples` field, fp32 on the host: {"latents": [(C, h, w), ...]} of the images (mirrored
    left-right with `mirror`), and without `mirror` "masks": [(1, h, w), ...] where the items have masks."""
    images = torch.stack([item["image"] for item in items])
    latents = encode_images(pipe, images.flip(-1) if mirror else images, generator=generator).float().cpu()
    fields = {"latents": list(latents)}
    if not mirror and all("mask" in item for item in items):
        fields["masks"] = [latent_mask(item["mask"], latents.shape[2:]) for item in items]
    return fields


def _unnamed(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def encode_captions(pipe, captions: list[str], store=None) -> dict[str, torch.Tensor]:
    """Each caption's text embeddings, (N, ...) per key on the host: each distinct caption through the text
    encoders once, ENCODE_BATCH at a time (each call read from or written to `store`, a
    `diskcache.DiskCache`, where given), its rows written straight into the (N, ...) result (no second copy
    of the embeddings while they are gathered)."""
    unique = list(dict.fromkeys(captions))
    row_of = {c: i for i, c in enumerate(unique)}
    examples_of: dict[int, list[int]] = {}  # a distinct caption's row -> the examples that have it
    for i, c in enumerate(captions):
        examples_of.setdefault(row_of[c], []).append(i)
    embeds: dict[str, torch.Tensor] = {}
    for start in range(0, len(unique), ENCODE_BATCH):
        chunk = unique[start: start + ENCODE_BATCH]
        part = cached_call(store, "text", chunk, lambda: encode_prompts(pipe, chunk))
        for k, v in part.items():
            if k not in embeds:
                embeds[k] = torch.empty((len(captions), *v.shape[1:]), dtype=v.dtype)
            for j in range(len(v)):  # one caption's row into each of its examples (broadcast: no copies)
                embeds[k][torch.tensor(examples_of[start + j])] = v[j]
    return embeds


def cached_call(store, kind: str, parts, compute) -> dict[str, torch.Tensor]:
    """`compute()` (a dict of tensors, on the host), through the disk cache `store`'s entry of `kind` and
    inputs `parts` where a store is given."""
    if store is None:
        return {k: v.cpu() for k, v in compute().items()}
    return store.entry(kind, parts, compute)


def unconditional_embeds(pipe) -> dict[str, torch.Tensor]:
    """The pipeline's own unconditional input (its classifier-free guidance's negative branch), (1, ...):
    zero embeddings where it forces zeros for an empty prompt (SDXL), else the encoded empty prompt."""
    embeds = encode_prompts(pipe, [""])
    if getattr(pipe.config, "force_zeros_for_empty_prompt", False):
        embeds = {k: torch.zeros_like(v) for k, v in embeds.items()}
    return embeds
