"""A small real task for the notebooks: scikit-learn's 1797 handwritten digits, and a plain training loop.

The digits ship inside scikit-learn (no download). They are 8x8 images with values 0..16; `load_digits`
scales them to [0, 1], optionally resizes them (bilinear) to size x size, flattens them, and splits
them into train and test sets with a seeded, stratified-by-shuffle split.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LoraLabError


@dataclass
class Split:
    x_train: torch.Tensor  # (N, size*size) float32 in [0, 1]
    y_train: torch.Tensor  # (N,) int64 labels, the digit
    x_test: torch.Tensor
    y_test: torch.Tensor


def digit_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 of scikit-learn's digits: images (N, 8, 8) float32 with ink in [0, 1], labels (N,) int64."""
    # scikit-learn is imported here, not at the top: it is optional (the notebooks extra)
    from sklearn.datasets import load_digits as _sk_digits

    data = _sk_digits()
    return torch.tensor(data.images, dtype=torch.float32) / 16.0, torch.tensor(data.target, dtype=torch.int64)


def load_digits(
    size: int = 8, classes: Sequence[int] | None = None, test_fraction: float = 0.25, seed: int = 0
) -> Split:
    """Digits as flat float32 vectors of size*size pixels, split into train/test (labels stay 0..9)."""
    if not 0.0 < test_fraction < 1.0:
        raise LoraLabError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x, y = digit_arrays()  # (1797, 8, 8), (1797,)
    if classes is not None:
        keep = torch.isin(y, torch.tensor(list(classes)))
        if not keep.any():
            raise LoraLabError(f"no digits of classes {list(classes)}; the digits are 0..9")
        x, y = x[keep], y[keep]
    if size != 8:
        x = F.interpolate(x[:, None], size=(size, size), mode="bilinear", align_corners=False)[:, 0]
    x = x.reshape(len(x), -1)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return Split(x[train], y[train], x[test], y[test])


def train_classifier(
    model: nn.Module,
    params: Iterable[torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    optimizer: type[torch.optim.Optimizer] = torch.optim.Adam,
) -> list[float]:
    """Train `params` of a classifier with cross-entropy; returns the mean loss of each epoch."""
    params = list(params)
    if not params:
        raise LoraLabError("train_classifier() was given no parameters to train")
    opt = optimizer(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        total = 0.0
        for i in range(0, len(x), batch_size):
            idx = perm[i : i + batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        losses.append(total / len(x))
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of `x` whose arg-max prediction equals `y`."""
    model.eval()
    return (model(x).argmax(-1) == y).float().mean().item()
