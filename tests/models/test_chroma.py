"""models/chroma.py: Chroma's masked T5 prompts, its denoiser call, its trainer's timestep draw, a run that
trains, samples and resumes bit for bit, and the options that do not apply refused in one line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lora_lab import models as M
from lora_lab.diffusion import TrainConfig, TrainConfigError, train
from lora_lab.diffusion.step import training_objective
from lora_lab.diffusion.weighting import chroma_sigmas, timestep_density
from lora_lab.models.chroma import modulation_indices

SEED = 3
FAST = {"rank": 4, "lr": 1e-3, "batch_size": 2, "sample_steps": 0, "progress": False, "seed": SEED}


@pytest.fixture(scope="module")
def pipe():
    return M.build_pipeline("chroma", seed=SEED)


def test_prompts_are_masked_to_their_tokens_and_one_padding_token(pipe):
    """The mask is boolean, True on the prompt's tokens (</s> included) and the first padding token; the
    embeddings beyond it do not reach the output (the attention masks them)."""
    embeds = M.encode_prompts(pipe, ["a digit three", "one"])
    mask = embeds["prompt_attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (2, M.TEXT_LEN)
    assert mask.sum(1).tolist() == [4 + 1, 2 + 1]  # "a digit three </s>" + 1, "one </s>" + 1
    assert mask[0, :5].all() and not mask[0, 5:].any()
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0.3, 0.8])
    garbled = {**embeds, "prompt_embeds": torch.where(mask[..., None], embeds["prompt_embeds"], 7.0)}
    with torch.no_grad():
        a = M.predict("chroma", pipe.transformer, x, t, embeds)
        b = M.predict("chroma", pipe.transformer, x, t, garbled)
        unmasked = M.predict("chroma", pipe.transformer, x, t, {**embeds, "prompt_attention_mask":
                                                                 torch.ones_like(mask)})
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert (a - unmasked).abs().max() > 1e-3  # the mask matters: the test can fail


def test_the_sampler_masks_as_training_does(pipe):
    """`sample` hands the pipeline the boolean mask: its images do not change with what lies under the
    padding (the float mask diffusers 0.42 makes itself would let it through)."""
    from lora_lab.diffusion.sampling import prompt_inputs, sample

    inputs = prompt_inputs(pipe, ["a digit three"])
    mask = inputs["prompt_attention_mask"]
    garbled = {**inputs, "prompt_embeds": torch.where(mask[..., None], inputs["prompt_embeds"], 7.0)}
    first = sample(pipe, "a digit three", seed=SEED, steps=2, inputs=inputs)
    second = sample(pipe, "a digit three", seed=SEED, steps=2, inputs=garbled)
    torch.testing.assert_close(first, second, rtol=0, atol=1e-6)


def test_the_modulation_buffer_no_file_holds_is_made_as_the_constructor_makes_it(pipe):
    made = pipe.transformer.time_text_embed.mod_proj
    like = torch.empty(made.shape, device="meta")
    torch.testing.assert_close(modulation_indices(like), made, rtol=0, atol=0)


def test_chroma_sigmas_follow_the_trainers_density():
    """The quantiles invert the CDF of 2 - 7.7 (s - 1/2)^2: the median is 1/2, the density's mean 1/2, and a
    histogram of draws matches the density within sampling error."""
    u = torch.tensor([0.0, 0.5, 1.0])
    assert chroma_sigmas(u)[1].item() == pytest.approx(0.5, abs=1e-6)
    assert 0 < chroma_sigmas(u)[0].item() < 1e-5 and 1 - 1e-5 < chroma_sigmas(u)[2].item() < 1
    s = timestep_density("chroma", 200_000, torch.Generator().manual_seed(0))
    hist = torch.histc(s, bins=10, min=0, max=1) / len(s)
    centres = torch.arange(10) / 10 + 0.05
    dens = 2 - 7.7 * (centres - 0.5) ** 2
    torch.testing.assert_close(hist, dens / dens.sum(), rtol=0, atol=4e-3)


def test_training_uses_chromas_own_draw_unshifted_unless_asked(pipe):
    default = training_objective(TrainConfig(model="chroma"), pipe, 1024)
    assert (default.sampling, default.shift, default.mu) == ("chroma", 1.0, None)
    asked = training_objective(TrainConfig(model="chroma", timestep_sampling="mode", timestep_shift=3.0),
                               pipe, 1024)
    assert (asked.sampling, asked.shift) == ("mode", 3.0)
    assert training_objective(TrainConfig(model="chroma", dynamic_shift=True), pipe, 1024).mu is not None


@pytest.mark.parametrize("fields, message", [
    ({"text_encoder_lr": 1e-4}, r"TrainConfig.text_encoder_lr=0.0001: chroma has no CLIP text encoder"),
    ({"train_guidance": 3.0}, r"TrainConfig.train_guidance=3.0: applies to flux only"),
])
def test_options_that_do_not_apply_are_refused_in_one_line(fields, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig(model="chroma", **fields)


@pytest.mark.slow
def test_a_run_trains_samples_and_resumes_bit_for_bit(digits_folder, tmp_path):
    """4 steps, then the run cut back to its step-2 checkpoint and resumed: the same losses and LoRA bits; the
    samples are written."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    base = dict(model="chroma", dataset=str(digits_folder(4)), output=str(out), steps=4, save_every=2,
                keep_checkpoints=2, **FAST)
    whole = train(TrainConfig(**{**base, "sample_steps": 2}))
    assert whole.outputs["samples"].is_file()
    files = {key: load_file(str(whole.outputs[key])) for key in ("lora_kohya", "lora_diffusers")}
    (out / "checkpoints" / "step_0000004.pt").unlink()
    resumed = train(TrainConfig(resume=True, **base))
    assert resumed.losses == whole.losses
    for key, a in files.items():
        b = load_file(str(resumed.outputs[key]))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), key
