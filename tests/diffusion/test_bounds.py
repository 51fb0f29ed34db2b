"""Every number a run takes has a range declared once (lora_lab/diffusion/bounds.py): a value no run can use
is a one-line error naming the field (exit 2 from the CLI, nothing written), not an overflow, a hang or a
16 GB allocation."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest

from lora_lab.cli import main as cli_main
from lora_lab.diffusion import TrainConfig, TrainConfigError
from lora_lab.diffusion.bounds import BOUNDS, MAX_REPEATS, numeric_fields


def test_every_numeric_field_declares_its_bound():
    numeric = numeric_fields(TrainConfig)
    assert {"lr", "steps", "alpha", "batch_size", "caption_variants", "seed"} <= set(numeric)
    assert not {"dora", "progress", "gradient_checkpointing", "model"} & set(numeric)  # bool, str
    # a numeric TrainConfig field without a row in BOUNDS, or a row naming no numeric field
    assert sorted(numeric) == sorted(BOUNDS)


def test_every_default_is_inside_its_bound():
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    for name, bound in BOUNDS.items():
        assert defaults[name] is None or bound.holds(defaults[name]), name


@pytest.mark.parametrize("name, value", [
    ("batch_size", 10**30), ("grad_accum", 10**30), ("steps", 10**30), ("caption_variants", 10**30),
    ("caption_variants", 10**6), ("lr", 1e39), ("lr", 1e300), ("lr", 1e308), ("loraplus_ratio", 1e39),
    ("text_encoder_lr", 1e308), ("alpha", 1e300), ("weight_decay", 1e300), ("max_grad_norm", 1e39),
    ("prior_loss_weight", 1e300), ("keep_tokens", 10**30), ("blocks_to_swap", 10**30),
    ("save_every", 10**30), ("warmup_steps", 10**30), ("resolution", 2**40), ("rank", 10**30),
    ("lokr_factor", 10**30), ("min_snr_gamma", 1e300), ("train_guidance", 1e39), ("logit_mean", 1e39),
    ("lr", math.inf), ("lr", 0.0), ("batch_size", 2.0), ("steps", True),
])
def test_a_value_no_run_can_use_is_a_one_line_error_naming_the_field_and_its_rule(name, value):
    with pytest.raises(TrainConfigError) as e:
        TrainConfig(**{name: value})
    said = str(e.value)
    assert said.startswith(f"TrainConfig.{name}={value!r}: must be ") and "\n" not in said
    infinite = isinstance(value, float) and math.isinf(value)
    assert ("finite" in said) if infinite else BOUNDS[name].rule() in said


@pytest.mark.parametrize("argv", [
    ["--lr", "1e39"], ["--lr", "1e300"], ["--lr", "1e308", "--optimizer", "prodigy"],
    ["--loraplus-ratio", "1e300"], ["--batch-size", str(10**30)], ["--grad-accum", str(10**30)],
    ["--caption-variants", "1000000", "--shuffle-captions"],
])
def test_huge_flags_exit_2_before_anything_is_written(tmp_path, capsys, argv):
    out = tmp_path / "o"
    assert cli_main(["train", "--output", str(out), "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be a" in err and argv[0][2:].replace("-", "_") in err
    assert not out.exists()


@pytest.mark.parametrize("table", [f"repeats = {10**23}", f"repeats = {MAX_REPEATS + 1}"])
def test_huge_repeats_in_a_run_file_exit_2_nothing_written(tmp_path, capsys, digits_folder, table):
    run_file, out = tmp_path / "run.toml", tmp_path / "o"
    run_file.write_text(f"steps = 1\n[[datasets]]\npath = '{digits_folder(2)}'\n{table}\n")
    assert cli_main(["train", "--config", str(run_file), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"must be in [1, {MAX_REPEATS}]" in err and not out.exists()


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("name, said", [("99999999999_x", "99999999999 repeats (kohya's N_name folder) must "
                                         f"be at most {MAX_REPEATS}"),
                                        ("90000_x", "an epoch of 180000 examples")])
def test_a_kohya_folder_of_too_many_repeats_exits_2_nothing_written(tmp_path, capsys, digits_folder, name,
                                                                    said, dry_run):
    data = tmp_path / "data"
    data.mkdir()
    digits_folder(2).rename(data / name)
    out = tmp_path / "o"
    argv = ["train", "--model", "sd15", "--dataset", str(data), "--output", str(out), "--steps", "10",
            *(["--dry-run"] if dry_run else [])]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err  # a real run says the base's dtype first
    assert err.count("lora-lab: error: ") == 1 and said in err.splitlines()[-1] and not out.exists()


def test_an_epoch_as_long_as_the_run_draws_is_allowed():
    from lora_lab.diffusion.bounds import MAX_EPOCH_FLOOR, epoch_problem

    config = TrainConfig(steps=10**5, batch_size=4)
    assert epoch_problem({"a": (2, MAX_EPOCH_FLOOR // 2)}, TrainConfig()) is None
    assert epoch_problem({"a": (4, 10**5)}, config) is None  # 4e5 = steps x batch
    assert "an epoch of 400004 examples" in epoch_problem({"a": (4, 10**5), "b": (4, 1)}, config)
