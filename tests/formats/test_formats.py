"""LoRA files: key maps, save/load/convert, bad files, and interoperability with diffusers' own loader.

The interop tests build the real StableDiffusion(XL)Pipeline from tiny components (offline tokenizer),
load a lora_lab kohya file with `pipe.load_lora_weights`, and compare the UNet / text encoder outputs
with lora_lab's merged model; and the other way round for a file diffusers' `save_lora_weights` wrote.
"""

from __future__ import annotations

import json
import math
import struct
import warnings

import pytest
import torch
from torch import nn

from lora_lab.formats import (
    COMPONENTS,
    LoraFile,
    LoraFormatError,
    LoraWeights,
    convert_lora,
    diffusers_name,
    kohya_name,
    load_lora,
    match_modules,
    save_lora,
)
from lora_lab.lora import LoRAConfig, add_lora, lora_modules
from lora_lab.merge import apply_loras, merge_loras
from lora_lab.models import build_components, build_pipeline

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")


RANK = 4
ALPHA = 2.0  # != RANK: a reader that drops alpha gets twice the change
TOL = 1e-4  # fp32, as the issue asks
UNET_TARGETS = (r".*(attn[12]\.to_(q|k|v|out\.0)|proj_in|proj_out|ff\.net\.(0\.proj|2)|"
                r"resnets\.\d+\.(conv1|conv2|time_emb_proj))")
TE_TARGETS = r".*(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])"


def randomize(model: nn.Module, seed: int) -> None:
    """Non-zero A and B (B starts at 0 in training), deterministic: the files then carry real changes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("down", "up")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def unet_inputs(pipe, kind: str):
    """Fixed latents, timestep and text states for one UNet call (SDXL's added conditions included)."""
    g = torch.Generator().manual_seed(1)
    unet = pipe.unet
    x = torch.randn(1, 4, 8, 8, generator=g)
    ctx = torch.randn(1, 16, unet.config.cross_attention_dim, generator=g)
    kw = {}
    if kind == "sdxl":
        kw["added_cond_kwargs"] = {"text_embeds": torch.randn(1, 32, generator=g),
                                   "time_ids": torch.tensor([[16.0, 16, 0, 0, 16, 16]])}
    return (x, torch.tensor([500]), ctx), kw


@torch.no_grad()
def unet_out(unet, args, kw) -> torch.Tensor:
    return unet(*args, **kw).sample


@torch.no_grad()
def te_out(te, ids) -> torch.Tensor:
    return te(ids)[0]


def lora_lab_lora(kind: str, seed: int = 0) -> dict[str, nn.Module]:
    """Components of a fresh tiny pipeline with lora_lab adapters (random, non-zero) on the UNet and text
    encoders."""
    comps = build_components(kind)
    models = {"unet": comps["unet"], "text_encoder": comps["text_encoder"]}
    if kind == "sdxl":
        models["text_encoder_2"] = comps["text_encoder_2"]
    for i, (name, m) in enumerate(models.items()):
        add_lora(m, LoRAConfig(rank=RANK, alpha=ALPHA,
                               targets=UNET_TARGETS if name == "unet" else TE_TARGETS))
        randomize(m, seed + i)
    return models


# ----------------------------------------------------------------------------- key maps


def transformers4_path(model: nn.Module, path: str) -> str:
    """A module's path in transformers 4's layout: CLIPTextModel held its modules under `.text_model`
    (transformers 5 flattened it; CLIPTextModelWithProjection and T5 did not change)."""
    from transformers import CLIPTextModel

    flat = isinstance(model, CLIPTextModel) and not hasattr(model, "text_model")
    return f"text_model.{path}" if flat else path


@pytest.mark.parametrize("kind", ["sd15", "sdxl", "sd3", "flux"])
def test_every_module_name_survives_kohya_and_back(kind):
    comps = build_components(kind)
    names = {f"{c}.{n}": f"{c}.{transformers4_path(m, n)}" for c, m in comps.items() if c in COMPONENTS
             for n, mod in m.named_modules() if isinstance(mod, (nn.Linear, nn.Conv2d))}
    assert len(names) > 50
    from lora_lab.formats import unet_layout

    # SDXL's UNet: LDM names, and without: diffusers'
    layout = unet_layout(comps["unet"]) if kind == "sdxl" else None
    for name, tf4 in names.items():
        assert diffusers_name(kohya_name(name, kind), kind) == tf4
        assert diffusers_name(kohya_name(name, kind, layout), kind, layout) == tf4


def test_kohya_names_are_the_ones_comfyui_and_diffusers_use():
    assert (kohya_name("unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0")
            == "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_out_0")
    assert (kohya_name("text_encoder.text_model.encoder.layers.3.mlp.fc1", "sd15")
            == "lora_te_text_model_encoder_layers_3_mlp_fc1")
    assert (kohya_name("text_encoder.text_model.encoder.layers.3.mlp.fc1", "sdxl")
            == "lora_te1_text_model_encoder_layers_3_mlp_fc1")
    assert (kohya_name("text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj")
            == "lora_te2_text_model_encoder_layers_0_self_attn_q_proj")
    assert (kohya_name("transformer.single_transformer_blocks.0.proj_mlp")
            == "lora_transformer_single_transformer_blocks_0_proj_mlp")
    assert (diffusers_name("lora_unet_transformer_blocks_0_attn_add_q_proj")
            == "transformer.transformer_blocks.0.attn.add_q_proj")
    with pytest.raises(LoraFormatError, match="double_blocks.*not one diffusers module"):
        diffusers_name("lora_unet_double_blocks_0_img_attn_qkv")  # load_lora splits it (tests below)
    # SD3 / Flux: CLIP-L is te1, Flux's T5 (its text_encoder_2) te3, as sd-scripts' sd3/flux networks write
    # them
    assert (kohya_name("text_encoder.encoder.layers.0.mlp.fc1", "flux")
            == "lora_te1_text_model_encoder_layers_0_mlp_fc1")
    t5 = "text_encoder_2.encoder.block.0.layer.0.SelfAttention.q"
    assert kohya_name(t5, "flux") == "lora_te3_encoder_block_0_layer_0_SelfAttention_q"
    assert diffusers_name("lora_te3_encoder_block_0_layer_0_SelfAttention_q", "flux") == t5
    # OneTrainer's Flux
    assert diffusers_name("lora_te2_encoder_block_0_layer_0_SelfAttention_q", "flux") == t5
    assert (diffusers_name("lora_te3_encoder_block_0_layer_0_SelfAttention_q", "sd3")
            .startswith("text_encoder_3."))


CLIP_MODULES = {"self_attn_q_proj": "self_attn.q_proj", "self_attn_k_proj": "self_attn.k_proj",
                "self_attn_v_proj": "self_attn.v_proj", "self_attn_out_proj": "self_attn.out_proj",
                "mlp_fc1": "mlp.fc1", "mlp_fc2": "mlp.fc2"}  # kohya: module


def kohya_clip_names(prefix: str, layers: int) -> set[str]:
    """The names kohya's sd-scripts gives a CLIP text encoder's CLIPAttention / CLIPMLP linears
    (transformers 4: `text_model.encoder.layers.{i}.self_attn.q_proj`, ...) and ComfyUI's key map expects,
    from the architecture."""
    return {f"{prefix}text_model_encoder_layers_{i}_{m}" for i in range(layers) for m in CLIP_MODULES}


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_text_encoder_kohya_names_are_the_transformers4_names(tmp_path, kind):
    """Whatever transformers is installed, the file has `lora_te_text_model_...` (SD1.5),
    `lora_te1_/lora_te2_...` (SDXL)."""
    from safetensors import safe_open

    models = lora_lab_lora(kind)
    path = save_lora(tmp_path / "te.safetensors", models)
    with safe_open(str(path), "pt") as f:
        modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0]
                   for k in f.keys()}  # noqa: SIM118
    want = set()
    for comp, prefix in ({"text_encoder": "lora_te_"} if kind == "sd15" else
                         {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}).items():
        want |= kohya_clip_names(prefix, models[comp].config.num_hidden_layers)
    assert len(want) == 12 * (1 if kind == "sd15" else 2)
    assert {m for m in modules if m.startswith("lora_te")} == want


def hand_clip_file(path, model, prefix: str, seed: int, spell=lambda i, m: None):
    """A kohya file for every CLIPAttention / CLIPMLP linear of `model` (ComfyUI / kohya names), and the
    weights W + alpha / r up @ down computed by hand."""
    g = torch.Generator().manual_seed(seed)
    layers = model.config.num_hidden_layers
    sd = model.state_dict()
    tensors, want = {}, {}
    for i in range(layers):
        for m, dotted in CLIP_MODULES.items():
            key = spell(i, m) or f"{prefix}text_model_encoder_layers_{i}_{m}"
            weight = next(k for k in sd if k.endswith(f"encoder.layers.{i}.{dotted}.weight"))
            out, inp = sd[weight].shape
            down, up = torch.randn(RANK, inp, generator=g) * 0.2, torch.randn(out, RANK, generator=g) * 0.2
            tensors.update({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                            f"{key}.alpha": torch.tensor(ALPHA)})
            want[weight] = sd[weight] + ALPHA / RANK * up @ down
    return write_raw(path, tensors), want


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_comfyui_kohya_text_encoder_file_loads_with_every_module_matched(tmp_path, kind):
    comps = build_components(kind)
    encoders = ({"text_encoder": "lora_te_"} if kind == "sd15"
                else {"text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"})
    for i, (comp, prefix) in enumerate(encoders.items()):
        model = comps[comp]
        path, want = hand_clip_file(tmp_path / f"{comp}.safetensors", model, prefix, seed=20 + i)
        assert len(want) == 12
        applied = apply_loras(model, [(path, 1.0)], component=comp)  # strict: every module matched
        assert sorted(applied.weights) == sorted(want)
        got = model.state_dict()
        for k, w in want.items():
            torch.testing.assert_close(got[k], w, rtol=0, atol=1e-6)


def test_text_encoder_names_without_text_model_and_peft_from_transformers4_read_too(tmp_path):
    """lora_lab's own older files (`lora_te_encoder_layers_...`) and PEFT files made with transformers 4
    (`text_encoder.text_model.encoder...`) load into the same modules; both spellings in one file is an
    error."""
    te = build_components("sd15")["text_encoder"]
    old, want = hand_clip_file(tmp_path / "old.safetensors", te, "lora_te_", 30,
                               spell=lambda i, m: f"lora_te_encoder_layers_{i}_{m}")
    new, _ = hand_clip_file(tmp_path / "new.safetensors", te, "lora_te_", 30)
    peft_file = convert_lora(new, tmp_path / "peft.safetensors", to="peft")
    from safetensors import safe_open

    with safe_open(str(peft_file), "pt") as f:
        assert all(k.startswith("text_encoder.text_model.encoder.layers.") for k in f.keys())  # noqa: SIM118
    for path in (old, new, peft_file):
        lf = load_lora(path)
        assert (all(n.startswith("text_encoder.text_model.encoder.layers.") for n in lf.modules)
                and len(lf.modules) == 12)
        merged = merge_loras(te.state_dict(), [(path, 1.0)])
        assert sorted(merged.patched) == sorted(want)
        for k, w in want.items():
            torch.testing.assert_close(merged[k], w, rtol=0, atol=1e-6)
    both = {**load_file_raw(old), **load_file_raw(new)}
    with pytest.raises(LoraFormatError,
                       match="both.safetensors: keys 'lora_te_.*' and 'lora_te_.*' are both module"):
        load_lora(write_raw(tmp_path / "both.safetensors", both))
    te1 = {k.replace("lora_te_", "lora_te1_"): v for k, v in load_file_raw(new).items()}
    with pytest.raises(LoraFormatError,
                       match="te1.safetensors: keys .* are both module 'text_encoder.text_model"):
        load_lora(write_raw(tmp_path / "te1.safetensors", {**load_file_raw(new), **te1}))


def load_file_raw(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# ----------------------------------------------------------------------------- save / load / convert


def hand_lora(seed: int = 0, dora: bool = False) -> LoraFile:
    """Two modules, a linear one and a 3x3 conv (LoCon), ranks and alphas differing."""
    g = torch.Generator().manual_seed(seed)
    lin = LoraWeights(torch.randn(4, 64, generator=g), torch.randn(64, 4, generator=g), alpha=2.0,
                     dora_scale=torch.rand(64, 1, generator=g) + 0.5 if dora else None)
    conv = LoraWeights(torch.randn(2, 32, 3, 3, generator=g), torch.randn(32, 2, 1, 1, generator=g),
                       alpha=1.5)
    return LoraFile({"unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q": lin,
                     "unet.down_blocks.0.resnets.0.conv1": conv})


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_save_load_round_trip_is_exact(tmp_path, fmt):
    lf = hand_lora(dora=True)
    path = save_lora(tmp_path / "x.safetensors", lf, format=fmt, base="sd15")
    back = load_lora(path)
    assert back.format == fmt and back.base == "sd15" and set(back.modules) == set(lf.modules)
    for name, m in lf.modules.items():
        b = back.modules[name]
        assert torch.equal(b.down, m.down) and torch.equal(b.up, m.up) and b.alpha == m.alpha
        assert (b.dora_scale is None) == (m.dora_scale is None)
        if m.dora_scale is not None:
            assert torch.equal(b.dora_scale, m.dora_scale) and b.dora_scale.shape == (64, 1)


def test_kohya_file_layout_and_metadata(tmp_path):
    from safetensors import safe_open

    with pytest.warns(UserWarning, match=r"different alphas \[1.5, 2.0\].*diffusers"):
        path = save_lora(tmp_path / "k.safetensors", hand_lora(dora=True), base="sd15")
    with safe_open(str(path), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        alpha = f.get_tensor("lora_unet_down_blocks_0_resnets_0_conv1.alpha")
    q = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"
    assert f"{q}.alpha" in keys and f"{q}.dora_scale" in keys  # alpha always written
    assert alpha.dtype == torch.float32 and alpha.item() == 1.5
    assert meta["lora_lab.format"] == "kohya" and meta["lora_lab.base_model"] == "sd15"
    assert (meta["lora_lab.rank"] == "[2, 4]" and meta["lora_lab.version"]
            and meta["ss_network_module"] == "networks.lora")
    assert not list(tmp_path.glob(".*tmp"))  # the atomic write left no temp file


def test_peft_file_carries_diffusers_adapter_metadata(tmp_path):
    from safetensors import safe_open

    path = save_lora(tmp_path / "p.safetensors", hand_lora(), format="peft")
    with safe_open(str(path), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert "unet.down_blocks.0.resnets.0.conv1.lora_A.weight" in keys
    adapter = json.loads(meta["lora_adapter_metadata"])
    assert adapter["unet.r"] in (2, 4) and set(adapter["unet.target_modules"]) == {
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q", "down_blocks.0.resnets.0.conv1"}
    # what diffusers builds
    config = peft.LoraConfig(**{k.removeprefix("unet."): v for k, v in adapter.items()})
    assert config.lora_alpha in (1.5, 2.0)


def test_kohya_peft_kohya_round_trips_exactly(tmp_path):
    from safetensors.torch import load_file

    models = lora_lab_lora("sdxl")
    k1 = save_lora(tmp_path / "a.safetensors", models)
    p = convert_lora(k1, tmp_path / "b.safetensors", to="peft")
    k2 = convert_lora(p, tmp_path / "c.safetensors", to="kohya")
    a, c = load_file(k1), load_file(k2)
    assert a.keys() == c.keys() and len(a) > 100
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert (any(k.startswith("lora_te1_text_model_") for k in a)
            and any(k.startswith("lora_te2_text_model_") for k in a))


def test_atomic_write_keeps_the_old_file_when_saving_fails(tmp_path):
    path = save_lora(tmp_path / "keep.safetensors", hand_lora())
    before = path.read_bytes()
    bad = hand_lora(1)
    next(iter(bad.modules.values())).up[0, 0] = float("nan")
    with pytest.raises(LoraFormatError, match="NaN"):
        save_lora(path, bad)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["keep.safetensors"]


def test_saved_file_gets_the_usual_permissions(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        path = save_lora(tmp_path / "shared.safetensors", hand_lora())
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644  # readable by a ComfyUI service, like any file written here


# ----------------------------------------------------------------------------- bad files


def write_raw(path, tensors: dict, metadata=None):
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    return path


BAD = {
    "down_without_up": ({"lora_unet_conv_in.lora_down.weight": torch.ones(2, 4, 3, 3)},
                        "lora_unet_conv_in.*no lora_up"),
    "up_without_down": ({"unet.conv_in.lora_B.weight": torch.ones(4, 2, 1, 1)}, "unet.conv_in.*no lora_A"),
    "rank_mismatch": ({"lora_unet_conv_in.lora_down.weight": torch.ones(2, 4, 3, 3),
                       "lora_unet_conv_in.lora_up.weight": torch.ones(4, 3, 1, 1)},
                      "lora_unet_conv_in.*rank mismatch"),
    "int_dtype": ({"lora_unet_conv_in.lora_down.weight": torch.ones(2, 4, dtype=torch.int32),
                   "lora_unet_conv_in.lora_up.weight": torch.ones(4, 2)}, "lora_unet_conv_in.*int32"),
    "alpha_not_scalar": ({"lora_unet_conv_in.lora_down.weight": torch.ones(2, 4),
                          "lora_unet_conv_in.lora_up.weight": torch.ones(4, 2),
                          "lora_unet_conv_in.alpha": torch.ones(2)},
                         "lora_unet_conv_in.*alpha must be one real number"),
    "unknown_key": ({"lora_unet_conv_in.hada_w1_a": torch.ones(2, 4)}, "lora_unet_conv_in.hada_w1_a"),
    "mixed": ({"lora_unet_conv_in.lora_down.weight": torch.ones(2, 4), "model.x": torch.ones(1)}, "model.x"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_tensors_name_the_file_and_the_key(tmp_path, case):
    tensors, pattern = BAD[case]
    path = write_raw(tmp_path / f"{case}.safetensors", tensors)
    with pytest.raises(LoraFormatError, match=f"{case}.safetensors.*{pattern}"):
        load_lora(path)


def test_a_file_without_alpha_reads_at_scale_one(tmp_path):
    """As diffusers and ComfyUI read it: no alpha means alpha = rank."""
    path = write_raw(tmp_path / "noalpha.safetensors",
                     {"lora_unet_conv_in.lora_down.weight": torch.ones(3, 4, 3, 3),
                      "lora_unet_conv_in.lora_up.weight": torch.ones(32, 3, 1, 1)})
    m = load_lora(path).modules["unet.conv_in"]
    assert m.alpha == 3.0 and m.scale == 1.0


def test_not_safetensors_truncated_and_garbage_header(tmp_path):
    txt = tmp_path / "notes.safetensors"
    txt.write_text("this is a text file, not weights\n")
    with pytest.raises(LoraFormatError, match="notes.safetensors: not a safetensors file"):
        load_lora(txt)
    good = save_lora(tmp_path / "good.safetensors", hand_lora())
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(LoraFormatError, match="cut.safetensors: truncated"):
        load_lora(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(struct.pack("<Q", 12) + b"{not json!!}" + b"\0" * 64)
    with pytest.raises(LoraFormatError, match="junk.safetensors: .*garbage header"):
        load_lora(junk)
    with pytest.raises(LoraFormatError, match="missing.safetensors: no such file"):
        load_lora(tmp_path / "missing.safetensors")


def test_keys_matching_no_module_are_listed_or_skipped(tmp_path):
    unet = build_components("sd15")["unet"]
    lf = hand_lora()
    lf.modules["unet.down_blocks.9.nothing"] = LoraWeights(torch.ones(2, 8), torch.ones(8, 2), 2.0,
                                                           key="lora_unet_down_blocks_9_nothing")
    path = save_lora(tmp_path / "extra.safetensors", lf)
    loaded = load_lora(path)
    weights = unet.state_dict()
    with pytest.raises(LoraFormatError,
                       match=r"extra.safetensors: 1 key\(s\) match no module"
                             r".*lora_unet_down_blocks_9_nothing"):
        match_modules(loaded, weights)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        comp, matched = match_modules(loaded, weights, strict=False)
    assert comp == "unet" and len(matched) == 2 and "lora_unet_down_blocks_9_nothing" in str(w[0].message)


def test_shape_that_does_not_fit_the_model_is_an_error(tmp_path):
    unet = build_components("sd15")["unet"]
    lf = LoraFile({"unet.conv_in": LoraWeights(torch.ones(2, 4, 3, 3), torch.ones(7, 2, 1, 1), 2.0)})
    with pytest.raises(LoraFormatError, match="conv_in.*\\(7, 4, 3, 3\\).*\\(32, 4, 3, 3\\)"):
        match_modules(load_lora(save_lora(tmp_path / "s.safetensors", lf)), unet.state_dict())


# ---------------------------------------------------------------------------- interoperability with diffusers


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_lora_lab_kohya_file_loads_in_diffusers_with_the_same_output(tmp_path, kind):
    models = lora_lab_lora(kind)
    path = save_lora(tmp_path / f"{kind}.safetensors", models)
    keys = load_lora(path).modules
    assert any(m.down.dim() == 4 for m in keys.values())  # LoCon convs went in too

    pipe = build_pipeline(kind)
    args, kw = unet_inputs(pipe, kind)
    before = unet_out(pipe.unet, args, kw)
    pipe.load_lora_weights(str(path))  # diffusers' own kohya reader

    ours = build_components(kind)  # same seed: the same base weights
    applied = apply_loras(ours["unet"], [(path, 1.0)], mode="merge")
    assert len(applied.weights) == sum(1 for n in keys if n.startswith("unet."))
    ref, got = unet_out(pipe.unet, args, kw), unet_out(ours["unet"], args, kw)
    assert (ref - before).abs().max() > 100 * TOL  # the LoRA changes the output a lot
    torch.testing.assert_close(got, ref, atol=TOL, rtol=TOL)
    # ... and it is the adapted model lora_lab trained, with its adapters unmerged
    torch.testing.assert_close(unet_out(models["unet"], args, kw), ref, atol=TOL, rtol=TOL)

    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    for te in [n for n in models if n.startswith("text_encoder")]:
        apply_loras(ours[te], [(path, 1.0)], component=te, mode="merge")
        ref = te_out(getattr(pipe, te), ids)
        torch.testing.assert_close(te_out(ours[te], ids), ref, atol=TOL, rtol=TOL)
        torch.testing.assert_close(te_out(models[te], ids), ref, atol=TOL, rtol=TOL)


def test_lora_lab_peft_file_loads_in_diffusers_with_the_same_output(tmp_path):
    """PEFT files carry per-module alphas (and ranks) in lora_adapter_metadata; diffusers honours them."""
    models = lora_lab_lora("sd15", seed=5)
    for i, (_, a) in enumerate(lora_modules(models["unet"])):
        a.alpha = (1.0, 2.0, 3.0)[i % 3]
    path = save_lora(tmp_path / "p.safetensors", models, format="peft")
    assert len({m.alpha for m in load_lora(path).modules.values()}) == 3
    pipe = build_pipeline("sd15")
    args, kw = unet_inputs(pipe, "sd15")
    pipe.load_lora_weights(str(path))
    torch.testing.assert_close(unet_out(models["unet"], args, kw), unet_out(pipe.unet, args, kw),
                               atol=TOL, rtol=TOL)
    # the text encoder's modules (`text_encoder.text_model.…` in the file) reach transformers 5's flat
    # CLIPTextModel
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    base = te_out(build_components("sd15")["text_encoder"], ids)
    ref = te_out(pipe.text_encoder, ids)
    assert (ref - base).abs().max() > 100 * TOL
    torch.testing.assert_close(te_out(models["text_encoder"], ids), ref, atol=TOL, rtol=TOL)


def test_lora_lab_dora_peft_file_loads_in_diffusers_with_the_same_output(tmp_path):
    """DoRA (linear and conv) as PEFT's lora_magnitude_vector: diffusers/PEFT compute what lora_lab does."""
    unet = build_components("sd15")["unet"]
    add_lora(unet, LoRAConfig(rank=RANK, alpha=ALPHA, use_dora=True,
                              targets=r".*attn1\.to_(q|k|v)|.*resnets\.0\.conv1"))
    randomize(unet, 7)
    with torch.no_grad():
        for _, a in lora_modules(unet):
            a.magnitude.mul_(1.2)  # m != ||W + s B A||
    path = save_lora(tmp_path / "dora.safetensors", unet, format="peft")
    pipe = build_pipeline("sd15")
    args, kw = unet_inputs(pipe, "sd15")
    pipe.load_lora_weights(str(path))
    ref = unet_out(pipe.unet, args, kw)
    torch.testing.assert_close(unet_out(unet, args, kw), ref, atol=TOL, rtol=TOL)
    ours = build_components("sd15")["unet"]
    apply_loras(ours, [(path, 1.0)], mode="merge")
    torch.testing.assert_close(unet_out(ours, args, kw), ref, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_transformer_peft_file_loads_in_diffusers_with_the_same_output(tmp_path, kind):
    from lora_lab.models import encode_prompts, predict

    model = build_components(kind)["transformer"]
    add_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA,
                               targets=r".*attn\.(to_q|to_k|to_v|add_q_proj|to_out\.0)|.*proj_mlp"))
    randomize(model, 8)
    path = save_lora(tmp_path / f"{kind}.safetensors", model, format="peft")
    assert load_lora(path).base == kind and all(n.startswith("transformer.") for n in load_lora(path).modules)
    pipe = build_pipeline(kind)
    pipe.load_lora_weights(str(path))
    embeds = encode_prompts(pipe, ["a photo of the digit seven"])
    latents, t = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([0.5])
    with torch.no_grad():
        ref = predict(kind, pipe.transformer, latents, t, embeds)
        torch.testing.assert_close(predict(kind, model, latents, t, embeds), ref, atol=TOL, rtol=TOL)
        ours = build_components(kind)["transformer"]
        apply_loras(ours, [(path, 1.0)], mode="merge")
        torch.testing.assert_close(predict(kind, ours, latents, t, embeds), ref, atol=TOL, rtol=TOL)


def test_file_saved_by_diffusers_loads_in_lora_lab_as_in_diffusers(tmp_path):
    from diffusers import StableDiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    src = build_pipeline("sd15")
    config = peft.LoraConfig(r=RANK, lora_alpha=6.0, init_lora_weights=False,
                             target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1"])
    src.unet.add_adapter(config)
    StableDiffusionPipeline.save_lora_weights(
        tmp_path, unet_lora_layers=get_peft_model_state_dict(src.unet),
        unet_lora_adapter_metadata=config.to_dict(), weight_name="diffusers.safetensors")
    path = tmp_path / "diffusers.safetensors"
    lf = load_lora(path)
    assert lf.format == "peft" and {m.alpha for m in lf.modules.values()} == {6.0}

    pipe = build_pipeline("sd15")
    args, kw = unet_inputs(pipe, "sd15")
    pipe.load_lora_weights(str(path))
    ref = unet_out(pipe.unet, args, kw)
    torch.testing.assert_close(unet_out(src.unet, args, kw), ref, atol=TOL, rtol=TOL)  # PEFT's own output
    ours = build_components("sd15")["unet"]
    apply_loras(ours, [(path, 1.0)], mode="merge")
    torch.testing.assert_close(unet_out(ours, args, kw), ref, atol=TOL, rtol=TOL)


def test_hand_written_kohya_locon_with_alpha_not_rank(tmp_path):
    """A file as kohya's LoCon writes it (alpha 2 != rank 4; fp16 and int alphas, as tools write them),
    checked against W + alpha/r * up @ down by hand. One alpha for both modules: diffusers 0.42's kohya
    reader mis-reads per-module alphas of attention projections (see notes/formats.md)."""
    g = torch.Generator().manual_seed(3)
    r, alpha = 4, 2
    conv_down, conv_up = (torch.randn(r, 32, 3, 3, generator=g) * 0.1,
                          torch.randn(32, r, 1, 1, generator=g) * 0.1)
    lin_down, lin_up = torch.randn(r, 64, generator=g) * 0.3, torch.randn(64, r, generator=g) * 0.3
    path = write_raw(tmp_path / "locon.safetensors", {
        "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight": conv_down,
        "lora_unet_down_blocks_0_resnets_0_conv1.lora_up.weight": conv_up,
        "lora_unet_down_blocks_0_resnets_0_conv1.alpha": torch.tensor(alpha, dtype=torch.float16),
        "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_q.lora_down.weight": lin_down,
        "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_q.lora_up.weight": lin_up,
        "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_q.alpha": torch.tensor(alpha),
    }, metadata={"ss_network_module": "networks.lora"})

    by_hand = build_components("sd15")["unet"]
    with torch.no_grad():
        conv = by_hand.down_blocks[0].resnets[0].conv1
        conv.weight += alpha / r * (conv_up.flatten(1) @ conv_down.flatten(1)).reshape(conv.weight.shape)
        q = by_hand.down_blocks[1].attentions[0].transformer_blocks[0].attn2.to_q
        q.weight += alpha / r * lin_up @ lin_down

    pipe = build_pipeline("sd15")
    args, kw = unet_inputs(pipe, "sd15")
    pipe.load_lora_weights(str(path))
    ours = build_components("sd15")["unet"]
    apply_loras(ours, [(path, 1.0)], mode="merge")
    want = unet_out(by_hand, args, kw)
    torch.testing.assert_close(unet_out(ours, args, kw), want, atol=TOL, rtol=TOL)
    torch.testing.assert_close(unet_out(pipe.unet, args, kw), want, atol=TOL, rtol=TOL)


def test_loaded_file_gives_back_lora_state_dict(tmp_path):
    """load_lora(save_lora(model)).state_dict("unet") is the model's lora_state_dict, bit for bit (DoRA
    included)."""
    from lora_lab.lora import lora_state_dict

    unet = build_components("sd15")["unet"]
    add_lora(unet, LoRAConfig(rank=RANK, alpha=ALPHA, use_dora=True, targets=UNET_TARGETS))
    randomize(unet, 3)
    want = lora_state_dict(unet)
    for fmt in ("kohya", "peft"):
        got = load_lora(save_lora(tmp_path / f"{fmt}.safetensors", unet, format=fmt)).state_dict("unet")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), fmt


def test_rslora_scale_survives_the_file(tmp_path):
    """rsLoRA's scale alpha / sqrt(r) reaches the file as alpha' = alpha sqrt(r): readers compute
    alpha' / r."""
    unet = build_components("sd15")["unet"]
    add_lora(unet, LoRAConfig(rank=4, alpha=2.0, use_rslora=True, targets=UNET_TARGETS))
    lf = load_lora(save_lora(tmp_path / "rs.safetensors", unet))
    assert [m.scale for m in lf.modules.values()] == pytest.approx([2.0 / math.sqrt(4)] * len(lf.modules))


def flux_bfl_file(path, names: dict[str, tuple[int, int]], seed: int = 11):
    """A kohya sd-scripts Flux file (BFL module names), random, alpha 2 at rank 4."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (out, inp) in names.items():
        tensors[f"lora_unet_{name}.lora_down.weight"] = torch.randn(RANK, inp, generator=g) * 0.2
        tensors[f"lora_unet_{name}.lora_up.weight"] = torch.randn(out, RANK, generator=g) * 0.2
        tensors[f"lora_unet_{name}.alpha"] = torch.tensor(ALPHA)
    return write_raw(path, tensors, metadata={"ss_base_model_version": "flux1"}), tensors


def test_flux_kohya_file_in_bfl_layout_loads_as_diffusers_loads_it(tmp_path):
    """kohya's Flux LoRAs name BFL's fused modules (img_attn_qkv, ...); diffusers' own converter is the
    reference."""
    from lora_lab.models import encode_prompts, predict

    d = 32  # the tiny Flux's hidden size
    path, _ = flux_bfl_file(tmp_path / "flux_bfl.safetensors", {
        "double_blocks_0_img_attn_qkv": (3 * d, d), "double_blocks_0_txt_attn_proj": (d, d),
        "double_blocks_0_img_mlp_0": (4 * d, d), "double_blocks_0_txt_mod_lin": (6 * d, d),
        "single_blocks_1_linear2": (d, 5 * d)})
    lf = load_lora(path)
    assert lf.base == "flux" and "transformer.transformer_blocks.0.attn.to_k" in lf.modules
    pipe = build_pipeline("flux")
    pipe.load_lora_weights(str(path))
    embeds = encode_prompts(pipe, ["a photo of the digit two"])
    latents, t = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([0.5])
    ours = build_components("flux")["transformer"]
    assert len(apply_loras(ours, [(path, 1.0)]).weights) == 7
    with torch.no_grad():
        ref = predict("flux", pipe.transformer, latents, t, embeds)
        torch.testing.assert_close(predict("flux", ours, latents, t, embeds), ref, atol=TOL, rtol=TOL)


def test_flux_bfl_fused_linear1_and_final_modulation_split_by_rows(tmp_path):
    """single_blocks linear1 = [q; k; v; mlp], final_layer adaLN (shift, scale) and img_in, checked by hand
    (diffusers' converter hard-codes the full-size Flux's widths for linear1, and drops img_in: its
    converted name lacks the "transformer." prefix, so 0.42 never applies it)."""
    d = 32
    path, raw = flux_bfl_file(tmp_path / "flux_bfl2.safetensors", {
        "single_blocks_0_linear1": (7 * d, d), "final_layer_adaLN_modulation_1": (2 * d, d),
        "img_in": (d, 16)})
    ours = build_components("flux")["transformer"]
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    apply_loras(ours, [(path, 1.0)])
    after = ours.state_dict()

    def fused(name):
        return (ALPHA / RANK * raw[f"lora_unet_{name}.lora_up.weight"]
                @ raw[f"lora_unet_{name}.lora_down.weight"])

    w1 = fused("single_blocks_0_linear1")
    blk = "single_transformer_blocks.0."
    for part, rows in (("attn.to_q", slice(0, d)), ("attn.to_k", slice(d, 2 * d)),
                       ("attn.to_v", slice(2 * d, 3 * d)), ("proj_mlp", slice(3 * d, 7 * d))):
        torch.testing.assert_close(after[blk + part + ".weight"] - before[blk + part + ".weight"], w1[rows])
    shift_scale = fused("final_layer_adaLN_modulation_1")
    torch.testing.assert_close(after["norm_out.linear.weight"] - before["norm_out.linear.weight"],
                               torch.cat([shift_scale[d:], shift_scale[:d]]))
    torch.testing.assert_close(after["x_embedder.weight"] - before["x_embedder.weight"], fused("img_in"))


# kohya's SDXL LoRAs name the LDM/sgm UNet's modules; the diffusers module each is, in a 2-resnet-per-block
# SDXL-like UNet (down: DownBlock2D, CrossAttnDownBlock2D; up: CrossAttnUpBlock2D, UpBlock2D).
SGM = {
    "input_blocks_0_0": "conv_in",
    "input_blocks_1_0_in_layers_2": "down_blocks.0.resnets.0.conv1",
    "input_blocks_3_0_op": "down_blocks.0.downsamplers.0.conv",
    "input_blocks_4_0_skip_connection": "down_blocks.1.resnets.0.conv_shortcut",
    "input_blocks_4_1_proj_in": "down_blocks.1.attentions.0.proj_in",
    "input_blocks_5_1_transformer_blocks_1_attn2_to_k":
        "down_blocks.1.attentions.1.transformer_blocks.1.attn2.to_k",
    "middle_block_1_transformer_blocks_0_attn1_to_out_0":
        "mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0",
    "middle_block_2_emb_layers_1": "mid_block.resnets.1.time_emb_proj",
    "output_blocks_1_1_transformer_blocks_0_ff_net_2":
        "up_blocks.0.attentions.1.transformer_blocks.0.ff.net.2",
    "output_blocks_2_2_conv": "up_blocks.0.upsamplers.0.conv",
    "output_blocks_5_0_out_layers_3": "up_blocks.1.resnets.2.conv2",
    "time_embed_0": "time_embedding.linear_1",
    "label_emb_0_2": "add_embedding.linear_2",
    "out_2": "conv_out",
}


def test_sdxl_kohya_file_in_sgm_layout_loads_as_diffusers_loads_it(tmp_path):
    from diffusers import UNet2DConditionModel

    from lora_lab.models import model_kind
    from lora_lab.models.builders import CONFIGS, pipeline_class

    def unet():
        torch.manual_seed(0)
        return UNet2DConditionModel(**{**CONFIGS["sdxl"]["unet"], "layers_per_block": 2}).eval()

    shapes = {k[: -len(".weight")]: v.shape for k, v in unet().state_dict().items()}
    g = torch.Generator().manual_seed(12)
    tensors = {}
    for sgm, module in SGM.items():
        assert diffusers_name(f"lora_unet_{sgm}", "sdxl") == f"unet.{module}"
        s = shapes[module]
        tensors[f"lora_unet_{sgm}.lora_down.weight"] = torch.randn(RANK, *s[1:], generator=g) * 0.2
        tensors[f"lora_unet_{sgm}.lora_up.weight"] = torch.randn(s[0], RANK, *[1] * (len(s) - 2),
                                                                 generator=g) * 0.2
        tensors[f"lora_unet_{sgm}.alpha"] = torch.tensor(ALPHA)
    path = write_raw(tmp_path / "sgm.safetensors", tensors)

    comps = build_components("sdxl")
    comps["unet"] = unet()
    pipe = pipeline_class(model_kind("sdxl"))(**comps)
    args, kw = unet_inputs(pipe, "sdxl")
    before = unet_out(pipe.unet, args, kw)
    pipe.load_lora_weights(str(path))  # diffusers maps sgm blocks with the UNet's config
    ours = unet()
    assert len(apply_loras(ours, [(path, 1.0)]).weights) == len(SGM)
    ref = unet_out(pipe.unet, args, kw)
    assert (ref - before).abs().max() > 100 * TOL
    torch.testing.assert_close(unet_out(ours, args, kw), ref, atol=TOL, rtol=TOL)


# ----------------------------------------------------------------------- SDXL UNet: sd-scripts' LDM/sgm names

# The published SDXL base 1.0 UNet config (stabilityai/stable-diffusion-xl-base-1.0, unet/config.json), the
# entries that are not diffusers' defaults; built on the meta device (no weights).
SDXL_BASE_UNET = {
    "sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": [320, 640, 1280], "attention_head_dim": [5, 10, 20], "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "transformer_layers_per_block": [1, 2, 10], "use_linear_projection": True,
    "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
}


def sd_scripts_sdxl_lora_names() -> set[str]:
    """The LoRA names sd-scripts gives its SDXL UNet, re-derived here from its rule and its model, not from
    lora_lab: networks/lora.py names every Linear / Conv2d inside a Transformer2DModel, ResnetBlock2D,
    Downsample2D or Upsample2D `lora_unet_` + module path with "_" for "."; library/sdxl_original_unet.py
    builds the tree: input_blocks = [conv], then per level (mult 1, 2, 4; transformer depth 0, 2, 10)
    2 x [ResnetBlock2D (+ its Transformer2DModel)] and a [Downsample2D] between levels;
    middle_block = [resnet, transformer(10), resnet]; output_blocks per level 4, 2, 1:
    3 x [resnet (+ transformer)], the third with an Upsample2D at levels 4 and 2."""
    # in_layers = [GroupNorm, SiLU, Conv2d], emb_layers = [SiLU, Linear], out_layers[3] = Conv2d
    def resnet(path, skip):
        return {f"{path}.{m}" for m in ("in_layers.2", "emb_layers.1", "out_layers.3")
                + (("skip_connection",) if skip else ())}

    # proj_in / proj_out Linear; BasicTransformerBlock: attn1, attn2, ff.net = [GEGLU, -, Linear]
    def transformer(path, depth):
        attn = [f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]
        return {f"{path}.proj_in", f"{path}.proj_out"} | {
            f"{path}.transformer_blocks.{d}.{m}" for d in range(depth)
            for m in attn + ["ff.net.0.proj", "ff.net.2"]}

    mults, depths, names, n = (1, 2, 4), (0, 2, 10), set(), 1
    for level, (mult, depth) in enumerate(zip(mults, depths)):
        for i in range(2):
            names |= resnet(f"input_blocks.{n}.0", skip=i == 0 and level > 0)
            names |= transformer(f"input_blocks.{n}.1", depth) if depth else set()
            n += 1
        if level < 2:
            names.add(f"input_blocks.{n}.0.op")
            n += 1
    names |= (resnet("middle_block.0", False) | transformer("middle_block.1", 10)
              | resnet("middle_block.2", False))
    n = 0
    for level in (2, 1, 0):
        for i in range(3):
            # the skip connection's channels are concatenated
            names |= resnet(f"output_blocks.{n}.0", skip=True)
            if depths[level]:
                names |= transformer(f"output_blocks.{n}.1", depths[level])
            if i == 2 and level > 0:
                names.add(f"output_blocks.{n}.2.conv")
            n += 1
    return {"lora_unet_" + name.replace(".", "_") for name in names}


def real_sdxl_unet():
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return UNet2DConditionModel.from_config(SDXL_BASE_UNET)


def test_sdxl_unet_kohya_names_are_the_ones_sd_scripts_gives_its_sdxl_unet():
    from lora_lab.formats import UnetLayout, unet_layout

    unet = real_sdxl_unet()
    layout = unet_layout(unet)
    assert layout == UnetLayout(2, (True, True, False))
    blocks = [n for n, m in unet.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))
              and n.startswith(("down_blocks.", "mid_block.", "up_blocks."))]
    ours = {kohya_name(f"unet.{n}", "sdxl", layout): n for n in blocks}
    want = sd_scripts_sdxl_lora_names()
    # 70 transformer blocks x 10 + 22 proj + 62 resnet + 4 sampler layers
    assert len(ours) == len(blocks) == len(want) == 788
    assert set(ours) == want  # sd-scripts finds every module, and each under one name
    assert all(diffusers_name(k, "sdxl", layout) == f"unet.{n}" for k, n in ours.items())
    # outside the blocks: the paths of sd-scripts' model (which trains no LoRA there; ComfyUI and diffusers
    # read them)
    top = {"conv_in": "input_blocks_0_0", "time_embedding.linear_1": "time_embed_0",
           "time_embedding.linear_2": "time_embed_2", "add_embedding.linear_1": "label_emb_0_0",
           "add_embedding.linear_2": "label_emb_0_2", "conv_out": "out_2"}
    assert ({n: kohya_name(f"unet.{n}", "sdxl", layout) for n in top}
            == {n: f"lora_unet_{v}" for n, v in top.items()})
    # without the structure: diffusers' names, as before
    assert (kohya_name("unet.down_blocks.1.attentions.0.proj_in", "sdxl")
            == "lora_unet_down_blocks_1_attentions_0_proj_in")


def test_diffusers_own_sgm_mapping_reads_lora_lab_names_for_the_real_sdxl_unet():
    """diffusers' kohya reader (its sgm block map with the UNet config's layers_per_block, its key conversion,
    then its PEFT names, as `load_lora_weights` chains them) turns every name lora_lab writes for the real
    SDXL UNet back into the module it came from."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_lora_to_diffusers,
        _maybe_map_sgm_blocks_to_diffusers,
    )
    from diffusers.utils import convert_unet_state_dict_to_peft

    from lora_lab.formats import unet_layout

    unet = real_sdxl_unet()
    layout = unet_layout(unet)
    modules = [n for n, m in unet.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    state = {}
    for n in modules:
        k = kohya_name(f"unet.{n}", "sdxl", layout)
        state.update({f"{k}.lora_down.weight": torch.zeros(1, 1), f"{k}.lora_up.weight": torch.zeros(1, 1),
                      f"{k}.alpha": torch.tensor(1.0)})
    assert not any("down_blocks" in k or "up_blocks" in k or "mid_block" in k for k in state)
    mapped = _maybe_map_sgm_blocks_to_diffusers(state, unet.config)
    converted, _ = _convert_non_diffusers_lora_to_diffusers(mapped)
    peft_keys = convert_unet_state_dict_to_peft({k.removeprefix("unet."): v for k, v in converted.items()})
    got = {k.removesuffix(".lora_A.weight") for k in peft_keys if k.endswith(".lora_A.weight")}
    assert got == set(modules)


def test_tiny_sdxl_file_has_ldm_names_and_every_spelling_loads_into_the_same_weights(tmp_path):
    """The shipped tiny SDXL (layers_per_block=1) gets LDM names numbered for its own structure (diffusers
    reads them: test_lora_lab_kohya_file_loads_in_diffusers_with_the_same_output); an old lora_lab file with
    diffusers names, and the same LDM file without lora_lab's metadata (as another tool would write it),
    merge identically."""
    from safetensors import safe_open

    from lora_lab.formats import UNET_LAYOUT_KEY

    models = lora_lab_lora("sdxl", seed=3)
    new = save_lora(tmp_path / "new.safetensors", models)
    with safe_open(str(new), "pt") as f:
        unet_keys = [k for k in f.keys() if k.startswith("lora_unet_")]  # noqa: SIM118
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    assert unet_keys and all(k.startswith(("lora_unet_input_blocks_", "lora_unet_middle_block_",
                                           "lora_unet_output_blocks_"))
                              for k in unet_keys)
    # down block 1, L = 1
    assert "lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in unet_keys
    # up block 0, its 2nd resnet
    assert "lora_unet_output_blocks_1_0_in_layers_2.lora_down.weight" in unet_keys
    assert json.loads(meta[UNET_LAYOUT_KEY]) == {"layers_per_block": 1, "up_attentions": [True, False]}

    with pytest.warns(UserWarning, match="structure is not known.*diffusers names"):
        old = save_lora(tmp_path / "old.safetensors", load_lora(new).state_dict(), base="sdxl")
    with safe_open(str(old), "pt") as f:
        assert any(k.startswith("lora_unet_down_blocks_1_attentions_0_") for k in f.keys())  # noqa: SIM118
    foreign = write_raw(tmp_path / "foreign.safetensors", tensors,
                        {"ss_base_model_version": "sdxl_base_v1-0"})

    merged = []
    for path in (new, old, foreign):
        unet = build_components("sdxl")["unet"]
        applied = apply_loras(unet, [(path, 1.0)], mode="merge")  # strict: every module matched
        assert len(applied.weights) == len(unet_keys) // 3
        merged.append(unet.state_dict())
    for other in merged[1:]:
        assert all(torch.equal(merged[0][k], other[k]) for k in merged[0])
    args, kw = unet_inputs(build_pipeline("sdxl"), "sdxl")
    unet = build_components("sdxl")["unet"]
    unet.load_state_dict(merged[0])
    torch.testing.assert_close(unet_out(unet, args, kw), unet_out(models["unet"], args, kw),
                               atol=TOL, rtol=TOL)


def test_ldm_names_need_a_known_structure_to_be_written(tmp_path):
    from lora_lab.formats import UnetLayout, unet_layout

    models = lora_lab_lora("sdxl")
    lf = load_lora(save_lora(tmp_path / "a.safetensors", models["unet"]))
    peft_file = save_lora(tmp_path / "p.safetensors", {"unet": models["unet"]}, format="peft")
    with pytest.warns(UserWarning, match="pass unet="):  # a PEFT file from elsewhere: no structure known
        save_lora(tmp_path / "b.safetensors", load_lora(peft_file).state_dict(), base="sdxl")
    layout = unet_layout(build_components("sdxl")["unet"])
    for unet in (layout, build_components("sdxl")["unet"]):
        b = load_lora(save_lora(tmp_path / "b.safetensors", load_lora(peft_file).state_dict(), base="sdxl",
                                unet=unet))
        assert {m.key for m in b.modules.values()} == {m.key for m in lf.modules.values()}
    with pytest.raises(LoraFormatError, match="unet=Linear: not a UNet"):
        save_lora(tmp_path / "c.safetensors", lf, unet=nn.Linear(2, 2))
    assert unet_layout(["down_blocks.0.resnets.0.conv1"]) is None  # no up / mid blocks: not the LDM structure
    assert UnetLayout.from_json("x", layout.to_json()) == layout
    with pytest.raises(LoraFormatError, match="x: must be"):
        UnetLayout.from_json("x", '{"layers_per_block": 0, "up_attentions": []}')
    # SD1.5 keeps diffusers' names (sd-scripts' SD1.5 UNet has diffusers' layout)
    sd15 = lora_lab_lora("sd15")
    assert all(m.key.startswith(("lora_unet_down_blocks", "lora_unet_mid_block", "lora_unet_up_blocks",
                                 "lora_te"))
               for m in load_lora(save_lora(tmp_path / "s.safetensors", sd15)).modules.values())


def test_alpha_pattern_keys_are_read_as_peft_reads_them_in_diffusers(tmp_path):
    """PEFT (and so diffusers' load_lora_weights) reads alpha_pattern keys as regexes, `(.*\\.)?(key)$`:
    `{"to_.": 8}` gives alpha 8 to every to_q, to_k and to_v and leaves to_out.0 at lora_alpha. lora_lab reads
    the file the same way (it read the key literally: alpha 2 everywhere, a 4x scale apart from diffusers)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    unet = build_components("sd15")["unet"]
    add_lora(unet, LoRAConfig(rank=RANK, alpha=ALPHA, targets=r".*attn[12]\.to_(q|k|v|out\.0)"))
    randomize(unet, 9)
    path = save_lora(tmp_path / "p.safetensors", unet, format="peft")
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    adapter = json.loads(meta["lora_adapter_metadata"])
    adapter.update({"unet.lora_alpha": 2.0, "unet.alpha_pattern": {"to_.": 8.0}})
    meta["lora_adapter_metadata"] = json.dumps(adapter)
    save_file(tensors, str(path), metadata=meta)
    alphas = {n: m.alpha for n, m in load_lora(path).modules.items()}
    assert {a for n, a in alphas.items() if not n.endswith("to_out.0")} == {8.0}
    assert {a for n, a in alphas.items() if n.endswith("to_out.0")} == {2.0}
    pipe = build_pipeline("sd15")
    args, kw = unet_inputs(pipe, "sd15")
    pipe.load_lora_weights(str(path))
    peft_scales = {n: next(iter(m.scaling.values())) for n, m in pipe.unet.named_modules()
                   if hasattr(m, "scaling") and m.scaling}
    assert {n: alphas["unet." + n] / RANK for n in peft_scales} == peft_scales
    ours = build_components("sd15")["unet"]
    apply_loras(ours, [(path, 1.0)], mode="merge")
    torch.testing.assert_close(unet_out(ours, args, kw), unet_out(pipe.unet, args, kw), atol=TOL, rtol=TOL)
