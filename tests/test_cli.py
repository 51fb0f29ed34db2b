"""`lora-lab inspect | convert | merge`: run through `main(argv)` and as the installed console script."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_lab.cli import main
from lora_lab.formats import LoraFile, LoraModule, load_lora, save_lora
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
            "unet.proj": LoraModule(torch.randn(RANK, 8, generator=g), torch.randn(16, RANK, generator=g), ALPHA),
            "unet.conv_in": LoraModule(torch.randn(2, 4, 3, 3, generator=g), torch.randn(16, 2, 1, 1, generator=g), ALPHA),
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
    assert main(["convert", str(files / "a.safetensors"), str(files / "a_peft.safetensors"), "--to", "peft"]) == 0
    assert main(["convert", str(files / "a_peft.safetensors"), str(files / "a_back.safetensors"), "--to", "kohya"]) == 0
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
    (["merge", "base.safetensors", "m.safetensors", "--lora", "a.safetensors:strong"], "with a number after the colon"),
    (["merge", "base.safetensors", "m.safetensors"], "the following arguments are required: --lora"),
    (["merge", "a.safetensors", "m.safetensors", "--lora", "b.safetensors:1"], "match no module"),
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


def test_exit_code_of_the_real_process(files):
    r = subprocess.run([sys.executable, "-m", "lora_lab.cli", "inspect", str(files / "nope.safetensors")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("lora-lab: error:")
