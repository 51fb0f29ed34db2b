"""models/builders.py: the tiny configs build the real diffusers pipelines, `predict` feeds the
denoiser exactly what the pipeline feeds it, and a saved pipeline loads back from its folder."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lora_lab import models as M
from lora_lab.models import KINDS, ModelLoadError, model_kind
from lora_lab.models.inputs import sdxl_time_ids

SEED = 3
PROMPTS = ["a digit three", "a handwritten digit seven"]
SIZE = M.RESOLUTION  # pixels; latents are half as wide


def _call(pipe, kind, embeds, steps=2, **kw):
    extra = {"max_sequence_length": M.TEXT_LEN} if kind in ("sd3", "flux") else {}
    if (inputs := model_kind(kind).pipeline_inputs) is not None:  # z-image: lists, its guidance_scale
        embeds, kw = {}, {**kw, **inputs(embeds, kw.get("guidance_scale", 1.0))}
    return pipe(**embeds, num_inference_steps=steps, height=SIZE, width=SIZE, output_type="pt",
                generator=torch.Generator().manual_seed(SEED), **extra, **kw).images


def test_tokenizers_keep_caption_words_whole():
    clip, t5 = M.build_tokenizer("clip"), M.build_tokenizer("t5")
    ids = clip("a digit three").input_ids
    assert len(ids) == 5  # <start> a digit three <end>
    assert clip.decode(ids, skip_special_tokens=True).strip() == "a digit three"
    assert len(t5("a digit three").input_ids) == 4  # three words and </s>
    # An unknown word still tokenizes (byte fallback), it is just longer.
    assert len(clip("a zebra").input_ids) > 4


@pytest.mark.parametrize("kind", KINDS)
def test_predict_matches_the_pipeline_denoiser_call(kind):
    """Capture the denoiser's input and output inside a real pipeline call, then recompute the
    output with `predict` from (latents, t, encode_prompts(...)): training sees what sampling sees."""
    pipe = M.build_pipeline(kind, seed=SEED)
    den = M.denoiser(pipe)
    embeds = M.encode_prompts(pipe, PROMPTS)
    seen = {}

    def hook(module, args, kwargs, out):
        if not seen:
            seen.update(args=args, kwargs=kwargs, out=out[0] if isinstance(out, tuple) else out.sample)

    handle = den.register_forward_hook(hook, with_kwargs=True)
    try:
        _call(pipe, kind, embeds, guidance_scale=1.0)
    finally:
        handle.remove()
    kw = seen["kwargs"]
    if kind in ("sd15", "sdxl"):
        x, t = seen["args"][0], seen["args"][1]
        t = t.expand(x.shape[0]) if t.dim() == 0 else t
        expected = seen["out"]
    elif kind == "sd3":
        x, t, expected = kw["hidden_states"], kw["timestep"] / 1000, seen["out"]
    elif kind == "z-image":  # lists of (C, 1, h, w) latents, t = 1 - sigma, the output negated
        x, t = torch.stack(seen["args"][0]).squeeze(2), 1 - seen["args"][1]
        expected = -torch.stack(seen["out"]).squeeze(2)
    else:
        h = w = SIZE // 2
        from lora_lab.models.inputs import unpack_latents

        x, t = unpack_latents(kw["hidden_states"], h, w), kw["timestep"]
        expected = unpack_latents(seen["out"], h, w)
    with torch.no_grad():
        got = M.predict(kind, den, x, t, embeds)
    assert got.shape == (2, 4, SIZE // 2, SIZE // 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_sdxl_uses_both_text_encoders_and_time_ids():
    pipe = M.build_pipeline("sdxl", seed=SEED)
    e = M.encode_prompts(pipe, PROMPTS)
    assert e["prompt_embeds"].shape == (2, M.TEXT_LEN, 64)  # 32 (CLIP-L-like) + 32 (CLIP-G-like)
    assert e["pooled_prompt_embeds"].shape == (2, 32)
    assert not torch.equal(e["prompt_embeds"][0], e["prompt_embeds"][1])
    x, t = torch.randn(2, 4, SIZE // 2, SIZE // 2), torch.tensor([500, 500])
    with torch.no_grad():
        a = M.predict("sdxl", pipe.unet, x, t, e)
        b = M.predict("sdxl", pipe.unet, x, t, {**e, "time_ids": sdxl_time_ids(2, 64, 64)})
    assert not torch.allclose(a, b)  # the micro-conditioning reaches the UNet


def test_same_seed_same_weights_other_seed_other_weights():
    a = M.build_components("sdxl", seed=SEED)["unet"].state_dict()
    b = M.build_components("sdxl", seed=SEED)["unet"].state_dict()
    c = M.build_components("sdxl", seed=SEED + 1)["unet"].state_dict()
    key = "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])


@pytest.mark.parametrize("kind", ["sdxl", "flux"])
def test_save_and_load_from_a_local_folder(kind, tmp_path):
    pipe = M.build_pipeline(kind, seed=SEED)
    pipe.save_pretrained(tmp_path / kind)
    again = M.build_pipeline(kind, base=tmp_path / kind)
    assert type(again) is type(pipe)
    e = M.encode_prompts(pipe, PROMPTS)
    torch.testing.assert_close(M.encode_prompts(again, PROMPTS), e)
    torch.testing.assert_close(_call(again, kind, e), _call(pipe, kind, e))


def test_default_resolution_is_the_models_native_size():
    from types import SimpleNamespace

    assert M.default_resolution(M.build_pipeline("sd15")) == M.RESOLUTION  # tiny VAE, 2x
    real_sdxl = SimpleNamespace(vae_scale_factor=8,
                                unet=SimpleNamespace(config=SimpleNamespace(sample_size=128)))
    assert M.default_resolution(real_sdxl) == 1024


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model kind 'sd2'"):
        M.build_pipeline("sd2")
    with pytest.raises(ModelLoadError, match="no such base model"):
        M.build_pipeline("sdxl", base=tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="no model_index.json"):
        M.build_pipeline("sdxl", base=tmp_path)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="not a safetensors file"):  # a single-file base, checked
        M.build_pipeline("sdxl", base=bad)
    broken = tmp_path / "broken"
    shutil.copytree(M.shipped_base("sdxl"), broken)
    for weights in [broken / "unet" / "diffusion_pytorch_model.safetensors",
                    broken / "text_encoder" / "model.safetensors"]:
        good = weights.read_bytes()
        weights.write_bytes(good[: len(good) // 2])  # a download cut in half
        with pytest.raises(ModelLoadError, match="cannot load as a sdxl pipeline"):
            M.build_pipeline("sdxl", base=broken)
        weights.write_bytes(good)


@pytest.mark.parametrize("kind", ["sd3", "chroma"])
def test_shipped_flow_bases_draw_recognisable_digits(kind):
    """data/base/sd3 and data/base/chroma (flow matching, `data/make_base.py --kind KIND`) load and draw the
    digit asked for."""
    pytest.importorskip("sklearn")
    from lora_lab.diffusion import sample
    from lora_lab.notebook.effect import fit_classifiers

    pipe = M.build_pipeline(kind, base=M.shipped_base(kind))
    # (10, 3, 16, 16)
    images = sample(pipe, [f"a digit {n}" for n in M.DIGIT_NAMES], seed=0, steps=10) * 2 - 1
    digits, inverted = fit_classifiers(range(1600))
    assert digits.accuracy(images, torch.arange(10)) >= 0.8
    assert inverted.rate(images) == 0.0


def test_shipped_sdxl_base_draws_recognisable_digits():
    """data/base/sdxl (made by data/make_base.py) loads with from_pretrained and draws the digit it is
    asked for; sdxl and sd3 ship pre-trained, sd15 and flux are built from a seed."""
    pytest.importorskip("sklearn")
    from lora_lab.diffusion import sample
    from lora_lab.notebook.effect import digit_images, fit_classifiers

    base = M.shipped_base("sdxl")
    assert base is not None and M.shipped_base("sd15") is None
    pipe = M.build_pipeline("sdxl", base=base)
    assert pipe.tokenizer("a digit three").input_ids == M.build_tokenizer("clip")("a digit three").input_ids
    # (10, 3, 16, 16)
    images = sample(pipe, [f"a digit {n}" for n in M.DIGIT_NAMES], seed=0, steps=10) * 2 - 1
    digits, inverted = fit_classifiers(range(1600))
    assert digits.accuracy(images, torch.arange(10)) >= 0.8
    assert inverted.rate(images) == 0.0
    # the VAE is a codec of both styles (held-out digits): the LoRA's inverted style is reachable
    for style in (False, True):
        x, _ = digit_images(range(1700, 1716), inverted=style)
        z = M.encode_images(pipe, x, generator=torch.Generator().manual_seed(SEED))
        assert z.shape == (16, 4, 8, 8) and 0.5 < z.std() < 2  # scaling_factor makes latents ~unit scale
        assert ((M.decode_latents(pipe, z) - x) ** 2).mean() < 0.03


def test_a_kind_name_is_resolved_once_at_the_entry_point(monkeypatch):
    """`build_pipeline("flux")` looks the name up once; below it, models/ passes the ModelKind itself (no
    second lookup by name), and `kind_of` gives that same object back."""
    from lora_lab.models import bases, builders, single_file

    looked_up = []

    def counting(name):
        if isinstance(name, str):
            looked_up.append(name)
        return M.model_kind(name)

    for module in (bases, builders, single_file):
        monkeypatch.setattr(module, "model_kind", counting, raising=False)
    pipe = M.build_pipeline("flux", seed=SEED)
    assert looked_up == ["flux"]
    assert M.kind_of(pipe) is M.model_kind("flux")
    opened = M.open_base(M.model_kind("sd15"), None, torch.float32)
    assert looked_up == ["flux"] and M.kind_of(opened.pipe).name == "sd15"
