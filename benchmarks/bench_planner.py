"""Memory planner: real-size predictions, the planner's own speed, and the tiny-model validation matrix.

    python benchmarks/bench_planner.py                 # real-size table (predictions) + planner speed
    python benchmarks/bench_planner.py --validate      # tiny models on the CPU: predicted vs measured,
                                                       # 32 runs
    python benchmarks/bench_planner.py --quantized     # real size with a quantized frozen denoiser
                                                       # (NF4, int8)
    python benchmarks/bench_planner.py --validate --quantized   # the same check with a quantized frozen base
    python benchmarks/bench_planner.py --speed         # only the planner's speed: 3 plans of SDXL 1024, fit
    python benchmarks/bench_planner.py --cold-start    # a plan in a fresh process: cold plan cache, then warm
    python benchmarks/bench_planner.py --replay        # identical blocks replayed vs every block run: CPU s
    python benchmarks/bench_planner.py --targets       # the whole-run targets: SDXL and Flux NF4 at 1024
    python benchmarks/bench_planner.py --small-cards   # Flux.1-dev 1024 on 12 / 16 GiB, block swapping
    python benchmarks/bench_planner.py --flags         # train --dry-run per run flag vs a tiny run measured
                                                       # by MemTracker, phase by phase (sd15, the CPU)
    python benchmarks/bench_planner.py --real-cpu      # real SD1.5 trained on this CPU (random weights):
                                                       # each phase measured against its plan (~30 min)

Real-size rows are predictions from fake tensors (no GPU was used). Targets: a plan for the real
SDXL at 1024 in <= 10 s and < 2 GiB resident on the 2-core machine; `fit` over all options < 1 minute;
every validation row within 5%; --real-cpu: every phase within 3%; --targets: SDXL every phase under 8 GiB,
Flux.1-dev with an NF4 base under 16 GiB.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

REAL_ROWS = [  # (model, resolution, checkpointing, optimizer)
    ("sdxl", 512, False, "adamw"), ("sdxl", 512, True, "adamw8bit"),
    ("sdxl", 1024, False, "adamw"), ("sdxl", 1024, True, "adamw8bit"),
    ("sd35-medium", 1024, False, "adamw"), ("sd35-medium", 1024, True, "adamw8bit"),
    ("sd35-large", 1024, False, "adamw"), ("sd35-large", 1024, True, "adamw8bit"),
    ("flux-dev", 1024, False, "adamw"), ("flux-dev", 1024, True, "adamw8bit"),
]


PHASE_COLUMNS = ("cache", "load", "train step", "save", "sample")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


QUANTIZED_ROWS = [  # (model, resolution, checkpointing, optimizer, base quantization)
    ("flux-dev", 1024, False, "adamw", "nf4"), ("flux-dev", 1024, True, "adamw8bit", "nf4"),
    ("flux-dev", 1024, False, "adamw", "int8"), ("flux-dev", 1024, True, "adamw8bit", "int8"),
    ("sdxl", 1024, False, "adamw", "nf4"), ("sdxl", 1024, True, "adamw8bit", "nf4"),
]


def real_table(rows, rank: int) -> None:
    """Whole-run plans at real size (CUDA's rules, base dtype auto = bf16, encoders unloaded after caching):
    each phase's peak."""
    from lora_lab.planning import plan_memory

    quantized = len(rows[0]) == 5
    print(f"| model | resolution | {'base | ' if quantized else ''}checkpointing | optimizer | attention | "
          + " | ".join(f"{p} GiB" for p in PHASE_COLUMNS) + " | peak (phase) | plan time s |")
    print(f"| --- | ---: | {'--- | ' if quantized else ''}--- | --- | --- | "
          + " | ".join("---:" for _ in PHASE_COLUMNS) + " | --- | ---: |")
    for model, res, ckpt, opt, *q in rows:
        p = plan_memory(model, resolution=res, rank=rank, gradient_checkpointing=ckpt, optimizer=opt,
                        base_quantization=q[0] if q else None)
        phases = " | ".join(gib(p.phases[ph]) for ph in PHASE_COLUMNS)
        print(f"| {model} | {res} | {q[0] + ' | ' if q else ''}{'yes' if ckpt else 'no'} | {opt} | "
              f"{p.attention} | {phases} | **{gib(p.peak)}** ({p.peak_phase}) | {p.seconds:.0f} |",
              flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\nmax resident memory of this process: {rss:.2f} GiB")


def validate() -> None:
    from lora_lab.diffusion import TrainConfig
    from lora_lab.planning import measure_training_step, plan_memory

    print("| kind | checkpointing | optimizer | autocast | measured step peak B | planned step peak B | "
          "error | state B (both) |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    worst = 0.0
    for kind in ("sd15", "sdxl", "sd3", "flux"):
        for ckpt in (False, True):
            for opt in ("adamw", "adamw8bit"):
                for mp in ("no", "bf16"):
                    with tempfile.TemporaryDirectory() as d:
                        config = TrainConfig(model=kind, output=d, rank=8, gradient_checkpointing=ckpt,
                                             optimizer=opt, mixed_precision=mp)
                        m = measure_training_step(config)
                        p = plan_memory(config)  # the same run
                    err = p.step_peak / m["peak"] - 1  # the training step's, as measured
                    worst = max(worst, abs(err))
                    same = "yes" if p.parts["optimizer state"] == m["optimizer_state"] else "NO"
                    print(f"| {kind} | {'yes' if ckpt else 'no'} | {opt} | {mp} | {m['peak']:,} | "
                          f"{p.step_peak:,} | "
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
            config = TrainConfig(model="sdxl", output=d, rank=8, base_quantization=q)
            m = measure_training_step(config)
            p = plan_memory(config)  # the same run
        err = p.step_peak / m["peak"] - 1
        print(f"| sdxl | {q} | {m['peak']:,} | {p.step_peak:,} | {100 * err:+.2f}% |", flush=True)


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


COLD_START = """
import time, warnings
warnings.filterwarnings("ignore")
from lora_lab.planning import plan_memory
p = plan_memory({model!r}, resolution={resolution})
print(f"{{p.peak}} {{p.cached}} {{p.seconds:.3f}}")
"""


# What any plan that runs the real model classes pays before it counts a byte, each in a fresh process: the
# imports, and the denoiser's own forward and backward at 1024 px on plain meta tensors (bf16, no adapter, no
# autocast, nothing counted, only the input's gradient: less work than the plan's training step does).
FLOOR = {
    "import torch": "import torch",
    "+ import lora_lab.planning and the classes an SDXL plan runs": """
import torch, lora_lab.planning, diffusers, transformers
for name in ("UNet2DConditionModel", "AutoencoderKL"): getattr(diffusers, name)
for name in ("CLIPTextModel", "CLIPTextModelWithProjection"): getattr(transformers, name)""",
    "+ SDXL's UNet forward and backward at 1024 on meta tensors": """
import torch, lora_lab.planning
from lora_lab.models.real import build_real
with torch.device("meta"):
    unet = build_real("sdxl", ["unet"])["unet"].to(torch.bfloat16).requires_grad_(False)
    x = torch.empty(1, 4, 128, 128, dtype=torch.bfloat16, requires_grad=True)
    cond = {"text_embeds": torch.empty(1, 1280, dtype=torch.bfloat16), "time_ids": torch.empty(1, 6)}
    out = unet(x, torch.ones(1), torch.empty(1, 77, 2048, dtype=torch.bfloat16), added_cond_kwargs=cond)
    out.sample.float().mean().backward()""",
}


def cold_start(model: str, resolution: int, rounds: int) -> None:
    """One plan in a fresh Python process (imports included), with an empty plan cache and then with the plan
    cache the first process wrote: wall and CPU seconds of the whole process (its children's rusage). First
    the floor under any plan that runs the real classes (FLOOR), each in a fresh process."""
    import subprocess
    import sys

    from busy import machine_load

    def fresh(code: str, env=None) -> tuple[float, float, list[str]]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, out

    print("| a fresh process: the floor | wall s | CPU s | 1-min load |")
    print("| --- | ---: | ---: | ---: |")
    for label, code in FLOOR.items():
        load = machine_load()
        wall, cpu, _ = fresh("import warnings; warnings.filterwarnings('ignore')\n" + code)
        print(f"| {label} | {wall:.1f} | {cpu:.1f} | {load} |", flush=True)
    print(f"\n| {model} {resolution} px, fresh process | wall s | CPU s | plan s (inside) | from the cache | "
          "1-min load |")
    print("| --- | ---: | ---: | ---: | --- | ---: |")
    peaks, rows = set(), {"cold": [], "warm": []}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as folder:
            env = {**os.environ, "LORA_LAB_PLAN_CACHE": folder}
            for label in ("cold", "warm"):
                load = machine_load()
                wall, cpu, out = fresh(COLD_START.format(model=model, resolution=resolution), env)
                peaks.add(int(out[0]))
                rows[label].append(wall)
                print(f"| {label} cache | {wall:.1f} | {cpu:.1f} | {float(out[2]):.2f} | {out[1]} | {load} |",
                      flush=True)
    assert len(peaks) == 1, f"the cached plan differs from the plan made: {peaks}"
    cold, warm = min(rows["cold"]), min(rows["warm"])
    print(f"\nbest of {rounds}: cold {cold:.1f} s (target <= 8 s: {'met' if cold <= 8 else 'NOT met'}), "
          f"warm {warm:.1f} s (target <= 1 s for the repeat: {'met' if warm <= 1 else 'NOT met'}); "
          "the same peak both ways")


def replay(rounds: int) -> None:
    """Plans at 1024 px (no checkpointing, no sample phase) with the training step's identical blocks replayed
    (planning/blocks.py) and with every block running, alternating which goes first: CPU seconds of each, the
    blocks replayed, and whether the plans are the same in every field."""
    import contextlib

    from lora_lab.planning import blocks, plan_memory, run
    from lora_lab.planning.fakedevice import warm_caches

    warm_caches()
    plan_memory("sd15", resolution=256, sample_steps=0)  # the first plan's one-time costs, outside the rows
    replayed_blocks, calls = run.replayed_blocks, [0]
    apply = blocks._Replay.apply
    blocks._Replay.apply = lambda *a: calls.__setitem__(0, calls[0] + 1) or apply(*a)
    print("| model, 1024 px | every block CPU s | replayed CPU s | ratio | blocks replayed | the same plan |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for model in ("sdxl", "sd35-large", "flux-dev"):
        cpu: dict[str, list[float]] = {"every": [], "replay": []}
        plans, replayed = {}, 0
        for r in range(rounds):
            for label in (("every", "replay") if r % 2 else ("replay", "every")):
                run.replayed_blocks = (replayed_blocks if label == "replay"
                                       else lambda *a: contextlib.nullcontext())
                calls[0], c = 0, time.process_time()
                plans[label] = plan_memory(model, resolution=1024, sample_steps=0)
                cpu[label].append(time.process_time() - c)
                replayed = max(replayed, calls[0])
        run.replayed_blocks = replayed_blocks
        same = {**vars(plans["every"]), "seconds": 0} == {**vars(plans["replay"]), "seconds": 0}
        every, fast = min(cpu["every"]), min(cpu["replay"])
        print(f"| {model} | {every:.1f} | {fast:.1f} | {fast / every:.2f} | {replayed} | "
              f"{'yes' if same else 'NO'} |", flush=True)
    blocks._Replay.apply = apply


def targets() -> None:
    """The whole-run plans at 1024, batch 1, rank 16, bf16 base, checkpointing + 8-bit AdamW, encoders
    unloaded after caching, on CUDA's rules: every phase, against the targets."""
    from lora_lab.planning import plan_memory

    print("| model | base | " + " | ".join(f"{p} GiB" for p in PHASE_COLUMNS) + " | peak (phase) | target | "
          "plan s |")
    print("| --- | --- | " + " | ".join("---:" for _ in PHASE_COLUMNS) + " | --- | --- | ---: |")
    for model, quantization, target in (("sdxl", None, 8), ("flux-dev", "nf4", 16)):
        p = plan_memory(model, resolution=1024, rank=16, base_dtype="bf16", gradient_checkpointing=True,
                        optimizer="adamw8bit", base_quantization=quantization)
        met = "met" if p.peak < target * 2**30 else "NOT met"
        phases = " | ".join(gib(p.phases[ph]) for ph in PHASE_COLUMNS)
        print(f"| {model} | {quantization or 'bf16'} | {phases} | {gib(p.peak)} ({p.peak_phase}) | "
              f"< {target} GiB: {met} | {p.seconds:.0f} |", flush=True)


SMALL_CARDS = (("nf4", 0), ("fp8", 0), ("fp8", 30), ("fp8", 34))  # (base, blocks swapped)


def small_cards(rows=SMALL_CARDS) -> None:
    """Flux.1-dev at 1024 on 12 and 16 GiB cards: NF4 or fp8 base, checkpointing, 8-bit AdamW, encoders
    unloaded after caching, with and without block swapping; every phase, and the bytes swapping copies."""
    from lora_lab.planning import plan_memory

    print("| base | blocks swapped | " + " | ".join(f"{p} GiB" for p in PHASE_COLUMNS)
          + " | peak (phase) | 12 GiB | 16 GiB | copied per step GiB | plan s |")
    print("| --- | ---: | " + " | ".join("---:" for _ in PHASE_COLUMNS)
          + " | --- | --- | --- | ---: | ---: |")
    for quantization, swapped in rows:
        p = plan_memory("flux-dev", resolution=1024, rank=16, base_dtype="bf16", gradient_checkpointing=True,
                        optimizer="adamw8bit", base_quantization=quantization, blocks_to_swap=swapped)
        fits = ["fits" if p.peak <= gib_ * 2**30 else f"over by {gib(p.peak - gib_ * 2**30)}"
                for gib_ in (12, 16)]
        print(f"| {quantization} | {swapped} | " + " | ".join(gib(p.phases[ph]) for ph in PHASE_COLUMNS)
              + f" | {gib(p.peak)} ({p.peak_phase}) | {fits[0]} | {fits[1]} | {gib(p.moved_per_step)} | "
              f"{p.seconds:.0f} |", flush=True)


def four_examples(folder):
    """A dataset of 4 shipped examples (image + caption) in folder/data: enough for a few real-size steps."""
    import shutil

    from lora_lab.models import DATA_DIR

    data = folder / "data"
    data.mkdir()
    for stem in sorted({p.stem for p in (DATA_DIR / "lora_inverted").glob("*.png")})[:4]:
        for ext in (".png", ".txt"):
            shutil.copy(DATA_DIR / "lora_inverted" / f"{stem}{ext}", data / f"{stem}{ext}")
    return data


def real_cpu(runs: list[tuple[int, str, bool]], steps: int) -> None:
    """The real SD1.5 architecture (published configs, seeded random weights: `--base real:sd15`) trained
    for a few steps on this CPU on 4 shipped examples, fp32 and bf16 bases, checkpointing on and off: each
    phase's peak counted by lora_lab's LiveBytes and PyTorch's MemTracker in the same run, against the plan
    (device cpu)."""
    import shutil
    from pathlib import Path

    from lora_lab.diffusion import TrainConfig
    from lora_lab.planning import plan_memory
    from lora_lab.planning.measure import measure_phases

    worst = 0.0
    print("| resolution | base | checkpointing | phase | LiveBytes GiB | MemTracker GiB | planned GiB | "
          "error | run s |")
    print("| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        data = four_examples(Path(tmp))
        for res, dtype, ckpt in runs:
            config = TrainConfig(model="sd15", base="real:sd15", base_dtype=dtype, dataset=str(data),
                                 output=f"{tmp}/run-{res}-{dtype}-{ckpt}", resolution=res, rank=16,
                                 steps=steps, sample_steps=1, sample_prompts=["a photo"],
                                 gradient_checkpointing=ckpt, progress=False, device="cpu")
            t = time.perf_counter()
            measured = measure_phases(config, ("live", "torch"))
            seconds = time.perf_counter() - t
            plan = plan_memory(config)  # the same run
            for ph in PHASE_COLUMNS:
                live, mt, planned = measured["live"][ph], measured["torch"][ph], plan.phases[ph]
                err = planned / live - 1 if live else 0.0
                worst = max(worst, abs(err))
                print(f"| {res} | {dtype} | {'yes' if ckpt else 'no'} | {ph} | {gib(live)} | {gib(mt)} | "
                      f"{gib(planned)} | {100 * err:+.2f}% | {seconds:.0f} |", flush=True)
            shutil.rmtree(config.output, ignore_errors=True)
    print(f"\nworst |error|: {100 * worst:.2f}% (target <= 3%: {'met' if worst <= 0.03 else 'NOT met'})")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"max resident memory of this process: {rss:.2f} GiB")


# the run flags whose plans tests/planning/test_matrix.py checks: each beside the plain tiny sd15 run
FLAG_CASES = {
    "plain": {}, "--feed-forward": {"feed_forward": True}, "--reg-dataset": {"reg_dataset": "reg"},
    "[[datasets]] x3, x2": {"dataset": None, "datasets": [{"path": "train", "repeats": 3},
                                                          {"path": "more", "repeats": 2}]},
    "--shuffle-captions --caption-variants 32": {"shuffle_captions": True, "caption_variants": 32},
    "--validation-split 0.25": {"validation_split": 0.25}, "--sample-every 1": {"sample_every": 1},
    "--ema-decay 0.9": {"ema_decay": 0.9}, "--text-encoder-lr 1e-4": {"text_encoder_lr": 1e-4},
    "--adapter lokr": {"adapter": "lokr"}, "--optimizer prodigy": {"optimizer": "prodigy", "lr": 1.0},
    "--optimizer adafactor": {"optimizer": "adafactor"},
    "--validation-dataset": {"validation_dataset": "more"}, "--save-every 1": {"save_every": 1},
}


def flags_table() -> None:
    """`train --dry-run` (plan_memory of the run's TrainConfig) against the same tiny run measured by
    PyTorch's MemTracker, each phase's plan / measured, on 4-image folders captioned with comma-separated tags
    (what caption shuffling shuffles)."""
    from lora_lab.diffusion import TrainConfig
    from lora_lab.diffusion.trainer import PHASES
    from lora_lab.planning import plan_memory
    from lora_lab.planning.measure import measure_phases

    print("| run (sd15, 2 steps, rank 16) | " + " | ".join(PHASES) + " | measured peak |")
    print("| --- |" + " ---: |" * (len(PHASES) + 1))
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name in ("train", "more", "reg"):
            (Path(tmp) / name).mkdir()
            folders[name] = four_examples(Path(tmp) / name)
            for i, caption in enumerate(sorted(folders[name].glob("*.txt"))):
                caption.write_text(f"digit, {name} {i}, inverted")
        for i, (label, options) in enumerate(FLAG_CASES.items()):
            options = dict(options)
            for name in ("reg_dataset", "validation_dataset"):
                if name in options:
                    options[name] = str(folders[options[name]])
            if "datasets" in options:
                options["datasets"] = [{**t, "path": str(folders[t["path"]])} for t in options["datasets"]]
            config = TrainConfig(**{"model": "sd15", "dataset": str(folders["train"]), "rank": 16, "steps": 2,
                                    "sample_steps": 1, "progress": False, "device": "cpu",
                                    "output": f"{tmp}/out-{i}", **options})
            measured = measure_phases(config, ("torch",))["torch"]
            planned = plan_memory(config, cache=False).phases
            print(f"| {label} | " + " | ".join(f"{planned[p] / measured[p]:.3f}" for p in PHASES)
                  + f" | {max(measured.values()) / 2**20:.1f} MiB |", flush=True)


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
    ap.add_argument("--targets", action="store_true", help="the whole-run targets (SDXL, Flux NF4 at 1024)")
    ap.add_argument("--cold-start", action="store_true",
                    help="one SDXL 1024 plan in a fresh process, cold and warm plan cache (--rounds)")
    ap.add_argument("--rounds", type=int, default=1, help="--cold-start's and --replay's rounds (default 1)")
    ap.add_argument("--replay", action="store_true",
                    help="plans with the training step's identical blocks replayed vs every block running")
    ap.add_argument("--small-cards", action="store_true",
                    help="Flux.1-dev 1024 on 12 / 16 GiB: NF4 or fp8 base, with and without block swapping")
    ap.add_argument("--flags", action="store_true", help="train --dry-run per run flag vs MemTracker")
    ap.add_argument("--real-cpu", action="store_true",
                    help="real SD1.5 trained on this CPU, measured per phase")
    ap.add_argument("--runs", default="256:fp32:no,256:fp32:yes,256:bf16:yes,512:fp32:yes",
                    help="--real-cpu's runs, RESOLUTION:BASE_DTYPE:CHECKPOINTING,... (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=2, help="--real-cpu's training steps (default 2)")
    args = ap.parse_args()
    if not args.cold_start:  # every plan here is made and timed, not read back from a plan cache
        os.environ["LORA_LAB_PLAN_CACHE"] = "off"
    if args.real_cpu:
        real_cpu([(int(r), d, c == "yes") for r, d, c in (run.split(":") for run in args.runs.split(","))],
                 args.steps)
    elif args.flags:
        flags_table()
    elif args.targets:
        targets()
    elif args.cold_start:
        cold_start("sdxl", 1024, args.rounds)
    elif args.replay:
        replay(args.rounds)
    elif args.small_cards:
        small_cards()
    elif args.validate and args.quantized:
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
