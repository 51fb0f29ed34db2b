"""diffusion/sampling.py: seeded sampling through the real pipelines, and the grid helper."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from lora_lab import models as M
from lora_lab.diffusion import image_grid, sample
from lora_lab.models import KINDS

SEED = 7
PROMPTS = ["a digit one", "a digit eight"]


@pytest.mark.parametrize("kind", KINDS)
def test_sample_is_seeded_and_in_range(kind):
    pipe = M.build_pipeline(kind, seed=SEED)
    a = sample(pipe, PROMPTS, seed=1, steps=2, guidance=1.0)
    assert a.shape == (2, 3, M.RESOLUTION, M.RESOLUTION) and a.dtype == torch.float32
    assert 0 <= a.min() and a.max() <= 1
    assert torch.equal(a, sample(pipe, PROMPTS, seed=1, steps=2, guidance=1.0))
    assert not torch.equal(a, sample(pipe, PROMPTS, seed=2, steps=2, guidance=1.0))


def test_sample_equals_the_pipeline_called_with_prompts():
    """`sample` is the pipeline's own sampler: same as calling it with the prompt strings."""
    pipe = M.build_pipeline("sd15", seed=SEED)
    ours = sample(pipe, PROMPTS, seed=3, steps=3, guidance=3.0)
    ref = pipe(PROMPTS, num_inference_steps=3, guidance_scale=3.0, height=M.RESOLUTION, width=M.RESOLUTION,
               generator=torch.Generator().manual_seed(3), output_type="pt").images
    torch.testing.assert_close(ours, ref.clamp(0, 1), rtol=1e-5, atol=1e-5)


def test_image_grid_places_images_row_major():
    imgs = torch.stack([torch.full((3, 2, 3), v) for v in (0.0, 0.25, 0.75, 1.0, 0.5)])  # (5, 3, 2, 3)
    grid = image_grid(imgs, rows=2, scale=2, pad=1)
    assert grid.size == (3 * (6 + 1) + 1, 2 * (4 + 1) + 1)  # (width, height): 3 columns, 2 rows
    px = grid.load()
    assert px[1, 1] == (0, 0, 0)                       # image 0, top-left
    assert px[1 + 7, 1] == (64, 64, 64)                # image 1: 0.25 * 255 rounded
    assert px[1 + 14, 1] == (191, 191, 191)            # image 2
    assert px[1, 1 + 5] == (255, 255, 255)             # image 3 starts row 2
    assert px[1 + 14, 1 + 5] == (128, 128, 128)        # the empty sixth cell stays grey padding
    assert px[0, 0] == (128, 128, 128)


def test_sample_with_a_lora_file_and_strengths(tmp_path):
    """A LoRA file at strength 1 gives the images of the model that carries that adapter; strength 0
    gives the base's; after the call the denoiser is the base again (same modules, same images)."""
    from lora_lab.formats import save_lora
    from lora_lab.lora import LoRAConfig, add_lora, lora_modules

    pipe = M.build_pipeline("sd15", seed=SEED)
    kw = {"seed": 4, "steps": 2, "guidance": 1.0}
    base = sample(pipe, PROMPTS, **kw)
    modules_before = [type(m) for m in pipe.unet.modules()]

    trained = M.build_pipeline("sd15", seed=SEED)
    add_lora(trained.unet, LoRAConfig(rank=4, alpha=4.0, targets=r".*attn[12]\.to_(q|k|v|out\.0)"))
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, m in lora_modules(trained.unet):
            m.up.copy_(torch.randn(m.up.shape, generator=g) * 0.3)  # as if trained: a visible change
    path = save_lora(tmp_path / "lora.safetensors", trained.unet, format="kohya", base="sd15")
    want = sample(trained, PROMPTS, **kw)
    assert (want - base).abs().max() > 0.01

    torch.testing.assert_close(sample(pipe, PROMPTS, **kw, loras=[(path, 1.0)]), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sample(pipe, PROMPTS, **kw, loras=[(path, 0.0)]), base, rtol=1e-5, atol=1e-5)
    half = sample(pipe, PROMPTS, **kw, loras=[(path, 0.5)])
    assert 0 < (half - base).abs().mean() < (want - base).abs().mean()
    assert [type(m) for m in pipe.unet.modules()] == modules_before
    assert torch.equal(sample(pipe, PROMPTS, **kw), base)


def test_non_finite_samples_warn_naming_the_vae_weight():
    """An Inf in the VAE decoder drew all-black samples without a word: a warning names the weight (the run
    and its LoRA are right: only the pictures are lost)."""
    pipe = M.build_pipeline("sd15", seed=SEED)
    with torch.no_grad():
        pipe.vae.decoder.conv_out.weight[0, 0, 0, 0] = float("inf")
    with pytest.warns(UserWarning, match=r"2 of 2 sample image\(s\) decoded to NaN/Inf .* the VAE's "
                                         r"decoder\.conv_out\.weight holds non-finite values"):
        images = sample(pipe, PROMPTS, seed=1, steps=2, guidance=1.0)
    assert images.shape[0] == 2
