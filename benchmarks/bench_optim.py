"""8-bit AdamW against torch's AdamW, bitsandbytes and torchao: state bytes and step time on one weight,
quiet and with one core busy.

    python benchmarks/bench_optim.py [--size 4096] [--rounds 7] [--torchao] [--no-callers-threads]

Every optimizer steps the same fp32 parameter with the same gradient; each round runs every setting and in
it every optimizer once (interleaved: a load change hits all alike); times are medians of wall time, and on
one thread also of process CPU time (what a quiet machine's wall time would be; the target is read on it
when the machine is shared). Three settings, one run:
  1 thread, quiet;  2 threads, quiet;  2 threads while a second process spins on one core (busy.py).
"lora_lab AdamW8bit" is its CPU default, the C step (lora_lab/kernels/cpu_adam8bit.py: one pass, one thread)
in its fastest body for this CPU; "C <body>" rows force the others (AVX2, plain C: $LORA_LAB_ADAM8BIT_PATH);
"PyTorch path" the same optimizer with backend="torch" (its reference, ~20 ops a chunk on one torch thread);
"PyTorch path, caller's threads" that path with its thread policy switched off (its ops on the caller's
intra-op threads, as before lora_lab.threads): the busy row measures what the policy prevents (slow when
busy: --no-callers-threads leaves it out).

Floors (the C step's AVX-512 body, where the CPU has it): one pass over the same weight's bytes with less
of the step's work (lora_lab_adam8bit_floor in kernels/cpu_adam8bit.c): its bytes alone; + Adam's arithmetic
(two divides and a square root a value, as torch's fused kernel); + the dequantization (table lookups by
permutes). The step adds the block absmax and the nearest codes: the rows say where its time goes.

GB/s: the bytes a step must move at least (parameter read and written, gradient read, state read and
written: 28 a parameter for fp32 AdamW, 16 + 1/16 for 8-bit) over its CPU time, beside a torch copy_ of
256 MiB on one thread (read + written), timed in the same rounds: the machine's copy bandwidth.
Torch's kernels run at its CPU capability (printed; ATEN_CPU_CAPABILITY=avx2 for an AVX2 run on an AVX-512
CPU, with LORA_LAB_ADAM8BIT_PATH=avx2 for lora_lab's side).

Targets (issue 44): lora_lab AdamW8bit at most 1.0x torch AdamW fused=True (1 thread, quiet, CPU time), and
with one core busy (2 threads) at most 2x its own quiet time.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
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


def other_bodies() -> list[str]:
    """The C step's bodies this CPU runs besides the one "lora_lab AdamW8bit" runs."""
    native = lora_lab.kernels.cpu_adam8bit
    return [body for body in native.paths() if body != native.chosen_path()] if native.paths() else []


def makers(use_torchao: bool, callers_threads: bool) -> dict:
    out = {
        "torch AdamW (fp32 state; torch's CPU default)": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "torch AdamW fused=True (fp32 state)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "lora_lab AdamW8bit": lambda ps: AdamW8bit(ps, lr=1e-3),
        **{f"lora_lab AdamW8bit, C {body}": lambda ps: AdamW8bit(ps, lr=1e-3) for body in other_bodies()},
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


@contextlib.contextmanager
def row_setting(name: str):
    """The step of the row `name` as it says: the PyTorch path with lora_lab.threads.one_thread switched off
    ("caller's threads"), the C step in the body it names ("C <body>")."""
    env = lora_lab.kernels.cpu_adam8bit.PATH_ENV
    before = os.environ.get(env)
    if ", C " in name:
        os.environ[env] = name.split(", C ")[1]
    try:
        policy_off = name.endswith("caller's threads")
        off = _patched(lora_lab.optim, "one_thread", contextlib.nullcontext)
        with off if policy_off else contextlib.nullcontext():
            yield
    finally:
        if before is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before


@contextlib.contextmanager
def _patched(module, name, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


CONTROL = "control: a fixed single-thread loop (no torch)"
FLOORS = ("floor: the 8-bit step's bytes alone (C, one pass)", "floor + Adam's arithmetic",
          "floor + Adam's arithmetic + dequantization")
COPY = "torch copy_ of 256 MiB, 1 thread (the copy bandwidth)"


class Floor:
    """One of the C step's floors (FLOORS: level 0, 1, 2) on its own weight, gradient and codes."""

    def __init__(self, level: int, w0: torch.Tensor, grad: torch.Tensor):
        self.level, self.p, self.g = level, w0.clone().reshape(-1), grad.reshape(-1)
        self.m, self.v = (torch.randint(0, 256, (self.p.numel(),), dtype=torch.uint8) for _ in range(2))
        self.maps = lora_lab.kernels.cpu_adam8bit._tables()[:2]

    def step(self) -> None:
        lib = lora_lab.kernels.cpu_adam8bit.library()
        ran = lib.lora_lab_adam8bit_floor(self.p.data_ptr(), self.g.data_ptr(), self.m.data_ptr(),
                                          self.v.data_ptr(), *(t.data_ptr() for t in self.maps),
                                          self.p.numel(), self.level)
        assert ran == self.level, "the floor did not run"


def floors(w0: torch.Tensor, grad: torch.Tensor) -> list:
    """(name, Floor) for each floor, where the C step has its AVX-512 body ([] elsewhere)."""
    native = lora_lab.kernels.cpu_adam8bit
    if "avx512" not in native.paths() or w0.numel() % 64:
        return []
    return [(name, Floor(level, w0, grad)) for level, name in enumerate(FLOORS)]


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
        with row_setting(name):
            opts[name].step()  # the first step makes the state (and compiles, for torchao)
        print(f"  first step of {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    src, dst = torch.randn(64 << 20), torch.empty(64 << 20)
    copy = type("Copy", (), {"step": lambda self: dst.copy_(src)})()
    extra = [*floors(w0, grad), (CONTROL, FixedWork()), (COPY, copy)]
    times: dict = {}
    for r in range(rounds):  # each round runs every setting: a change of the machine's load hits all alike
        for label, threads, busy in SETTINGS:
            torch.set_num_threads(threads)
            with one_core_busy() if busy else contextlib.nullcontext():
                print(f"  round {r + 1}, {label}: {machine_load()}", flush=True)
                for name, opt in [*opts.items(), *extra]:
                    with row_setting(name):
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
    native = lora_lab.kernels.cpu_adam8bit
    if native.library() is None:
        print("the C step cannot run here (its reason is logged): 'lora_lab AdamW8bit' is the PyTorch path")
    else:
        print(f"the C step's bodies on this CPU: {', '.join(native.paths())}; default {native.chosen_path()}")
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, one "
          f"{args.size}x{args.size} fp32 weight, {args.rounds} interleaved rounds per setting; "
          f"{machine_load()}", flush=True)
    opts, t = measure(args.size, args.rounds, args.torchao, not args.no_callers_threads)
    table(opts, t, args.size**2)
    for ours in ("lora_lab AdamW8bit", "lora_lab AdamW8bit, PyTorch path"):
        targets(t, ours, [s[0] for s in SETTINGS])
    fused = t["torch AdamW fused=True (fp32 state)", "cpu"]
    if (FLOORS[0], "cpu") in t:
        print("floors / torch AdamW fused=True, 1 thread, CPU time: "
              + "; ".join(f"{f}: {t[f, 'cpu'] / fused:.2f}" for f in FLOORS)
              + f"; the step: {t['lora_lab AdamW8bit', 'cpu'] / fused:.2f}")
    return 0


def table(opts: dict, t: dict, n: int) -> None:
    labels = [s[0] for s in SETTINGS]
    print(f"\n| optimizer | state bytes/param | {labels[0]}: CPU ms | GB/s (its bytes / CPU time) | "
          f"{' | '.join(labels)} | busy / its 2-thread quiet |")
    print("| --- | ---: |" + " ---: |" * (len(labels) + 3))
    for name, opt in opts.items():
        state = optimizer_state_bytes(opt) / n
        moved = n * (12 + 2 * state)  # param read and written, grad read, state read and written
        ms = " | ".join(f"{t[name, lab] * 1e3:.0f} ms" for lab in labels)
        rate = moved / t[name, "cpu"] / 1e9
        print(f"| {name} | {state:.3f} | {t[name, 'cpu'] * 1e3:.1f} ms | {rate:.1f} | "
              f"{ms} | {t[name, labels[2]] / t[name, labels[1]]:.2f} |")
    step_bytes = n * (12 + 2 * (1 + 4 / 256))  # the 8-bit step's (block size 256)
    rows = [(f, step_bytes) for f in FLOORS if (f, "cpu") in t]
    rows += [(CONTROL, None), (COPY, 2 * 4 * (64 << 20))]
    for row, moved in rows:
        ms = " | ".join(f"{t[row, lab] * 1e3:.0f} ms" for lab in labels)
        rate = f"{moved / t[row, 'cpu'] / 1e9:.1f}" if moved else ""
        print(f"| {row} | | {t[row, 'cpu'] * 1e3:.1f} ms | {rate} | {ms} | "
              f"{t[row, labels[2]] / t[row, labels[1]]:.2f} |")
    print()


def targets(t: dict, ours: str, labels: list) -> None:
    for ref in ("torch AdamW fused=True (fp32 state)", "torch AdamW (fp32 state; torch's CPU default)"):
        wall, quiet = t[ours, labels[0]] / t[ref, labels[0]], t[ours, "cpu"] / t[ref, "cpu"]
        verdict = f" (target <= 1.0: {'met' if quiet <= 1.0 else 'not met'})" if "fused" in ref else ""
        print(f"{ours} / {ref}, 1 thread, quiet: wall {wall:.2f}, CPU time {quiet:.2f}{verdict}")
    busy = t[ours, labels[2]] / t[ours, labels[1]]
    control = t[CONTROL, labels[2]] / t[CONTROL, labels[1]]
    print(f"{ours}, 2 threads, one core busy / 2 threads quiet: {busy:.2f} (target <= 2: "
          f"{'met' if busy <= 2.0 else 'not met'}); / its 1-thread quiet time: "
          f"{t[ours, labels[2]] / t[ours, labels[0]]:.2f}; / the control's busy ratio: {busy / control:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
