"""Samples as a person reads them: a grid of tiles, one row per model, each with the strict reader's reading.

    reading_grid(rows, asked, reader, title="") -> matplotlib Figure
        rows: {row label: images (N, 3, H, W) in [0, 1]}; asked: (N,) the digit each column asked for

Each tile is drawn large with bicubic interpolation (as a screen scales a small image up; the reader sees the
H x W pixels themselves) and titled with what `effect.StrictReader` reads in it: the digit and its confidence,
green when it is the digit asked for with confidence >= 0.8, red otherwise ("no digit": like no real digit).
"""

from __future__ import annotations

import torch

from .effect import STRICT_CONFIDENCE, StrictReader

READ = "#1a7f37"  # green: read as the digit asked for
NOT_READ = "#cf222e"  # red


def tile_label(digit: int, confidence: float, like_a_digit: bool) -> str:
    """What the reader says about one tile, in a few characters."""
    return f"{digit}  {confidence:.1f}" if like_a_digit else "no digit"


def reading_grid(rows: dict[str, torch.Tensor], asked, reader: StrictReader, title: str = ""):
    """A figure: one row of tiles per entry of `rows`, each titled with its strict reading."""
    import matplotlib.pyplot as plt  # the notebooks extra

    asked = torch.as_tensor(asked)
    n = len(asked)
    fig, axes = plt.subplots(len(rows), n, figsize=(1.05 * n + 0.9, 1.5 * len(rows)), squeeze=False)
    for r, (label, images) in enumerate(rows.items()):
        reading = reader.read(images * 2 - 1)
        confidence = reader.confidence(images * 2 - 1, asked)
        for c in range(n):
            ax = axes[r, c]
            ax.imshow(images[c].float().mean(0), cmap="gray", vmin=0, vmax=1, interpolation="bicubic")
            ok = confidence[c].item() >= STRICT_CONFIDENCE
            text = tile_label(reading.digit[c].item(), reading.confidence[c].item(),
                              reading.like_a_digit[c].item())
            ax.set_title(text, fontsize=9, color=READ if ok else NOT_READ)
            ax.set_xticks([])
            ax.set_yticks([])
            for side in ax.spines.values():
                side.set_color(READ if ok else NOT_READ)
                side.set_linewidth(2)
        axes[r, 0].set_ylabel(label, fontsize=9)
    for c in range(n):
        axes[-1, c].set_xlabel(f"asked {asked[c].item()}", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
