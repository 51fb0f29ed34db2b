"""A notebook over a grid of parameters and seeds: `python -m lora_lab.notebook 03_lora_dora
--sweep RANK=1,2,4,8 --seeds 0,1,2 [--plot NAME ...]`.

Every point of the grid (each swept value, for each seed, with the `-p` values on top) is checked against the
notebook's declared types and ranges before anything runs (`expected_parameters`), then run by papermill
into its own folder, `<out>/sweeps/<notebook>-<NAMES>/<NAME>=<value>_SEED=<seed>/`, side by side on the
machine's cores as a batch run is. A point is done when its folder holds the notebook's JSON with the same
parameters and its verdict (passed or failed): a rerun skips it (resume), so a sweep that stopped goes on
where it stopped and one that finished reruns at once. A failed point is reported and the others go on.
Then the aggregate (aggregate.py): a table of every recorded number over the seeds and a figure per
`--plot NAME`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LoraLabError
from .aggregate import write_aggregate
from .parameters import expected_parameters, notebook_parameters
from .runner import Job, _cli_value, run_jobs

SEED_PARAMETER = "SEED"


class SweepError(LoraLabError):
    """A sweep that cannot run: a `--sweep` that cannot be read, a name given twice, seeds for a notebook
    without a SEED parameter."""


@dataclass(frozen=True)
class Point:
    """One point of a sweep: its swept values and seed, its folder, what is injected and what it runs with."""

    values: dict[str, Any]
    seed: int | None
    folder: Path
    injected: dict[str, Any]
    expected: dict[str, Any]

    @property
    def label(self) -> str:
        return self.folder.name


def _split_top_level(text: str) -> list[str]:
    """`1,2,[3,4]` -> ["1", "2", "[3,4]"]: commas outside brackets and quotes."""
    parts, depth, quote, current = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += ch
    return parts + [current]


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """`RANK=1,2,4,8` -> ("RANK", [1, 2, 4, 8]): each value a Python literal, else a string (as `-p`)."""
    name, sep, values = text.partition("=")
    name = name.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_]\w*", name) or not values.strip():
        raise SweepError(f"--sweep {text!r}: write NAME=V1,V2,... (e.g. RANK=1,2,4,8)")
    items = [_cli_value(v) for v in _split_top_level(values) if v.strip()]
    if len({repr(v) for v in items}) != len(items):
        raise SweepError(f"--sweep {text!r}: a value is given twice")
    return name, items


def parse_seeds(text: str) -> list[int]:
    """`0,1,2` -> [0, 1, 2]."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SweepError(f"--seeds {text!r}: write whole numbers separated by commas (e.g. 0,1,2)") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SweepError(f"--seeds {text!r}: at least one seed, none twice")
    return seeds


def _folder_part(name: str, value: Any) -> str:
    """`RANK=4`; a value that is not a plain file name is made one, with a short hash to keep it unique."""
    text = str(value)
    plain = re.sub(r"[^\w.+-]", "", text)
    if plain != text or not plain:
        plain = f"{plain[:24]}~{hashlib.sha1(repr(value).encode()).hexdigest()[:8]}"
    return f"{name}={plain}"


def sweep_folder(out: Path, path: Path, names: list[str], seeds: list[int] | None) -> Path:
    """Where a sweep's points and aggregate go: `<out>/sweeps/<notebook>-<NAME>-...[-SEED]`."""
    tail = names + ([SEED_PARAMETER] if seeds else [])
    return out / "sweeps" / "-".join([path.stem, *tail])


def plan_sweep(path: Path, sweeps: list[tuple[str, list[Any]]], seeds: list[int] | None,
               fixed: dict[str, Any], out: Path) -> list[Point]:
    """Every point of the grid, each checked against the notebook's declared types and ranges (nothing runs
    before all are): NotebookParameterError or SweepError naming the notebook and the parameter."""
    names = [n for n, _ in sweeps]
    for name in set(names):
        if names.count(name) > 1 or name in fixed:
            raise SweepError(f"{path.stem}: parameter {name} is swept twice or also given with -p")
    defaults, _ = notebook_parameters(path)
    if seeds and SEED_PARAMETER not in defaults:
        raise SweepError(f"{path.stem} has no {SEED_PARAMETER} parameter: --seeds cannot be given to it")
    if seeds and (SEED_PARAMETER in names or SEED_PARAMETER in fixed):
        raise SweepError(f"{path.stem}: {SEED_PARAMETER} is given by --seeds, not by --sweep or -p")
    root = sweep_folder(out, path, names, seeds)
    points = []
    for combo in itertools.product(*(values for _, values in sweeps)):
        for seed in seeds or [None]:
            injected = {**fixed, **dict(zip(names, combo))}
            if seed is not None:
                injected[SEED_PARAMETER] = seed
            expected = expected_parameters(path, injected)
            values = {n: expected[n] for n in names}  # as the notebook takes them: 3 for a float is 3.0
            parts = [_folder_part(n, v) for n, v in values.items()]
            parts += [_folder_part(SEED_PARAMETER, seed)] if seed is not None else []
            folder = root / ("_".join(parts) or "default")
            points.append(Point(values, seed, folder, injected, expected))
    return points


def point_record(path: Path, point: Point) -> dict | None:
    """The point's recorded JSON if it is done (the same parameters, a verdict recorded), else None."""
    try:
        data = json.loads((point.folder / f"{path.stem}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "passed" not in data or data.get("parameters") != point.expected:
        return None
    return data


def run_sweep(path: Path, sweeps: list[tuple[str, list[Any]]], seeds: list[int] | None,
              fixed: dict[str, Any], out: Path, jobs: int, plots: list[str]) -> int:
    """Plan (and check) the grid, run the points not done yet, write the aggregate; 1 if a point failed."""
    points = plan_sweep(path, sweeps, seeds, fixed, out)
    records = [point_record(path, p) for p in points]
    todo = [i for i, r in enumerate(records) if r is None]
    print(f"{path.stem}: {len(points)} points, {len(points) - len(todo)} done before, {len(todo)} to run",
          flush=True)
    ran = run_jobs([Job(path, points[i].folder, points[i].injected, points[i].label) for i in todo],
                   min(jobs, max(1, len(todo))))
    for i, record in zip(todo, ran):
        records[i] = record
    root = sweep_folder(out, path, [n for n, _ in sweeps], seeds)
    written = write_aggregate(root, path.stem, [n for n, _ in sweeps], points, records, plots)
    print(f"aggregate: {', '.join(str(w) for w in written)}")
    failed = [(p, r) for p, r in zip(points, records) if not r.get("passed")]
    for point, record in failed:
        failing = [k for k, c in record.get("claims", {}).items() if not c["held"]]
        print(f"  FAIL  {point.label}: {record.get('error') or failing}")
    print(f"  {len(points) - len(failed)} of {len(points)} points passed")
    return 1 if failed else 0
