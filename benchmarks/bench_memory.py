"""Memory benchmark: gradient checkpointing policies (activation bytes, step time). (8-bit Adam's state
bytes and step time: benchmarks/bench_optim.py.)

    python benchmarks/bench_memory.py [--threads 1] [--rounds 15]
        [--plot docs/checkpoint_pareto.png] [--profile]
    python benchmarks/bench_memory.py --wide --rounds 7 --budgets 0.2 0.3 0.35 0.5
    python benchmarks/bench_memory.py --real --threads 2 --rounds 3 --attention fused
    python benchmarks/bench_memory.py --real --threads 2 --rounds 3 --attention unfused --model UNet
    python benchmarks/bench_memory.py --real --threads 2 --rounds 7 --attention unfused --model SD3

Checkpointing: the 12-block stack, the tiny UNet and a tiny SD3 transformer (these two also with their
attention unfused: SDPA's math backend), each with no checkpointing,
lora_lab's policies (full, selective, every_k, budgets) and torch.utils.checkpoint with and without its
selective policy API on the same blocks, all timed in the same interleaved rounds; a table, the targets,
and a Pareto plot of bytes kept against step time. --wide: the same for a UNet and an SD3 transformer with
real heads (64 channels) and LoRA on a frozen base, where a tiny model's per-op overhead no longer hides the
trade (a few seconds a step). --real: SDXL's and SD3.5 Medium's own widths and token counts, fewer layers
(tens of seconds a step; the fused run takes 13 minutes; no plot). With unfused attention, one model a
process: the SDXL-wide UNet's unchecked step alone saves 4.6 GB (the run peaks at 17 GB; 10 minutes).

Activation and state bytes are exact counts (lora_lab.memory), not allocator readings. Times are
medians of interleaved runs (each round runs every variant once), so a load change on the machine
hits all variants alike; ratios come from the same run. Prints a markdown table with the targets.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import functools
import gc
import io
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lora_lab import (
    BlockStack,
    LoRAConfig,
    add_lora,
    enable_checkpointing,
)
from lora_lab.checkpointing import checkpointing_plan
from lora_lab.checkpointing.ops import _is_costly
from lora_lab.diffusion.config import ATTENTION_TARGETS
from lora_lab.fileio import atomic_write_bytes
from lora_lab.memory import saved_activation_bytes
from lora_lab.models.real import SD35_MEDIUM, TEXT_TOKENS, UNET_SDXL
from lora_lab.notebook.runner import isolate_caches

STACK = {"n_blocks": 12, "width": 256, "hidden": 1024, "out": 10, "dropout": 0.1}
STACK_BATCH = 128
# the sd15-like tiny UNet of the project's tiny diffusers configs
TINY_UNET = {
    "sample_size": 16, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
    "block_out_channels": [32, 64], "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "cross_attention_dim": 32, "norm_num_groups": 32, "attention_head_dim": 8,
}
UNET_BATCH = 4
# the project's tiny SD3 config with 4 joint blocks, on 32x32 latents (256 image tokens)
TINY_SD3 = {
    "sample_size": 32, "patch_size": 2, "in_channels": 4, "num_layers": 4, "attention_head_dim": 8,
    "num_attention_heads": 4, "caption_projection_dim": 32, "joint_attention_dim": 32,
    "pooled_projection_dim": 64, "out_channels": 4,
}
SD3_BATCH = 4
# --wide: the UNet and the SD3 transformer with heads of 64 channels (as SDXL's and SD3.5's), batch 1, LoRA
# rank 16 on the trainer's attention targets with the base frozen (what lora_lab trains). UNet: 320 / 640
# channels, attention on the 32x32 level (1,024 tokens, 5 heads; UNet2DConditionModel's "attention_head_dim"
# is its head count)
WIDE_UNET = {
    "sample_size": 32, "in_channels": 4, "out_channels": 4, "layers_per_block": 1,
    "block_out_channels": [320, 640], "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "cross_attention_dim": 768, "attention_head_dim": [5, 10],
}
# SD3: 2 joint blocks 512 wide (8 heads), 64x64 latents (1,024 image tokens) and 77 text tokens
WIDE_SD3 = {
    "sample_size": 64, "patch_size": 2, "in_channels": 16, "num_layers": 2, "attention_head_dim": 64,
    "num_attention_heads": 8, "caption_projection_dim": 512, "joint_attention_dim": 768,
    "pooled_projection_dim": 256, "out_channels": 16,
}
WIDE_LORA_RANK = 16
# --real: the widths, heads and token counts of SDXL at 1024 px and SD3.5 Medium at 768 px (the LoRA as in
# --wide), with fewer layers so that a step takes seconds on this CPU: SDXL's three levels with one ResNet and
# one transformer layer each where SDXL has two and [1, 2, 10]; two of SD3.5 Medium's 24 joint blocks, the
# first with its dual attention (as its blocks 0-12 have). Attention sees 4,096 and 1,024 tokens (SDXL's 64x64
# and 32x32 levels) and 2,304 image + 333 text tokens (SD3). SD3 at 1024 px with unfused attention (24 heads x
# 4,429^2 probabilities, 1.9 GB an attention) ran out of this machine's 24 GiB in its first unchecked step.
REAL_UNET = {**UNET_SDXL, "layers_per_block": 1, "transformer_layers_per_block": [1, 1, 1]}
REAL_SD3 = {**SD35_MEDIUM, "num_layers": 2, "dual_attention_layers": [0], "sample_size": 96}
REAL_VARIANTS = ("full", "selective", "budget:0.3")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library's allocator controls (mallopt, malloc_trim), or None where the C library is not glibc."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def steady_allocator() -> bool:
    """Keep freed memory in the process, as PyTorch's CUDA caching allocator does. glibc's malloc gives a
    freed block above its mmap threshold back to the OS, so each step page-faults its largest tensors afresh
    (the unfused attention's probabilities: 4.7 MB a block), and the threshold moves with the run's history:
    the same command measured the unfused SD3 transformer's "full" at +24% in one run and +55% in the next.
    With large blocks taken from the heap and the heap never trimmed, every variant runs on reused pages."""
    libc = _glibc()
    if libc is None:  # not glibc: its allocator's own policy stands
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # (an int over 32 bits would be cut, not refused)
    m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameters (malloc.h)
    return bool(libc.mallopt(m_mmap_threshold, 2**31 - 1)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def release_freed() -> None:
    """Give the memory freed so far back to the OS (glibc's malloc_trim), between models: steady_allocator
    keeps it otherwise."""
    gc.collect()
    if _glibc() is not None:
        _glibc().malloc_trim(0)


def _median_times(fns: dict, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def held_bytes(fn, *args) -> int:
    """Bytes of the storages made during fn(*args) that are still alive when it returns (the graph
    holds them): the same measure for lora_lab and for torch's selective checkpointing, which keeps
    its outputs outside autograd's saved tensors. For lora_lab's policies it equals
    saved_activation_bytes plus the loss itself (checked below)."""
    refs: dict[int, tuple[StorageWeakRef, int]] = {}

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)}
            # views and in-place results make nothing new (weights seen through t())
            for t in tree_leaves(out):
                if (isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()
                        and t.untyped_storage()._cdata not in ins):
                    s = t.untyped_storage()
                    refs[s._cdata] = (StorageWeakRef(s), s.nbytes())
            return out

    with Made():
        out = fn(*args)
    gc.collect()
    held = sum(n for ref, n in refs.values() if not ref.expired())
    del out
    return held


def _torch_checkpoint(blocks, selective: bool) -> None:
    """PyTorch's non-reentrant checkpoint on the same blocks; selective: its per-op policy API keeping
    the same ops as lora_lab's "selective" (matmuls, convolutions, attention)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if _is_costly(op, args, kwargs)
                else CheckpointPolicy.PREFER_RECOMPUTE)

    for b in blocks:
        extra = ({"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}
                 if selective else {})
        b.forward = functools.partial(torch.utils.checkpoint.checkpoint, b.forward, use_reentrant=False,
                                      **extra)


def _subjects(scale: str = "tiny") -> Iterator[tuple]:
    """Yields (name, model, loss(model), blocks(model)) for the stack, the tiny UNet and the tiny SD3
    transformer, then the UNet and the transformer again with their attention unfused: those two are yielded
    inside `sdpa_kernel(MATH)`, so everything the caller runs with them (forward and backward, every variant,
    torch's checkpoint too) runs SDPA's math backend, which makes and saves the seq x seq scores and
    probabilities (Korthikanti et al.'s setting, and attention that no fused kernel takes). scale "wide" /
    "real": the UNet and the transformer of WIDE_* / REAL_* with LoRA on a frozen base instead, and no
    stack."""
    torch.manual_seed(0)
    out = []
    if scale == "tiny":
        stack = BlockStack(**STACK).train()
        x = torch.randn(STACK_BATCH, STACK["width"])
        out.append(("12-block residual MLP stack", stack, lambda m: m(x).square().mean(), lambda m: m.blocks))
    try:
        import diffusers
        from diffusers.models.attention import JointTransformerBlock
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.transformers.transformer_2d import Transformer2DModel
    except ImportError:
        print("diffusers not installed: UNet and transformer rows skipped")
        yield from out
        return
    unet_cfg, sd3_cfg = {"tiny": (TINY_UNET, TINY_SD3), "wide": (WIDE_UNET, WIDE_SD3),
                         "real": (REAL_UNET, REAL_SD3)}[scale]
    unet = diffusers.UNet2DConditionModel(**unet_cfg).train()
    sd3 = diffusers.SD3Transformer2DModel(**sd3_cfg).train()
    unet_kw: dict = {}
    if scale == "tiny":
        sample, t, text = (torch.randn(UNET_BATCH, 4, 16, 16), torch.tensor([10, 300, 600, 900]),
                           torch.randn(UNET_BATCH, 8, 32))
        latents, prompt, pooled = (torch.randn(SD3_BATCH, 4, 32, 32), torch.randn(SD3_BATCH, 16, 32),
                                   torch.randn(SD3_BATCH, 64))
        steps = torch.tensor([100.0, 400.0, 700.0, 900.0])
        names = ("tiny diffusers UNet2DConditionModel", "tiny diffusers SD3Transformer2DModel")
    else:
        for m in (unet, sd3):
            add_lora(m, LoRAConfig(rank=WIDE_LORA_RANK, alpha=WIDE_LORA_RANK,
                                   targets=list(ATTENTION_TARGETS)))
        t, steps = torch.tensor([500]), torch.tensor([500.0])
        n_unet, n_sd3 = unet_cfg["sample_size"], sd3_cfg["sample_size"]  # latent sides
        sample, text = torch.randn(1, 4, n_unet, n_unet), torch.randn(1, 77, unet_cfg["cross_attention_dim"])
        text_tokens = 77 if scale == "wide" else TEXT_TOKENS["sd35-medium"]
        latents, prompt = (torch.randn(1, 16, n_sd3, n_sd3),
                           torch.randn(1, text_tokens, sd3_cfg["joint_attention_dim"]))
        pooled = torch.randn(1, sd3_cfg["pooled_projection_dim"])
        if scale == "wide":
            names = ("UNet 320/640 wide, heads of 64, LoRA", "SD3 transformer 512 wide, heads of 64, LoRA")
        else:  # SDXL's added conditions: pooled text (1,280) and 6 size/crop ids
            unet_kw = {"added_cond_kwargs": {"text_embeds": torch.randn(1, 1280),
                                             "time_ids": torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]])}}
            names = ("SDXL-wide UNet, 1024 px, LoRA", "SD3.5 Medium, 2 joint blocks, 768 px, LoRA")
    out.append((names[0], unet,
                lambda m: m(sample, t, encoder_hidden_states=text, **unet_kw).sample.square().mean(),
                lambda m: (ResnetBlock2D, Transformer2DModel)))
    out.append((names[1], sd3, lambda m: m(latents, prompt, pooled, steps).sample.square().mean(),
                lambda m: JointTransformerBlock))
    yield from out
    for name, model, loss, blocks in out[-2:]:
        with sdpa_kernel(SDPBackend.MATH):
            yield f"{name}, unfused attention", model, loss, blocks


def _sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the modules that shares the parameters and buffers: each variant of a real-size model runs
    the same weights, held once (full copies would not fit in memory). Each step sets the gradients to None
    after its backward, so the variants do not see each other's. The tiny and wide models keep a full copy per
    variant, as their tables were measured."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def checkpointing_rows(rounds: int, budgets: list[float], scale: str, attention: str = "both",
                       which: str = "all") -> list[dict]:
    """One row per (model, variant); every variant of a model is timed in the same interleaved rounds. At the
    real scale only the policies of REAL_VARIANTS and torch's whole-block checkpoint run (a step takes
    seconds)."""
    rows = []
    policies = (list(REAL_VARIANTS) if scale == "real"
                else ["full", "selective", "every_k"] + [f"budget:{b:g}" for b in budgets])
    refs = ((("torch.utils.checkpoint", False),) if scale == "real"
            else (("torch.utils.checkpoint", False), ("torch selective (SAC)", True)))
    copy_of = _sharing_copy if scale == "real" else copy.deepcopy
    for name, model, loss_fn, blocks in _subjects(scale):
        wrong_attention = attention != "both" and ("unfused" in name) != (attention == "unfused")
        if wrong_attention or (which != "all" and which not in name):
            continue
        variants = {"none": model}
        for policy in policies:
            m = copy_of(model)
            enable_checkpointing(m, blocks(m), policy)
            variants[policy] = m
        probe = copy_of(model)
        names = enable_checkpointing(probe, blocks(probe))  # the names of the blocks, for torch's checkpoint
        for ref, selective in refs:
            m = copy_of(model)
            _torch_checkpoint([m.get_submodule(n) for n in names], selective)
            variants[ref] = m

        def step(m, f=loss_fn):
            f(m).backward()
            m.zero_grad(set_to_none=True)

        for m in variants.values():
            step(m)  # warm-up (and the budget's planning forward)
        plain = saved_activation_bytes(loss_fn, model)
        kept = {k: held_bytes(loss_fn, m) for k, m in variants.items()}
        for k, m in variants.items():  # the held measure agrees with the exact count for lora_lab's policies
            if not k.startswith("torch"):
                exact = saved_activation_bytes(loss_fn, m)
                assert kept[k] - exact in (0, 4), (name, k, kept[k], exact)
                kept[k] = exact
        times = _median_times({k: functools.partial(step, m) for k, m in variants.items()}, rounds)
        for k, m in variants.items():
            plan = checkpointing_plan(m)
            rows.append({"model": name, "variant": k, "bytes": kept[k], "ratio": kept[k] / plain,
                         "s": times[k], "overhead": times[k] / times["none"] - 1,
                         "plan": str(plan) if plan else ""})
        for r in rows[-len(variants):]:  # as each model ends: a run cut short keeps what it measured
            print(f"  {name}: {r['variant']}: {r['bytes']:,} bytes ({r['ratio']:.3f}), "
                  f"{r['s']:.3f} s ({r['overhead']:+.0%})", flush=True)
        del variants, m, probe
        release_freed()
    return rows


class _PassThrough(TorchDispatchMode):
    """A Python dispatch mode that does nothing: what running every op through one costs."""

    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _PassThrough.ops += 1
        return func(*args, **(kwargs or {}))


def profile_rows(rounds: int, scale: str) -> list[dict]:
    """Where a step's time goes, per model: the forward (no grad) plain and under a pass-through dispatch
    mode, the self time of the costly ops (torch profiler), and forward / backward of none, full and
    selective."""
    from torch.profiler import profile

    rows = []
    for name, model, loss_fn, blocks in _subjects(scale):
        variants = {"none": model}
        for policy in ("full", "selective"):
            variants[policy] = copy.deepcopy(model)
            enable_checkpointing(variants[policy], blocks(variants[policy]), policy)

        def forward(mode=None, f=loss_fn, m=model):
            with torch.no_grad(), mode or contextlib.nullcontext():
                f(m)

        def halves(m, f=loss_fn):
            t0 = time.perf_counter()
            loss = f(m)
            t1 = time.perf_counter()
            loss.backward()
            m.zero_grad(set_to_none=True)
            return t1 - t0, time.perf_counter() - t1

        for m in variants.values():
            halves(m)
        _PassThrough.ops = 0
        forward(_PassThrough())
        n_ops = _PassThrough.ops
        times: dict[str, list[float]] = {k: [] for k in ("forward", "forward in a mode",
                                                         *[f"{v} {h}" for v in variants
                                                           for h in ("fwd", "bwd")])}
        for _ in range(rounds):
            for k, mode in (("forward", None), ("forward in a mode", _PassThrough())):
                t0 = time.perf_counter()
                forward(mode)
                times[k].append(time.perf_counter() - t0)
            for v, m in variants.items():
                f, b = halves(m)
                times[f"{v} fwd"].append(f)
                times[f"{v} bwd"].append(b)
        with profile() as prof:
            forward()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        costly = sum(e.self_cpu_time_total for e in events
                     if any(c in e.key for c in ("mm", "conv", "attention")))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"model": name, "ops": n_ops, "costly share": costly / total,
                     "mode us/op": (med["forward in a mode"] - med["forward"]) / n_ops * 1e6, **med})
    return rows


def _saved_per_block(model, loss_fn, block_types) -> Counter:
    """Activation bytes autograd saves inside each kind of block during one forward (parameters left out)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    out: Counter = Counter()
    undo = []
    for b in model.modules():
        if isinstance(b, block_types):
            def counted(*a, _b=b, _f=b.forward, **k):
                seen = {}

                def pack(t):
                    if t.untyped_storage()._cdata not in params:
                        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
                    return t.detach()  # (not t: see lora_lab.memory.saved_activation_bytes)

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = _f(*a, **k)
                out[type(_b).__name__] += sum(seen.values())
                return y

            undo.append((b, b.__dict__.get("forward")))
            b.forward = counted
    loss_fn(model)
    for b, f in undo:
        if f is None:
            del b.forward
        else:
            b.forward = f
    return out


def block_rows(scale: str) -> list[dict]:
    """Per kind of block: what "selective" keeps against what the unchecked block saves (exact bytes)."""
    rows = []
    for name, model, loss_fn, blocks in _subjects(scale):
        probe = copy.deepcopy(model)
        names = enable_checkpointing(probe, blocks(probe))
        kinds = tuple({type(probe.get_submodule(n)) for n in names})
        plain = _saved_per_block(model, loss_fn, kinds)
        selective = copy.deepcopy(model)
        enable_checkpointing(selective, blocks(selective), "selective")
        kept = _saved_per_block(selective, loss_fn, kinds)
        rows += [{"model": name, "block": k, "plain": plain[k], "kept": kept[k]} for k in sorted(plain)]
    return rows


def print_profile(rows: list[dict]) -> None:
    print("| model | ops in a forward | forward ms (no grad) | + pass-through mode, us/op |"
          " matmul/conv/attention share of forward |"
          " none fwd / bwd ms | full fwd / bwd ms | selective fwd / bwd ms |")
    print("|---|---:|---:|---:|---:|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['ops']} | {1e3 * r['forward']:.1f} | {r['mode us/op']:.1f} | "
              f"{r['costly share']:.0%} | "
              + " | ".join(f"{1e3 * r[v + ' fwd']:.1f} / {1e3 * r[v + ' bwd']:.1f}"
                           for v in ("none", "full", "selective")) + " |")


def pareto_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    cols = min(3, len(models))
    n_rows = -(-len(models) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(5.2 * cols, 4.2 * n_rows), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.axis("off")
    for ax, model in zip(axes.flat, models):
        mine = [r for r in rows if r["model"] == model]
        for r in mine:
            ref = r["variant"].startswith("torch")
            budget = r["variant"].startswith("budget")
            ax.scatter(r["ratio"], 100 * r["overhead"], marker="s" if ref else "o",
                       color="tab:orange" if ref else ("tab:green" if budget else "tab:blue"))
            ax.annotate(r["variant"].replace("torch.utils.checkpoint", "torch full"),
                        (r["ratio"], 100 * r["overhead"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        budgets = sorted((r for r in mine if r["variant"].startswith("budget")), key=lambda r: r["ratio"])
        ax.plot([r["ratio"] for r in budgets], [100 * r["overhead"] for r in budgets], color="tab:green",
                lw=0.8)
        ax.set_xlabel("activation bytes kept / unchecked")
        ax.set_ylabel("step time overhead, %")
        ax.set_title(model, fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())
    print(f"Pareto plot: {path}")


def print_checkpointing(rows: list[dict]) -> None:
    print("| model | policy | activation bytes kept | kept / unchecked | step s | overhead vs none |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['variant']} | {r['bytes']:,} | {r['ratio']:.3f} | {r['s']:.4f} | "
              f"{r['overhead']:+.0%} |")
    print("\nTargets:")
    for model in dict.fromkeys(r["model"] for r in rows):
        v = {r["variant"]: r for r in rows if r["model"] == model}
        ratio = v["full"]["s"] / v["torch.utils.checkpoint"]["s"]
        print(f"- {model}: whole-block time / torch.utils.checkpoint's = {ratio:.3f} "
              f"(target <= 1.0: {'met' if ratio <= 1.0 else 'not met'})")
        if not model.startswith("12-block"):
            s = v["selective"]
            ok = s["ratio"] <= 0.35 and s["overhead"] <= 0.15
            print(f"- {model}: selective keeps {s['ratio']:.3f} at {s['overhead']:+.0%} "
                  f"(target <= 0.35 at <= +15%: {'met' if ok else 'not met'})")
        if "budget:0.3" in v:
            b = v["budget:0.3"]
            ok = b["ratio"] <= 0.30 + 0.02 and b["s"] < v["full"]["s"]
            print(f"- {model}: budget 0.3 keeps {b['ratio']:.3f}, "
                  f"{b['s'] / v['full']['s']:.3f} x whole-block's time "
                  f"(target <= 0.32 and < 1: {'met' if ok else 'not met'})")
            print(f"    plan: {b['plan']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: see the README note)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds (median)")
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.1, 0.2, 0.3, 0.4, 0.5],
                    help="checkpoint budgets to measure")
    ap.add_argument("--plot", help="Pareto plot path ('' for none; default docs/checkpoint_pareto.png,"
                    " with --wide docs/checkpoint_pareto_wide.png, with --real none)")
    scale = ap.add_mutually_exclusive_group()
    scale.add_argument("--wide", action="store_const", dest="scale", const="wide", default="tiny",
                       help="checkpointing of the UNet and the SD3 transformer with heads of 64 and LoRA on a"
                       " frozen base (WIDE_UNET, WIDE_SD3) instead of the tiny models")
    scale.add_argument("--real", action="store_const", dest="scale", const="real",
                       help="the same with the widths and token counts of SDXL at 1024 px and SD3.5 Medium at"
                       " 768 px, fewer layers (REAL_UNET, REAL_SD3), policies REAL_VARIANTS"
                       " (--budgets ignored); ~16 GB of memory")
    ap.add_argument("--attention", choices=("fused", "unfused", "both"), default="both",
                    help="checkpointing: only the models with fused (SDPA's choice) or unfused attention; in"
                    " 24 GiB, --real needs one process for each, and one for each --model when unfused")
    ap.add_argument("--model", choices=("all", "UNet", "SD3"), default="all",
                    help="checkpointing: only this model")
    ap.add_argument("--no-checkpointing", action="store_true", help="skip the checkpointing table")
    ap.add_argument("--profile", action="store_true",
                    help="also print where a step's time goes (dispatch mode, costly ops)")
    args = ap.parse_args()
    isolate_caches()
    torch.set_num_threads(args.threads)
    steady = steady_allocator()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.rounds} interleaved "
          f"rounds, freed memory "
          f"{'kept in the process (mallopt)' if steady else 'handled by the allocator as it is'}\n",
          flush=True)

    if args.profile:
        print_profile(profile_rows(args.rounds, args.scale))
        print()
        print("| model | block | bytes the unchecked blocks save | selective keeps | kept / unchecked |")
        print("|---|---|---:|---:|---:|")
        for r in block_rows(args.scale):
            print(f"| {r['model']} | {r['block']} | {r['plain']:,} | {r['kept']:,} | "
                  f"{r['kept'] / r['plain']:.3f} |")
        print()
    if not args.no_checkpointing:
        rows = checkpointing_rows(args.rounds, args.budgets, args.scale, args.attention, args.model)
        print()
        print_checkpointing(rows)
        plot = args.plot if args.plot is not None else {"tiny": "docs/checkpoint_pareto.png",
                                                        "wide": "docs/checkpoint_pareto_wide.png",
                                                        "real": ""}[args.scale]
        if plot:  # (a str: Path('') would be '.', the current directory)
            pareto_plot(rows, Path(plot))


if __name__ == "__main__":
    main()
