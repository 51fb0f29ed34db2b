"""The plan cache on disk: a plan made once is read back in a later process, not planned again.

    plan_key(config, options) -> the plan's key: a hash of everything a plan depends on
    load_plan(key)           -> the cached plan's fields (a dict), or None (none, unreadable, another key)
    store_plan(key, fields)  -> writes them (atomically), where `cache_dir()` says
    cache_dir()              -> $LORA_LAB_PLAN_CACHE, else $XDG_CACHE_HOME/lora_lab/plans, else
                                ~/.cache/lora_lab/plans; None where LORA_LAB_PLAN_CACHE is "off"

The key covers the plan's options (what of the TrainConfig its memory depends on, `diffusion/footprint.py`,
and the planning options: `planner.plan_options`), lora_lab's version and a hash of its source files (an
edited checkout plans again), the versions of torch, diffusers and transformers, and every file the plan
reads (`read_paths`: a base folder or file and its parts, the data folders): config files by contents,
every other file by name, size and time. A changed input gives
another key, so a cached plan is never one of other inputs; the cache is safe to delete at any time.

Files are JSON, one per key (`<key>.json`), read with `fileio.parse_json`: nothing read runs code. Each holds
the sha256 of its key and plan (`checksum`): a plan edited after it was stored, even consistently (every
figure divided by 1000), no longer matches it. A file that cannot be read, is not the JSON of a plan, holds
another key or fails its checksum is ignored (an edited one with a warning): the plan is made again and the
file rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from importlib import metadata
from pathlib import Path

import torch

from .._version import __version__
from ..diffusion.options import input_paths
from ..errors import LoraLabError
from ..fileio import atomic_write_bytes, cache_root, parse_json

FORMAT = 3  # the layout of a cache file (3: with its checksum); a new layout is another key
MAX_FILE_BYTES = 1 << 20  # a plan's JSON is a few KiB: a larger file is not one of ours
PACKAGE = Path(__file__).resolve().parents[1]


def cache_dir() -> Path | None:
    """Where plans are cached: $LORA_LAB_PLAN_CACHE ("off" | "0" | "": no cache), else
    $XDG_CACHE_HOME/lora_lab/plans, else ~/.cache/lora_lab/plans."""
    env = os.environ.get("LORA_LAB_PLAN_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "no", "false") else Path(env).expanduser()
    return cache_root() / "plans"


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """A hash of every file of the lora_lab package (code and the real models' configs), once per process."""
    h = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _fingerprint(path: Path) -> list:
    """What a plan reads of a file or folder: config files by contents, every other file by name, size and
    time (a folder's files, recursively)."""
    if not path.exists():
        return [str(path), None]
    out = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        name = str(file.relative_to(path)) if path.is_dir() else str(file)
        stat = file.stat()
        if file.suffix == ".json" and stat.st_size <= MAX_FILE_BYTES:
            out.append([name, hashlib.sha256(file.read_bytes()).hexdigest()])
        else:
            out.append([name, stat.st_size, stat.st_mtime_ns])
    return out


def read_paths(config) -> list[Path]:
    """The files and folders a plan of `config` reads: the run's inputs (`diffusion.options.input_paths`:
    its base and the base's part files, its data folders)."""
    return [path for _, path in input_paths(config)]


def plan_key(config, options: dict) -> str:
    """The key of a plan of `config` with `options` (what `planner.plan_options` gives: what of the config
    the plan depends on, and the planning options): a hex sha256."""
    inputs = {"format": FORMAT, "lora_lab": __version__, "source": source_hash(),
              "torch": torch.__version__, "diffusers": _version("diffusers"),
              "transformers": _version("transformers"), "options": options,
              "files": [_fingerprint(p) for p in read_paths(config)]}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def load_plan(key: str) -> dict | None:
    """The fields of the plan cached under `key`, or None: no cache, no file, or a file that is not a plan of
    this key (unreadable, not JSON, another key)."""
    folder = cache_dir()
    if folder is None:
        return None
    path = folder / f"{key}.json"
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        data = parse_json(str(path), path.read_bytes())
    except (OSError, LoraLabError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("plan"), dict):
        return None
    if data.get("checksum") != checksum(key, data["plan"]):
        warnings.warn(f"{path}: the cached plan does not match its checksum (edited after it was stored); "
                      "ignored, planning again", stacklevel=3)
        return None
    return data["plan"]


def checksum(key: str, plan: dict) -> str:
    """The sha256 of a cache entry's key and plan (its JSON, keys sorted)."""
    return hashlib.sha256(json.dumps([key, plan], sort_keys=True, default=str).encode()).hexdigest()


def store_plan(key: str, fields: dict) -> Path | None:
    """Write a plan's fields under `key` (atomically); None where the cache is off or cannot be written (a
    plan is still returned: the cache only saves time)."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        plan = json.loads(json.dumps(fields, default=str))  # as read back: the checksum of what is stored
        entry = {"key": key, "checksum": checksum(key, plan), "plan": plan}
        return atomic_write_bytes(folder / f"{key}.json", json.dumps(entry, indent=1).encode())
    except OSError:
        return None
