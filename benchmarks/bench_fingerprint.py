"""What the resume fingerprint's content hash costs beside what a run does with the same images anyway.

    PYTHONPATH=. python benchmarks/bench_fingerprint.py

For a 1024 x 1024 PNG and JPEG (a smooth gradient with noise, as photos compress): the time of hashing the
file's bytes as `diffusion/data.folder_fingerprint` does (blake2b) and of decoding the image as the cache
phase does (`diffusion/data._open_image`: PIL, fully decoded, EXIF orientation, RGB), interleaved over REPS
rounds, and their ratio. A ratio well under 1 means the fingerprint adds a fraction of the cache phase's
reading.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from lora_lab.diffusion.data import _open_image

REPS = 10


def _hash(path: Path) -> None:
    contents = hashlib.blake2b()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            contents.update(chunk)
    contents.digest()


def main() -> None:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 40, (1024, 1024, 3))
    pixels = (noise + np.linspace(0, 200, 1024)[None, :, None]).astype(np.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'file':<10} {'MB':>6} {'hash ms':>8} {'decode ms':>10} {'hash/decode':>12}")
        for name in ("image.png", "image.jpg"):
            path = Path(tmp) / name
            Image.fromarray(pixels).save(path)
            hashed = decoded = 0.0
            for _ in range(REPS):  # interleaved: the machine's load falls on both alike
                t = time.perf_counter()
                _hash(path)
                hashed += time.perf_counter() - t
                t = time.perf_counter()
                _open_image(path)
                decoded += time.perf_counter() - t
            print(f"{name:<10} {path.stat().st_size / 1e6:>6.2f} {1e3 * hashed / REPS:>8.1f} "
                  f"{1e3 * decoded / REPS:>10.1f} {hashed / decoded:>12.3f}")


if __name__ == "__main__":
    main()
