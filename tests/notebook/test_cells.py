"""The workbook as a learner reads it: short cells, and the subject only (no project history)."""

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
MAX_CELL_LINES = 20  # every line of a code cell, blank and comment lines included
HISTORY = re.compile(r"\brust\b|\bcandle\b|make_var|measurements\.md|original (?:rust )?design|project notes",
                     re.I)


def _notebooks():
    return sorted(NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
def test_no_code_cell_is_longer_than_20_lines(path):
    nb = nbformat.read(path, as_version=4)
    long = [(i, len(c.source.splitlines())) for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and len(c.source.splitlines()) > MAX_CELL_LINES]
    assert not long, f"{path.name}: code cells (index, lines) over {MAX_CELL_LINES} lines: {long}"


@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
def test_the_text_speaks_of_the_subject_only(path):
    nb = nbformat.read(path, as_version=4)
    found = [(i, m.group(0)) for i, c in enumerate(nb.cells) for m in HISTORY.finditer(c.source)]
    assert not found, f"{path.name}: project history in the learner's path (cell, words): {found}"


def test_the_rules_catch_what_they_name(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("as the original Rust design did"),
                nbformat.v4.new_code_cell("\n".join(["x = 1"] * 21))]
    assert HISTORY.findall(nb.cells[0].source) == ["original Rust design"]
    assert len(HISTORY.findall("Candle's Var, make_var; see docs/measurements.md")) == 3
    assert len(nb.cells[1].source.splitlines()) > MAX_CELL_LINES
    assert not HISTORY.search("a trusted candlestick chart; rustic")
