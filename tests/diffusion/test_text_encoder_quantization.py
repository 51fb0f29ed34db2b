"""Text encoders quantized for the cache phase (`text_encoder_quantization`, `stages.quantize_encoders`): the
embeddings cached within the format's error of the float encoders', the run trains on them, the disk cache
keeps them apart from the float encoders' entries; the option's refusals and its flag."""

from __future__ import annotations

import json

import pytest
from torch import nn

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from lora_lab.cli import build_parser
from lora_lab.diffusion import TrainConfig, TrainConfigError, train
from lora_lab.quant import QuantLinear

RUN = dict(model="flux", device="cpu", rank=4, lr=1e-3, steps=2, progress=False, sample_steps=0, seed=3)
# the embeddings' relative error ||q - f|| / ||f|| at most, per format (measured on the tiny flux base, T5 and
# CLIP both quantized: fp8 0.036-0.042, nf4 0.14)
MAX_ERROR = {"fp8": 0.08, "nf4": 0.25}

pytestmark = pytest.mark.xdist_group("test_train")


@pytest.mark.parametrize("fields, why", [
    ({"text_encoder_quantization": "int4"}, "must be one of int8, int8-block, nf4, fp8, fp8-row"),
    ({"model": "sd15", "text_encoder_quantization": "nf4", "text_encoder_lr": 1e-4}, "with text_encoder_lr"),
])
def test_a_format_it_does_not_know_or_a_trained_encoder_is_refused(fields, why):
    with pytest.raises(TrainConfigError, match=rf"^TrainConfig.text_encoder_quantization=.*{why}"):
        TrainConfig(**fields)


def test_the_flag_is_the_field():
    parse = build_parser().parse_args
    assert parse(["train", "--text-encoder-quantization", "nf4"]).text_encoder_quantization == "nf4"
    assert parse(["plan", "--text-encoder-quantization", "fp8"]).text_encoder_quantization == "fp8"
    assert parse(["train"]).text_encoder_quantization is None


def relative_error(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.slow
def test_quantized_encoders_cache_near_the_float_embeddings_apart_on_disk_and_the_run_trains(
        cache_phase, digits_folder, tmp_path):
    data, cache = str(digits_folder(4)), str(tmp_path / "cache")
    runs = {fmt: cache_phase(TrainConfig(**RUN, dataset=data, cache_dir=cache, keep_encoders=True,
                                         text_encoder_quantization=fmt, output=str(tmp_path / str(fmt))))
            for fmt in (None, "fp8", "nf4")}
    assert runs[None].store.stats["written"] > 0
    for fmt in MAX_ERROR:
        run = runs[fmt]
        assert run.store.stats["hits"] == 0  # the float encoders' entries are not theirs
        for name in ("text_encoder", "text_encoder_2"):  # CLIP and T5: every Linear holds codes
            encoder = getattr(run.pipe, name)
            assert not any(type(m) is nn.Linear for m in encoder.modules())
            assert {m.fmt for m in encoder.modules() if isinstance(m, QuantLinear)} == {fmt}
        errors = {k: relative_error(v, runs[None].data.embeds[k]) for k, v in run.data.embeds.items()}
        assert all(0 < e < MAX_ERROR[fmt] for e in errors.values()), (fmt, errors)
    fp8, nf4 = ({k: relative_error(runs[f].data.embeds[k], runs[None].data.embeds[k])
                 for k in runs[None].data.embeds} for f in ("fp8", "nf4"))
    assert all(fp8[k] < nf4[k] for k in fp8)  # 8 bits nearer than 4

    out = tmp_path / "trained"
    result = train(TrainConfig(**RUN, dataset=data, text_encoder_quantization="nf4", output=str(out)))
    losses = [json.loads(line)["loss"] for line in (out / "loss.jsonl").read_text().splitlines()]
    assert len(losses) == RUN["steps"] and all(0 < loss < 10 for loss in losses)
    assert result.outputs["lora_kohya"].is_file()
    # it trained on the quantized encoders' embeddings (those of the cache phase above, bit for bit)
    assert all((result.cached.data.embeds[k] == v).all() for k, v in runs["nf4"].data.embeds.items())
