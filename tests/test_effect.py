"""diffusion/effect.py: the classifiers that measure samples, checked on held-out real digits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")

from lora_lab.notebook.effect import digit_images, fit_classifiers

TRAIN = range(1600)
HELD_OUT = range(1600, 1797)


def test_digit_images_are_white_ink_on_black():
    x, y = digit_images(range(10))
    assert x.shape == (10, 3, 16, 16) and y.tolist() == list(range(10))
    assert -1 <= x.min() and x.max() <= 1
    assert (x[:, :, :, 0] == -1).all()  # the left column is background: black (sklearn digits leave it empty)
    xi, _ = digit_images(range(10), inverted=True)
    torch.testing.assert_close(xi, -x)


def test_classifiers_on_held_out_real_digits():
    digits, inverted = fit_classifiers(TRAIN)
    x, y = digit_images(HELD_OUT)
    xi, _ = digit_images(HELD_OUT, inverted=True)
    assert digits.accuracy(x, y) > 0.88
    assert digits.accuracy(xi, y) == digits.accuracy(x, y)  # reads the digit whatever the colours
    assert inverted.rate(x) == 0.0 and inverted.rate(xi) == 1.0
    # noise with no digit is not "a digit": the digit classifier's answer is near chance
    noise = torch.rand(200, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert digits.accuracy(noise, torch.arange(200) % 10) < 0.3
    # a mid-grey image is on the boundary's side of neither extreme; a white one reads as inverted
    assert inverted.rate(torch.ones(4, 3, 16, 16)) == 1.0
    assert inverted.rate(-torch.ones(4, 3, 16, 16)) == 0.0
