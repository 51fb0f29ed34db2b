"""Does a style LoRA keep the content? Notebook 07's recipe with one thing changed, its rates printed.

    PYTHONPATH=. python benchmarks/content_probe.py --model z-image                      # the recipe itself
    PYTHONPATH=. python benchmarks/content_probe.py --model chroma --rank 32
    PYTHONPATH=. python benchmarks/content_probe.py --model z-image --adapter loha
    PYTHONPATH=. python benchmarks/content_probe.py --model flux2 --targets 'transformer_blocks\\..*'
    PYTHONPATH=. python benchmarks/content_probe.py --model z-image --trigger front  # "inverted, a digit 3"

Trains notebook 07's style LoRA (recipe.style_recipe: data/lora_inverted, 200 steps, rank 8, attention and
feed-forward) with the change asked for, samples "a digit 0..9, inverted" (or the captions' form of
--trigger) at 5 seeds without and with the LoRA (20 Euler steps, guidance 4), and prints one JSON line: the
strict reader's digit rate (the notebook's content measure) and the inverted rate of each. --targets is a
regular expression over the denoiser's module names (re.fullmatch), in place of the recipe's suffixes; the
run is otherwise train()'s own. About 10-60 s a run on one thread here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from lora_lab import lora_disabled
from lora_lab.diffusion import TrainConfig, sample, train
from lora_lab.models import DATA_DIR, denoiser
from lora_lab.notebook.effect import StrictReader, fit_classifiers
from lora_lab.notebook.recipe import prompts, style_recipe

TRIGGERS = {"end": lambda c: c, "front": lambda c: "inverted, " + c.removesuffix(", inverted"),
            "none": lambda c: c.removesuffix(", inverted")}  # where the style's word sits in every caption


@dataclasses.dataclass
class Targeted(TrainConfig):
    """TrainConfig with its adapters on the modules a regular expression names."""

    pattern: str = ".*"

    def adapter_targets(self):
        return self.pattern


def captioned(folder: Path, trigger) -> Path:
    """data/lora_inverted's images with each caption rewritten by `trigger`, in `folder` (made)."""
    folder.mkdir()
    for png in sorted((DATA_DIR / "lora_inverted").glob("*.png")):
        shutil.copy(png, folder / png.name)
        caption = png.with_suffix(".txt").read_text().strip()
        (folder / png.with_suffix(".txt").name).write_text(trigger(caption))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="z-image")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--adapter", default="lora", choices=["lora", "lokr", "loha"])
    ap.add_argument("--targets", default=None, help="a regular expression over module names (re.fullmatch)")
    ap.add_argument("--trigger", default="end", choices=sorted(TRIGGERS))
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="content_probe_"))
    trigger = TRIGGERS[args.trigger]
    data = DATA_DIR / "lora_inverted" if args.trigger == "end" else captioned(work / "data", trigger)
    fields = style_recipe(args.model, work / "run", args.steps, lr=args.lr, rank=args.rank, batch_size=16,
                          seed=0, adapter=args.adapter, dataset=str(data))
    config = TrainConfig(**fields) if args.targets is None else Targeted(**fields, pattern=args.targets)
    t0 = time.time()
    result = train(config)
    asked = [trigger(p) for p in prompts()]
    labels = torch.arange(10).repeat(args.seeds)
    reader, (_, inverted) = StrictReader.fit(size=16), fit_classifiers()

    def rates() -> tuple[float, float]:
        images = torch.cat([sample(result.pipe, asked, seed=s, steps=20, guidance=4.0)
                            for s in range(args.seeds)]) * 2 - 1
        return round(reader.rate(images, labels), 2), round(inverted.rate(images), 2)

    with lora_disabled(denoiser(result.pipe)):
        base = rates()
    lora = rates()
    print(json.dumps({**{k: v for k, v in vars(args).items() if k != "seeds"}, "adapted": len(result.adapted),
                      "digit_rate": {"base": base[0], "lora": lora[0]},
                      "inverted_rate": {"base": base[1], "lora": lora[1]},
                      "samples": 10 * args.seeds, "seconds": round(time.time() - t0)}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
