"""The real models' configurations, as data, and a builder that makes them at full size without weights.

    REAL_MODELS                         -> the names: sd15, sdxl, sd35-medium, sd35-large, flux-dev,
                                           chroma1-hd, z-image-turbo, qwen-image, flux2-dev
    REAL_CONFIGS[name][component]       -> (class name, config dict), numbers from the public
                                           config.json files
    real_kind(name)                     -> the trainer's kind of a model (a name in models.KINDS)
    build_real(name, components=None)   -> {component: module}, built in the current device context
                                           (under a FakeTensorMode or on "meta": no memory is allocated)

Each config is copied from the model's public `config.json` (the Hugging Face repository named in the
comment above it); only the fields that change the architecture are written out, the rest are the
classes' defaults, which equal the published values. `tests/models/test_real.py` checks the parameter counts
against the published totals (SDXL UNet 2.567 B, Flux.1-dev 11.9 B, SD3.5 Large 8.1 B, SD3.5 Medium
2.5 B, Chroma1-HD 8.9 B, T5-XXL encoder 4.76 B, CLIP-L text 123 M, OpenCLIP bigG text 695 M, Z-Image 6.15 B,
Qwen3-4B 4.02 B; Qwen-Image's 20.4 B transformer and 8.29 B Qwen2.5-VL-7B: tests/models/test_qwen_image.py).
"""

from __future__ import annotations

from . import flux2, qwen_image
from .kinds import ModelLoadError

# diffusers and transformers are imported where used: ~4 s to import, which `import lora_lab` should not pay.

# ----------------------------------------------------------------------------- text encoders

# openai/clip-vit-large-patch14 (text_config), as used by stable-diffusion-v1-5/text_encoder,
# stabilityai/stable-diffusion-xl-base-1.0/text_encoder, SD3.5 text_encoder and FLUX.1-dev text_encoder.
CLIP_L = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
          "num_attention_heads": 12, "max_position_embeddings": 77, "projection_dim": 768,
          "hidden_act": "quick_gelu"}
# laion/CLIP-ViT-bigG-14-laion2B-39B-b160k (text), as stabilityai/stable-diffusion-xl-base-1.0/text_encoder_2
# and SD3.5 text_encoder_2 (CLIPTextModelWithProjection).
CLIP_BIGG = {"vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
             "num_attention_heads": 20, "max_position_embeddings": 77, "projection_dim": 1280,
             "hidden_act": "gelu"}
# google/t5-v1_1-xxl encoder, as stabilityai/stable-diffusion-3.5-large/text_encoder_3 and
# black-forest-labs/FLUX.1-dev/text_encoder_2 (T5EncoderModel).
T5_XXL = {"vocab_size": 32128, "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24,
          "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
          "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0, "is_encoder_decoder": False}

# Tongyi-MAI/Z-Image-Turbo/text_encoder/config.json (Qwen3-4B; the pipeline loads it as Qwen3Model: no
# lm_head, the embeddings tied)
QWEN3_4B = {"vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645}
# black-forest-labs/FLUX.2-dev/text_encoder/config.json: Mistral Small 3.1/3.2 24B
# (Mistral3ForConditionalGeneration: the Mistral text model with its lm_head, a Pixtral vision tower, its
# patch merger and projector; Tekken's vocabulary, bos 1, eos 2, pad 11, [IMG] 10).
MISTRAL_SMALL_3 = {
    "text_config": {"vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768,
                    "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "head_dim": 128,
                    "max_position_embeddings": 131072, "rope_theta": 1e9, "rms_norm_eps": 1e-5,
                    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 11},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "head_dim": 64, "patch_size": 14, "image_size": 1540},
    "image_token_index": 10, "spatial_merge_size": 2, "projector_hidden_act": "gelu",
    "multimodal_projector_bias": False, "tie_word_embeddings": False}

# ----------------------------------------------------------------------------- VAEs

_VAE_SD = {"in_channels": 3, "out_channels": 3, "latent_channels": 4,
           "block_out_channels": [128, 256, 512, 512],
           "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
           "layers_per_block": 2, "norm_num_groups": 32}
# stable-diffusion-v1-5/stable-diffusion-v1-5/vae/config.json
VAE_SD15 = {**_VAE_SD, "sample_size": 512, "scaling_factor": 0.18215}
# stabilityai/stable-diffusion-xl-base-1.0/vae/config.json
VAE_SDXL = {**_VAE_SD, "sample_size": 1024, "scaling_factor": 0.13025}
# stabilityai/stable-diffusion-3.5-large/vae/config.json (the same VAE in 3.5 Medium)
VAE_SD3 = {**_VAE_SD, "latent_channels": 16, "sample_size": 1024, "scaling_factor": 1.5305,
           "shift_factor": 0.0609, "use_quant_conv": False, "use_post_quant_conv": False}
# black-forest-labs/FLUX.1-dev/vae/config.json
VAE_FLUX = {**_VAE_SD, "latent_channels": 16, "sample_size": 1024, "scaling_factor": 0.3611,
            "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False}

# black-forest-labs/FLUX.2-dev/vae/config.json (AutoencoderKLFlux2: 32 channels, batch norm over 2x2 patches)
VAE_FLUX2 = {**_VAE_SD, "latent_channels": 32, "sample_size": 1024, "batch_norm_eps": 1e-4,
             "batch_norm_momentum": 0.1, "patch_size": [2, 2]}

# ----------------------------------------------------------------------------- denoisers

# stable-diffusion-v1-5/stable-diffusion-v1-5/unet/config.json
UNET_SD15 = {"sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
             "block_out_channels": [320, 640, 1280, 1280],
             "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
             "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
             "cross_attention_dim": 768, "attention_head_dim": 8, "norm_num_groups": 32}
# stabilityai/stable-diffusion-xl-base-1.0/unet/config.json
UNET_SDXL = {"sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
             "block_out_channels": [320, 640, 1280],
             "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
             "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
             "transformer_layers_per_block": [1, 2, 10], "attention_head_dim": [5, 10, 20],
             "cross_attention_dim": 2048, "use_linear_projection": True, "addition_embed_type": "text_time",
             "addition_time_embed_dim": 256, "projection_class_embeddings_input_dim": 2816,
             "norm_num_groups": 32}
# stabilityai/stable-diffusion-3.5-medium/transformer/config.json (MMDiT-X: dual attention in blocks 0-12)
SD35_MEDIUM = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
               "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
               "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 384,
               "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm"}
# stabilityai/stable-diffusion-3.5-large/transformer/config.json
SD35_LARGE = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 38,
              "attention_head_dim": 64, "num_attention_heads": 38, "joint_attention_dim": 4096,
              "caption_projection_dim": 2432, "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
              "qk_norm": "rms_norm"}
# black-forest-labs/FLUX.1-dev/transformer/config.json
FLUX_DEV = {"patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19,
            "num_single_layers": 38,
            "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
            "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]}
# lodestones/Chroma1-HD/transformer/config.json (ChromaTransformer2DModel; Flux.1-schnell's blocks without
# their modulation layers, an approximator of 5 layers of width 5120 from 64 channels instead; its defaults in
# diffusers 0.42 are these values, and InvokeAI's CHROMA_TRANSFORMER_CONFIG spells the same)
CHROMA1_HD = {"patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19,
              "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
              "joint_attention_dim": 4096, "axes_dims_rope": [16, 56, 56], "approximator_num_channels": 64,
              "approximator_hidden_dim": 5120, "approximator_layers": 5}
# Tongyi-MAI/Z-Image-Turbo/transformer/config.json (Tongyi-MAI/Z-Image's is the same architecture); its
# vae/config.json is FLUX.1's VAE (VAE_FLUX)
Z_IMAGE = {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840, "n_layers": 30,
           "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-5, "qk_norm": True,
           "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48],
           "axes_lens": [1536, 512, 512]}

# Qwen/Qwen-Image/transformer/config.json (20.4 B)
QWEN_IMAGE = {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
              "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
              "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]}
# Qwen/Qwen-Image/vae/config.json (AutoencoderKLQwenImage; latents_mean / latents_std: the class defaults,
# which are the published values)
VAE_QWEN_IMAGE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                  "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0}
# Qwen/Qwen-Image/text_encoder/config.json: Qwen2.5-VL-7B-Instruct (Qwen2_5_VLForConditionalGeneration, 8.3 B
# with its vision tower and lm_head)
QWEN25_VL_7B = {
    "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                    "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
                    "pad_token_id": 151643, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                      "in_chans": 3, "hidden_act": "silu"},
    "tie_word_embeddings": False,
}

# black-forest-labs/FLUX.2-dev/transformer/config.json (8 double-stream, 48 single-stream blocks, width 6144)
FLUX2_DEV = {"patch_size": 1, "in_channels": 128, "out_channels": None, "num_layers": 8,
             "num_single_layers": 48, "attention_head_dim": 128, "num_attention_heads": 48,
             "joint_attention_dim": 15360, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
             "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "guidance_embeds": True}

REAL_CONFIGS: dict[str, dict[str, tuple[str, dict]]] = {
    "sd15": {"unet": ("UNet2DConditionModel", UNET_SD15), "vae": ("AutoencoderKL", VAE_SD15),
             "text_encoder": ("CLIPTextModel", CLIP_L)},
    "sdxl": {"unet": ("UNet2DConditionModel", UNET_SDXL), "vae": ("AutoencoderKL", VAE_SDXL),
             "text_encoder": ("CLIPTextModel", CLIP_L),
             "text_encoder_2": ("CLIPTextModelWithProjection", CLIP_BIGG)},
    "sd35-medium": {"transformer": ("SD3Transformer2DModel", SD35_MEDIUM), "vae": ("AutoencoderKL", VAE_SD3),
                    "text_encoder": ("CLIPTextModelWithProjection", CLIP_L),
                    "text_encoder_2": ("CLIPTextModelWithProjection", CLIP_BIGG),
                    "text_encoder_3": ("T5EncoderModel", T5_XXL)},
    "sd35-large": {"transformer": ("SD3Transformer2DModel", SD35_LARGE), "vae": ("AutoencoderKL", VAE_SD3),
                   "text_encoder": ("CLIPTextModelWithProjection", CLIP_L),
                   "text_encoder_2": ("CLIPTextModelWithProjection", CLIP_BIGG),
                   "text_encoder_3": ("T5EncoderModel", T5_XXL)},
    "flux-dev": {"transformer": ("FluxTransformer2DModel", FLUX_DEV), "vae": ("AutoencoderKL", VAE_FLUX),
                 "text_encoder": ("CLIPTextModel", CLIP_L), "text_encoder_2": ("T5EncoderModel", T5_XXL)},
    # lodestones/Chroma1-HD: FLUX.1's VAE (vae/config.json) and T5-XXL (text_encoder/config.json) alone
    "chroma1-hd": {"transformer": ("ChromaTransformer2DModel", CHROMA1_HD),
                   "vae": ("AutoencoderKL", VAE_FLUX), "text_encoder": ("T5EncoderModel", T5_XXL)},
    "z-image-turbo": {"transformer": ("ZImageTransformer2DModel", Z_IMAGE),
                      "vae": ("AutoencoderKL", VAE_FLUX), "text_encoder": ("Qwen3Model", QWEN3_4B)},
    "qwen-image": {"transformer": ("QwenImageTransformer2DModel", QWEN_IMAGE),
                   "vae": ("AutoencoderKLQwenImage", VAE_QWEN_IMAGE),
                   "text_encoder": ("Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B)},
    "flux2-dev": {"transformer": ("Flux2Transformer2DModel", FLUX2_DEV),
                  "vae": ("AutoencoderKLFlux2", VAE_FLUX2),
                  "text_encoder": ("Mistral3ForConditionalGeneration", MISTRAL_SMALL_3)},
}
# The schedulers' training settings (each model's scheduler/scheduler_config.json), in the scheduler classes
# lora_lab's kinds use: what the trainer's objective reads (betas, prediction type, flow shift).
_DDPM = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
         "beta_schedule": "scaled_linear", "prediction_type": "epsilon", "timestep_spacing": "leading",
         "steps_offset": 1}
REAL_SCHEDULERS = {
    "sd15": _DDPM,
    "sdxl": _DDPM,
    "sd35-medium": {"num_train_timesteps": 1000, "shift": 3.0},
    "sd35-large": {"num_train_timesteps": 1000, "shift": 3.0},
    "flux-dev": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                 "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096},
    # Flux's scheduler settings, which ChromaPipeline reads to sample (mu from the image's tokens); training
    # does not shift (the kind's own_flow: the authors' trainer draws its sigmas unshifted)
    "chroma1-hd": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                   "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096},
    "z-image-turbo": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
    "qwen-image": qwen_image.SCHEDULER,
    "flux2-dev": flux2.SCHEDULER,  # black-forest-labs/FLUX.2-dev/scheduler/scheduler_config.json
}
REAL_MODELS = tuple(REAL_CONFIGS)
REAL_PREFIX = "real:"  # a base spelled "real:sdxl": the published configs with seeded random weights
_KIND = {"sd15": "sd15", "sdxl": "sdxl", "sd35-medium": "sd3", "sd35-large": "sd3", "flux-dev": "flux",
         "chroma1-hd": "chroma", "z-image-turbo": "z-image", "qwen-image": "qwen-image", "flux2-dev": "flux2"}
# the real model a kind plans by default (`lora-lab plan --model sd3`)
REAL_DEFAULT = {"sd15": "sd15", "sdxl": "sdxl", "sd3": "sd35-large", "flux": "flux-dev",
                "chroma": "chroma1-hd", "z-image": "z-image-turbo", "qwen-image": "qwen-image",
                "flux2": "flux2-dev"}
# Text tokens per prompt the pipelines use: CLIP 77; SD3 adds 256 T5 tokens after 77 CLIP; Flux and Chroma
# 512 T5; Z-Image at most 512 Qwen3 tokens (the chat template's and the caption's: a plan counts all 512);
# Qwen-Image its prompt's tokens after the template's dropped prefix; Flux.2 512 tokens of the chat (system
# message included)
TEXT_TOKENS = {"sd15": 77, "sdxl": 77, "sd35-medium": 77 + 256, "sd35-large": 77 + 256, "flux-dev": 512,
               "chroma1-hd": 512, "z-image-turbo": 512, "qwen-image": qwen_image.PROMPT_TOKENS,
               "flux2-dev": flux2.PIPELINE_TOKENS}


def real_kind(name: str) -> str:
    """The trainer's model kind (a name in models.KINDS) of a real model name."""
    if name not in _KIND:
        raise ModelLoadError(f"unknown real model {name!r}; choose one of {', '.join(REAL_MODELS)}")
    return _KIND[name]


def _build(class_name: str, cfg: dict):
    import diffusers
    import transformers

    if class_name == "Qwen3Model":
        return transformers.Qwen3Model(transformers.Qwen3Config(**cfg))
    if class_name.startswith("Qwen2_5_VL"):
        return qwen_image.text_encoder(cfg)
    if class_name.startswith("Mistral3"):
        return flux2.text_encoder(cfg)
    if class_name.startswith(("CLIP", "T5")):
        config_cls = transformers.T5Config if class_name.startswith("T5") else transformers.CLIPTextConfig
        return getattr(transformers, class_name)(config_cls(**cfg))
    return getattr(diffusers, class_name)(**cfg)


def build_real(name: str, components: list[str] | tuple[str, ...] | None = None) -> dict:
    """The model's components at full size, in eval mode, built in the caller's device context.

    Call it under `torch.device("meta")` or a `FakeTensorMode` (as `lora_lab.planning` does): on a real
    device it allocates every weight (SDXL's UNet alone is 10 GiB in fp32).
    """
    real_kind(name)
    cfgs = REAL_CONFIGS[name]
    wanted = list(cfgs) if components is None else list(components)
    unknown = [c for c in wanted if c not in cfgs]
    if unknown:
        raise ModelLoadError(f"{name} has no component(s) {unknown}; it has {', '.join(cfgs)}")
    return {c: _build(*cfgs[c]).eval() for c in wanted}
