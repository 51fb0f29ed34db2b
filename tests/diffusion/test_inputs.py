"""Reliability round four, part A (issue 43): a run never writes into what it reads, reads kohya folders as
kohya does, never validates on an image it trains on, reads images upright, notices a replaced image on
resume; a setting spelled twice, a caption extension that names no file, a base folder naming a class
diffusers lacks, a LoKr module under two names and --log-with without its package are refused by name. Each
case is the one-line reproducer of the issue: the project's own error (exit 2, nothing written), a warning,
or the correct result."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
from PIL import Image
from safetensors.torch import save_file

from lora_lab.cli import main as cli_main
from lora_lab.diffusion import DatasetError, TrainConfig, TrainConfigError, train
from lora_lab.diffusion.data import _open_image, shown_size
from lora_lab.diffusion.datasets import data_sources, kohya_sources, sources_fingerprint, split
from lora_lab.diffusion.runfile import config_from_file
from lora_lab.formats import LoraFormatError, load_lora
from lora_lab.models import shipped_base

FAST = ["--steps", "1", "--rank", "4", "--sample-steps", "0", "--no-progress", "--base-dtype", "fp32"]


def refused(capsys, argv: list[str], *words) -> str:
    """`lora-lab ARGV` ends with exit 2 and one line of the project's own naming each of `words`."""
    code = cli_main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("lora-lab: error: "), err
    assert "Traceback" not in err and all(str(w) in err for w in words), err
    return err


def files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def base(tmp_path) -> Path:
    """A copy of the tiny SDXL diffusers folder shipped in data/ (never the shipped one: a failing test must
    not break it)."""
    return Path(shutil.copytree(shipped_base("sdxl"), tmp_path / "base"))


# -------------------------------------------------------------------------- 1. outputs inside inputs


def test_output_inside_the_diffusers_base_is_refused_and_nothing_written(base, digits_folder, capsys):
    before = files(base)
    refused(capsys, ["train", "--model", "sdxl", "--base", base, "--dataset", digits_folder(2),
                     "--output", base / "unet", *FAST], "output", "base", base)
    assert files(base) == before


def test_output_in_the_folder_of_a_single_file_base_or_part_is_refused(tmp_path, digits_folder, capsys,
                                                                      monkeypatch):
    """The base file's folder and each part file's folder (--clip-l, --t5xxl, --vae); a subfolder beside a
    base file is a folder of its own and may hold the run. (The files' contents are not what this checks:
    check_base, which reads them, is stood in for.)"""
    monkeypatch.setattr("lora_lab.diffusion.config.check_base", lambda *a, **k: None)
    folders = {name: tmp_path / name for name in ("ckpt", "clip", "t5", "ae")}
    for folder in folders.values():
        folder.mkdir()
    main = folders["ckpt"] / "flux.safetensors"
    parts = {"clip-l": folders["clip"] / "clip_l.safetensors", "t5xxl": folders["t5"] / "t5xxl.safetensors",
             "vae": folders["ae"] / "ae.safetensors"}
    for path in (main, *parts.values()):
        path.write_bytes(b"stand-in")
    flags = ["train", "--model", "flux", "--base", main, "--dataset", digits_folder(2), *FAST]
    flags += [x for flag, path in parts.items() for x in (f"--{flag}", path)]
    refused(capsys, [*flags, "--output", folders["ckpt"]], "output", "base file", main)
    for flag, path in parts.items():
        refused(capsys, [*flags, "--output", path.parent], "output", flag.replace("-", "_"), path)
    assert all(sorted(f.iterdir()) == [p] for f, p in zip(folders.values(), [main, *parts.values()]))
    config = TrainConfig(model="flux", base=str(main), output=str(folders["ckpt"] / "run"),
                         **{k.replace("-", "_"): str(v) for k, v in parts.items()})
    assert config.output.endswith("run")


def test_sample_into_its_base_folder_and_convert_onto_its_lora_are_refused(base, tmp_path, capsys):
    refused(capsys, ["sample", "--model", "sdxl", "--base", base, "--prompt", "a digit",
                     "--output", base / "unet" / "x.png"], "inside the input folder", base)
    lora = tmp_path / "a.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.ones(1, 4),
               "lora_unet_x.lora_up.weight": torch.ones(4, 1)}, str(lora))
    before = lora.read_bytes()
    refused(capsys, ["convert", lora, lora, "--to", "peft"], "is the input file")
    assert lora.read_bytes() == before and not (base / "unet" / "x.png").exists()


# -------------------------------------------------------------------------- 2. kohya folders


def _kohya(root: Path, digits_folder, **subfolders: int) -> Path:
    for name, count in subfolders.items():
        shutil.copytree(digits_folder(count), root / name)
    return root


def test_kohya_zero_repeats_and_other_subfolders_are_skipped_with_a_warning(tmp_path, digits_folder):
    root = _kohya(tmp_path / "img", digits_folder, **{"10_style": 2, "0_off": 2, "notes": 1})
    with pytest.warns(UserWarning) as caught:
        sources = kohya_sources(root)
    assert [(Path(s.path).name, s.repeats) for s in sources] == [("10_style", 10)]
    said = " | ".join(str(w.message) for w in caught)
    assert "0_off: 0 repeats" in said and "notes: not kohya's N_name/" in said


def test_kohya_with_only_zero_repeats_or_a_stray_image_is_refused(tmp_path, digits_folder):
    root = _kohya(tmp_path / "zero", digits_folder, **{"0_off": 2})
    with pytest.warns(UserWarning), pytest.raises(DatasetError, match="every kohya subfolder has 0 repeats"):
        kohya_sources(root)
    root = _kohya(tmp_path / "stray", digits_folder, **{"10_style": 2})
    shutil.copy(root / "10_style" / "00.png", root / "stray.png")
    with pytest.raises(DatasetError, match=r"stray: holds images \(stray.png\) beside kohya's N_name/"):
        data_sources(TrainConfig(model="sd15", dataset=str(root), output=str(tmp_path / "out")))


def test_dry_run_of_a_kohya_dataset_plans_it(tmp_path, digits_folder, capsys):
    root = _kohya(tmp_path / "img", digits_folder, **{"10_style": 3})
    assert cli_main(["train", "--model", "sd15", "--dataset", str(root), "--output", str(tmp_path / "out"),
                     "--dry-run", *FAST]) == 0
    assert "cached data" in capsys.readouterr().out and not (tmp_path / "out").exists()


# -------------------------------------------------------------------------- 3. validation on trained images


def test_a_validation_folder_holding_the_training_folder_is_refused(tmp_path, digits_folder, capsys):
    root = _kohya(tmp_path / "img", digits_folder, **{"10_style": 3})
    out = tmp_path / "out"
    argv = ["train", "--model", "sd15", "--dataset", root / "10_style", "--validation-dataset", root,
            "--output", out, *FAST]
    refused(capsys, argv, "validation_dataset", "are trained on too", root / "10_style")
    refused(capsys, [*argv, "--dry-run"], "validation_dataset", "are trained on too")
    assert not out.exists()


def test_one_folder_twice_splits_as_one_set_of_files(tmp_path, digits_folder):
    """The same folder in two [[datasets]] tables, once through a link: a held-out file is held out in both,
    with a warning; the plan counts the same split."""
    data = digits_folder(6)
    (tmp_path / "link").symlink_to(data)
    config = TrainConfig(model="sd15", output=str(tmp_path / "out"), validation_split=0.34,
                         datasets=[{"path": str(data)}, {"path": str(tmp_path / "link")}])
    paths = [p for s in data_sources(config) for p in sorted(Path(s.path).glob("*.png"))]
    with pytest.warns(UserWarning, match="6 of the 12 images are files listed twice"):
        trained, held = split(paths, config.validation_split)
    real = [p.resolve() for p in paths]
    assert len(held) == 2 and not {real[i] for i in held} & {real[i] for i in trained}
    assert len(trained) == 8  # 4 files, each in both tables
    from lora_lab.planning.examples import count_examples

    with pytest.warns(UserWarning, match="listed twice"):
        assert count_examples(config, 16).held_out == held


# -------------------------------------------------------------------------- 4. EXIF orientation


def test_an_image_with_an_orientation_tag_is_read_as_shown(tmp_path):
    """Stored 32 wide x 16 high, red left half, tagged orientation 6 (turn 90 degrees clockwise to show): read
    as 16 wide x 32 high with red on top, as diffusers' scripts read it (ImageOps.exif_transpose); the plan's
    header-only size agrees."""
    stored = np.zeros((16, 32, 3), np.uint8)
    stored[:, :16, 0] = 255
    stored[:, 16:, 2] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "photo.png"
    Image.fromarray(stored).save(path, exif=exif)
    shown = np.asarray(_open_image(path))
    assert shown.shape == (32, 16, 3)
    assert (shown[:16, :, 0] == 255).all() and (shown[16:, :, 2] == 255).all()
    with Image.open(path) as img:
        assert shown_size(img) == (16, 32)


# -------------------------------------------------------------------------- 5. resume after a replaced image


def test_resume_after_an_image_replaced_by_one_of_the_same_size_is_refused(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):  # BMPs: one size of file whatever the pixels
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(data / f"{i}.bmp")
        (data / f"{i}.txt").write_text("a square")
    cfg = dict(model="sd15", dataset=str(data), output=str(tmp_path / "out"), steps=2, save_every=1, rank=4,
               sample_steps=0, progress=False)
    before = sources_fingerprint(TrainConfig(**cfg))
    train(TrainConfig(**cfg))
    size = (data / "0.bmp").stat().st_size
    Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(data / "0.bmp")
    assert (data / "0.bmp").stat().st_size == size and sources_fingerprint(TrainConfig(**cfg)) != before
    with pytest.raises(TrainConfigError, match=r"files of the dataset .* changed .*images"):
        train(TrainConfig(**cfg, resume=True))


# -------------------------------------------------------------------------- 6, 7. run files


def test_a_setting_spelled_twice_in_a_run_file_is_refused(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('model = "sd15"\nsample-steps = 0\nsample_steps = 5\n')
    with pytest.raises(TrainConfigError, match="'sample-steps' and 'sample_steps' are the same setting"):
        config_from_file(toml)
    refused(capsys, ["train", "--config", toml, "--output", tmp_path / "out"], toml, "sample-steps",
            "sample_steps")
    run_json = tmp_path / "config.json"
    run_json.write_text('{"model": "sd15", "steps": 1, "steps": 5}')
    refused(capsys, ["train", "--config", run_json, "--output", tmp_path / "out"], run_json,
            "'steps' is given twice")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extension", [".", "./x", "txt", ".a/b"])
def test_a_caption_extension_naming_no_file_is_refused(tmp_path, digits_folder, capsys, extension):
    toml = tmp_path / "run.toml"
    toml.write_text(f'model = "sd15"\n[[datasets]]\npath = "{digits_folder(2)}"\n'
                    f'caption_extension = "{extension}"\n')
    refused(capsys, ["train", "--config", toml, "--output", tmp_path / "out"], "caption_extension",
            repr(extension))
    with pytest.raises(DatasetError, match="caption_extension"):
        from lora_lab.diffusion import ImageCaptionDataset

        ImageCaptionDataset(digits_folder(2), 16, caption_extension=extension)
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------------- 8. a class diffusers lacks


def test_a_base_folder_naming_a_class_diffusers_lacks_is_refused(base, digits_folder, tmp_path, capsys):
    index = json.loads((base / "model_index.json").read_text())
    index["unet"] = ["diffusers", "UNetThatIsNot"]
    (base / "model_index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    refused(capsys, ["train", "--model", "sdxl", "--base", base, "--dataset", digits_folder(2),
                     "--output", out, *FAST], base, "diffusers.UNetThatIsNot")
    assert not out.exists()


# -------------------------------------------------------------------------- 9. repeating a resumed run


def test_the_config_json_of_a_resumed_run_repeats_it(tmp_path, digits_folder, capsys):
    out, again = tmp_path / "out", tmp_path / "again"
    argv = ["train", "--model", "sd15", "--dataset", digits_folder(2), "--output", out, "--save-every", "1",
            "--rank", "4", "--sample-steps", "0", "--no-progress"]
    assert cli_main([str(a) for a in [*argv, "--steps", "2"]]) == 0
    (out / "checkpoints" / "step_0000002.pt").unlink()  # as if killed after step 1's checkpoint
    assert cli_main([str(a) for a in [*argv, "--steps", "2", "--resume"]]) == 0
    assert json.loads((out / "config.json").read_text())["resume"] is False
    assert cli_main(["train", "--config", str(out / "config.json"), "--output", str(again)]) == 0
    capsys.readouterr()
    assert TrainConfig.from_json(again / "config.json").steps == 2 and (again / "lora.safetensors").is_file()


# -------------------------------------------------------------------------- 10. a LoKr module twice


def test_a_lokr_module_under_its_ldm_and_its_diffusers_name_is_refused(tmp_path):
    ldm = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    diffusers = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"
    tensors = {f"{ldm}.lokr_w1": torch.ones(2, 2), f"{ldm}.lokr_w2": torch.ones(32, 32),
               f"{diffusers}.lokr_w1": torch.ones(4, 4), f"{diffusers}.lokr_w2": torch.ones(16, 16)}
    path = tmp_path / "twice.safetensors"
    save_file(tensors, str(path), metadata={"lora_lab.base_model": "sdxl"})
    with pytest.raises(LoraFormatError, match="twice.safetensors: keys .* are both module "
                                              "'unet.down_blocks.1.attentions.0") as e:
        load_lora(path)
    assert ldm in str(e.value) and diffusers in str(e.value)


# -------------------------------------------------------------------------- 11. --log-with's package


def test_log_with_tensorboard_without_tensorboard_is_refused_before_anything_is_written(
        tmp_path, digits_folder, capsys, monkeypatch):
    import lora_lab.diffusion.options as options

    real = options.find_spec
    monkeypatch.setattr(options, "find_spec", lambda name: None if name == "tensorboard" else real(name))
    out = tmp_path / "out"
    refused(capsys, ["train", "--model", "sd15", "--dataset", digits_folder(2), "--output", out,
                     "--log-with", "tensorboard", *FAST], "log_with", "tensorboard package")
    assert not out.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setattr(options, "find_spec", real)
        assert TrainConfig(model="sd15", output=str(out), log_with="tensorboard").log_with == "tensorboard"
