"""The 8-bit Adam(W) step on the CPU as one C function (cpu_adam8bit.c beside it), compiled at first use.

    cpu_adam8bit_step(param, grad, m, m_absmax, v, v_absmax, step, hp, path=None) -> bool
    nearest_codes(x, scale, signed, path=None) -> the codes the step gives x / scale (its quantization alone)
    library()   -> the loaded library, or None (then the reason was logged, once per process)
    paths()     -> the bodies this CPU runs, fastest first: "avx512", "avx2", "plain"
    cache_dir() -> $LORA_LAB_NATIVE_CACHE, else lora_lab's cache folder (fileio.cache_root()) / "native"

The PyTorch path (functional/adam.py's `adam_step_`) runs ~20 ops a chunk, each a pass over memory, six of
them table lookups; the C function does the whole update in one pass, block by block, on one thread (a
second thread gains little and collapses when another process keeps a core busy: lora_lab.threads). It has
three bodies of the same arithmetic: AVX-512 and AVX2 (x86-64, chosen at run time by what the CPU has) and
plain C the compiler vectorizes (any other CPU); $LORA_LAB_ADAM8BIT_PATH (or `path`) forces one. Each
rounds as torch's fused Adam kernel's vector body on AVX2 and AVX512 (the PyTorch path keeps torch's kernel
off its scalar tail), so its results equal the PyTorch path's bit for bit there
(tests/kernels/test_cpu_adam8bit.py, for both capabilities); where torch's kernel rounds otherwise (its
DEFAULT capability, other CPUs) they differ by its rounding. No C compiler, a failed compile or a tensor it
does not take: the PyTorch path runs.

The library is compiled by $CC (else `cc`) from the C source alone (no torch headers: ~1 s of CPU) into
the cache folder, keyed by a hash of the source and the flags; a second process loads it. Nothing read from
disk runs unless it is the library compiled here from this source: beside the library a JSON file (read as
JSON only) holds its key and the sha256 of its bytes; a library of another key, with other bytes, not owned
by this user or writable by others, is compiled again (written atomically, as every file of lora_lab).
Where the cache cannot be written, the library is compiled into a folder of the process (removed at exit).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

from ..errors import LoraLabError
from ..fileio import atomic_write_bytes, cache_root, parse_json
from ..functional.blockwise import dynamic_map, rounding_tables
from ..torch_private import is_fake

SOURCE = Path(__file__).with_name("cpu_adam8bit.c")
CACHE_ENV = "LORA_LAB_NATIVE_CACHE"
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c99", "-shared", "-fPIC")
PATH_ENV = "LORA_LAB_ADAM8BIT_PATH"
PATHS = {"avx512": 3, "avx2": 2, "plain": 1}  # the C's bodies, fastest first: its `path` codes
# torch CPU capabilities whose fused Adam kernel rounds as the C step (its vector body on every value, the
# PyTorch path padding its chunks): there the two agree bit for bit; elsewhere within the rounding
EXACT_CAPABILITIES = ("AVX2", "AVX512")
PACK_BINADES = 24  # the packed nearest-code table's buckets: |y| in [2^-24, 1], 128 a binade; below, one
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types whose data_ptr() is their memory
COMPILE_SECONDS = 120
log = logging.getLogger(__name__)
compiled_here = 0  # how many times this process compiled the library (a test reads it)


class NativeBuildError(LoraLabError, RuntimeError):
    """The C step could not be built or loaded here (its message is the reason logged)."""


class NativePathError(LoraLabError, ValueError):
    """$LORA_LAB_ADAM8BIT_PATH (or `path`) names a body that does not exist or that this CPU cannot run."""


def cache_dir() -> Path:
    """Where the compiled library is kept: $LORA_LAB_NATIVE_CACHE, else fileio.cache_root() / "native"."""
    env = os.environ.get(CACHE_ENV, "").strip()
    return Path(env).expanduser() if env else cache_root() / "native"


def library_key() -> str:
    """The hash the library's file is named by: the C source, the flags, the machine."""
    inputs = {"source": hashlib.sha256(SOURCE.read_bytes()).hexdigest(), "flags": FLAGS,
              "machine": platform.machine(), "system": platform.system()}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The C step, built or read from the cache once per process; None (reason logged once) if it cannot."""
    try:
        lib = ctypes.CDLL(str(_built_library()))
    except (NativeBuildError, OSError) as e:
        log.warning("lora_lab: the 8-bit Adam step runs its PyTorch path (slower): %s", e)
        return None
    f = lib.lora_lab_adam8bit_step
    f.restype = ctypes.c_int
    f.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4
                  + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int32] * 2 + [ctypes.c_void_p]
                  + [ctypes.c_double] * 6 + [ctypes.c_int] * 2)
    codes = lib.lora_lab_adam8bit_codes
    codes.restype = ctypes.c_int
    codes.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int] + [ctypes.c_void_p] * 2
                      + [ctypes.c_int32] * 2 + [ctypes.c_void_p, ctypes.c_int])
    floor = lib.lora_lab_adam8bit_floor  # benchmarks/bench_optim.py's floors
    floor.restype = ctypes.c_int
    floor.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_int]
    lib.lora_lab_adam8bit_paths.restype = ctypes.c_int
    lib.lora_lab_adam8bit_paths.argtypes = []
    return lib


def paths() -> list[str]:
    """The C step's bodies this CPU runs, fastest first ([] where the library cannot be built)."""
    lib = library()
    bits = lib.lora_lab_adam8bit_paths() if lib is not None else 0
    return [name for name, code in PATHS.items() if bits & (1 << code)]


def chosen_path(path: str | None = None) -> str:
    """The body the step runs: `path`, else $LORA_LAB_ADAM8BIT_PATH, else the fastest this CPU has; a name
    that is not a body, or one this CPU cannot run, is refused (NativePathError)."""
    name = path if path is not None else os.environ.get(PATH_ENV, "").strip() or None
    have = paths()
    if not have:
        raise NativeBuildError("the C step cannot be built here (its reason was logged)")
    if name is None:
        return have[0]
    if name not in PATHS:
        raise NativePathError(f"${PATH_ENV} (or path) must be one of {', '.join(PATHS)}, got {name!r}")
    if name not in have:
        raise NativePathError(f"${PATH_ENV} (or path) {name!r}: this CPU runs {', '.join(have)}")
    return name


def _built_library() -> Path:
    key = library_key()
    folder = cache_dir()
    so, meta = folder / f"adam8bit-{key[:40]}.so", folder / f"adam8bit-{key[:40]}.json"
    if _trusted(so, meta, key):
        return so
    data = _compile()
    record = json.dumps({"key": key, "sha256": hashlib.sha256(data).hexdigest()}).encode()
    try:
        atomic_write_bytes(so, data)
        atomic_write_bytes(meta, record)
    except OSError as e:  # a cache that cannot be written: this process's own folder, compiled each time
        log.warning("lora_lab: cannot keep the 8-bit step's compiled library in %s ($%s: %s); it is compiled "
                    "again in each process", folder, CACHE_ENV, e)
        folder = Path(tempfile.mkdtemp(prefix="lora_lab-native-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        so, meta = folder / so.name, folder / meta.name
        atomic_write_bytes(so, data)
        atomic_write_bytes(meta, record)
    if not _trusted(so, meta, key):
        raise NativeBuildError(f"{so}: the library just written does not read back as written")
    return so


def _trusted(so: Path, meta: Path, key: str) -> bool:
    """True if `so` is the library compiled from this source: its JSON holds this key and the sha256 of its
    bytes, and it is ours and writable only by us."""
    try:
        info = so.stat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return False
        if meta.stat().st_size > 4096:
            return False
        record = parse_json(str(meta), meta.read_bytes())
        return (isinstance(record, dict) and record.get("key") == key
                and record.get("sha256") == hashlib.sha256(so.read_bytes()).hexdigest())
    except (OSError, LoraLabError):
        return False


def _compile() -> bytes:
    """The library's bytes, compiled in a temporary folder by $CC (else cc)."""
    global compiled_here
    cc = shlex.split(os.environ.get("CC", "").strip() or "cc")
    with tempfile.TemporaryDirectory(prefix="lora_lab-native-") as tmp:
        out = Path(tmp) / "adam8bit.so"
        try:
            done = subprocess.run([*cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True,
                                  text=True, timeout=COMPILE_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeBuildError(f"no working C compiler ({' '.join(cc)}: {e})") from e
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise NativeBuildError(f"compiling {SOURCE.name} with {' '.join(cc)} failed: {' | '.join(tail)}")
        compiled_here += 1
        return out.read_bytes()


def _takes(param, grad, m, m_absmax, v, v_absmax, block_size: int) -> bool:
    """True for the tensors the C step takes: plain contiguous CPU tensors (not fake: a plan's), param fp32
    or bf16, grad fp32 or param's dtype, codes uint8 and absmax fp32 of the right sizes."""
    n = param.numel()
    n_blocks = -(-n // block_size) if block_size > 0 else -1
    tensors = (param, grad, m, m_absmax, v, v_absmax)
    return (all(type(t) in PLAIN and not is_fake(t) and t.device.type == "cpu" and t.is_contiguous()
                for t in tensors)
            and param.dtype in DTYPES and grad.dtype in (torch.float32, param.dtype) and grad.numel() == n
            and m.dtype == v.dtype == torch.uint8 and m.numel() == v.numel() == n
            and m_absmax.dtype == v_absmax.dtype == torch.float32
            and m_absmax.numel() == v_absmax.numel() == n_blocks and n > 0)


def packed_table(signed: bool, keep_nonzero: bool = False) -> torch.Tensor:
    """blockwise.py's nearest-code tables (`rounding_tables`) packed as the C reads them: int32 (2 n,), n =
    PACK_BINADES * 128 + 2 entries a sign, entry = base << 16 | t (see cpu_adam8bit.c). Entry 0 stands for
    every |y| < 2^-PACK_BINADES (asserted: they share one code, but for keep_nonzero's exact 0)."""
    return _packed(signed, keep_nonzero)


@functools.cache
def _packed(signed: bool, keep_nonzero: bool) -> torch.Tensor:
    base, thr = rounding_tables(signed, keep_nonzero)
    base, bits = base.long(), thr.view(torch.int32).long() & 0xFFFFFFFF
    first = (127 - PACK_BINADES) << 7  # the top 16 bits of 2^-PACK_BINADES
    n = PACK_BINADES * 128 + 2
    out = torch.empty(2 * n, dtype=torch.int64)
    for sign in (0, 1):
        tops = torch.arange(first, first + n - 1) | sign << 15
        finite = thr[tops].isfinite()
        assert bool((bits[tops] >> 16 == tops)[finite].all()), "a threshold outside its bucket"
        low = (bits[tops] & 0xFFFF) ^ (0xFFFF if sign else 0)  # a negative y's order reversed
        out[sign * n + 1: (sign + 1) * n] = base[tops] << 16 | torch.where(finite, low, 0xFFFF)
        below = torch.arange(first) | sign << 15
        code, inf = int(base[below[1]]), thr[below[1:]].isinf()
        assert bool((base[below[1:]] == code).all() and inf.all()), "tiny values that round apart"
        if thr[below[0]].isinf():
            assert int(base[below[0]]) == code, "tiny values that round apart"
            out[sign * n] = code << 16 | 0xFFFF
        else:  # keep_nonzero's bucket of +0.0: exactly 0 -> base, above -> base + 1
            assert sign == 0 and float(thr[below[0]]) == 0.0 and int(base[below[0]]) + 1 == code
            out[sign * n] = int(base[below[0]]) << 16
    return out.to(torch.int32)


@functools.cache
def _tables() -> tuple[torch.Tensor, ...]:
    """The maps and packed nearest-code tables of the PyTorch path (functional/blockwise.py)."""
    return (dynamic_map(True).contiguous(), dynamic_map(False).contiguous(), packed_table(True),
            packed_table(False, keep_nonzero=True))


def cpu_adam8bit_step(param, grad, m, m_absmax, v, v_absmax, step: int, hp, path: str | None = None) -> bool:
    """One Adam(W) step of `param` with 8-bit moments, in place, by the C function; False (nothing done) where
    it cannot run (no library, tensors it does not take): then run the PyTorch path. path: the body (PATHS),
    else $LORA_LAB_ADAM8BIT_PATH, else the fastest this CPU has."""
    if not _takes(param, grad, m, m_absmax, v, v_absmax, hp.block_size):
        return False
    lib = library()
    if lib is None:
        return False
    bs, n = hp.block_size, param.numel()
    scratch = torch.empty(4 * (bs + 16), dtype=torch.float32)
    ran = lib.lora_lab_adam8bit_step(
        param.data_ptr(), DTYPES[param.dtype], grad.data_ptr(), DTYPES[grad.dtype], m.data_ptr(),
        m_absmax.data_ptr(), v.data_ptr(), v_absmax.data_ptr(), n, bs, *(t.data_ptr() for t in _tables()),
        PACK_BINADES * 128 + 2, (127 - PACK_BINADES) << 23, scratch.data_ptr(), hp.lr, hp.beta1, hp.beta2,
        hp.eps, hp.weight_decay, float(step), int(hp.decoupled), PATHS[chosen_path(path)])
    assert ran > 0, "the C step refused a path chosen_path allowed"
    return True


def nearest_codes(x: torch.Tensor, scale: float, signed: bool, path: str | None = None) -> torch.Tensor:
    """The codes the C step's body `path` (else as cpu_adam8bit_step chooses) gives the values x / scale: its
    quantization alone, for the tests. signed: m's map, else v's (keep_nonzero); x: fp32 on the CPU."""
    lib = library()
    if lib is None:
        raise NativeBuildError("the C step cannot be built here (its reason was logged)")
    n = x.numel()
    padded = torch.zeros(n + 16, dtype=torch.float32)  # the AVX-512 body reads whole vectors
    padded[:n] = x.reshape(-1)
    out = torch.empty(n, dtype=torch.uint8)
    tables = _tables()
    map_, pack = (tables[0], tables[2]) if signed else (tables[1], tables[3])
    ran = lib.lora_lab_adam8bit_codes(padded.data_ptr(), n, scale, int(signed), map_.data_ptr(),
                                      pack.data_ptr(), PACK_BINADES * 128 + 2, (127 - PACK_BINADES) << 23,
                                      out.data_ptr(), PATHS[chosen_path(path)])
    assert ran > 0, "the C step refused a path chosen_path allowed"
    return out
