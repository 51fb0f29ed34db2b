"""diffusion/state.py and checkpoints.py: which files are checkpoints (links and look-alikes never are),
checksums verified on resume, what a good checkpoint is, pruning that removes only this run's older
checkpoints, paths compared by real path; and a seeded fuzz test of checkpoint folders with links and
flipped bytes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
from safetensors.torch import load_file

from lora_lab.cli import main as cli_main
from lora_lab.diffusion.checkpoints import SANE_WEIGHT, checkpoints, digest
from lora_lab.diffusion.state import move_aside, prune, resume_point
from lora_lab.diffusion.trainer import (
    NonFiniteLossError,
    ResumeError,
    TrainConfig,
    TrainConfigError,
    load_checkpoint,
    train,
)
from lora_lab.fileio import atomic_write_bytes

SEED = 5
FAST = {"rank": 4, "lr": 1e-3, "batch_size": 2, "sample_steps": 0, "progress": False, "seed": SEED}
# more for a longer search: LORA_LAB_FUZZ_CASES=1000
FUZZ_CASES = int(os.environ.get("LORA_LAB_FUZZ_CASES", "80"))


# `--dist loadgroup` (the Makefile) spreads single tests over the workers; this file stays together:
# the module's fixtures are built once, on one worker
pytestmark = pytest.mark.xdist_group("test_run_state")


@pytest.fixture(scope="module")
def dataset(digits_folder) -> Path:
    return digits_folder(6)


@pytest.fixture(scope="module")
def three_checkpoints(dataset, tmp_path_factory) -> Path:
    """A 3-step flux run with a checkpoint after each step: <out>/checkpoints/step_000000{1,2,3}.pt."""
    out = tmp_path_factory.mktemp("three") / "out"
    train(TrainConfig(model="flux", dataset=str(dataset), output=str(out), steps=3, save_every=1,
                      keep_checkpoints=3, **FAST))
    return out / "checkpoints"


def _loras(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {k: load_file(str(folder / k)) for k in ("lora.safetensors", "pytorch_lora_weights.safetensors")}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                        for x, y in zip(a.values(), b.values()))


def _stop_at_step(monkeypatch, step: int) -> None:
    """The loss of `step` is NaN: the run stops there (NonFiniteLossError) as a killed run would, its
    checkpoints of the steps before written."""
    from lora_lab.diffusion import objectives

    real, calls = objectives.diffusion_loss, []

    def loss(pred, target):
        calls.append(1)
        return real(pred, target) * (float("nan") if len(calls) == step else 1.0)

    monkeypatch.setattr(objectives, "diffusion_loss", loss)


def _tree(root: Path) -> dict[str, str]:
    """Every path under `root` (links not followed) -> its kind and content hash or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                out[str(p)] = "link:" + os.readlink(p)
            elif p.is_file():
                out[str(p)] = "file:" + hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[str(p)] = "dir"
    return out


# ----------------------------------------------------------------------------- links named like checkpoints


@pytest.mark.slow
def test_links_named_like_checkpoints_are_ignored_and_pruning_keeps_the_real_ones(dataset, tmp_path,
                                                                               monkeypatch):
    """--keep-checkpoints 1 with `step_latest.pt -> step_0000002.pt` and `step_0000099.pt -> a file outside`:
    the resume warns about the link named like a checkpoint and goes on from the real step 2; each save keeps
    the checkpoint it wrote (and the one the links point to); the links and the file outside are untouched;
    the LoRA is the one of the run never stopped. (Before: every save deleted the checkpoint it had just
    written, and the run ended with nothing but a dangling link.)"""
    base = dict(model="flux", dataset=str(dataset), steps=4, save_every=1, keep_checkpoints=1, **FAST)
    whole = train(TrainConfig(output=str(tmp_path / "whole"), **base))
    out = tmp_path / "run"
    _stop_at_step(monkeypatch, 3)
    with pytest.raises(NonFiniteLossError):
        train(TrainConfig(output=str(out), **base))
    monkeypatch.undo()
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_0000002.pt"]
    outside = tmp_path / "elsewhere.pt"
    shutil.copy(ckpts / "step_0000002.pt", outside)
    (ckpts / "step_latest.pt").symlink_to("step_0000002.pt")
    (ckpts / "step_0000099.pt").symlink_to(outside)
    before_outside = outside.read_bytes()
    args = ["train", "--model", "flux", "--dataset", str(dataset), "--output", str(out), "--steps", "4",
            "--save-every", "1", "--keep-checkpoints", "1", "--rank", "4", "--lr", "1e-3",
            "--batch-size", "2", "--seed", str(SEED), "--sample-steps", "0", "--no-progress", "--resume"]
    with pytest.warns(UserWarning) as record:
        assert cli_main(args) == 0
    said = "\n".join(str(w.message) for w in record)
    assert "step_latest.pt" not in said  # not a checkpoint's name: never looked at
    assert "step_0000099.pt: a link or not a regular file, named like a checkpoint; ignored" in said
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step_0000002.pt", "step_0000004.pt", "step_0000099.pt", "step_latest.pt"]
    assert (ckpts / "step_latest.pt").resolve() == (ckpts / "step_0000002.pt").resolve()
    assert os.readlink(ckpts / "step_0000099.pt") == str(outside) and outside.read_bytes() == before_outside
    assert load_checkpoint(ckpts / "step_0000004.pt")["step"] == 4
    assert _same(_loras(out), _loras(Path(whole.outputs["config"]).parent))
    assert [json.loads(x)["step"] for x in (out / "loss.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.slow
def test_checkpoints_are_read_from_their_exact_names(three_checkpoints, tmp_path, dataset):
    """A link named for a later step is never the one resumed from; near-miss names are not checkpoints."""
    out = tmp_path / "out"
    shutil.copytree(three_checkpoints, out / "checkpoints")
    c = out / "checkpoints"
    (c / "step_0000099.pt").symlink_to(c / "step_0000001.pt")
    (c / "step_00000007.pt").write_bytes((c / "step_0000003.pt").read_bytes())  # 8 digits: not the name
    (c / "step_0000050.pt").mkdir()
    for name in ("step_0000004.pt.bak", "step_4.pt", "Step_0000005.pt"):
        (c / name).write_bytes(b"x")
    with pytest.warns(UserWarning, match="step_0000099.pt: a link or not a regular file"):
        assert [s for s, _ in checkpoints(out)] == [1, 2, 3]
    config = TrainConfig(model="flux", dataset=str(dataset), output=str(out), resume=True, steps=3, **FAST)
    with warnings.catch_warnings(record=True):
        path, state, bad = resume_point(config, out)
    assert path == c / "step_0000003.pt" and state["step"] == 3 and bad == []


# ----------------------------------------------------------------------------- checksums


def _flip_in(path: Path, tensor: torch.Tensor, byte: int, mask: int) -> None:
    """Flip bits `mask` of byte `byte` of the first element of `tensor`, found in the file's bytes."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.contiguous().numpy().tobytes())
    assert at > 0 and data.find(tensor.contiguous().numpy().tobytes(), at + 1) < 0
    data[at + byte] ^= mask
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_flipped_bit_in_a_checkpoint_is_found_on_resume_and_the_run_ends_bit_for_bit(dataset, tmp_path):
    """One exponent bit of an adapter weight of the newest checkpoint, one of an Adam exp_avg_sq of the one
    before (each value still finite and small: only a checksum can tell): --resume names both, renames them
    .bad, goes on from the oldest, and ends with the LoRA of the run never disturbed."""
    out, steps = tmp_path / "run", 6
    base = dict(model="flux", dataset=str(dataset), steps=steps, save_every=2, keep_checkpoints=3, **FAST)
    train(TrainConfig(output=str(out), **base))
    want = _loras(out)
    ckpts = out / "checkpoints"
    newest = torch.load(ckpts / "step_0000006.pt", weights_only=True)
    name, weight = next((n, w) for n, w in newest["adapter"].items() if w.abs().min() > 1e-3)
    _flip_in(ckpts / "step_0000006.pt", weight, 2, 0x80)  # the lowest exponent bit: x2 or /2
    middle = torch.load(ckpts / "step_0000004.pt", weights_only=True)
    sq = next(s["exp_avg_sq"] for s in middle["optimizer"]["state"].values() if s["exp_avg_sq"].min() > 0)
    _flip_in(ckpts / "step_0000004.pt", sq, 2, 0x80)
    for p in (out / "lora.safetensors", out / "pytorch_lora_weights.safetensors"):
        p.unlink()  # written again by the resumed run
    with pytest.warns(UserWarning) as record:
        train(TrainConfig(output=str(out), resume=True, **base))
    said = "\n".join(str(w.message) for w in record)
    assert "step_0000006.pt: the checksum of 'adapter' does not match" in said
    assert "step_0000004.pt: the checksum of 'optimizer' does not match" in said
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step_0000002.pt", "step_0000004.pt", "step_0000004.pt.bad", "step_0000006.pt", "step_0000006.pt.bad"]
    assert _same(_loras(out), want)


@pytest.mark.slow
def test_checksums_cover_every_entry_and_a_checkpoint_without_them_warns(three_checkpoints, tmp_path):
    good = three_checkpoints / "step_0000003.pt"
    state = torch.load(good, weights_only=True)
    assert set(state["checksums"]) == set(state) - {"checksums"}
    for change in ("losses", "rng", "config", "extra"):
        bad = dict(state)
        if change == "losses":
            bad["losses"] = [*state["losses"][:-1], state["losses"][-1] * 2]
        elif change == "rng":
            bad["rng"] = {**state["rng"], "python": (3, (0,) * 625, None)}
        elif change == "config":
            bad["config"] = {**state["config"], "rank": 8}
        else:
            bad["extra"] = 1
        torch.save(bad, tmp_path / "step_0000003.pt")
        with pytest.raises(ResumeError, match=r"step_0000003\.pt: (the checksum of|not a checkpoint train)"):
            load_checkpoint(tmp_path / "step_0000003.pt")
    old = {k: v for k, v in state.items() if k != "checksums"}  # written before checksums existed
    torch.save(old, tmp_path / "old.pt")
    with pytest.warns(UserWarning, match="written without checksums"):
        assert load_checkpoint(tmp_path / "old.pt")["step"] == 3
    assert digest(state["adapter"]) == state["checksums"]["adapter"]


# ----------------------------------------------------------------------------- what a good checkpoint is


def test_a_diverged_run_writes_no_checkpoint_and_says_where_to_start(dataset, tmp_path, monkeypatch):
    """--lr 1000 (the most bounds.py allows) with the sane bound at 100: after step 1 the LoRA weights are
    ~1000, finite but no state to go on from. Nothing is written, and the error says no good checkpoint
    exists (before: step 1 was "the last good checkpoint", and resuming from it with a lower lr failed again
    at step 2)."""
    from lora_lab.diffusion import checkpoints

    monkeypatch.setattr(checkpoints, "SANE_WEIGHT", 100.0)
    out = tmp_path / "run"
    said = (r"adapter weights reach [0-9.]+e\+03, beyond 100 \(the run diverged\) after step 1 .*"
            r"no good checkpoint was written yet: start the run again and try a lower --lr")
    with pytest.raises(NonFiniteLossError, match=said):
        train(TrainConfig(model="flux", dataset=str(dataset), output=str(out), steps=3, save_every=1,
                          **{**FAST, "lr": 1000.0}))
    assert list((out / "checkpoints").iterdir()) == []


def test_load_checkpoint_refuses_weights_beyond_the_sane_bound(three_checkpoints, tmp_path):
    state = torch.load(three_checkpoints / "step_0000003.pt", weights_only=True)
    name = next(iter(state["adapter"]))
    state["adapter"][name] = state["adapter"][name] + 2 * SANE_WEIGHT
    state["checksums"] = {k: digest(v) for k, v in state.items() if k != "checksums"}
    torch.save(state, tmp_path / "step_0000003.pt")
    with pytest.raises(ResumeError, match=rf"adapter weights reach .* beyond 10000 .*\({name}\)"):
        load_checkpoint(tmp_path / "step_0000003.pt")


# ----------------------------------------------------------------------------- paths compared by real path


@pytest.mark.slow
def test_resume_takes_the_same_reg_dataset_given_another_way(dataset, digits_folder, tmp_path, monkeypatch):
    """--reg-dataset given as a relative path, then through a symlink: the same folder, not a changed
    config."""
    reg = digits_folder(4, first=20)
    monkeypatch.chdir(reg.parent)
    base = dict(model="flux", dataset=str(dataset), output=str(tmp_path / "out"), steps=1, save_every=1,
                **FAST)
    train(TrainConfig(reg_dataset=reg.name, **base))
    link = tmp_path / "reg_link"
    link.symlink_to(reg)
    assert train(TrainConfig(reg_dataset=str(link), resume=True, **base)).steps == 1
    other = digits_folder(4, first=30)
    with pytest.raises(TrainConfigError, match="config changed .*reg_dataset"):
        train(TrainConfig(reg_dataset=str(other), resume=True, **base))


# ----------------------------------------------------------------------------- fuzz: links and flipped bytes


def _mutate_folder(rng: random.Random, ckpts: Path, outside: Path) -> list[str]:
    """1 to 3 random changes to a checkpoints folder; returns what was done."""
    done = []
    for _ in range(rng.randint(1, 3)):
        files = sorted(p for p in ckpts.iterdir() if p.is_file() and not p.is_symlink())
        kind = rng.choice(["flip", "flip", "flip", "link", "link", "link_over", "folder", "near_name",
                           "truncate"])
        name = f"step_{rng.choice([0, 1, 2, 3, 7, 99, 10**7]):07d}.pt"  # 4: the next save's own name
        if kind in ("flip", "truncate", "link_over") and not files:
            continue
        if kind == "flip":
            f = rng.choice(files)
            data = bytearray(f.read_bytes())
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            f.write_bytes(bytes(data))
        elif kind == "truncate":
            f = rng.choice(files)
            f.write_bytes(f.read_bytes()[: rng.randrange(f.stat().st_size)])
        elif kind in ("link", "link_over"):
            target = rng.choice([*(files or [ckpts]), outside / "victim.pt", outside, outside / "missing.pt",
                                 ckpts])
            where = rng.choice(files) if kind == "link_over" else ckpts / rng.choice([name, "step_latest.pt"])
            if where.exists() or where.is_symlink():
                where.unlink() if not where.is_dir() or where.is_symlink() else shutil.rmtree(where)
            where.symlink_to(target)
        elif kind == "folder" and not (ckpts / name).exists():
            (ckpts / name).mkdir()
        elif kind == "near_name":
            (ckpts / rng.choice(["step_3.pt", "step_0000003.pt.bak", "step_00000003.pt"])).write_bytes(b"x")
        done.append(kind)
    return done


def test_fuzz_checkpoint_folders_with_links_and_flipped_bytes(three_checkpoints, dataset, tmp_path):
    """Seeded: a real checkpoints folder with links (to checkpoints, outside, dangling), folders, look-alike
    names, flipped bits and cuts, then resume_point, move_aside and the pruning of a next save. Every case
    resumes from an intact checkpoint (never a changed one, never through a link), or is a TrainConfigError;
    pruning removes only regular older checkpoints of the run; nothing outside the output folder changes."""
    rng = random.Random(SEED)
    want = {s: {k: digest(v) for k, v in load_checkpoint(p).items()} for s, p in checkpoints(
        three_checkpoints.parent)}
    outcomes: dict[str, int] = {}
    for case in range(FUZZ_CASES):
        root = tmp_path / f"case{case}"
        out, outside = root / "out", root / "outside"
        shutil.copytree(three_checkpoints, out / "checkpoints")
        outside.mkdir(parents=True)
        shutil.copy(three_checkpoints / "step_0000003.pt", outside / "victim.pt")
        intact = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
        done = _mutate_folder(rng, out / "checkpoints", outside)
        before_outside = _tree(outside)
        links = {p: os.readlink(p) for p in (out / "checkpoints").iterdir() if p.is_symlink()}
        config = TrainConfig(model="flux", dataset=str(dataset), output=str(out), resume=True, steps=3,
                             **FAST)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                path, state, bad = resume_point(config, out)
            except TrainConfigError:
                outcome, path = "refused", None
            else:
                move_aside(bad)
                assert not path.is_symlink() and path.parent == out / "checkpoints", (case, done)
                assert {k: digest(v) for k, v in state.items()} == want[state["step"]], (case, done)
                unchanged = [int(n[5:12]) for n, b in intact.items() if (out / "checkpoints" / n).is_file()
                             and not (out / "checkpoints" / n).is_symlink()
                             and (out / "checkpoints" / n).read_bytes() == b]
                assert state["step"] >= max(unchanged, default=0), (case, done)
                outcome = "newest" if state["step"] == 3 else "fell back"
        if path is not None:  # the next save of the resumed run, and its pruning (keep 1)
            regular = {p for s, p in checkpoints(out, warn=False)}
            atomic_write_bytes(out / "checkpoints" / "step_0000004.pt", path.read_bytes())
            prune(out, 4, 1)
            removed = regular - {p for s, p in checkpoints(out, warn=False)}
            pinned = {os.path.realpath(p) for p in links}
            assert all(os.path.realpath(p) not in pinned for p in removed), (case, done)
            assert (out / "checkpoints" / "step_0000004.pt").is_file()
        assert {p: os.readlink(p) for p in links if p.is_symlink()} == links, (case, done)
        assert _tree(outside) == before_outside, (case, done)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        shutil.rmtree(root)
    print(f"{FUZZ_CASES} checkpoint folders: {outcomes}")
    assert sum(outcomes.values()) == FUZZ_CASES and len(outcomes) == 3, outcomes


def test_a_checkpoint_from_before_base_dtype_and_feed_forward_resumes_as_the_run_it_was(tmp_path):
    """lora_lab 0.1 wrote no base_dtype (it loaded every base in fp32) and no feed_forward (it adapted
    attention only): such a checkpoint resumes a run with those values, and is refused by one with others."""
    from dataclasses import asdict, replace

    from lora_lab.diffusion.state import RunState, check_resumable

    now = TrainConfig(model="sdxl", base_dtype="fp32", feed_forward=False, output=str(tmp_path))
    old = asdict(now)
    del old["base_dtype"], old["feed_forward"]
    state = {"config": old, "n_examples": 3, "dataset_fingerprint": "contents:f"}
    check_resumable(state, RunState(tmp_path, now, 3, "contents:f"), tmp_path / "step_0000001.pt")
    for changed in ({"feed_forward": True}, {"base_dtype": "bf16"}):
        with pytest.raises(TrainConfigError, match=f"the config changed \\({next(iter(changed))}: None"):
            check_resumable(state, RunState(tmp_path, replace(now, **changed), 3, "contents:f"),
                            tmp_path / "x.pt")


def test_a_resume_writes_the_per_step_lora_a_kill_left_unwritten_and_names_older_ones(dataset, tmp_path):
    """Killed while lora_step_0000004.safetensors was written, after checkpoint 4: the resume writes it again
    from the checkpoint (the tensors the run wrote, bit for bit); an older missing one is named."""
    out = tmp_path / "run"
    base = dict(model="flux", dataset=str(dataset), steps=4, save_every=2, keep_checkpoints=2, **FAST)
    train(TrainConfig(output=str(out), **base))
    want = load_file(str(out / "lora_step_0000004.safetensors"))
    for name in ("lora_step_0000004.safetensors", "lora_step_0000002.safetensors"):
        (out / name).unlink()
    with pytest.warns(UserWarning, match="missing per-step LoRA file.s. lora_step_0000002.safetensors, "):
        train(TrainConfig(output=str(out), resume=True, **base))
    got = load_file(str(out / "lora_step_0000004.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not (out / "lora_step_0000002.safetensors").exists()


@pytest.mark.parametrize("left", ["loss.jsonl", "samples/step_0000000.png", "config.json", "tensorboard/x"])
def test_a_fresh_run_into_a_killed_runs_folder_is_refused_and_keeps_its_files(tmp_path, capsys, left):
    """A run killed before its first checkpoint leaves its loss log, samples, config.json: a fresh run into
    that folder would append its records to the log and draw the dead run's samples into its strip."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / left).parent.mkdir(parents=True, exist_ok=True)
    (out / left).write_text("the dead run's")
    assert cli_main(["train", "--output", str(out), "--steps", "1", "--sample-steps", "0"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("lora-lab: error: ") and f"already holds {left.split('/x')[0]}" in err
    assert (out / left).read_text() == "the dead run's"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [left]


def test_a_run_resumes_with_checkpointing_or_block_swapping_changed_but_not_the_base(tmp_path):
    """Checkpointing and block swapping change memory only (the same gradients, bit for bit:
    tests/checkpointing), so a run killed on one card resumes on a smaller one with them turned on (refused as
    'the config changed' before); a quantized base changes the numbers and is still refused."""
    from dataclasses import asdict, replace

    from lora_lab.diffusion.state import RunState, check_resumable

    before = TrainConfig(model="z-image", output=str(tmp_path))
    state = {"config": asdict(before), "n_examples": 3, "dataset_fingerprint": "contents:f"}
    smaller = replace(before, gradient_checkpointing="selective", blocks_to_swap=2)
    check_resumable(state, RunState(tmp_path, smaller, 3, "contents:f"), tmp_path / "step_0000001.pt")
    with pytest.raises(TrainConfigError, match=r"the config changed \(base_quantization: None -> 'nf4'\)"):
        check_resumable(state, RunState(tmp_path, replace(smaller, base_quantization="nf4"), 3, "contents:f"),
                        tmp_path / "step_0000001.pt")
