"""8-bit AdamW against torch's AdamW, bitsandbytes and torchao: state bytes and step time on one weight,
quiet and with one core busy.

    python benchmarks/bench_optim.py [--size 4096] [--rounds 7] [--torchao] [--no-callers-threads]

Every optimizer steps the same fp32 parameter with the same gradient; each round runs every setting and in
it every optimizer once (interleaved: a load change hits all alike); times are medians of wall time, and on
one thread also of process CPU time (what a quiet machine's wall time would be; the target is read on it
when the machine is shared). Three settings, one run:
  1 thread, quiet;  2 threads, quiet;  2 threads while a second process spins on one core (busy.py).
"lora_lab AdamW8bit" is its CPU default, the C step (lora_lab/kernels/cpu_adam8bit.py: one pass, one thread);
"PyTorch path" the same optimizer with backend="torch" (its reference, ~20 ops a chunk on one torch thread);
"PyTorch path, caller's threads" that path with its thread policy switched off (its ops on the caller's
intra-op threads, as before lora_lab.threads): the busy row measures what the policy prevents (slow when
busy: --no-callers-threads leaves it out).

Targets (issue 30): lora_lab AdamW8bit at most 1.0x torch AdamW (1 thread, quiet), and with one core busy
(2 threads) at most 2x its own quiet time.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
import warnings

import torch
from busy import machine_load, one_core_busy

import lora_lab.kernels.cpu_adam8bit
import lora_lab.optim
from lora_lab import AdamW8bit, optimizer_state_bytes

SETTINGS = (("1 thread, quiet", 1, False), ("2 threads, quiet", 2, False),
            ("2 threads, one core busy", 2, True))  # (label, torch threads, a helper spinning)


def torch_path(ps):
    return AdamW8bit(ps, lr=1e-3, backend="torch")


def makers(use_torchao: bool, callers_threads: bool) -> dict:
    out = {
        "torch AdamW (fp32 state; torch's CPU default)": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "torch AdamW fused=True (fp32 state)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "lora_lab AdamW8bit": lambda ps: AdamW8bit(ps, lr=1e-3),
        "lora_lab AdamW8bit, PyTorch path": torch_path,
        "lora_lab AdamW8bit, PyTorch path, caller's threads": torch_path,
    }
    if not callers_threads:
        del out["lora_lab AdamW8bit, PyTorch path, caller's threads"]
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    try:
        import bitsandbytes as bnb

        out["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)
    except ImportError:
        print("bitsandbytes not installed: its row is skipped")
    if use_torchao:
        from torchao.optim import AdamW8bit as AoAdamW8bit

        out["torchao AdamW8bit (compiled)"] = lambda ps: AoAdamW8bit(ps, lr=1e-3)
    logging.disable(logging.NOTSET)
    return out


def no_thread_policy(name: str):
    """The optimizer's step with lora_lab.threads.one_thread switched off, for the row that says so."""
    if not name.endswith("caller's threads"):
        return contextlib.nullcontext()
    return _patched(lora_lab.optim, "one_thread", contextlib.nullcontext)


@contextlib.contextmanager
def _patched(module, name, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


CONTROL = "control: a fixed single-thread loop (no torch)"


class FixedWork:
    """The control row: the same work on one thread each time (a Python loop, no memory traffic); its busy /
    quiet ratio is the share of a core the machine gives any one thread, whatever the step does."""

    def step(self) -> None:
        for _ in range(8_000_000):
            pass


def measure(size: int, rounds: int, use_torchao: bool, callers_threads: bool) -> tuple[dict, dict]:
    torch.manual_seed(0)
    w0, grad = torch.randn(size, size) * 0.02, torch.randn(size, size) * 1e-3
    opts = {}
    for name, make in makers(use_torchao, callers_threads).items():
        p = torch.nn.Parameter(w0.clone())
        p.grad = grad.clone()
        opts[name] = make([p])
        t0 = time.perf_counter()
        with no_thread_policy(name):
            opts[name].step()  # the first step makes the state (and compiles, for torchao)
        print(f"  first step of {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict = {}
    for r in range(rounds):  # each round runs every setting: a change of the machine's load hits all alike
        for label, threads, busy in SETTINGS:
            torch.set_num_threads(threads)
            with one_core_busy() if busy else contextlib.nullcontext():
                print(f"  round {r + 1}, {label}: {machine_load()}", flush=True)
                for name, opt in [*opts.items(), (CONTROL, FixedWork())]:
                    with no_thread_policy(name):
                        t0, c0 = time.perf_counter(), time.process_time()
                        opt.step()
                        times.setdefault((name, label), []).append(time.perf_counter() - t0)
                        if threads == 1:
                            times.setdefault((name, "cpu"), []).append(time.process_time() - c0)
    return opts, {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096, help="the weight is size x size")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--torchao", action="store_true",
                    help="also torchao's AdamW8bit (its first step compiles for ~1 min)")
    ap.add_argument("--no-callers-threads", action="store_true",
                    help="leave out the PyTorch path without its thread policy (seconds a step when busy)")
    args = ap.parse_args(argv)
    if lora_lab.kernels.cpu_adam8bit.library() is None:
        print("the C step cannot run here (its reason is logged): 'lora_lab AdamW8bit' is the PyTorch path")
    print(f"torch {torch.__version__}, CPU, one {args.size}x{args.size} fp32 weight, {args.rounds} "
          f"interleaved rounds per setting; {machine_load()}", flush=True)
    opts, t = measure(args.size, args.rounds, args.torchao, not args.no_callers_threads)
    n = args.size**2
    labels = [s[0] for s in SETTINGS]
    print(f"\n| optimizer | bytes/param | {labels[0]}: CPU ms | {' | '.join(labels)} | "
          "busy / its 2-thread quiet |")
    print("| --- | ---: |" + " ---: |" * (len(labels) + 2))
    for name, opt in opts.items():
        ms = " | ".join(f"{t[name, lab] * 1e3:.0f} ms" for lab in labels)
        print(f"| {name} | {optimizer_state_bytes(opt) / n:.3f} | {t[name, 'cpu'] * 1e3:.0f} ms | {ms} | "
              f"{t[name, labels[2]] / t[name, labels[1]]:.2f} |")
    ms = " | ".join(f"{t[CONTROL, lab] * 1e3:.0f} ms" for lab in labels)
    ratio = t[CONTROL, labels[2]] / t[CONTROL, labels[1]]
    print(f"| {CONTROL} | | {t[CONTROL, 'cpu'] * 1e3:.0f} ms | {ms} | {ratio:.2f} |")
    print()
    for ours in ("lora_lab AdamW8bit", "lora_lab AdamW8bit, PyTorch path"):
        targets(t, ours, labels)
    return 0


def targets(t: dict, ours: str, labels: list) -> None:
    ref = "torch AdamW (fp32 state; torch's CPU default)"
    wall, quiet = t[ours, labels[0]] / t[ref, labels[0]], t[ours, "cpu"] / t[ref, "cpu"]
    busy = t[ours, labels[2]] / t[ours, labels[1]]
    print(f"{ours} / torch AdamW, 1 thread, quiet: wall {wall:.2f}, CPU time {quiet:.2f} (target <= 1.0: "
          f"{'met' if max(wall, quiet) <= 1.0 else 'not met'})")
    print(f"{ours}, 2 threads, one core busy / 2 threads quiet: {busy:.2f} (target <= 2: "
          f"{'met' if busy <= 2.0 else 'not met'}); / its 1-thread quiet time: "
          f"{t[ours, labels[2]] / t[ours, labels[0]]:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
