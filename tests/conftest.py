"""Shared fixtures: a seed for every test, `digits_folder` (a small training folder of real digits), and
`run_notebook` to execute a notebook with papermill; the imported objects frozen for the garbage collector."""

from __future__ import annotations

import atexit
import gc
import json
import os
import random
import shutil
import tempfile

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, which must be switched on before
# anything imports triton.language: diffusers, peft and torchao do, and with `pytest -n 2` a worker
# may import them (in another test file) before tests/kernels/test_kernels.py runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Plans are made, not read from a user's plan cache (tests/planning/test_cache.py turns it on in a temp
# folder).
os.environ["LORA_LAB_PLAN_CACHE"] = "off"
# The 8-bit step's compiled C (kernels/cpu_adam8bit.py): `make test` keeps it in .venv/cache; elsewhere a
# folder of this process, not the user's cache.
if not os.environ.get("LORA_LAB_NATIVE_CACHE"):
    os.environ["LORA_LAB_NATIVE_CACHE"] = tempfile.mkdtemp(prefix="lora_lab-native-test-")
    atexit.register(shutil.rmtree, os.environ["LORA_LAB_NATIVE_CACHE"], ignore_errors=True)

from lora_lab.notebook import run_notebook as _run
from lora_lab.notebook.digits import digit_arrays
from lora_lab.notebook.record import NOTEBOOKS
from lora_lab.notebook.runner import isolate_caches

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def pytest_collection_modifyitems(items):
    """The modules with slow tests first, each module's tests kept together and in order: `--dist loadgroup`
    (the Makefile) hands out single tests in this order, so the long ones start early and the quick ones
    fill in at the end, and the two workers finish together (not one idle while the other runs a notebook
    handed out last)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def pytest_collection_finish(session):
    gc.collect()  # what the imports left as garbage, before the first test freezes the rest
    gc.freeze()


@pytest.fixture(autouse=True)
def _frozen_heap():
    """Before each test, what earlier tests and imports left alive is frozen (gc.freeze): the trainer's
    gc.collect() where it drops modules (3-5 a run) then walks only what this test made, not every object of
    the process (torch, diffusers, transformers: ~550,000; ~0.5 s a collection, 60% of a tiny run's time).
    Frozen objects are never collected, so the garbage goes first: a collection that walks only what was
    made since the last freeze (a plan, planning.run, freezes for itself and unfreezes everything at its
    end: then the next test freezes without one)."""
    if gc.get_freeze_count():
        gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def digits_folder(tmp_path_factory):
    """digits_folder(count=6, first=0, sizes=None, caption="a digit {name}") -> a new folder of scikit-learn's
    digits first .. first+count-1, white ink on black, as RGB PNGs 00.png, 01.png ... upscaled (bilinear) to
    32 x 32 or to each (H, W) of `sizes` (then count = len(sizes)), each with a .txt caption: `caption` with
    {name} the digit's name ("three"), {digit} its figure ("3")."""
    from PIL import Image

    images, labels = digit_arrays()  # (N, 8, 8) ink in [0, 1], (N,)

    def make(count: int = 6, first: int = 0, sizes=None, caption: str = "a digit {name}"):
        sizes = sizes or [(32, 32)] * count
        folder = tmp_path_factory.mktemp("digits")
        for i, (h, w) in enumerate(sizes):
            ink = (images[first + i] * 256).clamp(0, 255).to(torch.uint8).numpy()  # (8, 8)
            Image.fromarray(ink).resize((w, h), Image.BILINEAR).convert("RGB").save(folder / f"{i:02d}.png")
            label = int(labels[first + i])
            (folder / f"{i:02d}.txt").write_text(caption.format(name=DIGIT_NAMES[label], digit=label))
        return folder

    return make


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
        print(json.dumps({"numbers": data.get("numbers"), "failed": failed, "error": data.get("error")},
                         indent=1))
        return data

    def bare_results(name: str) -> list[str]:
        """Ids of the cells of the executed copy that show a bare value (an execute_result: a repr such as
        the Generator of `torch.manual_seed`, which no one printed)."""
        executed = json.loads((tmp_path / "reports" / f"{name}.ipynb").read_text())
        return [c.get("id") for c in executed["cells"]
                if any(o["output_type"] == "execute_result" for o in c.get("outputs", []))]

    run.bare_results = bare_results
    old = os.environ.get("LORA_LAB_REPORTS")
    yield run
    if old is None:
        os.environ.pop("LORA_LAB_REPORTS", None)
    else:
        os.environ["LORA_LAB_REPORTS"] = old
