"""`make report`: reports/index.html with every notebook's verdict, claims, figures and provenance, a link to
the executed notebook as offline HTML, and the sweeps' tables and figures; opened in headless Chromium (every
image drawn, no console error, nothing fetched from the network). The browser part is skipped without
Chromium or Playwright, as tests/notebook/test_lab.py is (`make test-lab` requires them)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from tiny_notebooks import tiny_notebook

from lora_lab.notebook import runner
from lora_lab.notebook.__main__ import main
from lora_lab.notebook.aggregate import write_aggregate
from lora_lab.notebook.sweep import plan_sweep

CHROMIUM = Path(os.environ.get("LORA_LAB_CHROMIUM", "/usr/bin/chromium"))
REQUIRED = os.environ.get("LORA_LAB_REQUIRE_BROWSER") == "1"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
WIDTHS = "imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)"
REMOTE = re.compile(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", re.IGNORECASE)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """A reports folder as `make run` and a sweep leave it: a notebook that passed, one that stopped before
    its record (summary.json has its failure), one sweep's aggregate."""
    tmp = tmp_path_factory.mktemp("report")
    out = tmp / "reports"
    (tmp / "notebooks").mkdir()
    nb = tiny_notebook(tmp / "notebooks" / "01_tiny.ipynb")
    tiny_notebook(tmp / "notebooks" / "02_broken.ipynb", claim="1 / 0")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "NOTEBOOKS", tmp / "notebooks")
        assert main(["--out", str(out), "--jobs", "1"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["provenance"]["lora_lab"]["git"]["commit"] and summary["provenance"]["machine"]["cpu"]
    points = plan_sweep(nb, [("N", [1, 2])], [0, 1], {}, out)
    records = [{"numbers": {"n": p.values["N"], "x": p.seed + p.values["N"]}, "passed": True, "claims": {}}
               for p in points]
    write_aggregate(points[0].folder.parent, "01_tiny", ["N"], points, records, ["x"])
    assert main(["--report", "--out", str(out)]) == 0
    return out


def test_the_report_holds_every_notebook_and_sweep_offline(reports):
    index = (reports / "index.html").read_text()
    for text in ("01_tiny", "the claim", "02_broken", "ZeroDivisionError", 'src="figures/01_tiny_line.png"',
                 "provenance: lora_lab",
                 'href="html/01_tiny.html"', "sweep: 01_tiny over N", 'src="sweeps/01_tiny-N-SEED/x.png"',
                 "<td>x</td><td>2</td><td>2.5</td>"):
        assert text in index, text
    page = (reports / "html" / "01_tiny.html").read_text()
    assert "data:image/png;base64" in page  # the notebook's figure, embedded
    for html in (index, page):
        assert not REMOTE.search(html) and "<script" not in html


def test_the_report_opens_in_chromium_with_every_figure(reports):
    if not CHROMIUM.is_file():
        (pytest.fail if REQUIRED else pytest.skip)(f"the report's browser test needs Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        (pytest.fail if REQUIRED else pytest.skip)("the report's browser test needs Playwright")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page()
        errors, requests = [], []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        try:
            page.goto((reports / "index.html").as_uri(), wait_until="load")
            widths = page.eval_on_selector_all("img", WIDTHS)
            assert len(widths) == 2 and all(w > 0 for w in widths), widths  # the notebook's and the sweep's
            page.click('a[href="html/01_tiny.html"]')
            page.wait_for_load_state("load")
            assert "01_tiny" in page.title()
            widths = page.eval_on_selector_all("img", WIDTHS)
            assert widths and all(w > 0 for w in widths), widths
        finally:
            browser.close()
    assert not errors, errors
    assert all(u.startswith(("file:", "data:")) for u in requests), [u for u in requests if "file:" not in u]
