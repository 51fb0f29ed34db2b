"""A sweep's aggregate: every recorded number over the seeds of each grid point, as a table (JSON, markdown)
and as figures of chosen numbers against the swept parameter with the seed spread drawn.

    <sweep>/aggregate.json   the points (values, seed, folder, verdict) and, per number and swept values:
                             mean, min, max and each seed's value (nested numbers as "name/key", "name[i]")
    <sweep>/aggregate.md     the same table in markdown
    <sweep>/NUMBER.png       one figure per `--plot NUMBER`: the number against the first swept parameter
                             (a line per value of the others): each seed a dot, the mean a line,
                             min..max a band
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path
from typing import Any

from ..errors import LoraLabError
from ..fileio import atomic_write_bytes
from .provenance import leaf_owner, leaves


class AggregateError(LoraLabError):
    """A `--plot NAME` that names no number the sweep recorded."""


def numeric_leaves(numbers: dict[str, Any]) -> dict[str, float]:
    """The recorded numbers as {"name", "name/key", "name[i]": float}: ints and floats (no bools, no text)."""
    return {k: float(v) for k, v in leaves(numbers or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def aggregate(notebook: str, names: list[str], points: list, records: list[dict]) -> dict[str, Any]:
    """The aggregate of a sweep's points (`sweep.Point`s) and their records, in the grid's order."""
    groups: dict[str, dict[str, Any]] = {}
    timing: set[str] = set()
    for point, record in zip(points, records):
        group = groups.setdefault(json.dumps(point.values, sort_keys=True, default=str),
                                  {"values": point.values, "by_seed": {}})
        group["by_seed"][str(point.seed)] = numeric_leaves(record.get("numbers", {}))
        timing |= set(record.get("timing", []))
    keys = list(dict.fromkeys(k for g in groups.values() for nums in g["by_seed"].values() for k in nums))
    rows = []
    for key in keys:
        for group in groups.values():
            seeds = {s: nums[key] for s, nums in group["by_seed"].items() if key in nums}
            if not seeds:
                continue
            vals = list(seeds.values())
            rows.append({"number": key, "timing": leaf_owner(key) in timing, "values": group["values"],
                         "mean": math.fsum(vals) / len(vals), "min": min(vals), "max": max(vals),
                         "seeds": seeds})
    return {
        "notebook": notebook,
        "swept": names,
        "seeds": list(dict.fromkeys(str(p.seed) for p in points)),
        "points": [{"values": p.values, "seed": p.seed, "folder": p.folder.name,
                    "passed": bool(r.get("passed")), "error": r.get("error"),
                    "claims_held": sum(c["held"] for c in r.get("claims", {}).values()),
                    "claims": len(r.get("claims", {}))} for p, r in zip(points, records)],
        "numbers": rows,
    }


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def table_rows(agg: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the table: number, each swept parameter, mean, min, max, each seed."""
    seeds = agg["seeds"]
    head = ["number", *agg["swept"], "mean", "min", "max",
            *(f"seed {s}" if s != "None" else "value" for s in seeds)]
    rows = [[r["number"] + (" (timing)" if r["timing"] else ""),
             *(_fmt(r["values"][n]) for n in agg["swept"]),
             _fmt(r["mean"]), _fmt(r["min"]), _fmt(r["max"]), *(_fmt(r["seeds"].get(s, "")) for s in seeds)]
            for r in agg["numbers"]]
    return head, rows


def markdown(agg: dict[str, Any]) -> str:
    passed = sum(p["passed"] for p in agg["points"])
    head, rows = table_rows(agg)
    lines = [f"# {agg['notebook']}: sweep over {', '.join(agg['swept']) or 'seeds'}", "",
             f"{len(agg['points'])} points, {passed} passed; seeds {', '.join(agg['seeds'])}.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def table_html(agg: dict[str, Any]) -> str:
    head, rows = table_rows(agg)
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return ("<table><thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr></thead>"
            f"<tbody>{cells}</tbody></table>")


def _x_positions(values: list[Any]) -> tuple[list[float], bool]:
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return ([float(v) for v in values] if numeric else list(map(float, range(len(values))))), numeric


def plot(agg: dict[str, Any], name: str, out: Path) -> Path:
    """The figure of number `name` against the first swept parameter, the seed spread drawn."""
    from matplotlib.figure import Figure  # no pyplot: no backend, nothing shown

    rows = [r for r in agg["numbers"] if r["number"] == name]
    if not rows:
        known = sorted({r["number"] for r in agg["numbers"]})
        raise AggregateError(f"--plot {name!r}: {agg['notebook']} recorded no such number; it recorded "
                             f"{', '.join(known[:40])}{' ...' if len(known) > 40 else ''}")
    x_name = agg["swept"][0] if agg["swept"] else None
    series: dict[str, list[dict]] = {}
    for r in rows:
        rest = ", ".join(f"{n}={r['values'][n]}" for n in agg["swept"][1:])
        series.setdefault(rest, []).append(r)
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot()
    xs_all = list(dict.fromkeys(r["values"][x_name] if x_name else "all" for r in rows))
    pos, numeric = _x_positions(xs_all)
    where = dict(zip(map(repr, xs_all), pos))
    for label, rs in series.items():
        xs = [where[repr(r["values"][x_name] if x_name else "all")] for r in rs]
        line, = ax.plot(xs, [r["mean"] for r in rs], marker="o", label=label or "mean")
        ax.fill_between(xs, [r["min"] for r in rs], [r["max"] for r in rs], alpha=0.2, color=line.get_color())
        for x, r in zip(xs, rs):
            ax.scatter([x] * len(r["seeds"]), list(r["seeds"].values()), s=14, color=line.get_color(),
                       alpha=0.7)
    if not numeric or not x_name:
        ax.set_xticks(pos, [str(v) for v in xs_all])
    ax.set_xlabel(x_name or "")
    ax.set_ylabel(name)
    ax.set_title(f"{agg['notebook']}: {name}; seeds {', '.join(agg['seeds'])} (dots), mean, min..max")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    path = out / (re.sub(r"[^\w.+-]", "_", name) + ".png")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def write_aggregate(root: Path, notebook: str, names: list[str], points: list, records: list[dict],
                    plots: list[str]) -> list[Path]:
    """aggregate.json, aggregate.md and a figure per name in `plots` into `root`; their paths."""
    agg = aggregate(notebook, names, points, records)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(root / "aggregate.md", markdown(agg).encode())
    agg["figures"] = []
    try:  # the table is written even where a --plot name is wrong
        for name in plots:
            agg["figures"].append(plot(agg, name, root).name)
    finally:
        atomic_write_bytes(root / "aggregate.json", json.dumps(agg, indent=2, default=str).encode())
    return [root / "aggregate.json", root / "aggregate.md", *(root / f for f in agg["figures"])]
