"""The workbook in JupyterLab as people use it: a real (headless) Chromium drives Lab's own UI.

JupyterLab is started on a free loopback port with a random token, over the checkout's notebooks/
(autosave off, checkpoints kept in a temporary folder). Playwright drives Debian's Chromium
(`executable_path`: Playwright's own browser download is not used). For notebooks 01, 03, 07 and 10 it
opens the notebook from the file browser, runs every cell from the Run menu, and checks what a reader
sees: the lora-lab kernel was picked without a dialog, no error and no stderr output, an inline image
for every figure the notebook records, and a live widget (the slider redraws its output; a sample
button gives an image within 5 s). Afterwards the server is stopped and notebooks/ is byte-identical.
Screenshots go to reports/lab/.

Skipped (with the reason) without Chromium or Playwright; `make test-lab` requires both.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lora_lab.notebook.record import BATCH_ENV, NOTEBOOKS, REPORTS_ENV, report_dir
from lora_lab.notebook.runner import KERNEL_NAME, ensure_kernel

CHROMIUM = Path(os.environ.get("LORA_LAB_CHROMIUM", "/usr/bin/chromium"))
REQUIRED = os.environ.get("LORA_LAB_REQUIRE_BROWSER") == "1"  # set by `make test-lab`: fail, not skip
HOW = "install it with `apt-get install -y chromium` (Debian), or run `make test-lab` (installs it as root)"
# `make test-lab` runs all five; `make test` the two quick ones (01, and 03 with its slider), which keeps the
# whole suite in its time budget: 07, 10 and 11 each train for minutes and also run under papermill in
# `make test` (11 with tiny parameters)
NOTEBOOK_NAMES = (["01_autograd", "03_lora_dora", "07_diffusion_lora", "10_training_machinery", "11_knobs"]
                  if REQUIRED else ["01_autograd", "03_lora_dora"])
WITH_SLIDERS = {"03_lora_dora", "07_diffusion_lora"}  # the notebooks with a live widget
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
RUN_TIMEOUT_S = 900  # one notebook's Run All (07 trains a LoRA: ~2-4 min on a busy 2-core machine)
SAMPLE_WITHIN_S = 5.0


# `--dist loadgroup` (the Makefile) spreads single tests over the workers; this file stays together:
# one JupyterLab server and browser for the file's tests, which run in order
pytestmark = [pytest.mark.xdist_group("test_lab"), pytest.mark.slow]  # 2+ minutes of browser


def _skip_or_fail(reason: str):
    if REQUIRED:
        pytest.fail(reason)
    pytest.skip(reason)


def _tree_digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones too): its sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_settings(folder: Path) -> None:
    """User settings of this Lab only: no autosave, every cell in the DOM, no news or update checks."""
    settings = {
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification": {"checkForUpdates": False, "fetchNews": "false"},
    }
    for name, value in settings.items():
        path = folder / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


class LabServer:
    """`jupyter lab` on 127.0.0.1:<free port> with a random token, in its own process group."""

    def __init__(self, tmp: Path):
        self.port, self.token = _free_port(), secrets.token_hex(24)
        self.tmp = tmp
        self.reports = tmp / "reports"
        _write_settings(tmp / "settings")
        env = dict(os.environ)
        env.pop("MPLBACKEND", None)  # what `make lab` gives the kernel: ipykernel's inline backend
        env.pop(BATCH_ENV, None)  # a person in JupyterLab: the widgets, not the batch run's static views
        env.update({
            REPORTS_ENV: str(self.reports),
            "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
            "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
            "JUPYTER_CONFIG_DIR": str(tmp / "config"),
        })
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={NOTEBOOKS}", f"--FileCheckpoints.checkpoint_dir={tmp / 'checkpoints'}",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log = open(tmp / "jupyter.log", "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_ready()

    def url(self, path: str = "lab") -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}/{path}{sep}token={self.token}"

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(self.url(f"api/{path}"), method=method)
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                self.api("status")
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"jupyter lab did not answer in {timeout} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return (self.tmp / "jupyter.log").read_text(errors="replace")[-3000:]

    def shutdown_kernels(self) -> None:
        for session in self.api("sessions"):
            self.api(f"sessions/{session['id']}", method="DELETE")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and the kernels it started
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not CHROMIUM.is_file():
        _skip_or_fail(f"the JupyterLab browser test needs Chromium at {CHROMIUM}: {HOW}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _skip_or_fail("the JupyterLab browser test needs Playwright: pip install playwright "
                      "(in the dev extra)")
    assert ensure_kernel() == KERNEL_NAME
    before = _tree_digest(NOTEBOOKS)
    server = LabServer(tmp_path_factory.mktemp("lab"))
    shots = report_dir() / "lab"
    shots.mkdir(parents=True, exist_ok=True)
    pw = sync_playwright().start()
    browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
    state = {"server": server, "browser": browser, "shots": shots, "before": before}
    try:
        yield state
    finally:
        browser.close()
        pw.stop()
        server.stop()


# ----------------------------------------------------------------------------- driving Lab's UI

def _open_from_file_browser(page, name: str) -> None:
    item = page.locator(".jp-DirListing-item", has_text=f"{name}.ipynb")
    item.wait_for(timeout=60_000)
    item.dblclick()
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.wait_for(timeout=60_000)


def _kernel_ready(page, timeout_s: float = 90.0) -> str:
    """Wait for the notebook's kernel to be idle; fail on any dialog (e.g. 'Select Kernel'). Its name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dialogs = page.locator(".jp-Dialog")
        if dialogs.count():
            pytest.fail(f"a dialog opened: {dialogs.first.inner_text()[:300]!r}")
        status = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator")
        kernel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-KernelName")
        name = kernel.first.inner_text().strip() if kernel.count() else ""
        if (name and name != "No Kernel" and status.count()
                and status.first.get_attribute("data-status") == "idle"):
            return name
        time.sleep(0.5)
    pytest.fail(f"the kernel did not become idle (kernel shown: {name!r})")


def _run_all_from_menu(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()


_STATE_JS = """() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const cells = [...nb.querySelectorAll('.jp-CodeCell')];
  const prompts = cells.map(c => (c.querySelector('.jp-InputArea-prompt') || {}).textContent || '');
  const outs = [...nb.querySelectorAll('.jp-OutputArea-output')];
  const status = (nb.querySelector('.jp-Notebook-ExecutionIndicator') || {dataset: {}}).dataset.status;
  return {
    prompts, status,
    mimes: outs.map(o => o.getAttribute('data-mime-type')),
    stderr: outs.filter(o => /stderr|error/.test(o.getAttribute('data-mime-type') || '')
                       || o.classList.contains('jp-OutputArea-executeResult')
                          && /Traceback/.test(o.textContent))
                .map(o => o.textContent.slice(0, 600)),
    images: nb.querySelectorAll('.jp-OutputArea-output[data-mime-type="image/png"] img').length,
  };
}"""


def _run_and_wait(page, timeout_s: float) -> dict:
    """Run all cells; wait until every code cell has run (or an error/stderr output appeared and the kernel is
    idle)."""
    _run_all_from_menu(page)
    time.sleep(2.0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = page.evaluate(_STATE_JS)
        done = all(re.fullmatch(r"\[\d+\]:", p.strip()) for p in state["prompts"])
        if state["status"] == "idle" and (done or state["stderr"]):
            return state
        time.sleep(1.0)
    pytest.fail(f"Run All did not finish in {timeout_s} s: prompts {page.evaluate(_STATE_JS)['prompts']}")


def _widget_cells(page):
    """Code cells whose output holds a slider (ipywidgets)."""
    return page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell").filter(
        has=page.locator(".jp-OutputArea .widget-slider"))


def _images(cell) -> list[str]:
    return cell.evaluate("c => [...c.querySelectorAll('.jp-OutputArea img')].map(i => i.src)")


def _drag_first_slider(page, cell, dx: float) -> None:
    handle = cell.locator(".widget-slider .noUi-handle").first
    handle.scroll_into_view_if_needed()
    box = handle.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.mouse.down()
    page.mouse.move(x + dx / 2, y, steps=5)
    page.mouse.move(x + dx, y, steps=5)
    page.mouse.up()


def _wait_new_image(cell, old: list[str], timeout_s: float) -> float | None:
    """Seconds until the cell shows an image that was not there before (None: not within the time)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        now = _images(cell)
        if now and set(now) - set(old):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def _check_the_checks(page) -> None:
    """The error/stderr detector is not blind: a cell typed in (never saved: autosave is off) that writes
    to stderr and raises must show up as both."""
    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-editor").last.click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # a new cell below
    page.keyboard.press("Enter")
    page.keyboard.type('import sys; print("lab-test to stderr", file=sys.stderr); 1 / 0')
    page.keyboard.press("Shift+Enter")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        seen = page.evaluate(_STATE_JS)["stderr"]
        if any("lab-test to stderr" in t for t in seen) and any("ZeroDivisionError" in t for t in seen):
            return
        time.sleep(0.5)
    pytest.fail(f"the test did not see a stderr line and an error: {seen}")


# ----------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_notebook_runs_in_jupyterlab(lab, name):
    server, shots = lab["server"], lab["shots"]
    page = lab["browser"].new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(server.url("lab?reset"))  # a fresh workspace: nothing open but what the test opens
        _open_from_file_browser(page, name)
        kernel = _kernel_ready(page)
        assert kernel.strip() == "Python (lora-lab)", f"kernel picked: {kernel!r}"

        state = _run_and_wait(page, RUN_TIMEOUT_S)
        page.screenshot(path=str(shots / f"{name}.png"))
        assert not state["stderr"], (f"{name}: error or stderr output in the notebook:\n"
                                     + "\n---\n".join(state["stderr"]))
        assert all(re.fullmatch(r"\[\d+\]:", p.strip()) for p in state["prompts"]), state["prompts"]

        record = json.loads((server.reports / f"{name}.json").read_text())
        assert record["passed"], record["claims"]
        print(f"{name}: the notebook ran in JupyterLab in {record['seconds']} s")  # bench_notebooks.py --lab
        assert state["images"] >= len(record["figures"]) >= 1, (
            f"{name}: {state['images']} inline images for {len(record['figures'])} figures "
            f"{record['figures']}")
        first_figure = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) "
                                    ".jp-OutputArea-output[data-mime-type='image/png'] img").first
        first_figure.scroll_into_view_if_needed()
        page.screenshot(path=str(shots / f"{name}_figure.png"))

        cells = _widget_cells(page)
        if name in WITH_SLIDERS:
            assert cells.count() >= 1, f"{name}: no slider found"
        for i in range(cells.count()):
            cell = cells.nth(i)
            button = cell.locator("button.widget-button, button.jupyter-button")
            before = _images(cell)
            _drag_first_slider(page, cell, dx=-40)
            if button.count():  # a manual widget: the button samples at the slider's value
                button.first.click()
                took = _wait_new_image(cell, before, SAMPLE_WITHIN_S)
                assert took is not None, f"{name}: the button gave no new image within {SAMPLE_WITHIN_S} s"
            else:
                took = _wait_new_image(cell, before, 30.0)
                assert took is not None, f"{name}: moving the slider did not redraw its output"
            cell.scroll_into_view_if_needed()
            page.screenshot(path=str(shots / f"{name}_widget{i}.png"))
            kind = "sample button" if button.count() else "slider redraw"
            print(f"{name}: widget {i}: {kind} showed a new image in {took:.2f} s")
        state = page.evaluate(_STATE_JS)
        assert not state["stderr"], f"{name}: the widgets wrote errors or stderr: {state['stderr']}"
        if name == NOTEBOOK_NAMES[0]:
            _check_the_checks(page)
    finally:
        server.shutdown_kernels()
        page.close()


def test_server_stops_and_the_checkout_is_unchanged(lab):
    server = lab["server"]
    server.stop()
    assert server.proc.returncode is not None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    assert _tree_digest(NOTEBOOKS) == lab["before"], "JupyterLab changed or added files under notebooks/"
    assert not (NOTEBOOKS / "reports").exists() and not (NOTEBOOKS / ".ipynb_checkpoints").exists()
    shutil.rmtree(server.tmp / "checkpoints", ignore_errors=True)
