"""models/flux2.py: the tiny FLUX.2 [dev] kind against diffusers' Flux2Pipeline (tokenizer and chat template,
latents, the denoiser's call), and a run trained, resumed bit for bit, its LoRA file loaded by diffusers."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from safetensors.torch import load_file

from lora_lab.models import build_pipeline, builders, flux2

SEED = 3


@pytest.fixture(scope="module")
def pipe():
    return build_pipeline("flux2", seed=SEED)


def test_tokenizer_makes_each_caption_word_one_token_and_renders_mistrals_chat(pipe):
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    tok = pipe.tokenizer
    for word in builders.WORDS:
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
        assert len(tok(" " + word, add_special_tokens=False).input_ids) == 1, word
    assert [tok.convert_tokens_to_ids(t) for t in ("<s>", "[INST]", "[IMG]", "<pad>", "[SYSTEM_PROMPT]")] == [
        1, 3, 10, 11, 17]
    chat = tok.apply_chat_template(format_input(["a digit seven"]), add_generation_prompt=False,
                                   tokenize=True, return_dict=True, return_tensors="pt",
                                   padding="max_length", truncation=True, max_length=flux2.TINY_TOKENS)
    tokens = tok.convert_ids_to_tokens(chat["input_ids"][0].tolist())
    n = int(chat["attention_mask"].sum())
    assert tokens[:2] == ["<s>", "[SYSTEM_PROMPT]"] and "[/SYSTEM_PROMPT]" in tokens
    # the caption whole after [INST], then padding to the tokenizer's length
    assert tokens[n - 5:n] == ["[INST]", "a", "\u0120digit", "\u0120seven", "[/INST]"]
    assert set(tokens[n:]) == {"<pad>"} and n < flux2.TINY_TOKENS


def test_prompt_embeds_stack_three_hidden_layers_of_the_text_encoder(pipe):
    embeds = builders.encode_prompts(pipe, ["a digit one", "a digit two"])["prompt_embeds"]
    hidden = pipe.text_encoder.config.text_config.hidden_size
    assert embeds.shape == (2, flux2.TINY_TOKENS, 3 * hidden)
    assert pipe.transformer.config.joint_attention_dim == 3 * hidden


def test_latents_are_the_pipelines_patchified_normalised_latents_in_pack_order(pipe):
    from diffusers import Flux2Pipeline

    from lora_lab.models.inputs import pack_latents

    vae = pipe.vae
    vae.bn.running_mean.uniform_(-0.5, 0.5)  # statistics that are not the identity
    vae.bn.running_var.uniform_(0.5, 2.0)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    ours = builders.encode_images(pipe, images)
    assert ours.shape == (2, 4, 8, 8)
    theirs = Flux2Pipeline._pack_latents(pipe._encode_vae_image(images, generator=None))  # (B, 16, 16)
    torch.testing.assert_close(pack_latents(ours), theirs)
    z = vae.encode(images).latent_dist.mode()
    torch.testing.assert_close(flux2.denormalize(vae, ours), z, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_flux2_trains_resumes_bit_for_bit_and_its_lora_loads_in_diffusers(digits_folder, tmp_path):
    """A run of 4 steps equals one stopped after 2 and resumed; pipe.load_lora_weights(its diffusers file)
    on a fresh tiny pipeline samples lora_lab's image."""
    from lora_lab.diffusion import TrainConfig, sample, train

    data = digits_folder(4)
    cfg = dict(model="flux2", dataset=str(data), rank=4, lr=1e-1, batch_size=2, seed=SEED, sample_steps=0,
               progress=False, save_every=2, feed_forward=True)
    run = tmp_path / "run"
    whole = train(TrainConfig(output=str(run), steps=4, **cfg))
    assert any(name.endswith("ff.linear_out") for name in whole.adapted)
    assert any(name.endswith("single_transformer_blocks.1.attn.to_qkv_mlp_proj") for name in whole.adapted)
    a = load_file(str(whole.outputs["lora_diffusers"]))
    # the run as a kill after its step-2 checkpoint leaves it, then resumed
    (run / "checkpoints" / "step_0000004.pt").unlink()
    log = run / "loss.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:2]))
    resumed = train(TrainConfig(output=str(run), steps=4, resume=True, **cfg))
    assert resumed.losses == whole.losses and all(map(math.isfinite, whole.losses))
    b = load_file(str(resumed.outputs["lora_diffusers"]))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4]

    prompt, steps = "a digit three", 4
    ours = sample(whole.pipe, prompt, seed=SEED, steps=steps)
    fresh = build_pipeline("flux2", builders.shipped_base("flux2"))
    plain = sample(fresh, prompt, seed=SEED, steps=steps)
    fresh.load_lora_weights(str(whole.outputs["lora_diffusers"]))
    theirs = sample(fresh, prompt, seed=SEED, steps=steps)
    assert (ours - plain).abs().max() > 0.02  # the LoRA changes the image: the comparison proves something
    torch.testing.assert_close(theirs, ours, atol=2e-3, rtol=0)


def comfyui_key_map(model) -> dict[str, tuple[str, tuple[int, ...]]]:
    """ComfyUI's LoRA key map for a Flux.2 model (comfy/lora.py `model_lora_keys_unet`), restated: ComfyUI
    cannot be installed here. Every weight of its BFL state dict as `lora_unet_<name with _>`; and its
    Flux branch (model_base.Flux2 subclasses Flux) maps the diffusers names that comfy/utils.py
    `flux_to_diffusers` knows (Flux.1's) as `lora_transformer_<name>`: the double-stream attention, q/k/v
    as slices of the fused qkv.
    -> {LoRA key: (the BFL weight, the shape the LoRA's update must have)}."""
    from torch import nn

    hidden = model.inner_dim
    keys = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        shape = tuple(module.weight.shape)
        bfl = flux2.bfl_name(name)
        if bfl is not None:  # in ComfyUI's state dict under this name, the whole weight
            keys[f"lora_unet_{bfl.replace('.', '_')}"] = (f"diffusion_model.{bfl}.weight", shape)
        block, _, tail = name.partition(".attn.")
        if name.startswith("transformer_blocks.") and tail in FLUX1_ATTENTION:
            double = block.replace("transformer_blocks", "double_blocks")
            fused = f"diffusion_model.{double}.{FLUX1_ATTENTION[tail]}"
            keys[f"lora_transformer_{name.replace('.', '_')}"] = (fused, (hidden, shape[1]))
    return keys


# comfy/utils.py flux_to_diffusers: diffusers attention module -> BFL weight (q/k/v: a `hidden` slice of qkv)
FLUX1_ATTENTION = {"to_q": "img_attn.qkv", "to_k": "img_attn.qkv", "to_v": "img_attn.qkv",
                   "to_out.0": "img_attn.proj", "add_q_proj": "txt_attn.qkv", "add_k_proj": "txt_attn.qkv",
                   "add_v_proj": "txt_attn.qkv", "to_add_out": "txt_attn.proj"}


def test_comfyui_file_keys_each_map_to_a_flux2_weight_and_convert_and_merge_read_them(tmp_path):
    from lora_lab.cli import main as cli_main
    from lora_lab.diffusion.config import ATTENTION_TARGETS, FEED_FORWARD_TARGETS
    from lora_lab.formats import load_lora, save_lora
    from lora_lab.lora import LoRAConfig, add_lora
    from lora_lab.merge import apply_loras

    model = builders.build_components("flux2", only=["transformer"])["transformer"]
    targets = [*ATTENTION_TARGETS, *FEED_FORWARD_TARGETS, "ff_context.linear_in", "ff_context.linear_out"]
    adapted = add_lora(model, LoRAConfig(rank=2, alpha=2, targets=targets))
    assert len(adapted) == 8 + 4 + 2 * 2  # 1 double-stream block (attention, ff) and 2 single-stream blocks
    for p in (p for n, p in model.named_parameters() if n.endswith(".up")):
        torch.nn.init.normal_(p, std=0.1)
    path = save_lora(tmp_path / "comfy.safetensors", model, format="kohya")
    keys = {k.rsplit(".", 2)[0] for k in load_file(str(path)) if k.endswith("lora_down.weight")}
    comfy = comfyui_key_map(builders.build_components("flux2", only=["transformer"])["transformer"])
    assert keys <= comfy.keys(), keys - comfy.keys()
    lf = load_lora(path)
    assert lf.base == "flux2" and sorted(lf.modules) == sorted(f"transformer.{n}" for n in adapted)
    for m in lf.modules.values():
        assert tuple(m.delta().shape) == comfy[m.key][1]
    # convert to PEFT and back: the same modules and tensors; merge applies either the same
    assert cli_main(["convert", str(path), str(tmp_path / "peft.safetensors"), "--to", "peft"]) == 0
    peft = load_lora(tmp_path / "peft.safetensors")
    assert sorted(peft.modules) == sorted(lf.modules)
    assert cli_main(["inspect", str(path)]) == 0
    a, b = (builders.build_components("flux2", only=["transformer"])["transformer"] for _ in range(2))
    apply_loras(a, [(path, 1.0)], mode="merge")
    apply_loras(b, [(tmp_path / "peft.safetensors", 1.0)], mode="merge")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_real_flux2_dev_has_the_published_sizes():
    """black-forest-labs/FLUX.2-dev: a 32B transformer, Mistral Small 3.x 24B as its text encoder (with its
    lm_head and Pixtral vision tower, as the repository ships it), the 32-channel VAE."""
    from lora_lab.models import build_real

    with torch.device("meta"):
        parts = build_real("flux2-dev")
    count = {name: sum(p.numel() for p in m.parameters()) for name, m in parts.items()}
    assert count["transformer"] == pytest.approx(32.2e9, rel=0.005)
    assert count["text_encoder"] == pytest.approx(24.0e9, rel=0.005)
    assert count["vae"] == pytest.approx(84.0e6, rel=0.005)
    assert parts["vae"].bn.num_features == 128 and parts["transformer"].config.joint_attention_dim == 3 * 5120


def test_options_that_cannot_apply_to_flux2_say_so():
    from lora_lab.diffusion import TrainConfig, TrainConfigError

    with pytest.raises(TrainConfigError, match="text_encoder_lr.*CLIP text encoders; flux2 has none"):
        TrainConfig(model="flux2", text_encoder_lr=1e-4)
    TrainConfig(model="flux2", train_guidance=3.5)  # its guidance embedding takes a value


@pytest.mark.slow
def test_every_phase_of_a_flux2_run_is_planned_within_5_percent(tmp_path):
    """A tiny flux2 run on the CPU measured phase by phase by PyTorch's MemTracker and lora_lab's LiveBytes,
    against its plan (the trainer's stages on fake tensors). The cache phase holds the Mistral encoder's
    33 hidden states and its logits, as large as the cached rows: planned as encode_captions makes them."""
    from lora_lab.diffusion import TrainConfig
    from lora_lab.diffusion.trainer import PHASES
    from lora_lab.planning import plan_memory
    from lora_lab.planning.measure import measure_phases

    config = TrainConfig(model="flux2", output=str(tmp_path), rank=8, steps=2, sample_steps=1, progress=False,
                         device="cpu")
    measured = measure_phases(config, ("torch", "live"))
    plan = plan_memory(config, cache=False)
    for tracker in ("torch", "live"):
        for phase in PHASES:
            assert plan.phases[phase] == pytest.approx(measured[tracker][phase], rel=0.05), (tracker, phase)
