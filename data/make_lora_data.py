"""Write data/lora_inverted/: the LoRA training set, a style the base model never saw.

    PYTHONPATH=. python data/make_lora_data.py

N_IMAGES of sklearn's digits that the base model was NOT trained on (indices from 1600 on, see
data/make_base.py), upscaled to 16x16 like the base's data but INVERTED (black ink on white),
saved as PNG with same-stem captions "a digit three, inverted". Deterministic: no randomness.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lora_lab.diffusion.effect import digit_images
from lora_lab.diffusion.models import DIGIT_NAMES
from lora_lab.diffusion.sampling import to_pil

FIRST = 1600     # the first digit the base model did not see
N_IMAGES = 120
OUT = Path(__file__).resolve().parent / "lora_inverted"


def main() -> None:
    images, labels = digit_images(range(FIRST, FIRST + N_IMAGES), inverted=True)  # (N, 3, 16, 16) in [-1, 1]
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    for k, (img, y) in enumerate(zip(images, labels)):
        stem = f"{FIRST + k:04d}"
        to_pil((img + 1) / 2).save(OUT / f"{stem}.png")
        (OUT / f"{stem}.txt").write_text(f"a digit {DIGIT_NAMES[int(y)]}, inverted\n")
    print(f"wrote {N_IMAGES} images and captions to {OUT}")


if __name__ == "__main__":
    main()
