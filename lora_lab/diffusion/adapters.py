"""The adapters a training run puts on the frozen model: LoRA/DoRA, LoKr or LoHa on the denoiser
(`add_adapter`), LoRAs on the CLIP text encoders (`text_encoder_adapters`); and what only the base can tell of
a config (`check_config_for_base`: the rank and LoKr factor against each targeted layer, the resolution)."""

from __future__ import annotations

import torch

from ..lora import LoRAConfig, LoRAConfigError, add_adapters, add_lora
from ..lora.lycoris import factorization, lycoris_targets
from ..models import TINY_MAX_RESOLUTION, ModelKind, denoiser, is_tiny
from .config import TEXT_ENCODER_TARGETS, TrainConfig, TrainConfigError


def check_adapter_for_base(config: TrainConfig, model: torch.nn.Module) -> None:
    """A rank no wider than every targeted layer; a LoKr factor that divides every targeted layer's output
    and input dimensions (each splits as factor x rest): TrainConfigError naming the first that fails."""
    layers = lycoris_targets(model, config.adapter_targets())  # the Linear / Conv2d layers the targets name
    widths = [(min(m.weight.shape[0], m.weight[0].numel()), name) for name, m in layers]
    if widths and config.rank > min(widths)[0]:
        width, name = min(widths)
        raise TrainConfigError(f"TrainConfig.rank={config.rank}: larger than the targeted layer {name} "
                               f"(min(out, in) = {width}); use --rank {width} or less")
    factor = config.lokr_factor  # set (> 0) for a LoKr only: TrainConfig checks that
    if factor > 0:
        for name, m in layers:
            out, inner = m.weight.shape[:2]
            try:  # LycorisLayer's own split of each dimension, before anything is built
                factorization(out, factor), factorization(inner, factor)
            except LoRAConfigError:
                raise TrainConfigError(f"TrainConfig.lokr_factor={factor}: does not divide the targeted "
                                       f"layer {name} (out {out}, in {inner}); use a common divisor, or -1"
                                       ) from None


def check_config_for_base(config: TrainConfig, kind: ModelKind, pipe, resolution: int) -> None:
    """What only the base model can tell: the adapter against the targeted layers (`check_adapter_for_base`),
    a resolution the VAE and the denoiser take (a multiple of VAE downsampling x patch size; SD3: within its
    position embedding; the tiny bases: at most TINY_MAX_RESOLUTION)."""
    model = denoiser(pipe)
    check_adapter_for_base(config, model)
    vae_factor = pipe.vae_scale_factor
    # latents reach the denoiser in patches: packed n x n (Flux), or cut by its patch embedding (SD3)
    patch = kind.latent_packing * int(getattr(model.config, "patch_size", None) or 1)
    if resolution % (vae_factor * patch):
        raise TrainConfigError(f"TrainConfig.resolution={resolution}: the {kind.name} base needs a multiple "
                               f"of {vae_factor * patch} "
                               f"(VAE downsampling {vae_factor} x patch size {patch})")
    max_patches = getattr(model.config, "pos_embed_max_size", None)
    if max_patches and resolution > max_patches * patch * vae_factor:
        raise TrainConfigError(f"TrainConfig.resolution={resolution}: larger than the {kind.name} base's "
                               f"position embedding takes "
                               f"({max_patches * patch * vae_factor} pixels at most)")
    if is_tiny(pipe) and resolution > TINY_MAX_RESOLUTION:  # 4096 would end in an out-of-memory
        raise TrainConfigError(f"TrainConfig.resolution={resolution}: the tiny {kind.name} base takes "
                               f"{TINY_MAX_RESOLUTION} pixels at most (8 x its native "
                               f"{TINY_MAX_RESOLUTION // 8})")


def add_adapter(model: torch.nn.Module, config: TrainConfig, kind: ModelKind) -> list[str]:
    """Freeze the denoiser and wrap its attention projections (and, with config.conv, its ResNet convs; with
    feed_forward, its feed-forward layers) in the config's adapter (LoRA/DoRA, LoKr or LoHa) initialised from
    config.seed; returns the wrapped module names."""
    if config.conv and kind.component != "unet":
        raise TrainConfigError(f"TrainConfig.conv=True: the {kind.name} transformer has no conv layers to "
                               "adapt")
    model.requires_grad_(False)
    torch.manual_seed(config.seed)
    return add_adapters(model, config.adapter, config.adapter_targets(), rank=config.rank,
                        alpha=config.adapter_alpha(), use_dora=config.dora, conv=config.conv,
                        factor=config.lokr_factor)


def clip_encoders(kind: ModelKind) -> list[str]:
    """The pipeline components of a kind's CLIP text encoders (not T5)."""
    return [e.component for e in kind.text_encoders if e.arch.startswith("clip")]


def text_encoder_adapters(config: TrainConfig, kind: ModelKind, pipe
                          ) -> tuple[list[str], list[tuple[str, torch.nn.Parameter]]]:
    """LoRAs (the config's rank and alpha) on the CLIP text encoders' attention and MLP layers, from the seed:
    the wrapped modules and the adapters' parameters, each named `<component>.<name>`."""
    wrapped, named = [], []
    for i, comp in enumerate(clip_encoders(kind)):
        encoder = getattr(pipe, comp)
        encoder.requires_grad_(False)
        torch.manual_seed(config.seed + 1 + i)
        wrapped += [f"{comp}.{n}" for n in add_lora(encoder, LoRAConfig(
            rank=config.rank, alpha=config.adapter_alpha(), targets=list(TEXT_ENCODER_TARGETS)))]
        named += [(f"{comp}.{n}", p) for n, p in encoder.named_parameters() if p.requires_grad]
    return wrapped, named
