"""The notebooks' exercises, checked: the learner writes a prediction, `check_exercise` says whether it held.

    check_exercise("03_lora_dora", 1, 4)   # prints the verdict and what a run shows; returns True or False

Each exercise's answer was measured by running the notebook as the exercise says (the parameters it names,
the rest at their defaults) and is stored here with the tolerance a prediction may miss it by. `ANSWERS`
holds one table per notebook; an exercise without an entry has no checkable single answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import LoraLabError


class ExerciseError(LoraLabError, ValueError):
    """An exercise that does not exist, or a prediction of the wrong kind."""


@dataclass(frozen=True)
class Answer:
    """One exercise: what to predict, how a prediction is judged, and what a run shows."""

    question: str  # the quantity to predict, one line
    kind: type  # the type a prediction must have: float (ints accepted), int, str or bool
    held: Callable[[Any], bool]  # whether a prediction matches what a run shows
    answer: str  # what a run shows, and why


def near(value: float, rel: float = 0.0, abs_: float = 0.0) -> Callable[[Any], bool]:
    """A prediction within `rel` (relative) or `abs_` (absolute) of `value`."""
    return lambda p: math.isclose(float(p), value, rel_tol=rel, abs_tol=abs_)


def between(low: float, high: float) -> Callable[[Any], bool]:
    """A prediction in [low, high]."""
    return lambda p: low <= float(p) <= high


def one_of(*choices: Any) -> Callable[[Any], bool]:
    """A prediction equal to one of `choices` (strings compared without case or surrounding spaces)."""
    def norm(v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v
    return lambda p: norm(p) in {norm(c) for c in choices}


ANSWERS: dict[str, dict[int, Answer]] = {
    "01_autograd": {
        1: Answer("dy/dx of x^2 at X = -1.0", float, near(-2.0, abs_=1e-9),
                  "-2.0: autograd applies 2x exactly, and the tangent's slope is the same number."),
        2: Answer("x.grad after (x**2).backward() twice, at x = 2", float, near(8.0, abs_=1e-9),
                  "8.0: each backward adds its 4 into .grad; zero_grad() is what resets it."),
        3: Answer("how far float32's central difference lands from 2x at FD_STEP = 1e-6, X = 2", float,
                  between(0.019, 1.9),
                  "0.19 (it gives 3.8147): f(x+h) - f(x-h) keeps only the last few of float32's 7 digits; "
                  "float64 keeps 16, so its rounding error is about 1e-10."),
        4: Answer("dy/dw for y = sin(w x + b) at the defaults (W = 3, X = 2, B = 1)", float,
                  near(math.cos(7.0) * 2.0, rel=1e-3),
                  f"cos(u) x = cos(7) * 2 = {math.cos(7.0) * 2.0:.4f}; "
                  "the graph's PowBackward0 becomes SinBackward0."),
    },
    "02_frozen_and_trainable": {
        1: Answer("the share of values that train with the first layer frozen, at HIDDEN = 16 (a fraction)",
                  float,
                  near(170 / 12730, rel=0.1),
                  "0.0134: the head's 16 x 10 + 10 = 170 values, of 784 x 16 + 16 + 170 = 12,730."),
        2: Answer("backward FLOPs with both layers trainable at SIZE = 8, as a fraction of SIZE = 28's",
                  float,
                  near(10752 / 102912, rel=0.15),
                  "0.104: the first layer's weight gradient (2 x batch x inputs x HIDDEN) is most of "
                  "backward, and it shrinks with the 64 inputs of 784; the frozen row's count (the head "
                  "only) stays."),
        3: Answer("the test accuracy of a frozen random first layer with a trained head, at HIDDEN = 1024",
                  float,
                  between(0.92, 0.97),
                  "about 0.95 (0.93-0.96 over seeds 0-2; 0.89 at HIDDEN = 128): more random features, more "
                  "for the head to combine; the gap to the trained network shrinks to about 3 points."),
    },
    "03_lora_dora": {
        1: Answer("the smallest rank within 2 points of the best (SWEEP_SEEDS = [0, 1, 2], "
                  "RANKS = [1, 2, 4, 16, 32])",
                  int, one_of(8),
                  "8: mean accuracy 0.70, 0.88, 0.94, 0.96, 0.94, 0.97 at ranks 1, 2, 4, 8, 16, 32; past "
                  "rank 8 the seeds differ by more than the ranks do, while the trainable share keeps "
                  "doubling (29% -> 118%)."),
        4: Answer("LoRA's test accuracy on 5-9 at strength t = 0.5 (a fraction)",
                  float, near(0.69, abs_=0.08),
                  "0.69 (and 0.00 on 0-4): half the adapter is not half the task; it already takes all of "
                  "the old task away (the head's 5-9 logits overtake 0-4's early) and gives two thirds of "
                  "the new."),
    },
    "04_lora_files": {
        2: Answer("the factor the style LoRA's effect changes by once its alpha tensors are deleted "
                  "(RANK 4, ALPHA 2)",
                  float, near(2.0, rel=0.01),
                  "2.0: without an alpha every module is read at scale 1 (kohya's rule, whatever the rank), "
                  "instead of alpha / rank = 0.5: the change B A counts twice as much."),
        3: Answer("the relative change ||y - y_base|| / ||y_base|| at LoRA 2's strength 2 (LoRA 1 at 0.8)",
                  float,
                  near(0.73, rel=0.15),
                  "0.73 (and 0.68 at -1), not 2 x 0.5 = 1.0: the UNet is not linear in a LoRA's strength "
                  "(the change passes through norms and activations), and LoRA 1's change adds to it."),
        4: Answer("the mean rank over the layers of the sd3 style LoRA resized with ENERGIES = [0.5]",
                  float, near(1.15, abs_=0.25),
                  "1.15 (45 ranks over 39 layers, 7% of the LoRA's parameters): one direction holds over "
                  "half of almost every layer's change (rank 1 keeps 72% of the whole LoRA), and the style "
                  "survives it, as it survives rank 1."),
    },
    "05_memory": {
        1: Answer("the share of the activation bytes checkpointing keeps at N_BLOCKS = 24 (a fraction)",
                  float, near(0.0713, rel=0.15),
                  "0.071, as at 12 blocks: the bytes kept (one input per block) and the unchecked bytes (a "
                  "block's activations per block) both grow with the blocks; only the head's share shrinks."),
        3: Answer("the 8-bit state's bytes per parameter for a 64 x 64 weight (STATE_WIDTH = 64)", float,
                  near(2.03125, rel=0.02),
                  "2.03 = 2 codes + one fp32 absmax per 256 values, as for a large weight: 4096 values is "
                  "just enough for 8-bit moments; at 63 x 63 (3969 values) the moments stay fp32, 8 bytes."),
    },
    "06_kernels": {
        1: Answer("how many programs the hand launch runs at TOKENS = 64, DEMO_BLOCK_M = 16", int, one_of(4),
                  "4 = ceil(64 / 16), and no row masked off (64 is a multiple of 16); at TOKENS = 1, one "
                  "program with 15 rows masked off."),
        3: Answer("the first wrong row of xa when the grid is one program short "
                  "(TOKENS = 41, DEMO_BLOCK_M = 16)",
                  int, one_of(32),
                  "32: programs 0 and 1 write rows 0-31; rows 32-40 belonged to the missing program 2 and "
                  "hold whatever torch.empty left there."),
    },
    # 07-11: their tables are added on the 07-11 branch
    "07_diffusion_lora": {
        1: Answer("the share of the empty prompt's samples drawn inverted with the LoRA, CAPTION_DROPOUT = 0",
                  float, near(1.0, abs_=0.15),
                  "1.0, as with dropout: the LoRA changes the denoiser for every input, so the empty prompt "
                  "draws the style though it never trained on it. The hypothesis' first half does not hold."),
        2: Answer("the digit rate with the LoRA at CAPTION_DROPOUT = 0 (the default run's: 0.94)", float,
                  near(0.76, abs_=0.1),
                  "0.76, below the default's 0.94 and under the 0.8 target: dropout does help the content, "
                  "but (exercise 1) not because the empty prompt kept the base's style: that explanation "
                  "fails."),
    },
    "08_memory_plan": {
        1: Answer("the phase that sets SDXL's peak at 1024 px with CHECKPOINTING = False", str,
                  one_of("train step", "the train step", "training step"),
                  "the train step, 13.4 GiB (5.7 with checkpointing): the saved activations grow from 0.54 "
                  "to 8.4 GiB, every block's kept for backward. It still fits 24 GiB."),
        2: Answer("Flux's frozen weights in GiB with BASE_QUANTIZATION = 'nf4' (bf16: 22.2 GiB)", float,
                  near(5.72, rel=0.15),
                  "5.7 GiB: half a byte a weight plus the blocks' scales, the layers NF4 does not store "
                  "(norms, embeddings) kept in bf16. The training step then takes 10.3 GiB and the run's "
                  "peak is the cache phase, 10.5 GiB: it fits 16 GiB (SimpleTuner quotes about 9 GB for an "
                  "NF4 base)."),
    },
    "09_quantized_base": {
        1: Answer("int8's mean relative loss gap to the fp32 run, over the whole run (NF4's: 0.0116)", float,
                  between(0.0012, 0.0047),
                  "0.0023 (within a factor 2 counts), a fifth of NF4's 0.0116: int8's output error in "
                  "section 1 (0.008) is a tenth of NF4's (0.09), and the loss feels it less than in "
                  "proportion."),
        3: Answer("the mean relative loss gap after the warm-up, TRAIN_STEPS = 400", float,
                  between(0.0058, 0.0234),
                  "0.0117 (within a factor 2 counts): the same as after the warm-up of the 200-step run "
                  "(0.0117) and in the warm-up (0.0114). The runs stay together: the gap is each step's "
                  "rounding of the base, and it does not grow as the adapters move."),
    },
    "10_training_machinery": {
        1: Answer("how many fp16 steps are skipped at INIT_SCALE = 65536.0", int, one_of(0),
                  "0: at 2**16 no scaled gradient overflows here, and fp16's loss stays within 1e-4 of "
                  "fp32's (mean |difference| 5.7e-5): without skipped steps nothing delays it."),
        2: Answer("is accumulation still equal to the big batch with MICRO_BATCHES = [1, 63]", bool,
                  one_of(True),
                  "True: each micro-batch's loss weighted by n_i / N gives the big batch's gradient whatever "
                  "the sizes; the mean of the means weighs the one example 63 times too much."),
    },
    "11_knobs": {},
}


def check_exercise(notebook: str, n: int, value: Any) -> bool:
    """Print whether the prediction `value` for exercise `n` of `notebook` held, and what a run shows."""
    table = ANSWERS.get(notebook)
    if table is None:
        raise ExerciseError(f"check_exercise: no notebook {notebook!r}; known: {', '.join(ANSWERS)}")
    if n not in table:
        raise ExerciseError(f"check_exercise: {notebook} has no checkable exercise {n}; "
                            f"checkable: {sorted(table) or 'none'}")
    ex = table[n]
    if value is None:
        print(f"Exercise {n}: predict {ex.question} (your prediction in place of None).")
        return False
    if not _fits(value, ex.kind):
        raise ExerciseError(f"check_exercise: {notebook} exercise {n} takes a {ex.kind.__name__} "
                            f"({ex.question}), got {value!r}")
    held = bool(ex.held(value))
    print(f"Exercise {n}: your prediction {value!r} {'held' if held else 'did not hold'}. {ex.answer}")
    return held


def _fits(value: Any, kind: type) -> bool:
    if isinstance(value, bool) or kind is bool:
        return isinstance(value, bool) and kind is bool
    if kind is float:
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, kind)
