"""`make gpu` on a machine without CUDA: it says so and exits 0, running nothing (the GPU path runs where a
GPU is lent: benchmarks/gpu_check.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu runs for real there")
def test_make_gpu_without_cuda_says_so_and_exits_0(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert not out.exists()  # nothing ran, nothing written


def test_the_gpu_table_names_the_device_and_each_phase():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    phases = dict.fromkeys(gpu_check.PHASES, 2**30)
    report = {"device": "NVIDIA H100", "kernels": {"summary": "40 passed"},
              "planner": [{"resolution": 512, "base": "nf4", "checkpointing": True, "measured": phases,
                           "planned": {**phases, "sample": 2**30 * 1.1}}]}
    text = gpu_check.table(json.loads(json.dumps(report)))
    assert "NVIDIA H100" in text and "40 passed" in text
    assert "| 512 | nf4 | yes | sample | 1.00 | 1.10 | +10.0% |" in text
    assert all(f"| {p} |" in text for p in gpu_check.PHASES)
