"""models/qwen_image.py: the Qwen-Image kind on its tiny base: the offline tokenizer honours the pipeline's
template, the fixed-length encoding is the pipeline's, padding changes no prediction, the VAE's normalised
latents; a run trains, samples, resumes bit for bit, and its LoRA file loads in diffusers' own loader."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lora_lab.diffusion import TrainConfig, train
from lora_lab.diffusion.weighting import dynamic_shift_mu
from lora_lab.models import build_pipeline, encode_images, encode_prompts, predict, qwen_image, shipped_base
from lora_lab.models.builders import WORDS, build_tokenizer

SEED = 5
PROMPTS = ["a handwritten digit seven", "the number two, inverted colours on white"]
FAST = {"rank": 4, "lr": 1e-3, "batch_size": 2, "sample_steps": 0, "progress": False, "seed": SEED}
pytestmark = pytest.mark.xdist_group("test_qwen_image")


@pytest.fixture(scope="module")
def pipe():
    return build_pipeline("qwen-image", seed=SEED)


def test_every_word_is_one_token_and_the_template_prefix_is_the_pipelines_drop():
    tok = build_tokenizer("qwen2_5_vl")
    for word in (*WORDS, *(w.strip() for w in qwen_image._template_words())):
        for form in (word, " " + word):
            assert len(tok(form)["input_ids"]) == 1, form
    prefix = qwen_image.TEMPLATE[:qwen_image.TEMPLATE.index("{}")]
    assert len(tok(prefix)["input_ids"]) == qwen_image.DROPPED == 34  # the real tokenizer's count too
    assert tok.convert_ids_to_tokens(tok(prefix)["input_ids"])[-3:] == ["<|im_start|>", "user", "Ċ"]


def test_encoding_is_the_pipelines_padded_with_its_mask(pipe):
    ours = encode_prompts(pipe, PROMPTS)
    theirs, mask = pipe.encode_prompt(PROMPTS, device="cpu")  # padded to the batch's longest prompt
    n = theirs.shape[1]
    assert ours["prompt_embeds"].shape == (2, 32, 64) and ours["prompt_embeds_mask"].shape == (2, 32)
    torch.testing.assert_close(ours["prompt_embeds"][:, :n], theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["prompt_embeds_mask"][:, :n], mask)  # the mask keeps its dtype
    assert ours["prompt_embeds"][:, n:].abs().max() == 0 and ours["prompt_embeds_mask"][:, n:].sum() == 0
    # each prompt keeps its own tokens and the template's closing 5: "a handwritten digit seven" is 4
    assert ours["prompt_embeds_mask"].sum(1).tolist() == [4 + 5, 8 + 5]


def test_padding_changes_no_prediction(pipe):
    embeds = encode_prompts(pipe, PROMPTS[:1])
    n = int(embeds["prompt_embeds_mask"].sum())
    x, t = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0.4])
    with torch.no_grad():
        padded = predict("qwen-image", pipe.transformer, x, t, embeds)
        trimmed = predict("qwen-image", pipe.transformer, x, t,
                          {"prompt_embeds": embeds["prompt_embeds"][:, :n]})
        unmasked = predict("qwen-image", pipe.transformer, x, t, {"prompt_embeds": embeds["prompt_embeds"]})
    torch.testing.assert_close(padded, trimmed, rtol=1e-5, atol=1e-5)
    assert (padded - unmasked).abs().max() > 1e-4  # the mask is what keeps padding out


def test_latents_are_one_frame_normalised_per_channel(pipe):
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    z = pipe.vae.encode(images[:, :, None]).latent_dist.mode()[:, :, 0]  # (2, 4, 8, 8)
    vae = pipe.vae
    vae.register_to_config(latents_mean=[0.5, -1.0, 0.0, 2.0], latents_std=[2.0, 1.0, 4.0, 0.5])
    try:
        lat = qwen_image.to_latents(vae, images)  # sampled: the mode plus the posterior's noise
        mean = torch.tensor([0.5, -1.0, 0.0, 2.0]).view(1, 4, 1, 1)
        std = torch.tensor([2.0, 1.0, 4.0, 0.5]).view(1, 4, 1, 1)
        noise = lat * std + mean - z
        assert lat.shape == (2, 4, 8, 8) and noise.abs().max() < 10 * vae.encode(
            images[:, :, None]).latent_dist.std.max()
        out = qwen_image.from_latents(vae, (z - mean) / std)
        torch.testing.assert_close(out, vae.decode(z[:, :, None]).sample[:, :, 0].clamp(-1, 1))
    finally:
        vae.register_to_config(latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    assert encode_images(pipe, images).shape == (2, 4, 8, 8)


def test_training_shift_is_musubi_tuners_qwen_shift(pipe):
    """mu linear in the image tokens from (256, 0.5) to (8192, 0.9): 1024 px -> 64 x 64 tokens, shift 2."""
    assert dynamic_shift_mu(4096, dict(pipe.scheduler.config)) == pytest.approx(0.5 + 3840 * 0.4 / 7936)
    shift = torch.exp(torch.tensor(dynamic_shift_mu(4096, qwen_image.SCHEDULER)))
    assert shift == pytest.approx(2.0, abs=0.01)


@pytest.mark.slow
def test_trains_samples_resumes_and_loads_in_diffusers(digits_folder, tmp_path):
    """A run samples, resumes bit for bit, and diffusers' QwenImagePipeline.load_lora_weights on a fresh
    pipeline samples lora_lab's image."""
    from lora_lab.diffusion import sample

    dataset = digits_folder(6)
    base = dict(model="qwen-image", dataset=str(dataset), steps=4, save_every=2, **{**FAST, "lr": 1e-1})
    run = tmp_path / "run"
    whole = train(TrainConfig(output=str(run), **base))
    a = {k: v.clone() for k, v in load_file(str(whole.outputs["lora_diffusers"])).items()}
    # the run as a kill after its step-2 checkpoint leaves it, then resumed
    for path in [run / "checkpoints" / "step_0000004.pt", *run.glob("*.safetensors")]:
        path.unlink()
    resumed = train(TrainConfig(output=str(run), resume=True, **base))
    assert resumed.losses == whole.losses
    b = load_file(str(resumed.outputs["lora_diffusers"]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt, steps = "a digit three", 4
    ours = sample(whole.pipe, prompt, seed=SEED, steps=steps)
    fresh = build_pipeline("qwen-image", shipped_base("qwen-image"))
    plain = sample(fresh, prompt, seed=SEED, steps=steps)
    fresh.load_lora_weights(str(resumed.outputs["lora_diffusers"]))
    theirs = sample(fresh, prompt, seed=SEED, steps=steps)
    assert (ours - plain).abs().max() > 0.02  # the LoRA changes the image: the comparison proves something
    torch.testing.assert_close(theirs, ours, atol=2e-3, rtol=0)


def _comfyui_keys(transformer: torch.nn.Module) -> set[str]:
    """The LoRA names ComfyUI's key map gives a Qwen-Image model (comfy/lora.py `model_lora_keys_unet`: for
    every `diffusion_model.<path>.weight`, the generic `lora_unet_<path with _>` and `diffusion_model.<path>`,
    and for comfy.model_base.QwenImage `<path>`, `transformer.<path>` and `lycoris_<path with _>`; ComfyUI's
    Qwen-Image model has diffusers' module names)."""
    keys = set()
    for name in transformer.state_dict():
        if name.endswith(".weight"):
            path = name[: -len(".weight")]
            under = path.replace(".", "_")
            keys |= {f"lora_unet_{under}", f"diffusion_model.{path}", path, f"transformer.{path}",
                     f"lycoris_{under}"}
    return keys


def test_lora_files_comfyui_keys_diffusers_loader_inspect_convert_merge(pipe, tmp_path, capsys):
    """A LoRA on the tiny transformer saved as kohya/ComfyUI and PEFT files: every kohya key is one ComfyUI
    maps; diffusers' loader takes both and predicts what lora_lab's merge predicts; `lora-lab inspect`,
    `convert` (both ways, the same modules) and `merge` (the weights lora_lab merges) handle them."""
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import save_file

    from lora_lab.cli import main as cli_main
    from lora_lab.formats import load_lora, save_lora
    from lora_lab.lora import LoRAConfig, add_lora, remove_lora

    model = QwenImageTransformer2DModel(**qwen_image.TINY["transformer"]).eval()
    model.load_state_dict(pipe.transformer.state_dict())
    base_weights = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    add_lora(model, LoRAConfig(rank=2, alpha=2.0, targets=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj",
                                                           "to_add_out", "img_mlp.net.2", "txt_mod.1"]))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    kohya = save_lora(tmp_path / "k.safetensors", model, "kohya", base="qwen-image")
    peft = save_lora(tmp_path / "p.safetensors", model, "peft", base="qwen-image")
    names = {k.rsplit(".", 2)[0] for k in load_file(str(kohya)) if k.endswith("lora_down.weight")}
    assert names and all(n.startswith("lora_unet_transformer_blocks_") for n in names)
    assert names <= _comfyui_keys(pipe.transformer)
    assert load_lora(kohya).base == "qwen-image"
    assert set(load_lora(kohya).modules) == set(load_lora(peft).modules)

    embeds = encode_prompts(pipe, PROMPTS[:1])
    x, t = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0.6])
    remove_lora(model)  # the plain modules, their weights merged
    with torch.no_grad():
        want = predict("qwen-image", model, x, t, embeds)
        for path in (kohya, peft):
            fresh = build_pipeline("qwen-image", seed=SEED)
            fresh.load_lora_weights(str(path))
            got = predict("qwen-image", fresh.transformer, x, t, embeds)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=str(path))

    assert cli_main(["inspect", str(kohya)]) == 0 and "qwen-image" in capsys.readouterr().out
    back = tmp_path / "back.safetensors"
    assert cli_main(["convert", str(peft), str(tmp_path / "c.safetensors"), "--to", "kohya"]) == 0
    assert cli_main(["convert", str(tmp_path / "c.safetensors"), str(back), "--to", "peft"]) == 0
    assert set(load_file(str(tmp_path / "c.safetensors"))) == set(load_file(str(kohya)))
    assert set(load_file(str(back))) == set(load_file(str(peft)))
    save_file(base_weights, str(tmp_path / "base.safetensors"))
    assert cli_main(["merge", str(tmp_path / "base.safetensors"), str(tmp_path / "m.safetensors"),
                     "--lora", f"{kohya}:1"]) == 0
    merged = load_file(str(tmp_path / "m.safetensors"))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_real_parameter_counts_match_the_published_totals():
    """Qwen/Qwen-Image's model card: a 20 B MMDiT (20.43 B on its config); Qwen2.5-VL-7B-Instruct 8.29 B
    (its model card: with the vision tower and lm_head); the VAE 127 M (Wan 2.1's architecture)."""
    from lora_lab.models import build_real

    with torch.device("meta"):
        counts = {c: sum(p.numel() for p in m.parameters()) for c, m in build_real("qwen-image").items()}
    assert counts["transformer"] == 20_430_401_088
    assert counts["text_encoder"] == pytest.approx(8.29e9, rel=0.001)
    assert counts["vae"] == pytest.approx(127e6, rel=0.002)


def test_validation_says_what_does_not_apply():
    from lora_lab.diffusion import TrainConfigError

    with pytest.raises(TrainConfigError, match="text_encoder_lr=.*CLIP text encoders; qwen-image has none"):
        TrainConfig(model="qwen-image", text_encoder_lr=1e-4).validate()
    with pytest.raises(TrainConfigError, match="train_guidance=.*guidance-distilled families only"):
        TrainConfig(model="qwen-image", train_guidance=3.5).validate()


@pytest.mark.slow
def test_every_phase_of_a_tiny_run_is_planned_within_five_percent(tmp_path):
    """The planner's validation on this kind: each phase of a real run of the trainer (caching with the
    Qwen2.5-VL encoder, loading, the steps, saving, sampling) measured by PyTorch's MemTracker and by
    LiveBytes on the CPU, against the plan of the same config."""
    from lora_lab.diffusion.trainer import PHASES
    from lora_lab.planning import plan_memory
    from lora_lab.planning.measure import measure_phases

    config = TrainConfig(model="qwen-image", output=str(tmp_path), rank=8, steps=2, sample_steps=1,
                         progress=False, device="cpu")
    measured = measure_phases(config, ("torch", "live"))
    planned = plan_memory(config, cache=False).phases
    for phase in PHASES:
        for tracker in ("torch", "live"):
            assert planned[phase] == pytest.approx(measured[tracker][phase], rel=0.05), (phase, tracker)
