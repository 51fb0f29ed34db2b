"""The 8-bit Adam(W) step's C function (lora_lab/kernels/cpu_adam8bit.py): each of its bodies (AVX-512, AVX2,
plain C) bit for bit the PyTorch path's results where torch's fused Adam kernel rounds as it does (CPU
capability AVX2 or AVX512: both checked here, the other in a subprocess), within the rounding elsewhere
(DEFAULT, checked in a subprocess); the fallback where it cannot be built, and its cache."""

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

import lora_lab.functional.adam as adam_mod
from lora_lab import optim as optim_mod
from lora_lab.kernels import cpu_adam8bit as native
from lora_lab.optim import Adam8bit, AdamW8bit

needs_native = pytest.mark.skipif(native.library() is None, reason="no working C compiler here (logged why)")
CAPABILITY = torch.backends.cpu.get_cpu_capability()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]).clone()


def _run(cls, p0, grads, backend, **kw):
    p = nn.Parameter(p0.clone())
    opt = cls([p], lr=1e-2, backend=backend, **kw)
    for g in grads:
        p.grad = g.to(p.dtype)
        opt.step()
    state = opt.state[p]
    names = ("exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax")
    return [_bits(p)] + [_bits(state[k]) for k in names]


def _grads(n, steps, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4 * 1e-2  # heavy-tailed
        x[:256] = 0.0  # a block of zeros
        x[256:300] = 1e-41  # denormals
        x[300:304] = torch.tensor([1e18, -3e17, 1e-30, -0.0])  # huge (g^2 still finite) and tiny values
        x[-7:] = 0.0  # a ragged tail of zeros
        out.append(x)
    return out


def _assert_equal_or_within_rounding(ref, out, dtype, steps, lr=1e-2):
    """Bit for bit where torch's kernel rounds as the C step (native.EXACT_CAPABILITIES); elsewhere (no fused
    multiply-adds in torch's DEFAULT kernel) within that rounding: codes at most 1 apart in at most 1% of
    the values (a moment within an ulp of a midpoint), the parameter within 1% of lr a step (a moment one
    code apart moves the next update by one step of the map: measured 0.29% of lr a step) or 2 of its ulps
    (bf16). A wrong update is ~lr apart."""
    names = ["param", "m codes", "m absmax", "v codes", "v absmax"]
    if CAPABILITY in native.EXACT_CAPABILITIES:
        for name, a, b in zip(names, ref, out):
            assert torch.equal(a, b), f"{name}: {int((a != b).sum())} of {a.numel()} differ"
        return
    p_ref, p_out = ref[0].view(dtype).float(), out[0].view(dtype).float()
    ulp = (p_ref.abs() * 2.0 ** -7).clamp(min=1e-38) if dtype == torch.bfloat16 else 0.0
    apart = (p_ref - p_out).abs()
    assert bool((apart <= 1e-2 * lr * steps + 2 * ulp).all()), f"param {float(apart.max())} apart"
    for name, a, b in ((names[1], ref[1], out[1]), (names[3], ref[3], out[3])):
        apart = (a.int() - b.int()).abs()
        assert int(apart.max()) <= 1 and int((apart > 0).sum()) <= a.numel() // 100, f"{name} beyond rounding"


def _on_paths():
    """The C bodies to check: every one this CPU runs (all three on an x86-64 CPU with AVX-512)."""
    return [pytest.param(p, marks=pytest.mark.skipif(p not in native.paths(), reason=f"this CPU lacks {p}"))
            for p in native.PATHS]


@needs_native
@pytest.mark.parametrize("path", _on_paths())
@pytest.mark.parametrize("cls,kw", [(AdamW8bit, {}), (AdamW8bit, {"weight_decay": 0.0}),
                                    (Adam8bit, {"weight_decay": 0.1}), (Adam8bit, {"betas": (0.3, 0.99)}),
                                    (AdamW8bit, {"block_size": 100})])
@pytest.mark.parametrize("n,dtype", [(8192, torch.float32), (20_003, torch.float32), (6_151, torch.bfloat16)])
def test_bit_for_bit_the_pytorch_path(monkeypatch, path, cls, kw, n, dtype):
    """Codes, absmax (a zero block's +0.0 included) and the parameter equal the PyTorch path's exactly, over
    several steps, for each body: sizes that are and are not a whole number of blocks or of vectors, several
    chunks (chunks of 3 blocks: the PyTorch path pads each of them, 300 values with block_size 100, to keep
    torch's kernel off its scalar tail), fp32 and bf16 parameters, Adam with L2 decay, AdamW with and without
    decay, beta1 < 0.5 (lerp's other form)."""
    monkeypatch.setenv(native.PATH_ENV, path)
    if n != 8192:
        monkeypatch.setattr(adam_mod, "CHUNK_BLOCKS", 3)
    calls = []
    monkeypatch.setattr(optim_mod, "adam_step_", lambda *a: calls.append(1) or adam_mod.adam_step_(*a))
    p0 = (torch.randn(n) * 0.05).to(dtype)
    p0[:3] = torch.tensor([0.0, -0.0, 1e-40])
    grads = _grads(n, 3, seed=n)
    ref = _run(cls, p0, grads, "torch", **kw)
    assert len(calls) == 3  # the PyTorch path ran
    calls.clear()
    out = _run(cls, p0, grads, "auto", **kw)
    assert not calls  # the C step ran instead
    _assert_equal_or_within_rounding(ref, out, dtype, steps=3)


@needs_native
@pytest.mark.parametrize("capability", ["avx2", "avx512", "default"])
def test_each_torch_capability_in_a_subprocess(capability):
    """torch's fused Adam kernel as built for each x86 capability (ATEN_CPU_CAPABILITY, read at torch's
    start): AVX2 and AVX512 bit for bit, DEFAULT within its rounding; every body of the C step."""
    if capability == "avx512" and CAPABILITY != "AVX512":
        pytest.skip("torch cannot run its AVX512 kernels on this CPU")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONPATH": os.getcwd()}
    env.pop(native.PATH_ENV, None)
    code = ("import torch, sys, pytest; "
            f"assert torch.backends.cpu.get_cpu_capability() == {capability.upper()!r}; "
            f"sys.exit(pytest.main([{__file__!r}, '-q', '-x', '-p', 'no:cacheprovider', '-p', 'no:xdist', "
            "'-k', 'bit_for_bit and 20003']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout


def test_a_path_this_cpu_cannot_run_or_that_does_not_exist_is_refused(monkeypatch):
    monkeypatch.setenv(native.PATH_ENV, "sse9")
    with pytest.raises(native.NativePathError, match="sse9"):
        native.chosen_path()
    lacking = [p for p in native.PATHS if p not in native.paths()]
    if lacking:
        with pytest.raises(native.NativePathError, match=lacking[0]):
            native.chosen_path(lacking[0])
    assert native.chosen_path("plain") == "plain"  # every CPU runs the plain C


@pytest.mark.parametrize("signed,keep_nonzero", [(True, False), (False, True), (False, False)])
def test_the_packed_table_gives_the_rounding_tables_codes(signed, keep_nonzero):
    """The C's nearest-code lookup (its arithmetic, here in torch) equals blockwise.py's base[top16] + (y >
    threshold[top16]) at every threshold and its neighbours, the ends of every bucket, zeros and tiny
    values, for values in [-1, 1] (signed) or [0, 1]."""
    from lora_lab.functional.blockwise import rounding_tables

    base, thr = rounding_tables(signed, keep_nonzero)
    pack = native.packed_table(signed, keep_nonzero).long()
    tops = torch.arange(65536, dtype=torch.int64)
    at = thr.view(torch.int32).long() & 0xFFFFFFFF
    ends = torch.tensor([1, 2**31, 2**31 + 1])  # the smallest denormal, -0.0, its negative
    edges = torch.cat([tops << 16, tops << 16 | 0xFFFF, at - 1, at, at + 1, ends])
    y = (edges & 0xFFFFFFFF).to(torch.int64)
    y = torch.where(y >= 2**31, y - 2**32, y).to(torch.int32).view(torch.float32)
    y = y[y.isfinite() & (y.abs() <= 1) & ((y >= 0) | signed)]
    top = (y.view(torch.int32).long() >> 16) & 0xFFFF
    want = base.long()[top] + (y > thr[top]).long()
    u = y.view(torch.int32).long() & 0xFFFFFFFF
    mag = u & 0x7FFFFFFF
    r = mag - ((127 - native.PACK_BINADES) << 23)
    n = native.PACK_BINADES * 128 + 2
    i = torch.where(r < 0, 0, (r >> 16) + 1).clamp(max=n - 1) + torch.where(u >> 31 == 1, n, 0)
    cmp = torch.where(r < 0, (mag != 0).long(), r & 0xFFFF) ^ torch.where(u >> 31 == 1, 0xFFFF, 0)
    got = (pack[i] >> 16) + (cmp > (pack[i] & 0xFFFF)).long()
    assert y.numel() > 30_000 and torch.equal(got, want)


def _floats(signed: bool, mid: torch.Tensor) -> torch.Tensor:
    """A wide set of floats: every float32 within 512 ulps of each midpoint (the ties themselves included),
    every 8191st bit pattern of all 2^32, the ends of every top-16-bit bucket, and the edges: zeros, the
    smallest and largest denormals, 1, the largest float, infinities, NaNs of both signs; signed: their
    negatives too."""
    near = (mid.view(torch.int32).long()[:, None] + torch.arange(-512, 513)).reshape(-1)
    tops = torch.arange(65536, dtype=torch.int64) << 16
    edges = torch.tensor([0, 1, 0x007FFFFF, 0x00800000, 0x3F800000, 0x3F800001, 0x7F7FFFFF, 0x7F800000,
                          0x7FC00000, 0x7F800001])
    bits = torch.cat([near, torch.arange(0, 2**32, 8191), tops, tops | 0xFFFF, edges])
    bits = torch.cat([bits, bits ^ 2**31])  # the negatives (the unsigned map's included: its policy)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def _exact_codes(y: torch.Tensor, mid: torch.Tensor, keep_nonzero: bool) -> torch.Tensor:
    """The exact nearest code: the index of the first midpoint >= y (blockwise.py's rounding); keep_nonzero:
    a positive y at least 1; a NaN by its sign bit: 255, or 0 if set."""
    code = torch.bucketize(y, mid)
    if keep_nonzero:
        code = torch.where(y > 0, code.clamp(min=1), code)
    sign = y.view(torch.int32) < 0
    return torch.where(y.isnan(), torch.where(sign, 0, 255), code).to(torch.uint8)


def _scales():
    """(body, scale) pairs: the AVX-512 body's every way (see the test), the others' one divide."""
    out = []
    for p in native.PATHS:
        lacks = pytest.mark.skipif(p not in native.paths(), reason=f"this CPU lacks {p}")
        out += [pytest.param(p, s, marks=lacks) for s in ([1.0, 0.37, 2.0**-3, 3e-39, 7e35] if p == "avx512"
                                                          else [0.37])]
    return out


@needs_native
@pytest.mark.parametrize("path,scale", _scales())
@pytest.mark.parametrize("signed", [True, False])
def test_the_nearest_code_is_the_exact_argmin_for_every_float(path, signed, scale):
    """Each body's quantization (the AVX-512 one without a table lookup: lines, a permute and a multiply by
    1 / scale, redone by a divide near a midpoint) gives exactly the nearest map entry of x / scale, the
    lower at a tie, over a wide set of floats (_floats) and scales: 1 (y = x), one whose reciprocal is
    inexact, a power of two, a denormal and a huge one (the divide throughout). The step's own scale is the
    block's absmax (x / scale in [-1, 1]); beyond, every body still agrees with the exact rule."""
    from lora_lab.functional.blockwise import _midpoints

    mid = _midpoints(signed, torch.device("cpu"))
    x = _floats(signed, mid)
    got = native.nearest_codes(x, scale, signed, path)
    want = _exact_codes(x / scale, mid, keep_nonzero=not signed)
    wrong = (got != want).nonzero().reshape(-1)
    assert x.numel() > 1_000_000 and not wrong.numel(), (
        f"{wrong.numel()} wrong, e.g. x bits {x.view(torch.int32)[wrong[:3]].tolist()}: "
        f"{got[wrong[:3]].tolist()} for {want[wrong[:3]].tolist()}")


@needs_native
def test_state_dict_round_trip_between_the_paths():
    """The state is the same tensors either way: a checkpoint of one path resumes in the other exactly."""
    p0, grads = torch.randn(6000) * 0.1, _grads(6000, 4, seed=1)
    whole = _run(AdamW8bit, p0, grads, "auto")
    p = nn.Parameter(p0.clone())
    opt = AdamW8bit([p], lr=1e-2, backend="torch")
    for g in grads[:2]:
        p.grad = g
        opt.step()
    q = nn.Parameter(p.detach().clone())
    resumed = AdamW8bit([q], lr=1e-2)  # "auto": the C step
    resumed.load_state_dict(opt.state_dict())
    for g in grads[2:]:
        q.grad = g
        resumed.step()
    assert torch.equal(_bits(q), whole[0]) and torch.equal(_bits(resumed.state[q]["exp_avg"]), whole[1])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache folder holding the library, compiled once for this file's cache tests."""
    folder = tmp_path_factory.mktemp("native")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.CACHE_ENV, str(folder))
        native.library.cache_clear()
        native.library()
    native.library.cache_clear()
    return folder


@pytest.fixture
def fresh_library(tmp_path, monkeypatch):
    """library() forgotten before and after the test, its cache in tmp_path (empty)."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "native"))
    native.library.cache_clear()
    yield tmp_path / "native"
    native.library.cache_clear()


@pytest.fixture
def cached_library(built, fresh_library):
    """As fresh_library, with a copy of the compiled library (and its JSON) in the cache."""
    fresh_library.mkdir()
    for f in built.iterdir():
        shutil.copy2(f, fresh_library / f.name)
    return fresh_library


def test_no_compiler_falls_back_to_the_pytorch_path_with_one_logged_reason(fresh_library, monkeypatch,
                                                                               caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    p0, grads = torch.randn(5000), _grads(5000, 2, seed=2)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        out = _run(AdamW8bit, p0, grads, "auto")
    assert native.library() is None
    reasons = [r.getMessage() for r in caplog.records if r.name == native.__name__]
    assert len(reasons) == 1 and "PyTorch path" in reasons[0] and "/nonexistent/cc" in reasons[0]
    assert all(torch.equal(a, b) for a, b in zip(out, _run(AdamW8bit, p0, grads, "torch")))


@needs_native
def test_a_second_process_loads_the_cached_library(cached_library):
    fresh_library = cached_library
    before = native.compiled_here
    assert native.library() is not None and native.compiled_here == before  # read, not compiled
    (so,) = fresh_library.glob("*.so")
    mtime = so.stat().st_mtime_ns
    code = ("from lora_lab.kernels import cpu_adam8bit as n; assert n.library() is not None; "
            "print(n.compiled_here)")
    env = {**os.environ, native.CACHE_ENV: str(fresh_library), "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0" and so.stat().st_mtime_ns == mtime


@needs_native
@pytest.mark.parametrize("damage", ["other bytes", "another key", "not JSON", "writable by others"])
def test_a_cached_library_that_is_not_ours_is_compiled_again(cached_library, damage):
    """Nothing read from disk runs unless it is the library compiled from this source: its JSON (read as
    JSON) must hold this source's key and the sha256 of the library's bytes."""
    (so,), (meta,) = cached_library.glob("*.so"), cached_library.glob("*.json")
    assert native._trusted(so, meta, native.library_key())
    good = so.read_bytes()
    if damage == "other bytes":  # a new file (the loaded library's pages must not change under it)
        so.unlink()
        so.write_bytes(good[:-16] + b"\0" * 16)
    elif damage == "another key":
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "key": "0" * 64}))
    elif damage == "not JSON":
        meta.write_text("import os; os.system('echo no')")
    else:
        so.chmod(0o777)
    before = native.compiled_here
    assert not native._trusted(so, meta, native.library_key())
    native.library.cache_clear()
    assert native.library() is not None and native.compiled_here == before + 1
    assert native._trusted(so, meta, native.library_key())


@needs_native
def test_a_cache_that_cannot_be_written_still_gives_the_c_step(fresh_library, monkeypatch):
    blocker = fresh_library.parent / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "native"))
    before = native.compiled_here
    assert native.library() is not None and native.compiled_here == before + 1
