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


def test_strict_reader_reads_real_digits_and_refuses_blobs():
    from lora_lab.errors import LoraLabError
    from lora_lab.notebook.effect import StrictReader

    reader = StrictReader.fit(indices=TRAIN)
    x, y = digit_images(HELD_OUT)
    xi, _ = digit_images(HELD_OUT, inverted=True)
    assert reader.rate(x, y) >= 0.85  # 4 of the 5 nearest real digits agree for most digits of unseen writers
    torch.testing.assert_close(reader.confidence(xi, y), reader.confidence(x, y))  # whatever the colours
    read = reader.read(x)
    assert (read.digit == y).float().mean() > 0.9 and read.like_a_digit.float().mean() > 0.9
    # the same digits smeared into blobs (each pixel's ink spread over 5x5 and doubled: strokes merge): the
    # ink is still where the digit's is, so the pooled classifier reads most of them, but they are like no
    # real digit
    blobs = (torch.nn.functional.avg_pool2d(x + 1, 5, stride=1, padding=2, count_include_pad=False) * 2 - 1)
    blobs = blobs.clamp(-1, 1)
    digits, _ = fit_classifiers(TRAIN)
    assert digits.accuracy(blobs, y) > 0.7
    assert reader.rate(blobs, y) < 0.1 and reader.read(blobs).like_a_digit.float().mean() < 0.1
    noise = torch.rand(50, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert reader.rate(noise, torch.arange(50) % 10) == 0.0
    with pytest.raises(LoraLabError, match="16x16"):
        reader.read(torch.zeros(2, 3, 32, 32))
