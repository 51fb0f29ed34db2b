"""Fitting a card's memory (VRAM): the fastest training configuration whose planned peak fits, and the table
of options.

    fit_vram("24GiB", "sdxl", resolution=1024, batch_size=4) -> FitResult (chosen plan, why, every plan tried)
    fit_vram("24GiB", TrainConfig(...))                      -> the same for a run as given
    options_table(plans, vram)                              -> one line per option: peak, its phase, fits
    fit_config(config, "24GiB")                             -> the TrainConfig `lora-lab train --vram` runs

Options are tried cheapest in time first: no recomputation before recomputation, fp32 AdamW (the faster
step) before 8-bit, and the largest micro-batch that fits, with gradient accumulation for the rest; as the
last resort, the fewest of the denoiser's blocks swapped to host memory that fit (its cost: the bytes it
copies per step, which the reason says).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..diffusion.config import TrainConfig
from ..diffusion.options import KIND_OPTIONS
from . import planner
from .planner import MemoryPlan, PlanError, format_bytes, parse_bytes
from .run import OverLimit

# The order `fit_vram` tries options in, cheapest in time first: no recomputation before recomputation,
# fp32 Adam (fastest step) before 8-bit. In memory the order is the reverse, for the same run otherwise and in
# every phase (`_at_most`): 8-bit AdamW's state (1 byte a moment and a float per block) is smaller than fp32
# AdamW's (4 bytes), and its step's temporaries are not larger; full checkpointing keeps the blocks' inputs
# instead of their activations (other policies are not ordered against none). Both are checked phase by
# phase on every kind (tests/planning/test_fit.py), so fit plans the option of least memory second and,
# where it does not fit, no other.
CHECKPOINTING_ORDER = (False, True)
OPTIMIZER_ORDER = ("adamw", "adamw8bit")


@dataclass
class FitResult:
    """What `fit_vram` chose, and every option it planned on the way (cheapest in time first)."""

    vram: int
    chosen: MemoryPlan
    tried: list[MemoryPlan] = field(default_factory=list)

    @property
    def settings(self) -> dict[str, Any]:
        """The TrainConfig fields to set: gradient_checkpointing, optimizer, batch_size, grad_accum,
        vae_tiling."""
        o = self.chosen.options
        chosen = ("optimizer", "batch_size", "grad_accum", "vae_tiling", "blocks_to_swap")
        return {**{k: o[k] for k in chosen}, "gradient_checkpointing": o["gradient_checkpointing"] or False}

    def reason(self) -> str:
        s = self.settings
        skipped = [p for p in self.tried if not p.fits(self.vram)]
        why = ("; faster options did not fit: " + ", ".join(
            f"{_label(p.options)} {format_bytes(p.peak)} ({p.peak_phase})"
            for p in skipped)) if skipped else ""
        moved = (f"; it copies {format_bytes(self.chosen.moved_per_step)} from host memory to the device "
                 "per micro-batch" if s["blocks_to_swap"] else "")
        return (f"chose {_label(self.chosen.options)}: predicted peak {format_bytes(self.chosen.peak)} of "
                f"{format_bytes(self.vram)}, in {self.chosen.why()} (batch {s['batch_size']} x "
                f"{s['grad_accum']} accumulation){moved}{why}")


def _label(options: dict) -> str:
    ck = planner.checkpointing_words(options["gradient_checkpointing"]) or "no checkpointing"
    q = f", {options['base_quantization']} base" if options.get("base_quantization") else ""
    tiles = ", vae tiling" if options.get("vae_tiling") else ""
    swap = f", {options['blocks_to_swap']} blocks swapped" if options.get("blocks_to_swap") else ""
    return f"{ck}, {options['optimizer']}, batch {options['batch_size']}{q}{tiles}{swap}"


def options_table(plans: list[MemoryPlan], vram: int | str | None = None) -> str:
    """One line per plan: the option, its predicted peak, the phase that sets it, and whether it fits."""
    vram = parse_bytes(vram) if vram is not None else None
    width = max([len("option"), *(len(_label(p.options)) for p in plans)])
    head = f"{'option':<{width}}  {'predicted peak':>14}  {'set by':<12}" + (f"  fits {format_bytes(vram)}"
                                                                             if vram else "")
    rows = [head]
    for p in plans:
        row = f"{_label(p.options):<{width}}  {format_bytes(p.peak):>14}  {p.peak_phase:<12}"
        if vram:
            row += "  yes" if p.fits(vram) else "  no"
        rows.append(row)
    return "\n".join(rows)


def fit_vram(vram: int | str, run: TrainConfig | str = "sdxl", *, size: str = "real",
             checkpointing: bool | str | None = None, plans: list[MemoryPlan] | tuple = (),
             attention: str = "auto", checkpoint_options: dict | None = None, **fields) -> FitResult:
    """The fastest variant of a run (a `TrainConfig`, or `planner.plan_config(run, size=size, **fields)`)
    whose every phase fits `vram` (e.g. "24GiB"), a card's memory; its batch_size x grad_accum is the
    effective batch, kept.

    Variants are tried in order of their time cost: no checkpointing before checkpointing (it adds a
    forward), fp32 AdamW before 8-bit AdamW (its step is the cheaper one) when both fit (a run with another
    optimizer, Prodigy or Adafactor, keeps it); within those, the largest micro-batch (a power of two
    dividing the effective batch) that fits, with gradient accumulation making up the rest. Where only the
    sample phase does not fit, the same variant with the samples decoded in tiles (vae_tiling) is planned.
    Options that cannot fit are not planned: the one of least memory is planned second
    (`_fastest_fitting`), and a plan stops after its load phase where that phase or the cache phase (the
    same in every option) does not fit. Raises PlanError naming the smallest peak found and what sets it (or
    the phase before the options that does not fit) when nothing fits. `plans` are plans already made (e.g.
    the table `lora-lab plan` prints): one whose options are those of a variant tried is used as it is, not
    planned again. checkpointing: the policy of the variants with checkpointing (default: the run's own,
    else "full"). attention, checkpoint_options: `plan_memory`'s.
    """
    vram = parse_bytes(vram)
    for key in ("gradient_checkpointing", "grad_accum"):
        if key in fields:
            raise PlanError(f"fit_vram chooses {key} itself; do not pass it")
    config = planner.run_config(run, size, fields)
    checkpointing = checkpointing if checkpointing is not None else config.checkpointing_policy() or True
    optimizers = OPTIMIZER_ORDER if config.optimizer in OPTIMIZER_ORDER else (config.optimizer,)
    batch_size = config.batch_size * config.grad_accum
    if batch_size > 4096:
        raise PlanError(f"fit_vram: the effective batch must be at most 4096, got {batch_size}")
    micro = [b for b in (2**i for i in range(batch_size.bit_length()))
             if batch_size % b == 0][::-1]  # largest first
    tried: list[MemoryPlan] = []

    def planned(**changes) -> MemoryPlan:
        variant = replace(config, **changes)
        options = planner.plan_options(variant, attention, checkpoint_options)
        p = next((q for q in plans if q.options == options), None) or planner.plan_memory(
            variant, attention=attention, checkpoint_options=checkpoint_options, limit=vram)
        tried.append(p)
        return p

    def plan(ckpt, opt, b) -> MemoryPlan:
        kw = {"batch_size": b, "grad_accum": batch_size // b,
              "gradient_checkpointing": ckpt and checkpointing, "optimizer": opt}
        p = planned(**kw)
        others = [v for phase, v in p.phases.items() if phase != "sample"]
        if not p.fits(vram) and not config.vae_tiling and max(others) <= vram:
            p = planned(**kw, vae_tiling=True)  # only sampling did not fit: decode in tiles
        return p

    try:
        chosen = _fastest_fitting(vram, [(ck, opt) for ck in CHECKPOINTING_ORDER for opt in optimizers],
                                  micro, plan, checkpointing)
        chosen = chosen or _fit_swapping(vram, config, micro[-1], batch_size, checkpointing, optimizers[-1],
                                         planned)
    except OverLimit as e:  # the phases before the adapter: every option has them
        phase = max(e.phases, key=e.phases.get)
        what = "the text encoders and VAE encoding the data" if phase == "cache" else "the denoiser loaded"
        raise PlanError(
            f"nothing fits {format_bytes(vram)}: the {phase} phase alone peaks at "
            f"{format_bytes(e.phases[phase])} ({what}), before anything fit chooses (checkpointing, "
            "optimizer, micro-batch, blocks swapped) applies; lower the resolution, "
            f"{_quantize(config, phase)}or use a larger GPU") from None
    if chosen is not None:
        return FitResult(vram, chosen, tried)
    best = min(tried, key=lambda p: p.peak)
    raise PlanError(
        f"nothing fits {format_bytes(vram)}: the smallest predicted peak is {format_bytes(best.peak)} "
        f"({_label(best.options)}), in {best.why()}; lower the resolution or the rank, "
        f"{_quantize(config, best.peak_phase)}or use a larger GPU"
        + ("" if checkpointing in (True, "full")
           else f", or a checkpointing policy that keeps less than {checkpointing} "
           "(full, every_k, budget:F)"))


def _at_most(a: tuple, b: tuple, policy: bool | str = True) -> bool:
    """Whether variant a = (checkpointing, optimizer) peaks at most where b does in every phase of the same
    run (the orders above `CHECKPOINTING_ORDER`); checkpointing's order is the full policy's (`policy`)."""
    checkpointing = a[0] == b[0] or (policy in (True, "full") and a[0] and not b[0])
    return checkpointing and (a[1] == b[1] or (a[1], b[1]) == ("adamw8bit", "adamw"))


def _fastest_fitting(vram: int, variants: list[tuple], micro: list[int], plan, policy) -> MemoryPlan | None:
    """The first of `variants` (time order) whose smallest micro-batch fits, at its largest micro-batch that
    fits; None where none fits. The fastest is planned first, then the last, the one of least memory (with
    full checkpointing at most every other, `_at_most`), then the others in time order but for one that needs
    at least the memory of one that did not fit: where the least does not fit, none of them is planned."""
    smallest = micro[-1]
    first = plan(*variants[0], smallest)
    chosen = (variants[0], first) if first.fits(vram) else None
    if chosen is None and len(variants) > 1:
        least = plan(*variants[-1], smallest)
        failed = [variants[0]] + ([] if least.fits(vram) else [variants[-1]])
        for v in variants[1:-1]:
            if any(_at_most(f, v, policy) for f in failed):
                continue
            p = plan(*v, smallest)
            if p.fits(vram):
                chosen = v, p
                break
            failed.append(v)
        chosen = chosen or ((variants[-1], least) if least.fits(vram) else None)
    if chosen is None:
        return None
    # the largest micro-batch that fits: the peak grows with the batch, so search down from the top
    v, p = chosen
    return next((q for q in (plan(*v, b) for b in micro[:-1]) if q.fits(vram)), p)


def _fit_swapping(vram: int, config: TrainConfig, micro: int, batch_size: int, checkpointing, optimizer: str,
                  planned) -> MemoryPlan | None:
    """The last resort: checkpointing, 8-bit AdamW (or the run's own optimizer), the smallest micro-batch, and
    as few of the denoiser's blocks swapped to host memory as fit (`checkpointing/swap.py`): every block
    swapped first, which gives the bytes of a block; then the count the room left allows, planned again. None
    where even every block swapped does not fit, or the model's blocks cannot be counted (a local folder)."""
    total = _swappable_blocks(config)
    if not total:
        return None
    kw = {"batch_size": micro, "grad_accum": batch_size // micro, "optimizer": optimizer,
          "gradient_checkpointing": checkpointing or True}
    every = planned(**kw, blocks_to_swap=total)
    if not every.fits(vram):
        return None
    per_block = every.moved_per_step // (2 * total)
    return _fewest_swapped(vram, total, per_block, every, kw, planned)


def _fewest_swapped(vram: int, total: int, per_block: int, every: MemoryPlan, kw: dict,
                    planned) -> MemoryPlan:
    """From the plan with every block swapped: the fewest blocks whose plan fits (estimated from the room
    left, checked by planning it; every block where the estimate does not fit)."""
    room = vram - every.peak  # each block not swapped adds its bytes (those in flight are in every's peak)
    n = max(1, total - room // max(per_block, 1))
    if n >= total:
        return every
    p = planned(**kw, blocks_to_swap=int(n))
    return p if p.fits(vram) else every


def _swappable_blocks(config: TrainConfig) -> int:
    """How many blocks the denoiser of a real or tiny model has to swap (0: a local folder, not counted)."""
    import torch

    from ..checkpointing.swap import swappable
    from ..models import model_kind
    from ..models.builders import CONFIGS
    from ..models.real import REAL_CONFIGS

    model, size = planner.plan_size(config)
    kind = model_kind(config.model)
    if size == "real":
        cfg = REAL_CONFIGS[model][kind.component][1]
    elif size == "tiny":
        cfg = CONFIGS[model][kind.component]
    else:
        return 0
    with torch.device("meta"):
        denoiser = kind.denoiser_class()(**cfg)
    return len(swappable(denoiser, kind.checkpoint_blocks()))


def fit_config(config: TrainConfig, vram: int | str) -> tuple[TrainConfig, str, MemoryPlan]:
    """`lora-lab train --vram`: the TrainConfig with gradient_checkpointing, optimizer, batch_size, grad_accum
    (and vae_tiling, blocks_to_swap) chosen by `fit_vram` for its base on its device;
    config.batch_size * config.grad_accum is the effective batch kept. Returns (config, why, its plan)."""
    result = fit_vram(vram, config)
    return replace(config, **result.settings), result.reason(), result.chosen


def _quantize(config: TrainConfig, phase: str) -> str:
    """The advice to quantize what holds `phase`'s memory, where the run can still take it (", "-ended; ""
    where not): the text encoders for the cache phase, the denoiser for the phases after it (an adapter kind
    that takes a quantized base only: options.KIND_OPTIONS)."""
    if phase == "cache":
        quantized, flag = config.text_encoder_quantization, "--text-encoder-quantization nf4"
        what = "the text encoders"
    else:
        quantized, flag, what = config.base_quantization, "--base-quantization nf4", "the base"
        if config.adapter != KIND_OPTIONS["base_quantization"][0]:  # the one adapter kind it takes
            return ""
    return "" if quantized else f"quantize {what} ({flag}), "
