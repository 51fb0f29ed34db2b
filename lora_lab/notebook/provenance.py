"""Where a recorded result came from: the code, the packages, the machine, the time.

`provenance(...)` is written into every `reports/NN_name.json` by `Record.finish` and into `summary.json` by
the runner, so that two report folders can be compared (`compare.py`) and a reader can tell what made a
number:

    lora_lab    the version, and the git commit of the checkout with whether its tree was dirty
                ("not a git checkout" where lora_lab is installed elsewhere)
    python      its version
    packages    the version of each key package, read from the installed metadata (never imported);
                "not installed" where absent
    machine     OS, CPU model, torch's CPU capability (the 8-bit step runs another path on AVX2 and AVX512),
                cores, torch threads, and the GPU with its CUDA version where torch can use one
    started, ended   UTC, ISO 8601
    seeds       each seed the notebook declared (`Record.seed`, and its SEED parameter)
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .._version import __version__

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("torch", "diffusers", "transformers", "safetensors", "peft", "bitsandbytes", "torchao", "triton",
            "papermill", "numpy")
NOT_A_CHECKOUT = "not a git checkout"
# what differs from one run to the next by design: not compared between two runs
PER_RUN = ("started", "ended", "seeds")


def utc_now(at: float | None = None) -> str:
    """A time (now, or the `time.time()` value `at`) as UTC ISO 8601, to the second."""
    t = datetime.datetime.now(datetime.timezone.utc) if at is None else \
        datetime.datetime.fromtimestamp(at, datetime.timezone.utc)
    return t.replace(microsecond=0).isoformat()


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """{name: installed version or "not installed"}, from the distributions' metadata."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state() -> dict[str, Any] | str:
    """{"commit": sha, "dirty": bool} of the checkout lora_lab runs from, else "not a git checkout".

    Dirty: a tracked file changed, or an untracked one that .gitignore does not name (reports/ is ignored)."""
    if not (REPO / ".git").exists():
        return NOT_A_CHECKOUT
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return NOT_A_CHECKOUT
    status = _git("status", "--porcelain")
    return {"commit": commit, "dirty": bool(status) if status is not None else "unknown"}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpu() -> dict[str, Any] | None:
    """The GPU torch can use (name, CUDA version, whether this process used it), else None."""
    if not torch.cuda.is_available():
        return None
    return {"name": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
            "count": torch.cuda.device_count(), "used": torch.cuda.is_initialized()}


def machine() -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "os": platform.platform(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "cores_usable": cores,
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu(),
    }


def provenance(started: float, ended: float | None = None, seeds: list[int] | None = None) -> dict[str, Any]:
    """Everything above for a run that started at `started` (and ended at `ended`, else now)."""
    return {
        "lora_lab": {"version": __version__, "git": git_state()},
        "python": platform.python_version(),
        "packages": package_versions(),
        "machine": machine(),
        "started": utc_now(started),
        "ended": utc_now(ended),
        "seeds": list(seeds or []),
    }


def leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested value as {"a/b[0]": leaf}: dicts by "/key", lists by "[index]"; an empty one is a leaf."""
    if isinstance(data, dict) and data:
        items = [(f"{prefix}/{k}" if prefix else str(k), v) for k, v in data.items()]
    elif isinstance(data, (list, tuple)) and data:
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(data)]
    else:
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(leaves(value, key))
    return out


def leaf_owner(key: str) -> str:
    """The top-level name a key of `leaves` belongs to ("a/b[0]" -> "a")."""
    return re.split(r"[/\[]", key, maxsplit=1)[0]


def provenance_differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{"packages/torch": (a's, b's), ...}: what differs between two runs' provenance, leaving out what
    differs by design (`PER_RUN`: the times and the seeds)."""
    fa, fb = ({k: v for k, v in leaves(x or {}).items() if leaf_owner(k) not in PER_RUN}
              for x in (a, b))
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}
