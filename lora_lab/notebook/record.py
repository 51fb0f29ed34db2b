"""What every notebook records: checked parameters, named numbers and claims, figures, and where they go.

In a notebook:

    nb = Record.start("01_autograd", globals())   # right after the `parameters` cell
    ...
    nb.number("dy_dx", 4.0)
    nb.number("train_seconds", 1.2, timing=True)   # wall-clock: never compared between two runs
    nb.number("loss", 0.31, rtol=1e-3, why="...")  # a number that may move this much from run to run
    nb.seed(SEED)                                 # torch, random and numpy seeded; the seed recorded
    nb.claim("dy/dx = 4 at x = 2", dy_dx == 4.0)
    nb.figure(fig, "loss_curve")
    nb.finish()                                   # writes the JSON, then fails if a claim failed

`Record.start` reads the defaults from the notebook's `parameters` cell (from the IPython input
history, so it works in JupyterLab and under papermill alike) and checks every injected parameter
(parameters.py): a name the notebook does not define (in any case), a value of another type than
the default's (also inside lists and dicts), NaN/Inf where the parameter's comment does not say it
takes them, or a value outside the range the comment declares (ranges.py) is a `NotebookParameterError`
naming the parameter, raised in the cell right after the parameters, before any cell uses a value.
`finish()` shows one table of the claims (held or not) and writes the JSON; a claim held over a NaN, or a
NaN among the recorded numbers, fails the record (nothing holds over a number that is not a number).

A notebook writes only inside the reports folder: `fresh_report_folder(name)` is where a run's files go
(a name built from parameters that would lead outside it is refused, and nothing is removed).

Results go to `reports/` at the repository root, whatever the working directory (JupyterLab runs a
notebook in notebooks/), or to $LORA_LAB_REPORTS when it is set (the runner's `--out` sets it).

`Record.start` also sets the kernel's torch threads to `lora_lab.threads.notebook_threads()` (1, or
$LORA_LAB_THREADS): the notebooks train tiny models, whose many small ops gain little from a second thread
and collapse on two when another process keeps a core busy (JupyterLab beside a browser, a shared 2-vCPU
machine). The count is recorded with the results.

Every record carries its provenance (provenance.py: lora_lab's version and git commit, the key packages'
versions, the machine, start and end time, the seeds: the SEED parameter and each `nb.seed(n)`), and says
which of its numbers are timing (`timing=True`) or may move by a declared tolerance (`rtol=`, with why):
the reproducibility test and `--compare` compare every other number exactly.
"""

from __future__ import annotations

import html
import json
import math
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import LoraLabError
from ..fileio import atomic_write_bytes
from ..threads import notebook_threads
from .parameters import (
    NotebookParameterError,
    as_declared,
    check_parameters,
    check_ranges,
    nonfinite_allowed,
    parameter_cells,
)
from .provenance import provenance

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
REPORTS_ENV = "LORA_LAB_REPORTS"
# Set in the kernels the batch runner starts. Their notebooks show no ipywidgets there: nobody can move a
# slider in a batch run, and widget comm traffic can leave nbclient waiting for a reply that already came
# (jupyter/nbclient#312; seen here as notebook 07 hanging at its widget cell with both processes idle).
BATCH_ENV = "LORA_LAB_BATCH"


class ClaimFailed(LoraLabError):
    """A notebook's recorded claim did not hold."""


class RecordError(LoraLabError):
    """A number recorded in a way that cannot be compared (a tolerance without its reason, say)."""


def batch_run() -> bool:
    """True in a kernel started by the batch runner (`python -m lora_lab.notebook`, `make run`, the tests):
    notebooks then draw their interactive views once, as a static picture, instead of as widgets."""
    return os.environ.get(BATCH_ENV) == "1"


def report_dir() -> Path:
    """Where results go: $LORA_LAB_REPORTS if set, else reports/ at the repository root (else ./reports
    where lora_lab is installed outside a checkout)."""
    if os.environ.get(REPORTS_ENV):
        return Path(os.environ[REPORTS_ENV]).expanduser().resolve()
    return REPO / "reports" if NOTEBOOKS.is_dir() else Path("reports").resolve()


_PLAIN_NAME = re.compile(r"[\w+-][\w.+-]*")  # one file or folder name: no separator, not "." or ".."


def fresh_report_folder(name: str) -> Path:
    """report_dir()/name for a run's files, removed first if an earlier run left it (a fresh run each time).

    `name` must be one plain folder name and the folder, resolved, must lie directly in the reports folder
    (a link to elsewhere is refused): a name built from parameters never reaches outside it. Otherwise
    NotebookParameterError, and nothing is removed."""
    root = report_dir()
    path = root / name
    if not (isinstance(name, str) and _PLAIN_NAME.fullmatch(name)) or path.is_symlink() \
            or path.resolve().parent != root.resolve():
        raise NotebookParameterError(f"{name!r} is not a folder name inside the reports folder {root}; "
                                     "nothing was removed")
    if path.exists() and not path.is_dir():
        raise NotebookParameterError(f"{path} is not a folder; nothing was removed")
    if path.exists():
        shutil.rmtree(path)
    return path


def _has_nan(value: Any) -> bool:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, (list, tuple)):
        return any(map(_has_nan, value))
    if isinstance(value, dict):
        return any(map(_has_nan, value.values()))
    return False


@dataclass
class Record:
    """Named numbers, named claims and figures of one notebook run, written to <reports>/<name>.json."""

    name: str
    parameters: dict[str, Any]
    numbers: dict[str, Any] = field(default_factory=dict)
    claims: dict[str, dict[str, Any]] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    threads: int = field(default_factory=torch.get_num_threads)
    seeds: list[int] = field(default_factory=list)
    timing: list[str] = field(default_factory=list)
    tolerances: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def start(cls, name: str, namespace: dict[str, Any]) -> Record:
        """Check the parameters in `namespace` (a notebook's globals()) and start a record."""
        inputs = namespace.get("In")
        if isinstance(inputs, list):
            defaults, injected, comments = parameter_cells(inputs)
            nonfinite_ok = nonfinite_allowed(comments)
            check_parameters(defaults, injected, nonfinite_ok)
            # the values in use, typed into the parameters cell too (NaN/Inf there)
            current = {k: namespace[k] for k in defaults if k in namespace}
            check_parameters(defaults, {k: v for k, v in current.items() if k not in injected}, nonfinite_ok)
            for k, v in current.items():  # an int given for a float becomes that float, in the notebook too
                try:
                    namespace[k] = current[k] = as_declared(defaults[k], v)
                except NotebookParameterError as e:
                    raise NotebookParameterError(f"parameter {k}: {e}") from None
            check_ranges(comments, current)  # before any cell uses a value (a path built from one, say)
        else:  # not IPython: nothing injected, take the UPPER_CASE globals as they are
            defaults = {}
        params = {k: namespace[k] for k in defaults if k in namespace}
        torch.set_num_threads(notebook_threads())  # the thread policy: lora_lab/threads.py
        record = cls(name=name, parameters=params)
        if isinstance(params.get("SEED"), int):
            record.seeds.append(params["SEED"])
        return record

    def seed(self, seed: int) -> None:
        """Seed torch's, Python's and numpy's global generators with `seed` and record it."""
        import numpy  # a dependency of torch's; imported here, where a notebook seeds

        torch.manual_seed(seed)
        random.seed(seed)
        numpy.random.seed(seed % 2**32)
        if seed not in self.seeds:
            self.seeds.append(seed)

    def number(self, key: str, value: Any, *, timing: bool = False, rtol: float | None = None,
               why: str = "") -> Any:
        """Record a named number (or small list/dict of numbers) and return it.

        `timing=True`: a wall-clock time, never compared between two runs. `rtol` (with `why`): the relative
        tolerance within which it may move from one run with the same parameters to the next. Every other
        number must come out the same (the reproducibility test, `--compare`)."""
        if timing and rtol is not None:
            raise RecordError(f"number {key!r}: timing or a tolerance, not both")
        if rtol is not None and not (rtol >= 0 and why.strip()):
            raise RecordError(f"number {key!r}: a tolerance needs rtol >= 0 and why (got {rtol!r}, {why!r})")
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()
        self.numbers[key] = value
        if timing and key not in self.timing:
            self.timing.append(key)
        if rtol is not None:
            self.tolerances[key] = {"rtol": float(rtol), "why": why.strip()}
        return value

    def claim(self, key: str, held: bool, detail: str = "") -> bool:
        """Record whether a claim held; `finish()` shows them all and fails the notebook if any did not."""
        if _has_nan(held):  # bool(nan) is True: a claim over a NaN holds nothing
            held, detail = False, f"{detail} (over a NaN)".strip()
        held = bool(held)
        self.claims[key] = {"held": held, "detail": detail}
        return held

    def figure(self, fig, key: str) -> Path:
        """Save a matplotlib figure as PNG beside the report and return its path (which a notebook does
        not echo under the cell: the figure itself is shown inline)."""
        if not _PLAIN_NAME.fullmatch(f"{self.name}_{key}"):
            raise NotebookParameterError(f"figure {key!r}: not a plain file name")
        out = _FigurePath(report_dir() / "figures" / f"{self.name}_{key}.png")
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110, bbox_inches="tight")
        self.figures.append(str(out.relative_to(report_dir())))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "notebook": self.name,
            "parameters": self.parameters,
            "numbers": self.numbers,
            "claims": self.claims,
            "figures": self.figures,
            "passed": all(c["held"] for c in self.claims.values()),
            "seconds": round(time.time() - self.started, 2),
            "torch_threads": self.threads,
            "timing": self.timing,
            "tolerances": self.tolerances,
            "provenance": provenance(self.started, seeds=self.seeds),
        }

    def summary(self) -> tuple[str, str]:
        """The claims as a small table: (plain text, HTML)."""
        held = sum(c["held"] for c in self.claims.values())
        where = f"{report_dir().name}/{self.name}.json"  # no absolute path in an executed notebook
        head = f"{self.name}: {held} of {len(self.claims)} claims held (results: {where})"
        rows = [(("PASS" if c["held"] else "FAIL"), k, c["detail"]) for k, c in self.claims.items()]
        width = max((len(k) for _, k, _ in rows), default=0)
        text = "\n".join([head] + [f"  {v}  {k:{width}s}  {d}".rstrip() for v, k, d in rows])
        cells = "".join(
            f'<tr><td style="color:{"#1a7f37" if v == "PASS" else "#cf222e"};font-weight:bold;'
            'white-space:nowrap">'
            f"{'&#10003;' if v == 'PASS' else '&#10007;'} {v.lower()}</td>"
            f'<td style="text-align:left">{html.escape(k)}</td>'
            f'<td style="text-align:left">{html.escape(d)}</td></tr>'
            for v, k, d in rows
        )
        table = (f'<table><caption style="text-align:left">{html.escape(head)}</caption>'
                 f'<tr><th>held</th><th style="text-align:left">claim</th>'
                 f'<th style="text-align:left">measured</th></tr>'
                 f"{cells}</table>")
        return text, table

    def finish(self) -> dict[str, Any]:
        """Write <reports>/<name>.json (atomically), show the table of claims, then raise ClaimFailed if a
        claim failed. Returns the recorded dict (which IPython does not echo: the table says it)."""
        nans = [k for k, v in self.numbers.items() if _has_nan(v)]
        if nans:
            self.claim("no recorded number is NaN", False, f"NaN in {', '.join(nans)}")
        data = _Shown(self.to_json())
        atomic_write_bytes(report_dir() / f"{self.name}.json",
                           json.dumps(data, indent=2, default=jsonable).encode())
        _show(*self.summary())
        failed = [k for k, c in self.claims.items() if not c["held"]]
        if not self.claims:
            raise ClaimFailed(f"{self.name}: recorded no claims")
        if failed:
            raise ClaimFailed(f"{self.name}: claim(s) did not hold: {failed}")
        return data


class _FigurePath(type(Path())):
    """A saved figure's path: IPython does not echo it (the figure is on screen already)."""

    def _ipython_display_(self) -> None:
        pass


class _Shown(dict):
    """A dict that a notebook does not echo under its cell: `finish()` has shown it as a table."""

    def _ipython_display_(self) -> None:
        pass


def _show(text: str, table: str) -> None:
    """The table as HTML in a notebook (plain text in its text/plain part), else printed."""
    try:  # IPython only where a notebook runs: Record also works in a plain interpreter
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(text)
        return
    display({"text/plain": text, "text/html": table}, raw=True)


def jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)
