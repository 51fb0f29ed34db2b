"""Adversarial LoRA files and merge inputs: each finding of issue 12 (items 1-4, 11) as a test, and a seeded
fuzz test.

Every bad input must give the project's `LoraFormatError` naming the file and the key (or module), in bounded
time and memory; nothing may escape as a RecursionError, TypeError, StopIteration, ZeroDivisionError, or hang.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import struct
import threading

import pytest
import torch
from torch import nn

from lora_lab.formats import LoraFile, LoraFormatError, LoraWeights, convert_lora, load_lora, save_lora
from lora_lab.merge import apply_loras, merge_loras, save_merged

Q = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
CONV = "unet.down_blocks.0.resnets.0.conv1"
KQ = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"


@contextlib.contextmanager
def time_limit(seconds: float):
    """Fail (raise TimeoutError) if the block runs longer than `seconds` (SIGALRM: main thread, POSIX)."""

    def expired(signum, frame):
        raise TimeoutError(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def small_lora(seed: int = 0, dora: bool = True) -> LoraFile:
    g = torch.Generator().manual_seed(seed)
    lin = LoraWeights(torch.randn(4, 64, generator=g) * 0.1, torch.randn(64, 4, generator=g) * 0.1, alpha=2.0,
                     dora_scale=torch.rand(64, 1, generator=g) + 0.5 if dora else None)
    conv = LoraWeights(torch.randn(2, 32, 3, 3, generator=g) * 0.1,
                       torch.randn(32, 2, 1, 1, generator=g) * 0.1, alpha=2.0)
    return LoraFile({Q: lin, CONV: conv})


def base_state(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {Q.removeprefix("unet.") + ".weight": torch.randn(64, 64, generator=g),
            CONV.removeprefix("unet.") + ".weight": torch.randn(32, 32, 3, 3, generator=g)}


def raw_file(path, header, data: bytes = b"", length: int | None = None):
    """A file with the given header (a dict, dumped as JSON, or bytes as they are) and data section."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head) if length is None else length) + head + data)
    return path


def header_of(path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


# ----------------------------------------------------------------------------- item 1: header and metadata


F32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
HEADERS = {  # case -> (header, data, what the error must say after the file name)
    "deep_nesting": (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", "nested too deeply"),
    "huge_int": ({"k.alpha": {**F32, "data_offsets": [0, 10**40]}}, b"\0" * 16,
                 "key 'k.alpha': data_offsets"),
    "huge_int_4300_digits": (b'{"k.alpha":{"dtype":"F32","shape":[' + b"9" * 5000
                             + b'],"data_offsets":[0,4]}}',
                             b"\0" * 4, "key 'k.alpha': shape"),
    "offsets_null": ({"k.alpha": {**F32, "data_offsets": None}}, b"\0" * 16,
                     "key 'k.alpha': data_offsets None"),
    "offsets_string": ({"k.alpha": {**F32, "data_offsets": "0,16"}}, b"\0" * 16,
                       "key 'k.alpha': data_offsets"),
    "offsets_one_number": ({"k.alpha": {**F32, "data_offsets": [16]}}, b"\0" * 16,
                           "key 'k.alpha': data_offsets"),
    "offsets_object": ({"k.alpha": {**F32, "data_offsets": {"a": 0}}}, b"\0" * 16,
                       "key 'k.alpha': data_offsets"),
    "offsets_reversed": ({"k.alpha": {**F32, "data_offsets": [16, 0]}}, b"\0" * 16,
                         "key 'k.alpha': data_offsets"),
    "offsets_wrong_size": ({"k.alpha": {**F32, "data_offsets": [0, 12]}}, b"\0" * 16,
                           "key 'k.alpha': .*needs 16"),
    "offsets_overlap": ({"a.alpha": F32, "b.alpha": F32}, b"\0" * 32,
                        "key 'b.alpha': data_offsets begin at 0"),
    "trailing_bytes": ({"k.alpha": F32}, b"\0" * 20, "4 bytes after the last tensor"),
    "shape_negative": ({"k.alpha": {**F32, "shape": [-2, -2]}}, b"\0" * 16, "key 'k.alpha': shape"),
    "shape_bool": ({"k.alpha": {**F32, "shape": [True, 4]}}, b"\0" * 16, "key 'k.alpha': shape"),
    "dtype_unknown": ({"k.alpha": {**F32, "dtype": "F128"}}, b"\0" * 16, "key 'k.alpha': dtype 'F128'"),
    "dtype_not_string": ({"k.alpha": {**F32, "dtype": 7}}, b"\0" * 16, "key 'k.alpha': dtype 7"),
    "entry_not_object": ({"k.alpha": [1, 2]}, b"", "key 'k.alpha': a tensor entry"),
    "entry_extra_field": ({"k.alpha": {**F32, "x": 1}}, b"\0" * 16, "key 'k.alpha': a tensor entry"),
    "metadata_not_strings": ({"__metadata__": {"a": 1}, "k.alpha": F32}, b"\0" * 16, "key '__metadata__'"),
    "metadata_list": ({"__metadata__": [1], "k.alpha": F32}, b"\0" * 16, "key '__metadata__'"),
    "metadata_zero": ({"__metadata__": 0, "k.alpha": F32}, b"\0" * 16, "key '__metadata__'"),
    "repeated_key": ((b'{"k.alpha":{"dtype":"F32","shape":[],"data_offsets":[0,4]},'
                      b'"k.alpha":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}'), b"\0" * 4,
                     "'k.alpha' appears twice"),
    "header_not_object": (b"[1, 2, 3]", b"", "not a JSON object"),
    "header_not_utf8": (b'{"\xff\xfe": 1}', b"", "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_malformed_header_names_the_file_and_the_key(tmp_path, case):
    header, data, said = HEADERS[case]
    path = raw_file(tmp_path / f"{case}.safetensors", header, data)
    with time_limit(5), pytest.raises(LoraFormatError, match=f"{case}.safetensors: .*{said}"):
        load_lora(path)


def test_header_length_beyond_the_file_or_limit(tmp_path):
    for name, length in (("long", 10**6), ("huge", 2**63)):
        path = raw_file(tmp_path / f"{name}.safetensors", b"{}", length=length)
        with pytest.raises(LoraFormatError, match=f"{name}.safetensors: not a safetensors file"):
            load_lora(path)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"abc")  # shorter than the length field: said so
    with pytest.raises(LoraFormatError, match=r"short.safetensors: not a safetensors file \(3 bytes"):
        load_lora(short)


def test_a_file_mixing_kohya_and_peft_names(tmp_path):
    path = save_lora(tmp_path / "k.safetensors", small_lora())
    header, data = header_of(path)
    header["unet.conv_in.lora_A.weight"] = header.pop(f"{KQ}.lora_down.weight")
    mixed = raw_file(tmp_path / "mixed.safetensors", header, data)
    with pytest.raises(LoraFormatError,
                       match=r"mixed.safetensors: mixes kohya names .* and PEFT names \('unet.conv_in"):
        load_lora(mixed)


def peft_file(tmp_path, name: str, adapter) -> str:
    """small_lora as a PEFT file whose lora_adapter_metadata is `adapter` (a JSON value, or raw text)."""
    path = save_lora(tmp_path / f"{name}.peft.safetensors", small_lora(dora=False), format="peft")
    header, data = header_of(path)
    header["__metadata__"]["lora_adapter_metadata"] = (adapter if isinstance(adapter, str)
                                                       else json.dumps(adapter))
    return raw_file(tmp_path / f"{name}.safetensors", header, data)


PEFT_META = {  # case -> (adapter metadata, what the error must say)
    "not_object": ([1, 2], "must be a JSON object, got list"),
    "alpha_null": ({"unet.lora_alpha": None}, "key 'unet.lora_alpha': must be a finite number > 0, got None"),
    "alpha_string": ({"unet.lora_alpha": "2"}, "key 'unet.lora_alpha'.*got '2'"),
    "alpha_list": ({"unet.lora_alpha": [2]}, "key 'unet.lora_alpha'.*got \\[2\\]"),
    "alpha_zero": ({"unet.lora_alpha": 0}, "key 'unet.lora_alpha'.*got 0"),
    "alpha_negative": ({"unet.lora_alpha": -2.0}, "key 'unet.lora_alpha'.*got -2.0"),
    "alpha_bool": ({"unet.lora_alpha": True}, "key 'unet.lora_alpha'.*got True"),
    "alpha_huge_int": ('{"unet.lora_alpha": ' + "9" * 5000 + "}", "key 'unet.lora_alpha'.*got '999"),
    "alpha_pattern_list": ({"unet.lora_alpha": 2, "unet.alpha_pattern": ["to_q"]},
                           "key 'unet.alpha_pattern': must be an object"),
    "alpha_pattern_nan": ('{"unet.lora_alpha": 2, "unet.alpha_pattern": {"to_q": NaN}}',
                          "alpha_pattern\\['to_q'\\].*got nan"),
    "rslora_string": ({"unet.lora_alpha": 2, "unet.use_rslora": "yes"},
                      "key 'unet.use_rslora': must be true or false"),
    "deep": ('{"a":' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    "not_json": ("{unet.lora_alpha: 2", "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(PEFT_META))
def test_malformed_peft_adapter_metadata_names_the_file_and_the_key(tmp_path, case):
    adapter, said = PEFT_META[case]
    path = peft_file(tmp_path, case, adapter)
    with time_limit(5), pytest.raises(LoraFormatError,
                                      match=f"{case}.safetensors: metadata 'lora_adapter_metadata'.*{said}"):
        load_lora(path)


def test_rslora_without_r_uses_the_tensors_rank(tmp_path):
    """`r` missing (or wrong) does not matter: rsLoRA's sqrt(r) is the rank of the weights in the file."""
    path = peft_file(tmp_path, "rs", {"unet.lora_alpha": 3.0, "unet.use_rslora": True, "unet.r": -1})
    lf = load_lora(path)
    assert (lf.modules[Q].scale == pytest.approx(3.0 / math.sqrt(4))
            and lf.modules[CONV].scale == pytest.approx(3.0 / math.sqrt(2)))


def test_float8_weights_are_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "fp8.safetensors"
    save_file({f"{KQ}.lora_down.weight": torch.ones(4, 64).to(torch.float8_e4m3fn),
               f"{KQ}.lora_up.weight": torch.ones(64, 4).to(torch.float8_e4m3fn)}, str(path))
    with pytest.raises(LoraFormatError,
                       match=f"fp8.safetensors: module '{KQ}': down has dtype torch.float8_e4m3fn"):
        load_lora(path)


# --------------------------------------------------------------------- item 2: no pattern can hang the reader


def test_pattern_keys_match_module_names_by_suffix(tmp_path):
    """As PEFT matches a name: the key equals the module's path or ends it after a dot; escaped or not."""
    to_q = Q.removeprefix("unet.")
    path = peft_file(tmp_path, "pat", {"unet.lora_alpha": 1.0,
                                       "unet.alpha_pattern": {"attn1\\.to_q": 5.0, "conv1": 7.0, "v1": 9.0}})
    lf = load_lora(path)
    assert lf.modules[Q].alpha == 5.0 and lf.modules[CONV].alpha == 7.0  # "v1" ends no name after a dot
    path = peft_file(tmp_path, "pat2", {"unet.lora_alpha": 1.0, "unet.alpha_pattern": {to_q: 4.0}})
    assert load_lora(path).modules[Q].alpha == 4.0


@pytest.mark.parametrize("pattern", ["(.*)*b", "(a+)+$", "(x|x)*y", "^unet.*"])
def test_a_regex_pattern_is_refused_at_once(tmp_path, pattern):
    """`(.*)*b` against a long name backtracks for ever in `re`; lora_lab reads no regex, so it cannot
    hang."""
    path = peft_file(tmp_path, "evil", {"unet.lora_alpha": 1.0, "unet.alpha_pattern": {pattern: 2.0}})
    with time_limit(2), pytest.raises(LoraFormatError,
                                      match="evil.safetensors: .*alpha_pattern.*is not a module name"):
        load_lora(path)


# ----------------------------------------------------------------------------- item 3: rank, alpha, strength


def kohya_raw(path, down, up, alpha=None):
    from safetensors.torch import save_file

    t = {f"{KQ}.lora_down.weight": down, f"{KQ}.lora_up.weight": up}
    if alpha is not None:
        t[f"{KQ}.alpha"] = torch.tensor(alpha)
    save_file(t, str(path))
    return path


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_alpha_is_refused_at_load(tmp_path, alpha):
    path = kohya_raw(tmp_path / "alpha.safetensors", torch.ones(4, 64), torch.ones(64, 4), alpha)
    with pytest.raises(LoraFormatError, match=f"alpha.safetensors: module '{KQ}': alpha is {alpha}"):
        load_lora(path)


def test_rank_zero_is_refused_at_load(tmp_path):
    path = kohya_raw(tmp_path / "r0.safetensors", torch.ones(0, 64), torch.ones(64, 0), 1.0)
    with pytest.raises(LoraFormatError, match=f"r0.safetensors: module '{KQ}': rank 0"):
        load_lora(path)


@pytest.mark.parametrize("strength", [float("nan"), float("inf"), -float("inf"), True, "1"])
def test_non_finite_strength_is_refused_by_merge_and_apply(tmp_path, strength):
    path = save_lora(tmp_path / "s.safetensors", small_lora())
    with pytest.raises(LoraFormatError, match=r"s.safetensors: strength .* must be a finite number"):
        merge_loras(base_state(), [(path, 0.5), (path, strength)])
    model = nn.Linear(2, 2)
    with pytest.raises(LoraFormatError, match=r"s.safetensors: strength .* must be a finite number"):
        apply_loras(model, [(path, strength)], component="unet", strict=False)


@pytest.mark.parametrize("case", ["nan", "inf"])
def test_non_finite_weights_never_reach_a_merged_file(tmp_path, case):
    """Values are read where they are used: inspecting the file works, merging, applying or converting it does
    not."""
    path = save_lora(tmp_path / "ok.safetensors", small_lora())
    header, data = header_of(path)
    values = bytearray(data)
    entry = header[f"{KQ}.lora_up.weight"]
    start = entry["data_offsets"][0] + 4 * (3 * 4 + 1)
    values[start:start + 4] = struct.pack("<f", float(case))
    path = raw_file(tmp_path / f"{case}.safetensors", header, bytes(values))
    assert "r=4" in load_lora(path).summary()  # the header is fine
    said = f"{case}.safetensors: module '{KQ}': up holds NaN or Inf"
    with pytest.raises(LoraFormatError, match=said):
        merge_loras(base_state(), [(path, 1.0)])
    with pytest.raises(LoraFormatError, match=said):
        convert_lora(path, tmp_path / "out.safetensors", to="peft")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_merge_that_overflows_is_refused_and_writes_nothing(tmp_path):
    path = save_lora(tmp_path / "big.safetensors", small_lora(dora=False))
    base = {k: v.half() for k, v in base_state().items()}
    merged = merge_loras(base, [(path, 1e30)])
    with pytest.raises(LoraFormatError, match="big.safetensors: module .* at strength 1e\\+30 "
                                              "the change to .* is not finite|overflows"):
        save_merged(merged, tmp_path / "merged.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


# ----------------------------------------------------------------------------- item 4: no silent loss


def flux_file(path, name: str, out: int, inp: int = 8):
    from safetensors.torch import save_file

    save_file({f"lora_unet_{name}.lora_down.weight": torch.ones(2, inp),
               f"lora_unet_{name}.lora_up.weight": torch.ones(out, 2),
               f"lora_unet_{name}.alpha": torch.tensor(2.0)}, str(path),
              metadata={"ss_base_model_version": "flux1"})
    return path


@pytest.mark.parametrize(("name", "out"), [("final_layer_adaLN_modulation_1", 9),
                                           ("double_blocks_0_img_attn_qkv", 10),
                                           ("single_blocks_0_linear1", 15)])
def test_fused_rows_that_do_not_divide_evenly_are_an_error(tmp_path, name, out):
    path = flux_file(tmp_path / "odd.safetensors", name, out)
    with pytest.raises(LoraFormatError, match=f"odd.safetensors: module 'lora_unet_{name}': "
                                              f".*{out} outputs does not split"):
        load_lora(path)


def test_two_keys_for_one_module_are_an_error(tmp_path):
    """The same conv under its diffusers name and its LDM name (kohya's SDXL layout): an error, not one
    dropped."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(save_lora(tmp_path / "k.safetensors", small_lora(dora=False), base="sd15")))
    for suffix in (".lora_down.weight", ".lora_up.weight", ".alpha"):
        tensors[f"lora_unet_input_blocks_1_0_in_layers_2{suffix}"] = tensors[
            f"lora_unet_down_blocks_0_resnets_0_conv1{suffix}"].clone()
    save_file(tensors, str(tmp_path / "dup.safetensors"))
    with pytest.raises(LoraFormatError, match="dup.safetensors: keys 'lora_unet_.*' and 'lora_unet_.*' "
                                              "are both module 'unet.down_blocks.0.resnets.0.conv1'"):
        load_lora(tmp_path / "dup.safetensors")



@pytest.mark.parametrize("module", ["unet", "text_encoder", "unet.", "lora_unet_", "lora_te_text_model_",
                                    "lora_unet_down_blocks__1"])
def test_a_key_that_names_no_module_is_an_error(tmp_path, module):
    """A component with no module path (PEFT `unet.lora_A.weight` was an IndexError in convert and merge), a
    kohya prefix with nothing after it, an empty path segment: LoraFormatError naming the key, in every
    command."""
    from safetensors.torch import save_file

    a, b = ((".lora_down.weight", ".lora_up.weight") if module.startswith("lora_")
            else (".lora_A.weight", ".lora_B.weight"))
    save_file({module + a: torch.ones(2, 64), module + b: torch.ones(64, 2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(LoraFormatError, match=f"x.safetensors: key '{module}' names no module of"):
        load_lora(tmp_path / "x.safetensors")
    with pytest.raises(LoraFormatError, match="names no module of"):
        merge_loras(base_state(), [(tmp_path / "x.safetensors", 1.0)])

# ----------------------------------------------------------------------------- item 11: bounded memory


def anon_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024


class PeakAnon:
    """Highest RssAnon (private, not file-backed memory) seen while the block runs, sampled every
    millisecond."""

    def __enter__(self):
        self.start = self.peak = anon_mib()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, anon_mib())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, anon_mib())

    @property
    def grew(self) -> float:
        return self.peak - self.start


def big_lora(path, mib: int) -> LoraFile:
    """A valid kohya file of about `mib` MiB: 8 modules of rank 64 (fp32)."""
    n = mib * 2**20 // (8 * 2 * 64 * 4)
    mods = {f"unet.down_blocks.0.attentions.0.transformer_blocks.{i}.attn1.to_q":
            LoraWeights(torch.full((64, n), 0.01), torch.full((n, 64), 0.01), 8.0) for i in range(8)}
    save_lora(path, LoraFile(mods), base="sd15")
    return path


def test_a_large_file_is_inspected_and_converted_in_bounded_memory(tmp_path):
    """64 MiB file: load + summary reads the header only; convert streams one tensor at a time
    (each 4 MiB)."""
    path = big_lora(tmp_path / "big.safetensors", 64)
    assert path.stat().st_size > 64 * 2**20
    with PeakAnon() as inspect:
        lf = load_lora(path)
        text = lf.summary()
    assert "r=64" in text and len(lf.modules) == 8
    with PeakAnon() as convert:
        convert_lora(path, tmp_path / "big_peft.safetensors", to="peft")
    print(f"peak extra private memory: inspect {inspect.grew:.1f} MiB, convert {convert.grew:.1f} MiB")
    assert inspect.grew < 8  # a copy of the file would be 64
    assert convert.grew < 16  # safetensors.torch.save builds the whole file in memory: > 64
    back = load_lora(tmp_path / "big_peft.safetensors")
    assert torch.equal(back.modules[next(iter(back.modules))].down, lf.modules[next(iter(lf.modules))].down)


# ----------------------------------------------------------------------------- fuzz


def nested_modules(weights: dict[str, torch.Tensor]) -> nn.Module:
    """A model whose state dict has exactly these weights (nn.Linear / nn.Conv2d at their paths)."""
    root = nn.Module()
    for key, w in weights.items():
        *parents, leaf = key.removesuffix(".weight").split(".")
        node = root
        for p in parents:
            if not hasattr(node, p):
                node.add_module(p, nn.Module())
            node = getattr(node, p)
        layer = (nn.Linear(w.shape[1], w.shape[0], bias=False) if w.dim() == 2
                 else nn.Conv2d(w.shape[1], w.shape[0], w.shape[2], bias=False))
        layer.weight.data.copy_(w)
        node.add_module(leaf, layer)
    return root


ODD_VALUES = [None, "x", -1, 0, 2**70, 1e308, -1e308, True, [], {}, [0], [0, 1, 2], [1, 0], {"a": 1}, "NaN",
              [[[[1]]]]]


def mutate(rng: random.Random, raw: bytes) -> bytes:
    """One random change to a safetensors file: bytes, length, header JSON, metadata JSON or tensor values."""
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = bytearray(raw[8 + n:])
    kind = rng.choice(["flip", "flip_header", "truncate", "append", "length", "field", "metadata", "rename",
                       "values"])
    if kind in ("flip", "flip_header"):
        out = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(8, 8 + n) if kind == "flip_header" else rng.randrange(len(out))
            out[i] = rng.randrange(256)
        return bytes(out)
    if kind == "truncate":
        return raw[: rng.randrange(len(raw))]
    if kind == "append":
        return raw + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    if kind == "length":
        return struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, n + 8, 2**40, 2**64 - 1])) + raw[8:]
    keys = [k for k in header if k != "__metadata__"]
    if kind == "field":
        entry = header[rng.choice(keys)]
        entry[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice(
            ODD_VALUES + ["F16", "BF16", "F8_E4M3", "I64"])
    elif kind == "metadata":
        meta = header.setdefault("__metadata__", {})
        if "lora_adapter_metadata" in meta and rng.random() < 0.7:
            adapter = json.loads(meta["lora_adapter_metadata"])
            adapter[rng.choice(sorted(adapter) + ["unet.alpha_pattern"])] = rng.choice(
                ODD_VALUES + [{"to_q": 2.0}, {"(.*)*b": 1.0}, {"attn1\\.to_q": -1}])
            meta["lora_adapter_metadata"] = json.dumps(adapter)
        else:
            meta[rng.choice(sorted(meta) + ["lora_adapter_metadata", "ss_base_model_version"])] = rng.choice(
                ["", "{", "[]", "sdxl", "flux1", '{"unet.lora_alpha": null}', "x" * 1000])
    elif kind == "rename":
        k = rng.choice(keys)
        new = rng.choice([k.replace("lora_up", "lora_down"), k.replace("lora_", "lora_te1_"), k.upper(),
                          "unet." + k, k.replace("to_q", "to_k"), k + ".alpha", k.replace("_", ".")])
        header[new] = header.pop(k)
    else:  # values: NaN / Inf / huge numbers written over random tensor bytes
        entry = header[rng.choice(keys)]
        b, e = entry["data_offsets"]
        if e - b >= 4:
            i = b + 4 * rng.randrange((e - b) // 4)
            data[i:i + 4] = struct.pack("<f", rng.choice([float("nan"), float("inf"), 3e38, -3e38, 1e-45]))
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + bytes(data)


def exercise(path, out_dir) -> str:
    """Everything a user does with a file: load, inspect, convert both ways, merge (and save), apply both
    modes."""
    lf = load_lora(path)
    lf.summary()
    for fmt in ("kohya", "peft"):
        load_lora(convert_lora(path, out_dir / f"conv.{fmt}.safetensors", to=fmt))
    weights = base_state()
    merged = merge_loras(weights, [(path, 0.7)], component="unet", strict=False)
    save_merged(merged, out_dir / "merged.safetensors")
    assert all(torch.isfinite(merged[k]).all() for k in merged.patched)
    for mode in ("merge", "runtime"):
        apply_loras(nested_modules(weights), [(path, 0.7)], mode=mode, component="unet", strict=False)
    return "ok"


# more for a longer search: LORA_LAB_FUZZ_CASES=4000
FUZZ_CASES = int(os.environ.get("LORA_LAB_FUZZ_CASES", "300"))


def test_fuzz_mutated_lora_files_give_success_or_lora_format_error(tmp_path):
    """Seeded mutants of a kohya (DoRA) and a PEFT file lora_lab wrote: each ends in success or
    LoraFormatError, within 2 s; never another exception, a hang, or a merged weight that is not finite."""
    import warnings

    rng = random.Random(12)
    originals = [save_lora(tmp_path / "orig_k.safetensors", small_lora(), base="sd15").read_bytes(),
                 save_lora(tmp_path / "orig_p.safetensors", LoraFile({**small_lora(dora=False).modules}),
                           format="peft").read_bytes()]
    outcomes: dict[str, int] = {}
    for case in range(FUZZ_CASES):
        raw = mutate(rng, rng.choice(originals))
        path = tmp_path / "mutant.safetensors"
        path.write_bytes(raw)
        try:
            with time_limit(2), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outcome = exercise(path, tmp_path)
        except LoraFormatError as e:
            outcome = "LoraFormatError"
            assert ".safetensors" in str(e), f"case {case}: the error names no file: {e}"
        except Exception as e:  # noqa: BLE001 (the point of the test)
            pytest.fail(f"case {case}: {type(e).__name__}: {e}")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(outcomes)
    assert sum(outcomes.values()) == FUZZ_CASES
    assert outcomes.get("ok", 0) > FUZZ_CASES // 30 and outcomes.get("LoraFormatError", 0) > FUZZ_CASES // 3


def test_two_modules_for_one_weight_are_an_error():
    """One by its path, one by its kohya spelling (as ComfyUI matches): both would change `a.b.weight`."""
    from lora_lab.formats import match_modules

    g = torch.Generator().manual_seed(3)
    m = LoraWeights(torch.randn(2, 4, generator=g), torch.randn(4, 2, generator=g), 2.0)
    lf = LoraFile({"unet.a.b": m, "unet.a_b": LoraWeights(m.down, m.up, 2.0, key="lora_unet_a_b")})
    with pytest.raises(LoraFormatError, match="LoRA: modules .* and 'lora_unet_a_b' both adapt 'a.b.weight'"):
        match_modules(lf, {"a.b.weight": torch.zeros(4, 4)})


@pytest.mark.parametrize(("down", "up", "alpha", "said"), [
    (torch.ones(0, 6), torch.ones(8, 0), 1.0, "rank 0"),
    (torch.ones(2, 6), torch.ones(8, 2), float("nan"), "alpha is nan"),
    (torch.ones(2, 6), torch.ones(8, 2), 0.0, "alpha is 0.0"),
    (torch.ones(2, 6), torch.ones(8, 3), 1.0, "rank mismatch"),
    (torch.ones(2, 6, dtype=torch.int64), torch.ones(8, 2), 1.0, "down has dtype torch.int64"),
])
def test_a_lora_made_in_memory_is_checked_by_merge_and_apply(down, up, alpha, said):
    lf = LoraFile({"unet.lin": LoraWeights(down, up, alpha, key="lin")})
    base = {"lin.weight": torch.zeros(8, 6)}
    with pytest.raises(LoraFormatError, match=f"LoRA #0: module 'lin': {said}"):
        merge_loras(base, [(lf, 1.0)])
    with pytest.raises(LoraFormatError, match=f"LoRA #0: module 'lin': {said}"):
        apply_loras(nested_modules(base), [(lf, 1.0)], mode="runtime")
