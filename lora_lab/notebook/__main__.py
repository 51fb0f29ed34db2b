"""`python -m lora_lab.notebook`: the batch runner (runner.py), sweeps (sweep.py), two runs compared
(compare.py) and the report (report.py).

    python -m lora_lab.notebook [NAME ...] [-p NAME VALUE ...] [--out DIR] [--jobs N]
    python -m lora_lab.notebook NAME --sweep RANK=1,2,4,8 [--sweep ...] [--seeds 0,1,2] [--plot NUMBER ...]
    python -m lora_lab.notebook --compare REPORTS_A REPORTS_B [--rtol R]
    python -m lora_lab.notebook --report [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import LoraLabError
from .compare import DEFAULT_RTOL, compare_main
from .record import REPORTS_ENV, report_dir
from .report import write_report
from .runner import _cli_value, default_jobs, run_batch, select_notebooks
from .sweep import parse_seeds, parse_sweep, run_sweep


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lora_lab.notebook",
                                 description="Execute the notebooks with papermill; sweep one over "
                                 "parameters and seeds; compare two runs; write the report.")
    ap.add_argument("names", nargs="*",
                    help="notebook names or paths, e.g. 03_lora_dora or notebooks/03_lora_dora.ipynb "
                    "(default: all in notebooks/)")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                    help="inject a parameter (a Python literal, else a string), as papermill's -p; "
                    "repeatable")
    ap.add_argument("--out", default=None,
                    help=f"output folder (default: ${REPORTS_ENV}, else reports/ at the repository root)")
    ap.add_argument("--jobs", type=int, default=default_jobs(),
                    help="notebooks run at once, each on one torch thread (default: one per core, at most 4: "
                    "%(default)s here)")
    ap.add_argument("--sweep", action="append", default=[], metavar="NAME=V1,V2,...",
                    help="run the notebook at each value (repeatable: the grid of all); into "
                    "OUT/sweeps/NOTEBOOK-NAMES/, points already done are skipped")
    ap.add_argument("--seeds", default=None, metavar="S1,S2,...",
                    help="run each point with each seed (the notebook's SEED parameter)")
    ap.add_argument("--plot", action="append", default=[], metavar="NUMBER",
                    help="with --sweep/--seeds: a figure of this recorded number against the swept parameter")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("REPORTS_A", "REPORTS_B"),
                    help="compare two report folders: claims flipped (exit 1), numbers moved, provenance")
    ap.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                    help="with --compare: a number moved when it changed by more than this, relative "
                    "(default %(default)g; a record's own declared tolerance where larger)")
    ap.add_argument("--report", action="store_true", help="write OUT/index.html from the records in OUT")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.rtol < 0:
        ap.error(f"--rtol must be at least 0, got {args.rtol}")
    out = Path(args.out).resolve() if args.out else report_dir()
    parameters = {name: _cli_value(value) for name, value in args.parameter}
    try:
        if args.compare:
            return compare_main(Path(args.compare[0]), Path(args.compare[1]), args.rtol)
        if args.report:
            print(f"report: {write_report(out)}")
            return 0
        if args.sweep or args.seeds:
            paths = select_notebooks(args.names)
            if len(args.names) != 1 or len(paths) != 1:
                ap.error(f"--sweep and --seeds take exactly one notebook, got {args.names or 'none'}")
            sweeps = [parse_sweep(s) for s in args.sweep]
            seeds = parse_seeds(args.seeds) if args.seeds else None
            return run_sweep(paths[0], sweeps, seeds, parameters, out, args.jobs, args.plot)
        if args.plot:
            ap.error("--plot goes with --sweep or --seeds")
        return run_batch(args.names, out, parameters, args.jobs)
    except LoraLabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
