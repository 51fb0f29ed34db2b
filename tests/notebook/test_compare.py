"""`--compare A B`: the claims that flipped (exit 1), the numbers that moved beyond the tolerance (timing
never, a declared tolerance where larger), the parameters and provenance that differ."""

from __future__ import annotations

import copy
import json

import pytest

from lora_lab.notebook.__main__ import main
from lora_lab.notebook.compare import CompareError, compare_folders, compare_records

RECORD = {
    "notebook": "03_x", "parameters": {"RANK": 4, "SEED": 0},
    "numbers": {"acc": 0.9, "loss": 0.31, "train_seconds": 1.5, "sweep": {"1": 0.5, "2": [0.6, 0.7]},
                "phase": "train", "noisy": 10.0},
    "claims": {"acc >= 0.85": {"held": True, "detail": "0.900"}, "fast": {"held": True, "detail": ""}},
    "passed": True, "seconds": 12.0, "timing": ["train_seconds"],
    "tolerances": {"noisy": {"rtol": 0.05, "why": "threads reduce in another order"}},
    "provenance": {"lora_lab": {"version": "0.2.0", "git": {"commit": "a" * 40, "dirty": False}},
                   "packages": {"torch": "2.13.0"}, "machine": {"cpu": "EPYC", "cpu_capability": "AVX512"},
                   "started": "2026-01-01T00:00:00+00:00", "ended": "2026-01-01T00:01:00+00:00",
                   "seeds": [0]},
}


def _folder(path, *records):
    path.mkdir()
    for r in records:
        (path / f"{r['notebook']}.json").write_text(json.dumps(r))
    (path / "summary.json").write_text(json.dumps({"notebooks": list(records), "passed": True}))
    return path


def test_a_rerun_moves_nothing_whatever_its_seconds_and_times(tmp_path):
    b = copy.deepcopy(RECORD)
    b["seconds"], b["numbers"]["train_seconds"], b["numbers"]["noisy"] = 99.0, 7.0, 10.4  # within its 5%
    b["provenance"].update(started="2026-02-01T00:00:00+00:00", ended="2026-02-01T00:09:00+00:00")
    d = compare_records(RECORD, b, rtol=0.0)
    assert (d["flipped"], d["moved"], d["parameters"], d["provenance"]) == ([], [], {}, {})


def test_what_moved_flipped_and_differs_is_named(tmp_path, capsys):
    b = copy.deepcopy(RECORD)
    b["parameters"]["RANK"] = 8
    b["numbers"].update(acc=0.8, loss=0.3100001, phase="cache", noisy=11.0)
    b["numbers"]["sweep"]["2"][1] = 0.75
    b["claims"]["acc >= 0.85"] = {"held": False, "detail": "0.800"}
    b["provenance"]["packages"]["torch"] = "2.14.0"
    b["provenance"]["machine"]["cpu_capability"] = "AVX2"
    d = compare_records(RECORD, b, rtol=1e-3)
    assert d["flipped"] == [{"claim": "acc >= 0.85", "a": True, "b": False}]
    assert [m["number"] for m in d["moved"]] == ["acc", "sweep/2[1]", "phase", "noisy"]  # loss: within 1e-3
    assert d["parameters"] == {"RANK": [4, 8]}
    assert d["provenance"] == {"machine/cpu_capability": ["AVX512", "AVX2"],
                               "packages/torch": ["2.13.0", "2.14.0"]}

    a_dir, b_dir = _folder(tmp_path / "a", RECORD), _folder(tmp_path / "b", b)
    assert main(["--compare", str(a_dir), str(b_dir), "--rtol", "0.001"]) == 1  # a claim flipped
    text = capsys.readouterr().out
    assert "FLIPPED  acc >= 0.85: held -> failed" in text and "moved    acc: 0.9 -> 0.8" in text
    assert "param    RANK: 4 -> 8" in text and "prov     packages/torch" in text
    assert main(["--compare", str(a_dir), str(a_dir)]) == 0
    assert "1 notebooks compared: 0 claim(s) flipped, 0 number(s) moved" in capsys.readouterr().out


def test_notebooks_in_one_folder_only_are_named_and_an_empty_folder_refused(tmp_path):
    other = dict(copy.deepcopy(RECORD), notebook="04_y")
    result = compare_folders(_folder(tmp_path / "a", RECORD, other), _folder(tmp_path / "b", RECORD))
    assert result["only_in"] == {"a": ["04_y"], "b": []} and list(result["notebooks"]) == ["03_x"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(CompareError, match="no notebook records"):
        compare_folders(tmp_path / "empty", tmp_path / "a")
