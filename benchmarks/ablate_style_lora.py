"""Which parts of notebook 07's style-LoRA recipe matter: the recipe, then one row per option changed.

    PYTHONPATH=. python benchmarks/ablate_style_lora.py --model sd3     # and --model sdxl

The recipe is notebook 07's `parameters` cell, read from the notebook (so the table always varies what
`make run` trains). Each row trains the recipe with one option flipped (left out where the recipe has it,
added where it does not), samples 10 * EVAL_SEEDS images ("a digit zero, inverted" .. "a digit nine,
inverted", the notebook's seeds) at strength 1 and prints the inverted rate and the digit rate measured by
the notebook's readers (`fit_classifiers()` for the inversion, `StrictReader` for the digit: read as the
digit asked for with confidence >= 0.8), and the same for the plain prompts ("a digit zero" ..): what prior
preservation is for. Rows: the recipe; prior preservation (data/lora_reg) on/off; caption dropout 0.1
on/off; only the first 120 style images (the set before issue 15); captions without the digit ("a digit,
inverted"); half the steps; on the UNet bases, no LoCon; on the transformers, no feed-forward layers
(attention projections only) and, with them off, the learning rate of the UNets.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from lora_lab.diffusion import TrainConfig, sample, train
from lora_lab.models import DATA_DIR, DIGIT_NAMES, denoiser
from lora_lab.notebook.effect import StrictReader, fit_classifiers
from lora_lab.notebook.parameters import literal_assignments

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "07_diffusion_lora.ipynb"
UNETS = ("sdxl", "sd15")  # trained for UNET_STEPS, with LoCon when CONV (as notebook 07 does)


def recipe() -> dict:
    """Notebook 07's parameters cell, as {NAME: value}."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    cell = next(c for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
    return literal_assignments("".join(cell["source"]))


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


def steps_of(p: dict, model: str) -> int:
    """Notebook 07's rule: UNET_STEPS for the UNet bases, STEPS for the transformers."""
    return p["UNET_STEPS"] if model in UNETS else p["STEPS"]


def run(p: dict, model: str, dataset: Path | None, out: Path) -> dict:
    steps = steps_of(p, model)
    unet = model in UNETS
    config = TrainConfig(model=model, output=str(out), dataset=None if dataset is None else str(dataset),
                         steps=steps, rank=p["RANK"], lr=p["UNET_LR"] if unet else p["LR"],
                         batch_size=p["BATCH_SIZE"], conv=bool(p["CONV"]) and unet,
                         feed_forward=bool(p["FEED_FORWARD"]) and not unet,
                         reg_dataset=str(DATA_DIR / "lora_reg") if p["PRIOR"] else None,
                         prior_loss_weight=p["PRIOR_LOSS_WEIGHT"], caption_dropout=p["CAPTION_DROPOUT"],
                         dora=p["DORA"], warmup_steps=max(1, steps // 10), schedule="cosine", seed=p["SEED"],
                         sample_steps=0, progress=False)
    t0 = time.time()
    result = train(config)
    seconds = time.time() - t0
    denoiser(result.pipe).eval()
    seeds = range(p["SEED"], p["SEED"] + p["EVAL_SEEDS"])
    _, inverted = fit_classifiers()
    reader = StrictReader.fit()
    labels = torch.arange(10).repeat(len(seeds))
    row = {"seconds": seconds}
    for key, suffix in (("styled", ", inverted"), ("plain", "")):
        prompts = [f"a digit {DIGIT_NAMES[d]}{suffix}" for d in range(10)]
        images = torch.cat([sample(result.pipe, prompts, seed=s, steps=p["SAMPLE_STEPS"])
                            for s in seeds]) * 2 - 1
        row[key] = (inverted.rate(images), reader.rate(images, labels))
    return row


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
            ("prior preservation " + ("off" if base["PRIOR"] else "on (data/lora_reg)"),
             {**base, "PRIOR": not base["PRIOR"]}, None),
            ("caption dropout " + ("off" if base["CAPTION_DROPOUT"] else "0.1"),
             {**base, "CAPTION_DROPOUT": 0.0 if base["CAPTION_DROPOUT"] else 0.1}, None),
            ("120 style images, not all 197", base, subset_folder(tmp, 120)),
            ("captions without the digit", base, subset_folder(tmp, None, lambda t: "a digit, inverted\n")),
        ]
        n = steps_of(base, args.model)
        rows.append((f"{n // 2} steps, not {n}",
                     {**base, "STEPS": base["STEPS"] // 2, "UNET_STEPS": base["UNET_STEPS"] // 2},
                     None))
        if args.model in UNETS and base["CONV"]:
            rows.append(("no LoCon (attention projections only)", {**base, "CONV": False}, None))
        if args.model not in UNETS and base["FEED_FORWARD"]:
            rows.append(("no feed-forward layers (attention projections only)",
                         {**base, "FEED_FORWARD": False}, None))
            rows.append((f"attention only, lr {base['UNET_LR']:g} (the earlier recipe's layers and rate)",
                         {**base, "FEED_FORWARD": False, "LR": base["UNET_LR"]}, None))
        print(f"{args.model}, {10 * base['EVAL_SEEDS']} samples per prompt set, strength 1:")
        print("| changed | inverted rate | digit rate (strict) | plain prompt: inverted rate, digit rate "
              "| train s |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for i, (name, p, dataset) in enumerate(rows):
            r = run(p, args.model, dataset, tmp / f"run{i}")
            (inv, acc), (pinv, pacc) = r["styled"], r["plain"]
            print(f"| {name} | {inv:.2f} | {acc:.2f} | {pinv:.2f}, {pacc:.2f} | {r['seconds']:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
