"""Sweeps (`python -m lora_lab.notebook NB --sweep NAME=V1,V2 --seeds 0,1`): the grid checked before anything
runs, each point in its own folder, resume, a failed point reported while the others go on, the aggregate."""

from __future__ import annotations

import json

import pytest
from tiny_notebooks import tiny_notebook

from lora_lab.notebook import NotebookParameterError
from lora_lab.notebook.__main__ import main
from lora_lab.notebook.aggregate import AggregateError
from lora_lab.notebook.sweep import SweepError, parse_seeds, parse_sweep, plan_sweep, point_record, run_sweep


def test_parse_sweep_and_seeds():
    assert parse_sweep("RANK=1,2,4,8") == ("RANK", [1, 2, 4, 8])
    assert parse_sweep("M=['sd15','sdxl'],[], 'a,b'") == ("M", [["sd15", "sdxl"], [], "a,b"])
    assert parse_sweep("FORMAT=nf4,int8") == ("FORMAT", ["nf4", "int8"])
    assert parse_seeds("0,1,2") == [0, 1, 2]
    for bad in ("RANK", "RANK=", "=1,2", "RANK=1,1"):
        with pytest.raises(SweepError, match="--sweep"):
            parse_sweep(bad)
    for bad in ("0,a", "", "1,1"):
        with pytest.raises(SweepError, match="--seeds"):
            parse_seeds(bad)


def test_every_point_is_checked_before_anything_runs(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb")
    points = plan_sweep(nb, [("N", [1, 2]), ("X", [1, 2.5])], [0, 7], {}, tmp_path / "out")
    assert len(points) == 8 and len({p.folder for p in points}) == 8
    assert points[0].folder == tmp_path / "out" / "sweeps" / "tiny-N-X-SEED" / "N=1_X=1.0_SEED=0"
    assert points[0].expected == {"N": 1, "X": 1.0, "SEED": 0}  # as the notebook takes them
    with pytest.raises(NotebookParameterError, match=r"tiny: parameter N=101: out of range"):
        plan_sweep(nb, [("N", [1, 101])], None, {}, tmp_path / "out")
    with pytest.raises(NotebookParameterError, match=r"tiny: unknown parameter"):
        plan_sweep(nb, [("RANK", [1])], None, {}, tmp_path / "out")
    with pytest.raises(SweepError, match="SEED is given by --seeds"):
        plan_sweep(nb, [("SEED", [1])], [0], {}, tmp_path / "out")
    no_seed = tiny_notebook(tmp_path / "noseed.ipynb", parameters="N = 2  # int in [1, 100]: n\nX = 0.5  # f")
    with pytest.raises(SweepError, match="no SEED parameter"):
        plan_sweep(no_seed, [], [0, 1], {}, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


@pytest.mark.slow
def test_a_sweep_runs_each_point_resumes_and_aggregates(tmp_path, capsys):
    nb = tiny_notebook(tmp_path / "tiny.ipynb", claim="N < 3")  # N = 3 fails its claim
    out = tmp_path / "out"
    code = run_sweep(nb, [("N", [1, 3])], [0, 1], {"X": 2.0}, out, jobs=2, plots=["x_seed"])
    text = capsys.readouterr().out
    assert code == 1 and "4 to run" in text and "FAIL  N=3_SEED=0" in text and "2 of 4 points passed" in text
    root = out / "sweeps" / "tiny-N-SEED"
    agg = json.loads((root / "aggregate.json").read_text())
    assert [p["passed"] for p in agg["points"]] == [True, True, False, False]
    rows = {(r["number"], r["values"]["N"]): r for r in agg["numbers"]}
    x = rows["x_seed", 1]  # X * (SEED + 1) at X = 2: 2 and 4
    assert (x["mean"], x["min"], x["max"], x["seeds"]) == (3.0, 2.0, 4.0, {"0": 2.0, "1": 4.0})
    assert rows["nested/a[1]", 3]["mean"] == 6.0 and rows["seconds", 1]["timing"]
    assert agg["figures"] == ["x_seed.png"] and (root / "x_seed.png").stat().st_size > 1000
    assert "| x_seed | 1 | 3 | 2 | 4 | 2 | 4 |" in (root / "aggregate.md").read_text()
    stamp = (root / "N=1_SEED=0" / "tiny.json").stat().st_mtime_ns

    # a rerun: every point is done (a failed one too: its verdict is recorded), nothing runs
    assert run_sweep(nb, [("N", [1, 3])], [0, 1], {"X": 2.0}, out, jobs=2, plots=[]) == 1
    assert "4 done before, 0 to run" in capsys.readouterr().out
    assert (root / "N=1_SEED=0" / "tiny.json").stat().st_mtime_ns == stamp
    # a point that stopped before its record runs again
    (root / "N=3_SEED=1" / "tiny.json").unlink()
    assert run_sweep(nb, [("N", [1, 3])], [0, 1], {"X": 2.0}, out, jobs=2, plots=[]) == 1
    assert "4 points, 3 done before, 1 to run" in capsys.readouterr().out
    # another value of a fixed parameter is another point: it runs
    points = plan_sweep(nb, [("N", [1])], [0], {"X": 3.0}, out)
    assert point_record(nb, points[0]) is None
    with pytest.raises(AggregateError, match="no such number.*x_seed"):
        run_sweep(nb, [("N", [1])], [0], {"X": 2.0}, out, jobs=1, plots=["no_such"])


def test_the_command_line_refuses_a_bad_sweep_before_running(capsys):
    assert main(["03_lora_dora", "--sweep", "RANK=1,100", "--seeds", "0"]) == 2
    assert "03_lora_dora: parameter RANK=100: out of range" in capsys.readouterr().err
    assert main(["01_autograd", "-p", "X", "1e9"]) == 2  # a plain batch run too
    assert "01_autograd: parameter X=1000000000.0: out of range" in capsys.readouterr().err
    assert main(["08_memory_plan", "--seeds", "0,1"]) == 2
    assert "no SEED parameter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["01_autograd", "03_lora_dora", "--sweep", "X=1"])
