"""Memory planner: real-size predictions, the planner's own speed, and the tiny-model validation matrix.

    python benchmarks/bench_planner.py                 # real-size table (predictions) + planner speed
    python benchmarks/bench_planner.py --validate      # tiny models on the CPU: predicted vs measured,
                                                       # 32 runs
    python benchmarks/bench_planner.py --quantized     # real size with a quantized frozen denoiser
                                                       # (NF4, int8)
    python benchmarks/bench_planner.py --validate --quantized   # the same check with a quantized frozen base
    python benchmarks/bench_planner.py --speed         # only the planner's speed: 3 plans of SDXL 1024, fit

Real-size rows are predictions from fake tensors (no GPU was used). Targets: a plan for the real
SDXL at 1024 in <= 10 s and < 2 GiB resident on the 2-core machine; `fit` over all options < 1 minute;
every validation row within 5%.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

REAL_ROWS = [  # (model, resolution, checkpointing, optimizer)
    ("sdxl", 512, False, "adamw"), ("sdxl", 512, True, "adamw8bit"),
    ("sdxl", 1024, False, "adamw"), ("sdxl", 1024, True, "adamw8bit"),
    ("sd35-medium", 1024, False, "adamw"), ("sd35-medium", 1024, True, "adamw8bit"),
    ("sd35-large", 1024, False, "adamw"), ("sd35-large", 1024, True, "adamw8bit"),
    ("flux-dev", 1024, False, "adamw"), ("flux-dev", 1024, True, "adamw8bit"),
]


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


QUANTIZED_ROWS = [  # (model, resolution, checkpointing, optimizer, base quantization)
    ("flux-dev", 1024, False, "adamw", "nf4"), ("flux-dev", 1024, True, "adamw8bit", "nf4"),
    ("flux-dev", 1024, False, "adamw", "int8"), ("flux-dev", 1024, True, "adamw8bit", "int8"),
    ("sdxl", 1024, False, "adamw", "nf4"), ("sdxl", 1024, True, "adamw8bit", "nf4"),
]


def real_table(rows, rank: int) -> None:
    from lora_lab.planning import plan_memory

    quantized = len(rows[0]) == 5
    print(f"| model | resolution | {'base | ' if quantized else ''}checkpointing | optimizer | attention | "
          "weights (denoiser / others) GiB | saved activations GiB | predicted peak GiB | phase | "
          "plan time s |")
    print(f"| --- | ---: | {'--- | ' if quantized else ''}--- | --- | --- | ---: | ---: | ---: | --- | "
          "---: |")
    for model, res, ckpt, opt, *q in rows:
        p = plan_memory(model, resolution=res, rank=rank, gradient_checkpointing=ckpt, optimizer=opt,
                        base_quantization=q[0] if q else None)
        w = p.parts
        print(f"| {model} | {res} | {q[0] + ' | ' if q else ''}{'yes' if ckpt else 'no'} | {opt} | "
              f"{p.attention} | "
              f"{gib(w['frozen weights'])} / {gib(w['resident (VAE, text encoders)'])} | "
              f"{gib(p.saved_activations)} | "
              f"**{gib(p.peak)}** | {p.peak_phase} | {p.seconds:.1f} |", flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\nmax resident memory of this process: {rss:.2f} GiB")


def validate() -> None:
    from lora_lab.diffusion import TrainConfig
    from lora_lab.planning import measure_training_step, plan_memory

    print("| kind | checkpointing | optimizer | autocast | measured peak B | predicted peak B | error | "
          "state B (both) |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    worst = 0.0
    for kind in ("sd15", "sdxl", "sd3", "flux"):
        for ckpt in (False, True):
            for opt in ("adamw", "adamw8bit"):
                for mp in ("no", "bf16"):
                    with tempfile.TemporaryDirectory() as d:
                        m = measure_training_step(TrainConfig(model=kind, output=d, rank=8,
                                                              gradient_checkpointing=ckpt,
                                                              optimizer=opt, mixed_precision=mp))
                    p = plan_memory(kind, size="tiny", device="cpu", base_dtype="fp32", rank=8,
                                    gradient_checkpointing=ckpt, optimizer=opt, mixed_precision=mp,
                                    dataset_size=m["dataset_size"])
                    err = p.peak / m["peak"] - 1
                    worst = max(worst, abs(err))
                    same = "yes" if p.parts["optimizer state"] == m["optimizer_state"] else "NO"
                    print(f"| {kind} | {'yes' if ckpt else 'no'} | {opt} | {mp} | {m['peak']:,} | "
                          f"{p.peak:,} | "
                          f"{100 * err:+.2f}% | {m['optimizer_state']:,} ({same}) |", flush=True)
    print(f"\nworst |error|: {100 * worst:.2f}% (target <= 5%: {'met' if worst <= 0.05 else 'NOT met'})")


def validate_quantized() -> None:
    """The same check with the frozen denoiser stored quantized (tiny sdxl, no checkpointing, adamw, fp32)."""
    from lora_lab.diffusion import TrainConfig
    from lora_lab.planning import measure_training_step, plan_memory

    print("| kind | base | measured peak B | predicted peak B | error |")
    print("| --- | --- | ---: | ---: | ---: |")
    for q in ("int8", "int8-block", "nf4", "fp8"):
        with tempfile.TemporaryDirectory() as d:
            m = measure_training_step(TrainConfig(model="sdxl", output=d, rank=8, base_quantization=q))
        p = plan_memory("sdxl", size="tiny", device="cpu", base_dtype="fp32", rank=8, base_quantization=q,
                        mixed_precision="no", dataset_size=m["dataset_size"])
        print(f"| sdxl | {q} | {m['peak']:,} | {p.peak:,} | {100 * (p.peak / m['peak'] - 1):+.2f}% |",
              flush=True)


def speed() -> None:
    from lora_lab.planning import PlanError, fit_vram, plan_memory
    from lora_lab.planning.fakedevice import warm_caches

    t = time.perf_counter()
    # what the first plan in a process would do first: import diffusers' and transformers' classes
    warm_caches()
    t_import = time.perf_counter() - t
    seconds, cpu = [], []
    for _ in range(3):
        t, c = time.perf_counter(), time.process_time()
        p = plan_memory("sdxl", resolution=1024, rank=16)
        seconds.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    t = time.perf_counter()
    r = fit_vram("24GiB", "sdxl", resolution=1024, rank=16)
    t_fit = time.perf_counter() - t
    t = time.perf_counter()
    try:  # nothing fits 4 GiB: fit plans all four options before it says so
        fit_vram("4GiB", "sdxl", resolution=1024, rank=16)
    except PlanError:
        pass
    t_all = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    met = "met" if max(seconds) <= 10 else "NOT met"
    print(f"process start: importing diffusers' and transformers' model classes {t_import:.1f} s "
          "(once per process)")
    print(f"plan, real SDXL 1024, rank 16: {seconds[0]:.1f} s, {seconds[1]:.1f} s, {seconds[2]:.1f} s "
          f"(CPU {' / '.join(f'{c:.1f}' for c in cpu)} s; target <= 10 s: {met}; a one-shot process: "
          f"{t_import + seconds[0]:.1f} s), peak {gib(p.peak)} GiB predicted")
    print(f"fit 24GiB: {t_fit:.1f} s over {len(r.tried)} plan(s); "
          "fit 4GiB (nothing fits: all 4 options planned): "
          f"{t_all:.1f} s (target < 60 s: {'met' if max(t_fit, t_all) < 60 else 'NOT met'})")
    print(f"max resident memory: {rss:.2f} GiB (target < 2 GiB: {'met' if rss < 2 else 'NOT met'})")


def policies_table(models: list[str], rank: int) -> None:
    """Real size at 1024, bf16, AdamW: the saved activations and the peak under each checkpointing policy,
    with the attention kernel PyTorch picks on CUDA (fused) and with SDPA's math backend (the scores
    materialised)."""
    from lora_lab.planning import plan_memory

    print("| model | attention | checkpointing | saved activations | kept / none | predicted peak | plan s |")
    print("|---|---|---|---:|---:|---:|---:|")
    for model in models:
        for attention in ("auto", "math"):
            none = None
            for policy in (False, "full", "selective", "budget:0.3"):
                t = time.perf_counter()
                p = plan_memory(model, resolution=1024, rank=rank, gradient_checkpointing=policy,
                                attention=attention)
                none = none or p.saved_activations
                print(f"| {model} | {p.attention} | {policy or 'none'} | {gib(p.saved_activations)} GiB | "
                      f"{p.saved_activations / none:.3f} | {gib(p.peak)} GiB | "
                      f"{time.perf_counter() - t:.0f} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validate", action="store_true",
                    help="the tiny-model matrix instead of the real-size table")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--only", default=None, help="comma-separated models of the real table (default: all)")
    ap.add_argument("--quantized", action="store_true", help="real size with an NF4 / int8 frozen denoiser")
    ap.add_argument("--speed", action="store_true", help="only the planner's own speed and memory")
    ap.add_argument("--policies", action="store_true",
                    help="SDXL and SD3.5 Medium at 1024 under each checkpointing policy, fused and unfused "
                         "attention")
    args = ap.parse_args()
    if args.validate and args.quantized:
        validate_quantized()
    elif args.validate:
        validate()
    elif args.speed:
        speed()
    elif args.policies:
        policies_table((args.only or "sdxl,sd35-medium").split(","), args.rank)
    elif args.quantized:
        real_table(QUANTIZED_ROWS, args.rank)
    else:
        speed()
        rows = [r for r in REAL_ROWS if args.only is None or r[0] in args.only.split(",")]
        real_table(rows, args.rank)
