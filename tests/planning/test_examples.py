"""planning/examples.py: the examples a plan counts are the ones the trainer caches (folders, [[datasets]]
tables with repeats, kohya's N_name/ folders, the held-out split, caption variants), and a plan made from the
config alone caches them (planning/run.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lora_lab.diffusion import TrainConfig
from lora_lab.diffusion.data import DatasetError
from lora_lab.diffusion.datasets import data_sources, held_out, open_images
from lora_lab.planning.examples import count_examples
from lora_lab.planning.run import plan_run

SIZES = [(24, 24), (16, 32), (32, 16), (24, 24), (24, 24)]


@pytest.fixture(scope="module")
def layout(digits_folder, tmp_path_factory):
    """A kohya folder (3_a: 3 images, 2_b: 2), a plain folder of mixed sizes, a regularization folder."""
    kohya = tmp_path_factory.mktemp("kohya")
    for name, count, first in (("3_a", 3, 0), ("2_b", 2, 10)):
        digits_folder(count=count, first=first).rename(kohya / name)
    return {"kohya": kohya, "mixed": digits_folder(sizes=SIZES, first=20),
            "reg": digits_folder(count=4, first=40)}


@pytest.mark.parametrize("buckets", [False, True])
def test_the_counted_examples_are_the_trainers(layout, buckets):
    """Each image's size (its bucket, from the header), caption and repeats, as the trainer opens them."""
    config = TrainConfig(datasets=[{"path": str(layout["kohya"]), "repeats": 2},
                                   {"path": str(layout["mixed"]), "repeats": 3}],
                         reg_dataset=str(layout["reg"]), buckets=buckets, validation_split=0.3,
                         shuffle_captions=True, caption_variants=4)
    counts = count_examples(config, 32)
    sources = data_sources(config)
    train = open_images([s for s in sources if not s.is_reg], config, 32)
    reg = open_images([s for s in sources if s.is_reg], config, 32)
    assert (counts.train.sizes, counts.train.captions, counts.train.repeats) == \
        (train.sizes, train.captions, train.repeats)
    assert counts.train.repeats == [4] * 2 + [6] * 3 + [3] * 5  # kohya's N times the table's (2_b, 3_a)
    assert (counts.reg.sizes, counts.reg.repeats) == (reg.sizes, reg.repeats)
    assert counts.held_out == held_out(10, 0.3) and counts.variants == 4
    assert len(set(counts.train.sizes)) == (3 if buckets else 1)


def test_a_folder_without_images_or_a_missing_caption_is_the_trainers_error(layout, tmp_path):
    with pytest.raises(DatasetError, match="no images"):
        count_examples(TrainConfig(dataset=str(tmp_path)), 16)
    (tmp_path / "x.png").write_bytes((layout["reg"] / "00.png").read_bytes())
    with pytest.raises(DatasetError, match="no caption file x.txt"):
        count_examples(TrainConfig(dataset=str(tmp_path)), 16)


def test_a_plan_caches_what_the_configs_data_hold(layout):
    """On the CPU the cache is on the device: each repeat of an example adds its caption's embeddings to the
    cache (a copy per repeat), each caption variant too; the latents are per image."""
    kw = dict(model="sd15", rank=4, sample_steps=0, mixed_precision="no", device="cpu")

    def cached(**data) -> int:
        return plan_run(TrainConfig(**kw, **data), device="cpu").parts["cached data"]

    once = cached(dataset=str(layout["reg"]))  # 4 images, once
    twice = cached(datasets=[{"path": str(layout["reg"]), "repeats": 2}])
    variants = cached(dataset=str(layout["reg"]), shuffle_captions=True, caption_variants=3)
    embed = twice - once  # 4 more rows of embeddings
    assert embed > 0
    assert variants - once == 2 * embed  # 4 examples x 3 variants: 8 more rows
