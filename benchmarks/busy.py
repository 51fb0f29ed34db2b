"""The benchmarks' busy machine: a second process that keeps one core busy while a block runs.

    from busy import one_core_busy, machine_load
    with one_core_busy():      # `python -c "while True: pass"`, started here and killed on leaving
        ...                    # rows measured "with one core busy"

Benchmarks print `machine_load()` (the 1-minute load average and the core count) beside their tables: on a
shared machine "quiet" only means that the benchmark started no helper.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator


@contextlib.contextmanager
def one_core_busy(settle_s: float = 0.5) -> Iterator[int]:
    """Run the block while another Python process spins on one core; yields its pid."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(settle_s)  # until it has a core
        yield spin.pid
    finally:
        spin.kill()
        spin.wait()


def machine_load() -> str:
    return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
