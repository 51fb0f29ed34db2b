"""The range of every number a run takes, declared once: `BOUNDS[field]` for each int or float field of
`TrainConfig`, `MAX_REPEATS` for a folder's repeats. `TrainConfig.validate` checks them first, so a value no
run can use (a batch of 1e30, an lr beyond float32's range, 1e6 caption variants) is a one-line error naming
the field before anything is read or written, not an overflow, a hang or a 16 GB allocation later. A numeric
field added to `TrainConfig` without a row here fails `tests/diffusion/test_bounds.py`.

Each upper bound is what a run can use, and its error says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

MAX_STEPS = 10**9  # 30 years at one step a second; step numbers stay far inside int64 with any batch
MAX_REPEATS = 10**5  # a folder's repeats (kohya's `N_name/`, a [[datasets]] table's `repeats`)
MAX_EPOCH_FLOOR = 10**5  # an epoch (images x repeats) may always be this long, however short the run
MAX_SAMPLE_STEPS = 1000  # every base's scheduler has 1000 training timesteps (10**25: a numpy traceback)


@dataclass(frozen=True)
class Bound:
    """low <= value <= high (`low_open`/`high_open`: strict), an integer where `whole`; `why`: the reason of
    the upper bound, said in the error."""

    low: float
    high: float
    whole: bool = False
    why: str = ""
    low_open: bool = False
    high_open: bool = False

    def rule(self) -> str:
        kind = "an integer" if self.whole else "a number"
        lo, hi = ("(" if self.low_open else "["), (")" if self.high_open else "]")
        text = f"must be {kind} in {lo}{_num(self.low)}, {_num(self.high)}{hi}"
        return f"{text} ({self.why})" if self.why else text

    def holds(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (self.whole and
                                                                              not isinstance(value, int)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below


def _num(x: float) -> str:
    if x == 2 / (math.pi - 2):
        return "2/(pi-2)"
    sign = "-" if x < 0 else ""
    if isinstance(x, int) and abs(x) > 65536 and abs(x) & (abs(x) - 1) == 0:
        return f"{sign}2**{abs(x).bit_length() - 1}"
    if isinstance(x, int) and abs(x) >= 10**4 and 10 ** len(str(abs(x)).rstrip("0")) == 10:
        return f"{sign}10**{len(str(abs(x))) - 1}"
    return f"{x:g}" if isinstance(x, float) else str(x)


STEPS = f"{_num(MAX_STEPS)} steps is over 30 years at a step a second"
LR = ("Adam moves each weight about lr per step: beyond 1000 one step throws the adapter's weights (order 1) "
      "far past any use; float32 overflows at 3.4e38")
PROBABILITY = Bound(0, 1, high_open=True)

BOUNDS: dict[str, Bound] = {
    # the data
    "resolution": Bound(8, 16384, True, "no base was trained beyond 16384 px a side"),
    "prior_loss_weight": Bound(0, 10**6, False, "beyond a million times the data's loss, the data's part is "
                               "below float32's precision"),
    "caption_dropout": PROBABILITY,
    "validation_split": Bound(0, 1, low_open=True, high_open=True),
    "keep_tokens": Bound(0, 512, True, "no text encoder reads more than 512 tokens, one a tag at least"),
    "tag_dropout": PROBABILITY,
    "caption_variants": Bound(1, 1024, True, "each variant of every caption is encoded and kept while "
                              "training (SDXL: 0.6 MB each)"),
    # the adapter
    "rank": Bound(1, 65536, True, "no base has a wider layer"),
    "alpha": Bound(0, 10**6, False, "the update's scale alpha/rank beyond a million overflows half "
                   "precision", low_open=True),
    "lokr_factor": Bound(-1, 65536, True, "-1: the most square split; no base has a wider layer"),
    # the optimization
    "steps": Bound(1, MAX_STEPS, True, STEPS),
    "batch_size": Bound(1, 4096, True, "a micro-batch's activations grow with it: no device holds 4096 "
                        "examples of any base at once"),
    "grad_accum": Bound(1, 4096, True, "a step's examples are drawn at once: 4096 micro-batches a step is "
                        "more than any run uses"),
    "lr": Bound(0, 1000, False, LR, low_open=True),
    "text_encoder_lr": Bound(0, 1000, False, LR, low_open=True),
    "loraplus_ratio": Bound(0, 10**4, False, "the paper's is 16; with lr <= 1000 the up matrices' lr stays "
                            "inside float32", low_open=True),
    "warmup_steps": Bound(0, MAX_STEPS, True, STEPS),
    "weight_decay": Bound(0, 1000, False, "AdamW removes lr x weight_decay of each weight a step"),
    "max_grad_norm": Bound(0, 1e30, False, "0 turns clipping off; beyond 1e30 the norm would overflow "
                           "float32 before it clips"),
    "noise_offset": Bound(0, 1, False, "the noise's own standard deviation is 1: a larger offset drowns it"),
    "min_snr_gamma": Bound(0, 10**4, False, "above the schedulers' largest SNR (about 1200) it weights "
                           "nothing", low_open=True),
    "logit_mean": Bound(-10, 10, False, "sigmoid(10) is within 5e-5 of 1: every sigma would be 0 or 1"),
    "logit_std": Bound(0, 10, False, "beyond 10 every sigma is drawn near 0 or 1", low_open=True),
    "mode_scale": Bound(-1, 2 / (math.pi - 2), False, "else the mode sampling leaves (0, 1)"),
    "timestep_shift": Bound(0, 10**4, False, "beyond 10**4 every shifted sigma is 1 to float32's precision",
                            low_open=True),
    "train_guidance": Bound(0, 100, False, "Flux's guidance embedding was distilled at values up to about "
                            "10"),
    "ema_decay": Bound(0, 1, low_open=True, high_open=True),
    "huber_c": Bound(0, 1, low_open=True),  # sd-scripts' threshold share: the schedules end at c
    "huber_scale": Bound(0, 10**6, False, "the threshold's scale: beyond a million the loss is MSE / c to "
                         "float32's precision", low_open=True),
    # memory and bookkeeping
    "blocks_to_swap": Bound(0, 1024, True, "no base has more blocks"),
    "seed": Bound(-(2**63), 2**64, True, "what torch.manual_seed takes", high_open=True),
    "save_every": Bound(0, MAX_STEPS, True, STEPS),
    "keep_checkpoints": Bound(1, MAX_STEPS, True, STEPS),
    "sample_steps": Bound(0, MAX_SAMPLE_STEPS, True, "every base's scheduler has 1000 training timesteps: "
                          "more steps repeat them"),
    "sample_every": Bound(0, MAX_STEPS, True, STEPS),
    "validate_every": Bound(0, MAX_STEPS, True, STEPS),
}


def numeric_fields(config_class) -> list[str]:
    """The fields of `config_class` (TrainConfig) whose type is int or float (optional or not; not bool)."""
    return [f.name for f in fields(config_class)
            if {"int", "float"} & set(str(f.type).replace(" ", "").split("|"))]


def check_bounds(config, bad) -> None:
    """`validate`'s first part: every BOUNDS field in its range (None where its default is None)."""
    defaults = {f.name: f.default for f in fields(config)}
    for name, bound in BOUNDS.items():
        value = getattr(config, name)
        if value is None and defaults[name] is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            bad(name, "must be a finite number")
        if not bound.holds(value):
            bad(name, bound.rule())


def epoch_problem(counts: dict[str, tuple[int, int]], config) -> str | None:
    """What is wrong with an epoch of `counts` ({folder: (images, repeats)}), or None: it may be as long as
    the examples the run draws in all (steps x batch_size x grad_accum), at least MAX_EPOCH_FLOOR; a longer
    one is never finished, and each repeat holds a copy of its text embeddings."""
    length = sum(n * r for n, r in counts.values())
    drawn = config.steps * config.batch_size * config.grad_accum
    cap = max(MAX_EPOCH_FLOOR, drawn)
    if length <= cap:
        return None
    folder, (n, r) = max(counts.items(), key=lambda kv: kv[1][0] * kv[1][1])
    return (f"an epoch of {length} examples (images x repeats; {folder}: {n} x {r}) is longer than the run "
            f"can use: at most max({MAX_EPOCH_FLOOR}, steps x batch_size x grad_accum = {drawn}); lower the "
            "repeats (their ratio is what weights the folders)")
