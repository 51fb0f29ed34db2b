"""What watching a run costs: a tiny-base training run with samples every 50 steps and the validation loss
every 25 steps, against the same run without them, side by side.

    PYTHONPATH=. python benchmarks/bench_watch.py [--model sd3] [--steps 200] [--batch-size 16] [--rounds 2]
                                                  [--held-out 10] [--threads 1]

The defaults are notebook 07's run (the tiny sd3 base, 200 steps of batch 16, 10 held-out images). Both runs
train the same steps on the same data (data/lora_inverted) with the same seed; the watched one also
samples its 4 default prompts (20 denoising steps) at step 0 and every 50 steps, and computes the validation
loss of `--held-out` images (copied from the dataset into a validation folder, so the training set is the same
in both rows) at step 0 and every 25 steps. Rows are interleaved (each once per round); the table shows the
median wall time of `train()` over the rounds (the whole run: opening the base, caching, the steps, the files)
and the ratio to the plain run, and the same for this process's CPU seconds (user + system). On a shared
machine both move with the load between runs, so the table also splits the watched run itself: the wall
seconds of its training steps (loss.jsonl's `seconds`) and of its watching (inside `Watch.watched`: the
validation losses and the samples), measured side by side in one run under one load. Target: the watched run
costs at most 15% more than the plain one. This script sets torch's thread count and says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lora_lab.diffusion.trainer import TrainConfig, train
from lora_lab.diffusion.watch import Watch
from lora_lab.models import DATA_DIR

DATASET = DATA_DIR / "lora_inverted"


def held_out_folder(folder: Path, n: int) -> Path:
    """A folder holding copies of the dataset's first n images and captions (the validation set)."""
    for image in sorted(DATASET.glob("*.png"))[:n]:
        shutil.copy(image, folder / image.name)
        shutil.copy(image.with_suffix(".txt"), folder / image.with_suffix(".txt").name)
    return folder


WATCHED = [0.0]  # wall seconds inside Watch.watched (the validation losses and samples) of the current run


def timed_watched(self):
    t0 = time.perf_counter()
    try:
        return REAL_WATCHED(self)
    finally:
        WATCHED[0] += time.perf_counter() - t0


REAL_WATCHED, Watch.watched = Watch.watched, timed_watched


def one_run(config: TrainConfig) -> tuple[float, float, float, float]:
    """(wall seconds, this process's CPU seconds) of one train(); the wall seconds of its training steps (the
    sum of loss.jsonl's `seconds`) and of its watching (validation losses and samples)."""
    WATCHED[0] = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    train(config)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    log = [json.loads(line) for line in (Path(config.output) / "loss.jsonl").read_text().splitlines()]
    return wall, cpu, sum(r.get("seconds", 0.0) for r in log), WATCHED[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="sd3")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--held-out", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}; model {args.model} (tiny base), {args.steps} steps of "
          f"batch {args.batch_size}, {args.rounds} rounds")
    times: dict[str, list[tuple[float, ...]]] = {"plain": [], "samples every 50 + validation every 25": []}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "val").mkdir()
        val = held_out_folder(Path(tmp) / "val", args.held_out)
        base = {"model": args.model, "dataset": str(DATASET), "steps": args.steps,
                "batch_size": args.batch_size, "progress": False, "seed": 0}
        for r in range(args.rounds):
            for name in times:
                # both draw the end's with/without grid (the default); only the watching differs
                watched = {"sample_every": 50, "validation_dataset": str(val), "validate_every": 25} \
                    if name != "plain" else {}
                config = TrainConfig(output=f"{tmp}/{name[:5]}{r}", **base, **watched)
                wall, cpu, steps, watching = one_run(config)
                times[name].append((wall, cpu, steps, watching))
                print(f"  round {r + 1}: {name}: {wall:.1f} s wall, {cpu:.1f} s CPU; steps {steps:.1f} s, "
                      f"watching {watching:.1f} s", flush=True)
    wall0 = statistics.median(v[0] for v in times["plain"])
    cpu0 = statistics.median(v[1] for v in times["plain"])
    print(f"\n| run ({args.model}, {args.steps} steps, batch {args.batch_size}, {args.threads} threads) "
          "| wall s | ratio | CPU s | ratio | steps s | watching s | watching / steps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, values in times.items():
        wall, cpu, steps, watching = (statistics.median(v[i] for v in values) for i in range(4))
        print(f"| {name} | {wall:.1f} | {wall / wall0:.3f} | {cpu:.1f} | {cpu / cpu0:.3f} | {steps:.1f} | "
              f"{watching:.1f} | {watching / steps:.3f} |")


if __name__ == "__main__":
    main()
