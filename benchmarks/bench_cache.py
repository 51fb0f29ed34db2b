"""The disk cache's first and second run against a run without it: the cache phase's seconds and host memory.

    PYTHONPATH=. python benchmarks/bench_cache.py [--images 2000] [--resolution 64] [--variants 4]

A folder of `--images` noisy gradient PNGs (resolution x resolution, each with a tag caption) is cached by the
tiny SDXL base's VAE and two CLIP encoders on the CPU (`TrainingRun` through its cache phase, with caption
shuffling: `--variants` variants per image), each run in a subprocess of its own: without the disk cache, with
it into an empty folder (the first run: encodes and writes), with it again (the second: reads). Interleaved
over `--rounds` rounds (the machine's load falls on each alike). Per run: the cache phase's seconds, the
process's peak resident memory (`resource.getrusage` ru_maxrss) and after the cache phase its anonymous and
file-backed resident memory (/proc/self/status RssAnon, RssFile: the disk cache's latents are file pages),
the anonymous memory after glibc's `malloc_trim(0)` (what the allocator kept of freed memory given back), the
encoder calls (VAE encoder and text encoders' forwards) and the cache folder's size.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("no disk cache", "disk cache, first run", "disk cache, second run")


def make_folder(folder: Path, images: int, resolution: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 200, resolution)[None, :, None]
    for i in range(images):
        pixels = (rng.integers(0, 50, (resolution, resolution, 3)) + ramp).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.png")
        (folder / f"{i:05d}.txt").write_text(f"image {i}, tag {i % 7}, tag {i % 11}, style {i % 3}")


def child(args) -> None:
    """One run's cache phase, measured; a JSON line on stdout."""
    import torch
    from diffusers.models.autoencoders.vae import Encoder
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from lora_lab.diffusion import TrainConfig
    from lora_lab.diffusion.trainer import TrainingRun

    torch.set_num_threads(1)
    calls = [0]
    encoders = (Encoder, CLIPTextModel, CLIPTextModelWithProjection)
    torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, o: calls.__setitem__(0, calls[0] + isinstance(m, encoders)))
    config = TrainConfig(model="sdxl", device="cpu", dataset=args.data, resolution=args.resolution,
                         shuffle_captions=True, caption_variants=args.variants, sample_steps=0,
                         progress=False, output=args.output, cache_dir=args.cache)
    run = TrainingRun(config)
    run.setup()
    run.open_base()
    t = time.perf_counter()
    run.cache()
    seconds = time.perf_counter() - t
    kib = rss_kib()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the allocator keeps of freed memory, given back
    print(json.dumps({"seconds": seconds, "peak_mib": peak,
                      "anon_mib": kib["RssAnon"] / 1024, "file_mib": kib["RssFile"] / 1024,
                      "trimmed_mib": rss_kib()["RssAnon"] / 1024,
                      "calls": calls[0], "examples": len(run.data.latents)}))


def rss_kib() -> dict[str, int]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(status[k].split()[0]) for k in ("RssAnon", "RssFile")}


def run_child(data: Path, output: Path, cache: Path | None, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--data", str(data), "--output", str(output),
           "--resolution", str(args.resolution), "--variants", str(args.variants)]
    if cache is not None:
        cmd += ["--cache", str(cache)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--variants", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true")
    p.add_argument("--data"), p.add_argument("--output"), p.add_argument("--cache")
    args = p.parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "data"
        data.mkdir()
        make_folder(data, args.images, args.resolution)
        rows: dict[str, list[dict]] = {m: [] for m in MODES}
        size = 0
        for r in range(args.rounds):
            cache = tmp / f"cache{r}"
            rows[MODES[0]].append(run_child(data, tmp / f"out{r}a", None, args))
            rows[MODES[1]].append(run_child(data, tmp / f"out{r}b", cache, args))
            rows[MODES[2]].append(run_child(data, tmp / f"out{r}c", cache, args))
            size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
            shutil.rmtree(cache)
    examples = rows[MODES[0]][0]["examples"]
    print(f"{args.images} images {args.resolution}x{args.resolution} PNG, {args.variants} caption variants "
          f"({examples} examples), tiny SDXL on the CPU, 1 thread; best of {args.rounds} interleaved rounds; "
          f"cache folder {size / 2**20:.1f} MiB")
    print(f"{'run':<24} {'cache s':>8} {'peak RSS MiB':>13} {'anon MiB':>9} {'trimmed':>8} {'file MiB':>9} "
          f"{'encoder calls':>14}")
    for mode, runs in rows.items():
        best = min(runs, key=lambda x: x["seconds"])
        print(f"{mode:<24} {best['seconds']:>8.2f} {min(x['peak_mib'] for x in runs):>13.1f} "
              f"{best['anon_mib']:>9.1f} {best['trimmed_mib']:>8.1f} {best['file_mib']:>9.1f} "
              f"{best['calls']:>14}")
    first, second = (min(x["seconds"] for x in rows[m]) for m in MODES[1:])
    plain = min(x["seconds"] for x in rows[MODES[0]])
    print(f"second run / first run: {second / first:.3f}; first run / no disk cache: {first / plain:.3f}")


if __name__ == "__main__":
    main()
