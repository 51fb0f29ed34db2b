"""A run as pages a person opens: `make report` (`python -m lora_lab.notebook --report [--out DIR]`) writes
`<reports>/index.html` after `make run` or a sweep.

index.html shows every notebook recorded in the folder with its verdict, its claims, its figures (the PNGs in
figures/, linked relatively) and its provenance, and links to the executed notebook rendered as HTML by
nbconvert (`html/NN_name.html`, its images embedded); then each sweep under `sweeps/` with its table and
figures. Nothing is loaded from the network: the pages carry their styles inline and no scripts (nbconvert's
lab template without require.js, MathJax, Mermaid and the widget manager, which it takes from a CDN), so the
folder can be opened offline, copied or archived as it is.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ..errors import LoraLabError
from ..fileio import atomic_write_bytes
from .aggregate import table_html
from .compare import CompareError, load_records
from .provenance import leaves

# nbconvert's lab template without what it loads from a CDN (require.js, MathJax, Mermaid, the widget
# manager): the batch runs draw the widgets as static images, and math shows as its TeX
OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""

STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em;
       color: #1f2328; }
table { border-collapse: collapse; margin: .5em 0; font-size: 13px; }
th, td { border: 1px solid #d0d7de; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
.pass { color: #1a7f37; font-weight: bold; } .fail { color: #cf222e; font-weight: bold; }
img { max-width: 100%; border: 1px solid #d0d7de; margin: .4em 0; }
section { border-top: 2px solid #d0d7de; margin-top: 2em; }
details { margin: .5em 0; } summary { cursor: pointer; color: #0969da; }
code { background: #f6f8fa; padding: 0 3px; }
"""


class ReportError(LoraLabError):
    """A folder to report on that holds nothing to report."""


def render_notebook(ipynb: Path, out: Path) -> Path:
    """The executed notebook as one offline HTML page (images embedded), unless `out` is newer already."""
    if out.exists() and out.stat().st_mtime >= ipynb.stat().st_mtime:
        return out
    import jinja2  # nbconvert's own dependency; nbconvert ships with jupyterlab (the `notebooks` extra)
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(extra_loaders=[jinja2.DictLoader({"offline.html.j2": OFFLINE_TEMPLATE})],
                            template_file="offline.html.j2", embed_images=True)
    body, _ = exporter.from_filename(str(ipynb))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, body.encode())
    return out


def _verdict(passed: bool) -> str:
    return '<span class="pass">&#10003; pass</span>' if passed else '<span class="fail">&#10007; FAIL</span>'


def _table(head: list[str], rows: list[list[str]]) -> str:
    """An HTML table of already escaped cells."""
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows) + "</table>")


def _leaf_table(data: dict[str, Any]) -> str:
    return _table(["", ""], [[html.escape(k), html.escape(json.dumps(v, default=str))]
                             for k, v in leaves(data).items()])


def _provenance_line(prov: dict[str, Any]) -> str:
    """commit, CPU and torch in one line."""
    git = prov.get("lora_lab", {}).get("git")
    commit = (f"{git['commit'][:10]}{' (dirty)' if git.get('dirty') else ''}" if isinstance(git, dict)
              else str(git))
    m = prov.get("machine", {})
    gpu = m.get("gpu") or {}
    return html.escape(f"lora_lab {prov.get('lora_lab', {}).get('version')} at {commit}; "
                       f"torch {prov.get('packages', {}).get('torch')}; "
                       f"{m.get('cpu')} ({m.get('cpu_capability')}, {m.get('cores')} cores)"
                       f"{'; ' + gpu['name'] if gpu else ''}; {prov.get('started')}")


def _notebook_section(reports: Path, record: dict[str, Any]) -> str:
    name = record["notebook"]
    claims = record.get("claims", {})
    held = sum(c["held"] for c in claims.values())
    parts = [f'<section id="{html.escape(name)}">',
             f'<h2>{html.escape(name)} {_verdict(record.get("passed"))}</h2>',
             f"<p>{held} of {len(claims)} claims held in {record.get('seconds', '?')} s"
             + (f"; error: <code>{html.escape(record['error'])}</code>" if record.get("error") else "") + ". "
             + (f'<a href="html/{html.escape(name)}.html">The executed notebook</a> '
                f'(<a href="{html.escape(name)}.ipynb">.ipynb</a>, '
                f'<a href="{html.escape(name)}.json">.json</a>).'
                if (reports / f"{name}.ipynb").exists() else "") + "</p>"]
    parts.append(_table(["held", "claim", "measured"],
                        [[_verdict(c["held"]), html.escape(k), html.escape(c.get("detail", ""))]
                         for k, c in claims.items()]))
    for fig in record.get("figures", []):
        parts.append(f'<div><img src="{html.escape(fig)}" alt="{html.escape(Path(fig).stem)}"></div>')
    parts.append("<details><summary>parameters and numbers</summary>"
                 + _leaf_table(record.get("parameters", {})) + _leaf_table(record.get("numbers", {}))
                 + "</details>")
    if record.get("provenance"):
        parts.append(f"<details><summary>provenance: {_provenance_line(record['provenance'])}</summary>"
                     f"{_leaf_table(record['provenance'])}</details>")
    return "\n".join(parts) + "</section>"


def _sweep_section(reports: Path, path: Path) -> str:
    agg = json.loads(path.read_text())
    folder = path.parent.relative_to(reports).as_posix()
    passed = sum(p["passed"] for p in agg["points"])
    title = f"sweep: {agg['notebook']} over {', '.join(agg['swept']) or 'seeds'}"
    parts = [f'<section id="{html.escape(path.parent.name)}"><h2>{html.escape(title)}</h2>',
             f"<p>{len(agg['points'])} points, {passed} passed; "
             f"seeds {html.escape(', '.join(agg['seeds']))}; "
             f'<a href="{html.escape(folder)}/aggregate.md">aggregate.md</a>, '
             f'<a href="{html.escape(folder)}/aggregate.json">aggregate.json</a>.</p>']
    parts += [f'<div><img src="{html.escape(folder)}/{html.escape(f)}" alt="{html.escape(f)}"></div>'
              for f in agg.get("figures", [])]
    link = '<a href="{0}/{1}/{2}.json">{1}</a>'
    parts.append(_table(["point", "verdict", "claims held", "error"],
                        [[link.format(*map(html.escape, (folder, p["folder"], agg["notebook"]))),
                          _verdict(p["passed"]), f"{p['claims_held']} of {p['claims']}",
                          html.escape(p.get("error") or "")] for p in agg["points"]]))
    parts.append(f"<details open><summary>every recorded number</summary>{table_html(agg)}</details>")
    return "\n".join(parts) + "</section>"


def write_report(reports: Path) -> Path:
    """`reports/index.html` (and `reports/html/NN_name.html` for each executed notebook); its path."""
    reports = Path(reports).resolve()
    sweeps = sorted(reports.glob("sweeps/*/aggregate.json"))
    try:
        records = load_records(reports)
    except CompareError:
        records = {}
    try:
        summary = json.loads((reports / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    for r in summary.get("notebooks", []):  # a notebook that stopped before its record: its failure
        records.setdefault(r.get("notebook", "?"), r)
    if not records and not sweeps:
        raise ReportError(f"{reports}: no notebook records and no sweeps in it (`make run` writes them)")
    for name in records:
        if (reports / f"{name}.ipynb").exists():
            render_notebook(reports / f"{name}.ipynb", reports / "html" / f"{name}.html")
    prov = summary.get("provenance") or next((r["provenance"] for r in records.values() if "provenance" in r),
                                             {})
    rows = [[f'<a href="#{html.escape(n)}">{html.escape(n)}</a>', _verdict(r.get("passed")),
             f"{sum(c['held'] for c in r.get('claims', {}).values())} of {len(r.get('claims', {}))}",
             html.escape(str(r.get("seconds", "?")))] for n, r in records.items()]
    rows += [[f'<a href="#{html.escape(p.parent.name)}">{html.escape(p.parent.name)}</a>', "sweep", "", ""]
             for p in sweeps]
    body = [f"<h1>lora_lab workbook: {html.escape(reports.name)}</h1>",
            f"<p>{_provenance_line(prov)}</p>" if prov else "",
            _table(["notebook", "verdict", "claims held", "seconds"], rows)]
    body += [_notebook_section(reports, r) for r in records.values()]
    body += [_sweep_section(reports, p) for p in sweeps]
    page = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>lora_lab workbook</title>'
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    out = reports / "index.html"
    atomic_write_bytes(out, page.encode())
    return out
