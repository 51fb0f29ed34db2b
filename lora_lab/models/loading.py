"""Loading a denoiser onto the device one module at a time, in the base dtype, quantized on the way.

    model = skeleton(cls, config)                     # the module tree: parameters on the meta device,
                                                      # no memory
    fill(model, source, dtype=torch.bfloat16, device="cuda", quantization="nf4")

`fill` reads each submodule's parameters from `source`, casts them to `dtype` and puts them on `device`, one
submodule at a time; with `quantization`, a frozen `nn.Linear` becomes a `QuantLinear` as soon as its weight
is on the device, and the weight in `dtype` is dropped. So the device never holds more than the model as
stored so far plus one layer in `dtype` and that layer's quantization temporaries (`quantize_weight` works
through a weight in chunks). Sources:

    FolderWeights(folder)    a diffusers component folder's safetensors (memory-mapped; sharded or not)
    ModuleWeights(build)     the tensors of a module built on the host when first read (a tiny base's seed)
    RandomWeights(seed)      seeded N(0, 0.02) weights, zero biases, unit norms:
                             a real-size model for measuring
    FakeWeights()            empty tensors: under a FakeTensorMode, the shapes and dtypes a plan counts

The skeleton is built on the meta device; every parameter and buffer is then read from the source (a
model with a buffer its weights do not hold is refused). Nothing read from disk runs code: safetensors only.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..fileio import BASE_DTYPES, weight_dtype_problem
from ..quant import QuantLinear
from ..torch_private import buffers_of, parameters_of
from . import flux2, qwen_image
from .chroma import modulation_indices
from .kinds import ModelLoadError
from .qwen_image import rope_tables

# Buffers no weights file holds (a constructor computes them, non-persistent), by name: made from their shape.
DERIVED_BUFFERS = {"time_text_embed.mod_proj": modulation_indices}


def skeleton(cls, config, meta_buffers: bool = True) -> nn.Module:
    """A model of class `cls` from its `config` (a diffusers config dict, or a transformers config object)
    with its parameters on the meta device (no memory, no init work), in eval mode and frozen: the shapes a
    plan or a check reads, and what `fill` loads weights into. meta_buffers: the buffers on the meta device
    too (a denoiser: SD3.5's position table alone is 0.9 GB to compute; every buffer is in its weights), else
    made by the constructor (a text encoder's position ids, which its weights do not hold)."""
    build = (lambda: cls.from_config(config)) if isinstance(config, dict) else (lambda: cls(config))
    if not meta_buffers:
        return skeleton_of(build)
    with torch.device("meta"):
        model = build()
    return model.eval().requires_grad_(False)


def skeleton_of(make: Callable[[], nn.Module]) -> nn.Module:
    """The model `make()` builds, with its parameters on the meta device and its buffers made (a text
    encoder its family's module builds from a config dict and a tokenizer), in eval mode and frozen."""
    with _parameters_on_meta():
        model = make()
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside is made on the meta device (buffers are made where they are)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


# ----------------------------------------------------------------------------- sources of weights


def stored_names(model: nn.Module) -> Callable[[str], str] | None:
    """The module name of each key a text encoder's checkpoints hold, where transformers 5 builds its modules
    under other names (Qwen2.5-VL's, Mistral3's: each family's module says how); None where the keys are the
    module names."""
    return qwen_image.stored_names(model) or flux2.stored_names(model)


class FolderWeights:
    """A component folder's safetensors: `diffusion_pytorch_model.safetensors` (or its sharded index, or the
    fp16 variant), or transformers' `model.safetensors`; read memory-mapped, one tensor at a time."""

    NAMES = ("diffusion_pytorch_model", "model")

    def __init__(self, folder: str | Path, rename: Callable[[str], str] | None = None):
        from safetensors import safe_open

        folder = Path(folder)
        files = self._files(folder)
        self.where: dict[str, Path] = {}
        self.stored: dict[str, str] = {}  # a module's tensor name -> its key on file (`rename`: key -> name)
        for f in files:
            with safe_open(str(f), "pt") as h:
                for key in h.keys():
                    name = rename(key) if rename else key
                    self.where[name], self.stored[name] = f, key
        self._open: dict[Path, object] = {}
        self._safe_open = safe_open

    @classmethod
    def _files(cls, folder: Path) -> list[Path]:
        for name in cls.NAMES:
            index = folder / f"{name}.safetensors.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text()).get("weight_map", {})
                return sorted({folder / f for f in weight_map.values()})
            for variant in ("", ".fp16"):
                single = folder / f"{name}{variant}.safetensors"
                if single.is_file():
                    return [single]
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        raise ModelLoadError(f"{folder}: no safetensors weights" + (
            f" (only {pickles}: pickle files are not read, since loading them can run code)"
            if pickles else ""))

    def keys(self) -> set[str]:
        return set(self.where)

    def describe(self, name: str) -> str:
        return f"{self.where.get(name)}: tensor {name!r}"

    def tensor(self, name: str, like: torch.Tensor) -> torch.Tensor:
        f = self.where.get(name)
        if f is None:
            raise KeyError(name)
        if f not in self._open:
            self._open[f] = self._safe_open(str(f), "pt")
        return self._open[f].get_tensor(self.stored[name])


class ModuleWeights:
    """The parameters and buffers of a module built on the host by `build()` (called when they are first
    read: at loading, not before), by name; each handed over once, so the built module's tensors go as the
    model takes them (or converts them)."""

    def __init__(self, build: Callable[[], nn.Module]):
        self._build = build
        self._tensors: dict[str, torch.Tensor] | None = None

    def _built(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = {n: t.detach() for n, t in self._build().state_dict(keep_vars=True).items()}
        return self._tensors

    def keys(self) -> set[str]:
        return set(self._built())

    def tensor(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return self._built().pop(name)


class RandomWeights:
    """Seeded random weights of any shape, each tensor from its own generator (seed, name): N(0, 0.02) for
    matrices and kernels, zero for biases, one for the weights of norms (1-D tensors named `weight`). Values
    for measuring a real-size model's time and memory, not for its outputs."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def keys(self) -> None:
        return None  # any name

    def tensor(self, name: str, like: torch.Tensor) -> torch.Tensor:
        if like.dim() <= 1:
            fill = 1.0 if name.endswith("weight") else 0.0
            return torch.full(like.shape, fill, dtype=torch.float32)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        return torch.randn(like.shape, generator=g) * 0.02


class FakeWeights:
    """Empty tensors of each parameter's shape: under a FakeTensorMode they are fake (no memory, no
    values)."""

    def keys(self) -> None:
        return None

    def tensor(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")


# ----------------------------------------------------------------------------- filling a skeleton


def fill(model: nn.Module, source, *, dtype: torch.dtype, device: torch.device | str,
         quantization: str | None = None, block_size: int | None = None) -> nn.Module:
    """Load `source` into the skeleton `model` (in place), one submodule at a time, onto `device` in `dtype`
    (floating tensors; the model's `_keep_in_fp32_modules` stay fp32, as transformers loads them), each
    nn.Linear quantized to `quantization` as it arrives. A parameter tied to another (T5's shared embedding)
    is loaded once, under whichever of its names the weights hold. Raises ModelLoadError naming the tensors
    the source lacks or has that the model does not. Returns `model` (QuantLinears replace quantized
    Linears)."""
    device = torch.device(device)
    wanted = dict(model.state_dict(keep_vars=True))
    names_of: dict[int, list[str]] = {}  # a tensor's names: one, or several where it is tied
    for name, t in wanted.items():
        names_of.setdefault(id(t), []).append(name)
    have = source.keys()
    if have is not None:
        missing = sorted(ns[0] for ns in names_of.values() if not any(n in have for n in ns)
                         and (isinstance(wanted[ns[0]], nn.Parameter) or wanted[ns[0]].is_meta))
        unexpected = sorted(have - set(wanted))
        if missing or unexpected:
            raise ModelLoadError(
                f"the weights do not fit the {type(model).__name__} they are loaded into: "
                + (f"{len(missing)} missing, e.g. {missing[:3]}" if missing else "")
                + ("; " if missing and unexpected else "")
                + (f"{len(unexpected)} unexpected, e.g. {unexpected[:3]}" if unexpected else ""))
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    loaded: dict[int, torch.Tensor] = {}  # a tied meta tensor -> its loaded value (loaded once)

    def load(name: str, like: torch.Tensor) -> torch.Tensor | None:
        """The value of `like` from the source (None: a buffer the constructor made and the weights lack)."""
        if id(like) in loaded:
            return loaded[id(like)]
        held = [n for n in names_of.get(id(like), [name]) if have is None or n in have]
        if not held:
            if like.is_meta and name in DERIVED_BUFFERS:
                return DERIVED_BUFFERS[name](like).to(device=device, dtype=like.dtype)
            if like.is_meta:
                raise ModelLoadError(f"{name}: the weights do not hold it")
            return None
        t = source.tensor(held[0], like)
        if like.is_floating_point() and weight_dtype_problem(t.dtype, BASE_DTYPES):
            where = source.describe(held[0]) if hasattr(source, "describe") else held[0]
            raise ModelLoadError(f"{where} {weight_dtype_problem(t.dtype, BASE_DTYPES)}")
        if tuple(t.shape) != tuple(like.shape):
            raise ModelLoadError(f"{held[0]}: the weights hold shape {tuple(t.shape)}, the model expects "
                                 f"{tuple(like.shape)}")
        fp32 = keep and any(k in name.split(".") for k in keep)
        to = like.dtype if not like.is_floating_point() else (torch.float32 if fp32 else dtype)
        return t.to(device=device, dtype=to)

    swaps = []
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for pname, p in list(parameters_of(module).items()):
            if p is not None:
                value = load(prefix + pname, p)
                parameters_of(module)[pname] = value if isinstance(value, nn.Parameter) else nn.Parameter(
                    value, requires_grad=False)
                if len(names_of.get(id(p), ())) > 1:  # a tie shares the Parameter itself (kept for the
                    loaded[id(p)] = parameters_of(module)[pname]  # other names only: others may be freed)
        for bname, b in list(buffers_of(module).items()):
            if b is not None:
                value = load(prefix + bname, b)
                buffers_of(module)[bname] = value if value is not None else b.to(
                    device=device, dtype=dtype if b.is_floating_point() else b.dtype)
        if quantization is not None and type(module) is nn.Linear:
            swaps.append((mod_name, QuantLinear.from_linear(module, quantization, block_size)))
            parameters_of(module)["weight"] = None  # the dtype copy goes now: the device holds the codes only
    for name, q in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, q)
    rope_tables(model, device)  # Qwen-Image's rotary tables: tensors its constructor makes, not buffers
    return model
