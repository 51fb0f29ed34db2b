"""var_from_tensor, load_frozen and count_parameters."""

import gc
import weakref

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lora_lab import Linear, count_parameters, load_frozen, var_from_tensor
from lora_lab.errors import TensorTypeError, WeightFileError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _check_fresh(p: torch.Tensor, src: torch.Tensor):
    assert isinstance(p, nn.Parameter) and p.is_leaf and p.requires_grad and p.grad_fn is None
    assert p.is_contiguous()
    assert torch.equal(p.detach(), src.detach())
    assert p.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    before = src.detach().clone()
    with torch.no_grad():
        p.add_(1.0)
    assert torch.equal(src.detach(), before), "writing to the Var changed its source"


@pytest.mark.parametrize("device", DEVICES)
def test_var_from_leaf_nonleaf_view_and_expanded(device):
    leaf = torch.randn(3, 4, device=device, requires_grad=True)
    _check_fresh(var_from_tensor(leaf), leaf)
    nonleaf = leaf * 2 + 1  # carries grad history
    _check_fresh(var_from_tensor(nonleaf), nonleaf)
    view = nonleaf.t()[1:]  # non-contiguous view
    assert not view.is_contiguous()
    _check_fresh(var_from_tensor(view), view)
    expanded = torch.randn(4, 1, device=device).expand(4, 5)  # stride 0: elements alias
    p = var_from_tensor(expanded)
    _check_fresh(p, expanded)
    assert p.stride() == (5, 1)


def test_var_is_usable_as_a_training_variable():
    p = var_from_tensor(torch.tensor(2.0))
    (p**2).backward()
    assert p.grad.item() == 4.0


def test_var_does_not_keep_the_source_graph_alive():
    x = torch.randn(64, 64, requires_grad=True)
    h = x * 3
    held_by_graph = weakref.ref(h)
    y = h.sin()  # sin's backward saves h
    del h
    gc.collect()
    assert held_by_graph() is not None  # the graph of y keeps h alive...
    p = var_from_tensor(y)
    del y
    gc.collect()
    assert held_by_graph() is None, "the Var keeps its source's autograd graph alive"  # ...the Var does not
    assert p.grad_fn is None


@pytest.mark.parametrize("bad", [torch.arange(4), torch.tensor([True, False]), [1.0, 2.0]])
def test_var_from_non_floating_is_a_clear_error(bad):
    with pytest.raises(TensorTypeError, match="floating|torch.Tensor"):
        var_from_tensor(bad)


@pytest.fixture
def weights_file(tmp_path):
    tensors = {"layer.weight": torch.randn(32, 16), "layer.bias": torch.randn(32), "steps": torch.arange(3)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def _mapped_ranges(path):
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def test_load_frozen_reads_frozen_memory_mapped_tensors(weights_file):
    path, tensors = weights_file
    loaded = load_frozen(path)
    assert set(loaded) == set(tensors)
    for k, t in loaded.items():
        assert torch.equal(t, tensors[k]) and not t.requires_grad
    import sys

    if sys.platform.startswith("linux"):  # no copy: the data lies inside the file's mapping
        ranges = _mapped_ranges(path.resolve())
        assert ranges and any(lo <= loaded["layer.weight"].data_ptr() < hi for lo, hi in ranges)


def test_load_frozen_casts_floats_only(weights_file):
    path, _ = weights_file
    loaded = load_frozen(path, dtype=torch.bfloat16)
    assert loaded["layer.weight"].dtype == torch.bfloat16
    assert loaded["steps"].dtype == torch.int64


def test_load_frozen_bad_files_name_the_file(tmp_path, weights_file):
    with pytest.raises(WeightFileError, match="nope.safetensors"):
        load_frozen(tmp_path / "nope.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\x00" * 64)
    with pytest.raises(WeightFileError, match="garbage.safetensors"):
        load_frozen(garbage)
    path, _ = weights_file
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(WeightFileError, match="truncated.safetensors"):
        load_frozen(truncated)


def test_count_parameters_counts_frozen_buffers_and_frozen_params():
    frozen = Linear.frozen(torch.randn(8, 4), torch.randn(8))  # 40 frozen, as buffers
    trainable = Linear.trainable(8, 3)  # 27 trainable
    plain = nn.Linear(3, 2)  # 8, frozen by hand
    plain.requires_grad_(False)
    norm = nn.BatchNorm1d(2)  # 4 trainable; its running stats are buffers but not weights
    model = nn.Sequential(frozen, trainable, plain, norm)
    assert count_parameters(model) == (27 + 4, 40 + 8)
    shared = nn.Sequential(trainable, nn.ReLU(), nn.Linear(3, 8))
    shared[2].weight = nn.Parameter(torch.randn(8, 3))
    assert count_parameters(nn.ModuleList([trainable, trainable])) == (27, 0)  # counted once
