"""The plan cache on disk (lora_lab/planning/cache.py): a hit is the plan made again, every input is in the
key, a damaged file is planned again and rewritten, where the cache lives."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lora_lab.planning import cache, planner
from lora_lab.planning.planner import plan_memory, plan_options

TINY = dict(size="tiny", device="cpu", base_dtype="fp32", rank=4, mixed_precision="no", sample_steps=0)


@pytest.fixture
def plans_in(tmp_path, monkeypatch):
    folder = tmp_path / "plans"
    monkeypatch.setenv("LORA_LAB_PLAN_CACHE", str(folder))
    return folder


def _same(a, b) -> bool:
    return replace(a, seconds=0.0, cached=False) == replace(b, seconds=0.0, cached=False)


def test_a_cached_plan_is_the_plan_made_again(plans_in):
    made = plan_memory("sd15", **TINY)
    assert not made.cached and len(list(plans_in.glob("*.json"))) == 1
    again = plan_memory("sd15", **TINY)  # read back: the plan made on fake tensors above, field by field
    assert again.cached and _same(again, made) and again.seconds < made.seconds


def _fake_plan(calls):
    def plan(config, options, limit=None):
        calls.append(options)
        phases = {"cache": 1, "load": 2, "train step": 5, "save": 2, "sample": 0}
        return planner.MemoryPlan(options["model"], str(options["size"]), options, "native (cpu)", phases,
                                  {"frozen weights": 5}, 5, "train step", "backward", 3, 1, host=phases)
    return plan


@pytest.mark.parametrize("damage", [b"{not json", b"\x80\x03pickle", b"[]", b'{"key": "another", "plan": {}}',
                                    "wrong peak", "missing field"])
def test_a_damaged_cache_file_is_ignored_and_rewritten(plans_in, monkeypatch, damage):
    calls = []
    monkeypatch.setattr(planner, "_plan", _fake_plan(calls))
    first = plan_memory("sd15", **TINY)
    (path,) = plans_in.glob("*.json")
    if isinstance(damage, bytes):
        path.write_bytes(damage)
    else:
        data = json.loads(path.read_text())
        if damage == "wrong peak":
            data["plan"]["peak"] = "5"
        else:
            del data["plan"]["gradients"]
        path.write_text(json.dumps(data))
    second = plan_memory("sd15", **TINY)
    assert not second.cached and len(calls) == 2 and _same(second, first)
    third = plan_memory("sd15", **TINY)  # the file was rewritten
    assert third.cached and len(calls) == 2 and _same(third, first)


def test_a_cache_entry_edited_consistently_is_planned_again_with_a_warning(plans_in, monkeypatch):
    """Every figure divided by 1000 (a plan still consistent in itself) no longer matches the checksum stored
    with its key: never returned, the plan is made again and the file rewritten."""
    calls = []
    monkeypatch.setattr(planner, "_plan", _fake_plan(calls))
    first = plan_memory("sd15", **TINY)
    (path,) = plans_in.glob("*.json")
    data = json.loads(path.read_text())
    assert set(data) == {"key", "checksum", "plan"}
    data["plan"] = {k: (v // 1000 if isinstance(v, int) and not isinstance(v, bool) else
                        {n: b // 1000 for n, b in v.items()} if k in ("phases", "parts") else v)
                    for k, v in data["plan"].items()}
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=f"{path.name}: the cached plan does not match its checksum"):
        second = plan_memory("sd15", **TINY)
    assert not second.cached and len(calls) == 2 and _same(second, first)
    assert plan_memory("sd15", **TINY).cached and len(calls) == 2  # rewritten with its checksum


def _key(model="sdxl", *, attention="auto", checkpoint_options=None, **fields) -> str:
    config = planner.plan_config(model, **fields)
    return cache.plan_key(config, plan_options(config, attention, checkpoint_options))


def test_every_input_of_a_plan_changes_its_key(tmp_path, monkeypatch):
    key = _key()
    changed = {"resolution": 512, "batch_size": 2, "grad_accum": 2, "rank": 8, "dora": True, "conv": True,
               "optimizer": "adamw8bit", "gradient_checkpointing": True, "mixed_precision": "fp16",
               "base_dtype": "fp32", "base_quantization": "nf4", "keep_encoders": True, "vae_tiling": True,
               "sample_steps": 0, "attention": "math", "device": "cpu", "ema_decay": 0.9,
               "text_encoder_lr": 1e-4, "adapter": "loha", "feed_forward": True, "sample_every": 5,
               "caption_dropout": 0.1}
    keys = {name: _key(**{name: value}) for name, value in changed.items()}
    keys["model"] = _key("flux-dev")
    keys["checkpoint_options"] = _key(gradient_checkpointing=True, checkpoint_options={"k": 2})
    keys["size"] = _key(size="tiny")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("a caption")
    keys["dataset"] = _key(dataset=str(data))
    for name, target, attr, value in [
            ("lora_lab version", cache, "__version__", "9.9"),
            ("lora_lab source", cache, "source_hash", lambda: "another"),
            ("torch", cache.torch, "__version__", "0.0"),
            ("diffusers", cache, "_version", lambda package: "0.0" if package == "diffusers" else "1")]:
        with monkeypatch.context() as m:
            m.setattr(target, attr, value)
            keys[name] = _key()
    assert len(set(keys.values()) | {key}) == len(keys) + 1, keys
    # what the memory does not depend on is not in the key: the same plan serves both runs
    assert _key(lr=1e-3, steps=5, seed=7, ema_decay=0.5) == _key(ema_decay=0.9)
    assert _key(gradient_checkpointing="full") == _key(gradient_checkpointing=True)
    # a data folder's files are in its key: a caption rewritten is another plan
    before = _key(dataset=str(data))
    (data / "a.txt").write_text("a longer caption than before")
    assert _key(dataset=str(data)) != before
    # a local folder's configs are in its key: edit one, and it is another plan
    folder = tmp_path / "base"
    (folder / "unet").mkdir(parents=True)
    (folder / "model_index.json").write_text("{}")
    (folder / "unet" / "config.json").write_text('{"sample_size": 64}')
    config = planner.TrainConfig(model="sdxl", base=str(folder), device="cuda")
    before = cache.plan_key(config, {})
    assert cache.plan_key(config, {}) == before
    (folder / "unet" / "config.json").write_text('{"sample_size": 128}')
    assert cache.plan_key(config, {}) != before


def test_where_plans_are_cached(tmp_path, monkeypatch):
    monkeypatch.delenv("LORA_LAB_PLAN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "lora_lab" / "plans"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_dir() == Path.home() / ".cache" / "lora_lab" / "plans"
    monkeypatch.setenv("LORA_LAB_PLAN_CACHE", str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("LORA_LAB_PLAN_CACHE", "off")
    assert cache.cache_dir() is None and cache.store_plan("k", {}) is None and cache.load_plan("k") is None
