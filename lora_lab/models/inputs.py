"""The denoisers' extra inputs, as plain tensors: Flux's 2x2 latent packing, rotary ids and guidance;
SDXL's time ids.

    pack_latents(x) / unpack_latents(packed, h, w)  -> Flux's patch packing (B, C, h, w) <-> (B, hw/4, 4C)
    flux_latent_ids(h, w), flux_text_ids(T), flux_guidance(B, value)
    sdxl_time_ids(batch, height, width)             -> (B, 6) SDXL's (original size, crop, target size)
"""

from __future__ import annotations

import torch


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, (h/2)(w/2), 4C): each 2x2 patch becomes one token, channels (C, 2, 2)."""
    B, C, h, w = x.shape
    x = x.view(B, C, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # (B, h/2, w/2, C, 2, 2)
    return x.reshape(B, (h // 2) * (w // 2), C * 4)


def unpack_latents(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of `pack_latents`: (B, (h/2)(w/2), 4C) -> (B, C, h, w)."""
    B, _, D = x.shape
    x = x.view(B, h // 2, w // 2, D // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)  # (B, C, h/2, 2, w/2, 2)
    return x.reshape(B, D // 4, h, w)


def flux_latent_ids(h: int, w: int) -> torch.Tensor:
    """Rotary position ids of the packed image tokens, ((h/2)(w/2), 3): (0, row, column)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


def flux_text_ids(num_tokens: int) -> torch.Tensor:
    """Rotary position ids of the text tokens: all zero, (T, 3)."""
    return torch.zeros(num_tokens, 3)


def flux_guidance(batch: int, value: float = 1.0) -> torch.Tensor:
    """The guidance-embedding input of guidance-distilled Flux: the guidance scale per sample, (B,)."""
    return torch.full((batch,), float(value))


def sdxl_time_ids(batch: int, height: int, width: int) -> torch.Tensor:
    """SDXL's micro-conditioning as its pipeline builds it for an uncropped image of the target size:
    (original h, original w, crop top, crop left, target h, target w), (B, 6)."""
    return torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32).repeat(batch, 1)
