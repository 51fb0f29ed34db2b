"""lora/lycoris.py and formats/lycoris.py: LoKr and LoHa on Linear and Conv2d against the formulas written out
here and ComfyUI's loading rule; merge, unmerge, strength; files with ComfyUI's keys read back."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from lora_lab.formats.lycoris import apply_lycoris, save_lycoris
from lora_lab.lora.config import LoRAConfigError
from lora_lab.lora.lycoris import LycorisLayer, add_lycoris, factorization
from lora_lab.lora.model import lora_disabled

LINEAR = "mid_block.attentions.0.proj_in"
CONV = "down_blocks.0.resnets.0.conv1"


def _unet_like() -> nn.Module:
    """A Linear (12 -> 16) and a 3x3 Conv2d (4 -> 8) at paths of a diffusers UNet."""
    torch.manual_seed(0)
    root = nn.Module()
    root.mid_block = nn.Module()
    root.mid_block.attentions = nn.ModuleList([nn.Module()])
    root.mid_block.attentions[0].proj_in = nn.Linear(12, 16)
    root.down_blocks = nn.ModuleList([nn.Module()])
    root.down_blocks[0].resnets = nn.ModuleList([nn.Module()])
    root.down_blocks[0].resnets[0].conv1 = nn.Conv2d(4, 8, 3, padding=1)
    return root


def _trained(model: nn.Module) -> None:
    """Random factors everywhere (a fresh adapter is a no-op)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)


def _comfy_weight(w: torch.Tensor, f: dict[str, torch.Tensor], alpha: float, strength: float) -> torch.Tensor:
    """ComfyUI's calculate_weight (comfy/weight_adapter/lokr.py, loha.py), written out: alpha / dim where a
    factor is decomposed (dim: its rank), else 1; a 4-D lokr_w2 gets w1 unsqueezed to 4-D."""
    if "hada_w1_a" in f:
        diff = (f["hada_w1_a"] @ f["hada_w1_b"]) * (f["hada_w2_a"] @ f["hada_w2_b"])
        return w + strength * (alpha / f["hada_w1_b"].shape[0]) * diff.reshape(w.shape)
    w1 = f["lokr_w1"]
    dim = f["lokr_w2_b"].shape[0] if "lokr_w2_b" in f else None
    w2 = f["lokr_w2"] if dim is None else f["lokr_w2_a"] @ f["lokr_w2_b"]
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    return w + strength * (alpha / dim if dim else 1.0) * torch.kron(w1, w2).reshape(w.shape)


@pytest.mark.parametrize("kind, rank", [("lokr", None), ("lokr", 2), ("loha", 3)])
def test_forward_merge_unmerge_and_strength_are_the_formula(kind, rank):
    model = _unet_like()
    x, img = torch.randn(5, 12), torch.randn(2, 4, 6, 6)
    before = copy.deepcopy(model)
    assert add_lycoris(model, kind, [LINEAR, CONV], rank=rank, alpha=4.0, factor=2) == [LINEAR, CONV]
    lin, conv = model.get_submodule(LINEAR), model.get_submodule(CONV)
    torch.testing.assert_close(lin(x), before.get_submodule(LINEAR)(x))  # a no-op at the start
    _trained(model)
    for layer, base, inp in ((lin, before.get_submodule(LINEAR), x), (conv, before.get_submodule(CONV), img)):
        f = {k: v for k, v in layer.adapter_state().items() if k != "alpha"}
        if kind == "lokr":  # written out: s kron(W1, W2), s = alpha / r (1 with W2 whole: rank 2 keeps the
            whole = "lokr_w2" in f  # conv's 2 x 2 W2 whole, LyCORIS' rule)
            assert whole == (rank is None or layer is conv)
            w2 = f["lokr_w2"].flatten(1) if whole else f["lokr_w2_a"] @ f["lokr_w2_b"]
            delta = (1.0 if whole else 4.0 / rank) * torch.kron(f["lokr_w1"], w2)
        else:  # (alpha / r) (W1a W1b) * (W2a W2b)
            delta = 4.0 / rank * (f["hada_w1_a"] @ f["hada_w1_b"]) * (f["hada_w2_a"] @ f["hada_w2_b"])
        w = base.weight + delta.reshape(base.weight.shape)
        run = (lambda t, w=w, b=base: F.linear(t, w, b.bias)) if inp.dim() == 2 else (
            lambda t, w=w, b=base: F.conv2d(t, w, b.bias, padding=1))
        torch.testing.assert_close(layer(inp), run(inp), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(w, _comfy_weight(base.weight, f, layer.alpha, 1.0), rtol=1e-5, atol=1e-6)
        layer.strength = 0.5
        half = base.weight + 0.5 * delta.reshape(base.weight.shape)
        expect = layer(inp)
        layer.merge()
        torch.testing.assert_close(layer.base.weight, half, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer(inp), expect, rtol=1e-4, atol=1e-5)
        layer.unmerge()
        torch.testing.assert_close(layer.base.weight, base.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lora_disabled_switches_lycoris_layers_off_too(kind):
    """The trainer's samples.png draws its base row inside `lora_disabled`: a LoKr/LoHa run's base row must be
    the base (it was the adapted model: only LoRA layers were switched off)."""
    model = _unet_like()
    x = torch.randn(5, 12)
    before = copy.deepcopy(model)
    add_lycoris(model, kind, [LINEAR, CONV], rank=2, alpha=4.0, factor=2)
    _trained(model)
    lin = model.get_submodule(LINEAR)
    adapted = lin(x)
    assert not torch.allclose(adapted, before.get_submodule(LINEAR)(x))
    with lora_disabled(model):
        torch.testing.assert_close(lin(x), before.get_submodule(LINEAR)(x), rtol=0, atol=0)
    torch.testing.assert_close(lin(x), adapted, rtol=0, atol=0)


@pytest.mark.parametrize("kind, rank", [("lokr", None), ("lokr", 1), ("loha", 3)])
def test_files_carry_comfyuis_keys_and_read_back(tmp_path, kind, rank):
    model, fresh = _unet_like(), _unet_like()
    add_lycoris(model, kind, [LINEAR, CONV], rank=rank, alpha=4.0, factor=4)
    _trained(model)
    path = save_lycoris(tmp_path / "adapter.safetensors", model, "unet", base="sd15")
    keys = set(load_file(str(path)))
    stem = "lora_unet_mid_block_attentions_0_proj_in"
    roles = ({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"} if kind == "loha"
             else {"lokr_w1", "lokr_w2"} if rank is None else {"lokr_w1", "lokr_w2_a", "lokr_w2_b"})
    assert {k for k in keys if k.startswith(stem + ".")} == {f"{stem}.{r}" for r in roles | {"alpha"}}
    assert apply_lycoris(fresh, path, "unet", base="sd15", strength=0.7) == [LINEAR, CONV]
    for name, inp in ((LINEAR, torch.randn(3, 12)), (CONV, torch.randn(1, 4, 5, 5))):
        model.get_submodule(name).strength = 0.7
        torch.testing.assert_close(fresh.get_submodule(name)(inp), model.get_submodule(name)(inp),
                                   rtol=1e-5, atol=1e-6)


def test_factorization_and_bad_factors_are_one_line_errors():
    assert factorization(16, 4) == (4, 4) and factorization(12, 2) == (2, 6) and factorization(12) == (3, 4)
    with pytest.raises(LoRAConfigError, match=r"^mid_block.attentions.0.proj_in: LoKr factor 5 does not "
                                              r"divide the dimension 16$"):
        add_lycoris(_unet_like(), "lokr", [LINEAR], factor=5)
    with pytest.raises(LoRAConfigError, match="kind must be one of lokr, loha"):
        LycorisLayer(nn.Linear(4, 4), "lora")


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_stacks_with_a_lora_file_in_merge_loras_and_apply_loras(tmp_path, kind):
    from lora_lab.formats import save_lora
    from lora_lab.lora import LoRAConfig, add_lora
    from lora_lab.merge import apply_loras, merge_loras

    with_lora, with_lycoris = _unet_like(), _unet_like()
    add_lora(with_lora, LoRAConfig(rank=2, alpha=2.0, targets=[LINEAR, CONV], conv=True))
    add_lycoris(with_lycoris, kind, [LINEAR], rank=2, alpha=1.0, factor=4)
    _trained(with_lora)
    _trained(with_lycoris)
    lora = save_lora(tmp_path / "lora.safetensors", with_lora, "kohya", component="unet", base="sd15")
    lyco = save_lycoris(tmp_path / "lyco.safetensors", with_lycoris, "unet", base="sd15")
    base = _unet_like()
    w, key = base.get_submodule(LINEAR).weight, f"{LINEAR}.weight"
    lora_only = merge_loras(base.state_dict(), [(lora, 0.5)], component="unet")[key]
    both = merge_loras(base.state_dict(), [(lora, 0.5), (lyco, 0.8)], component="unet")
    expect = lora_only + 0.8 * with_lycoris.get_submodule(LINEAR).delta_weight().detach()  # W + D + t dW
    torch.testing.assert_close(both[key], expect, rtol=1e-5, atol=1e-6)
    assert not torch.equal(lora_only, w) and both.patched == [f"{CONV}.weight", key]
    x = torch.randn(3, 12)
    applied = apply_loras(base, [(lora, 0.5), (lyco, 0.8)], mode="runtime", component="unet")
    torch.testing.assert_close(base.get_submodule(LINEAR)(x), F.linear(x, expect, base.get_submodule(
        LINEAR).base.bias), rtol=1e-4, atol=1e-5)
    applied.set_strength(1, 0.0)  # the LoKr/LoHa file off: the LoRA alone
    torch.testing.assert_close(base.get_submodule(LINEAR)(x), F.linear(x, lora_only, base.get_submodule(
        LINEAR).base.bias), rtol=1e-4, atol=1e-5)


def test_the_deltas_are_the_lycoris_packages():
    """lycoris-lora's own functional forms (skipped where the package is not installed)."""
    lokr = pytest.importorskip("lycoris.functional.lokr")
    loha = pytest.importorskip("lycoris.functional.loha")
    model = _unet_like()
    add_lycoris(model, "lokr", [LINEAR], rank=1, alpha=4.0, factor=4)  # rank 2 would keep W2 (4 x 4) whole
    _trained(model)
    layer = model.get_submodule(LINEAR)
    ref = lokr.diff_weight(layer.w1, None, None, None, layer.w2_a, layer.w2_b, None, gamma=4.0,
                           backend="torch")
    torch.testing.assert_close(layer.delta_weight(), ref.reshape(layer.shape), rtol=1e-5, atol=1e-6)
    model = _unet_like()
    add_lycoris(model, "loha", [CONV], rank=3, alpha=4.0)
    _trained(model)
    h = model.get_submodule(CONV)
    ref = loha.diff_weight(h.w1_b, h.w1_a, h.w2_b, h.w2_a, None, None, gamma=torch.tensor(4.0 / 3),
                           backend="torch")
    torch.testing.assert_close(h.delta_weight(), ref.reshape(h.shape), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ LoKr / LoHa as a training option


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_a_tiny_training_run_writes_a_file_lora_lab_reads_back_and_merges_as_the_formula(
        tmp_path, digits_folder, kind):
    from lora_lab.diffusion import TrainConfig, TrainConfigError, train
    from lora_lab.formats import load_lora
    from lora_lab.formats.lycoris import LycorisWeights
    from lora_lab.merge import merge_loras

    cfg = dict(model="sd15", dataset=str(digits_folder(2)), output=str(tmp_path / "run"), steps=2, rank=2,
               alpha=4.0, lr=1e-2, batch_size=2, sample_steps=0, progress=False, adapter=kind,
               save_every=1, ema_decay=0.5, **({"lokr_factor": 4} if kind == "lokr" else {}))
    result = train(TrainConfig(**cfg))
    out = tmp_path / "run"
    assert set(result.outputs) >= {"lora_kohya", "lora_kohya_ema"} and "lora_diffusers" not in result.outputs
    assert (out / "lora_step_0000001.safetensors").is_file()
    layers = {n: m for n, m in result.pipe.unet.named_modules() if isinstance(m, LycorisLayer)}
    assert layers and all(m.kind == kind for m in layers.values())
    for file, ema in ((result.outputs["lora_kohya"], False), (result.outputs["lora_kohya_ema"], True)):
        lf = load_lora(file)
        assert lf.format == "lycoris" and lf.base == "sd15"
        assert set(lf.modules) == {f"unet.{n}" for n in layers}
        assert "lora_lab_train_config" in lf.metadata and lf.metadata["lora_lab_step"] == "2"
        for n, m in layers.items():
            read = lf.modules[f"unet.{n}"]
            assert isinstance(read, LycorisWeights) and read.alpha == 4.0
            for role, t in m.adapter_state().items():  # the trained weights, exactly (the EMA file: not them)
                assert role == "alpha" or torch.equal(read.factors[role], t) != ema
    # the merge of the file = W + t (the formula of its factors), ComfyUI's rule written out
    lf = load_lora(result.outputs["lora_kohya"])
    weights = {f"{n}.weight": m.base.weight.detach() for n, m in layers.items()}
    merged = merge_loras(weights, [(result.outputs["lora_kohya"], 0.7)], component="unet")
    assert sorted(merged.patched) == sorted(weights)
    for n, m in layers.items():
        f = {k: v.float() for k, v in lf.modules[f"unet.{n}"].factors.items()}
        torch.testing.assert_close(merged[f"{n}.weight"], _comfy_weight(weights[f"{n}.weight"], f, 4.0, 0.7),
                                   rtol=1e-5, atol=1e-6)
    if kind == "loha":  # a resume with the other adapter kind is refused
        return
    with pytest.raises(TrainConfigError, match="the config changed .*adapter: 'lokr' -> 'loha'"):
        train(TrainConfig(**{**cfg, "adapter": "loha", "lokr_factor": -1, "steps": 3, "resume": True}))


def test_adapter_options_are_one_line_errors(tmp_path, digits_folder):
    from lora_lab.cli import build_parser
    from lora_lab.diffusion import TrainConfig, TrainConfigError, train

    args = build_parser().parse_args(["train", "--adapter", "lokr", "--lokr-factor", "4"])
    assert (args.adapter, args.lokr_factor) == ("lokr", 4)
    for bad, field in [({"adapter": "locon"}, "adapter"),
                       ({"adapter": "lokr", "lokr_factor": 0}, "lokr_factor"),
                       ({"lokr_factor": 4}, "lokr_factor"), ({"adapter": "loha", "dora": True}, "dora"),
                       ({"adapter": "lokr", "loraplus_ratio": 4.0}, "loraplus_ratio"),
                       ({"adapter": "loha", "text_encoder_lr": 1e-4}, "text_encoder_lr")]:
        with pytest.raises(TrainConfigError, match=f"^TrainConfig.{field}=[^\n]*$"):
            TrainConfig(**bad)
    out = tmp_path / "bad"  # a factor that does not divide a targeted layer: before anything is built
    with pytest.raises(TrainConfigError, match=r"^TrainConfig.lokr_factor=7: does not divide the targeted "
                                               r"layer [^\n]*; use a common divisor, or -1$"):
        train(TrainConfig(model="sd15", dataset=str(digits_folder(4)), output=str(out), steps=1,
                          adapter="lokr", lokr_factor=7, rank=2, sample_steps=0, progress=False))
    assert not out.exists()
