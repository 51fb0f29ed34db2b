"""The checks of TrainConfig's fields for watching a run (samples and validation during training, logging) and
for several data folders (`[[datasets]]` tables, caption shuffling): `check_watch_fields(config, bad)`, called
by `TrainConfig.validate`."""

from __future__ import annotations

from pathlib import Path

DATASET_KEYS = {"path": str, "repeats": int, "caption_extension": str, "is_reg": bool}  # a [[datasets]] table
LOG_WITH = ("tensorboard",)


def check_watch_fields(config, bad) -> None:
    """`validate`'s part for the fields of watching a run and of several data folders: `bad(name, why)`."""
    for name in ("sample_every", "validate_every", "keep_tokens"):
        if not isinstance(getattr(config, name), int) or getattr(config, name) < 0:
            bad(name, "must be an integer >= 0")
    if not isinstance(config.caption_variants, int) or config.caption_variants < 1:
        bad("caption_variants", "must be an integer >= 1")
    if config.sample_every and not config.sample_steps:
        bad("sample_every", "needs denoising steps to sample with (--sample-steps is 0)")
    split = config.validation_split
    if split is not None and not (isinstance(split, (int, float)) and not isinstance(split, bool)
                                  and 0 < split < 1):
        bad("validation_split", "must be a fraction strictly between 0 and 1")
    if config.validation_dataset is not None and not Path(config.validation_dataset).is_dir():
        bad("validation_dataset", "is not a folder")
    if split is not None and config.validation_dataset is not None:
        bad("validation_split", "and validation_dataset both given: hold out a fraction or name a folder")
    if config.log_with is not None and config.log_with not in LOG_WITH:
        bad("log_with", f"must be one of {', '.join(LOG_WITH)} (or None: loss.jsonl only)")
    if not (isinstance(config.tag_dropout, (int, float)) and 0 <= config.tag_dropout < 1):
        bad("tag_dropout", "must be a probability in [0, 1)")
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
    if table.get("repeats", 1) < 1:
        return f"repeats = {table['repeats']} must be >= 1"
    if not table.get("caption_extension", ".txt").startswith("."):
        return f"caption_extension = {table['caption_extension']!r} must start with a dot"
    return None

