"""Two or more builds of the C 8-bit step, timed interleaved in one process against torch's fused AdamW.

    PYTHONPATH=. python benchmarks/ab_adam8bit.py old.c lora_lab/kernels/cpu_adam8bit.c [--rounds 12]

Each .c is compiled alone with cpu_adam8bit.FLAGS, and each build steps its own copy of one 4096x4096
parameter (the same values and gradient) with AdamW8bit, round by round in turn with torch.optim.AdamW
(fused=True), one thread, CPU time. The machine's speed drifts 10-20% between runs here, so a change to the
kernel is judged by the ratio of builds within one run (bench_optim.py prints the ratio to torch). At the
end every build's parameter and moments must be equal to the first's, bit for bit: a faster build that
computes something else fails.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from lora_lab.kernels import cpu_adam8bit as kernel
from lora_lab.optim import AdamW8bit


def build(source: Path, folder: Path):
    """The ctypes library of `source`, as cpu_adam8bit.library() loads the project's own."""
    so = folder / f"{source.stem}_{abs(hash(str(source)))}.so"
    subprocess.run(["cc", *kernel.FLAGS, str(source), "-o", str(so), "-lm"], check=True)
    built, kernel._built_library = kernel._built_library, lambda: so
    try:
        kernel.library.cache_clear()
        return kernel.library()
    finally:
        kernel._built_library = built
        kernel.library.cache_clear()


def parameter() -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4096, 4096, generator=g) * 0.02)
    p.grad = torch.randn(4096, 4096, generator=g) * 1e-3
    return p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=12, help="the first two are warm-up, not counted")
    args = ap.parse_args()
    torch.set_num_threads(1)
    project_library = kernel.library
    with tempfile.TemporaryDirectory() as tmp:
        libs = {str(s): build(s, Path(tmp)) for s in args.sources}
        runs = {name: (p, AdamW8bit([p], lr=1e-3)) for name, p in ((n, parameter()) for n in libs)}
        fused = parameter()
        runs["torch AdamW fused=True"] = (fused, torch.optim.AdamW([fused], lr=1e-3, fused=True))
        times: dict[str, list[float]] = {name: [] for name in runs}
        try:
            for r in range(args.rounds):
                for name, (p, opt) in runs.items():
                    kernel.library = (lambda lib=libs.get(name): lib) if name in libs else project_library
                    c0 = time.process_time()
                    opt.step()
                    if r >= 2:
                        times[name].append(1e3 * (time.process_time() - c0))
        finally:
            kernel.library = project_library
    fused_ms = statistics.median(times["torch AdamW fused=True"])
    print("| build | median CPU ms | min | / fused |\n| --- | ---: | ---: | ---: |")
    for name, t in times.items():
        ms = statistics.median(t)
        print(f"| {name} | {ms:.2f} | {min(t):.2f} | {ms / fused_ms:.2f} |")
    first, *others = [(name, runs[name]) for name in libs]
    for name, (p, opt) in others:
        same = torch.equal(p, first[1][0]) and all(
            torch.equal(a, b) for a, b in zip(opt.state_dict()["state"][0].values(),
                                              first[1][1].state_dict()["state"][0].values())
            if isinstance(a, torch.Tensor))
        print(f"{name}: parameter and state {'equal to' if same else 'DIFFER from'} {first[0]}'s")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
