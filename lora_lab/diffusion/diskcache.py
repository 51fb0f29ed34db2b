"""The cache phase's tensors on disk, reused by the next run whose keys match: `--cache-dir DIR`
(`--cache-to-disk`: DIR is the output folder's cache/).

    store = open_disk_cache(config, pipe, device, dtype)   # None without a cache folder
    store.images(ds, start, stop, generator, compute)      # one VAE call's tensors, by field
    store.entry(kind, parts, compute)                      # one encoder call's tensors (text, prompts, ...)
    store.stats                                            # {"hits", "written", "rebuilt"}

Layout: one safetensors file per encoder call, `DIR/<kind>/<key[:2]>/<key>.safetensors` (kind: images, text,
prompts, unconditional), the key a sha256 of everything its tensors depend on, repeated in its metadata
beside a blake2b checksum of its tensors' bytes:

    every entry   CACHE_FORMAT, lora_lab's, torch's, diffusers' and transformers' versions, the device type
                  the encoders run on, the base dtype, the model kind
    images        the VAE's identity (a hash of its weights as loaded and its config), each image file's
                  contents (blake2b) and size (its bucket at the run's resolution), and the VAE sampling
                  generator's state before the call (the seed and every draw before it); the file holds each
                  example's tensors by field (`latents.0`, ... and any other per-example field
                  `encoded.encode_group` returns) and the generator's state after the call
    text          the text encoders' identity (weights, tokenizers' vocabularies), the call's captions (each
                  caption variant a string of its own)

Why one file per encoder call, not per image nor per dataset: the call is what the run computes at once (up
to `encoded.ENCODE_BATCH` images of one size, or captions), so a changed image or caption rebuilds exactly its
call, in the same batch and from the same generator state as a run without the cache: bit for bit what that
run computes (an image encoded alone could round differently than in its batch, and the VAE's noise is drawn
per call from one generator). A file per dataset would rebuild everything for one changed caption. An image
inserted before others shifts the later calls (their batch and noise change): those are rebuilt.

Reading maps the file (`fileio.read_safetensors`: the header checked before any tensor, no code run); the
checksum is verified before a tensor is used. A missing entry is encoded and written atomically
(`fileio.atomic_save_safetensors`), then read back mapped, as the next run reads it; a corrupt, truncated or
foreign file is rebuilt with a warning, never trusted. A folder that cannot be written to warns once and the
run goes on from memory.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch

from .._version import __version__
from ..errors import LoraFormatError
from ..fileio import atomic_save_safetensors, read_safetensors
from ..models.kinds import kind_of
from .config import TrainConfig
from .data import file_digest

CACHE_FORMAT = "1"  # the entries' layout: raise it when what an entry holds changes
RNG = "generator_state"  # an images entry's tensor: the VAE sampling generator's state after its call


def cache_folder(config: TrainConfig) -> Path | None:
    """Where a run's disk cache is: `cache_dir`, else with `cache_to_disk` the output folder's cache/, else
    None (off)."""
    if config.cache_dir is not None:
        return Path(config.cache_dir)
    return Path(config.output) / "cache" if config.cache_to_disk else None


def open_disk_cache(config: TrainConfig, pipe, device: torch.device, dtype: torch.dtype) -> DiskCache | None:
    """The run's disk cache (None where it has none), its identity read from the encoders as loaded (call it
    while they are on the host: their weights are hashed)."""
    folder = cache_folder(config)
    if folder is None:
        return None
    return DiskCache(folder, {**encoder_identity(pipe, device, dtype),
                              "text_quantization": config.text_encoder_quantization})


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def module_digest(module: torch.nn.Module | None) -> str:
    """A blake2b of a module's class, config, and every tensor's name, dtype, shape and bytes."""
    h = hashlib.blake2b()
    if module is None:
        return "none"
    config = getattr(module, "config", None)
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    h.update(json.dumps([type(module).__name__, config], sort_keys=True, default=str).encode())
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def encoder_identity(pipe, device: torch.device, dtype: torch.dtype) -> dict:
    """What every entry depends on besides its inputs: versions, device type, dtype, kind, and per kind of
    entry the encoders' own identity (`module_digest`; the tokenizers' vocabularies)."""
    kind = kind_of(pipe)
    text = [module_digest(getattr(pipe, e.component)) for e in kind.text_encoders]
    vocab = hashlib.blake2b()
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        tok = getattr(pipe, name, None)
        if tok is not None:
            vocab.update(json.dumps([name, type(tok).__name__, sorted(tok.get_vocab().items()),
                                     tok.model_max_length]).encode())
    return {"format": CACHE_FORMAT, "lora_lab": __version__, "torch": torch.__version__,
            "diffusers": _version("diffusers"), "transformers": _version("transformers"),
            "device": torch.device(device).type, "dtype": str(dtype), "kind": kind.name,
            "vae": module_digest(pipe.vae), "text": [*text, vocab.hexdigest()]}


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """A blake2b of the tensors' names, dtypes, shapes and bytes, in name order."""
    h = hashlib.blake2b()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


class DiskCache:
    """The entries of one cache folder for encoders of one `identity` (the module docstring)."""

    def __init__(self, folder: str | Path, identity: dict):
        self.folder, self.identity = Path(folder), identity
        self.stats = {"hits": 0, "written": 0, "rebuilt": 0}
        self.read_only = False  # a write failed: the run goes on from memory (warned once)

    def path(self, kind: str, key: str) -> Path:
        return self.folder / kind / key[:2] / f"{key}.safetensors"

    def entry(self, kind: str, parts, compute: Callable[[], dict[str, torch.Tensor]]
              ) -> dict[str, torch.Tensor]:
        """The tensors of the entry of `kind` whose inputs are `parts` (JSON): read mapped from the folder,
        else `compute()`d, written, and read back mapped."""
        encoders = {k: v for k, v in self.identity.items() if k not in ("vae", "text")}
        own = self.identity["vae"] if kind == "images" else self.identity["text"]
        key = hashlib.sha256(json.dumps([encoders, own, kind, parts], sort_keys=True,
                                        default=str).encode()).hexdigest()
        path = self.path(kind, key)
        found = self._read(path, key)
        if found is not None:
            self.stats["hits"] += 1
            return found
        tensors = {k: v.detach().cpu().contiguous() for k, v in compute().items()}
        if self.read_only:
            return tensors
        try:
            atomic_save_safetensors(path, tensors, {"key": key, "checksum": checksum(tensors)})
        except OSError as e:
            warnings.warn(f"disk cache {self.folder}: cannot write {path.name} ({e}); this run caches in "
                          "memory only", stacklevel=2)
            self.read_only = True
            return tensors
        self.stats["written"] += 1
        return self._read(path, key) or tensors

    def _read(self, path: Path, key: str) -> dict[str, torch.Tensor] | None:
        """The entry's tensors, mapped; None where there is none, or (with a warning) where the file is not
        the entry whole: unreadable, truncated, another key, its checksum differs."""
        if not path.exists():
            return None
        try:
            tensors, meta = read_safetensors(path)
            if meta.get("key") != key:
                raise LoraFormatError(f"{path}: holds the entry {meta.get('key')!r}, not {key}")
            if meta.get("checksum") != checksum(tensors):
                raise LoraFormatError(f"{path}: its tensors' checksum differs from the one written")
        except (LoraFormatError, OSError) as e:
            warnings.warn(f"disk cache: {e}; rebuilt", stacklevel=3)
            self.stats["rebuilt"] += 1
            return None
        return tensors

    def images(self, ds, start: int, stop: int, generator: torch.Generator,
               compute: Callable[[], dict[str, list[torch.Tensor]]], extra=()
               ) -> dict[str, list[torch.Tensor]]:
        """The per-example tensors of images start..stop-1 of `ds` (one VAE call: `compute()`, {field: [one
        tensor per image]}), and `generator` left in the state the call leaves it in. `extra`: what else the
        call's tensors depend on (JSON: an option, another file's `data.file_digest`)."""
        before = hashlib.blake2b(generator.get_state().numpy().data).hexdigest()
        parts = [before, [[list(ds.sizes[i]), file_digest(ds.paths[i]).hex()] for i in range(start, stop)],
                 list(extra)]

        def flat() -> dict[str, torch.Tensor]:
            out = {f"{name}.{j}": t for name, ts in compute().items() for j, t in enumerate(ts)}
            return {**out, RNG: generator.get_state()}

        tensors = self.entry("images", parts, flat)
        generator.set_state(tensors[RNG].clone())
        fields: dict[str, list[torch.Tensor]] = {}
        for name in sorted((k for k in tensors if k != RNG), key=lambda k: (k.rsplit(".", 1)[0],
                                                                           int(k.rsplit(".", 1)[1]))):
            fields.setdefault(name.rsplit(".", 1)[0], []).append(tensors[name])
        return fields
