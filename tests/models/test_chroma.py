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
from lora_lab.models.chroma import TINY_TRANSFORMER, modulation_indices

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
    ({"text_encoder_lr": 1e-4},
     r"TrainConfig.text_encoder_lr=0.0001: trains LoRAs on CLIP text encoders; chroma has none"),
    ({"train_guidance": 3.0},
     r"TrainConfig.train_guidance=3.0: applies to the guidance-distilled families only"),
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


# ComfyUI loads Chroma LoRAs through its Flux key map: comfy/model_base.py `class Chroma(Flux)`, so
# comfy/lora.py `model_lora_keys_unet`'s `isinstance(model, comfy.model_base.Flux)` branch maps
# "transformer.<diffusers module>" and "lora_transformer_<diffusers module, dots as _>" to the targets of
# comfy/utils.py `flux_to_diffusers`: the diffusers modules of a double / single block (the suffix) -> its
# BFL module. Chroma's BFL model (comfy/ldm/chroma/model.py) has these but no img_mod / txt_mod / modulation
# (its "distilled_guidance_layer" replaces them), so only the blocks' attention and MLP layers are mapped.
COMFY_DOUBLE = {"attn.to_q": "img_attn.qkv", "attn.to_k": "img_attn.qkv", "attn.to_v": "img_attn.qkv",
                "attn.add_q_proj": "txt_attn.qkv", "attn.add_k_proj": "txt_attn.qkv",
                "attn.add_v_proj": "txt_attn.qkv", "attn.to_out.0": "img_attn.proj",
                "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
                "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2"}
COMFY_SINGLE = {"attn.to_q": "linear1", "attn.to_k": "linear1", "attn.to_v": "linear1", "proj_mlp": "linear1",
                "proj_out": "linear2"}


def comfy_target(module: str) -> str | None:
    """The BFL module ComfyUI's Flux map sends a diffusers transformer module to, or None."""
    parts = module.split(".")
    if parts[0] == "transformer_blocks" and ".".join(parts[2:]) in COMFY_DOUBLE:
        return f"double_blocks.{parts[1]}.{COMFY_DOUBLE['.'.join(parts[2:])]}"
    if parts[0] == "single_transformer_blocks" and ".".join(parts[2:]) in COMFY_SINGLE:
        return f"single_blocks.{parts[1]}.{COMFY_SINGLE['.'.join(parts[2:])]}"
    return None


@pytest.mark.parametrize("format, prefix, cut", [("kohya", "lora_transformer_", ".lora_down.weight"),
                                                  ("peft", "transformer.", ".lora_A.weight")])
def test_every_key_of_both_files_is_one_comfyui_maps_to_a_module(pipe, tmp_path, format, prefix, cut):
    """A LoRA on every layer lora_lab adapts (attention and feed-forward) saved in both layouts: each module
    key is one ComfyUI's Flux map knows, and names a module of Chroma's BFL model."""
    from safetensors import safe_open

    from lora_lab.diffusion.config import ATTENTION_TARGETS, FEED_FORWARD_TARGETS
    from lora_lab.formats import save_lora
    from lora_lab.lora import add_lora
    from lora_lab.lora.config import LoRAConfig

    model = M.build_components("chroma", seed=SEED, only=["transformer"])["transformer"]
    targets = list(ATTENTION_TARGETS) + list(FEED_FORWARD_TARGETS) + ["ff_context.net.0.proj",
                                                                      "ff_context.net.2", "proj_mlp"]
    wrapped = add_lora(model, LoRAConfig(rank=2, targets=targets))
    path = save_lora(tmp_path / f"{format}.safetensors", model, format, base="chroma")
    with safe_open(str(path), "pt") as f:
        keys = [k for k in f.keys() if k.endswith(cut)]
    assert len(keys) == len(wrapped) > 0
    n = TINY_TRANSFORMER
    bfl = ({f"double_blocks.{i}.{m}" for i in range(n["num_layers"]) for m in COMFY_DOUBLE.values()}
           | {f"single_blocks.{i}.{m}" for i in range(n["num_single_layers"]) for m in COMFY_SINGLE.values()})
    for key in keys:
        module = key[len(prefix):-len(cut)]
        if format == "kohya":
            module = next(w for w in wrapped if w.replace(".", "_") == module)
        assert comfy_target(module) in bfl, key


def test_inspect_convert_and_merge_take_a_chroma_file(pipe, tmp_path, capsys):
    """`lora-lab inspect`, `convert` (kohya <-> peft, the same modules and values) and `merge` into the
    transformer's weights file: the merged weight is the base's plus the LoRA's change."""
    from safetensors.torch import load_file, save_file

    from lora_lab.cli import main
    from lora_lab.formats import load_lora, save_lora
    from lora_lab.lora import add_lora
    from lora_lab.lora.config import LoRAConfig

    model = M.build_components("chroma", seed=SEED, only=["transformer"])["transformer"]
    base = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("mod_proj")}
    add_lora(model, LoRAConfig(rank=2, targets=["to_q", "proj_mlp"]))
    for name, p in model.named_parameters():
        if "lora_B" in name or "up" in name:
            torch.nn.init.normal_(p, std=0.1)
    kohya = save_lora(tmp_path / "k.safetensors", model, "kohya", base="chroma")
    assert main(["inspect", str(kohya)]) == 0
    assert "transformer" in capsys.readouterr().out
    peft, back = tmp_path / "p.safetensors", tmp_path / "k2.safetensors"
    assert main(["convert", str(kohya), str(peft), "--to", "peft", "--base", "chroma"]) == 0
    assert main(["convert", str(peft), str(back), "--to", "kohya", "--base", "chroma"]) == 0
    a, b = load_lora(kohya), load_lora(back)
    assert a.modules.keys() == b.modules.keys()
    assert all(torch.equal(a.modules[k].delta(), b.modules[k].delta()) for k in a.modules)
    save_file(base, str(tmp_path / "base.safetensors"))
    assert main(["merge", str(tmp_path / "base.safetensors"), str(tmp_path / "merged.safetensors"),
                 "--lora", f"{kohya}:1.0"]) == 0
    merged = load_file(str(tmp_path / "merged.safetensors"))
    name = "single_transformer_blocks.0.proj_mlp"
    change = a.modules[f"transformer.{name}"].delta()
    torch.testing.assert_close(merged[f"{name}.weight"], base[f"{name}.weight"] + change, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_every_phase_of_a_tiny_run_is_planned_within_five_percent(tmp_path):
    """The plan of a chroma run on the shipped LoRA set (`train --dry-run`) against the run measured phase by
    phase by PyTorch's MemTracker and by LiveBytes (planning/measure.py), as tests/planning/test_matrix.py
    does for sd15. Measured: cache 1.0025, load 0.979, train step 0.996, save 0.988, sample 0.997 (plan /
    MemTracker); the load phase's ~27 KB the plan does not see (flux's too) is 2% of it here, 9% of a
    4-image run's."""
    from lora_lab.diffusion.trainer import PHASES
    from lora_lab.planning import plan_memory
    from lora_lab.planning.measure import measure_phases

    config = TrainConfig(model="chroma", rank=16, steps=2, sample_steps=1, progress=False, device="cpu",
                         output=str(tmp_path))
    measured, planned = measure_phases(config, ("torch", "live")), plan_memory(config, cache=False).phases
    ratios = {t: {p: round(planned[p] / measured[t][p], 4) for p in PHASES} for t in measured}
    for phase in PHASES:
        for tracker in measured:
            assert planned[phase] == pytest.approx(measured[tracker][phase], rel=0.05), (phase, ratios)


def test_a_chroma_single_file_is_named_and_refused_in_one_line(tmp_path):
    """Chroma1-HD.safetensors is BFL's layout with Flux's keys and a distilled guidance layer: read as Chroma
    (tests/models/test_single_file_families.py loads one), not mistaken for Flux (or schnell): `--model flux`
    on it is refused in one line naming the family to use."""
    from safetensors.torch import save_file

    from lora_lab.models.single_file import check_file, detect_file

    keys = ("img_in.weight", "double_blocks.0.img_attn.qkv.weight", "distilled_guidance_layer.in_proj.weight")
    save_file({k: torch.zeros(3072 if k == "img_in.weight" else 1, 1) for k in keys}, str(tmp_path / "c.st"))
    found = detect_file(tmp_path / "c.st")
    assert (found.kind.name, found.variant) == ("chroma", "chroma1-hd")
    with pytest.raises(M.ModelLoadError, match=r"c.st is a chroma checkpoint \(chroma1-hd\), not flux: use "
                       "--model chroma"):
        check_file(tmp_path / "c.st", M.model_kind("flux"))

