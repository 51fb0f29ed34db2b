"""`lora-lab inspect | convert | merge`: run through `main(argv)` and as the installed console script."""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_lab.cli import main
from lora_lab.formats import LoraFile, LoraWeights, load_lora, save_lora
from lora_lab.merge import merge_loras

RANK, ALPHA = 4, 2.0


@pytest.fixture
def files(tmp_path):
    """A base weights file (one Linear, one Conv2d, a bias) and two kohya LoRA files for it."""
    g = torch.Generator().manual_seed(0)
    base = {"proj.weight": torch.randn(16, 8, generator=g), "proj.bias": torch.randn(16, generator=g),
            "conv_in.weight": torch.randn(16, 4, 3, 3, generator=g)}
    save_file(base, str(tmp_path / "base.safetensors"))
    for i, name in enumerate(("a", "b")):
        lf = LoraFile({
            "unet.proj": LoraWeights(torch.randn(RANK, 8, generator=g),
                                     torch.randn(16, RANK, generator=g), ALPHA),
            "unet.conv_in": LoraWeights(torch.randn(2, 4, 3, 3, generator=g),
                                        torch.randn(16, 2, 1, 1, generator=g), ALPHA),
        })
        save_lora(tmp_path / f"{name}.safetensors", lf, base="sd15")
    return tmp_path


def test_inspect_shows_format_modules_ranks_alphas_metadata(files, capsys):
    assert main(["inspect", str(files / "a.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "format:  kohya" in out and "base:    sd15" in out and "modules: 2" in out
    assert "unet.conv_in" in out and "conv" in out and "r=4" in out and "alpha=2" in out
    assert "lora_lab.version" in out


def test_convert_to_peft_and_back(files, capsys):
    assert main(["convert", str(files / "a.safetensors"), str(files / "a_peft.safetensors"),
                 "--to", "peft"]) == 0
    assert main(["convert", str(files / "a_peft.safetensors"), str(files / "a_back.safetensors"),
                 "--to", "kohya"]) == 0
    assert load_lora(files / "a_peft.safetensors").format == "peft"
    a, back = load_file(str(files / "a.safetensors")), load_file(str(files / "a_back.safetensors"))
    assert a.keys() == back.keys() and all(torch.equal(a[k], back[k]) for k in a)


def test_merge_writes_the_merged_weights(files, capsys):
    out = files / "merged.safetensors"
    rc = main(["merge", str(files / "base.safetensors"), str(out),
               "--lora", f"{files / 'a.safetensors'}:0.8", "--lora", f"{files / 'b.safetensors'}:0.6"])
    assert rc == 0 and "2 of 3 weights changed by 2 LoRA file(s)" in capsys.readouterr().out
    want = merge_loras(load_file(str(files / "base.safetensors")),
                       [(files / "a.safetensors", 0.8), (files / "b.safetensors", 0.6)])
    got = load_file(str(out))
    assert got.keys() == set(want) and all(torch.equal(got[k], want[k]) for k in got)
    assert not torch.equal(got["proj.weight"], want.base["proj.weight"])


@pytest.mark.parametrize("argv, message", [
    (["inspect", "missing.safetensors"], "missing.safetensors: no such file"),
    (["convert", "a.safetensors", "x.safetensors", "--to", "onnx"], "invalid choice: 'onnx'"),
    (["merge", "base.safetensors", "m.safetensors", "--lora", "a.safetensors:strong"],
     "with a number after the colon"),
    (["merge", "base.safetensors", "m.safetensors"], "the following arguments are required: --lora"),
    (["merge", "a.safetensors", "m.safetensors", "--lora", "b.safetensors:1"], "match no module"),
    # a new user's pass (qa): the CLI's own flag, not the Python keyword; a folder called a folder (it was
    # "no such file"); an empty file name (it was ".": the current folder); the flag typed, not grad_accum
    (["merge", "a.safetensors", "m.safetensors", "--lora", "b.safetensors:1"], "--no-strict"),
    (["inspect", "."], ".: is a folder, not a file"),
    (["merge", ".", "m.safetensors", "--lora", "a.safetensors"], ".: is a folder, not a weights file"),
    (["merge", "base.safetensors", "m.safetensors", "--lora", ":1"], "the file name is empty"),
    (["plan", "--model", "sdxl", "--batch-size", "0"], "TrainConfig.batch_size=0: must be an integer in [1,"),
    (["convert", "a.safetensors", "x.safetensors", "--to", "peft", "--base", "sdxl"],
     "a.safetensors: a sd15 LoRA (its metadata says so), not sdxl"),
    (["merge", "base.safetensors", "m.safetensors", "--lora", "a.safetensors:1",
      "--component", "text_encoder"],
     "base.safetensors: the --lora file(s) change none of its weights (component text_encoder); "
     "nothing written"),
])
def test_bad_arguments_give_one_error_line_and_exit_code_2(files, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(files)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1
    assert not (files / "m.safetensors").exists() and not (files / "x.safetensors").exists()



def test_an_error_message_of_several_lines_is_printed_on_one(files, monkeypatch, capsys):
    """diffusers' hub errors, wrapped in a ModelLoadError (`--base` a file from_single_file cannot place),
    have several lines; the CLI prints them joined, so that every error is one line."""
    from lora_lab import cli
    from lora_lab.models import ModelLoadError

    def fails(path):
        raise ModelLoadError(f"{path}: cannot load (LocalEntryNotFoundError: Got: ConnectError\n"
                             "An error happened while trying to locate the files on the Hub.)")

    monkeypatch.setattr(cli, "load_lora", fails)
    assert main(["inspect", str(files / "a.safetensors")]) == 2
    err = capsys.readouterr().err
    assert (err.count("\n") == 1 and err.startswith("lora-lab: error: ")
            and "ConnectError An error happened" in err)

@pytest.mark.slow
def test_exit_code_of_the_real_process(files):
    r = subprocess.run([sys.executable, "-m", "lora_lab.cli", "inspect", str(files / "nope.safetensors")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("lora-lab: error:")


# ---------------------------------------------------------------------- never the input, OS errors (issue 12)


def _run(argv) -> tuple[int, str]:
    try:
        return main([str(a) for a in argv]), ""
    except SystemExit as e:  # argparse's own errors
        return e.code, ""


@pytest.mark.parametrize("case", ["merge_out_is_base", "merge_out_is_lora", "merge_out_links_to_base",
                                  "convert_dst_is_src", "convert_dst_links_to_src"])
def test_the_cli_never_overwrites_its_input_without_overwrite(files, capsys, case):
    base, a = files / "base.safetensors", files / "a.safetensors"
    link = files / "link.safetensors"
    if case == "merge_out_links_to_base":
        link.symlink_to(base)
    if case == "convert_dst_links_to_src":
        link.symlink_to(a)
    argv, victim = {
        "merge_out_is_base": (["merge", base, base, "--lora", f"{a}:0.5"], base),
        "merge_out_is_lora": (["merge", base, a, "--lora", f"{a}:0.5"], a),
        "merge_out_links_to_base": (["merge", base, link, "--lora", f"{a}:0.5"], base),
        "convert_dst_is_src": (["convert", a, a, "--to", "peft"], a),
        "convert_dst_links_to_src": (["convert", a, link, "--to", "peft"], a),
    }[case]
    before = victim.read_bytes()
    rc, _ = _run(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "refusing to overwrite an input" in err and "--overwrite" in err, err
    assert victim.read_bytes() == before
    assert main([str(x) for x in argv] + ["--overwrite"]) == 0  # asked for: replaced atomically
    written = link if "links" in case else victim
    assert written.read_bytes() != before and load_file(str(written))


def test_sample_never_writes_its_png_over_a_lora_file(files, capsys):
    a = files / "a.safetensors"
    before = a.read_bytes()
    rc = main(["sample", "--model", "sd15", "--lora", f"{a}:1", "--prompt", "x", "--output", str(a)])
    assert rc == 2 and "refusing to overwrite an input" in capsys.readouterr().err
    assert a.read_bytes() == before



@pytest.mark.parametrize(("flag", "value", "said"), [
    ("--steps", "0", "--steps 0: must be an integer in [1, 1000]"),
    ("--steps", "-1", "--steps -1: must be an integer in [1, 1000]"),
    ("--steps", str(10**25), "must be an integer in [1, 1000]"),  # a ValueError traceback from numpy
    ("--guidance", "nan", "--guidance nan: must be a finite number"),
    ("--guidance", "inf", "--guidance inf: must"),
    ("--seed", str(2**64), "must be an integer in [-2**63, 2**64)"),
    ("--device", "tpu", "must be auto, cpu, cuda"),
    ("--output", "s.jpg", "--output s.jpg: the grid is a PNG"),  # it wrote PNG bytes under that name
])
def test_sample_flags_out_of_range_are_one_error_line(files, capsys, flag, value, said):
    """--steps 0 was a ZeroDivisionError, --seed 2**64 a ValueError, --device tpu a RuntimeError; --steps -1
    and a NaN guidance wrote a PNG."""
    out = files / "s.png"
    rc = main(["sample", "--model", "sd15", "--prompt", "x", "--output", str(out), flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("lora-lab: error: ") and said in err, err
    assert not out.exists()

@pytest.mark.parametrize("strength", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_strength_is_one_error_line(files, capsys, strength):
    rc, _ = _run(["merge", files / "base.safetensors", files / "m.safetensors",
                  "--lora", f"{files / 'a.safetensors'}:{strength}"])
    err = capsys.readouterr().err
    assert rc == 2 and "the strength must be a finite number" in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1
    assert not (files / "m.safetensors").exists()


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder this process cannot write to: a chmod 555 folder; as root (whom chmod does not stop) a
    read-only tmpfs mounted on a folder of tmp_path (unmounted after), else a skip. Never a system folder."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                             capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"running as root and cannot mount a read-only folder: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_the_read_only_folder_is_a_temporary_one_nothing_can_be_written_to(read_only_folder, tmp_path):
    """Test hygiene: the folder the OS-error tests write into is under tmp_path (it was /sys as root)."""
    assert read_only_folder.resolve().is_relative_to(tmp_path.resolve())
    with pytest.raises(OSError):
        (read_only_folder / "x").write_bytes(b"x")


@pytest.mark.parametrize("case", ["read_only_folder", "disk_full", "output_is_a_folder", "parent_is_a_file"])
def test_os_errors_are_one_line_naming_the_path_and_leave_the_disk_as_it_was(
    files, capsys, monkeypatch, case, request
):
    src = files / "a.safetensors"
    old = files / "old.safetensors"
    old.write_bytes(b"the previous output")
    dst = {"read_only_folder": lambda: request.getfixturevalue("read_only_folder") / "out.safetensors",
           "disk_full": lambda: old,
           "output_is_a_folder": lambda: files,
           "parent_is_a_file": lambda: src / "out.safetensors"}[case]()
    if case == "disk_full":  # the file system reports ENOSPC when the data is synced (delayed allocation)
        def full(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(os, "fsync", full)
    listing = sorted(p.name for p in files.iterdir())
    rc = main(["convert", str(src), str(dst), "--to", "peft"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("lora-lab: error: "), err
    assert str(dst) in lines[0] and "Traceback" not in err
    assert sorted(p.name for p in files.iterdir()) == listing  # no temp file, nothing new
    assert old.read_bytes() == b"the previous output"
    assert load_lora(src).modules  # the input is intact


_KILLED_WRITER = """
import os, signal, sys
from lora_lab import fileio
def killed(src, dst):  # the process dies after writing its temp file, before the rename
    os.kill(os.getpid(), signal.SIGKILL)
fileio.os.replace = killed
fileio.atomic_write_bytes(sys.argv[1], b"x" * 100000)
"""


def test_temp_files_of_a_killed_write_are_removed_at_the_next_write(files, monkeypatch):
    folder = files / "out"
    folder.mkdir()
    r = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(folder / "x.safetensors")], timeout=120,
                       check=False, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert r.returncode == -signal.SIGKILL
    left = [p.name for p in folder.iterdir()]
    assert len(left) == 1 and left[0].startswith(".x.safetensors.lora_lab-") and left[0].endswith(".tmp")
    live = folder / f".y.safetensors.lora_lab-{os.getpid()}-abc123.tmp"  # a write in progress (this process)
    foreign = folder / ".notes.tmp"  # not lora_lab's
    live.write_bytes(b"busy")
    foreign.write_bytes(b"someone else's")

    synced = []  # (what, is a folder) in order: the folder must be fsynced after the rename
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(("fsync", stat.S_ISDIR(os.fstat(fd).st_mode))),
                                                  real_fsync(fd))[-1])
    monkeypatch.setattr(os, "replace", lambda a, b: (synced.append(("replace", False)),
                                                     real_replace(a, b))[-1])
    assert main(["convert", str(files / "a.safetensors"), str(folder / "a.safetensors"), "--to", "peft"]) == 0
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == sorted(["a.safetensors", live.name, foreign.name])
    assert synced[-2:] == [("replace", False), ("fsync", True)]


@pytest.mark.slow
def test_inspect_under_an_address_space_limit_is_one_error_line(tmp_path):
    """A file that declares a 512 GiB tensor (sparse on disk), inspected under `ulimit -v` 4 GiB: mapping it
    fails with ENOMEM, which is the project's one-line error, exit 2 (it was a 17-line MemoryError)."""
    import json
    import resource
    import struct

    header = json.dumps({"lora_unet_x.lora_down.weight": {"dtype": "F32", "shape": [2**17, 2**20],
                                                          "data_offsets": [0, 2**39]}}).encode()
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + 2**39)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))

    r = subprocess.run([sys.executable, "-m", "lora_lab.cli", "inspect", str(path)], capture_output=True,
                       text=True, timeout=300, preexec_fn=limit, check=False,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("lora-lab") or "Error" in ln]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines == [f"lora-lab: error: {path}: cannot map its {path.stat().st_size} bytes into memory "
                     "(Cannot allocate memory (os error 12)); not enough address space"], r.stderr[-2000:]


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lycoris_files_inspect_merge_and_refuse_to_convert(files, capsys, kind):
    from torch import nn

    from lora_lab.formats.lycoris import save_lycoris
    from lora_lab.lora.lycoris import add_lycoris

    model = nn.Module()  # the base file's layers
    model.proj, model.conv_in = nn.Linear(8, 16), nn.Conv2d(4, 16, 3)
    add_lycoris(model, kind, ["proj", "conv_in"], rank=1, alpha=1.0, factor=4)  # rank 2: W2 (4 x 4) whole
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    lyco = save_lycoris(files / "lyco.safetensors", model, "unet", base="sd15")
    assert main(["inspect", str(lyco)]) == 0
    out = capsys.readouterr().out
    assert "format:  lycoris" in out and "base:    sd15" in out and f"kinds:   {kind} (x2)" in out
    assert "ranks:   1 (x2)" in out and "alphas:  1 (x2)" in out
    detail = "lokr w1=4x2 r=1" if kind == "lokr" else "loha r=1"  # proj: 16 = 4 x 4, 8 = 2 x 4
    assert f"unet.proj     {detail} alpha=1 weight (16, 8)" in out and "weight (16, 36)" in out
    assert main(["convert", str(lyco), str(files / "x.safetensors"), "--to", "peft"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a LyCORIS LoKr/LoHa file" in err and "nothing to convert" in err
    assert not (files / "x.safetensors").exists()
    out = files / "merged.safetensors"  # stacked with a LoRA file
    assert main(["merge", str(files / "base.safetensors"), str(out), "--lora", f"{lyco}:0.5",
                 "--lora", str(files / "a.safetensors")]) == 0
    base = load_file(str(files / "base.safetensors"))
    got, lora = load_file(str(out)), merge_loras(base, [(files / "a.safetensors", 1.0)])
    for name in ("proj", "conv_in"):  # W + D_lora + t dW
        expect = lora[f"{name}.weight"] + 0.5 * model.get_submodule(name).delta_weight().detach()
        torch.testing.assert_close(got[f"{name}.weight"], expect, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- a new user's pass (qa)


def test_convert_with_the_files_own_base_or_none_still_works(files, capsys):
    """`--base` that contradicts the file's recorded base is refused (above: it wrote an sd15 LoRA labelled
    sdxl, its ss_base_model_version still sd_v1); the file's own base is accepted."""
    a, out = files / "a.safetensors", files / "x.safetensors"
    assert main(["convert", str(a), str(out), "--to", "peft", "--base", "sd15"]) == 0
    assert load_lora(out).base == "sd15"


@pytest.mark.slow
def test_a_reader_that_closes_the_pipe_is_not_an_error(files):
    """`lora-lab inspect F | head`: the reader goes away; the command printed `lora-lab: error: [Errno 32]
    Broken pipe` and exited 2."""
    p = subprocess.Popen([sys.executable, "-m", "lora_lab.cli", "inspect", str(files / "a.safetensors")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the command has printed anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 1 and err == ""


def test_train_help_says_each_default_once():
    """`lora-lab train --help` showed '(default: the set in data/) (default: None)'."""
    from lora_lab.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    text = " ".join(train.format_help().split())
    assert "(default: the set in data/)" in text
    assert not re.search(r"\(default: [^)]*\) \(default:", text) and text.count("(default:") > 40


def _flags(command: str, capsys) -> set[str]:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", capsys.readouterr().out))


def test_plan_and_train_take_the_same_run_flags(capsys):
    """`lora-lab plan` plans the run `lora-lab train` makes of the same flags: one list of run flags, made
    from TrainConfig's fields; each command adds only what it does with the run."""
    train, plan = _flags("train", capsys), _flags("plan", capsys)
    assert train - plan == {"--dry-run"} and plan - train == {"--attention"}
    assert {"--feed-forward", "--adapter", "--ema-decay", "--text-encoder-lr", "--optimizer", "--reg-dataset",
            "--caption-variants", "--sample-every", "--validation-split", "--config"} <= plan


def test_plan_plans_the_flags_it_is_given(monkeypatch, capsys):
    """A flag of the run changes the run planned (the dry run ignored --feed-forward before)."""
    from lora_lab.planning import planner

    planned = []
    monkeypatch.setattr(planner, "_plan", lambda config, options, *_: planned.append(config) or
                        planner.MemoryPlan("sdxl", "real", options, "flash", dict.fromkeys(
                            ("cache", "load", "train step", "save", "sample"), 1), {"frozen weights": 1}, 1,
                            "cache", "backward", 0, 0, resolution=1024, base_dtype="bf16"))
    assert main(["plan", "--model", "sd35-medium", "--feed-forward", "--ema-decay", "0.99",
                 "--lokr-factor", "4", "--adapter", "lokr"]) == 0
    config = planned[0]
    assert (config.model, config.base, config.feed_forward, config.ema_decay, config.adapter) == (
        "sd3", "real:sd35-medium", True, 0.99, "lokr")
    assert config.mixed_precision == "bf16" and config.device == "cuda"  # a plan's defaults
    planned.clear()
    assert main(["train", "--model", "sdxl", "--dry-run", "--feed-forward"]) == 0
    assert planned[0].feed_forward and planned[0].base is None  # the tiny base, as `train` would


def test_plan_of_a_run_file_is_the_plan_of_the_same_flags(tmp_path, monkeypatch):
    """`lora-lab plan --config FILE` plans as `lora-lab plan` with the file's settings as flags: a plan's
    defaults under the file, the real model of the file's model (also a real model's name)."""
    from lora_lab.planning import planner

    planned = []
    monkeypatch.setattr(planner, "_plan", lambda config, options, *_: planned.append((config, options)) or
                        planner.MemoryPlan(options["model"], "real", options, "flash", dict.fromkeys(
                            ("cache", "load", "train step", "save", "sample"), 1), {"frozen weights": 1}, 1,
                            "cache", "backward", 0, 0, resolution=256, base_dtype="bf16"))
    run = tmp_path / "run.toml"
    run.write_text('model = "sd35-medium"\nrank = 8\nresolution = 256\n')
    assert main(["plan", "--config", str(run), "--optimizer", "prodigy", "--lr", "1.0"]) == 0
    config, options = planned[0]
    assert (config.model, config.base, config.rank, config.device, config.mixed_precision) == (
        "sd3", "real:sd35-medium", 8, "cuda", "bf16")
    assert {c.optimizer for c, _ in planned} == {"prodigy"} and options["model"] == "sd35-medium"
