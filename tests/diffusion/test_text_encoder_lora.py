"""A LoRA on the CLIP text encoders (--text-encoder-lr): trained with its own lr, embeddings computed at each
step, saved with kohya's text-encoder names and PEFT's, which diffusers loads with the same output."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from lora_lab.diffusion import TrainConfig, train

FAST = {"rank": 4, "lr": 1e-3, "batch_size": 2, "sample_steps": 0, "progress": False, "seed": 5}


def test_trained_text_encoder_lora_loads_in_diffusers(digits_folder, tmp_path):
    from lora_lab.models import build_pipeline, shipped_base

    out = tmp_path / "te"
    result = train(TrainConfig(model="sd15", dataset=str(digits_folder(6)), output=str(out), steps=2,
                               text_encoder_lr=1e-2, caption_dropout=0.3, **FAST))
    te = result.pipe.text_encoder
    ups = [p for n, p in te.named_parameters() if n.endswith(".up")]
    assert ups and all(p.abs().max() > 0 for p in ups)  # trained (B starts at zero)
    assert any(n.startswith("text_encoder.") for n in result.adapted)
    kohya = set(load_file(str(out / "lora.safetensors")))
    assert any(k.startswith("lora_te_text_model_encoder_layers_0_self_attn_q_proj.") for k in kohya)
    assert any(k.startswith("lora_te_text_model_encoder_layers_0_mlp_fc1.") for k in kohya)
    assert any(k.startswith("lora_unet_") for k in kohya)
    peft = set(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert any(k.startswith("text_encoder.") and "lora_A" in k for k in peft)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = te(ids.to(te.device))[0].cpu()
        for name in ("pytorch_lora_weights.safetensors", "lora.safetensors"):  # PEFT, then kohya's names
            pipe = build_pipeline("sd15", shipped_base("sd15"))
            base = pipe.text_encoder(ids)[0]
            pipe.load_lora_weights(str(out / name))
            ref = pipe.text_encoder(ids)[0]
            assert (ref - base).abs().max() > 1e-4  # the LoRA changes the encoder
            torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_sdxl_saves_both_clip_encoders_with_te1_and_te2_names(tmp_path):
    from lora_lab.diffusion.trainer import add_adapter, text_encoder_adapters, write_lora
    from lora_lab.models import build_pipeline, model_kind

    kind = model_kind("sdxl")
    pipe = build_pipeline("sdxl")
    config = TrainConfig(model="sdxl", rank=2, text_encoder_lr=1e-4)
    add_adapter(pipe.unet, config, kind)
    wrapped, named = text_encoder_adapters(config, kind, pipe)
    assert "text_encoder.text_model.encoder.layers.0.self_attn.q_proj" in wrapped or any(
        w.startswith("text_encoder.") and w.endswith("self_attn.q_proj") for w in wrapped)
    assert {n.split(".")[0] for n, _ in named} == {"text_encoder", "text_encoder_2"}
    with torch.no_grad():
        for _, p in named:
            p.add_(0.1)
    files = {key: write_lora(kind, pipe, tmp_path / f"{key}.safetensors", fmt, config, 0)
             for key, fmt in (("lora_kohya", "kohya"), ("lora_diffusers", "peft"))}
    kohya = set(load_file(str(files["lora_kohya"])))
    assert {k.split("_text_model")[0] for k in kohya if k.startswith("lora_te")} == {"lora_te1", "lora_te2"}
    peft = {k.split(".")[0] for k in load_file(str(files["lora_diffusers"]))}
    assert peft == {"unet", "text_encoder", "text_encoder_2"}
