"""Files, at the bottom: safetensors headers read and checked before any tensor is, and atomic writes.

Nothing here knows what a LoRA is; formats/, merge.py, the trainer and the notebook records write
through `atomic_write_bytes`, and every safetensors file lora_lab reads goes through `read_header`.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .errors import LoraFormatError

# safetensors' dtype names; LoRA weights must be one of WEIGHT_DTYPES (alphas: any real one)
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BASE_DTYPES = (*WEIGHT_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2)  # a base's weights: fp8 files too


def weight_dtype_problem(dtype: torch.dtype, allowed: tuple[torch.dtype, ...] = WEIGHT_DTYPES) -> str | None:
    """Why a tensor of `dtype` cannot be a weight (of a LoRA file: `WEIGHT_DTYPES`; of a base: `BASE_DTYPES`),
    or None: an integer or bool tensor never is (cast, its codes would be trained on as numbers)."""
    if dtype in allowed:
        return None
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    return f"has dtype {dtype}; weights must be one of {names}"
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_MAX_INT_DIGITS = 19  # a JSON integer in a header or in metadata: offsets and sizes fit 63 bits


def parse_json(where: str, raw: bytes | str):
    """JSON with bounds: integers of more than 19 digits stay strings (so the field that holds one fails its
    type check, naming it), nesting deeper than Python's recursion limit and repeated keys are errors."""

    def bounded_int(s: str):
        return int(s) if len(s.lstrip("-")) <= _MAX_INT_DIGITS else s

    def no_repeats(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise ValueError(f"key {k!r} appears twice")
            out[k] = v
        return out

    try:
        return json.loads(raw, parse_int=bounded_int, object_pairs_hook=no_repeats)
    except RecursionError:
        raise LoraFormatError(f"{where}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise LoraFormatError(f"{where}: not valid JSON ({e})") from None


def read_header(path: Path) -> tuple[list[str], dict[str, str]]:
    """A safetensors header, checked: the tensor keys and the metadata; LoraFormatError naming the key."""
    if not path.is_file():
        raise LoraFormatError(f"{path}: {'is a folder, not a file' if path.is_dir() else 'no such file'}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise LoraFormatError(f"{path}: not a safetensors file ({size} bytes: shorter than the 8-byte "
                                  "length a safetensors file starts with)")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8 or n > _MAX_HEADER_BYTES:
            raise LoraFormatError(
                f"{path}: not a safetensors file (header length {n} does not fit the file's {size} bytes)"
            )
        raw = f.read(n)
    header = parse_json(f"{path}: not a safetensors file: garbage header", raw)
    if not isinstance(header, dict):
        raise LoraFormatError(f"{path}: not a safetensors file: the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise LoraFormatError(f"{path}: key '__metadata__' must map names to strings")
    data = size - 8 - n
    spans = []
    for key, v in header.items():
        where = f"{path}: key {key!r}"
        if not isinstance(v, dict) or set(v) != {"dtype", "shape", "data_offsets"}:
            raise LoraFormatError(f"{where}: a tensor entry must have exactly dtype, shape and data_offsets")
        dtype = SAFETENSORS_DTYPES.get(v["dtype"]) if isinstance(v["dtype"], str) else None
        if dtype is None:
            raise LoraFormatError(f"{where}: dtype {v['dtype']!r} is not one of {list(SAFETENSORS_DTYPES)}")
        shape, offsets = v["shape"], v["data_offsets"]
        if not isinstance(shape, list) or len(shape) > 8 or not all(type(d) is int and d >= 0 for d in shape):
            raise LoraFormatError(f"{where}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise LoraFormatError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        if offsets[1] > data:
            raise LoraFormatError(f"{path}: truncated: key {key!r} ends at byte {offsets[1]} "
                                  f"of a {data}-byte data section")
        nbytes = math.prod(shape) * dtype.itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise LoraFormatError(f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, "
                                  f"shape {shape} {v['dtype']} needs {nbytes}")
        spans.append((offsets[0], offsets[1], key))
    end = 0
    for begin, stop, key in sorted(spans):  # the tensors tile the data section: no gap, no overlap
        if begin != end:
            raise LoraFormatError(f"{path}: key {key!r}: data_offsets begin at {begin}, "
                                  f"the previous tensor ends at {end}")
        end = stop
    if end != data:
        raise LoraFormatError(f"{path}: {data - end} bytes after the last tensor's data")
    return list(header), meta


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (memory-mapped: nothing is read until used) and the metadata of a safetensors file whose
    header `read_header` has checked; LoraFormatError for anything else."""
    keys, metadata = read_header(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {key: f.get_tensor(key) for key in keys}
    except MemoryError as e:  # mapping a file larger than the address space left (ulimit -v): ENOMEM
        raise LoraFormatError(f"{path}: cannot map its {path.stat().st_size} bytes into memory ({e}); "
                              "not enough address space") from None
    except (SafetensorError, OSError, RuntimeError, ValueError, TypeError) as e:
        raise LoraFormatError(f"{path}: not a readable safetensors file ({e})") from e
    metadata.pop("format", None)
    return tensors, metadata



def cache_root() -> Path:
    """lora_lab's folder of caches (plans, compiled kernels): $XDG_CACHE_HOME/lora_lab (an absolute path),
    else ~/.cache/lora_lab. Each cache has its own variable to put it elsewhere."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return root / "lora_lab"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Temp files of atomic_write_bytes: ".<name>.lora_lab-<pid>-<random>.tmp" beside the target. One whose
# process is gone was left by a killed write; the next write to that folder removes it.
_TEMP_PREFIX = ".lora_lab-"
_TEMP_NAME = re.compile(r"\.lora_lab-(\d+)-[A-Za-z0-9_]+\.tmp$")


def _remove_stale_temp_files(folder: Path) -> list[Path]:
    """Remove lora_lab's own temp files in `folder` whose writing process no longer runs; returns them."""
    removed = []
    for tmp in folder.glob(f".*{_TEMP_PREFIX}*.tmp"):
        m = _TEMP_NAME.search(tmp.name)
        if m is None or int(m.group(1)) == os.getpid() or _process_alive(int(m.group(1))):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process (or a pid no process can have)
        return True
    return True


def atomic_write_bytes(path: str | os.PathLike, data: bytes | Iterable[bytes]) -> Path:
    """Write `data` (bytes, or chunks of bytes written as they come) to `path` atomically: a temp file in the
    same folder, fsync, rename over `path`, fsync the folder (so the rename itself survives a power cut).

    A crash leaves the old file or the new one, never half of one; a failed write leaves no temp file, and
    the temp files of killed writes are removed at the next write to the folder. An OSError names `path`.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp_files(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{_TEMP_PREFIX}{os.getpid()}-", suffix=".tmp",
                                   dir=path.parent)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes the file 0600; a LoRA is shared like any file
        with os.fdopen(fd, "wb") as f:
            for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_folder(path.parent)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None and e.filename != str(path):
            # name the caller's file, not the temp file
            raise type(e)(e.errno, e.strerror or os.strerror(e.errno), str(path)) from e
        raise
    return path


def _fsync_folder(folder: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a folder; the data itself is already synced
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def atomic_save_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str],
    like: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Write a safetensors file atomically (`atomic_write_bytes`), one tensor at a time.

    The header comes from `like` (default: `tensors`; each tensor's dtype and shape), then each tensor of
    `tensors` is taken, written and dropped: with a mapping that computes tensors on access (a merged state
    dict) and `like` its base, at most one computed tensor exists at a time, and no copy of the file is made.
    """
    like = tensors if like is None else like
    header, offset = {"__metadata__": {"format": "pt", **metadata}}, 0
    for key, t in like.items():
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes

    def chunks():
        yield struct.pack("<Q", len(head)) + head
        for key, t0 in like.items():
            t = tensors[key].detach().to("cpu").contiguous()
            if t.dtype != t0.dtype or t.shape != t0.shape:
                raise LoraFormatError(f"{path}: key {key!r} is {t.dtype} {tuple(t.shape)}, its header says "
                                      f"{t0.dtype} {tuple(t0.shape)}")
            yield t.reshape(-1).view(torch.uint8).numpy().data  # little-endian, as safetensors; no copy

    atomic_write_bytes(path, chunks())


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """`torch.save`, written atomically (`atomic_write_bytes`): a kill never leaves half a file."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return atomic_write_bytes(path, buf.getvalue())
