"""Shared fixtures: a seed for every test, and `run_notebook` to execute a notebook with papermill."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, which must be switched on before
# anything imports triton.language: diffusers, peft and torchao do, and with `pytest -n 2` a worker
# may import them (in another test file) before tests/test_kernels.py runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lora_lab.notebook import NOTEBOOKS, isolate_caches
from lora_lab.notebook import run_notebook as _run


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def run_notebook(tmp_path):
    """run_notebook(name, **params) -> the recorded JSON of notebooks/<name>.ipynb run with `params`.

    The executed copy, figures and JSON go to a temporary folder; the JSON is returned whether or
    not the claims held, so a test can say which one failed. `run_notebook.bare_results(name)`: see below.
    """
    isolate_caches(tmp_path / "cache")

    def run(name: str, **params):
        path = NOTEBOOKS / f"{name}.ipynb"
        assert path.exists(), f"no notebook {path}"
        data = _run(path, tmp_path / "reports", parameters=params, timeout=600)
        failed = [k for k, c in data.get("claims", {}).items() if not c["held"]]
        print(json.dumps({"numbers": data.get("numbers"), "failed": failed, "error": data.get("error")}, indent=1))
        return data

    def bare_results(name: str) -> list[str]:
        """Ids of the cells of the executed copy that show a bare value (an execute_result: a repr such as
        the Generator of `torch.manual_seed`, which no one printed)."""
        executed = json.loads((tmp_path / "reports" / f"{name}.ipynb").read_text())
        return [c.get("id") for c in executed["cells"] if any(o["output_type"] == "execute_result" for o in c.get("outputs", []))]

    run.bare_results = bare_results
    old = os.environ.get("LORA_LAB_REPORTS")
    yield run
    if old is None:
        os.environ.pop("LORA_LAB_REPORTS", None)
    else:
        os.environ["LORA_LAB_REPORTS"] = old
