"""A training run one can watch (diffusion/watch.py, datasets.py, runfile.py): the validation loss on held-out
examples, samples during training, loss.jsonl and TensorBoard, a LoRA file per checkpoint, a TOML run file,
several folders with repeats and caption shuffling.

One small run (sd15, 6 steps, started from a TOML file with two folders) is shared by the tests that read
its outputs; one shorter run repeats it from its config.json."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from safetensors import safe_open
from safetensors.torch import load_file

from lora_lab.cli import main as cli_main
from lora_lab.diffusion import TrainConfig, TrainConfigError, train
from lora_lab.diffusion.datasets import caption_variant, data_sources, encode_run_data, sources_fingerprint
from lora_lab.diffusion.objectives import DDPM, FlowMatching
from lora_lab.diffusion.runfile import config_from_file
from lora_lab.diffusion.watch import validation_loss, validation_timesteps
from lora_lab.models import model_kind

SEED = 7
STEPS = 6


def _toml(settings: dict, datasets: list[dict] = ()) -> str:
    """A TOML run file of flat settings (strings, numbers, booleans, lists of strings) and [[datasets]]."""
    def value(v):
        return json.dumps(v)  # JSON's strings, numbers, lists and true/false are TOML's too

    lines = [f"{k} = {value(v)}" for k, v in settings.items() if v is not None]
    for table in datasets:
        lines += ["", "[[datasets]]", *(f"{k} = {value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def folders(digits_folder, tmp_path_factory) -> dict[str, Path]:
    """kohya's layout: parent/2_digits/ (4 images, tags "digit, <name>, white"); and a plain folder of 2
    images whose captions are .caption files."""
    parent = tmp_path_factory.mktemp("kohya")
    shutil.copytree(digits_folder(4, caption="digit, {name}, white"), parent / "2_digits")
    other = digits_folder(2, first=4, caption="digit, {name}, white")
    for txt in other.glob("*.txt"):
        txt.rename(txt.with_suffix(".caption"))
    return {"kohya": parent, "other": other}


@pytest.fixture(scope="module")
def run(folders, tmp_path_factory):
    """The shared run, started like `lora-lab train --config run.toml`: its output folder and result."""
    out = tmp_path_factory.mktemp("run")
    toml = out.parent / f"{out.name}.toml"
    toml.write_text(_toml(
        {"model": "sd15", "output": str(out), "steps": STEPS, "rank": 4, "lr": 2e-2, "batch_size": 2,
         "seed": SEED, "progress": False, "sample-every": 3, "sample_steps": 2, "validation_split": 0.25,
         "validate_every": 2, "save_every": 2, "keep_checkpoints": 2, "log_with": "tensorboard",
         "shuffle_captions": True, "keep_tokens": 1, "caption_variants": 2},
        [{"path": str(folders["kohya"])},
         {"path": str(folders["other"]), "repeats": 3, "caption_extension": ".caption"}]))
    config = config_from_file(toml)
    return out, config, train(config)


def _resolution(out: Path) -> int:
    return TrainConfig.from_json(out / "config.json").resolution


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_loss_log_has_the_train_and_validation_loss_lr_grad_norm_time_and_samples(run):
    out, config, result = run
    log = _log(out)
    assert [r["step"] for r in log] == list(range(STEPS + 1))  # step 0: the untrained adapter's
    assert [r["loss"] for r in log[1:]] == result.losses
    assert all(r["lr"] == config.lr and r["seconds"] > 0 and r["grad_norm"] > 0 for r in log[1:])
    assert [r["step"] for r in log if "val_loss" in r] == [0, 2, 4, 6]
    assert [r["samples"] for r in log if "samples" in r] == [f"samples/step_{s:07d}.png" for s in (0, 3, 6)]
    from PIL import Image

    column = Image.open(out / "samples/step_0000003.png")
    strip = Image.open(out / "samples" / "strip.png")
    assert column.height == strip.height and strip.width == 3 * (column.width - 1) + 1  # 3 steps side by side
    assert result.outputs["samples_strip"] == out / "samples" / "strip.png"
    # the samples change as the adapter trains (lr 2e-2), one row per prompt
    first, last = (torch.tensor(np.asarray(Image.open(out / f"samples/step_{s:07d}.png"))).float()
                   for s in (0, 6))
    assert (first - last).abs().max() > 0


@pytest.mark.slow
def test_samples_png_reuses_step_0_and_the_last_step_and_shows_what_sampling_afresh_shows(run, tmp_path):
    """A watched run's samples.png takes its base row from step 0's samples (the adapter as initialised adds
    nothing) and its LoRA row from the last step's: the same images as sampling both rows afresh at the end
    (up to float rounding of one batch against one prompt at a time)."""
    import numpy as np
    from PIL import Image

    from lora_lab.diffusion.sampling import sample_grid
    from lora_lab.models import denoiser

    out, config, result = run
    prompts, inputs = result.cached.samples
    denoiser(result.pipe).eval()
    fresh = sample_grid(result.pipe, prompts, config.seed, config.sample_steps, tmp_path / "fresh.png",
                        inputs=inputs)
    made, again = (np.asarray(Image.open(p), dtype=np.int16) for p in (result.outputs["samples"], fresh))
    assert made.shape == again.shape and np.abs(made - again).max() <= 1
    h = (made.shape[0] - 3) // 2  # two rows of tiles, 1 px of padding around them
    top, bottom = made[1:1 + h], made[2 + h:2 + 2 * h]  # they differ: the LoRA trained (no row is a copy)
    assert np.abs(top - bottom).max() > 8


@pytest.mark.slow
def test_tensorboard_events_read_back_with_tensorboards_reader(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, _ = run
    log = _log(out)
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    train_loss = events.Scalars("loss/train")
    assert [e.step for e in train_loss] == list(range(1, STEPS + 1))
    assert [e.value for e in train_loss] == pytest.approx([r["loss"] for r in log[1:]], rel=1e-6)
    assert [e.step for e in events.Scalars("loss/validation")] == [0, 2, 4, 6]
    assert {"lr", "grad_norm", "step_seconds"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Images("samples")] == [0, 3, 6]


@pytest.mark.slow
def test_validation_loss_is_the_same_draws_every_time_at_fixed_timesteps(run):
    out, config, result = run
    assert validation_timesteps(DDPM()).tolist() == [62, 187, 312, 437, 562, 687, 812, 937]
    sigmas = validation_timesteps(FlowMatching())  # logit-normal quantiles: symmetric about 1/2
    assert torch.allclose(sigmas + sigmas.flip(0), torch.ones(8)) and sigmas.diff().min() > 0
    data = encode_run_data(result.pipe, config, _resolution(out))
    kind = model_kind("sd15")
    first = validation_loss(config, kind, result.pipe, data.val)
    assert first == validation_loss(config, kind, result.pipe, data.val)  # fixed noise, fixed timesteps
    assert first == pytest.approx(_log(out)[-1]["val_loss"], rel=1e-6)  # the trained adapter's, as logged


def test_held_out_images_are_never_trained_on_and_repeats_are_counted(run, folders):
    out, config, result = run
    data = encode_run_data(result.pipe, config, _resolution(out))
    images = sorted(str(p) for p in [*folders["kohya"].glob("2_digits/*.png"),
                                     *folders["other"].glob("*.png")])
    held = set(data.val.paths)
    assert len(held) == 2 and held <= set(images)  # round(0.25 * 6)
    assert not held & set(data.train.paths)
    assert set(data.train.paths) | held == set(images)
    repeats = {str(p): 2 for p in folders["kohya"].glob("2_digits/*.png")} | \
              {str(p): 3 for p in folders["other"].glob("*.png")}
    assert sorted(data.train.paths) == sorted(p for p in images if p not in held for _ in range(repeats[p]))
    assert data.train.variants == 2
    assert data.train.embeds["prompt_embeds"].shape[0] == 2 * len(data.train.paths)
    ckpt = torch.load(out / "checkpoints" / f"step_{STEPS:07d}.pt", weights_only=True)
    assert ckpt["n_examples"] == len(data.train.paths)


@pytest.mark.slow
def test_a_lora_file_per_checkpoint_is_the_final_file_of_the_run_repeated_to_that_step(run, tmp_path, capfd):
    """lora_step_0000004 of the 6-step run = lora.safetensors of the run repeated from its config.json with
    the steps (and output) overridden; it loads in diffusers and gives that run's image. keep_checkpoints=2
    pruned step 2's LoRA file with its checkpoint."""
    from lora_lab.diffusion import sample
    from lora_lab.models import build_pipeline, shipped_base

    out, _, _ = run
    assert sorted(p.name for p in out.glob("lora_step_*")) == ["lora_step_0000004.safetensors",
                                                               "lora_step_0000006.safetensors"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000004.pt", "step_0000006.pt"]
    flags = {"output": str(tmp_path), "steps": 4, "progress": True, "sample_every": 0, "log_with": None}
    again = train(config_from_file(out / "config.json", flags))
    assert "4/4" in capfd.readouterr().err  # the progress bar: steps, loss, ETA
    step_file = out / "lora_step_0000004.safetensors"
    mine, theirs = load_file(step_file), load_file(again.outputs["lora_kohya"])
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with safe_open(str(step_file), "pt") as f:
        meta = f.metadata()
    assert meta["lora_lab_step"] == "4" and json.loads(meta["lora_lab_train_config"])["steps"] == STEPS
    prompt = "digit, three, white"
    ours = sample(again.pipe, prompt, seed=SEED, steps=3)
    pipe = build_pipeline("sd15", shipped_base("sd15"))
    plain = sample(pipe, prompt, seed=SEED, steps=3)
    pipe.load_lora_weights(str(step_file))
    diffusers_image = sample(pipe, prompt, seed=SEED, steps=3)
    assert (ours - plain).abs().max() > 0.02  # the LoRA changes the image: the comparison means something
    torch.testing.assert_close(diffusers_image, ours, atol=2e-3, rtol=0)


# ----------------------------------------------------------------------------- the run file and bad values


def test_toml_round_trip_of_every_field(folders, tmp_path):
    """Every TrainConfig field written to TOML (its flag's name with dashes for half of them) reads back as
    the same config."""
    tables = [{"path": str(folders["other"]), "repeats": 2, "caption_extension": ".caption"}]
    config = TrainConfig(model="sd15", output=str(tmp_path / "o"), rank=8, alpha=4.0, lr=3e-4, steps=50,
                         gradient_checkpointing="selective", sample_prompts=["a", "b"], sample_every=10,
                         validation_split=0.2, validate_every=5, log_with="tensorboard",
                         shuffle_captions=True, keep_tokens=2, tag_dropout=0.1, datasets=tables)
    values = asdict(config)
    names = [f.name for f in fields(TrainConfig) if f.name != "datasets"]
    settings = {(n.replace("_", "-") if i % 2 else n): values[n] for i, n in enumerate(names)}
    path = tmp_path / "run.toml"
    path.write_text(_toml(settings, config.datasets))
    assert config_from_file(path) == config
    assert config_from_file(path, {"rank": 4}).rank == 4  # a flag given overrides the file


@pytest.mark.parametrize("text, said", [
    ("rank = 0", "run.toml: TrainConfig.rank=0: must be an integer in [1, 65536]"),
    ("rank = 'eight'", "run.toml: rank = 'eight' must be an integer"),
    ("rnak = 8", "run.toml: unknown key 'rnak'"),
    ("sample_every = -1", "run.toml: TrainConfig.sample_every=-1"),
    ("validation_split = 1.0", "run.toml: TrainConfig.validation_split=1.0: must be a number in (0, 1)"),
    ("rank = [", "run.toml: not valid TOML"),
    ("[[datasets]]\nrepeats = 2", "run.toml: TrainConfig.datasets="),
    (b"rank = \xff", "run.toml: unreadable config file"),
])
def test_a_bad_run_file_is_one_error_line_naming_file_and_key(tmp_path, capsys, text, said):
    out = tmp_path / "out"
    out.mkdir()
    (out / "lora.safetensors").write_bytes(b"kept")  # what an earlier run wrote stays
    run_file = tmp_path / "run.toml"
    run_file.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert cli_main(["train", "--config", str(run_file), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lora-lab: error: ") and said in err
    assert (out / "lora.safetensors").read_bytes() == b"kept"
    assert sorted(out.iterdir()) == [out / "lora.safetensors"]


@pytest.mark.parametrize("argv, said", [
    (["--sample-every", "-1"], "TrainConfig.sample_every=-1: must be an integer in [0, 10**9]"),
    (["--validation-split", "0"], "TrainConfig.validation_split=0.0: must be a number in (0, 1)"),
    (["--validation-split", "1"], "TrainConfig.validation_split=1.0"),
    (["--validate-every", "-2"], "TrainConfig.validate_every=-2"),
    (["--log-with", "wandb"], "TrainConfig.log_with='wandb'"),
    (["--sample-every", "5", "--sample-steps", "0"], "TrainConfig.sample_every=5: needs denoising steps"),
    (["--tag-dropout", "1"], "TrainConfig.tag_dropout=1.0"),
])
def test_bad_watch_flags_are_one_error_line(tmp_path, capsys, argv, said):
    assert cli_main(["train", "--output", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and not (tmp_path / "o").exists()


def test_a_split_that_leaves_nothing_to_train_on_is_an_error(digits_folder, tmp_path):
    with pytest.raises(TrainConfigError, match="validation_split=0.9: holds out 2 of the 2 images"):
        train(TrainConfig(model="sd15", dataset=str(digits_folder(2)), validation_split=0.9, steps=1,
                          output=str(tmp_path / "o"), progress=False, sample_steps=0))
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- folders and captions


def test_kohya_folders_repeats_and_a_fingerprint_over_every_folder(folders, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(folders["other"], other)
    config = TrainConfig(datasets=[{"path": str(folders["kohya"]), "repeats": 2},
                                   {"path": str(other), "caption_extension": ".caption", "is_reg": True}])
    sources = data_sources(config)
    assert [(Path(s.path).name, s.repeats, s.is_reg) for s in sources] == [("2_digits", 4, False),
                                                                            ("other", 1, True)]
    plain = TrainConfig(dataset=str(folders["kohya"]))  # the dataset folder in kohya's layout
    assert [(Path(s.path).name, s.repeats) for s in data_sources(plain)] == [("2_digits", 2)]
    before = sources_fingerprint(config)
    caption = next(other.glob("*.caption"))
    caption.write_text(caption.read_text() + ", changed")  # a caption of the second folder
    assert sources_fingerprint(config) != before


def test_caption_variants_keep_the_first_tokens_shuffle_and_drop_the_rest():
    caption = "sks style, a cat, on a mat, red, blue"
    seen = set()
    for i in range(40):
        v = caption_variant(caption, random.Random(i), keep_tokens=1, shuffle=True)
        assert v.startswith("sks style, ") and sorted(v.split(", ")) == sorted(caption.split(", "))
        seen.add(v)
        dropped = caption_variant(caption, random.Random(i), keep_tokens=2, tag_dropout=0.5)
        assert dropped.startswith("sks style, a cat") and set(dropped.split(", ")) <= set(caption.split(", "))
        seen.add(dropped)
    assert len(seen) > 10  # they do vary
    assert caption_variant(caption, random.Random(3), 1, True, 0.2) == \
        caption_variant(caption, random.Random(3), 1, True, 0.2)  # a function of its generator's seed


def test_a_checkpoint_from_before_these_fields_resumes_and_watching_may_change(tmp_path):
    """A checkpoint's config without the new fields is the run it was (one folder, no caption variants); the
    fields of watching may change at a resume, those that change the training may not."""
    from dataclasses import replace

    from lora_lab.diffusion.state import RunState, check_resumable

    now = TrainConfig(model="sdxl", output=str(tmp_path))
    old = asdict(now)
    for name in ("sample_every", "validation_split", "validation_dataset", "validate_every", "log_with",
                 "datasets", "shuffle_captions", "keep_tokens", "tag_dropout", "caption_variants"):
        del old[name]
    state = {"config": old, "n_examples": 3, "dataset_fingerprint": "contents:f"}
    (tmp_path / "val").mkdir()  # beside the output, not around it (an output inside a data folder is refused)
    watched = replace(now, sample_every=5, validate_every=2, log_with="tensorboard",
                      validation_dataset=str(tmp_path / "val"))
    check_resumable(state, RunState(tmp_path, watched, 3, "contents:f"), tmp_path / "step_0000001.pt")
    with pytest.raises(TrainConfigError, match="the config changed \\(shuffle_captions: None -> True"):
        check_resumable(state, RunState(tmp_path, replace(now, shuffle_captions=True), 3, "contents:f"),
                        tmp_path / "x.pt")


def test_buckets_across_two_kohya_folders(digits_folder, tmp_path):
    """Two N_name folders of different image shapes, with buckets: every example keeps its folder's bucket,
    the repeats are counted per folder, each step's batch is one bucket (both buckets are drawn), and the
    resume fingerprint changes with an image of either folder."""
    from lora_lab.diffusion.data import batch_indices
    from lora_lab.models import build_pipeline

    parent = tmp_path / "parent"
    shutil.copytree(digits_folder(sizes=[(32, 32)] * 2), parent / "2_square")
    shutil.copytree(digits_folder(first=2, sizes=[(32, 64)] * 3), parent / "3_wide")
    config = TrainConfig(model="sd15", dataset=str(parent), buckets=True, resolution=32, batch_size=2)
    pipe = build_pipeline("sd15", None, seed=0)
    data = encode_run_data(pipe, config, 32).train
    folder_of = [Path(p).parent.name for p in data.paths]
    assert sorted(folder_of) == ["2_square"] * 4 + ["3_wide"] * 9  # 2 images x 2, 3 images x 3
    bucket = {"2_square": (32, 32), "3_wide": (24, 48)}  # aspect_buckets(32)'s nearest to 1:1 and 1:2
    assert [tuple(s) for s in data.sizes] == [bucket[f] for f in folder_of]
    f = pipe.vae_scale_factor
    assert all(tuple(x.shape[-2:]) == (h // f, w // f) for x, (h, w) in zip(data.latents, data.sizes))
    drawn = set()
    for step in range(12):
        sizes = {tuple(data.sizes[i]) for i in batch_indices(config.seed, step, 2, data.sizes).tolist()}
        assert len(sizes) == 1, step
        drawn |= sizes
    assert drawn == set(bucket.values())
    before = sources_fingerprint(config)
    for folder in ("2_square", "3_wide"):
        image = sorted((parent / folder).glob("*.png"))[0]
        image.write_bytes(image.read_bytes() + b"\0")  # the same name, other bytes
        assert sources_fingerprint(config) != before, folder
        before = sources_fingerprint(config)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_a_per_step_kohya_lora_file_of_sd3_and_flux_loads_in_diffusers(kind, digits_folder, tmp_path):
    """lora_step_0000002 of a 2-step run is the final lora.safetensors of that step and gives lora_lab's image
    in diffusers: Flux's kohya file directly (diffusers reads its lora_transformer_ names); SD3's after
    `convert_lora(..., to="peft")`, because diffusers 0.42's SD3 loader reads only its own names (it has no
    kohya converter for SD3; ComfyUI reads the kohya file)."""
    from lora_lab.diffusion import sample
    from lora_lab.formats import convert_lora
    from lora_lab.models import build_pipeline, shipped_base

    result = train(TrainConfig(model=kind, dataset=str(digits_folder(2)), steps=2, save_every=2, rank=4,
                               lr=5e-2, batch_size=2, sample_steps=0, progress=False, seed=SEED,
                               output=str(tmp_path / "run")))
    step_file = tmp_path / "run" / "lora_step_0000002.safetensors"
    mine, final = load_file(step_file), load_file(result.outputs["lora_kohya"])
    assert mine.keys() == final.keys() and all(torch.equal(mine[k], final[k]) for k in mine)
    prompt = "a digit three"
    ours = sample(result.pipe, prompt, seed=SEED, steps=3)
    base = shipped_base(kind)
    pipe = build_pipeline(kind, base) if base is not None else build_pipeline(kind, None, seed=0)
    plain = sample(pipe, prompt, seed=SEED, steps=3)
    loadable = step_file if kind == "flux" else convert_lora(step_file, tmp_path / "peft.safetensors",
                                                              to="peft", base=kind)
    if kind == "sd3":  # the kohya file is taken without an error or a warning, and nothing is loaded
        pipe.load_lora_weights(str(step_file))
        assert pipe.get_list_adapters() == {}
    pipe.load_lora_weights(str(loadable))
    theirs = sample(pipe, prompt, seed=SEED, steps=3)
    assert (ours - plain).abs().max() > 0.02  # the LoRA changes the image: the comparison means something
    torch.testing.assert_close(theirs, ours, atol=2e-3, rtol=0)


def test_validation_does_not_depend_on_the_training_knobs(run, digits_folder):
    """Validation uses the base's own timesteps (objective_for(pipe)) and no loss weighting, so runs with
    different knobs compare: configs that differ only in a training knob give the same validation loss (the
    sd15 run's with min-SNR or debiased weighting; a tiny sd3's with other timestep sampling, shift,
    logit-normal mean and loss weighting)."""
    from dataclasses import replace

    from lora_lab.models import build_pipeline, shipped_base

    out, config, result = run
    data = encode_run_data(result.pipe, config, _resolution(out))
    plain = validation_loss(config, model_kind("sd15"), result.pipe, data.val)
    for knob in ({"min_snr_gamma": 5.0}, {"debiased_estimation": True}):
        assert validation_loss(replace(config, **knob), model_kind("sd15"), result.pipe, data.val) == plain
    pipe = build_pipeline("sd3", shipped_base("sd3"))
    sd3 = TrainConfig(model="sd3", dataset=str(digits_folder(2)), validation_split=0.5, batch_size=4)
    val = encode_run_data(pipe, sd3, 16).val
    plain = validation_loss(sd3, model_kind("sd3"), pipe, val)
    knobs = {"timestep_sampling": "mode", "timestep_shift": 1.5, "logit_mean": 0.5,
             "loss_weighting": "cosmap"}
    for name, value in knobs.items():
        assert validation_loss(replace(sd3, **{name: value}), model_kind("sd3"), pipe, val) == plain, name
