"""Stacking LoRA files: merge_loras (lazy, the seeds' LoRABackend) and apply_loras (merge | runtime).

References: the plain formula W + sum_i t_i alpha_i/r_i up_i @ down_i written out in the test, PEFT's
DoRA layer, and lora_lab's own LoRALinear/LoRAConv2d for DoRA at a strength.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lora_lab.formats import LoraFile, LoraFormatError, LoraWeights, save_lora
from lora_lab.lora import LoRAConv2d, LoRALinear, lora_modules
from lora_lab.merge import AppliedLoras, LoRAStack, apply_loras, load_merged, merge_loras

STRENGTHS = (0.8, 0.6)
TOL = 1e-5  # merged vs runtime: fp32 rounding only


def rand_module(g, out, inp, r, alpha, k=None, dora=False) -> LoraWeights:
    down = torch.randn((r, inp) if k is None else (r, inp, k, k), generator=g) * 0.3
    up = torch.randn((out, r) if k is None else (out, r, 1, 1), generator=g) * 0.3
    m = torch.rand((out, 1) if k is None else (out, 1, 1, 1), generator=g) + 0.5 if dora else None
    return LoraWeights(down, up, alpha, m)


def toy_base(g) -> dict[str, torch.Tensor]:
    return {"lin.weight": torch.randn(8, 6, generator=g), "lin.bias": torch.randn(8, generator=g),
            "conv.weight": torch.randn(8, 6, 3, 3, generator=g),
            "other.weight": torch.randn(5, 5, generator=g)}


def two_loras(g, dora=False) -> list[LoraFile]:
    a = LoraFile({"unet.lin": rand_module(g, 8, 6, 2, 1.0), "unet.conv": rand_module(g, 8, 6, 3, 6.0, k=3)})
    b = LoraFile({"unet.lin": rand_module(g, 8, 6, 4, 2.0, dora=dora)})
    return [a, b]


def test_merge_loras_is_the_formula():
    g = torch.Generator().manual_seed(0)
    base, (a, b) = toy_base(g), two_loras(g)
    merged = merge_loras(base, [(a, STRENGTHS[0]), (b, STRENGTHS[1])])
    la, lb = a.modules["unet.lin"], b.modules["unet.lin"]
    want_lin = base["lin.weight"] + 0.8 * (1.0 / 2) * la.up @ la.down + 0.6 * (2.0 / 4) * lb.up @ lb.down
    ca = a.modules["unet.conv"]
    want_conv = (base["conv.weight"]
                 + 0.8 * (6.0 / 3) * torch.einsum("or,rikl->oikl", ca.up[:, :, 0, 0], ca.down))
    torch.testing.assert_close(merged.get("lin.weight"), want_lin)
    torch.testing.assert_close(merged["conv.weight"], want_conv)
    assert merged["other.weight"] is base["other.weight"] and merged["lin.bias"] is base["lin.bias"]
    assert merged.patched == ["conv.weight", "lin.weight"] and set(merged) == set(base)


def test_merge_is_lazy_and_in_fp32_stored_in_the_base_dtype():
    g = torch.Generator().manual_seed(1)
    base, (a, _) = {k: v.to(torch.bfloat16) for k, v in toy_base(g).items()}, two_loras(g)
    merged = merge_loras(base, [(a, 1.0)])
    base["lin.weight"] = base["lin.weight"] * 2  # changed after merge_loras: the merge happens on access
    m = a.modules["unet.lin"]
    want = (base["lin.weight"].float() + 0.5 * m.up @ m.down).to(torch.bfloat16)
    got = merged.get("lin.weight")
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)



def test_a_float8_base_merges_and_its_overflow_is_an_error():
    """isfinite has no float8 kernel: a float8 base (as ComfyUI users keep SDXL/Flux) merges like any dtype,
    and a merged weight that overflows float8_e5m2 is refused, not a NotImplementedError (torch saturates
    e4m3fn at 448)."""
    g = torch.Generator().manual_seed(1)
    base, (a, _) = {k: v.to(torch.float8_e4m3fn) for k, v in toy_base(g).items()}, two_loras(g)
    m = a.modules["unet.lin"]
    got = merge_loras(base, [(a, 1.0)]).get("lin.weight")
    want = (base["lin.weight"].float() + 0.5 * m.up @ m.down).to(torch.float8_e4m3fn)
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got.float(), want.float())
    e5m2 = {k: v.float().to(torch.float8_e5m2) for k, v in base.items()}
    with pytest.raises(LoraFormatError, match="the merged 'lin.weight' overflows torch.float8_e5m2"):
        merge_loras(e5m2, [(a, 1e6)]).get("lin.weight")

def test_a_float8_e4m3_merge_that_torch_would_saturate_is_an_error():
    """float8_e4m3fn has no inf: torch turns any value beyond +-448 into +-448. A merged weight there is an
    error, as an overflow of any other dtype is (it was saved as 448, silently)."""
    g = torch.Generator().manual_seed(1)
    base, (a, _) = {k: v.to(torch.float8_e4m3fn) for k, v in toy_base(g).items()}, two_loras(g)
    with pytest.raises(LoraFormatError, match=r"the merged 'lin.weight' overflows torch.float8_e4m3fn "
                                              r"\(\|W \+ change\| reaches .*the largest .* is 448\)"):
        merge_loras(base, [(a, 1e4)]).get("lin.weight")
    assert merge_loras(base, [(a, 1.0)]).get("lin.weight").dtype == torch.float8_e4m3fn  # within: merged


@pytest.mark.parametrize(("dtype", "up", "refused"), [
    (torch.float16, 1e36, "overflows torch.float16"), (torch.bfloat16, 1e36, None),
    (torch.float32, 1e36, None), (torch.float32, 3e38, "the change to 'lin.weight' is not finite")])
def test_runtime_mode_holds_a_lora_to_the_bound_merge_uses(dtype, up, refused):
    """Huge but finite LoRA weights: where the merge refuses them (W + change beyond the base's dtype, or a
    change that overflows fp32), runtime mode now refuses them too (it applied them, and the forward gave
    inf/NaN); where the merge takes them, so does runtime mode. Nothing is wrapped when it refuses."""
    g = torch.Generator().manual_seed(2)
    big = LoraFile({"unet.lin": LoraWeights(torch.rand(2, 6, generator=g) + 1, torch.full((8, 2), up), 2.0)})
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(6, 8).to(dtype))
    if refused is None:
        merge_loras(dict(model.state_dict()), [(big, 1.0)]).get("lin.weight")
        apply_loras(model, [(big, 1.0)], mode="runtime")
        assert isinstance(model.lin, LoRALinear)
        return
    with pytest.raises(LoraFormatError, match=refused):
        merge_loras(dict(model.state_dict()), [(big, 1.0)]).get("lin.weight")
    with pytest.raises(LoraFormatError, match=refused):
        apply_loras(model, [(big, 1.0)], mode="runtime")
    assert type(model.lin) is nn.Linear


def test_dora_merge_matches_peft():
    peft = pytest.importorskip("peft")
    g = torch.Generator().manual_seed(2)
    model = nn.Sequential(nn.Linear(12, 10), nn.Conv2d(3, 10, 3, padding=1))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=3.0, use_dora=True,
                                                       target_modules=["0", "1"], init_lora_weights=False))
    x, img = torch.randn(5, 12, generator=g), torch.randn(2, 3, 6, 6, generator=g)
    mods = {}
    for i in ("0", "1"):
        layer = model.base_model.model[int(i)]
        with torch.no_grad():
            layer.lora_magnitude_vector["default"].weight.mul_(1.3)  # m != ||W + s B A||: a real DoRA change
        mods[f"unet.{i}"] = LoraWeights(layer.lora_A["default"].weight.detach(),
                                       layer.lora_B["default"].weight.detach(), 3.0,
                                       layer.lora_magnitude_vector["default"].weight.detach()
                                       .reshape(10, *[1] * (1 + 2 * (i == "1"))))
    base = {"0.weight": model.base_model.model[0].base_layer.weight.detach(),
            "1.weight": model.base_model.model[1].base_layer.weight.detach()}
    merged = merge_loras(base, [(LoraFile(mods), 1.0)])
    with torch.no_grad():
        torch.testing.assert_close(F.linear(x, merged["0.weight"], model.base_model.model[0].base_layer.bias),
                                   model.base_model.model[0](x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(F.conv2d(img, merged["1.weight"],
                                            model.base_model.model[1].base_layer.bias, padding=1),
                                   model.base_model.model[1](img), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strength", [0.0, 0.35, 1.0, 1.7])
def test_dora_at_a_strength_matches_lora_lab_adapters(strength):
    g = torch.Generator().manual_seed(3)
    lin, conv = nn.Linear(6, 8), nn.Conv2d(6, 8, 3)
    ml, mc = rand_module(g, 8, 6, 3, 2.0, dora=True), rand_module(g, 8, 6, 2, 5.0, k=3, dora=True)
    merged = merge_loras({"l.weight": lin.weight.detach(), "c.weight": conv.weight.detach()},
                         [(LoraFile({"unet.l": ml, "unet.c": mc}), strength)])
    for key, base, m, cls in (("l.weight", lin, ml, LoRALinear), ("c.weight", conv, mc, LoRAConv2d)):
        a = cls.from_weights(base, m.down, m.up, m.alpha, magnitude=m.dora_scale)
        a.strength = strength
        torch.testing.assert_close(merged[key], a.merged_weight(), atol=1e-6, rtol=1e-6)


def tiny_unet():
    pytest.importorskip("diffusers")
    from lora_lab.models import build_components

    return build_components("sd15")["unet"]


def unet_loras(unet, g) -> list[LoraFile]:
    """Two files over the same attention and conv modules (one with DoRA on a linear and a conv)."""
    shapes = {k[: -len(".weight")]: v.shape for k, v in unet.state_dict().items()
              if k.endswith(".weight") and ("attn1.to_" in k or "resnets.0.conv1" in k) and v.dim() in (2, 4)}
    files = []
    for i, (r, alpha) in enumerate(((4, 4.0), (2, 3.0))):
        mods = {}
        for name, s in shapes.items():
            k = s[2] if len(s) == 4 else None
            mods[f"unet.{name}"] = rand_module(g, s[0], s[1], r, alpha, k=k,
                                               dora=(i == 1 and name.endswith(("to_q", "conv1"))))
        files.append(LoraFile(mods))
    return files


def unet_call(unet, g):
    x, ctx = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 16, 32, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor([300]), ctx).sample


def test_merged_equals_runtime_and_strengths_change_at_runtime(tmp_path):
    g = torch.Generator().manual_seed(4)
    merged_unet, runtime_unet = tiny_unet(), tiny_unet()
    a, b = unet_loras(merged_unet, g)
    paths = [save_lora(tmp_path / "a.safetensors", a), save_lora(tmp_path / "b.safetensors", b)]
    specs = list(zip(paths, STRENGTHS))
    before = unet_call(merged_unet, torch.Generator().manual_seed(9))

    done = apply_loras(merged_unet, specs, mode="merge")
    live = apply_loras(runtime_unet, specs, mode="runtime")
    assert done.weights == live.weights and len(done.weights) == len(a.modules)
    stacks = [m for m in runtime_unet.modules() if isinstance(m, LoRAStack)]
    assert len(stacks) == len(a.modules) and len(list(lora_modules(runtime_unet))) == 2 * len(a.modules)
    want = unet_call(merged_unet, torch.Generator().manual_seed(9))
    assert (want - before).abs().max() > 1e-2
    torch.testing.assert_close(unet_call(runtime_unet, torch.Generator().manual_seed(9)), want,
                               atol=TOL, rtol=TOL)

    live.set_strength(0, 0.3)  # no reloading: the adapters' strength
    again = tiny_unet()
    apply_loras(again, [(paths[0], 0.3), (paths[1], STRENGTHS[1])], mode="merge")
    torch.testing.assert_close(unet_call(runtime_unet, torch.Generator().manual_seed(9)),
                               unet_call(again, torch.Generator().manual_seed(9)), atol=TOL, rtol=TOL)
    with pytest.raises(LoraFormatError, match="runtime"):
        done.set_strength(0, 0.5)


def test_build_a_unet_from_the_lazy_mapping(tmp_path):
    """The seeds' VarBuilder route: the UNet's weights come from merged.get(name), one at a time,
    here from a base safetensors file read memory-mapped."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    unet = tiny_unet()
    base_path = tmp_path / "unet.safetensors"
    save_file(unet.state_dict(), str(base_path))
    loras = [(f, s) for f, s in zip(unet_loras(unet, g), STRENGTHS)]
    merged = merge_loras(base_path, loras)
    built = load_merged(tiny_unet(), merged)
    applied = apply_loras(unet, loras, mode="merge")
    assert isinstance(applied, AppliedLoras)
    for k, v in unet.state_dict().items():
        assert torch.equal(built.state_dict()[k], v), k


def test_unmatched_modules_and_bad_arguments():
    g = torch.Generator().manual_seed(6)
    base, (a, _) = toy_base(g), two_loras(g)
    a.modules["unet.nowhere"] = rand_module(g, 4, 4, 2, 2.0)
    with pytest.raises(LoraFormatError, match="match no module.*unet.nowhere"):
        merge_loras(base, [(a, 1.0)])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        merged = merge_loras(base, [(a, 1.0)], strict=False)
    assert merged.patched == ["conv.weight", "lin.weight"] and "unet.nowhere" in str(w[0].message)
    with pytest.raises(LoraFormatError, match="list of"):
        merge_loras(base, (a, 1.0))
    with pytest.raises(LoraFormatError, match="mode"):
        apply_loras(nn.Linear(2, 2), [], mode="fused")


@pytest.mark.slow
def test_notebook_04_lora_files(run_notebook):
    data = run_notebook("04_lora_files", STEPS=2, SWEEP=[0.0, 1.0], STYLE_STEPS=40, RESIZE_RANKS=[4, 1],
                        ENERGIES=[0.9])
    assert data["passed"], data.get("error") or data["claims"]
    n = data["numbers"]
    assert n["modules_style"] == 32 and n["modules_detail"] == 48 and n["locon_modules"] == 16
    kept = [n["resize"][f"rank {k}"]["kept"] for k in (16, 4, 1)]  # the sd3 style LoRA resized
    assert kept[0] > 1 - 1e-9 and kept[0] > kept[1] > kept[2] > 0.5 and n["style_survives_down_to_rank"] == 1
    assert n["extract"]["layers"] == 38 and n["extract"]["numerical_ranks"] == [16]  # 1 of 39 never moved
    assert n["max_abs_merged_vs_runtime"] < 1e-5 and n["max_abs_diffusers_vs_lora_lab"] < 1e-4
    assert n["sweep_relative_change"][1] > n["sweep_relative_change"][0]
    assert not run_notebook.bare_results("04_lora_files")  # every cell shows only what it prints or draws


def test_a_linear_lora_fits_a_1x1_conv_and_back():
    """As ComfyUI reshapes: SD1.5's proj_in is a 1x1 conv, SDXL's a linear layer; one LoRA fits both."""
    g = torch.Generator().manual_seed(7)
    conv, lin = nn.Conv2d(6, 8, 1), nn.Linear(6, 8)
    lf = LoraFile({"unet.c": rand_module(g, 8, 6, 2, 3.0), "unet.l": rand_module(g, 8, 6, 2, 3.0, k=1)})
    model = nn.ModuleDict({"c": conv, "l": lin})
    merged = merge_loras(model.state_dict(), [(lf, 0.7)])
    m = lf.modules["unet.c"]
    torch.testing.assert_close(merged["c.weight"],
                               conv.weight + 0.7 * 1.5 * (m.up @ m.down)[:, :, None, None])
    x = torch.randn(3, 6, 5, 5, generator=g)
    apply_loras(model, [(lf, 0.7)], mode="runtime")
    with torch.no_grad():
        torch.testing.assert_close(model["c"](x), F.conv2d(x, merged["c.weight"], conv.bias),
                                   atol=1e-5, rtol=1e-5)
        xl = x[:, :, 0, 0]
        torch.testing.assert_close(model["l"](xl), F.linear(xl, merged["l.weight"], lin.bias),
                                   atol=1e-5, rtol=1e-5)
