"""notebook/ranges.py and what Record.start does with it: each parameter's declared range enforced before any
cell uses the value, ints for floats made floats, a run's folder never outside the reports folder; notebook 09
run with hostile parameters; and a seeded fuzz test of notebooks 08 and 09's parameters."""

from __future__ import annotations

import hashlib
import math
import os
import random
from pathlib import Path

import nbformat
import pytest

from lora_lab.notebook import NotebookParameterError, Record, fresh_report_folder
from lora_lab.notebook.parameters import _assignments, check_ranges, literal_assignments
from lora_lab.notebook.ranges import parse_range, range_error
from lora_lab.notebook.record import NOTEBOOKS

# more for a longer search: LORA_LAB_FUZZ_CASES=5000
FUZZ_CASES = int(os.environ.get("LORA_LAB_FUZZ_CASES", "400"))


def parameters_cell(name: str) -> str:
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    return next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))


def start(name: str, **params) -> dict:
    """Record.start of notebook `name` as papermill runs it with `params` injected; the notebook's globals."""
    from papermill.translators import translate_parameters

    cell = parameters_cell(name)
    ns = {"In": ["", cell, translate_parameters("python", "python", params, "Parameters")],
          **literal_assignments(cell), **params}
    Record.start(name, ns)
    return ns


# ----------------------------------------------------------------------------- the grammar


@pytest.mark.parametrize(("comment", "good", "bad"), [
    ("int in [1, 64]: x", [1, 64], [0, 65, 2.0, True, "3"]),
    ("int in [256, 2048], multiple of 64", [256, 1024], [1000, 4096, 192]),
    ("float in (0, 1]: y", [1, 0.5, 1e-300], [0, -0.0, 1.5, math.nan, math.inf, "0.5", False]),
    ("float in [0, 1): z", [0.0, 0.999], [1.0, -1e-9]),
    ('one of "nf4" | "int8": the format', ["nf4", "int8"], ["fp32/../../victim", "NF4", "", 1]),
    ('str matching "[0-9]{1,4}GiB"', ["24GiB"], ["24 GiB", "24GiB/..", "9" * 20000, 24]),
    ("list of 0..2 int in [1, 9]", [[], [1, 9]], [[1, 2, 3], [0], "12", [[1]]]),
    ('list of 1..3 [one of "a" | "b", bool]', [[["a", True]], [["b", False]] * 3], [[["a"]], [], [["a", 1]]]),
    ("bool: flag", [True, False], [0, 1, "True", None]),
])
def test_a_declared_range_takes_what_it_says(comment, good, bad):
    spec = parse_range(comment)
    for v in good:
        assert range_error(spec, v, {}) is None, v
    for v in bad:
        assert range_error(spec, v, {}), v


def test_bounds_may_name_another_parameter_and_a_comment_without_a_range_declares_none():
    spec = parse_range("int in [1, HIDDEN]: rank")
    assert range_error(spec, 64, {"HIDDEN": 64}) is None and range_error(spec, 65, {"HIDDEN": 64})
    spec = parse_range("list of 0..8 int in [256, 2048], multiple of 64, only with MODELS: sweep MODELS[0]")
    assert range_error(spec, [], {"MODELS": []}) is None
    assert range_error(spec, [512], {"MODELS": ["sdxl"]}) is None
    assert range_error(spec, [512], {"MODELS": []}) == "needs MODELS (empty here)"
    assert parse_range("the point where d(x^2)/dx is taken") is None
    assert parse_range("float; inf = no limit") is not None  # a type alone, then the description
    for old_or_broken in ("float > 0", "int at least 1", "int in [1, 2: x", "one of nf4 | int8",
                          "list of 1 int", "int in [1, 2] or so"):
        assert parse_range(old_or_broken) is None, old_or_broken
    with pytest.raises(NotebookParameterError, match="parameter R: .*the bound NOPE names no numeric"):
        check_ranges({"R": "int in [1, NOPE]"}, {"R": 1})


def test_every_notebook_declares_the_range_of_each_parameter_and_its_default_is_in_it():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        found = _assignments(parameters_cell(path.stem))
        for name, (value, comment) in found.items():
            assert parse_range(comment) is not None, f"{path.name}: {name} declares no range: {comment!r}"
            if isinstance(value, (int, float)) and not isinstance(value, bool):  # an interval, or choices
                assert " in [" in comment or " in (" in comment or comment.startswith("one of "), (
                    f"{path.name}: {name} has no interval")
        check_ranges({k: c for k, (_, c) in found.items()}, {k: v for k, (v, _) in found.items()})


# ----------------------------------------------------------------------------- Record.start


@pytest.mark.parametrize(("name", "params", "said"), [
    ("08_memory_plan", {"VALIDATE": [["sd15"]]}, r"VALIDATE=.*item 0 .*not a list of 4 items"),
    ("08_memory_plan", {"MODELS": ["sdxl", "../x"]}, r"MODELS=.*item 1 .*not one of the choices"),
    ("08_memory_plan", {"RESOLUTION": 1000}, r"RESOLUTION=1000: not a multiple of 64"),
    ("08_memory_plan", {"MODELS": [], "SWEEP_RESOLUTIONS": [512]},
     r"SWEEP_RESOLUTIONS=\[512\]: needs MODELS"),
    ("09_quantized_base", {"FEATURES": 0}, r"FEATURES=0: out of range; .* int in \[512, 4096\]"),
    ("09_quantized_base", {"FEATURES": -5}, r"FEATURES=-5: out of range"),
    ("09_quantized_base", {"FEATURES": 1000000}, r"FEATURES=1000000: out of range"),
    ("09_quantized_base", {"REPS": 0}, r"REPS=0: out of range"),
    ("09_quantized_base", {"SAMPLE_STEPS": 0}, r"SAMPLE_STEPS=0: out of range"),
    ("09_quantized_base", {"TOKENS": 0}, r"TOKENS=0: out of range"),
    ("09_quantized_base", {"BATCH_SIZE": 1000000000}, r"BATCH_SIZE=1000000000: out of range"),
    ("09_quantized_base", {"FORMAT": "fp32/../../victim"}, r"FORMAT='fp32/../../victim': not one of"),
    ("03_lora_dora", {"RANK": 65}, r"RANK=65: out of range; .* int in \[1, HIDDEN\]"),
    ("01_autograd", {"X": 10**400}, r"X: .* too large for a float"),
])
def test_record_start_refuses_a_value_outside_its_declared_range(name, params, said):
    with pytest.raises(NotebookParameterError, match=f"parameter {said}"):
        start(name, **params)


def test_an_int_given_for_a_float_parameter_becomes_that_float():
    """`-p X 3` (papermill writes 3 for 3.0): notebook 01 got an int and failed in torch (TensorKindError)."""
    ns = start("01_autograd", X=3)
    assert ns["X"] == 3.0 and type(ns["X"]) is float
    ns = start("04_lora_files", STRENGTHS=[1, 0.5], SWEEP=[0, 1])
    assert [type(v) for v in ns["STRENGTHS"] + ns["SWEEP"]] == [float] * 4


def test_fresh_report_folder_stays_inside_the_reports_folder(tmp_path, monkeypatch):
    reports, victim = tmp_path / "reports", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    (reports / "run_fp32").mkdir(parents=True)
    (reports / "run_fp32" / "old.txt").write_text("old")
    (reports / "linked").symlink_to(victim)
    monkeypatch.setenv("LORA_LAB_REPORTS", str(reports))
    for name in ("run_fp32/../../victim", "../victim", "..", ".", "", "linked", "/tmp", "a/b"):
        with pytest.raises(NotebookParameterError, match="nothing was removed"):
            fresh_report_folder(name)
    assert (victim / "keep.txt").read_text() == "mine" and (reports / "linked").is_symlink()
    assert fresh_report_folder("run_fp32") == reports / "run_fp32" and not (reports / "run_fp32").exists()


# ----------------------------------------------------------------------------- notebook 09, run for real


def _snapshot(root: Path, skip: set[str]) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.relative_to(root).parts[0] in skip:
            continue
        out[str(p)] = (os.readlink(p) if p.is_symlink() else
                       hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
    return out


SMALL_09 = {"FEATURES": 512, "TOKENS": 4, "RANK": 2, "REPS": 1, "USE_REFERENCES": False, "TRAIN_STEPS": 1,
            "BATCH_SIZE": 2, "SAMPLE_STEPS": 1, "RATE_SAMPLES_PER_DIGIT": 1}


@pytest.mark.slow
def test_notebook_09_with_a_path_for_its_format_deletes_nothing(run_notebook, tmp_path):
    """`-p FORMAT "'fp32/../../victim'"` once a first run made 09_quantized_base_fp32/: the notebook removed
    the folder two levels above the reports folder. Now the parameter is refused before any cell runs."""
    reports, victim = tmp_path / "reports", tmp_path / "victim"
    (reports / "09_quantized_base_fp32").mkdir(parents=True)
    victim.mkdir()
    (victim / "thesis.txt").write_text("years of work")
    before = _snapshot(tmp_path, {"reports", "cache"})
    data = run_notebook("09_quantized_base", FORMAT="fp32/../../victim", **SMALL_09)
    assert not data["passed"] and "NotebookParameterError" in data["error"] and "FORMAT" in data["error"]
    assert _snapshot(tmp_path, {"reports", "cache"}) == before


@pytest.mark.slow
def test_notebook_09_never_trains_into_a_link_out_of_the_reports_folder(run_notebook, tmp_path):
    """Its run folder made a link to a folder elsewhere: the notebook wrote its training run through it."""
    reports, elsewhere = tmp_path / "reports", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    reports.mkdir()
    (reports / "09_quantized_base_fp32").symlink_to(elsewhere)
    before = _snapshot(tmp_path, {"reports", "cache"})
    data = run_notebook("09_quantized_base", **SMALL_09)
    assert not data["passed"] and "NotebookParameterError" in data["error"]
    assert "not a folder name inside the reports folder" in data["error"]
    assert _snapshot(tmp_path, {"reports", "cache"}) == before


# ----------------------------------------------------------------------------- fuzz: notebooks 08 and 09


HOSTILE = [0, -5, 1, 2, 63, 64, 511, 512, 1000, 4096, 4097, 10**6, 10**9, 2**63, -(2**63), 10**30, 10**400,
           0.0, -0.0, 1e-300, 0.5, 1.5, 1e308, math.nan, math.inf, -math.inf, True, False, None, "", "nf4",
           "fp32", "fp32/../../victim", "../victim", "/tmp", "sdxl", "flux-dev", "24GiB", "0GiB", "1e400GiB",
           "24 GiB",
           "9" * 5000, [], [[]], ["sdxl"], ["sdxl"] * 6, ["../x"], [512, 768], [100], [["sd15"]],
           [["sd15", False, "adamw", "no"]], [["sd15", False, "adamw", "no"]] * 5,
           [["sd3", True, "adamw8bit", "bf16"]], [["x", 1, 2, 3]], {"a": 1}, [1, [2]]]


def _hostile(rng: random.Random, default):
    """A value from HOSTILE, or the default changed: scaled, negated, a list with an item dropped or
    doubled."""
    if rng.random() < 0.6:
        return rng.choice(HOSTILE)
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return rng.choice([default * 2, default * 1000, -default, default + 1, default - 1, 0])
    if isinstance(default, list) and default:
        return rng.choice([default[:-1], default + default[-1:], [default[0], "x"]])
    return rng.choice([default.upper(), default + "/..", default * 2]) if isinstance(default, str) else None


def _usable(name: str, ns: dict) -> None:
    """What an accepted set of parameters guarantees the notebook's cells (beyond its declared ranges)."""
    from lora_lab.models import KINDS, REAL_MODELS
    from lora_lab.planning import parse_bytes
    from lora_lab.quant import FORMATS

    for k, v in literal_assignments(parameters_cell(name)).items():
        assert isinstance(ns[k], type(v)), (k, ns[k])  # ints for floats were made floats
    if name == "09_quantized_base":
        assert ns["FORMAT"] in FORMATS and fresh_report_folder(f"09_quantized_base_{ns['FORMAT']}")
        assert ns["FEATURES"] ** 2 * 4 <= 64 * 2**20 and ns["TOKENS"] * ns["FEATURES"] * 4 <= 64 * 2**20
        assert ns["RANK"] <= ns["FEATURES"] and ns["BATCH_SIZE"] <= 256 and ns["REPS"] >= 1
        assert ns["TRAIN_STEPS"] >= 1  # both runs (quantized and fp32 base) are compared step by step
    else:
        assert set(ns["MODELS"]) <= set(REAL_MODELS) and parse_bytes(ns["BUDGET"]) > 0
        assert ns["MODELS"] or not ns["SWEEP_RESOLUTIONS"]  # the sweep plans MODELS[0]
        assert all(r % 64 == 0 and r <= 2048 for r in [ns["RESOLUTION"], *ns["SWEEP_RESOLUTIONS"]])
        assert all(len(v) == 4 and v[0] in KINDS for v in ns["VALIDATE"])


@pytest.mark.parametrize("name", ["08_memory_plan", "09_quantized_base"])
def test_fuzz_notebook_parameters_are_accepted_safely_or_refused(name, tmp_path, monkeypatch):
    """Seeded: 1 to 3 parameters of the notebook set to hostile values, injected as papermill does, through
    Record.start (what runs right after the parameters cell). Each case is refused with a
    NotebookParameterError naming a parameter, or accepted with values every cell can use; nothing outside the
    reports folder changes."""
    monkeypatch.setenv("LORA_LAB_REPORTS", str(tmp_path / "reports"))
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "file.txt").write_text("mine")
    before = _snapshot(tmp_path, {"reports"})
    rng = random.Random(32)
    defaults = literal_assignments(parameters_cell(name))
    outcomes = {"accepted": 0, "refused": 0}
    for case in range(FUZZ_CASES):
        params = {k: _hostile(rng, defaults[k]) for k in rng.sample(sorted(defaults), rng.randint(1, 3))}
        try:
            ns = start(name, **params)
        except NotebookParameterError as e:
            assert any(f"parameter {k}" in str(e) or k in str(e) for k in params), (case, params, e)
            outcomes["refused"] += 1
            continue
        _usable(name, ns)
        outcomes["accepted"] += 1
    print(f"{name}: {FUZZ_CASES} parameter sets: {outcomes}")
    assert outcomes["accepted"] > FUZZ_CASES // 50 and outcomes["refused"] > FUZZ_CASES // 2, outcomes
    assert _snapshot(tmp_path, {"reports"}) == before
