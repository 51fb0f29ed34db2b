"""The plan cache on disk: a plan made once is read back in a later process, not planned again.

    plan_key(options)        -> the plan's key: a hash of everything a plan depends on
    load_plan(key)           -> the cached plan's fields (a dict), or None (none, unreadable, another key)
    store_plan(key, fields)  -> writes them (atomically), where `cache_dir()` says
    cache_dir()              -> $LORA_LAB_PLAN_CACHE, else $XDG_CACHE_HOME/lora_lab/plans, else
                                ~/.cache/lora_lab/plans; None where LORA_LAB_PLAN_CACHE is "off"

The key covers the plan's options (checked and with their defaults, `planner.plan_options`), lora_lab's
version and a hash of its source files (an edited checkout plans again), the versions of torch, diffusers
and transformers, and for a base read from a folder (a local diffusers folder, or the tiny base shipped in
data/base/) its config files' contents and every other file's name, size and time. A changed input gives
another key, so a cached plan is never one of other inputs; the cache is safe to delete at any time.

Files are JSON, one per key (`<key>.json`), read with `fileio.parse_json`: nothing read runs code. A file
that cannot be read, is not the JSON of a plan, or holds another key is ignored: the plan is made again and
the file rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

import torch

from .._version import __version__
from ..errors import LoraLabError
from ..fileio import atomic_write_bytes, cache_root, parse_json
from ..models import shipped_base

FORMAT = 1  # the layout of a cache file; a new layout is another key
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


def _folder_fingerprint(folder: Path) -> list:
    """A folder base's config files (contents) and its other files (name, size, time): what a plan reads."""
    out = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = str(path.relative_to(folder))
        stat = path.stat()
        if path.suffix == ".json" and stat.st_size <= MAX_FILE_BYTES:
            out.append([name, hashlib.sha256(path.read_bytes()).hexdigest()])
        else:
            out.append([name, stat.st_size, stat.st_mtime_ns])
    return out


def plan_key(options: dict) -> str:
    """The key of a plan of `options` (as `plan_options` returns them): a hex sha256."""
    size = str(options["size"])
    folder = (shipped_base(options["kind"]) if size == "tiny" else None if size == "real" else Path(size))
    inputs = {"format": FORMAT, "lora_lab": __version__, "source": source_hash(),
              "torch": torch.__version__, "diffusers": _version("diffusers"),
              "transformers": _version("transformers"), "options": options,
              "base files": _folder_fingerprint(folder) if folder is not None else None}
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
    return data["plan"]


def store_plan(key: str, fields: dict) -> Path | None:
    """Write a plan's fields under `key` (atomically); None where the cache is off or cannot be written (a
    plan is still returned: the cache only saves time)."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        return atomic_write_bytes(folder / f"{key}.json",
                                  json.dumps({"key": key, "plan": fields}, indent=1, default=str).encode())
    except OSError:
        return None
