"""Memory and time of reading, inspecting and converting a large LoRA file (issue 12, item 11).

    python benchmarks/bench_lora_io.py [--mib 256]

Writes a valid kohya file of about --mib MiB (8 modules, rank 64, fp32) to a temp folder, then runs each
operation in a fresh Python process and prints the peak private memory it added (RssAnon: memory that is
not a file's pages, sampled every millisecond) and its wall time. The "eager" rows are what reading a
file with `safetensors.torch.load_file` and writing it with `safetensors.torch.save` cost: a copy of every
tensor in memory, and the whole output file built in memory before it is written.

Target (read here, not a timed test): inspect and convert add memory of the order of one tensor, not of
the file.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import sys, threading, time
def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon")) / 1024
import torch, safetensors.torch as st
from lora_lab.formats import load_lora, convert_lora
op, src, dst = sys.argv[1:4]
start = peak = anon(); stop = False
def poll():
    global peak
    while not stop:
        peak = max(peak, anon()); time.sleep(0.001)
t = threading.Thread(target=poll, daemon=True); t.start()
t0 = time.perf_counter()
if op == "inspect":
    load_lora(src).summary()
elif op == "convert":
    convert_lora(src, dst, to="peft")
elif op == "eager_read":
    st.load_file(src)
elif op == "eager_convert":
    data = st.load_file(src)
    open(dst, "wb").write(st.save(data))
dt = time.perf_counter() - t0
stop = True; t.join(); peak = max(peak, anon())
print(f"{peak - start:.1f} {dt:.3f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the LoRA file in MiB")
    args = ap.parse_args()

    import torch

    from lora_lab.formats import LoraFile, LoraWeights, save_lora

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "big.safetensors", Path(tmp) / "out.safetensors"
        n = args.mib * 2**20 // (8 * 2 * 64 * 4)
        mods = {f"unet.down_blocks.0.attentions.0.transformer_blocks.{i}.attn1.to_q":
                LoraWeights(torch.full((64, n), 0.01), torch.full((n, 64), 0.01), 8.0) for i in range(8)}
        save_lora(src, LoraFile(mods), base="sd15")
        del mods
        size = src.stat().st_size / 2**20
        tensor = 64 * n * 4 / 2**20
        print(f"file: {size:.0f} MiB, 16 tensors of {tensor:.1f} MiB\n")
        print("| operation | peak extra private memory (MiB) | wall (s) |\n| --- | ---: | ---: |")
        for op, label in (("inspect", "lora_lab load_lora + summary"),
                          ("convert", "lora_lab convert_lora kohya -> peft"),
                          ("eager_read", "eager: safetensors.torch.load_file"),
                          ("eager_convert", "eager: load_file + safetensors.torch.save")):
            out = subprocess.run([sys.executable, "-c", CHILD, op, str(src), str(dst)], capture_output=True,
                                 text=True, check=True).stdout.split()
            print(f"| {label} | {float(out[-2]):.1f} | {float(out[-1]):.2f} |")


if __name__ == "__main__":
    main()
