"""A LoRA at a lower rank (`resize_lora`), or a LoRA from a fine-tuned model minus its base
(`extract_lora`): each layer's weight change D cut to rank k by its SVD, with what the cut keeps.

    D = U S V^T   ->   D_k = U_k S_k V_k^T,   up = U_k sqrt(S_k / s),  down = sqrt(S_k / s) V_k^T

D_k is the closest rank-k matrix to D in Frobenius norm (Eckart-Young), so no rank-k LoRA changes the
layer less than D_k does. The rank of a layer is either fixed (`rank`) or the smallest that keeps a share
`energy` of the change's squared Frobenius norm, sum(S_k^2) / sum(S^2) (sd-scripts'
`networks/resize_lora.py` calls this criterion `sv_fro`, with the square root of the share); `rank` with
`energy` caps it. A LoRA's change is a product of rank r: its SVD comes from an r x r one (QR of up and
down first), so resizing costs little at any width; a difference of full models needs the full SVD.

Each layer's report: the ranks, the share of the change kept, and the relative output error on a seeded
probe, ||(D - D_k) x|| / ||D x|| over 256 Gaussian inputs x (conv: inputs of in x kh x kw, a patch).
The file's alpha is kept for every layer (the factors absorb the scale), since diffusers' kohya reader
gives attention projections one alpha. DoRA: the low-rank part V - W is cut and the magnitude kept (the
renormalised weight is then close to, not exactly, the best one). LoKr/LoHa files are refused: their
change is a Kronecker or Hadamard product whose conv kernel is not on file; merge one into its base and
extract a LoRA from the merged model instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import LoraLabError
from .formats import LoraFile, LoraWeights, load_lora
from .models.kinds import ModelKind

PROBES = 256  # probe inputs per layer


class ResizeError(LoraLabError):
    """A resize or extract asked for something it cannot do: a rank or energy out of range, no change."""


@dataclass(frozen=True)
class LayerReport:
    """What cutting one layer's change kept."""

    name: str
    rank_from: int  # the LoRA's rank, or the change's numerical rank (extract: above the weights' rounding)
    rank: int
    kept: float  # sum(S_k^2) / sum(S^2)
    probe_error: float  # ||(D - D_k) x|| / ||D x||

    @property
    def frobenius_error(self) -> float:
        """||D - D_k||_F / ||D||_F = sqrt(1 - kept)."""
        return math.sqrt(max(0.0, 1.0 - self.kept))


@dataclass(frozen=True)
class ResizeReport:
    layers: list[LayerReport]
    params_from: int  # the LoRA's parameters before, or the changed weights' (extract)
    params: int
    kept: float  # the share of all layers' squared change kept (each layer weighted by its squared norm)

    def table(self) -> str:
        width = max((len(r.name) for r in self.layers), default=4)
        lines = [f"{'layer':<{width}}  rank      kept   F-error  probe-error"]
        lines += [f"{r.name:<{width}}  {r.rank_from:>4}->{r.rank:<4} {r.kept:6.2%}  {r.frobenius_error:8.2e}"
                  f"  {r.probe_error:9.2e}" for r in self.layers]
        lines.append(f"{len(self.layers)} layers, {self.params_from:,} -> {self.params:,} parameters, "
                     f"{self.kept:.2%} of the change kept")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"kept": self.kept, "params_from": self.params_from, "params": self.params,
                "layers": [{"name": r.name, "rank_from": r.rank_from, "rank": r.rank, "kept": r.kept,
                            "probe_error": r.probe_error} for r in self.layers]}


def check_target(rank: int | None, energy: float | None) -> None:
    """ResizeError unless a rank >= 1 or an energy in (0, 1] is given."""
    if rank is None and energy is None:
        raise ResizeError("give a rank (--rank) or an energy to keep (--energy), or both")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ResizeError(f"rank {rank!r}: it must be an integer >= 1")
    if energy is not None and not (isinstance(energy, (int, float)) and 0 < energy <= 1):
        raise ResizeError(f"energy {energy!r}: it must be a share in (0, 1], e.g. 0.95")


def choose_rank(s: torch.Tensor, rank: int | None, energy: float | None) -> int:
    """The rank to keep of singular values `s` (descending): `rank`, or the fewest keeping `energy` of
    sum(s^2) (at most `rank` when both are given); at least 1, at most len(s). No change (s all 0): 1."""
    k = len(s) if rank is None else min(rank, len(s))
    if energy is not None:
        if not (s > 0).any():  # a layer training never moved (SD3's last add_q_proj): one rank holds it
            return 1
        share = torch.cumsum(s.double() ** 2, 0) / (s.double() ** 2).sum()
        k = min(k, int((share < energy - 1e-12).sum()) + 1)
    return max(1, k)


def factored_svd(up: torch.Tensor, down: torch.Tensor, scale: float):
    """U, S, Vh of scale * up @ down ((out, r) @ (r, in)) through an r x r SVD, in float64."""
    qu, ru = torch.linalg.qr(up.double())
    qd, rd = torch.linalg.qr(down.double().T)
    p, s, vh = torch.linalg.svd(scale * ru @ rd.T)
    return qu @ p, s, vh @ qd.T


def cut(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, k: int, alpha: float):
    """(up (out, k), down (k, in)) with (alpha / k) up @ down = U_k S_k Vh_k, the scale split evenly."""
    root = (s[:k] * k / alpha).sqrt()
    return u[:, :k] * root, root[:, None] * vh[:k]


def probe_error(s: torch.Tensor, vh: torch.Tensor, k: int, seed: int = 0) -> float:
    """||(D - D_k) x|| / ||D x|| on PROBES seeded Gaussian inputs, D = U S Vh (U's columns orthonormal)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(vh.shape[1], PROBES, generator=gen, dtype=torch.float64)
    proj = vh.to(torch.float64) @ x  # (n, PROBES): D x = U S proj; D_k x keeps its first k rows
    ds = s.to(torch.float64)[:, None] * proj
    total = ds.norm()
    return float(ds[k:].norm() / total) if total > 0 else 0.0


def _numerical_rank(s: torch.Tensor, noise: float) -> int:
    """The singular values above `noise`: a bound on the singular values of the rounding in the weights
    (entries off by at most eps |w| / 2 each, so by Weyl's inequality s_i moves by at most
    eps ||W||_F / 2 for each of the two weights)."""
    return int((s > noise).sum())


def _as_matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    return shape[0], math.prod(shape[1:])


def _lora_of(u, s, vh, k, alpha, shape, dtype, dora=None, key="") -> LoraWeights:
    up, down = cut(u, s, vh, k, alpha)
    if len(shape) == 4:
        up, down = up.reshape(shape[0], k, 1, 1), down.reshape(k, *shape[1:])
    return LoraWeights(down=down.to(dtype).contiguous(), up=up.to(dtype).contiguous(), alpha=float(alpha),
                       dora_scale=dora, key=key)


def _params(m: LoraWeights) -> int:
    return m.down.numel() + m.up.numel()


def resize_lora(lora: str | Path | LoraFile, rank: int | None = None, energy: float | None = None,
                seed: int = 0) -> tuple[LoraFile, ResizeReport]:
    """A LoRA file (path or LoraFile; kohya or PEFT, LoRA or DoRA) cut to
    `rank` and/or to the fewest ranks keeping `energy` per layer; the file's format and metadata kept."""
    check_target(rank, energy)
    lf = lora if isinstance(lora, LoraFile) else load_lora(lora)
    modules, reports, weights = {}, [], []
    if lf.format == "lycoris":
        raise ResizeError(f"{lf.path}: a LoKr/LoHa file: its change is a Kronecker or Hadamard product, not "
                          "a low-rank one; merge it into its base (lora-lab merge) and extract a LoRA from "
                          "the merged model (lora-lab extract)")
    for name, m in sorted(lf.modules.items()):
        shape = m.weight_shape()
        u, s, vh = factored_svd(m.up.reshape(shape[0], m.rank), m.down.reshape(m.rank, -1), m.scale)
        k = choose_rank(s, rank, energy)
        kept = float((s[:k] ** 2).sum() / (s ** 2).sum()) if s.numel() and s[0] > 0 else 1.0
        reports.append(LayerReport(name, m.rank, k, kept, probe_error(s, vh, k, seed)))
        weights.append(float((s ** 2).sum()))
        modules[name] = _lora_of(u, s, vh, k, m.alpha, shape, m.down.dtype, m.dora_scale, key=m.key)
    out = LoraFile(modules, format=lf.format, metadata=dict(lf.metadata), path=lf.path)
    return out, _report(reports, weights, lf, out)


def _report(layers: list[LayerReport], weights: list[float], before, after: LoraFile) -> ResizeReport:
    total = sum(weights)
    kept = sum(r.kept * w for r, w in zip(layers, weights)) / total if total > 0 else 1.0
    params_from = before if isinstance(before, int) else sum(_params(m) for m in before.modules.values())
    return ResizeReport(layers, params_from, sum(_params(m) for m in after.modules.values()), kept)


def weight_pairs(tuned, base) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, W_tuned, W_base) for each 2-D or 4-D weight both sources hold (sources: `.keys()` and
    `.tensor(name, like)`, e.g. models.loading.FolderWeights or single_file.MappedWeights)."""
    common = sorted(set(tuned.keys()) & set(base.keys()))
    for name in common:
        if not name.endswith(".weight"):
            continue
        a = tuned.tensor(name, None)
        if a.dim() not in (2, 4) or not a.is_floating_point():
            continue
        b = base.tensor(name, None)
        if a.shape != b.shape:
            raise ResizeError(f"{name}: {tuple(a.shape)} in the fine-tuned model, {tuple(b.shape)} in the "
                              "base: they are not the same architecture")
        yield name, a, b


def extract_lora(tuned, base, component: str, rank: int | None = None, energy: float | None = None,
                 *, alpha: float | None = None, min_change: float = 1e-6, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> tuple[LoraFile, ResizeReport]:
    """A LoRA of the layers where `tuned` differs from `base` (weight sources, see `weight_pairs`), each
    change cut by its SVD to `rank` / `energy`; modules named `component.<path>`. A layer whose change is
    at most `min_change` of its weight (relative Frobenius norm) is left out. alpha: default the rank."""
    check_target(rank, energy)
    modules, reports, weights, full = {}, [], [], 0
    for name, a, b in weight_pairs(tuned, base):
        shape = tuple(a.shape)
        delta = (a.double() - b.double()).reshape(_as_matrix(shape))
        norm = float(delta.norm())
        if norm == 0 or not math.isfinite(norm) or norm <= min_change * float(b.double().norm()):
            if not math.isfinite(norm):
                raise ResizeError(f"{name}: the change holds NaN or Inf")
            continue
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        eps = torch.finfo(a.dtype).eps
        numerical = _numerical_rank(s, eps * float(a.double().norm() + b.double().norm()))
        k = min(choose_rank(s, rank, energy), max(1, numerical))  # nothing kept that is only rounding
        kept = float((s[:k] ** 2).sum() / (s ** 2).sum())
        module = f"{component}.{name.removesuffix('.weight')}"
        reports.append(LayerReport(module, numerical, k, kept, probe_error(s, vh, k, seed)))
        weights.append(norm ** 2)
        full += delta.numel()
        modules[module] = _lora_of(u, s, vh, k, alpha or k, shape, dtype)
    if not modules:
        raise ResizeError("the fine-tuned model and the base hold the same weights (no layer changed by more "
                          f"than {min_change:g} of its norm): nothing to extract")
    out = LoraFile(modules, format="kohya")
    return out, _report(reports, weights, full, out)


def denoiser_source(path: str | Path, kind: ModelKind):
    """(weights, skeleton or None) of the denoiser in `path`: a diffusers pipeline folder, a component
    folder (config.json and safetensors), a single-file checkpoint, or a component's safetensors in diffusers'
    names."""
    from .fileio import read_safetensors
    from .models.loading import FolderWeights, skeleton
    from .models.single_file import FileHeader, ModelLoadError, component_configs, detect, part_source

    path = Path(path)
    if path.is_dir():
        folder = path / kind.component if (path / "model_index.json").is_file() else path
        weights = _of_kind(path, FolderWeights(folder), kind)
        config = folder / "config.json"
        model = None
        if config.is_file():
            import json
            model = skeleton(kind.denoiser_class(), json.loads(config.read_text()))
        return weights, model
    header = FileHeader(path)
    try:
        found = detect(header)
    except ModelLoadError:  # one component's weights under diffusers' names, memory-mapped
        return _of_kind(path, TensorSource(read_safetensors(path)[0]), kind), None
    if found.kind.name != kind.name:
        raise ResizeError(f"{path}: a {found.kind.name} checkpoint, not {kind.name}")
    import diffusers

    cls_name, cfg = component_configs(kind, found.variant)[kind.component]
    model = skeleton(getattr(diffusers, cls_name), cfg)
    return part_source(kind, kind.component, model, header, {}, found), model


def _of_kind(path: Path, weights, kind: ModelKind):
    """`weights` (diffusers' names), refused where they are not of `kind`'s denoiser (an extract would write a
    LoRA labelled `kind` from another family's weights): each name's top-level module must be one of the
    class's (a config-independent part of it, checked on the tiny config's skeleton)."""
    from .models.builders import CONFIGS
    from .models.loading import skeleton

    cls = kind.denoiser_class()
    own = {n.split(".")[0] for n in skeleton(cls, CONFIGS[kind.name][kind.component]).state_dict()}
    foreign = sorted({k.split(".")[0] for k in weights.keys()} - own)
    if foreign:
        raise ResizeError(f"{path}: not a {kind.name} {kind.component}: {cls.__name__} has no "
                          f"{', '.join(foreign[:5])}; give the --model its weights are of")
    return weights


class TensorSource:
    """A {name: tensor} mapping as a weights source (`keys()`, `tensor(name, like)`), as models.loading's
    folder and single-file sources are."""

    def __init__(self, tensors):
        self.tensors = tensors

    def keys(self) -> set[str]:
        return set(self.tensors)

    def tensor(self, name: str, like) -> torch.Tensor:
        return self.tensors[name]


def _save(path: Path, lf: LoraFile, report: ResizeReport, what: dict, format: str, report_path,
          **save_kwargs) -> Path:
    """Write the LoRA (its metadata: what was asked and the share kept) and, where asked, the whole report
    as JSON, each atomically."""
    from .fileio import atomic_write_bytes
    from .formats import save_lora

    meta = {"lora_lab.lowrank": json.dumps({**what, "kept": round(report.kept, 6)})}
    out = save_lora(path, lf, format, metadata=meta, **save_kwargs)
    if report_path is not None:
        atomic_write_bytes(Path(report_path), json.dumps({**what, **report.to_json()}, indent=1).encode())
    return out


def resize_file(src: str | Path, dst: str | Path, rank: int | None = None, energy: float | None = None,
                report: str | Path | None = None) -> ResizeReport:
    """`lora-lab resize`: `resize_lora` of the file `src` written to `dst` in its own format."""
    lf, rep = resize_lora(src, rank, energy)
    _save(Path(dst), lf, rep, {"resized_from": Path(src).name, "rank": rank, "energy": energy}, lf.format,
          report)
    return rep


def extract_file(tuned: str | Path, base: str | Path, dst: str | Path, kind: ModelKind,
                 rank: int | None = None, energy: float | None = None, *, alpha: float | None = None,
                 format: str = "kohya", report: str | Path | None = None) -> ResizeReport:
    """`lora-lab extract`: the denoiser's change from `base` to `tuned` (folders or files, see
    `denoiser_source`) as a LoRA of `kind`, written to `dst`."""
    tuned_w, model = denoiser_source(tuned, kind)
    base_w, base_model = denoiser_source(base, kind)
    lf, rep = extract_lora(tuned_w, base_w, kind.component, rank, energy, alpha=alpha)
    unet = model or base_model
    layout = {"unet": unet} if kind.ldm_names and unet is not None else {}
    _save(Path(dst), lf, rep, {"extracted_from": Path(tuned).name, "base": Path(base).name, "rank": rank,
                               "energy": energy}, format, report, base=kind.name, **layout)
    return rep
