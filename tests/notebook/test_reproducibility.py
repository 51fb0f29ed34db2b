"""The workbook reproduces itself: three quick notebooks, run twice with the same parameters, record the same
numbers (every one, except the wall-clock seconds and the numbers their records declare as timing), and every
record names its commit, packages and CPU. Small parameters keep it to about a minute on two busy cores."""

from __future__ import annotations

import pytest

from lora_lab.notebook.compare import compare_folders
from lora_lab.notebook.record import NOTEBOOKS
from lora_lab.notebook.runner import Job, run_jobs

# the three fastest notebooks, at sizes that keep every claim's code path (02 and 03 with their accuracy
# targets off: a few epochs do not reach them, and reproducing a number does not need them reached)
SMALL = {
    "01_autograd": {},
    "02_frozen_and_trainable": {"SIZE": 8, "HIDDEN": 16, "EPOCHS": 2, "FROZEN_EPOCHS": 1,
                                "MIN_ACCURACY": 0.0},
    "03_lora_dora": {"HIDDEN": 16, "PRETRAIN_EPOCHS": 3, "FINETUNE_EPOCHS": 3, "RANK": 4, "RANKS": [1],
                     "MIN_BASE_ACCURACY": 0.0, "MIN_ADAPTED_ACCURACY": 0.0},
}


@pytest.mark.slow
@pytest.mark.xdist_group("reproducibility")
def test_three_notebooks_run_twice_record_the_same_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    jobs = [Job(NOTEBOOKS / f"{name}.ipynb", tmp_path / run, params, f"{name} ({run})")
            for run in ("a", "b") for name, params in SMALL.items()]
    records = run_jobs(jobs, workers=2)
    assert all(r["passed"] for r in records), [(r["notebook"], r.get("error")) for r in records]
    result = compare_folders(tmp_path / "a", tmp_path / "b", rtol=0.0)  # exactly equal
    assert set(result["notebooks"]) == set(SMALL)
    for name, diff in result["notebooks"].items():
        assert not diff["flipped"] and not diff["moved"], (name, diff["flipped"], diff["moved"])
        assert not diff["parameters"] and not diff["provenance"], (name, diff)
    timing = {r["notebook"]: r["timing"] for r in records[:3]}
    assert sorted(timing["03_lora_dora"]) == ["DoRA finetune_seconds", "LoRA finetune_seconds",
                                              "pretrain_seconds"]
    assert timing["02_frozen_and_trainable"] == ["train_seconds"] and timing["01_autograd"] == []
    for r in records:  # what made each number
        prov = r["provenance"]
        assert len(prov["lora_lab"]["git"]["commit"]) == 40 and prov["packages"]["torch"] != "not installed"
        assert prov["machine"]["cpu"] and prov["machine"]["cpu_capability"] and prov["seeds"] == [0]
