"""Every LoKr/LoHa file lora_lab writes loads in LyCORIS' own loader (`lycoris-lora`'s
`lycoris.kohya.create_network_from_weights`) with every module, and its merged weights are lora_lab's.
Skipped only where lycoris cannot be imported (it is in the dev extras: `make test` installs it)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lora_lab.formats import load_lora
from lora_lab.formats.lycoris import save_lycoris
from lora_lab.lora.lycoris import LycorisLayer, add_lycoris, factorization, lokr_w2_whole

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # lycoris' import (bitsandbytes, torchao) needs no network
lycoris_kohya = pytest.importorskip("lycoris.kohya")


def lycoris_deltas(path, layers: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """{kohya name: t dW} as LyCORIS' loader builds the file's modules around `layers` (by kohya name)."""
    holder = nn.Module()  # LyCORIS finds a module by `lora_unet_` + its name: one child per kohya name
    for key, layer in layers.items():
        holder.add_module(key.removeprefix("lora_unet_"), layer)
    network, _ = lycoris_kohya.create_network_from_weights(1.0, str(path), None, None, holder,
                                                           for_inference=True)
    return {m.lora_name: m.get_diff_weight(1.0, shape=layers[m.lora_name].weight.shape)[0].float()
            for m in network.unet_loras}


def assert_lycoris_reads(path, bases: dict[str, nn.Module]) -> int:
    """The file at `path` through LyCORIS' loader: every module, each merged weight equal to lora_lab's
    (`bases`: the plain layers by pipeline path); returns the module count."""
    lf = load_lora(path)
    by_key = {m.key: (name, m) for name, m in lf.modules.items()}
    theirs = lycoris_deltas(path, {key: bases[name] for key, (name, _) in by_key.items()})
    assert sorted(theirs) == sorted(by_key), f"{path}: LyCORIS loaded {len(theirs)} of {len(by_key)} modules"
    for key, (name, m) in by_key.items():
        w = bases[name].weight.detach().float()
        torch.testing.assert_close(w + theirs[key], w + m.delta(w.shape), rtol=1e-5, atol=1e-6)
    return len(by_key)


def trained_(model: nn.Module) -> None:
    """Every adapter factor random (W1 starts at zero: the deltas would all be 0)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LycorisLayer):
                for p in m.adapter_parameters():
                    p.normal_(std=0.2)


@pytest.mark.parametrize(("shape", "rank"), [((640, 640), 16), ((640, 640), 32), ((1280, 1280), 16),
                                             ((1280, 1280), 32), ((3072, 3072), 32), ((320, 320, 3, 3), 16),
                                             ((320, 320, 3, 3), 4), ((3072, 12288), 32)])
@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_real_sdxl_and_flux_shapes_load_in_lycoris_as_lora_lab_merges_them(tmp_path, shape, rank, kind):
    layer = nn.Linear(shape[1], shape[0]) if len(shape) == 2 else nn.Conv2d(shape[1], shape[0], shape[2:])
    model = nn.Sequential()
    model.add_module("to_q", layer)
    add_lycoris(model, kind, ["to_q"], rank=rank, alpha=rank)  # the CLI's defaults: alpha = rank
    trained_(model)
    adapted = model.get_submodule("to_q")
    if kind == "lokr":  # LyCORIS' layout: W2 whole where the rank is at least half its larger side
        (_, o2), (_, i2) = factorization(shape[0]), factorization(shape[1])
        assert hasattr(adapted, "w2") == lokr_w2_whole(rank, o2, i2)
    path = save_lycoris(tmp_path / "f.safetensors", model, "unet", "sd15")
    assert assert_lycoris_reads(path, {"unet.to_q": layer}) == 1


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_every_file_of_a_tiny_sdxl_run_with_the_cli_defaults_loads_in_lycoris(tmp_path, digits_folder,
                                                                             kind):
    from lora_lab.diffusion import TrainConfig, train

    result = train(TrainConfig(model="sdxl", dataset=str(digits_folder(2)), output=str(tmp_path / "run"),
                               steps=2, save_every=1, ema_decay=0.5, adapter=kind, sample_steps=0,
                               progress=False, conv=True))
    unet = result.pipe.unet
    bases = {f"unet.{n}": m.base for n, m in unet.named_modules() if isinstance(m, LycorisLayer)}
    files = sorted((tmp_path / "run").glob("*.safetensors"))
    assert len(files) == 4  # lora, lora_ema, lora_step_0000001, lora_step_0000002
    assert {assert_lycoris_reads(f, bases) for f in files} == {len(bases)}
    if kind == "lokr":  # the defaults (rank 16 = alpha) keep some W2 whole in the tiny UNet: the case refused
        assert any(not hasattr(m, "w2_a") for m in unet.modules() if isinstance(m, LycorisLayer))


def test_a_file_with_w2_decomposed_at_a_high_rank_still_reads_in_lora_lab(tmp_path):
    """Files written before LyCORIS' rule was followed (W2 = W2a W2b at rank >= half its side) still read."""
    base = nn.Linear(64, 64)
    w1, w2a, w2b = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)
    layer = LycorisLayer.from_factors(base, {"lokr_w1": w1, "lokr_w2_a": w2a, "lokr_w2_b": w2b}, 4.0)
    expect = 0.5 * torch.kron(w1, w2a @ w2b)
    torch.testing.assert_close(layer.delta_weight(), expect)
    assert layer.rank == 8 and not hasattr(layer, "w2")
