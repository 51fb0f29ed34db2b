"""diffusion/diskcache.py: the cache phase on disk. A run with it trains bit for bit as one without; a second
run reads every entry and calls no encoder; a changed image or caption rebuilds only its encoder call, to the
bits a run without the cache computes; a corrupt or truncated entry is rebuilt with a warning; a cache folder
among the inputs is refused."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from diffusers.models.autoencoders.vae import Encoder as VAEEncoder
from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

from lora_lab.diffusion.config import TrainConfig, TrainConfigError
from lora_lab.diffusion.trainer import train

ENCODERS = (VAEEncoder, CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel)
RUN = dict(model="sdxl", device="cpu", rank=4, lr=1e-3, batch_size=2, steps=3, progress=False, seed=3)
# caption variants, the empty caption and the sample prompts: every kind of entry
EVERY_ENTRY = dict(shuffle_captions=True, caption_variants=2, caption_dropout=0.2)

pytestmark = pytest.mark.xdist_group("test_train")


@contextlib.contextmanager
def encoder_calls():
    """Counts the forward calls of the VAE's encoder and the text encoders while in the block."""
    calls = {"n": 0}

    def hook(module, args, output):
        if isinstance(module, ENCODERS):
            calls["n"] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


def same_bits(a, b) -> bool:
    """Whether two cache phases' results hold the same tensors, bit for bit."""
    def flat(run):
        out = {f"latent{i}": t for i, t in enumerate(run.data.latents)}
        out.update({f"embed {k}": v for k, v in run.data.embeds.items()})
        out.update({f"empty {k}": v for k, v in (run.empty or {}).items()})
        out.update({f"prompt {k}": v for k, v in (run.samples[1] if run.samples else {}).items()})
        return out

    fa, fb = flat(a), flat(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def losses(output: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (output / "loss.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_second_run_reads_the_cache_and_trains_bit_for_bit(cache_phase, digits_folder, tmp_path):
    data = str(digits_folder(6))
    fields = dict(**RUN, **EVERY_ENTRY, dataset=data, sample_steps=0)
    plain = train(TrainConfig(**fields, output=str(tmp_path / "a")))
    cache = str(tmp_path / "cache")
    with encoder_calls() as first:  # the first run's cache phase (its bits: the test below)
        cache_phase(TrainConfig(**fields, cache_dir=cache, output=str(tmp_path / "b")))
    with encoder_calls() as second:
        result = train(TrainConfig(**fields, cache_dir=cache, output=str(tmp_path / "c")))
    assert first["n"] > 0 and second["n"] == 0, (first, second)
    assert losses(tmp_path / "a") == losses(tmp_path / "c")
    assert len(losses(tmp_path / "a")) == RUN["steps"]
    assert plain.outputs.keys() == result.outputs.keys()


def test_the_cache_phase_is_the_same_without_the_cache_with_it_and_read_back(cache_phase, digits_folder,
                                                                             tmp_path):
    data = str(digits_folder(6))
    fields = dict(**RUN, **EVERY_ENTRY, dataset=data, sample_steps=1, validation_split=0.2)
    plain = cache_phase(TrainConfig(**fields, output=str(tmp_path / "a")))
    written = cache_phase(TrainConfig(**fields, output=str(tmp_path / "b"), cache_to_disk=True))
    assert written.store.stats == {"hits": 0, "written": written.store.stats["written"], "rebuilt": 0}
    shutil.copytree(tmp_path / "b" / "cache", tmp_path / "c" / "cache")  # a resumed run's folder
    with encoder_calls() as calls:
        read = cache_phase(TrainConfig(**fields, output=str(tmp_path / "c"), cache_to_disk=True))
    assert calls["n"] == 0
    assert read.store.stats == {"hits": written.store.stats["written"], "written": 0, "rebuilt": 0}
    assert same_bits(plain, written) and same_bits(plain, read)
    assert all(torch.equal(a, b) for a, b in zip(plain.val.latents, read.val.latents))
    # the read latents are views of the cache's files, not copies in the process's memory
    assert all(not t.untyped_storage().resizable() for t in read.data.latents)


@pytest.mark.slow
def test_a_changed_image_or_caption_rebuilds_only_its_encoder_call(cache_phase, digits_folder, tmp_path):
    src = digits_folder(20)  # 32 x 32: two VAE calls (16 images, 4); one text call (10 distinct captions)
    data = tmp_path / "data"
    shutil.copytree(src, data)
    cache = str(tmp_path / "cache")
    fields = dict(**RUN, dataset=str(data), cache_dir=cache, sample_steps=0)
    cache_phase(TrainConfig(**fields, output=str(tmp_path / "a")))
    shutil.copy(src / "05.png", data / "02.png")  # image 2: the first VAE call
    (data / "18.txt").write_text("a digit, edited")  # a caption of the second text call
    changed = cache_phase(TrainConfig(**fields, output=str(tmp_path / "b")))
    assert len(set(changed.data.captions)) <= 16  # one text call, its captions changed: written again
    assert changed.store.stats == {"hits": 1, "written": 1 + 1, "rebuilt": 0}  # the second VAE call read
    plain = cache_phase(TrainConfig(**{**fields, "cache_dir": None}, output=str(tmp_path / "c")))
    assert same_bits(plain, changed)  # the later VAE call's noise: the generator's state as stored


def test_a_corrupt_or_truncated_entry_is_rebuilt_with_a_warning(cache_phase, digits_folder, tmp_path):
    data = str(digits_folder(4))
    cache = tmp_path / "cache"
    fields = dict(**RUN, dataset=data, cache_dir=str(cache), sample_steps=0)
    first = cache_phase(TrainConfig(**fields, output=str(tmp_path / "a")))
    entries = sorted(cache.rglob("*.safetensors"))
    images = next(p for p in entries if p.parts[-3] == "images")
    text = next(p for p in entries if p.parts[-3] == "text")
    raw = bytearray(images.read_bytes())
    raw[-5] ^= 0xFF  # one bit pattern of a latent changed
    images.write_bytes(bytes(raw))
    text.write_bytes(text.read_bytes()[:-100])  # truncated
    with pytest.warns(UserWarning, match="rebuilt") as caught:
        again = cache_phase(TrainConfig(**fields, output=str(tmp_path / "b")))
    messages = " ".join(str(w.message) for w in caught)
    assert "checksum" in messages and "truncated" in messages
    assert again.store.stats["rebuilt"] == 2 and again.store.stats["written"] == 2
    assert same_bits(first, again)
    third = cache_phase(TrainConfig(**fields, output=str(tmp_path / "c")))
    assert third.store.stats == {"hits": len(entries), "written": 0, "rebuilt": 0}


def test_a_cache_folder_among_the_inputs_or_given_twice_is_refused(digits_folder, tmp_path):
    data = digits_folder(2)
    with pytest.raises(TrainConfigError, match="cache_dir.*inside the dataset folder"):
        TrainConfig(dataset=str(data), cache_dir=str(data / "cache"), output=str(tmp_path / "o"))
    with pytest.raises(TrainConfigError, match="cache_to_disk.*and cache_dir both given"):
        TrainConfig(dataset=str(data), cache_dir=str(tmp_path / "c"), cache_to_disk=True,
                    output=str(tmp_path / "o"))
    (tmp_path / "file").write_text("")
    with pytest.raises(TrainConfigError, match="cache_dir.*is a file"):
        TrainConfig(dataset=str(data), cache_dir=str(tmp_path / "file"), output=str(tmp_path / "o"))
    TrainConfig(dataset=str(data), cache_dir=str(tmp_path / "o" / "cache"), output=str(tmp_path / "o"))


def test_mirrored_latents_and_masks_are_cached_and_an_edited_mask_is_read_again(cache_phase, digits_folder,
                                                                                tmp_path):
    from PIL import Image

    data = tmp_path / "data"
    shutil.copytree(digits_folder(4), data)
    for i in range(4):  # the left half trains
        Image.fromarray((torch.arange(32) < 16).to(torch.uint8).mul(255).expand(32, 32).numpy()).save(
            data / f"{i:02d}.mask.png")
    cache = str(tmp_path / "cache")
    fields = dict(**RUN, dataset=str(data), sample_steps=0, flip=True, masked_loss=True)

    def tensors(run):
        return [*run.data.latents, *run.data.flipped, *run.data.masks]

    plain = cache_phase(TrainConfig(**fields, output=str(tmp_path / "a")))
    cache_phase(TrainConfig(**fields, cache_dir=cache, output=str(tmp_path / "b")))
    with encoder_calls() as calls:
        read = cache_phase(TrainConfig(**fields, cache_dir=cache, output=str(tmp_path / "c")))
    assert calls["n"] == 0 and len(read.data.flipped) == len(read.data.masks) == 4
    assert all(torch.equal(a, b) for a, b in zip(tensors(plain), tensors(read), strict=True))
    Image.fromarray(torch.full((32, 32), 255, dtype=torch.uint8).numpy()).save(data / "01.mask.png")
    edited = cache_phase(TrainConfig(**fields, cache_dir=cache, output=str(tmp_path / "d")))
    assert edited.store.stats["written"] == 1  # the unmirrored call holds the masks; the mirrored one is read
    assert torch.equal(edited.data.masks[1], torch.ones_like(edited.data.masks[1]))
