"""--flip: a flipped example trains on the VAE's latent of its mirrored image (cached beside the others), its
mask mirrored with it; the flips are drawn last from their own (seed, step) generator, so every other draw
of a step is the one it is without flip, and a step's draws do not depend on the steps before (resume)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lora_lab.diffusion import TrainConfig, encoded
from lora_lab.diffusion.encoded import EncodedExamples, encode_examples
from lora_lab.diffusion.objectives import FlowMatching
from lora_lab.diffusion.step import draw_step, micro_batch

N = 6


def _data(variants: int = 1) -> EncodedExamples:
    embeds = {"prompt_embeds": torch.arange(N * variants * 4.0).reshape(N * variants, 2, 2)}
    return EncodedExamples([torch.full((4, 2, 2), float(i)) for i in range(N)], embeds,
                           [f"c{i}" for i in range(N)], [(4, 4)] * N, variants=variants,
                           flipped=[torch.full((4, 2, 2), -float(i)) for i in range(N)])


@pytest.mark.parametrize("batch, accum, world", [(2, 1, 1), (1, 3, 2)])
def test_the_flips_come_last_and_leave_every_other_draw_as_it_was(batch, accum, world):
    objective, data, reg = FlowMatching(), _data(variants=3), _data()
    empty = {"prompt_embeds": torch.zeros(1, 2, 2)}
    fields = dict(model="sd3", seed=7, batch_size=batch, grad_accum=accum, caption_dropout=0.3)
    off, on = TrainConfig(**fields), TrainConfig(**fields, flip=True)
    flips = []
    for step in range(12):
        for rank in range(world):
            a = draw_step(off, objective, data, reg, empty, step, rank, world)
            b = draw_step(on, objective, data, reg, empty, step, rank, world)
            assert a.flip is None and len(b.flip) == batch * accum
            assert a.idx == b.idx and a.reg[0] == b.reg[0]
            for x, y in [(a.noise, b.noise), (a.t, b.t), (a.drop, b.drop), (a.variant, b.variant),
                         (a.reg[1], b.reg[1]), (a.reg[2], b.reg[2])]:
                assert torch.equal(x, y)
            flips += b.flip
    assert 0.25 < sum(flips) / len(flips) < 0.75  # about half the examples mirrored


def test_a_steps_flips_are_a_function_of_seed_and_step_alone():
    """What a resumed run relies on: step k's draws are the same whatever was drawn before (the global
    generator's state, the steps before), and another seed or step draws other flips."""
    objective, data = FlowMatching(), _data()
    config = TrainConfig(model="sd3", seed=3, batch_size=8, flip=True)
    torch.manual_seed(0)
    first = draw_step(config, objective, data, None, None, 5).flip
    for step in range(5):
        draw_step(config, objective, data, None, None, step)
    torch.manual_seed(123)
    torch.rand(10)
    assert draw_step(config, objective, data, None, None, 5).flip == first
    others = [draw_step(config, objective, data, None, None, s).flip for s in range(6, 10)]
    others.append(draw_step(TrainConfig(model="sd3", seed=4, batch_size=8, flip=True), objective, data, None,
                            None, 5).flip)
    assert all(o != first for o in others)


class _Images:
    """Three 8 x 8 images, each with a mask, as an ImageCaptionDataset gives them."""

    sizes = [(8, 8)] * 3
    captions = ["a", "b", "c"]

    def __len__(self):
        return 3

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        mask = torch.zeros(1, 8, 8)
        mask[..., :2] = 1.0  # the two left columns
        return {"image": torch.rand(3, 8, 8, generator=g) * 2 - 1, "mask": mask}


def _vae(pipe, images, generator=None):
    """A stand-in VAE that is not mirror-equivariant: each 2 x 2 block's mean plus a left-to-right ramp."""
    pooled = torch.nn.functional.avg_pool2d(images, 2)
    return pooled + torch.linspace(0, 1, pooled.shape[-1])


def test_a_flipped_example_trains_on_the_mirrored_images_latent(monkeypatch):
    monkeypatch.setattr(encoded, "encode_images", _vae)
    monkeypatch.setattr(encoded, "encode_captions", lambda pipe, c, store=None: {"e": torch.zeros(len(c), 1)})
    pipe = SimpleNamespace(vae=SimpleNamespace(device="cpu"))
    ds = _Images()
    plain, flip = encode_examples(pipe, ds, flip=False), encode_examples(pipe, ds, flip=True)
    assert plain.flipped is None
    for i in range(3):
        image = ds[i]["image"][None]
        assert torch.equal(flip.latents[i], plain.latents[i])  # the same latents as without flip
        assert torch.equal(flip.flipped[i], _vae(None, image.flip(-1))[0])  # the mirrored image's latent
        assert not torch.allclose(flip.flipped[i], flip.latents[i].flip(-1))  # not a mirrored latent
    torch.testing.assert_close(flip.masks[0], torch.tensor([[[1.0, 0, 0, 0]] * 4]))  # the area rule, 2 x 2
    config = TrainConfig(model="sd3", batch_size=3)
    draws = SimpleNamespace(idx=[2, 0, 1], noise=torch.zeros(3, 3, 4, 4), t=torch.zeros(3), drop=None,
                            reg=None, variant=None, flip=[True, False, True])
    batch = micro_batch(config, flip.select([0, 1, 2, 0]), None, None, draws, 0, torch.device("cpu"))
    torch.testing.assert_close(batch.x0, torch.stack([flip.flipped[2], flip.latents[0], flip.flipped[1]]))
    want = torch.stack([flip.masks[2].flip(-1), flip.masks[0], flip.masks[1].flip(-1)])
    torch.testing.assert_close(batch.mask, want)
    assert batch.mask[0, 0, 0].tolist() == [0.0, 0.0, 0.0, 1.0]  # mirrored with its image


@pytest.mark.slow
def test_a_resumed_flip_and_masked_run_ends_bit_for_bit(digits_folder, tmp_path):
    """A 2-step sd3 run with flip and a masked loss, its last checkpoint and LoRA files removed, resumed from
    step 1: the LoRA of the run never stopped, bit for bit (the flips are functions of seed and step)."""
    from PIL import Image
    from safetensors.torch import load_file

    from lora_lab.diffusion import train

    folder = digits_folder(count=4)
    for image in folder.glob("*.png"):
        mask = torch.zeros(32, 32, dtype=torch.uint8)
        mask[:, :16] = 255
        Image.fromarray(mask.numpy()).save(folder / f"{image.stem}.mask.png")
    out = tmp_path / "run"
    fields = dict(model="sd3", dataset=str(folder), output=str(out), steps=2, save_every=1, rank=4, lr=1e-2,
                  batch_size=2, flip=True, masked_loss=True, sample_steps=0, progress=False, seed=11)
    whole = train(TrainConfig(**fields))
    want = load_file(str(whole.outputs["lora_diffusers"]))
    (out / "checkpoints" / "step_0000002.pt").unlink()
    for name in ("lora.safetensors", "pytorch_lora_weights.safetensors"):
        (out / name).unlink()
    resumed = train(TrainConfig(**fields, resume=True))
    got = load_file(str(resumed.outputs["lora_diffusers"]))
    assert resumed.losses == whole.losses
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
