"""How much each pre-trained tiny base reads its prompt, on its own style and on notebook 07's inverted style:
the base's loss (its trainer's objective, the validation loss at step 0, before any update) on 150 images
with their own captions and with wrong ones (each digit's name replaced by that of the digit + 5).

    PYTHONPATH=. python benchmarks/caption_dependence.py        # sd3 z-image chroma qwen-image flux2
    PYTHONPATH=. python benchmarks/caption_dependence.py --model z-image

On its own style (data/lora_reg) a base that reads the digit from the prompt has a lower loss with the right
captions. On the inverted style (data/lora_inverted) the right caption draws the right digit in the base's
own colours: the opposite of the target pixel for pixel, so the loss is higher with the right captions than
with wrong ones, and a LoRA's first steps lower the loss by weakening what the prompt draws (notebook 07's
strip). SD3's bases keep a second path from the prompt (the pooled embedding into every block's modulation,
which the LoRA does not adapt); the other families' do not.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path

from lora_lab.diffusion import TrainConfig, train
from lora_lab.models import DATA_DIR, DIGIT_NAMES
from lora_lab.notebook.recipe import style_recipe

IMAGES = 150
MODELS = ("sd3", "z-image", "chroma", "qwen-image", "flux2")
WORD = re.compile(r"\b(" + "|".join(DIGIT_NAMES) + r")\b")


def captioned(source: Path, folder: Path, shift: int) -> Path:
    """The first IMAGES images of `source` with their captions, each digit's name moved on by `shift`."""
    folder.mkdir(parents=True)
    for png in sorted(source.glob("*.png"))[:IMAGES]:
        shutil.copy(png, folder / png.name)
        caption = png.with_suffix(".txt").read_text()
        moved = WORD.sub(lambda m: DIGIT_NAMES[(DIGIT_NAMES.index(m[1]) + shift) % 10], caption)
        (folder / png.with_suffix(".txt").name).write_text(moved)
    return folder


def base_loss(model: str, validation: Path, work: Path) -> float:
    """The validation loss at step 0 (the base alone) of a one-step run of notebook 07's recipe."""
    fields = dict(batch_size=4, seed=0, dataset=str(DATA_DIR / "lora_reg"),
                  validation_dataset=str(validation), validate_every=1)
    config = TrainConfig(**style_recipe(model, work / "out", 1, **fields))
    log = Path(train(config).outputs["loss_log"]).read_text().splitlines()
    return next(r["val_loss"] for r in map(json.loads, log) if r.get("step") == 0 and "val_loss" in r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", choices=MODELS, help="default: all of them")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sets = {f"{style} {which}": captioned(DATA_DIR / source, root / f"{style}-{which}", shift)
                for style, source in (("own", "lora_reg"), ("inverted", "lora_inverted"))
                for which, shift in (("right", 0), ("wrong", 5))}
        print("| base | " + " | ".join(sets) + " |\n|" + " --- |" * (len(sets) + 1), flush=True)
        for model in args.model or MODELS:
            losses = [base_loss(model, folder, root / f"run-{model}-{i}")
                      for i, folder in enumerate(sets.values())]
            print(f"| {model} | " + " | ".join(f"{v:.3f}" for v in losses) + " |", flush=True)


if __name__ == "__main__":
    main()
