"""What the notebooks share: checked parameters, recorded claims, the batch runner, and the small real tasks
they teach on.

    record.py      Record (parameters checked, numbers, claims, figures -> reports/NAME.json), report_dir,
                   fresh_report_folder, batch_run
    parameters.py  a notebook's `parameters` cell and papermill's injected cell read as literals, and checked
    ranges.py      the range each parameter's comment declares (`int in [1, 64]`, `one of "a" | "b"`, ...)
    runner.py      `python -m lora_lab.notebook`: every notebook through papermill into reports/
    digits.py      scikit-learn's digits as a small real task, and a plain classifier training loop
    effect.py      what a sample shows, read by classifiers fitted on real digits (content kept, style
                   learned), and the strict reader of each tile
    tiles.py       samples drawn as a person reads them, each tile with the strict reader's reading
    exercises.py   `check_exercise(notebook, n, prediction)`: whether a learner's prediction held
    widgets.py     `slider_view(draw)`: a figure under a slider (once, as an image, in a batch run)

digits.py, effect.py and tiles.py are imported by name (`from lora_lab.notebook.digits import load_digits`):
they pull scikit-learn (and effect.py diffusers, tiles.py matplotlib), which a notebook that only records
claims does not need.
"""

from .parameters import NotebookParameterError, check_parameters
from .record import REPO, ClaimFailed, Record, batch_run, fresh_report_folder, report_dir
from .runner import run_notebook

__all__ = ["REPO", "ClaimFailed", "NotebookParameterError", "Record", "batch_run", "check_parameters",
           "fresh_report_folder", "report_dir", "run_notebook"]
