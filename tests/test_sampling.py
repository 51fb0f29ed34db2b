"""diffusion/sampling.py: seeded sampling through the real pipelines, and the grid helper."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from lora_lab.diffusion import models as M
from lora_lab.diffusion.sampling import image_grid, sample

SEED = 7
PROMPTS = ["a digit one", "a digit eight"]


@pytest.mark.parametrize("kind", M.KINDS)
def test_sample_is_seeded_and_in_range(kind):
    pipe = M.build_pipeline(kind, seed=SEED)
    a = sample(pipe, PROMPTS, seed=1, steps=2)
    assert a.shape == (2, 3, M.RESOLUTION, M.RESOLUTION) and a.dtype == torch.float32
    assert 0 <= a.min() and a.max() <= 1
    assert torch.equal(a, sample(pipe, PROMPTS, seed=1, steps=2))
    assert not torch.equal(a, sample(pipe, PROMPTS, seed=2, steps=2))


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
