"""Provenance in every record: the code (version, commit, dirty), the packages, the machine, the times, the
seeds; and the numbers a record declares as timing or with a tolerance."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from lora_lab.notebook import provenance as prov_module
from lora_lab.notebook.provenance import NOT_A_CHECKOUT, leaves, provenance, provenance_differences
from lora_lab.notebook.record import Record, RecordError


def test_provenance_names_the_commit_packages_and_machine():
    p = provenance(started=0.0, ended=60.0, seeds=[3])
    head = subprocess.run(["git", "-C", str(prov_module.REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert p["lora_lab"]["git"]["commit"] == head and isinstance(p["lora_lab"]["git"]["dirty"], bool)
    assert set(p["packages"]) == set(prov_module.PACKAGES) and p["packages"]["torch"].startswith("2.")
    assert p["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and p["machine"]["cpu"]
    assert p["started"] == "1970-01-01T00:00:00+00:00" and p["ended"] == "1970-01-01T00:01:00+00:00"
    assert p["seeds"] == [3]
    assert prov_module.package_versions(("no-such-package-x",)) == {"no-such-package-x": "not installed"}


def test_outside_a_checkout_it_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(prov_module, "REPO", tmp_path)
    assert prov_module.git_state() == NOT_A_CHECKOUT


def test_differences_leave_out_times_and_seeds():
    a = provenance(started=0.0, seeds=[0])
    b = json.loads(json.dumps(a))
    b.update(started="later", ended="later", seeds=[1, 2])
    assert provenance_differences(a, b) == {}
    b["packages"]["numpy"] = "0.0"
    assert list(provenance_differences(a, b)) == ["packages/numpy"]
    assert leaves({"a": {"b": [1, {"c": 2}]}, "d": []}) == {"a/b[0]": 1, "a/b[1]/c": 2, "d": []}


def test_a_record_declares_seeds_timing_and_tolerances(tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_LAB_REPORTS", str(tmp_path))
    nb = Record.start("seeded", {"In": ["SEED = 5  # int in [0, 9]: the seed"], "SEED": 5})
    nb.seed(7)
    first = torch.rand(3)
    nb.seed(7)
    assert torch.equal(torch.rand(3), first)  # seeded for real
    nb.number("train_seconds", 1.25, timing=True)
    nb.number("loss", 0.5, rtol=0.01, why="a reduction's order on several threads")
    with pytest.raises(RecordError, match="needs rtol >= 0 and why"):
        nb.number("x", 1.0, rtol=0.1)
    with pytest.raises(RecordError, match="not both"):
        nb.number("x", 1.0, timing=True, rtol=0.1, why="w")
    nb.claim("c", True)
    nb.finish()
    data = json.loads((tmp_path / "seeded.json").read_text())
    assert data["provenance"]["seeds"] == [5, 7] and data["timing"] == ["train_seconds"]
    assert data["tolerances"] == {"loss": {"rtol": 0.01, "why": "a reduction's order on several threads"}}
    assert data["provenance"]["lora_lab"]["version"] and data["provenance"]["machine"]["cores"] >= 1
