"""lora_lab.notebook (parameter checks, records, the runner), the foundation notebooks, and every
notebook's shape."""

import json
import math

import nbformat
import pytest
import torch

from lora_lab.notebook import NotebookParameterError, check_parameters
from lora_lab.notebook.parameters import literal_assignments as _literal_assignments
from lora_lab.notebook.parameters import parameters_from_history as _parameters_from_history
from lora_lab.notebook.record import NOTEBOOKS, REPO, ClaimFailed, Record, report_dir
from lora_lab.notebook.runner import _cli_value, run_notebook, select_notebooks

DEFAULTS = {"EPOCHS": 3, "LR": 1e-3, "NAME": "a", "SIZES": (1, 2), "FLAG": True}


def test_literal_assignments_only_accepts_upper_case_literals():
    assert (_literal_assignments("A = 1  # comment\nB_2 = 'x'\nC = (1, 2.5)")
            == {"A": 1, "B_2": "x", "C": (1, 2.5)})
    assert _literal_assignments("a = 1") is None
    assert _literal_assignments("A = f(1)") is None
    assert _literal_assignments("import os") is None
    assert _literal_assignments("") is None


def test_check_parameters_rejects_unknown_names_and_type_changes():
    # int for float, list for tuple
    check_parameters(DEFAULTS, {"EPOCHS": 5, "LR": 1, "SIZES": [3], "FLAG": False})
    with pytest.raises(NotebookParameterError, match="EPOCH.*takes"):
        check_parameters(DEFAULTS, {"EPOCH": 5})
    with pytest.raises(NotebookParameterError, match="EPOCHS: '5' is a str"):
        check_parameters(DEFAULTS, {"EPOCHS": "5"})
    with pytest.raises(NotebookParameterError, match="FLAG"):
        check_parameters(DEFAULTS, {"FLAG": 1})
    with pytest.raises(NotebookParameterError, match="EPOCHS"):
        check_parameters(DEFAULTS, {"EPOCHS": 2.5})


def test_check_parameters_any_case_nested_types_and_nonfinite():
    with pytest.raises(NotebookParameterError, match=r"\['epochs'\].*did you mean 'EPOCHS'"):
        check_parameters(DEFAULTS, {"epochs": 5})  # a lower-case name is unknown, not ignored
    with pytest.raises(NotebookParameterError, match="SIZES: item 1: 'x' is a str"):
        check_parameters(DEFAULTS, {"SIZES": [3, "x"]})
    with pytest.raises(NotebookParameterError, match="key 'b'"):
        check_parameters({"D": {"a": 1.0}}, {"D": {"b": 2.0}})
    check_parameters({"D": {"a": 1.0}, "L": [0.5, 1.0]}, {"D": {"a": 2}, "L": [1, 2.5]})
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(NotebookParameterError, match="LR=.*NaN and Inf"):
            check_parameters(DEFAULTS, {"LR": bad})
    with pytest.raises(NotebookParameterError, match="L=.*NaN and Inf"):
        check_parameters({"L": [0.5]}, {"L": [0.5, math.nan]})
    check_parameters(DEFAULTS, {"LR": math.inf}, nonfinite_ok=frozenset({"LR"}))


def test_parameters_from_history_reads_papermill_values_and_comments():
    cell = "LIMIT = 1.0  # float; inf = no limit\nLR = 0.1  # float > 0"
    injected = "# Parameters\nLIMIT = float(\"inf\")\nLR = float('nan')\n"
    assert (_parameters_from_history(["", cell, injected])[1]
            == {"LIMIT": math.inf, "LR": pytest.approx(math.nan, nan_ok=True)})
    ns = {"In": ["", cell, "# Parameters\nLIMIT = float('inf')\n"], "LIMIT": math.inf, "LR": 0.1}
    assert Record.start("x", ns).parameters["LIMIT"] == math.inf  # its comment names inf
    ns = {"In": ["", cell, injected], "LIMIT": math.inf, "LR": math.nan}
    with pytest.raises(NotebookParameterError, match="LR=nan"):
        Record.start("x", ns)
    # typed into the parameters cell in JupyterLab (nothing injected): refused at Record.start too
    ns = {"In": ["", "LR = float('nan')  # float > 0"], "LR": math.nan}
    with pytest.raises(NotebookParameterError, match="LR=nan"):
        Record.start("x", ns)
    with pytest.raises(NotebookParameterError,
                       match=r"injected parameter LR: cannot read 'LR = os\.getcwd\(\)'"):
        _parameters_from_history(["", cell, "# Parameters\nLR = os.getcwd()\n"])


def test_runner_cli_values_are_literals_else_strings():
    assert ([_cli_value(v) for v in ("3", "0.5", "True", "[1, 2]", "sdxl", "'x'")]
            == [3, 0.5, True, [1, 2], "sdxl", "x"])
    assert math.isinf(_cli_value("float('inf')")) and _cli_value("os.getcwd()") == "os.getcwd()"


def test_report_dir_is_the_repository_reports_folder_whatever_the_cwd(tmp_path, monkeypatch):
    monkeypatch.delenv("LORA_LAB_REPORTS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert report_dir() == REPO / "reports"
    monkeypatch.chdir(NOTEBOOKS)  # where JupyterLab and papermill run a notebook
    assert report_dir() == REPO / "reports"
    monkeypatch.setenv("LORA_LAB_REPORTS", str(tmp_path / "elsewhere"))
    assert report_dir() == tmp_path / "elsewhere"


def test_record_start_sets_the_notebook_thread_policy_and_records_it(monkeypatch):
    """A notebook's kernel runs its tiny models on lora_lab.threads.notebook_threads() threads (1 unless
    $LORA_LAB_THREADS says), set by Record.start and written with the results."""
    before = torch.get_num_threads()
    try:
        for env, expected in ((None, 1), ("2", 2)):
            torch.set_num_threads(2 if expected == 1 else 1)
            if env is None:
                monkeypatch.delenv("LORA_LAB_THREADS", raising=False)
            else:
                monkeypatch.setenv("LORA_LAB_THREADS", env)
            record = Record.start("x", {"A": 1})
            assert torch.get_num_threads() == expected and record.to_json()["torch_threads"] == expected
    finally:
        torch.set_num_threads(before)


def test_parameters_from_history_finds_defaults_and_papermill_injection():
    history = ["", "import torch", "A = 1\nB = 2.0", "# Parameters\nA = 5\n", "nb = Record.start(...)"]
    assert _parameters_from_history(history) == ({"A": 1, "B": 2.0}, {"A": 5})
    rerun = history + ["A = 1\nB = 3.0"]  # the user edits and re-runs the parameters cell in JupyterLab
    assert _parameters_from_history(rerun) == ({"A": 1, "B": 3.0}, {})


def test_record_start_checks_and_collects_parameters():
    ns = {"In": ["", "A = 1\nB = 2.0", "# Parameters\nB = 4\n"], "A": 1, "B": 4}
    assert Record.start("x", ns).parameters == {"A": 1, "B": 4}
    ns["In"].append("# Parameters\nC = 4\n")
    with pytest.raises(NotebookParameterError):
        Record.start("x", ns)


def test_record_finish_writes_json_then_fails_on_a_failed_claim(tmp_path, monkeypatch):
    monkeypatch.setenv("LORA_LAB_REPORTS", str(tmp_path))
    nb = Record("demo", parameters={"A": 1})
    nb.number("loss", 0.5)
    nb.claim("holds", True)
    nb.claim("does not hold", False, "because")
    with pytest.raises(ClaimFailed, match="does not hold"):
        nb.finish()
    text, table = nb.summary()
    assert text.splitlines()[0].startswith("demo: 1 of 2 claims held")
    assert f"(results: {tmp_path.name}/demo.json)" in text and str(tmp_path.parent) not in text  # no abs path
    assert "PASS  holds" in text and "FAIL  does not hold  because" in text
    assert table.count("<tr>") == 3 and "because" in table
    data = json.loads((tmp_path / "demo.json").read_text())
    assert data["passed"] is False and data["numbers"] == {"loss": 0.5}
    assert data["claims"]["holds"]["held"] and not data["claims"]["does not hold"]["held"]
    with pytest.raises(ClaimFailed, match="no claims"):
        Record("empty", parameters={}).finish()


def test_a_claim_over_a_nan_fails_and_so_does_a_nan_among_the_numbers(tmp_path, monkeypatch):
    """Notebook 09 with TOKENS 0 passed 11/11 claims while recording NaN errors: bool(nan) is True, and a
    claim that compares other numbers said nothing of the NaN ones. Both now fail the record."""
    import numpy as np
    import torch

    monkeypatch.setenv("LORA_LAB_REPORTS", str(tmp_path))
    nb = Record("nan", parameters={})
    for held in (math.nan, np.float64("nan"), torch.tensor(math.nan)):
        assert nb.claim("over a NaN", held) is False
    assert nb.claims["over a NaN"] == {"held": False, "detail": "(over a NaN)"}
    nb = Record("nan", parameters={})
    nb.claim("bytes per parameter <= 1.02", True)
    nb.number("relative_error", {"int8": math.nan, "nf4": 0.1})
    with pytest.raises(ClaimFailed, match="no recorded number is NaN"):
        nb.finish()
    data = json.loads((tmp_path / "nan.json").read_text())
    assert not data["passed"]
    assert data["claims"]["no recorded number is NaN"]["detail"] == "NaN in relative_error"


def test_a_batch_run_shows_no_kernel_noise_in_the_terminal(tmp_path, capfd):
    """ipykernel's "Kernel is running over TCP without encryption" warning reached every batch run's terminal
    (the kernel's stderr is the runner's)."""
    good = _tiny_notebook(tmp_path / "tiny.ipynb", "N == 2")
    assert run_notebook(good, tmp_path / "out")["passed"]
    err = capfd.readouterr().err
    assert "without encryption" not in err and "IPKernelApp" not in err, err


def _tiny_notebook(path, claim_src):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("N = 2  # int\nX = 0.5  # float")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nfrom lora_lab.notebook import Record"),
        params,
        nbformat.v4.new_code_cell(f"nb = Record.start({path.stem!r}, globals())"),
        nbformat.v4.new_code_cell("fig, ax = plt.subplots(figsize=(1, 1))\nax.plot([0, X])\n"
                                  "nb.figure(fig, 'line')"),
        nbformat.v4.new_code_cell(f"nb.number('n', N)\nnb.claim('claim', {claim_src})\nnb.finish()"),
    ]
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_runner_records_pass_fail_and_bad_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # a batch shell's setting must not reach the kernel
    good = _tiny_notebook(tmp_path / "tiny.ipynb", "N == 3")
    out = tmp_path / "out"
    data = run_notebook(good, out, parameters={"N": 3})
    assert data["passed"] and data["numbers"] == {"n": 3} and data["parameters"] == {"N": 3, "X": 0.5}
    executed = nbformat.read(out / "tiny.ipynb", as_version=4)
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1  # the figure, inline
    assert [o.output_type for o in executed.cells[-2].outputs] == ["display_data"]  # no echoed path
    record = [o for o in executed.cells[-1].outputs]
    assert len(record) == 1 and "text/html" in record[0]["data"]  # one table, no echoed dict
    assert "tiny: 1 of 1 claims held" in record[0]["data"]["text/plain"]
    assert not [o for o in outputs if o.get("name") == "stderr"]
    assert (out / "figures" / "tiny_line.png").is_file()
    data = run_notebook(good, out, parameters={"N": 2})
    assert not data["passed"] and "ClaimFailed" in data["error"]
    for bad, name in (({"M": 3}, "M"), ({"n": 3}, "n"), ({"X": float("inf")}, "X"), ({"X": "a"}, "X")):
        data = run_notebook(good, out, parameters=bad)
        assert (not data["passed"] and "NotebookParameterError" in data["error"]
                and name in data["error"]), data
    assert data["notebook"] == "tiny"  # the failure report still names the notebook


def test_every_notebook_is_thin_clean_and_parameterized():
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert len(paths) >= 10 and [p.stem[:2] for p in paths] == [f"{i:02d}" for i in range(1, len(paths) + 1)]
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), f"{path.name} has outputs"
        params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1, f"{path.name}: needs exactly one cell tagged 'parameters'"
        assert _literal_assignments(params[0].source), (
            f"{path.name}: parameters cell must be UPPER_CASE literals"
        )
        assert all("#" in line for line in params[0].source.splitlines() if "=" in line), (
            f"{path.name}: each parameter needs a comment naming its allowed values"
        )
        assert nb.metadata["kernelspec"]["name"] == "lora-lab"
        intro = nb.cells[0]
        assert intro.cell_type == "markdown" and intro.source.startswith("# "), (
            f"{path.name}: opens with a title"
        )
        assert "parameters" in intro.source and "lora_lab.notebook" in intro.source, (
            f"{path.name}: the opening cell says how to change the parameters"
        )
        assert f'Record.start("{path.stem}"' in "".join(c.source for c in code), path.name
        assert code[-1].source.rstrip().endswith("nb.finish();") or "nb.finish()" in code[-1].source
        # how to change a parameter: one short paragraph (docs/workbook.md has the rest)
        how = [p for p in intro.source.split("\n\n") if "To change a parameter" in p]
        assert len(how) == 1 and len(how[0]) <= 330 and f"lora_lab.notebook {path.stem}" in how[0], (
            f"{path.name}: one short 'To change a parameter' paragraph naming `python -m lora_lab.notebook`")
        assert "the seeds" not in "".join(c.source for c in nb.cells).lower(), (
            f"{path.name}: say 'the original Rust design', not 'the seeds'")


def test_every_notebook_ends_with_exercises():
    """2-4 exercises, each a change to make and something to predict, just before the record cell."""
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        last_code = max(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        found = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "markdown" and "## Exercises" in c.source]
        assert len(found) == 1 and found[0] == last_code - 1, (
            f"{path.name}: an Exercises section just before the record cell")
        text = nb.cells[found[0]].source.split("## Exercises", 1)[1]
        items = [line for line in text.splitlines() if line[:3] in {f"{i}. " for i in range(1, 10)}]
        assert 2 <= len(items) <= 4, f"{path.name}: {len(items)} exercises"
        assert "predict" in text.lower(), f"{path.name}: the exercises ask for a prediction"


@pytest.mark.slow
def test_notebook_01_autograd(run_notebook):
    data = run_notebook("01_autograd", X=3.0)
    assert data["passed"], data
    assert data["numbers"]["dy_dx"] == 6.0


@pytest.mark.slow
def test_notebook_02_frozen_and_trainable(run_notebook):
    data = run_notebook("02_frozen_and_trainable")  # the defaults: the >= 0.90 claim, for real
    assert data["passed"], data
    n = data["numbers"]
    assert n["test_accuracy"] >= 0.90 and len(data["claims"]) == 9
    # 784-128-10: every weight trains, then only the head's 128 * 10 + 10
    assert n["trainable_values"] == {"both trainable": 784 * 128 + 128 + 128 * 10 + 10,
                                     "first layer frozen": 128 * 10 + 10}
    assert n["backward_flops"]["first layer frozen"] < n["backward_flops"]["both trainable"] / 10


@pytest.mark.slow
def test_notebook_10_training_machinery(run_notebook, monkeypatch):
    """Small runs: the mixed-precision, accumulation, kill-and-resume and CLI claims all hold."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = run_notebook("10_training_machinery", MP_STEPS=12, STEPS=6, SAVE_EVERY=2, BATCH_SIZE=2, RANK=2)
    assert data["passed"], data.get("error") or data["claims"]
    assert not run_notebook.bare_results("10_training_machinery")
    n = data["numbers"]
    assert n["fp16_skipped_steps"] >= 1 and n["accumulation_max_weight_diff"] <= 1e-6
    killed = n["killed_with_checkpoints"]
    assert killed and all(name.startswith("step_") for name in killed)


@pytest.mark.slow
def test_notebook_11_knobs(run_notebook, monkeypatch):
    """Tiny runs (one seed, 2 steps of batch 2, one sampler step): every knob's run trains on the shared
    encoding and is measured, the table and figure are made, the mechanics claims hold (the effects need the
    defaults: `make run`)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    data = run_notebook("11_knobs", STEPS=2, SEEDS=1, BATCH_SIZE=2, SAMPLE_STEPS=1, CHECK_EFFECTS=False)
    assert data["passed"], data.get("error") or data["claims"]
    assert not run_notebook.bare_results("11_knobs")
    table = data["numbers"]["table"]
    assert len(table) == 9 and all(set(v) == {"style", "content", "val_loss"} for v in table.values())
    assert all(len(x) == 1 and math.isfinite(x[0]) for v in table.values() for x in v.values())
    one_seed = data["numbers"]["one_seed"]  # section 4: the losses, flip, the masked loss, one seed each
    assert len(one_seed) == 6 and all(math.isfinite(x) for v in one_seed.values() for x in v.values())


def test_runner_selects_notebooks_by_name_file_name_or_path():
    first = min(NOTEBOOKS.glob("*.ipynb"))
    for name in (first.stem, first.name, f"notebooks/{first.name}", str(first)):
        assert select_notebooks([name]) == [first]
    assert select_notebooks([]) == sorted(NOTEBOOKS.glob("*.ipynb")) and select_notebooks(["no_such"]) == []


def test_batch_run_is_set_only_inside_the_runners_kernel_environment(tmp_path, monkeypatch):
    """Kernels the runner starts see batch_run() true (notebooks then show no widgets); others do not."""
    from lora_lab.notebook.record import BATCH_ENV, batch_run
    from lora_lab.notebook.runner import kernel_environment

    monkeypatch.delenv(BATCH_ENV, raising=False)
    assert not batch_run()
    with kernel_environment(tmp_path):
        assert batch_run()
    assert not batch_run()


@pytest.mark.slow
def test_runner_runs_notebooks_side_by_side_and_keeps_their_order(tmp_path, capfd):
    """`--jobs 2`: two notebooks in two worker processes at once; the records come back in the order asked,
    each with its wall time, and a failed claim in one does not hide the other's pass."""
    from lora_lab.notebook.runner import run_notebooks

    good = _tiny_notebook(tmp_path / "a_good.ipynb", "N == 2")
    bad = _tiny_notebook(tmp_path / "b_bad.ipynb", "N == 3")
    records = run_notebooks([good, bad], tmp_path / "out", jobs=2)
    assert [r["notebook"] for r in records] == ["a_good", "b_bad"]
    assert records[0]["passed"] and not records[1]["passed"] and "ClaimFailed" in records[1]["error"]
    assert all(r["wall_seconds"] > 0 for r in records)
    assert (tmp_path / "out" / "a_good.ipynb").is_file() and (tmp_path / "out" / "b_bad.ipynb").is_file()
    err = capfd.readouterr().err  # the kernels' shutdown (an interrupt first) leaves no line in the terminal
    assert "IPKernelApp" not in err and "KeyboardInterrupt" not in err, err


def test_the_longest_notebook_of_the_last_run_starts_first(tmp_path):
    from lora_lab.notebook.runner import longest_first

    paths = [tmp_path / f"{n}.ipynb" for n in ("01_a", "02_b", "03_c", "04_new")]
    assert longest_first(paths, tmp_path) == paths  # no summary yet: the order asked
    (tmp_path / "summary.json").write_text(json.dumps({"notebooks": [
        {"notebook": "01_a", "wall_seconds": 5.0}, {"notebook": "02_b", "wall_seconds": 90.0},
        {"notebook": "03_c", "wall_seconds": 20.0}]}))
    assert [p.stem for p in longest_first(paths, tmp_path)] == ["04_new", "02_b", "03_c", "01_a"]
    (tmp_path / "summary.json").write_text("{not json")
    assert longest_first(paths, tmp_path) == paths
