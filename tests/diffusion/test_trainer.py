"""diffusion/trainer.py: config checks, the lr schedule, exact resume after a real kill, NaN handling,
the memory features, and the saved LoRA loading into diffusers with the same image as lora_lab's sampling."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
from safetensors.torch import load_file

from lora_lab.cli import main as cli_main
from lora_lab.diffusion.data import global_batch_indices
from lora_lab.diffusion.trainer import (
    NonFiniteLossError,
    ResumeError,
    TrainConfig,
    TrainConfigError,
    load_checkpoint,
    lr_factor,
    train,
)

REPO = Path(__file__).resolve().parents[2]
SEED = 5
N_IMAGES = 6  # a small dataset: 6 digits, 32 x 32
FAST = {"rank": 4, "lr": 1e-3, "batch_size": 2, "sample_steps": 0, "progress": False, "seed": SEED}


# `--dist loadgroup` (the Makefile) spreads single tests over the workers; this file stays together:
# the module's fixtures are built once, on one worker
pytestmark = pytest.mark.xdist_group("test_train")


@pytest.fixture(scope="module")
def dataset(digits_folder) -> Path:
    """Six scikit-learn digits, white on black, upscaled to 32 x 32, captioned 'a digit <name>'."""
    return digits_folder(N_IMAGES)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- config and schedule


@pytest.mark.parametrize(
    "field, value",
    [("model", "sd2"), ("rank", 0), ("optimizer", "sgd"), ("mixed_precision", "fp8"), ("lr", -1.0),
     ("warmup_steps", 2000), ("resolution", 30), ("dataset", "/no/such/folder"), ("schedule", "step"),
     ("lr", float("nan")), ("weight_decay", float("nan")), ("max_grad_norm", float("inf")),
     ("noise_offset", float("nan")), ("alpha", float("nan")), ("alpha", float("-inf")), ("seed", 2**64),
     ("seed", -(2**63) - 1), ("gradient_checkpointing", "sometimes"), ("gradient_checkpointing", "budget:2"),
     ("gradient_checkpointing", "budget:nan")],
)
def test_bad_config_is_a_clear_error(field, value):
    with pytest.raises(TrainConfigError, match=f"TrainConfig.{field}="):
        TrainConfig(**{field: value})


def test_cli_gradient_checkpointing_policy():
    from lora_lab.cli import build_parser

    for argv, policy in [([], None), (["--gradient-checkpointing"], "full"),
                         (["--no-gradient-checkpointing"], None),
                         (["--gradient-checkpointing", "budget:0.3"], "budget:0.3"),
                         (["--gradient-checkpointing", "selective"], "selective")]:
        args = build_parser().parse_args(["train", "--model", "sdxl", *argv])
        assert (TrainConfig(model="sdxl", gradient_checkpointing=args.gradient_checkpointing)
                .checkpointing_policy() == policy)
    assert TrainConfig(gradient_checkpointing=True).checkpointing_policy() == "full"


def test_cli_bad_value_exits_2(capsys, tmp_path):
    assert cli_main(["train", "--model", "sdxl", "--dataset", str(tmp_path / "none"),
                     "--output", str(tmp_path)]) == 2
    assert "lora-lab: error: TrainConfig.dataset=" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["train", "--rank", "many"])
    assert e.value.code == 2
    capsys.readouterr()
    for flag in ("--weight-decay", "--max-grad-norm", "--noise-offset", "--alpha"):
        assert cli_main(["train", flag, "nan", "--output", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert (err.count("\n") == 1
                and f"TrainConfig.{flag[2:].replace('-', '_')}=nan: must be a finite" in err)
    taken = tmp_path / "a_file"
    taken.write_text("not a folder")
    # a file, not a folder
    assert cli_main(["train", "--model", "flux", "--output", str(taken), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lora-lab: error: ") and str(taken) in err


def test_lr_schedule_warmup_then_cosine_and_linear():
    cfg = TrainConfig(steps=10, warmup_steps=2, schedule="cosine")
    got = [lr_factor(s, cfg) for s in range(10)]
    want = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
    assert got == pytest.approx(want)
    lin = TrainConfig(steps=4, schedule="linear")
    assert [lr_factor(s, lin) for s in range(4)] == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_data_order_is_a_permutation_per_epoch():
    n, g = 7, 3
    seen = torch.cat([global_batch_indices(SEED, s, g, n) for s in range(7)])  # 21 slots = 3 epochs
    for e in range(3):
        assert sorted(seen[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert not torch.equal(seen[:n], seen[n:2 * n])  # a new order each epoch


# ----------------------------------------------------------------------------- resume, NaN


@pytest.mark.slow
def test_killed_run_resumed_ends_bit_for_bit_like_an_uninterrupted_one(dataset, tmp_path):
    """SIGKILL a CLI run after its first checkpoint, resume it, compare with a run that was never stopped."""
    steps, every = 12, 4
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "lora_lab.cli", "train", "--model", "flux", "--dataset", str(dataset),
           "--output", str(killed), "--steps", str(steps), "--save-every", str(every), "--rank", "4",
           "--lr", "1e-3", "--batch-size", "2", "--seed", str(SEED), "--sample-steps", "0", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    first = killed / "checkpoints" / f"step_{every:07d}.pt"
    deadline = time.time() + 240
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0].decode()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed:\n{out[-2000:]}"
    assert not (killed / "lora.safetensors").exists()
    done_before_kill = sorted(p.name for p in (killed / "checkpoints").glob("step_*.pt"))
    assert done_before_kill and done_before_kill[-1] != f"step_{steps:07d}.pt"

    base = dict(model="flux", dataset=str(dataset), steps=steps, save_every=every, **FAST)
    resumed = train(TrainConfig(output=str(killed), resume=True, **base))
    whole = train(TrainConfig(output=str(tmp_path / "whole"), **base))
    assert resumed.steps == whole.steps == steps
    assert resumed.losses == whole.losses  # the whole history, the killed part included
    for key in ("lora_kohya", "lora_diffusers"):
        assert _same_bits(_tensors(resumed.outputs[key]), _tensors(whole.outputs[key])), key
    log = [json.loads(line) for line in (killed / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, steps + 1))  # no duplicated steps after the resume


def test_fresh_run_into_a_used_folder_and_resume_without_checkpoint_are_errors(dataset, tmp_path):
    with pytest.raises(TrainConfigError, match="holds no checkpoint"):
        train(TrainConfig(model="flux", dataset=str(dataset), output=str(tmp_path), resume=True, steps=1,
                          **FAST))


@pytest.mark.slow
def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_checkpoint(dataset, tmp_path, monkeypatch):
    from lora_lab.diffusion import objectives

    real, calls = objectives.diffusion_loss, []

    def loss_nan_at_step_4(pred, target):
        calls.append(1)
        loss = real(pred, target)
        return loss * float("nan") if len(calls) == 4 else loss

    monkeypatch.setattr(objectives, "diffusion_loss", loss_nan_at_step_4)
    out = tmp_path / "nan"
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 4 .*step_0000002\.pt"):
        train(TrainConfig(model="flux", dataset=str(dataset), output=str(out), steps=6, save_every=2, **FAST))
    kept = sorted(p.name for p in (out / "checkpoints").glob("*.pt"))
    assert kept == ["step_0000002.pt"]
    state = load_checkpoint(out / "checkpoints" / kept[0])  # finite weights and losses, or it raises
    assert all(torch.isfinite(v).all() for v in state["adapter"].values())
    assert not (out / "lora.safetensors").exists()
    # the error's advice works: resume from the last good checkpoint with a lower lr, clipping,
    # another precision
    monkeypatch.undo()
    done = train(TrainConfig(model="flux", dataset=str(dataset), output=str(out), steps=6, save_every=2,
                             resume=True, max_grad_norm=0.5, mixed_precision="fp16", **{**FAST, "lr": 5e-4}))
    assert (done.steps == 6 and done.losses[:2] == state["losses"]
            and all(math.isfinite(x) for x in done.losses))


@pytest.mark.slow
def test_a_run_given_an_earlier_runs_cached_data_trains_exactly_as_if_it_encoded_them(dataset, tmp_path,
                                                                                    monkeypatch):
    """`train(config, cached=result.cached)`: the same losses and adapter bits without the cache phase's
    encoding; data encoded for another seed (its VAE draws) or without the unconditional input are refused
    by name."""
    from lora_lab.diffusion import trainer

    base = dict(model="sd3", dataset=str(dataset), steps=2, caption_dropout=0.5, **FAST)
    first = train(TrainConfig(output=str(tmp_path / "a"), **base))
    monkeypatch.setattr(trainer.TrainingRun, "encode_data", None)  # a run given the data must not encode
    again = train(TrainConfig(output=str(tmp_path / "b"), **base), cached=first.cached)
    assert again.losses == first.losses and again.cached is first.cached
    for key in ("lora_kohya", "lora_diffusers"):
        assert _same_bits(_tensors(again.outputs[key]), _tensors(first.outputs[key])), key
    # a training knob may change (the run then differs); a field of the encoding may not
    knob = train(TrainConfig(output=str(tmp_path / "c"), **{**base, "loss_weighting": "cosmap"}),
                 cached=first.cached)
    assert knob.losses != first.losses
    for change, name in (({"seed": SEED + 1}, "seed"), ({"caption_dropout": 0.0}, "caption_dropout")):
        with pytest.raises(TrainConfigError, match=f"cached data: encoded for {name}="):
            train(TrainConfig(output=str(tmp_path / name), **{**base, **change}), cached=first.cached)
        assert not (tmp_path / name).exists()


# ----------------------------------------------------------------------------- the files in diffusers


@pytest.mark.slow
@pytest.mark.parametrize("model", ["sd15", "sdxl", "sd3", "flux", "chroma"])
def test_saved_lora_loads_in_diffusers_and_gives_lora_labs_image(dataset, tmp_path, model):
    """pipe.load_lora_weights(file) on a fresh pipeline samples the same image as the trained pipeline."""
    from lora_lab.diffusion import sample
    from lora_lab.models import build_pipeline, shipped_base

    # feed_forward: the files hold the transformer blocks' ff layers too, which diffusers must map as well
    result = train(TrainConfig(model=model, dataset=str(dataset), output=str(tmp_path), steps=3, rank=4,
                               lr=2e-2, batch_size=2, seed=SEED, sample_steps=0, progress=False,
                               feed_forward=True))
    assert any(name.endswith("ff.net.2") for name in result.adapted)
    prompt, steps = "a digit three", 4
    ours = sample(result.pipe, prompt, seed=SEED, steps=steps)  # (1, 3, H, W) in [0, 1]
    formats = ["lora_diffusers", "lora_kohya"] if model in ("sd15", "sdxl") else ["lora_diffusers"]
    for key in formats:
        pipe = build_pipeline(model, shipped_base(model))
        plain = sample(pipe, prompt, seed=SEED, steps=steps)
        pipe.load_lora_weights(str(result.outputs[key]))
        theirs = sample(pipe, prompt, seed=SEED, steps=steps)
        effect = (ours - plain).abs().max().item()
        assert effect > 0.02, (f"the LoRA hardly changes the image ({effect:.3g}): "
                               "the test would prove nothing")
        torch.testing.assert_close(theirs, ours, atol=2e-3, rtol=0, msg=f"{model} {key}")
    if model == "sdxl":  # `lora-lab sample` with the kohya file: a [base | base + LoRA] two-row PNG
        from PIL import Image

        png = tmp_path / "sample.png"
        args = ["sample", "--model", model, "--lora", f"{result.outputs['lora_kohya']}:1.0",
                "--prompt", prompt, "--seed", str(SEED), "--steps", str(steps), "--output", str(png)]
        assert cli_main(args) == 0
        # 1-pixel padding around and between rows
        grid = np.asarray(Image.open(png).convert("L"), dtype=float)
        h = (grid.shape[0] - 3) // 2
        top, bottom = grid[1:1 + h], grid[2 + h:2 + 2 * h]
        assert top.shape == bottom.shape and np.abs(top - bottom).max() > 5  # the LoRA row differs


# ----------------------------------------------------------------------------- notebook 07


@pytest.mark.slow
@pytest.mark.parametrize("model", ["sd15", "sdxl", "sd3", "flux"])
def test_notebook_07_runs_for_each_model(run_notebook, model):
    """Small parameters: the mechanics claims must hold (the quality targets need the full run,
    `make run`)."""
    data = run_notebook("07_diffusion_lora", MODEL=model, STEPS=8, BATCH_SIZE=8, SAMPLE_STEPS=2, EVAL_SEEDS=1,
                        UNET_STEPS=8, CHECK_TARGETS=False)
    assert data["passed"], data.get("error") or data["claims"]
    n = data["numbers"]
    assert n["adapted_modules"] > 0 and 0 < n["trainable_fraction"] < 0.2
    assert n["strength0_vs_base_max_abs_diff"] < 1e-5
    assert n["diffusers_vs_lora_lab_max_abs_diff"] < 2e-3
    assert set(n["inverted_rate_by_strength"]) == {"0.0", "0.25", "0.5", "0.75", "1.0", "1.25", "1.5"}


# ------------------------------------------------------------------------ DoRA, LoCon and the memory features


@pytest.mark.slow
def test_checkpointing_gives_the_same_dora_locon_adapter_and_mixed_precision_trains(dataset, tmp_path):
    """Gradient checkpointing recomputes the same activations: the trained adapter must not change.
    bf16 / fp16 autocast must train to a finite loss near fp32's (8-bit AdamW, DoRA and LoCon on)."""
    base = dict(model="sdxl", dataset=str(dataset), steps=2, dora=True, conv=True, optimizer="adamw8bit",
                **FAST)
    plain = train(TrainConfig(output=str(tmp_path / "plain"), **base))
    a = _tensors(plain.outputs["lora_kohya"])
    # SDXL: LDM name of conv1
    assert any(k.endswith(".dora_scale") for k in a) and any("in_layers_2" in k for k in a)
    # whole blocks, op-level from a tape, and a memory budget
    for policy in (True, "selective", "budget:0.3"):
        ckpt = train(TrainConfig(output=str(tmp_path / f"ckpt{policy}"), gradient_checkpointing=policy,
                                 **base))
        b = _tensors(ckpt.outputs["lora_kohya"])
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=f"{policy} {k}")
    for dtype in ("bf16", "fp16"):
        policy = True if dtype == "fp16" else "selective"  # (bf16: a tape recorded under autocast)
        low = train(TrainConfig(output=str(tmp_path / dtype), mixed_precision=dtype,
                                gradient_checkpointing=policy, **base))
        assert all(math.isfinite(x) for x in low.losses)
        assert low.losses[0] == pytest.approx(plain.losses[0], rel=0.05)  # the same batch, rounded inputs


# ----------------------------------------------------------------------- checkpoints that must not be trusted


class _RunsCode:
    """Unpickling this calls os.system: what a malicious step_*.pt would do on
    torch.load(weights_only=False)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def two_checkpoints(dataset, tmp_path_factory) -> Path:
    """A 2-step flux run with a checkpoint after each step: <out>/checkpoints/step_000000{1,2}.pt."""
    out = tmp_path_factory.mktemp("two") / "out"
    train(TrainConfig(model="flux", dataset=str(dataset), output=str(out), steps=2, save_every=1, **FAST))
    return out / "checkpoints"


def _spoil(path: Path, kind: str, good: Path, marker: Path) -> None:
    """Turn `path` into a bad checkpoint of the given kind (from the good checkpoint `good`)."""
    if path.exists():
        path.unlink()
    data = good.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(np.random.default_rng(SEED).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    elif kind == "folder":
        path.mkdir()
    elif kind == "pipe":  # opening it would wait for a writer for ever
        os.mkfifo(path)
    elif kind == "malicious_pickle":
        torch.save({"step": 2, "adapter": _RunsCode(marker)}, path)
    else:
        state = torch.load(good, weights_only=True)
        if kind == "wrong_keys":
            state = {"weights": state["adapter"]}
        elif kind == "nan_weights":
            next(iter(state["adapter"].values()))[0] = float("nan")
        elif kind == "nan_loss":
            state["losses"][-1] = float("nan")
        torch.save(state, path)


BAD_KINDS = ["truncated", "empty", "garbage", "folder", "pipe", "malicious_pickle", "wrong_keys",
             "nan_weights", "nan_loss"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_load_checkpoint_refuses_a_bad_file_and_runs_no_code(two_checkpoints, tmp_path, kind):
    good = two_checkpoints / "step_0000002.pt"
    assert load_checkpoint(good)["step"] == 2
    bad, marker = tmp_path / "step_0000003.pt", tmp_path / "code_ran"
    _spoil(bad, kind, good, marker)
    with pytest.raises(ResumeError, match=r"step_0000003\.pt: "), _time_limit(10):
        load_checkpoint(bad)
    assert not marker.exists(), "unpickling the checkpoint ran code"


class _Waited(Exception):
    """Not an OSError (TimeoutError is one, and load_checkpoint turns OSErrors into ResumeErrors)."""


@contextlib.contextmanager
def _time_limit(seconds: int):
    """Raise _Waited (not the error a test expects) if the block waits longer than `seconds` (SIGALRM)."""

    def expired(signum, frame):
        raise _Waited(f"waited more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_a_pipe_named_loss_jsonl_is_an_error_not_a_wait(dataset, tmp_path):
    """A fresh run refuses a folder with a loss.jsonl before it opens it (a resumed one: "the loss log is not
    a regular file")."""
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "loss.jsonl")
    with pytest.raises(TrainConfigError, match=r"already holds loss\.jsonl"), _time_limit(120):
        train(TrainConfig(model="flux", dataset=str(dataset), output=str(out), steps=1, **FAST))


@pytest.mark.slow
def test_resume_skips_bad_checkpoints_and_a_torn_log_line_and_ends_bit_for_bit(dataset, tmp_path):
    """The two newest checkpoints spoilt (a pickle that would run code, a truncated file) and the loss log's
    last line torn: --resume (through the CLI, via a symlink to the folder) warns, goes back to the newest
    good checkpoint, and ends with the files of the run that was never disturbed; no code ran."""
    out, steps = tmp_path / "run", 6
    base = dict(model="flux", dataset=str(dataset), steps=steps, save_every=2, keep_checkpoints=3, **FAST)
    whole = train(TrainConfig(output=str(out), **base))
    want = {k: _tensors(whole.outputs[k]) for k in ("lora_kohya", "lora_diffusers")}
    ckpts, marker = out / "checkpoints", tmp_path / "code_ran"
    good = ckpts / "step_0000002.pt"
    _spoil(ckpts / "step_0000006.pt", "malicious_pickle", good, marker)
    _spoil(ckpts / "step_0000004.pt", "truncated", good, marker)
    log = out / "loss.jsonl"
    log.write_text(log.read_text() + '{"step": 7, "loss": 0.12')  # an append cut short by a kill
    link = tmp_path / "link"
    link.symlink_to(out)
    args = ["train", "--model", "flux", "--dataset", str(dataset), "--output", str(link),
            "--steps", str(steps), "--save-every", "2", "--keep-checkpoints", "3", "--rank", "4",
            "--lr", "1e-3", "--batch-size", "2", "--seed", str(SEED), "--sample-steps", "0",
            "--no-progress", "--resume"]
    with pytest.warns(UserWarning) as record:
        assert cli_main(args) == 0
    said = "\n".join(str(w.message) for w in record)
    assert "step_0000006.pt: not a readable weights-only checkpoint" in said
    assert "step_0000004.pt: not a readable weights-only checkpoint" in said
    assert "step_0000002.pt, the newest good checkpoint" in said and "loss.jsonl: dropped 1 line" in said
    assert not marker.exists(), "the malicious checkpoint ran code"
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step_0000002.pt", "step_0000004.pt", "step_0000004.pt.bad", "step_0000006.pt", "step_0000006.pt.bad"]
    for k, tensors in want.items():
        assert _same_bits(_tensors(out / whole.outputs[k].name), tensors), k
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(1, steps + 1))


@pytest.mark.slow
def test_resume_refuses_a_changed_dataset(dataset, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    cfg = dict(model="flux", dataset=str(data), output=str(tmp_path / "out"), steps=2, save_every=1, **FAST)
    train(TrainConfig(**cfg))
    (data / "00.txt").write_text((data / "00.txt").read_text().replace("digit", "DIGIT"))  # the same size
    with pytest.raises(TrainConfigError, match=r"files of the dataset .* changed"):
        train(TrainConfig(resume=True, **cfg))


def test_nan_weights_are_never_checkpointed(dataset, tmp_path, monkeypatch):
    """A finite loss with an update that makes a weight NaN: the step's checkpoint is not written."""
    real, calls = torch.nn.utils.clip_grad_norm_, []

    def nan_grads_at_step_2(params, max_norm):
        calls.append(1)
        if len(calls) == 2:
            for p in params:
                p.grad.fill_(float("nan"))
        return real(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_grads_at_step_2)
    out = tmp_path / "out"
    with pytest.raises(NonFiniteLossError,
                       match=r"adapter weights are not finite after step 2 .*step_0000001\.pt"):
        train(TrainConfig(model="flux", dataset=str(dataset), output=str(out), steps=3, save_every=1, **FAST))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000001.pt"]


@pytest.mark.parametrize("model, change, message", [
    ("flux", {"rank": 65}, r"TrainConfig.rank=65: larger than the targeted layer .* use --rank \d+ or less"),
    ("sd3", {"resolution": 136},
     r"TrainConfig.resolution=136: larger than the sd3 base's position embedding"),
    ("flux", {"resolution": 4096}, r"TrainConfig.resolution=4096: the tiny flux base takes 128 pixels"),
    ("sdxl", {"resolution": 136}, r"TrainConfig.resolution=136: the tiny sdxl base takes 128 pixels"),
])
def test_rank_and_resolution_the_base_cannot_take(dataset, tmp_path, model, change, message):
    with pytest.raises(TrainConfigError, match=message):
        train(TrainConfig(model=model, dataset=str(dataset), output=str(tmp_path), steps=1,
                          **{**FAST, **change}))


def _mutants(data: bytes, n: int, seed: int):
    """n seeded mutants of `data`: bytes overwritten, a cut, or bytes inserted."""
    import random

    rng = random.Random(seed)
    for _ in range(n):
        b = bytearray(data)
        op = rng.randrange(3)
        if op == 0:
            for _ in range(rng.randrange(1, 10)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1:
            del b[rng.randrange(len(b)):]
        else:
            i = rng.randrange(len(b))
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 30)))
        yield bytes(b)


def test_fuzzed_checkpoints_load_or_raise_checkpoint_error(two_checkpoints, tmp_path):
    """200 seeded mutants of a real checkpoint: each is a good checkpoint or a ResumeError, within 2 s."""
    path, outcomes = tmp_path / "step_0000002.pt", {"good": 0, "refused": 0}
    for data in _mutants((two_checkpoints / "step_0000002.pt").read_bytes(), 200, SEED):
        path.write_bytes(data)
        t0 = time.perf_counter()
        try:
            load_checkpoint(path)
            outcomes["good"] += 1
        except ResumeError:
            outcomes["refused"] += 1
        assert time.perf_counter() - t0 < 2.0
    assert outcomes["refused"] > 100, outcomes  # most mutants break the zip or the pickle


def test_sample_steps_beyond_the_schedulers_timesteps_are_refused(dataset, tmp_path):
    """--sample-steps 10**25 trained the whole run, then ended in numpy's ValueError traceback."""
    with pytest.raises(TrainConfigError, match=r"sample_steps=10{25}.*in \[0, 1000\]"):
        TrainConfig(model="flux", dataset=str(dataset), output=str(tmp_path),
                    **{**FAST, "sample_steps": 10**25})


@pytest.mark.parametrize("flag", ["--output", "--dataset"])
def test_an_empty_folder_name_is_refused(dataset, tmp_path, monkeypatch, capsys, flag):
    """`--output ""` trained into the current folder, `--dataset ""` on it (Path("") is ".")."""
    monkeypatch.chdir(tmp_path)
    args = {"--dataset": str(dataset), "--output": "out", flag: ""}
    rc = cli_main(["train", "--model", "flux", *[x for kv in args.items() for x in kv], "--steps", "1",
                   "--sample-steps", "0", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"{flag[2:]}='': is empty" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("inside", ["", "out", "samples/run"])
def test_an_output_inside_the_dataset_is_refused_and_the_data_stays_as_it_was(dataset, tmp_path, capsys,
                                                                               inside):
    """--output DATASET (or a folder in it) put samples.png, lora.safetensors and checkpoints/ among the
    training images: a later run found an image without a caption, --resume a changed dataset."""
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    before = sorted(p.name for p in data.iterdir())
    rc = cli_main(["train", "--model", "flux", "--dataset", str(data), "--output", str(data / inside),
                   "--steps", "1", "--sample-steps", "0", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "is inside the dataset folder" in err, err
    assert sorted(p.name for p in data.iterdir()) == before


def test_a_runs_config_json_repeats_it_from_another_folder(dataset, tmp_path, monkeypatch):
    """`lora-lab train --config out/config.json --output again` from another folder: config.json held the
    dataset as typed (`--dataset data`, relative), so the repeat said 'data: is not a folder'."""
    from lora_lab.diffusion.runfile import config_from_file

    shutil.copytree(dataset, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", "--model", "flux", "--dataset", "data", "--output", "out", "--steps", "1",
                     "--rank", "4", "--sample-steps", "0", "--no-progress"]) == 0
    monkeypatch.chdir(tmp_path / "out")
    again = config_from_file("config.json", {"output": "again"})
    assert Path(again.dataset) == (tmp_path / "data").absolute() and again.output == "again"


def test_a_validation_folder_that_is_trained_on_is_refused(dataset, tmp_path):
    """--validation-dataset DATASET trained on its own validation images: the held-out loss held none out."""
    with pytest.raises(TrainConfigError, match="validation_dataset.*is inside the dataset folder"):
        TrainConfig(model="flux", dataset=str(dataset), output=str(tmp_path / "out"),
                    validation_dataset=str(dataset), **FAST)


def test_a_regularization_folder_that_is_the_dataset_is_refused(dataset, tmp_path, monkeypatch):
    """--reg-dataset DATASET (by another spelling of the same folder): the style's images trained twice, the
    prior preserved nothing."""
    monkeypatch.chdir(dataset.parent)
    with pytest.raises(TrainConfigError, match=r"reg_dataset.*is the dataset folder .*data/lora_reg"):
        TrainConfig(model="flux", dataset=str(dataset), output=str(tmp_path / "out"),
                    reg_dataset=f"./{dataset.name}/", **FAST)
    TrainConfig(model="flux", dataset=str(dataset), output=str(tmp_path / "out"), **FAST)  # without: fine


def test_a_fresh_run_never_writes_over_a_saved_lora(dataset, tmp_path, capsys):
    """A folder that holds a LoRA but no checkpoints (pruned by hand, or another tool's): a fresh run wrote
    its own lora.safetensors over it; now one error line, the file as it was."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "lora.safetensors").write_bytes(b"a LoRA trained for a week")
    rc = cli_main(["train", "--model", "flux", "--dataset", str(dataset), "--output", str(out),
                   "--steps", "1", "--sample-steps", "0", "--no-progress"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("lora-lab: error: ")]
    assert rc == 2 and len(errors) == 1 and "already holds lora.safetensors, a saved LoRA" in errors[0], err
    assert (out / "lora.safetensors").read_bytes() == b"a LoRA trained for a week"
    assert sorted(p.name for p in out.iterdir()) == ["lora.safetensors"]


@pytest.mark.parametrize("change, error", [
    ({"rank": 65}, r"TrainConfig.rank=65: larger than the targeted layer"),
    ({"base": "no-such-base"}, r"no-such-base"),
    ({"dataset": "EMPTY"}, r"EMPTY|empty|no image"),
])
def test_a_failed_start_leaves_no_output_folder(dataset, tmp_path, change, error):
    """The output folder (and its checkpoints/) is made only once the run is sure to start."""
    from lora_lab.errors import LoraLabError

    if change.get("dataset") == "EMPTY":
        (tmp_path / "EMPTY").mkdir()
        change = {"dataset": str(tmp_path / "EMPTY")}
    out = tmp_path / "out" / "run"
    with pytest.raises(LoraLabError, match=error):
        train(TrainConfig(model="flux", **{"dataset": str(dataset), **FAST, **change}, output=str(out),
                          steps=1))
    assert not (tmp_path / "out").exists()
