"""Time the Triton kernels of lora_lab.kernels against PyTorch, PEFT and bitsandbytes on one GPU.

    python benchmarks/bench_kernels.py                 # the table for the README (needs a CUDA GPU)
    python benchmarks/bench_kernels.py --cpu-check     # tiny sizes on the CPU under the Triton interpreter:
                                                 # checks this script runs; its times mean nothing

Rows, all bf16 activations and base weights, fp32 adapter weights (as lora_lab trains them):
  LoRA layer forward+backward, 4096 -> 4096, tokens 4096 and 16384, rank 16 and 64:
      triton      lora_lab LoRALinear(backend="triton"): the fused kernels
      torch       lora_lab LoRALinear(backend="torch"): the unfused PyTorch formulation it replaces
      torch-bf16  the leanest unfused PyTorch: addmm for the base, the adapter in bf16, addmm_ for the add
      peft        PEFT's LoRA Linear
  DoRA layer forward+backward, same shapes: triton, torch (lora_lab.functional.dora) and PEFT's DoRA.
  8-bit Adam step on a 4096 x 4096 fp32 tensor: the Triton kernel, lora_lab's PyTorch path, bitsandbytes.

Each time is the median over interleaved rounds (every variant once per round, so clock or
thermal drift hits all of them alike); the speed-ups are ratios of medians from the same run.
TFLOP/s counts the useful flops of the formula (4 M N K + 6 r M (K + N) for LoRA forward+backward);
GB/s counts the least traffic the step needs (each big operand read or written once), so both are
lower bounds on what the hardware did. Peaks are datasheet figures (dense bf16 tensor-core
TFLOP/s, HBM GB/s) looked up by device name; pass --peak-tflops/--peak-gbps for other devices.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

# (substring of torch.cuda.get_device_name(), dense bf16 TFLOP/s, memory GB/s): NVIDIA datasheets;
# the first match wins, so the more specific names come first.
PEAKS = [
    ("H200", 989.0, 4800.0),
    ("H100 PCIe", 756.0, 2000.0),
    ("H100 NVL", 835.0, 3900.0),
    ("H100", 989.0, 3350.0),
    ("A100-SXM4-80GB", 312.0, 2039.0),
    ("A100 80GB PCIe", 312.0, 1935.0),
    ("A100", 312.0, 1555.0),
    ("L40S", 362.0, 864.0),
    ("L4", 121.0, 300.0),
    ("RTX 4090", 165.0, 1008.0),
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-check", action="store_true", help="tiny sizes on the CPU under the interpreter")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (median over them)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak dense bf16 TFLOP/s")
    ap.add_argument("--peak-gbps", type=float, default=None, help="device peak memory GB/s")
    ap.add_argument("--only", choices=["lora", "dora", "adam"], action="append", help="run only these parts")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.cpu_check:
    os.environ["TRITON_INTERPRET"] = "1"  # before lora_lab.kernels.* is imported
elif not torch.cuda.is_available():
    print("benchmarks/bench_kernels.py times GPU kernels and needs a CUDA GPU; there is none here.")
    print("Correctness is covered on the CPU by tests/kernels/test_kernels.py under TRITON_INTERPRET=1;")
    print("`python benchmarks/bench_kernels.py --cpu-check` runs this script at tiny sizes under the "
          "interpreter.")
    sys.exit(0)

# not at the top: TRITON_INTERPRET=1 (--cpu-check) must be set before lora_lab.kernels.* is imported
from lora_lab.functional import AdamHyper, adam_step_, quantize_blockwise  # noqa: E402  # TRITON_INTERPRET
from lora_lab.kernels.adam8bit import adam8bit_step  # noqa: E402  # TRITON_INTERPRET
from lora_lab.lora import LoRAConfig, LoRALinear  # noqa: E402  # TRITON_INTERPRET

DEVICE = torch.device("cpu" if ARGS.cpu_check else "cuda")
DTYPE = torch.bfloat16
if ARGS.cpu_check:  # (tokens, in = out, rank)
    LORA_SHAPES = [(64, 48, 4)]
    ADAM_NUMEL = 64 * 48
    INNER = 1
else:
    LORA_SHAPES = [(m, 4096, r) for m in (4096, 16384) for r in (16, 64)]
    ADAM_NUMEL = 4096 * 4096
    INNER = 5  # calls per timed sample


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def time_interleaved(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds per call of each fn; each round calls every fn INNER times, in turn."""
    for fn in fns.values():  # warm-up: compilation and autotuning happen here
        fn()
        fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(INNER):
                fn()
            sync()
            samples[name].append((time.perf_counter() - t0) / INNER)
    return {name: statistics.median(v) for name, v in samples.items()}


def device_peaks() -> tuple[str, float | None, float | None]:
    if DEVICE.type != "cuda":
        return "CPU (Triton interpreter; times are meaningless)", ARGS.peak_tflops, ARGS.peak_gbps
    name = torch.cuda.get_device_name(DEVICE)
    tflops, gbps = ARGS.peak_tflops, ARGS.peak_gbps
    for key, t, g in PEAKS:
        if key in name:
            tflops, gbps = tflops or t, gbps or g
            break
    return name, tflops, gbps


# ----------------------------------------------------------------------------- the layers


def lora_layers(k: int, n: int, r: int, use_dora: bool) -> dict:
    """Forward+backward closures of each variant on the same weights, x and g."""
    gen = torch.Generator().manual_seed(0)
    base = nn.Linear(k, n).to(DEVICE, DTYPE).requires_grad_(False)
    down = (torch.randn(r, k, generator=gen) / k**0.5).to(DEVICE)
    up = (torch.randn(n, r, generator=gen) * 0.01).to(DEVICE)
    layers = {}
    for backend in ("triton", "torch"):
        layer = LoRALinear(base, LoRAConfig(rank=r, alpha=float(r), use_dora=use_dora, backend=backend))
        with torch.no_grad():
            layer.down.copy_(down)
            layer.up.copy_(up)
        layers[backend] = (layer, layer.adapter_parameters())
    if not use_dora:
        down16, up16 = down.to(DTYPE).requires_grad_(), up.to(DTYPE).requires_grad_()

        def torch_bf16(x):  # y = b + x W^T, then y += (x A^T) B^T in place: no separate LoRA output
            y = torch.addmm(base.bias, x.reshape(-1, k), base.weight.t())
            return y.addmm_(x.reshape(-1, k) @ down16.t(), up16.t()).reshape(*x.shape[:-1], n)

        layers["torch-bf16"] = (torch_bf16, [down16, up16])
    try:
        import peft
    except ImportError:
        print("(peft is not installed: no PEFT rows)")
    else:
        model = peft.get_peft_model(
            nn.Sequential(nn.Linear(k, n)).to(DEVICE, DTYPE),
            peft.LoraConfig(r=r, lora_alpha=r, target_modules=["0"], use_dora=use_dora),
        )
        peft_layer = model.base_model.model[0]
        with torch.no_grad():
            peft_layer.base_layer.weight.copy_(base.weight)
            peft_layer.base_layer.bias.copy_(base.bias)
            peft_layer.lora_A["default"].weight.copy_(down)
            peft_layer.lora_B["default"].weight.copy_(up)
        layers["peft"] = (model, [p for p in model.parameters() if p.requires_grad])
    return layers


def fwd_bwd(layer, params, x, g):
    def step():
        y = layer(x)
        torch.autograd.grad(y, [x, *params], g)  # gradients returned, not accumulated into .grad

    return step


def bench_layers(use_dora: bool, peaks, rows):
    kind = "DoRA" if use_dora else "LoRA"
    for m, k, r in LORA_SHAPES:
        n = k
        x = torch.randn(m, k, device=DEVICE, dtype=DTYPE, requires_grad=True)
        g = torch.randn(m, n, device=DEVICE, dtype=DTYPE)
        layers = lora_layers(k, n, r, use_dora)
        times = time_interleaved({name: fwd_bwd(f, p, x, g) for name, (f, p) in layers.items()}, ARGS.rounds)
        flops = 4 * m * n * k + 6 * r * m * (k + n)
        nbytes = 2 * (3 * m * k + 2 * n * k + 2 * m * n)  # bf16: x x3, W x2, y, g, dx; adapters negligible
        ref = times["torch"]
        for name, t in times.items():
            rows.append((f"{kind} fwd+bwd", f"M={m} K=N={k} r={r}", name, t, flops, nbytes, ref / t, peaks))
        del layers, x, g


def bench_adam(peaks, rows):
    gen = torch.Generator().manual_seed(0)
    p0 = (torch.randn(ADAM_NUMEL, generator=gen) * 0.02).to(DEVICE)
    grad = (torch.randn(ADAM_NUMEL, generator=gen) * 1e-3).to(DEVICE)
    hp = AdamHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)

    def state():
        p = p0.clone()
        mc, ma = quantize_blockwise(grad * 0.1, signed=True)
        vc, va = quantize_blockwise(grad * grad, signed=False)
        return p, mc, ma, vc, va

    s_triton, s_torch = state(), state()
    fns = {
        "triton": lambda: adam8bit_step(s_triton[0], grad, *s_triton[1:], 10, hp),
        "torch": lambda: adam_step_(s_torch[0], grad, s_torch[1], s_torch[3], 10, hp, s_torch[2], s_torch[4]),
    }
    try:
        import bitsandbytes as bnb
    except ImportError:
        print("(bitsandbytes is not installed: no bitsandbytes row)")
    else:
        bp = nn.Parameter(p0.clone())
        bp.grad = grad.clone()
        opt = bnb.optim.AdamW8bit([bp], lr=hp.lr, weight_decay=hp.weight_decay)
        fns["bitsandbytes"] = opt.step
    times = time_interleaved(fns, ARGS.rounds)
    nbytes = ADAM_NUMEL * (4 + 4 + 4 + 2 + 2)  # param read+write, grad read, two uint8 codes read+write
    for name, t in times.items():
        rows.append(("8-bit AdamW step", f"{ADAM_NUMEL:,} fp32 values", name, t, None, nbytes,
                     times["torch"] / t, peaks))


def fmt_rate(value, peak):
    if value is None:
        return "-", "-"
    return f"{value:,.0f}", (f"{100 * value / peak:.0f}%" if peak else "n/a")


def main():
    name, peak_tflops, peak_gbps = device_peaks()
    parts = ARGS.only or ["lora", "dora", "adam"]
    rows: list = []
    if "lora" in parts:
        bench_layers(False, (peak_tflops, peak_gbps), rows)
    if "dora" in parts:
        bench_layers(True, (peak_tflops, peak_gbps), rows)
    if "adam" in parts:
        bench_adam((peak_tflops, peak_gbps), rows)
    print(f"device: {name}; peaks: {peak_tflops or 'unknown'} TFLOP/s bf16 dense, "
          f"{peak_gbps or 'unknown'} GB/s")
    print(f"torch {torch.__version__}; median of {ARGS.rounds} interleaved rounds x {INNER} calls\n")
    print("| step | shape | variant | ms | TFLOP/s | % peak | GB/s | % peak | speed-up vs torch |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for step, shape, variant, t, flops, nbytes, speedup, _ in rows:
        tf, tf_pct = fmt_rate(flops / t / 1e12 if flops else None, peak_tflops)
        gb, gb_pct = fmt_rate(nbytes / t / 1e9, peak_gbps)
        print(f"| {step} | {shape} | {variant} | {t * 1e3:.3f} | {tf} | {tf_pct} | {gb} | {gb_pct} | "
              f"{speedup:.2f}x |")
    print_targets(rows)


# the targets: (step, fast variant, slow variant, least speed-up)
TARGETS = [
    ("LoRA fwd+bwd", "triton", "torch", 1.2),
    ("LoRA fwd+bwd", "triton", "torch-bf16", 1.2),
    ("DoRA fwd+bwd", "triton", "peft", 1.5),
    ("8-bit AdamW step", "triton", "bitsandbytes", 1.0),
]


def print_targets(rows):
    print()
    if ARGS.cpu_check:
        print("(--cpu-check: interpreted kernels at tiny sizes; the targets are not judged)")
        return
    times = {(step, shape, variant): t for step, shape, variant, t, *_ in rows}
    for step, fast, slow, least in TARGETS:
        for shape in dict.fromkeys(shape for s, shape, *_ in rows if s == step):
            if (step, shape, fast) in times and (step, shape, slow) in times:
                ratio = times[(step, shape, slow)] / times[(step, shape, fast)]
                verdict = "met" if ratio >= least else "MISSED"
                print(f"target {step} {fast} >= {least}x {slow} at {shape}: {ratio:.2f}x, {verdict}")


if __name__ == "__main__":
    main()
