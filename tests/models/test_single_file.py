"""Single-file checkpoints offline: tiny checkpoints in the real layouts (LDM for SD1.5/SDXL, SD3.5's, BFL's
Flux transformer with its parts as separate files) load through `open_base` to the same tensors as the
pipeline they were written from, train to the same losses, and agree with diffusers' own converters; the
family is read from the keys of real files' headers; a family mismatch is one line and leaves nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lora_lab.diffusion import TrainConfig, TrainConfigError, train
from lora_lab.models import ModelLoadError, denoiser, model_kind, shipped_base
from lora_lab.models.bases import build_pipeline, open_base
from lora_lab.models.layouts import to_single_file
from lora_lab.models.loading import fill
from lora_lab.models.single_file import _PARTS, DENOISER_LAYOUT, DENOISER_PREFIX, component_rules, detect
from lora_lab.models.tokenizers import real_clip_tokenizer, real_t5_tokenizer

HEADERS = Path(__file__).parents[1] / "data" / "single_file_headers.json"


def write_single_file(kind: str, pipe, folder: Path) -> tuple[Path, dict[str, str]]:
    """`pipe` as a single-file checkpoint in its family's layout: SD1.5/SDXL/SD3 all in one file; Flux's
    transformer in BFL's names (no prefix, as flux1-dev.safetensors) with CLIP-L, T5 and the VAE as files."""
    spec = model_kind(kind)
    main, parts = {}, {}
    for comp, prefix, layout, part in [(spec.component, DENOISER_PREFIX, DENOISER_LAYOUT[kind], None),
                                       *[(c, pre, lay, p) for p, (c, pre, lay) in _PARTS[kind].items()]]:
        separate = kind == "flux"
        rules = component_rules(getattr(pipe, comp), layout, "" if separate else prefix)
        tensors = to_single_file(rules, getattr(pipe, comp).state_dict())
        if separate and part is not None:
            parts[part] = str(folder / f"{part}.safetensors")
            save_file(tensors, parts[part])
        else:
            main.update(tensors)
    save_file(main, folder / f"{kind}.safetensors")
    return folder / f"{kind}.safetensors", parts


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("single")
    out = {}
    for kind in ("sd15", "sdxl", "sd3", "flux"):
        pipe = build_pipeline(kind, None, seed=0)
        out[kind] = (pipe, *write_single_file(kind, pipe, folder))
    return out


@pytest.mark.parametrize("kind", ["sd15", "sdxl", "sd3", "flux"])
def test_single_file_loads_the_same_tensors(tiny_files, kind):
    pipe, path, parts = tiny_files[kind]
    if kind == "flux":
        assert not any(k.startswith("model.") for k in json.loads(path.read_bytes()[8:8 + int.from_bytes(
            path.read_bytes()[:8], "little")]))  # BFL's names, as flux1-dev.safetensors
    opened = open_base(model_kind(kind), path, torch.float32, parts=parts)
    fill(denoiser(opened.pipe), opened.source, dtype=torch.float32, device="cpu")
    for comp in [model_kind(kind).component, "vae", *[e.component for e in model_kind(kind).text_encoders]]:
        want, got = getattr(pipe, comp).state_dict(), getattr(opened.pipe, comp).state_dict()
        assert set(want) == set(got), comp
        assert all(torch.equal(want[k], got[k]) for k in want), comp
    if kind == "flux":  # the transformer-only file needs its parts: the error names the flag
        with pytest.raises(ModelLoadError, match="--t5xxl"):
            open_base(model_kind(kind), path, torch.float32, parts={**parts, "t5xxl": None})


def test_ldm_and_sd3_layouts_agree_with_diffusers_converters(tiny_files):
    """The layouts are diffusers' own: its single-file converters read the tiny files to the same tensors."""
    from diffusers.loaders import single_file_utils as su

    def same(converted, module, strip=""):
        want = {k.removeprefix(strip): v for k, v in module.state_dict().items()}
        for k, v in converted.items():
            k = k.removeprefix("text_model.") if strip == "text_model." else k
            assert torch.equal(want[k], v.reshape(want[k].shape)), k
        return len(converted)

    for kind in ("sd15", "sdxl"):
        pipe, path, _ = tiny_files[kind]
        from safetensors.torch import load_file

        ckpt = load_file(path)
        assert same(su.convert_ldm_unet_checkpoint(dict(ckpt), dict(pipe.unet.config)), pipe.unet) == len(
            pipe.unet.state_dict())
        assert same(su.convert_ldm_vae_checkpoint(dict(ckpt), dict(pipe.vae.config)), pipe.vae) == len(
            pipe.vae.state_dict())
        assert same(su.convert_ldm_clip_checkpoint(dict(ckpt)), pipe.text_encoder, "text_model.") >= 35
    te2 = tiny_files["sdxl"][0].text_encoder_2
    converted = su.convert_open_clip_checkpoint(te2, dict(load_file(tiny_files["sdxl"][1])),
                                                prefix="conditioner.embedders.1.model.")
    assert same(converted, te2) == len(te2.state_dict())
    pipe, path, _ = tiny_files["sd3"]
    ckpt = {k: v for k, v in load_file(path).items() if k.startswith(DENOISER_PREFIX)}
    assert same(su.convert_sd3_transformer_checkpoint_to_diffusers(ckpt), pipe.transformer) == len(
        pipe.transformer.state_dict())


def test_flux_layout_agrees_with_diffusers_at_real_size():
    """diffusers' Flux converter fixes the width at 3072, so it is checked at the real size on the meta
    device: the BFL names and shapes lora_lab writes are the ones it reads, to the same names and shapes."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders import single_file_utils as su

    from lora_lab.models.real import FLUX_DEV

    with torch.device("meta"):
        model = FluxTransformer2DModel(**FLUX_DEV)
    rules = component_rules(model, "flux", "")
    bfl = to_single_file(rules, {k: v for k, v in model.state_dict().items()})
    converted = su.convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    assert {k: tuple(v.shape) for k, v in converted.items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_family_detected_from_real_headers():
    """Key samples of the real files' headers (public names and shapes) give each family and variant."""
    from lora_lab.models.single_file import FileHeader

    want = {"sd_v1-5-pruned-emaonly": ("sd15", "sd15"), "sd_xl_base_1.0": ("sdxl", "sdxl"),
            "sd3.5_large": ("sd3", "sd35-large"), "sd3.5_medium": ("sd3", "sd35-medium"),
            "flux1-dev": ("flux", "flux-dev")}
    headers = json.loads(HEADERS.read_text())
    for name, (kind, variant) in want.items():
        header = FileHeader.__new__(FileHeader)
        header.path, header.shapes = Path(name), {k: tuple(s) for k, s in headers[name].items()}
        found = detect(header)
        assert (found.kind, found.variant) == (model_kind(kind), variant), name
    header.shapes = {k: tuple(s) for k, s in headers["flux1-schnell"].items()}
    with pytest.raises(ModelLoadError, match="schnell"):
        detect(header)
    # SD3 Medium 3.0 (sd3_medium.safetensors): SD3.5 Medium's width, without its dual attention (attn2) and
    # with 192 x 192 positions (diffusers tells the two apart by pos_embed: 36864 vs 147456)
    header.path = Path("sd3_medium.safetensors")
    header.shapes = {k: tuple(s) for k, s in headers["sd3.5_medium"].items() if ".attn2." not in k}
    header.shapes["model.diffusion_model.pos_embed"] = (1, 36864, 1536)
    with pytest.raises(ModelLoadError, match=r"sd3_medium.safetensors: a Stable Diffusion 3 Medium \(3.0\)"
                       ) as e:
        detect(header)
    assert "\n" not in str(e.value)


def test_without_a_model_the_base_names_it(tiny_files, tmp_path):
    """TrainConfig without `model`: the family its base names (a single file's keys, a pipeline folder's
    model_index.json, a real model's kind), sdxl without a base; a file lora_lab does not know is the
    base's one-line error."""
    assert TrainConfig(base=str(tiny_files["sd15"][1])).model == "sd15"
    assert TrainConfig(base=str(shipped_base("sd3"))).model == "sd3"
    assert TrainConfig(base="real:flux-dev").model == "flux"
    assert TrainConfig().model == "sdxl" and TrainConfig(model="sd15").model == "sd15"
    other = tmp_path / "other.safetensors"
    save_file({"foo.weight": torch.zeros(2)}, other)
    with pytest.raises(TrainConfigError, match=r"TrainConfig.base=.*other.safetensors.*not an SD1.5") as e:
        TrainConfig(base=str(other))
    assert "\n" not in str(e.value)


def test_mismatch_is_one_line_and_leaves_no_output(tiny_files, tmp_path):
    _, path, _ = tiny_files["sdxl"]
    with pytest.raises(TrainConfigError, match="is a sdxl checkpoint") as e:
        TrainConfig(model="sd15", base=str(path))
    assert "\n" not in str(e.value)
    with pytest.raises(TrainConfigError, match="clip_l"):
        TrainConfig(model="flux", clip_l=str(path))  # a part without a single-file base
    sdxl_folder = shipped_base("sdxl")  # a diffusers folder's family, from its model_index.json
    with pytest.raises(TrainConfigError, match="is a sdxl pipeline, not sd15"):
        TrainConfig(model="sd15", base=str(sdxl_folder))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "lora_lab.cli", "train", "--model", "sd15", "--base",
                           str(path), "--output", str(out), "--steps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and not out.exists()
    assert "is a sdxl checkpoint" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", ["sd15", "sdxl", "sd3", "flux"])
def test_single_file_trains_like_the_folder_load(tiny_files, kind, digits_folder, tmp_path):
    """`train --base FILE` (Flux: with --clip-l, --t5xxl, --vae) gives the losses of `train --base FOLDER`,
    the diffusers folder of the pipeline the file was written from. (Not the shipped tiny folders: their
    configs differ from lora_lab's tiny configs, e.g. a fitted VAE scaling factor, and a single file holds
    no config: it gets lora_lab's config of its detected size.)"""
    pipe, path, parts = tiny_files[kind]
    pipe.save_pretrained(tmp_path / "folder")
    common = dict(model=kind, dataset=str(digits_folder(count=2)), steps=2, rank=4, sample_steps=0,
                  device="cpu", progress=False)
    folder = train(TrainConfig(output=str(tmp_path / "a"), base=str(tmp_path / "folder"), **common))
    loaded = train(TrainConfig(output=str(tmp_path / "b"), base=str(path), **parts, **common))
    # the cached latents, embeddings and denoiser weights are bitwise equal; the weights are views of two
    # memory-mapped files at other alignments, which at batch 1 round some kernels differently (1 ulp)
    assert loaded.losses == pytest.approx(folder.losses, rel=1e-6, abs=0)


def test_real_clip_tokenizer_offline():
    """CLIP's BPE vocabulary from open_clip's file: 49408 tokens, the known ids of CLIP-L's tokenizer."""
    tok = real_clip_tokenizer()
    assert len(tok) == 49408
    assert tok("a photo of a cat")["input_ids"] == [49406, 320, 1125, 539, 320, 2368, 49407]


def test_real_t5_tokenizer_offline():
    """T5's vocabulary shipped (stable-diffusion.cpp's tokenizer JSON): 32100 tokens, the ids transformers'
    T5 tests expect of t5-base's tokenizer (the same sentencepiece vocabulary as T5 v1.1's), padded to the
    length with <pad> (0) after </s> (1)."""
    tok = real_t5_tokenizer(8)
    assert len(tok) == 32100
    ids = tok("A long paragraph for summarization.")["input_ids"]
    assert ids == [71, 307, 8986, 21, 4505, 1635, 1707, 5, 1]
    assert tok("a cat", padding="max_length", truncation=True)["input_ids"] == [3, 9, 1712, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_an_integer_weight_in_a_single_file_base_is_refused_naming_file_and_tensor(tiny_files, tmp_path,
                                                                                   capsys, dtype):
    """Cast to the base dtype, an int32 weight would be trained on as numbers: refused as a LoRA file's is
    (`fileio.weight_dtype_problem`), exit 2, nothing written."""
    from safetensors.torch import load_file

    from lora_lab.cli import main as cli_main

    _, path, _ = tiny_files["sd15"]
    tensors = load_file(str(path))
    key = next(k for k in sorted(tensors) if k.startswith(DENOISER_PREFIX) and k.endswith("to_q.weight"))
    tensors[key] = tensors[key].to(dtype)
    bad = tmp_path / "int.safetensors"
    save_file(tensors, bad)
    out = tmp_path / "run"
    assert cli_main(["train", "--model", "sd15", "--base", str(bad), "--output", str(out), "--steps", "1",
                     "--sample-steps", "0"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("lora-lab: error: ") and f"{bad}: tensor '{key}' has dtype {dtype}" in err
    assert not out.exists()
