"""models/z_image.py: the Z-Image kind on its tiny base: the offline tokenizer and its chat template, the
pipeline's own encoding and denoiser call, training with resume, and its files in diffusers' loader."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lora_lab import models as M
from lora_lab.models import z_image
from lora_lab.torch_private import FakeTensorMode

SEED = 5
PROMPTS = ["a digit three, inverted", "a handwritten digit seven", ""]


@pytest.fixture(scope="module")
def pipe():
    return M.build_pipeline("z-image", seed=SEED)


def test_tokenizer_writes_qwen3s_chat_prompt_with_whole_words(pipe):
    tok = pipe.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "a digit three"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=True)
    assert text == "<|im_start|>user\na digit three<|im_end|>\n<|im_start|>assistant\n"
    no_think = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    pieces = tok.tokenize(text)
    assert pieces == ["<|im_start|>", "user", "\u010a", "a", "\u0120digit", "\u0120three", "<|im_end|>",
                      "\u010a", "<|im_start|>", "assistant", "\u010a"]
    assert len(tok("a digit zebra").input_ids) > 3  # an unknown word still tokenizes, in bytes
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "right"


def test_encode_is_the_pipelines_own_list_of_prompts(pipe):
    ours = z_image.encode(pipe, PROMPTS, "cpu")
    theirs, _ = pipe.encode_prompt(list(PROMPTS), device="cpu", do_classifier_free_guidance=False,
                                   max_sequence_length=z_image.TEXT_TOKENS)
    emb, mask = ours["prompt_embeds"], ours["prompt_embeds_mask"]
    assert emb.shape == (3, z_image.TEXT_TOKENS, 32) and mask.shape == (3, z_image.TEXT_TOKENS)
    assert mask.sum(1).tolist() == [len(t) for t in theirs] == [13, 12, 8]
    for a, b in zip(z_image.prompt_list(emb, mask), theirs):
        assert torch.equal(a, b)
    assert (emb[mask == 0] == 0).all()  # padding rows are zero in the cache


def test_on_fake_tensors_every_prompt_counts_at_full_length():
    with FakeTensorMode():
        emb, mask = torch.zeros(2, 6, 4), torch.zeros(2, 6)
        rows = z_image.prompt_list(emb, mask)
    assert [tuple(r.shape) for r in rows] == [(6, 4), (6, 4)]


def test_pipeline_inputs_are_lists_and_the_guidance_scale_minus_one(pipe):
    e = M.encode_prompts(pipe, PROMPTS[:2])
    empty = M.encode_prompts(pipe, [""])
    call = z_image.pipeline_inputs({**e, **{f"negative_{k}": v.expand_as(e[k]) for k, v in empty.items()}},
                                   4.0)
    assert call["guidance_scale"] == 3.0  # the pipeline's pos + 3 (pos - neg) is lora_lab's guidance 4
    assert [len(t) for t in call["prompt_embeds"]] == [13, 12]
    assert [len(t) for t in call["negative_prompt_embeds"]] == [8, 8]


def test_sampling_with_guidance_is_the_pipeline_called_with_prompts(pipe):
    from lora_lab.diffusion import sample

    ours = sample(pipe, PROMPTS[:2], seed=3, steps=3, guidance=3.0)
    ref = pipe(list(PROMPTS[:2]), num_inference_steps=3, guidance_scale=2.0, height=M.RESOLUTION,
               width=M.RESOLUTION, generator=torch.Generator().manual_seed(3), output_type="pt",
               max_sequence_length=z_image.TEXT_TOKENS).images
    torch.testing.assert_close(ours, ref.clamp(0, 1), rtol=1e-5, atol=1e-5)


def test_text_encoder_lora_is_refused_in_one_line(tmp_path):
    from lora_lab.diffusion import TrainConfig, TrainConfigError

    with pytest.raises(TrainConfigError, match="text_encoder_lr=.*z-image has none"):
        TrainConfig(model="z-image", output=str(tmp_path), text_encoder_lr=1e-4)


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.slow
def test_trains_resumes_bit_for_bit_and_diffusers_loads_its_file(digits_folder, tmp_path):
    """A run with LoRA on attention and feed-forward (alpha != rank) resumed from its step-2 checkpoint ends
    with the same bits; pipe.load_lora_weights(its PEFT file) samples lora_lab's image."""
    from lora_lab.diffusion import TrainConfig, sample, train
    from lora_lab.models import build_pipeline, shipped_base

    dataset = digits_folder(4)
    cfg = dict(model="z-image", dataset=str(dataset), steps=4, save_every=2, rank=4, alpha=2.0, lr=2e-2,
               batch_size=2, seed=SEED, sample_steps=0, progress=False, feed_forward=True)
    out = tmp_path / "run"
    whole = train(TrainConfig(output=str(out), **cfg))
    assert any(n.endswith("feed_forward.w2") for n in whole.adapted)
    want = {key: _tensors(whole.outputs[key]) for key in ("lora_kohya", "lora_diffusers")}
    for p in [out / "checkpoints" / "step_0000004.pt", *out.glob("*.safetensors")]:
        p.unlink()  # back to the step-2 checkpoint, as if the run had stopped there
    (out / "loss.jsonl").write_text("".join((out / "loss.jsonl").read_text().splitlines(True)[:2]))
    resumed = train(TrainConfig(output=str(out), resume=True, **cfg))
    assert resumed.losses == whole.losses
    for key, b in want.items():
        a = _tensors(resumed.outputs[key])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), key
    prompt = "a digit three"
    ours = sample(whole.pipe, prompt, seed=SEED, steps=4)
    pipe = build_pipeline("z-image", shipped_base("z-image"))
    plain = sample(pipe, prompt, seed=SEED, steps=4)
    pipe.load_lora_weights(str(whole.outputs["lora_diffusers"]))
    theirs = sample(pipe, prompt, seed=SEED, steps=4)
    assert (ours - plain).abs().max() > 0.02  # the LoRA changes the image: the comparison means something
    torch.testing.assert_close(theirs, ours, atol=2e-3, rtol=0)


# ComfyUI's key map for Z-Image (comfy/lora.py `model_lora_keys_unet`, its Lumina2 branch over comfy/utils.py
# `z_image_to_diffusers`): a LoRA module named by the diffusers path of a block's attention (to_q, to_k, to_v
# into the fused qkv; to_out.0), feed-forward (w1, w2, w3) or adaLN_modulation.0, spelled
# "diffusion_model.<path>", "transformer.<path>", "lycoris_<path with _>" or "<path>".
_COMFY_BLOCK = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                "feed_forward.w2", "feed_forward.w3", "adaLN_modulation.0")


def _comfy_names(model) -> set[str]:
    cfg = model.config
    blocks = ([f"layers.{i}" for i in range(cfg.n_layers)]
              + [f"{g}.{i}" for g in ("noise_refiner", "context_refiner")
                 for i in range(cfg.n_refiner_layers)])
    paths = {f"{b}.{m}" for b in blocks for m in _COMFY_BLOCK}
    return {f"{p}{path}" for path in paths for p in ("diffusion_model.", "transformer.", "")}


def test_files_take_comfyuis_keys_and_convert_inspect_merge(pipe, tmp_path):
    """The kohya/ComfyUI file names every module as ComfyUI's Z-Image key map does (diffusion_model.<path>,
    with alphas), the PEFT file as diffusers does (transformer.<path>); both read back to the same modules;
    `lora-lab convert`, `inspect` and `merge` take them, and the merge equals the adapter's weights."""
    import copy

    from safetensors.torch import load_file, save_file

    from lora_lab.cli import main as cli_main
    from lora_lab.formats import load_lora, save_lora
    from lora_lab.lora import LoRAConfig, add_lora, lora_modules

    model = copy.deepcopy(pipe.transformer)
    base = {k: v.contiguous() for k, v in model.state_dict().items()}
    add_lora(model, LoRAConfig(rank=2, alpha=1.0, targets=list(_COMFY_BLOCK)))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    kohya = save_lora(tmp_path / "k.safetensors", model, "kohya", base="z-image")
    peft = save_lora(tmp_path / "p.safetensors", model, "peft", base="z-image")
    keys = load_file(str(kohya))
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in keys}
    comfy = _comfy_names(pipe.transformer)
    assert modules and modules <= comfy and all(m.startswith("diffusion_model.") for m in modules)
    assert all(keys[f"{m}.alpha"].item() == 1.0 for m in modules)
    peft_modules = {k.rsplit(".", 2)[0] for k in load_file(str(peft))}
    # 2 layers and a noise refiner, 8 modules each; the context refiner has no adaLN: 7
    assert peft_modules <= comfy and len(peft_modules) == len(modules) == 3 * 8 + 7
    assert load_lora(kohya).modules.keys() == load_lora(peft).modules.keys()
    converted = tmp_path / "c.safetensors"
    assert cli_main(["convert", str(peft), str(converted), "--to", "kohya"]) == 0
    assert load_file(str(converted)).keys() == keys.keys()
    assert cli_main(["inspect", str(kohya)]) == 0
    save_file(base, str(tmp_path / "base.safetensors"))
    assert cli_main(["merge", str(tmp_path / "base.safetensors"), str(tmp_path / "m.safetensors"),
                     "--lora", f"{kohya}:1.0"]) == 0
    merged = load_file(str(tmp_path / "m.safetensors"))
    want = {**base, **{f"{n}.weight": m.merged_weight() for n, m in lora_modules(model)}}
    assert merged.keys() == want.keys()
    for k, v in merged.items():
        torch.testing.assert_close(v, want[k], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_the_plan_of_a_tiny_run_is_within_5_percent_per_phase(digits_folder, tmp_path):
    """`plan_memory` of a tiny z-image run against the run as MemTracker measures it, every phase
    (the transformer pads captions to 32 tokens: the plan's full-length captions are exact here)."""
    from lora_lab.diffusion import TrainConfig
    from lora_lab.diffusion.trainer import PHASES
    from lora_lab.planning import plan_memory
    from lora_lab.planning.measure import measure_phases

    config = TrainConfig(model="z-image", dataset=str(digits_folder(2)), rank=16, steps=2, sample_steps=1,
                         progress=False, device="cpu", output=str(tmp_path))
    measured = measure_phases(config, ("torch",))["torch"]
    planned = plan_memory(config, cache=False).phases
    for phase in PHASES:
        assert planned[phase] == pytest.approx(measured[phase], rel=0.05), phase
