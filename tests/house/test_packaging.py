"""The install story: pyproject.toml and environment.yml agree; CI calls the README's command; the CLI
starts."""

import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_lists_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values()
                                            for r in extra]
    from_pyproject = {_name(r) for r in reqs}
    from_env = set()
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.match(r"^\s*-\s+([A-Za-z0-9_.\-]+[^#]*)$", line)
        if m and not line.strip().endswith(":"):
            from_env.add(_name(m.group(1)))
    from_env -= {"python", "pip", "conda-forge"}
    assert from_pyproject == from_env, (
        f"only in pyproject: {sorted(from_pyproject - from_env)}; "
        f"only in environment.yml: {sorted(from_env - from_pyproject)}"
    )


def test_torch_is_pinned_everywhere():
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    assert "torch==2.13.0" in (ROOT / "environment.yml").read_text()
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
    assert "make test" in (ROOT / "README.md").read_text()


def test_cli_help_starts():
    out = subprocess.run([sys.executable, "-m", "lora_lab.cli", "--help"], capture_output=True, text=True,
                         check=True)
    assert "lora-lab" in out.stdout


def test_the_version_is_written_once_in_version_py():
    """pyproject.toml reads the version from lora_lab/_version.py (setuptools' dynamic attr), so the two
    cannot disagree; the package's own `__version__` is that one."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lora_lab._version.__version__"}
    import lora_lab
    from lora_lab._version import __version__
    assert lora_lab.__version__ == __version__ and re.fullmatch(r"\d+\.\d+\.\d+", __version__)
