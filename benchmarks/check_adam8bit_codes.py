"""The C 8-bit step's nearest codes against blockwise.py's rounding for every one of the 2^32 float patterns.

    python benchmarks/check_adam8bit_codes.py [--path avx512] [--scales 1 0.37] [--chunk-bits 24]

For each map (m's signed one; v's unsigned one with keep_nonzero) and each scale s, every float x (all 2^32
bit patterns, in chunks) gets the codes of body `--path` (lora_lab.kernels.cpu_adam8bit.nearest_codes: x / s
as the step quantizes it) and blockwise.py's: base[top16(y)] + (y > threshold[top16(y)]) for y = x / s in
fp32 (its tables' rule, exact for every finite y), an infinity the end of its sign (the nearest entry), a NaN
by its sign (255, or 0 when set). s = 1: y = x, the search alone; s = 0.37: 1 / s inexact, the
AVX-512 body's y = x * (1 / s) and its redo by x / s near a midpoint. Prints the number of codes that
differ (0 expected) and, for the AVX-512 body's search (codes16 in cpu_adam8bit.c), how far the fp32
midpoints lie from integer line positions: below 0.5, the position rounded is the count of midpoints below y
or one less, and one compare decides. About 5 minutes of CPU a body on one thread.
"""

from __future__ import annotations

import argparse
import time

import torch

from lora_lab.functional.blockwise import _midpoints, rounding_tables
from lora_lab.kernels import cpu_adam8bit as native


def reference(x: torch.Tensor, scale: float, signed: bool) -> torch.Tensor:
    """blockwise.py's codes of x / scale (quantize_blocks' rounding, keep_nonzero for the unsigned map); the
    non-finite by their sign."""
    base, thr = rounding_tables(signed, keep_nonzero=not signed)
    y = x / scale if scale != 1.0 else x
    top = (y.view(torch.int32) >> 16) & 0xFFFF
    codes = base.index_select(0, top).add_(y > thr.index_select(0, top))
    other = (~y.isfinite()).nonzero().reshape(-1)  # NaN and infinities (their buckets hold NaNs)
    codes[other] = torch.where(y[other].view(torch.int32) < 0, 0, 255).to(torch.uint8)
    return codes


def line_offsets(signed: bool) -> float:
    """The largest distance of an fp32 midpoint's line position T(mid_k) (the least of the decades' lines,
    in float64) from its index k: codes16 rounds y's position to k and needs this below 0.5."""
    mid = _midpoints(signed, torch.device("cpu")).double()
    if signed:
        mid = mid[127:]
    lines = []
    for i in range(7):
        n = 2.0**i if signed else 2.0 ** (i + 1)
        c = n - 1.0 if signed else n - 2.0
        lines.append(n / (0.9 * 10.0 ** (i - 6)) * mid + c - n / 9.0)
    t = torch.stack(lines).amin(0)
    return float((t - torch.arange(mid.numel(), dtype=torch.float64)).abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default="avx512", choices=list(native.PATHS))
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.37])
    ap.add_argument("--chunk-bits", type=int, default=24)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"body {native.chosen_path(args.path)}, scales {args.scales}")
    for signed in (True, False):
        print(f"{'signed' if signed else 'unsigned'} map: the midpoints' line positions within "
              f"{line_offsets(signed):.3f} of their index (codes16 needs < 0.5)")
    step, wrong, t0 = 1 << args.chunk_bits, 0, time.perf_counter()
    for scale in args.scales:
        for signed in (True, False):
            bad = 0
            for start in range(0, 1 << 32, step):
                first = start - 2**32 if start >= 2**31 else start  # the chunk's bits as int32
                x = torch.arange(first, first + step, dtype=torch.int32).view(torch.float32)
                got = native.nearest_codes(x, scale, signed, args.path)
                differ = (got != reference(x, scale, signed)).nonzero().reshape(-1)
                if differ.numel() and not bad:
                    print(f"  e.g. x bits {hex(start + int(differ[0]))}: {int(got[differ[0]])}")
                bad += differ.numel()
            wrong += bad
            print(f"scale {scale}, {'signed' if signed else 'unsigned'}: {bad} of 2^32 codes differ "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print("all codes equal blockwise.py's" if not wrong else f"{wrong} codes differ")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
