"""Write the LoRA training data: data/lora_inverted/ (a style the base never saw) and data/lora_reg/.

    PYTHONPATH=. python data/make_lora_data.py

data/lora_inverted/: every one of sklearn's digits that the base models were NOT trained on (indices
FIRST..1796, see data/make_base.py), upscaled to 16x16 like the bases' data but INVERTED (black ink on
white), saved as PNG with same-stem captions naming the digit and the style: "a digit three, inverted".
data/lora_reg/: the same held-out digits in the bases' own style (white ink on black), captioned
"a digit three": regularization images for prior preservation (`--reg-dataset`), so that a LoRA learns
what the word "inverted" changes and leaves the rest of the model as it was. Deterministic: no randomness.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lora_lab.diffusion.sampling import to_pil
from lora_lab.models import DIGIT_NAMES
from lora_lab.notebook.effect import digit_images

FIRST = 1600     # the first digit the base models did not see
LAST = 1797      # sklearn has 1797 digits
HERE = Path(__file__).resolve().parent


def write(out: Path, inverted: bool, suffix: str) -> int:
    images, labels = digit_images(range(FIRST, LAST), inverted=inverted)  # (N, 3, 16, 16) in [-1, 1]
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for k, (img, y) in enumerate(zip(images, labels)):
        stem = f"{FIRST + k:04d}"
        to_pil((img + 1) / 2).save(out / f"{stem}.png")
        (out / f"{stem}.txt").write_text(f"a digit {DIGIT_NAMES[int(y)]}{suffix}\n")
    return len(images)


def main() -> None:
    for name, inverted, suffix in [("lora_inverted", True, ", inverted"), ("lora_reg", False, "")]:
        n = write(HERE / name, inverted, suffix)
        print(f"wrote {n} images and captions to {HERE / name}")


if __name__ == "__main__":
    main()
