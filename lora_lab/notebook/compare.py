"""Two runs compared: `python -m lora_lab.notebook --compare REPORTS_A REPORTS_B [--rtol R]`.

Per notebook recorded in either folder: the claims that flipped (held in one, not in the other), the numbers
that moved beyond the tolerance, the parameters and the provenance that differ (package versions, machine,
commit; not the times and seeds, which differ by design). A number moved when |a - b| > rtol * max(|a|, |b|),
with rtol the larger of `--rtol` and the tolerance the record declares for it (`nb.number(..., rtol=)`);
numbers the record declares as timing are not compared, nor are the wall-clock seconds. A number that is not
a number (text, a bool) moved when it is not equal. Exit 1 where a claim flipped, so that it serves as a
regression check.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import LoraLabError
from .provenance import leaf_owner, leaves, provenance_differences

DEFAULT_RTOL = 1e-6  # below anything a notebook claims; a rerun on the same commit and machine moves nothing


class CompareError(LoraLabError):
    """A folder to compare that holds no notebook records."""


def load_records(folder: Path) -> dict[str, dict[str, Any]]:
    """{notebook: its record} of every `NN_name.json` in `folder` (summary.json and other files left out)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CompareError(f"{folder}: no such folder")
    records = {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("notebook"), str) and "claims" in data:
            records[data["notebook"]] = data
    if not records:
        raise CompareError(f"{folder}: no notebook records (NN_name.json) in it")
    return records


def _moved(a: Any, b: Any, rtol: float) -> bool:
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
    if not numeric:
        return a != b
    if math.isnan(a) or math.isnan(b):
        return not (math.isnan(a) and math.isnan(b))
    return abs(a - b) > rtol * max(abs(a), abs(b))


def _only_in(a: dict, b: dict) -> dict[str, list[str]]:
    return {"a": sorted(set(a) - set(b)), "b": sorted(set(b) - set(a))}


def compare_records(a: dict[str, Any], b: dict[str, Any], rtol: float = DEFAULT_RTOL) -> dict[str, Any]:
    """What differs between two records of one notebook (each list empty where nothing does)."""
    claims_a, claims_b = a.get("claims", {}), b.get("claims", {})
    flipped = [{"claim": k, "a": claims_a[k]["held"], "b": claims_b[k]["held"]}
               for k in claims_a if k in claims_b and claims_a[k]["held"] != claims_b[k]["held"]]
    timing = set(a.get("timing", [])) | set(b.get("timing", []))
    declared = {**a.get("tolerances", {}), **b.get("tolerances", {})}
    na, nb = leaves(a.get("numbers", {})), leaves(b.get("numbers", {}))
    moved = []
    for key in [k for k in na if k in nb and leaf_owner(k) not in timing]:
        tol = max(rtol, declared.get(leaf_owner(key), {}).get("rtol", 0.0))
        if _moved(na[key], nb[key], tol):
            moved.append({"number": key, "a": na[key], "b": nb[key], "rtol": tol})
    pa, pb = a.get("parameters", {}), b.get("parameters", {})
    return {
        "flipped": flipped,
        "moved": moved,
        "claims_only_in": _only_in(claims_a, claims_b),
        "numbers_only_in": _only_in(na, nb),
        "parameters": {k: [pa.get(k), pb.get(k)] for k in sorted(set(pa) | set(pb))
                       if pa.get(k) != pb.get(k)},
        "provenance": {k: list(v) for k, v in provenance_differences(a.get("provenance", {}),
                                                                      b.get("provenance", {})).items()},
        "passed": [a.get("passed"), b.get("passed")],
    }


def compare_folders(a: Path, b: Path, rtol: float = DEFAULT_RTOL) -> dict[str, Any]:
    """{"notebooks": {name: compare_records(...)}, "only_in": {"a": [...], "b": [...]}} of two folders."""
    ra, rb = load_records(a), load_records(b)
    return {"a": str(a), "b": str(b), "rtol": rtol,
            "notebooks": {n: compare_records(ra[n], rb[n], rtol) for n in ra if n in rb},
            "only_in": _only_in(ra, rb)}


def _short(v: Any) -> str:
    text = f"{v:.6g}" if isinstance(v, float) else json.dumps(v, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _notebook_lines(name: str, d: dict[str, Any]) -> list[str]:
    lines = [f"  FLIPPED  {c['claim']}: {'held' if c['a'] else 'failed'} -> {'held' if c['b'] else 'failed'}"
             for c in d["flipped"]]
    lines += [f"  moved    {m['number']}: {_short(m['a'])} -> {_short(m['b'])}" for m in d["moved"]]
    lines += [f"  param    {k}: {_short(a)} -> {_short(b)}" for k, (a, b) in d["parameters"].items()]
    lines += [f"  prov     {k}: {_short(a)} -> {_short(b)}" for k, (a, b) in d["provenance"].items()]
    for side in ("a", "b"):
        lines += [f"  claim only in {side.upper()}: {c}" for c in d["claims_only_in"][side]]
        lines += [f"  number only in {side.upper()}: {n}" for n in d["numbers_only_in"][side]]
    head = f"{name}: " + ("nothing moved" if not lines else
                          f"{len(d['flipped'])} claim(s) flipped, {len(d['moved'])} number(s) moved")
    return [head, *lines]


def format_comparison(result: dict[str, Any]) -> str:
    lines = [f"A: {result['a']}", f"B: {result['b']}  (rtol {result['rtol']:g}; timing not compared)"]
    for name, d in result["notebooks"].items():
        lines += _notebook_lines(name, d)
    for side in ("a", "b"):
        lines += [f"{n}: only in {side.upper()}" for n in result["only_in"][side]]
    flipped = sum(len(d["flipped"]) for d in result["notebooks"].values())
    moved = sum(len(d["moved"]) for d in result["notebooks"].values())
    lines.append(f"{len(result['notebooks'])} notebooks compared: {flipped} claim(s) flipped, "
                 f"{moved} number(s) moved")
    return "\n".join(lines)


def compare_main(a: Path, b: Path, rtol: float = DEFAULT_RTOL) -> int:
    """Print the comparison; 1 where a claim flipped, else 0."""
    result = compare_folders(a, b, rtol)
    print(format_comparison(result))
    return 1 if any(d["flipped"] for d in result["notebooks"].values()) else 0
