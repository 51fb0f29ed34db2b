"""A run's settings in a file: `lora-lab train --config run.toml` (or the config.json a run wrote).

    config_from_file(path, overrides={}) -> TrainConfig: the file's keys (TrainConfig's field names, with
        underscores or the flags' dashes; `[[datasets]]` tables for several folders), then `overrides` (the
        flags given on the command line) on top, checked once
    read_run_file(path) -> {field: value}: the file parsed (stdlib tomllib; JSON for a .json file) and each
        key's type checked

Every problem is one TrainConfigError line naming the file and the key: a file that cannot be read or parsed,
an unknown key, one setting spelled twice (`sample-steps` and `sample_steps`), a value of the wrong type, a
value out of range (`TrainConfig.validate`'s message, after the file's name). Nothing is written before the
config is whole, so a bad file loses nothing.
"""

from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser as the package tomli
    import tomli as tomllib

from .config import TrainConfig, TrainConfigError

TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
              list: "a list", dict: "a table"}


def _accepts(kind, value) -> bool:
    """Whether `value` (parsed from TOML or JSON) has the field type `kind` (int | None, list[str], ...)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return any(_accepts(k, value) for k in typing.get_args(kind))
    origin = typing.get_origin(kind) or kind
    if kind is type(None):
        return value is None
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(kind) or (Any,)
        return isinstance(value, list) and (item is Any or all(_accepts(item, v) for v in value))
    return isinstance(value, origin)


def _type_name(kind) -> str:
    """'an integer', 'a number or a string', ... for a field type (None left out: a file cannot say None)."""
    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    kinds = [k for k in (typing.get_args(kind) if union else (kind,)) if k is not type(None)]
    return " or ".join(TYPE_NAMES.get(typing.get_origin(k) or k, str(k)) for k in kinds)


def _once(path: Path, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; TrainConfigError for a key given twice (json keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise TrainConfigError(f"{path}: {key!r} is given twice: give it once")
        out[key] = value
    return out


def read_run_file(path: str | os.PathLike) -> dict[str, Any]:
    """The settings in a TOML (or JSON) run file, each key a TrainConfig field of the right type."""
    path = Path(path)
    try:
        if not path.is_file():
            raise TrainConfigError(f"{path}: no such config file" if not path.exists()
                                   else f"{path}: the config is not a regular file")
        text = path.read_bytes().decode("utf-8")
        data = (json.loads(text, object_pairs_hook=lambda pairs: _once(path, pairs))
                if path.suffix.lower() == ".json" else tomllib.loads(text))  # TOML refuses a key twice
    except (OSError, UnicodeDecodeError) as e:
        raise TrainConfigError(f"{path}: unreadable config file ({e})") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise TrainConfigError(f"{path}: not valid {'JSON' if path.suffix.lower() == '.json' else 'TOML'} "
                               f"({e})") from None
    if not isinstance(data, dict):
        raise TrainConfigError(f"{path}: the config must be a table of settings")
    hints = typing.get_type_hints(TrainConfig)
    known = {f.name for f in fields(TrainConfig)}
    out, spelled = {}, {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in spelled:  # `sample-steps` and `sample_steps`: the later would win, silently
            raise TrainConfigError(f"{path}: {spelled[name]!r} and {key!r} are the same setting {name}: "
                                   "give it once")
        spelled[name] = key
        if name not in known:
            raise TrainConfigError(f"{path}: unknown key {key!r} (the keys are lora-lab train's flags, e.g. "
                                   "sample_every or sample-every)")
        if not _accepts(hints[name], value):
            raise TrainConfigError(f"{path}: {key} = {value!r} must be {_type_name(hints[name])}")
        out[name] = value
    return out


def config_from_file(path: str | os.PathLike, overrides: dict[str, Any] | None = None,
                     defaults: dict[str, Any] | None = None) -> TrainConfig:
    """The TrainConfig of a run file over `defaults` (else TrainConfig's), with `overrides` (the command
    line's flags) on top; one TrainConfigError line naming the file and the key for anything the file gets
    wrong."""
    settings = {**(defaults or {}), **read_run_file(path), **(overrides or {})}
    try:
        return TrainConfig(**settings)
    except TrainConfigError as e:
        if any(str(e).startswith(f"TrainConfig.{name}=") for name in overrides or {}):
            raise  # a flag's value: the command line's mistake, not the file's
        raise TrainConfigError(f"{path}: {e}") from None
