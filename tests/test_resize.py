"""`lora-lab resize` and `lora-lab extract`: the exact truncated SVD (Eckart-Young), what they report,
files diffusers loads, and bad requests refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from lora_lab.cli import main
from lora_lab.formats import LoraFile, LoraWeights, load_lora, save_lora
from lora_lab.models import build_pipeline, model_kind
from lora_lab.models.layouts import to_single_file
from lora_lab.models.single_file import DENOISER_LAYOUT, DENOISER_PREFIX, component_rules
from lora_lab.resize import ResizeError, TensorSource, choose_rank, extract_lora, resize_lora
from lora_lab.resize import denoiser_source as source


def module(g, out, inp, r, alpha, conv=False, dora=False) -> LoraWeights:
    k = (3, 3) if conv else ()
    return LoraWeights(down=torch.randn(r, inp, *k, generator=g), up=torch.randn(out, r, *[1] * len(k),
                       generator=g), alpha=alpha, dora_scale=torch.rand(out, 1, generator=g) + 0.5 if dora
                       else None)


def lora_file(seed=0, dora=False) -> LoraFile:
    g = torch.Generator().manual_seed(seed)
    return LoraFile({"unet.a.to_q": module(g, 24, 16, 8, 4.0, dora=dora),
                     "unet.b.to_k": module(g, 16, 40, 8, 8.0, dora=dora),
                     "unet.c.conv": module(g, 12, 6, 6, 3.0, conv=True)}, format="kohya")


def truncated(delta: torch.Tensor, k: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(delta.double().reshape(delta.shape[0], -1), full_matrices=False)
    return (u[:, :k] * s[:k] @ vh[:k]).reshape(delta.shape)


@pytest.mark.parametrize("rank", [1, 3, 8])
def test_resize_is_the_truncated_svd_of_the_change(rank):
    lf = lora_file()
    out, report = resize_lora(lf, rank=rank)
    for name, m in lf.modules.items():
        got, want = out.modules[name].delta().double(), truncated(m.delta(), min(rank, m.rank))
        assert out.modules[name].rank == min(rank, m.rank)
        assert out.modules[name].alpha == m.alpha  # the factors absorb the scale
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    layer = {r.name: r for r in report.layers}["unet.a.to_q"]
    s = torch.linalg.svdvals(lf.modules["unet.a.to_q"].delta().double())
    assert layer.kept == pytest.approx(float((s[:rank] ** 2).sum() / (s ** 2).sum()), rel=1e-6)
    assert (layer.probe_error == 0) == (rank >= 8) and 0 <= layer.probe_error < 1


def test_no_other_rank_k_lora_is_closer():
    """Eckart-Young: the cut is at least as close to D in Frobenius norm as any other rank-k product."""
    m = lora_file().modules["unet.b.to_k"]
    d = m.delta().double()
    best = (resize_lora(LoraFile({"unet.x": m}), rank=3)[0].modules["unet.x"].delta().double() - d).norm()
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        other = truncated(d + 0.3 * torch.randn(d.shape, generator=g, dtype=torch.float64), 3)
        assert (other - d).norm() >= best - 1e-9


def test_energy_chooses_the_fewest_ranks_per_layer():
    s = torch.tensor([4.0, 2.0, 1.0, 0.5])  # squared: 16, 4, 1, 0.25 of 21.25: shares .753, .941, .988, 1
    assert [choose_rank(s, None, e) for e in (0.5, 0.76, 0.94, 0.95, 0.99)] == [1, 2, 2, 3, 4]
    assert choose_rank(s, 2, 0.99) == 2 and choose_rank(s, 9, None) == 4
    assert choose_rank(torch.zeros(8), None, 0.9) == 1  # no change: one rank, not all 8 of zeros
    out, report = resize_lora(lora_file(), energy=0.9)
    assert all(r.kept >= 0.9 for r in report.layers)
    assert report.params < report.params_from


def test_dora_keeps_its_magnitude_and_peft_stays_peft(tmp_path):
    lf = lora_file(dora=True)
    src = save_lora(tmp_path / "d.safetensors", lf, "peft", base="sd15")
    assert main(["resize", str(src), str(tmp_path / "r.safetensors"), "--rank", "2",
                 "--report", str(tmp_path / "r.json")]) == 0
    back = load_lora(tmp_path / "r.safetensors")
    assert back.format == "peft" and {m.rank for m in back.modules.values()} == {2}
    torch.testing.assert_close(back.modules["unet.a.to_q"].dora_scale, lf.modules["unet.a.to_q"].dora_scale)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["rank"] == 2 and len(report["layers"]) == 3
    assert "kept" in json.loads(back.metadata["lora_lab.lowrank"])


@pytest.mark.filterwarnings("ignore:.*different alphas")
def test_bad_requests_are_one_line_errors(tmp_path, capsys):
    src = save_lora(tmp_path / "l.safetensors", lora_file(), base="sd15")
    dst = str(tmp_path / "o.safetensors")
    for args in ([], ["--rank", "0"], ["--energy", "1.5"], ["--energy", "nan"]):
        assert main(["resize", str(src), dst, *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("rank" in err or "energy" in err)
    assert main(["resize", str(src), str(src), "--rank", "1"]) == 2  # the input itself, without --overwrite
    assert not (tmp_path / "o.safetensors").exists()
    with pytest.raises(ResizeError, match="LoKr/LoHa"):
        resize_lora(LoraFile({}, format="lycoris"), rank=2)


# ----------------------------------------------------------------------------- extract


def planted(unet, rank, seed=3):
    """The UNet's state with a rank-`rank` change planted in a few layers (a linear, an attention output, a
    3x3 conv): {name: change}."""
    g = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in unet.state_dict().items()}
    changes = {}
    for name in ("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight",
                 "up_blocks.0.attentions.0.proj_out.weight", "up_blocks.0.resnets.0.conv1.weight"):
        w = state[name]
        flat = torch.randn(w.shape[0], rank, generator=g) @ torch.randn(rank, w[0].numel(), generator=g)
        changes[name] = 0.05 * flat.reshape(w.shape)
        state[name] = w + changes[name]
    return state, changes


def test_extract_recovers_a_planted_low_rank_change_and_diffusers_loads_it(tmp_path):
    pipe = build_pipeline("sd15", None, seed=0)
    base = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    state, changes = planted(pipe.unet, rank=2)
    save_file(state, tmp_path / "tuned.safetensors")
    save_file(base, tmp_path / "base.safetensors")
    dst = tmp_path / "x.safetensors"
    assert main(["extract", str(tmp_path / "tuned.safetensors"), str(tmp_path / "base.safetensors"), str(dst),
                 "--model", "sd15", "--rank", "4"]) == 0
    lf = load_lora(dst)
    assert set(lf.modules) == {"unet." + n.removesuffix(".weight") for n in changes}
    for name, change in changes.items():
        m = lf.modules["unet." + name.removesuffix(".weight")]
        assert m.rank == 2  # numerically rank 2: the cut at 4 keeps 2
        torch.testing.assert_close(m.delta(), change, atol=1e-6, rtol=1e-5)

    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    ctx = torch.randn(1, 7, pipe.unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(1))
    pipe.unet.load_state_dict(state)
    want = pipe.unet(x, 10, ctx).sample
    pipe.unet.load_state_dict(base)
    pipe.load_lora_weights(str(dst))  # diffusers' own kohya reader
    torch.testing.assert_close(pipe.unet(x, 10, ctx).sample, want, atol=1e-4, rtol=1e-4)


def test_extract_of_a_full_rank_change_reports_its_error(tmp_path):
    pipe = build_pipeline("sd15", None, seed=0)
    base = pipe.unet.state_dict()
    name = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    g = torch.Generator().manual_seed(0)
    tuned = {**base, name: base[name] + 0.01 * torch.randn(base[name].shape, generator=g)}
    lf, report = extract_lora(TensorSource(tuned), TensorSource(base), "unet", rank=2)
    (layer,) = report.layers
    s = torch.linalg.svdvals((tuned[name] - base[name]).double())
    assert layer.rank_from == len(s) and layer.rank == 2
    assert layer.kept == pytest.approx(float((s[:2] ** 2).sum() / (s ** 2).sum()), rel=1e-6)
    assert 0.5 < layer.frobenius_error < 1 and 0.5 < layer.probe_error < 1
    with pytest.raises(ResizeError, match="same weights"):
        extract_lora(TensorSource(base), TensorSource(base), "unet", rank=2)


@pytest.mark.parametrize("form", ["folder", "single_file"])
def test_extract_reads_diffusers_folders_and_single_files(tmp_path, form):
    kind = "sdxl"
    pipe = build_pipeline(kind, None, seed=0)
    base = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    state, changes = planted(pipe.unet, rank=1)
    paths = []
    for which, st in (("tuned", state), ("base", base)):
        pipe.unet.load_state_dict(st)
        if form == "folder":
            pipe.save_pretrained(tmp_path / which, safe_serialization=True)
            paths.append(tmp_path / which)
        else:
            rules = component_rules(pipe.unet, DENOISER_LAYOUT[kind], DENOISER_PREFIX)
            save_file(to_single_file(rules, pipe.unet.state_dict()), tmp_path / f"{which}.safetensors")
            paths.append(tmp_path / f"{which}.safetensors")
    weights, model = source(paths[0], model_kind(kind))
    assert model is not None  # the UNet's structure: sd-scripts' LDM names in the file
    dst = tmp_path / "x.safetensors"
    assert main(["extract", *map(str, paths), str(dst), "--model", kind, "--energy", "0.999"]) == 0
    lf = load_lora(dst)
    assert {m.rank for m in lf.modules.values()} == {1} and len(lf.modules) == len(changes)
    for name, change in changes.items():
        torch.testing.assert_close(lf.modules["unet." + name.removesuffix(".weight")].delta(), change,
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("given, named", [("flux2", "chroma"), ("qwen-image", "sd3"),
                                          ("z-image", "qwen-image"), ("sdxl", "sd15")])
def test_extract_refuses_weights_of_another_family(tmp_path, capsys, given, named):
    """A denoiser of `given` (a diffusers-named file, and its pipeline folder) extracted with `--model named`
    is refused in one line naming the file, before any SVD: before the fix it wrote a LoRA labelled `named`
    from `given`'s weights."""
    from pathlib import Path

    folder = Path(__file__).parents[1] / "data" / "base" / given
    component = model_kind(given).component
    file = folder / component / "diffusion_pytorch_model.safetensors"
    for path in (file, folder):
        with pytest.raises(ResizeError, match=f"not a {named} {model_kind(named).component}: "):
            source(path, model_kind(named))
    dst = tmp_path / "x.safetensors"
    assert main(["extract", str(file), str(file), str(dst), "--model", named, "--rank", "2"]) == 2
    err = capsys.readouterr().err
    assert str(file) in err and "give the --model" in err and len(err.strip().splitlines()) == 1
    assert not dst.exists()
    assert source(file, model_kind(given))[0].keys()  # its own kind still reads it
