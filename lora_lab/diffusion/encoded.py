"""A dataset encoded once for training: cached VAE latents and text embeddings.

API:
    EncodedExamples(latents, embeds, captions, sizes, paths=None, variants=1): what the training loop reads;
        .select(idx), .latents_of(idx), .embeds_of(idx, drop, empty, device, variant)
    encode_dataset(pipe, folder, resolution, ...) -> EncodedExamples of an image+caption folder
    encode_examples(pipe, ds, seed=0, phase=None, store=None) -> EncodedExamples of a dataset (VAE in bounded
        groups: `image_groups`, each `encode_group`; every encoder call through the disk cache `store`)
    encode_group(pipe, items, generator) -> {field: [one tensor per example]} of one VAE call
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
from .data import ImageCaptionDataset, aspect_buckets

ENCODE_BATCH = 16  # images (and captions) per encoder call when caching the dataset, at most
ENCODE_PIXELS = 1 << 20  # image pixels per VAE call, at most (but one image): one 1024 x 1024 image,
                         # 4 of 512 x 512


@dataclass
class EncodedExamples:
    """A dataset as the training loop uses it: one cached latent (C, h, w) per example (shapes differ across
    aspect-ratio buckets, never within a batch), text embeddings (N * variants, ...: example i's caption
    variants in rows i * variants ... (i + 1) * variants - 1), captions, bucket sizes, image files."""

    latents: list[torch.Tensor]
    embeds: dict[str, torch.Tensor]
    captions: list[str]
    sizes: list[tuple[int, int]]
    paths: list[str] | None = None
    variants: int = 1  # caption variants per example (shuffled tags, tag dropout), each step draws one

    def select(self, idx: list[int]) -> EncodedExamples:
        """The examples `idx` (repeats allowed: a repeated latent is the same tensor, not a copy)."""
        if list(idx) == list(range(len(self.captions))):
            return self  # all of them, in order: no copy of the embeddings (the cache phase's peak)
        rows = torch.tensor([i * self.variants + v for i in idx for v in range(self.variants)],
                            dtype=torch.long)
        return EncodedExamples([self.latents[i] for i in idx], {k: v[rows] for k, v in self.embeds.items()},
                               [self.captions[i] for i in idx], [self.sizes[i] for i in idx],
                               None if self.paths is None else [self.paths[i] for i in idx], self.variants)

    def latents_of(self, idx: list[int] | torch.Tensor) -> torch.Tensor:
        # (B, C, h, w)
        return torch.stack([self.latents[i]
                            for i in (idx.tolist() if isinstance(idx, torch.Tensor) else idx)])

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


def encode_examples(pipe, ds, seed: int = 0, phase=None, store=None) -> EncodedExamples:
    """The examples of `ds` (an ImageCaptionDataset, or anything with its `sizes`, `captions` and items) as
    cached latents and text embeddings.

    The VAE posterior is sampled with a generator seeded by `seed`, so every process (and a resumed run)
    caches the same latents. Images go through the VAE in groups of one size (with buckets, consecutive
    images of the same bucket) of at most ENCODE_BATCH images and ENCODE_PIXELS pixels (`image_groups`);
    each distinct caption through the text encoders once, ENCODE_BATCH at a time: the memory of caching does
    not grow with the dataset, only the cache does. phase: a context for each part, "cache captions" around
    the text encoders' (what a memory plan reads), or None. store: a `diskcache.DiskCache` each VAE and text
    encoder call is read from or written to (None: none).
    """
    g = torch.Generator(device=pipe.vae.device).manual_seed(seed)
    fields: dict[str, list[torch.Tensor]] = {}
    for start, stop in image_groups(ds.sizes):
        def compute(start=start, stop=stop) -> dict[str, list[torch.Tensor]]:
            return encode_group(pipe, [ds[i] for i in range(start, stop)], g)

        group = compute() if store is None else store.images(ds, start, stop, g, compute)
        for name, tensors in group.items():
            fields.setdefault(name, []).extend(tensors)
    with (phase or _unnamed)("cache captions"):
        embeds = encode_captions(pipe, ds.captions, store)
    paths = getattr(ds, "paths", None)
    return EncodedExamples(**fields, embeds=embeds, captions=list(ds.captions), sizes=list(ds.sizes),
                           paths=None if paths is None else [str(p) for p in paths])


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


def encode_group(pipe, items: list[dict], generator: torch.Generator) -> dict[str, list[torch.Tensor]]:
    """One VAE call's examples (dataset items of one size) as their per-example tensors by
    `EncodedExamples` field: {"latents": [(C, h, w), ...]} fp32 on the host."""
    images = torch.stack([item["image"] for item in items])
    return {"latents": list(encode_images(pipe, images, generator=generator).float().cpu())}


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
