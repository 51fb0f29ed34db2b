"""The style task of notebooks 07, 09 and 11: its prompts, its held-out set, and the training recipe's fields.

    prompts(digits=range(10)) -> ["a digit zero, inverted", ...]
    write_held_out(folder, n=10) -> folder: n inverted digits the LoRA never trains on, each with its caption
    style_recipe(model, output, steps, **changes) -> dict of TrainConfig fields (TrainConfig(**recipe))
    CONTENT_MODELS                      -> the bases notebook 07 claims the content on (the base and the
        LoRA's samples read as the digit asked for); the other pre-trained bases are claimed for the style
    watched(steps, held_out, samples=5, validations=10, sample_steps=20) -> the fields that sample and
        validate during a run (the strip over steps, the validation loss)

The recipe is what the notebooks share and change one field of at a time: rank 8 on the attention and
feed-forward layers (a UNet base: its convs instead), AdamW with a cosine schedule after a 10% warm-up, 10% of
the captions dropped, no samples and no progress bar (a notebook draws its own). It returns plain fields, so
that this package needs no import of the trainer.
"""

from __future__ import annotations

from pathlib import Path

from ..models import DIGIT_NAMES
from .effect import digit_images

HELD_OUT_FIRST = 1400  # digits 1400.. : the base saw them in its own style, the LoRA never sees them
UNET_MODELS = ("sdxl", "sd15")
# The pre-trained bases whose content holds under this recipe at notebook 07's defaults (strict reader: the
# base >= 0.9, with the LoRA >= 0.8, 50 samples each way). Not z-image, chroma, flux2, qwen-image: the LoRA's
# first steps erase what the prompt draws (the right digit in the base's colours is the wrong answer for an
# inverted target: benchmarks/caption_dependence.py), and the digits come back only to about 0.8 over 4-10x
# the steps; no learning rate (1e-4 .. 3e-2), target set, rank, DoRA, LoRA+, prior preservation or timestep
# shift (0.33 .. 30) tried held them in 200 steps (the rates: docs/measurements.md, notebook 07's rows).
CONTENT_MODELS = ("sd3",)


def prompts(digits=range(10)) -> list[str]:
    """The style's captions: 'a digit three, inverted'."""
    return [f"a digit {DIGIT_NAMES[int(d)]}, inverted" for d in digits]


def write_held_out(folder: Path, n: int = 10) -> Path:
    """`n` digits from HELD_OUT_FIRST on, drawn inverted (black on white) as PNGs with their captions."""
    from PIL import Image  # diffusers' dependency

    folder.mkdir(parents=True, exist_ok=True)
    images, labels = digit_images(range(HELD_OUT_FIRST, HELD_OUT_FIRST + n), inverted=True)
    for i, (image, label) in enumerate(zip(images, labels)):
        pixels = ((image + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()
        Image.fromarray(pixels).save(folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text(prompts([label])[0])
    return folder


def style_recipe(model: str, output: Path | str, steps: int, **changes) -> dict:
    """The TrainConfig fields of the style LoRA on `model`, with `changes` over them."""
    unet = model in UNET_MODELS
    fields = dict(model=model, output=str(output), steps=steps, rank=8, feed_forward=not unet, conv=unet,
                  caption_dropout=0.1, warmup_steps=max(1, steps // 10), schedule="cosine",
                  sample_steps=0, progress=False)
    return {**fields, **changes}


def watched(steps: int, held_out: Path, samples: int = 5, validations: int = 10,
            sample_steps: int = 20) -> dict:
    """The fields that sample four prompts `samples` times and validate on `held_out` `validations` times."""
    return dict(sample_steps=sample_steps, sample_every=max(1, steps // samples),
                sample_prompts=prompts((0, 3, 5, 8)), validation_dataset=str(held_out),
                validate_every=max(1, steps // validations))


def freeze_long_lived() -> None:
    """Move every object alive now (the libraries imported, the readers fitted) out of the garbage
    collector's sight. Each training run's start collects garbage, and walking ~580,000 long-lived objects
    takes about a second a run here; the runs' own objects are still collected."""
    import gc

    gc.freeze()
