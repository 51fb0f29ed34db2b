"""Which parts of notebook 07's style-LoRA recipe are needed: the recipe, then one row per option left out.

    PYTHONPATH=. python benchmarks/ablate_style_lora.py --model sdxl     # and --model sd3

The recipe is notebook 07's `parameters` cell, read from the notebook (so the table always ablates what
`make run` trains). Each row trains that recipe with one option taken away, then samples 10 * EVAL_SEEDS
images ("a digit zero, inverted" .. "a digit nine, inverted", the notebook's seeds) at strength 1 and prints
the inverted rate and the digit accuracy measured by the notebook's classifiers (`fit_classifiers()`).
Rows:
    recipe                       the notebook's defaults
    - prior preservation         no data/lora_reg (PRIOR = False)
    - caption dropout            CAPTION_DROPOUT = 0
    - all held-out digits        the first 120 of data/lora_inverted only (the set before issue 15)
    - digit named in caption     captions "a digit, inverted" (the style only)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from lora_lab.diffusion import TrainConfig, denoiser, train
from lora_lab.diffusion.effect import fit_classifiers
from lora_lab.diffusion.models import DATA_DIR, DIGIT_NAMES
from lora_lab.diffusion.sampling import sample
from lora_lab.notebook import _literal_assignments

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "07_diffusion_lora.ipynb"


def recipe() -> dict:
    """Notebook 07's parameters cell, as {NAME: value}."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    cell = next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
    return _literal_assignments("".join(cell["source"]))


def subset_folder(tmp: Path, n: int | None, caption=None) -> Path:
    """A copy of data/lora_inverted: its first `n` examples, captions rewritten by `caption(old)`."""
    src = DATA_DIR / "lora_inverted"
    out = tmp / f"style_{n}_{caption is not None}"
    out.mkdir()
    for png in sorted(src.glob("*.png"))[:n]:
        shutil.copy(png, out / png.name)
        text = png.with_suffix(".txt").read_text()
        (out / png.with_suffix(".txt").name).write_text(caption(text) if caption else text)
    return out


def run(p: dict, model: str, dataset: Path | None, out: Path) -> dict:
    config = TrainConfig(model=model, output=str(out), dataset=None if dataset is None else str(dataset),
                         steps=p["STEPS"], rank=p["RANK"], lr=p["LR"], batch_size=p["BATCH_SIZE"],
                         reg_dataset=str(DATA_DIR / "lora_reg") if p["PRIOR"] else None,
                         prior_loss_weight=p["PRIOR_LOSS_WEIGHT"], caption_dropout=p["CAPTION_DROPOUT"],
                         dora=p["DORA"], warmup_steps=max(1, p["STEPS"] // 10), schedule="cosine", seed=p["SEED"],
                         sample_steps=0, progress=False)
    t0 = time.time()
    result = train(config)
    seconds = time.time() - t0
    denoiser(result.pipe).eval()
    prompts = [f"a digit {DIGIT_NAMES[d]}, inverted" for d in range(10)]
    seeds = range(p["SEED"], p["SEED"] + p["EVAL_SEEDS"])
    images = torch.cat([sample(result.pipe, prompts, seed=s, steps=p["SAMPLE_STEPS"]) for s in seeds]) * 2 - 1
    digits, inverted = fit_classifiers()
    labels = torch.arange(10).repeat(len(seeds))
    return {"inverted": inverted.rate(images), "digit": digits.accuracy(images, labels), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="sdxl", choices=["sdxl", "sd3"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = recipe()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = [
            ("recipe (notebook 07's defaults)", base, None),
            ("- prior preservation (no data/lora_reg)", {**base, "PRIOR": False}, None),
            ("- caption dropout", {**base, "CAPTION_DROPOUT": 0.0}, None),
            ("- all held-out digits (first 120 only)", base, subset_folder(tmp, 120)),
            ("- digit named in the caption", base,
             subset_folder(tmp, None, lambda t: "a digit, inverted\n")),
        ]
        print(f"| {args.model}: left out | inverted rate | digit accuracy | train s |")
        print("| --- | ---: | ---: | ---: |")
        for i, (name, p, dataset) in enumerate(rows):
            if name.startswith("- caption dropout") and not base["CAPTION_DROPOUT"]:
                continue  # not in the recipe: nothing to leave out
            if name.startswith("- prior") and not base["PRIOR"]:
                continue
            r = run(p, args.model, dataset, tmp / f"run{i}")
            print(f"| {name} | {r['inverted']:.2f} | {r['digit']:.2f} | {r['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
