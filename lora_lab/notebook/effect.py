"""Measuring what a sample shows, with simple classifiers fitted on real data (scikit-learn's digits).

API:
    digit_images(indices=None, size=RESOLUTION, inverted=False)
        -> (images (N, 3, size, size) in [-1, 1], labels (N,))
    DigitClassifier.fit(images, labels) / .predict(images) -> labels;  .accuracy(images, labels) -> float
        .confidence(images, labels) -> float: the mean probability the classifier gives the digit asked for
    InvertedClassifier.fit(normal, inverted) / .predict(images) -> bool (N,);  .rate(images) -> float
    fit_classifiers(train_indices) -> (DigitClassifier, InvertedClassifier) fitted on real digits
    StrictReader.fit(size=RESOLUTION) -> the strict reader of each tile, on all 1797 real digits
        .read(images) -> Reading (digit, confidence, distance, like_a_digit per image)
        .confidence(images, asked) -> (N,);  .rate(images, asked) -> float (read as asked, confidence >= 0.8)

The images are sklearn's 8x8 digits (ink 0..16) upscaled bilinearly; ink is white (+1) on black (-1).
"Inverted" is the new style the LoRA in data/lora_inverted teaches: black ink on a white background.
The digit classifier reads an image average-pooled back to 8x8 (logistic regression on 64 pixels),
after turning an image with a light border (the inverted style) back to light ink on dark, so it
says which digit is drawn whatever the colours;
the strict reader compares each image, every pixel at full resolution, with the 1797 real digits (a
5-nearest-neighbour reading, with a check that the image is as close to real digits as they are to each
other);
the inversion classifier reads three statistics (mean of the border, of the centre, of the whole
image) with a logistic regression, so it keys on the background colour, not on a digit's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import LoraLabError
from ..models import RESOLUTION
from .digits import digit_arrays

# scikit-learn is imported where a classifier is fitted: it is optional (the notebooks extra).


def digit_images(indices=None, size: int = RESOLUTION,
                 inverted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's digits as RGB images in [-1, 1] (white ink on black; `inverted`: black on white)."""
    x, y = digit_arrays()  # (N, 8, 8) ink in [0, 1], (N,)
    if indices is not None:
        idx = torch.as_tensor(indices)
        x, y = x[idx], y[idx]
    x = F.interpolate(x[:, None], size=(size, size), mode="bilinear", align_corners=False)  # (N, 1, s, s)
    x = x.clamp(0, 1) * 2 - 1
    if inverted:
        x = -x
    return x.repeat(1, 3, 1, 1), y


def _gray(images: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) in [-1, 1] -> (N, H, W) grey in [-1, 1]."""
    return images.float().mean(dim=1)


def _upright(images: torch.Tensor) -> torch.Tensor:
    """Grey, light ink on dark (an image with a light border, the inverted style, is turned back): (N, H,
    W)."""
    g = _gray(images)
    light_border = torch.from_numpy(_brightness_stats(images)[:, 0] > 0)  # (N,) the inverted style
    return torch.where(light_border[:, None, None], -g, g)


def _pixels8(images: torch.Tensor) -> np.ndarray:
    """Average-pooled to 8x8, the digits' native size, light ink on dark: (N, 64)."""
    g = F.adaptive_avg_pool2d(_upright(images)[:, None], 8)
    return g.reshape(len(images), -1).numpy()


def _brightness_stats(images: torch.Tensor) -> np.ndarray:
    """(border mean, centre mean, overall mean) per image: (N, 3)."""
    g = _gray(images)
    H, W = g.shape[-2:]
    b = max(1, H // 8)
    border = torch.ones(H, W, dtype=torch.bool)
    border[b:-b, b:-b] = False
    centre = g[:, H // 4: 3 * H // 4, W // 4: 3 * W // 4]
    return torch.stack([g[:, border].mean(1), centre.mean((1, 2)), g.mean((1, 2))], dim=1).numpy()


@dataclass
class DigitClassifier:
    """Which digit an image shows: logistic regression on its 8x8 average-pooled grey pixels."""

    model: object = field(default=None, repr=False)

    def fit(self, images: torch.Tensor, labels: torch.Tensor) -> DigitClassifier:
        from sklearn.linear_model import LogisticRegression

        self.model = LogisticRegression(max_iter=2000, C=1.0).fit(_pixels8(images), labels.numpy())
        return self

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(self.model.predict(_pixels8(images)))

    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        return float((self.predict(images) == torch.as_tensor(labels)).float().mean())

    def confidence(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """The mean over images of the probability given to the digit asked for (`labels`): an image
        read correctly but hesitantly scores below 1, one read as another digit scores near 0."""
        proba = self.model.predict_proba(_pixels8(images))  # (N, 10), columns = self.model.classes_
        col = np.searchsorted(self.model.classes_, torch.as_tensor(labels).numpy())
        return float(proba[np.arange(len(col)), col].mean())


@dataclass
class InvertedClassifier:
    """Whether an image is in the inverted style (dark ink on a light background)."""

    model: object = field(default=None, repr=False)

    def fit(self, normal: torch.Tensor, inverted: torch.Tensor) -> InvertedClassifier:
        from sklearn.linear_model import LogisticRegression

        X = np.concatenate([_brightness_stats(normal), _brightness_stats(inverted)])
        y = np.r_[np.zeros(len(normal)), np.ones(len(inverted))]
        self.model = LogisticRegression(max_iter=1000).fit(X, y)
        return self

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(self.model.predict(_brightness_stats(images)) > 0.5)

    def rate(self, images: torch.Tensor) -> float:
        """The fraction of `images` classified as inverted."""
        return float(self.predict(images).float().mean())


def fit_classifiers(train_indices=None) -> tuple[DigitClassifier, InvertedClassifier]:
    """Both classifiers fitted on real digits (all 1797 by default, or `train_indices`)."""
    x, y = digit_images(train_indices)
    xi, _ = digit_images(train_indices, inverted=True)
    return DigitClassifier().fit(x, y), InvertedClassifier().fit(x, xi)


STRICT_CONFIDENCE = 0.8  # a tile counts as read when at least this share of its nearest real digits agree


@dataclass
class Reading:
    """What the strict reader sees in each image."""

    digit: torch.Tensor  # (N,) int64: the digit most of its K nearest real digits show
    confidence: torch.Tensor  # (N,) share of the K nearest real digits showing `digit`; 0 if not like_a_digit
    distance: torch.Tensor  # (N,) mean pixel distance to those K real digits
    like_a_digit: torch.Tensor  # (N,) bool: distance within what real digits have to each other


@dataclass
class StrictReader:
    """Which digit an image shows, read strictly: compared at full resolution (every pixel, grey, light ink
    on dark, nothing pooled) with real digits; the reading is the digit of its K nearest real digits, the
    confidence the share of them that agree. An image farther from its nearest real digits than `far` (the
    `quantile` of the real digits' own distances to their K nearest others) is like no real digit: confidence
    0, whatever its neighbours show: a blob with a digit's ink roughly in place reads as nothing."""

    references: torch.Tensor = field(repr=False)  # (M, H*W) the real digits, upright grey
    labels: torch.Tensor = field(repr=False)  # (M,)
    size: int
    k: int
    far: float

    @classmethod
    def fit(cls, size: int = RESOLUTION, k: int = 5, quantile: float = 0.99, indices=None) -> StrictReader:
        """The reader on scikit-learn's real digits (all 1797, or `indices`) upscaled to size x size."""
        x, y = digit_images(indices, size=size)
        refs = _upright(x).reshape(len(x), -1)
        d = torch.cdist(refs, refs)
        d.fill_diagonal_(float("inf"))  # leave-one-out: a digit is not its own neighbour
        far = d.topk(k, largest=False).values.mean(1).quantile(quantile).item()
        return cls(refs, y, size, k, far)

    def _neighbours(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels of the K nearest real digits (N, K), their mean distance (N,)) of `images`."""
        if tuple(images.shape[-2:]) != (self.size, self.size):
            raise LoraLabError(f"StrictReader was fitted on {self.size}x{self.size} digits; got images of "
                               f"{tuple(images.shape[-2:])}")
        g = _upright(images).reshape(len(images), -1)
        dist, idx = torch.cdist(g, self.references).topk(self.k, largest=False)  # (N, K)
        return self.labels[idx], dist.mean(1)

    def read(self, images: torch.Tensor) -> Reading:
        """The reading of `images` (N, 3, size, size) in [-1, 1]."""
        labels, distance = self._neighbours(images)
        share, digit = F.one_hot(labels, 10).float().mean(1).max(1)  # the majority and its share
        like = distance <= self.far
        return Reading(digit, torch.where(like, share, 0.0), distance, like)

    def confidence(self, images: torch.Tensor, asked) -> torch.Tensor:
        """(N,) the share of each image's K nearest real digits that show the digit `asked` (a scalar or
        (N,)), 0 for an image like no real digit."""
        labels, distance = self._neighbours(images)
        share = (labels == torch.as_tensor(asked).reshape(-1, 1)).float().mean(1)
        return torch.where(distance <= self.far, share, 0.0)

    def rate(self, images: torch.Tensor, asked, threshold: float = STRICT_CONFIDENCE) -> float:
        """The fraction of `images` read as the digit `asked` with confidence at least `threshold`."""
        return float((self.confidence(images, asked) >= threshold).float().mean())
