"""Single-file bases of the newer families (chroma, flux2, qwen-image, z-image): each tiny transformer
written in the layout its published file has (BFL's for Chroma1-HD and flux2-dev, ComfyUI's for
z_image_turbo and qwen_image, with or without `model.diffusion_model.`), with its text encoder and VAE as
part files in their checkpoints' layouts; diffusers' own converters read the written files back to the
same state dict; `open_base` loads them to the same tensors, and `train --base FILE` to the same losses as
the diffusers folder; the family is detected at the real sizes; another family's file, a missing tensor
or a wrong shape is one line naming the file; ComfyUI's scaled fp8 weights are read times their scale."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_lab.diffusion import TrainConfig, TrainConfigError, train
from lora_lab.models import ModelLoadError, denoiser, encode_prompts, model_kind, predict
from lora_lab.models.bases import build_pipeline, open_base
from lora_lab.models.layouts import to_single_file
from lora_lab.models.loading import fill
from lora_lab.models.real import REAL_CONFIGS, build_real
from lora_lab.models.single_file import (
    _PARTS,
    DENOISER_LAYOUT,
    DENOISER_PREFIX,
    FileHeader,
    component_rules,
    detect,
)

KINDS = ("chroma", "flux2", "qwen-image", "z-image")
# the prefix of each published file's keys: none (BFL's, Comfy-Org's split files); z-image's written with
# ComfyUI's checkpoint prefix, so that both are read
PREFIX = {"chroma": "", "flux2": "", "qwen-image": "", "z-image": DENOISER_PREFIX}
REAL = {"chroma": "chroma1-hd", "flux2": "flux2-dev", "qwen-image": "qwen-image", "z-image": "z-image-turbo"}


def checkpoint_key(kind: str, name: str) -> str | None:
    """A text encoder's key as ComfyUI's file holds it (None: not in the file), where transformers 5 builds it
    under another name: Qwen2.5-VL in its original layout without lm_head (`model.`, `visual.`); Mistral 3's
    language model alone (`model.`, ComfyUI's Mistral3Small24B). (Qwen3 is written under `model.` by
    `_PARTS`.)"""
    if kind == "qwen-image":
        if name.startswith("lm_head."):
            return None
        if name.startswith("model.visual."):
            return name.removeprefix("model.")
        return name.replace("model.language_model.", "model.", 1)
    if kind == "flux2":
        if not name.startswith("model.language_model."):
            return None
        return name.replace("model.language_model.", "model.", 1)
    return name


def write_files(kind: str, pipe, folder: Path) -> tuple[Path, dict[str, str]]:
    """The transformer as its family's single file, and its parts: each text encoder in its checkpoint's
    layout, the VAE in the layout `_PARTS` reads (LDM for Flux.1's ae and FLUX.2's, diffusers' for
    Qwen-Image's)."""
    rules = component_rules(pipe.transformer, DENOISER_LAYOUT[kind], PREFIX[kind])
    path = folder / f"{kind}.safetensors"
    save_file(to_single_file(rules, pipe.transformer.state_dict()), path)
    parts = {}
    for part, (component, prefix, layout) in _PARTS[kind].items():
        module = getattr(pipe, component)
        tensors = to_single_file(component_rules(module, layout, prefix), module.state_dict())
        if component == "text_encoder":
            renamed = {k: checkpoint_key(kind, k) for k in tensors}
            tensors = {renamed[k]: v for k, v in tensors.items() if renamed[k] is not None}
        parts[part] = str(folder / f"{kind}-{part}.safetensors")
        save_file(tensors, parts[part])
    return path, parts


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families")
    out = {}
    for kind in KINDS:
        pipe = build_pipeline(kind, None, seed=0)
        out[kind] = (pipe, *write_files(kind, pipe, folder))
    return out


def _converted(kind: str, tensors: dict) -> dict:
    """diffusers' own reading of a single file (`diffusers.loaders.single_file_model`'s mapping of the
    class): Qwen-Image's file is its names as they are."""
    from diffusers.loaders import single_file_utils as su

    convert = {"chroma": su.convert_chroma_transformer_checkpoint_to_diffusers,
               "flux2": su.convert_flux2_transformer_checkpoint_to_diffusers,
               "z-image": su.convert_z_image_transformer_checkpoint_to_diffusers,
               "qwen-image": lambda sd: sd}[kind]
    return convert(dict(tensors))


@pytest.mark.parametrize("kind", ["flux2", "qwen-image", "z-image"])
def test_layout_agrees_with_diffusers_converter(files, kind):
    """The tiny file lora_lab writes is what diffusers' converter reads back to the model's state dict, tensor
    for tensor (Chroma's converter fixes the width at 3072: checked at the real size below)."""
    pipe, path, _ = files[kind]
    converted = _converted(kind, load_file(path))
    want = pipe.transformer.state_dict()
    assert set(converted) == set(want)
    assert all(torch.equal(converted[k], want[k]) for k in want)


@pytest.mark.parametrize("kind", KINDS)
def test_layout_agrees_with_diffusers_at_real_size(kind):
    """At the published size (meta tensors): diffusers' converter reads the names and shapes lora_lab writes
    to the model's own; and the header detects as the family's real variant."""
    with torch.device("meta"):
        model = build_real(REAL[kind], ["transformer"])["transformer"]
    rules = component_rules(model, DENOISER_LAYOUT[kind], DENOISER_PREFIX)
    tensors = to_single_file(rules, model.state_dict())
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k != "time_text_embed.mod_proj"}
    unprefixed = {k.removeprefix(DENOISER_PREFIX): v for k, v in tensors.items()}
    assert {k: tuple(v.shape) for k, v in _converted(kind, unprefixed).items()} == shapes
    header = FileHeader.__new__(FileHeader)
    header.path, header.shapes = Path(f"{kind}.safetensors"), {k: tuple(v.shape) for k, v in tensors.items()}
    found = detect(header)
    assert (found.kind, found.variant, found.prefix) == (model_kind(kind), REAL[kind], DENOISER_PREFIX)
    assert REAL_CONFIGS[found.variant]["transformer"][0] == model_kind(kind).denoiser


def test_qwen_image_vae_in_wan_names_agrees_with_diffusers_at_real_size(files, tmp_path):
    """Qwen-Image's VAE as Comfy-Org's qwen_image_vae.safetensors holds it (Wan 2.1's names): diffusers' Wan
    VAE converter reads the real-size key set lora_lab writes to the model's names and shapes (it fixes
    Wan's block indices, so not at the tiny size); the same VAE in diffusers' names loads too."""
    from diffusers.loaders import single_file_utils as su

    with torch.device("meta"):
        vae = build_real("qwen-image", ["vae"])["vae"]
    tensors = to_single_file(component_rules(vae, "wan_vae", ""), vae.state_dict())
    assert "decoder.upsamples.4.shortcut.weight" in tensors and "decoder.middle.1.to_qkv.weight" in tensors
    converted = su.convert_wan_vae_to_diffusers(dict(tensors))
    assert {k: tuple(v.shape) for k, v in converted.items()} == {
        k: tuple(v.shape) for k, v in vae.state_dict().items()}
    pipe, path, parts = files["qwen-image"]
    assert "encoder.conv1.weight" in load_file(parts["vae"])
    save_file(pipe.vae.state_dict(), tmp_path / "vae.safetensors")
    opened = open_base(model_kind("qwen-image"), path, torch.float32,
                       parts={**parts, "vae": str(tmp_path / "vae.safetensors")})
    assert all(torch.equal(v, opened.pipe.vae.state_dict()[k]) for k, v in pipe.vae.state_dict().items())


@pytest.mark.parametrize("kind", ["qwen-image", "flux2"])
def test_a_whole_vlm_text_encoder_in_transformers_names_loads_too(files, kind, tmp_path):
    """The text encoder as transformers saves it (vision tower and lm_head included) loads to every tensor."""
    pipe, path, parts = files[kind]
    te = tmp_path / "te.safetensors"
    save_file({k: v.clone() for k, v in pipe.text_encoder.state_dict().items()}, te)  # ties as copies
    opened = open_base(model_kind(kind), path, torch.float32,
                       parts={**parts, "text_encoder": str(te)})
    want, got = pipe.text_encoder.state_dict(), opened.pipe.text_encoder.state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("kind", KINDS)
def test_single_file_loads_the_same_tensors(files, kind):
    """`open_base` on the file and its parts: every component's tensors equal the pipeline's, the prompt
    embeddings are equal and the denoiser's output on the same input is the same."""
    pipe, path, parts = files[kind]
    opened = open_base(model_kind(kind), path, torch.float32, parts=parts)
    fill(denoiser(opened.pipe), opened.source, dtype=torch.float32, device="cpu")
    for component in ("transformer", "vae", "text_encoder"):
        want, got = getattr(pipe, component).state_dict(), getattr(opened.pipe, component).state_dict()
        if component == "text_encoder":  # the modules prompts never run, which ComfyUI's files leave out
            want = {k: v for k, v in want.items() if checkpoint_key(kind, k) is not None}
        assert set(want) == set(got), component
        assert all(torch.equal(want[k], got[k]) for k in want), component
    embeds = encode_prompts(opened.pipe, ["a digit seven"])
    assert torch.equal(embeds["prompt_embeds"], encode_prompts(pipe, ["a digit seven"])["prompt_embeds"])
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))  # the tiny bases' latents
    t = torch.tensor([0.5])
    # equal weights; views of a memory-mapped file at other alignments round some kernels differently (1 ulp)
    torch.testing.assert_close(predict(kind, opened.pipe.transformer, x, t, embeds),
                               predict(kind, pipe.transformer, x, t, embeds), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_single_file_trains_like_the_folder_load(files, kind, digits_folder, tmp_path):
    """`train --base FILE` with its parts gives the losses of `train --base FOLDER`, the diffusers folder of
    the pipeline the file was written from."""
    pipe, path, parts = files[kind]
    pipe.save_pretrained(tmp_path / "folder")
    common = dict(model=kind, dataset=str(digits_folder(count=2)), steps=2, rank=4, sample_steps=0,
                  device="cpu", progress=False)
    folder = train(TrainConfig(output=str(tmp_path / "a"), base=str(tmp_path / "folder"), **common))
    loaded = train(TrainConfig(output=str(tmp_path / "b"), base=str(path), **parts, **common))
    assert len(loaded.losses) == 2
    assert loaded.losses == pytest.approx(folder.losses, rel=1e-6, abs=0)


def test_another_family_or_a_broken_file_is_one_line(files, tmp_path):
    """A file of another family names what it is and the --model to use; a transformer file without its
    parts names the flag; a missing tensor and a wrong shape name the file."""
    _, flux2_path, flux2_parts = files["flux2"]
    with pytest.raises(TrainConfigError, match=r"is a flux2 checkpoint \(tiny\), not flux") as e:
        TrainConfig(model="flux", base=str(flux2_path))
    assert "\n" not in str(e.value)
    with pytest.raises(TrainConfigError, match="--clip-l: a qwen-image model has no such part"):
        TrainConfig(model="qwen-image", base=str(files["qwen-image"][1]), clip_l=str(flux2_path))
    vae = load_file(flux2_parts["vae"])  # BFL's FLUX.2 VAE: its quant convolutions inside encoder and decoder
    assert {"encoder.quant_conv.weight", "decoder.post_quant_conv.weight", "bn.running_var"} <= set(vae)
    no_statistics = tmp_path / "ae.safetensors"
    save_file({k: v for k, v in vae.items() if not k.startswith("bn.")}, no_statistics)
    with pytest.raises(ModelLoadError, match=r"--vae .*ae.safetensors: no bn.running_mean, bn.running_var: "
                       "not FLUX.2's VAE"):
        open_base(model_kind("flux2"), flux2_path, torch.float32,
                  parts={**flux2_parts, "vae": str(no_statistics)})
    _, chroma_path, chroma_parts = files["chroma"]  # Chroma in BFL's layout: no longer refused as a Flux
    assert detect(FileHeader(chroma_path)).kind is model_kind("chroma")
    with pytest.raises(ModelLoadError, match="--t5xxl FILE"):
        open_base(model_kind("chroma"), chroma_path, torch.float32, parts={**chroma_parts, "t5xxl": None})

    tensors = load_file(flux2_path)
    missing = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in tensors.items() if k != "double_blocks.0.img_attn.proj.weight"}, missing)
    opened = open_base(model_kind("flux2"), missing, torch.float32, parts=flux2_parts)
    with pytest.raises(ModelLoadError, match=r"1 missing, e.g. \['transformer_blocks.0.attn.to_out.0"):
        fill(denoiser(opened.pipe), opened.source, dtype=torch.float32, device="cpu")
    wrong = tmp_path / "wrong.safetensors"
    save_file({**tensors, "single_blocks.0.linear2.weight": torch.zeros(32, 7)}, wrong)
    opened = open_base(model_kind("flux2"), wrong, torch.float32, parts=flux2_parts)
    with pytest.raises(ModelLoadError, match=r"weights hold shape \(32, 7\), the model expects \(32, 128\)"):
        fill(denoiser(opened.pipe), opened.source, dtype=torch.float32, device="cpu")
    odd = tmp_path / "odd.safetensors"
    save_file({**tensors, "img_in.weight": torch.zeros(48, 16)}, odd)
    with pytest.raises(ModelLoadError, match=r"odd.safetensors: a flux2 checkpoint of a size lora_lab has no "
                       r"config for \(first layer 48 wide"):
        detect(FileHeader(odd))


@pytest.mark.slow  # a one-step run (~5 s)
def test_without_model_the_command_line_trains_the_files_family(files, digits_folder, tmp_path, capsys):
    """`lora-lab train --base FILE` without --model takes the family the file's keys show; with another
    --model named the mismatch is the one-line error."""
    import json

    from lora_lab.cli import main
    from lora_lab.models.single_file import PART_FLAGS

    _, path, parts = files["z-image"]
    flags = [x for part, file in parts.items() for x in (PART_FLAGS[part], file)]
    common = ["--dataset", str(digits_folder(count=2)), "--steps", "1", "--rank", "2", "--sample-steps", "0",
              "--device", "cpu", "--no-progress"]
    assert main(["train", "--base", str(path), *flags, *common, "--output", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model"] == "z-image"
    assert main(["train", "--model", "flux", "--base", str(path), *flags, *common,
                 "--output", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "is a z-image checkpoint (tiny), not flux: use --model z-image" in err


def test_scaled_fp8_weights_are_read_times_their_scale(files, tmp_path):
    """ComfyUI's scaled fp8 files: e4m3 weights with `scale_weight` (one per tensor) or `weight_scale` (one
    per row) beside them load as weight * scale; a block-wise scale is refused by name."""
    pipe, path, parts = files["flux2"]
    tensors = load_file(path)
    qkv, linear1 = "double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight"
    per_tensor = torch.tensor(0.01)
    per_row = torch.rand(tensors[linear1].shape[0]) * 0.01 + 0.001
    fp8 = dict(tensors)
    fp8[qkv] = (tensors[qkv] / per_tensor).to(torch.float8_e4m3fn)
    fp8["double_blocks.0.img_attn.qkv.scale_weight"] = per_tensor
    fp8[linear1] = (tensors[linear1] / per_row[:, None]).to(torch.float8_e4m3fn)
    fp8[linear1 + "_scale"] = per_row
    scaled = tmp_path / "fp8.safetensors"
    save_file(fp8, scaled)
    opened = open_base(model_kind("flux2"), scaled, torch.float32, parts=parts)
    model = fill(denoiser(opened.pipe), opened.source, dtype=torch.float32, device="cpu")
    want_qkv = fp8[qkv].float() * per_tensor
    attn = model.transformer_blocks[0].attn
    got_qkv = torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight])
    assert torch.equal(got_qkv, want_qkv)
    assert torch.equal(model.single_transformer_blocks[0].attn.to_qkv_mlp_proj.weight,
                       fp8[linear1].float() * per_row[:, None])
    assert (got_qkv - tensors[qkv]).abs().max() < 0.1 * tensors[qkv].abs().max()  # fp8's rounding only
    fp8[linear1 + "_scale"] = torch.ones(4, 2)
    save_file(fp8, scaled)
    opened = open_base(model_kind("flux2"), scaled, torch.float32, parts=parts)
    with pytest.raises(ModelLoadError, match=r"scales 'single_blocks.0.linear1.weight' .* by blocks"):
        fill(denoiser(opened.pipe), opened.source, dtype=torch.float32, device="cpu")


def test_a_real_size_file_without_its_tokenizer_cached_names_the_repository(monkeypatch):
    """Qwen's and Mistral's tokenizers are not shipped: a real-size file reads them from the Hugging Face
    cache, offline, and says which repository to fetch where the cache lacks it."""
    import transformers

    from lora_lab.models.single_file import tokenizer_for

    asked = []

    def offline(repo, **kwargs):
        asked.append((repo, kwargs))
        raise OSError("not in the cache")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(ModelLoadError, match=r"qwen3 tokenizer from the Hugging Face cache of "
                       r"Tongyi-MAI/Z-Image-Turbo.*hf download Tongyi-MAI/Z-Image-Turbo") as e:
        tokenizer_for("qwen3", "text_encoder", "z-image-turbo", model_kind("z-image"))
    assert "\n" not in str(e.value)
    assert asked == [("Tongyi-MAI/Z-Image-Turbo", {"subfolder": "tokenizer", "local_files_only": True})]
