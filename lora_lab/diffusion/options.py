"""Parts of `TrainConfig.validate`: the fields for watching a run (samples and validation during training,
logging) and for several data folders (`[[datasets]]` tables, caption shuffling): `check_watch_fields`; the
knobs of loss weighting, timesteps, EMA and LoRA+: `check_knob_fields`; the adapter kind (LoRA, LoKr, LoHa)
and what goes with it: `check_adapter_fields`; the quantized base's and text encoders' formats:
`check_quantization_fields`."""

from __future__ import annotations

from dataclasses import fields
from importlib.util import find_spec
from pathlib import Path

from ..lora import ADAPTER_KINDS
from ..models import KINDS, model_kind, shipped_base
from ..models.real import REAL_PREFIX
from ..quant import FORMATS
from .bounds import MAX_REPEATS
from .data import caption_extension_problem
from .losses import HUBER_SCHEDULES, LOSSES
from .weighting import LOSS_WEIGHTINGS, TIMESTEP_SAMPLING

DATASET_KEYS = {"path": str, "repeats": int, "caption_extension": str, "is_reg": bool}  # a [[datasets]] table
LOG_WITH = ("tensorboard",)
FLOW_KNOBS = ("timestep_sampling", "logit_mean", "logit_std", "mode_scale", "timestep_shift", "dynamic_shift",
              "loss_weighting")
DDPM_KNOBS = ("min_snr_gamma", "debiased_estimation", "noise_offset")
ADAPTERS = ADAPTER_KINDS  # lora (DoRA: with dora), lokr, loha
# the options that belong to one adapter kind: (that kind, why); set for another kind, they are refused
KIND_OPTIONS = {
    "lokr_factor": ("lokr", "LoKr's split of each dimension"),
    "dora": ("lora", "DoRA's magnitude is LoRA's"),
    "loraplus_ratio": ("lora", "LoRA+ sets the lr of LoRA's up matrices"),
    "text_encoder_lr": ("lora", "the text encoders' adapter is a LoRA; a file holds one adapter kind"),
    "base_quantization": ("lora", "LoKr/LoHa wrap float Linear and Conv2d layers"),
}


def check_watch_fields(config, bad) -> None:
    """`validate`'s part for the fields of watching a run and of several data folders: `bad(name, why)`."""
    if config.sample_every and not config.sample_steps:
        bad("sample_every", "needs denoising steps to sample with (--sample-steps is 0)")
    split = config.validation_split
    if config.validation_dataset is not None and not Path(config.validation_dataset).is_dir():
        bad("validation_dataset", "is not a folder")
    if split is not None and config.validation_dataset is not None:
        bad("validation_split", "and validation_dataset both given: hold out a fraction or name a folder")
    if config.log_with is not None and config.log_with not in LOG_WITH:
        bad("log_with", f"must be one of {', '.join(LOG_WITH)} (or None: loss.jsonl only)")
    if config.log_with is not None and find_spec(config.log_with) is None:  # found now, not after a run
        bad("log_with", f"needs the {config.log_with} package, which is not installed (pip install "
            f"{config.log_with})")
    if config.cache_dir is not None and config.cache_to_disk:
        bad("cache_to_disk", "and cache_dir both given: cache_to_disk is the folder <output>/cache, "
            "cache_dir another: choose one")
    cache = config.cache_dir
    if cache is not None and Path(cache).exists() and not Path(cache).is_dir():
        bad("cache_dir", "is a file, not a folder")
    for name in ("output", "dataset", "reg_dataset", "validation_dataset", "cache_dir"):
        if getattr(config, name) == "":  # Path("") is the current folder: a run into (or of) wherever it runs
            bad(name, "is empty: give a folder")
    check_output_outside_data(config, bad)
    if config.datasets is not None:
        if config.dataset is not None:
            bad("datasets", "and dataset both given: list every folder in datasets")
        if not isinstance(config.datasets, list) or not config.datasets:
            bad("datasets", "must be a non-empty list of tables (path, repeats, caption_extension, is_reg)")
        for i, table in enumerate(config.datasets):
            problem = dataset_table_problem(table)
            if problem:
                bad("datasets", f"entry {i + 1}: {problem}")
        if all(table.get("is_reg", False) for table in config.datasets):
            bad("datasets", "every entry is a regularization folder (is_reg): none to train on")


def input_paths(config) -> list[tuple[str, Path]]:
    """Every file and folder a run of `config` reads, each with the field that names it: its base (a
    diffusers folder or a single file; the tiny one shipped in data/ by default; none for real:NAME), the
    base's part files, the data folders (`[[datasets]]` tables, else the dataset folder, the shipped set by
    default), the regularization and validation folders. The one list: the output check below and the plan
    cache's key (`planning/cache.read_paths`) read it."""
    base = config.base if config.base is not None else shipped_base(config.model)
    paths = [] if base is None or str(base).startswith(REAL_PREFIX) else [("base", Path(base))]
    paths += [(part, Path(p)) for part, p in config.base_parts().items() if p is not None]
    if isinstance(config.datasets, list):
        paths += [("datasets", Path(t["path"])) for t in config.datasets
                  if isinstance(t, dict) and isinstance(t.get("path"), str)]
    else:
        paths.append(("dataset", config.dataset_dir()))
    paths += [(name, Path(getattr(config, name))) for name in ("reg_dataset", "validation_dataset")
              if isinstance(getattr(config, name), (str, Path))]
    return paths


def check_output_outside_data(config, bad) -> None:
    """The output folder is no input folder and inside none, nor the folder an input file is in
    (`input_paths`): the run would write into its inputs (config.json over a base's unet/config.json,
    samples.png and checkpoints/ joining a data folder, its files beside a single-file base's); the disk cache
    folder (`cache_dir`) likewise. The validation folder is no training folder and inside none: its images
    would be trained on; the regularization folder is not the training folder itself."""
    writes = {"output": "the run's files (config.json, samples.png, checkpoints/)",
              "cache_dir": "the disk cache's entries"}
    for field, what in writes.items():
        if not isinstance(getattr(config, field), (str, Path)):
            continue
        written = Path(getattr(config, field)).resolve()
        for name, path in input_paths(config):
            if path.is_dir() and written.is_relative_to(path.resolve()):
                bad(field, f"is inside the {name} folder {path}: {what} would be written into an input; "
                    "choose a folder outside it")
            if path.is_file() and written == path.parent.resolve():
                bad(field, f"is the folder of the {name} file {path}: {what} would be written among its "
                    "inputs; choose another folder")
    val = config.validation_dataset
    trained = [(name, path) for name, path in input_paths(config)
               if name in ("dataset", "datasets", "reg_dataset") and path.is_dir()]
    for name, folder in trained if val is not None else []:
        if Path(val).resolve().is_relative_to(folder.resolve()):
            bad("validation_dataset", f"is inside the {name} folder {folder}: its images are trained on, so "
                "the validation loss would hold none out; name a folder of other images")
    reg = config.reg_dataset
    for name, folder in trained if isinstance(reg, (str, Path)) else []:
        if name != "reg_dataset" and Path(reg).resolve() == folder.resolve():
            bad("reg_dataset", f"is the {name} folder {folder}: prior preservation would train its images "
                "a second time; name a folder of the base's own images (data/lora_reg)")


def dataset_table_problem(table) -> str | None:
    """What is wrong with one [[datasets]] table, or None."""
    if not isinstance(table, dict):
        return "must be a table"
    unknown = sorted(set(table) - set(DATASET_KEYS))
    if unknown:
        return f"unknown key(s) {unknown} (known: {', '.join(DATASET_KEYS)})"
    if "path" not in table:
        return "has no path"
    for key, kind in DATASET_KEYS.items():
        wrong = not isinstance(table.get(key), kind) or (kind is int and isinstance(table[key], bool))
        if key in table and wrong:
            return f"{key} = {table[key]!r} must be a {kind.__name__}"
    if not Path(table["path"]).is_dir():
        return f"path {table['path']!r} is not a folder"
    if not 1 <= table.get("repeats", 1) <= MAX_REPEATS:
        return f"repeats = {table['repeats']} must be in [1, {MAX_REPEATS}] (their ratio weights the folders)"
    problem = caption_extension_problem(table.get("caption_extension", ".txt"))
    if problem:
        return f"caption_extension = {table['caption_extension']!r} {problem}"
    return None


def check_knob_fields(config, bad) -> None:
    """The knobs of loss weighting, timesteps, EMA and LoRA+: each in range, and only for the objective
    it belongs to."""
    flow = model_kind(config.model).objective == "flow"
    if config.optimizer == "prodigy" and not config.lr >= 0.1:
        bad("lr", "with prodigy is a multiplier of its own step size estimate: use 1.0 (0.1 or more)")
    if config.optimizer == "prodigy" and config.loraplus_ratio is not None:
        bad("loraplus_ratio", "prodigy takes one lr for every parameter group: no LoRA+ with it")
    for name, allowed in (("timestep_sampling", TIMESTEP_SAMPLING), ("loss_weighting", LOSS_WEIGHTINGS),
                          ("loss", LOSSES), ("huber_schedule", HUBER_SCHEDULES)):
        if getattr(config, name) not in allowed:
            bad(name, f"must be one of {', '.join(allowed)}")
    defaults = {f.name: f.default for f in fields(config)}
    only = FLOW_KNOBS if not flow else DDPM_KNOBS
    for name in only:
        if getattr(config, name) != defaults[name]:
            their = "/".join(k for k in KINDS if (model_kind(k).objective == "flow") != flow)
            bad(name, f"applies to {their} only, not {config.model}")
    kind = model_kind(config.model)
    if config.text_encoder_lr is not None and not any(e.arch.startswith("clip") for e in kind.text_encoders):
        bad("text_encoder_lr", f"trains LoRAs on CLIP text encoders; {config.model} has none (its "
            "encoder stays frozen, its embeddings cached)")
    if config.train_guidance != 1.0 and not kind.guidance_embedding:
        guided = ", ".join(k for k in KINDS if model_kind(k).guidance_embedding)
        bad("train_guidance", f"applies to the guidance-distilled families only ({guided}: their guidance "
            "embedding)")
    if config.dynamic_shift and config.timestep_shift is not None:
        bad("dynamic_shift", "and timestep_shift are two shifts: choose one")
    if config.min_snr_gamma is not None and config.debiased_estimation:
        bad("debiased_estimation", "and min_snr_gamma are two weightings: choose one")
    if config.alpha_mask and not config.masked_loss:
        bad("alpha_mask", "reads the masks of --masked-loss: give --masked-loss too")
    huber = {f.name: f.default for f in fields(config) if f.name.startswith("huber_")}
    if config.loss not in ("huber", "smooth_l1") and any(getattr(config, n) != v for n, v in huber.items()):
        bad(next(n for n, v in huber.items() if getattr(config, n) != v),
            f"applies to --loss huber or smooth_l1, not {config.loss}")


def check_adapter_fields(config, bad) -> None:
    """The adapter kind, LoKr's factor, and the options that belong to one kind (`KIND_OPTIONS`;
    `bad(name, why)`); whether the factor divides each targeted layer is the base's to tell
    (`adapters.check_config_for_base`)."""
    if config.adapter not in ADAPTERS:
        bad("adapter", f"must be one of {', '.join(ADAPTERS)}")
    factor = config.lokr_factor
    if factor == 0:
        bad("lokr_factor", "must be -1 (the most square split) or an integer >= 1")
    defaults = {f.name: f.default for f in fields(config)}
    for name, (kind, why) in KIND_OPTIONS.items():
        if getattr(config, name) != defaults[name] and config.adapter != kind:
            bad(name, f"applies to --adapter {kind} only, not {config.adapter} ({why})")


def check_quantization_fields(config, bad) -> None:
    """The quantized base's and text encoders' formats (`quant.FORMATS`); the text encoders are quantized
    only where they stay frozen (their embeddings cached): not with a text-encoder LoRA."""
    for name in ("base_quantization", "text_encoder_quantization"):
        if getattr(config, name) is not None and getattr(config, name) not in FORMATS:
            bad(name, f"must be one of {', '.join(FORMATS)} (or None: not quantized)")
    if config.text_encoder_quantization is not None and config.text_encoder_lr is not None:
        bad("text_encoder_quantization", "quantizes frozen text encoders for caching; with text_encoder_lr "
            "they train (a LoRA on their float Linear layers, the captions through them at each step)")
