"""torch's private API, which lora_lab uses only through lora_lab/torch_private.py: each use still works as
lora_lab relies on it under the pinned torch (a failure names the API that changed), and no other module
touches a private torch name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lora_lab import torch_private as tp

PACKAGE = Path(__file__).resolve().parents[2] / "lora_lab"
CHECKS = {}


def check(api: str):
    def register(fn):
        CHECKS[api] = fn
        return fn
    return register


@check("torch.utils._pytree.tree_flatten / tree_unflatten / tree_leaves")
def _pytree():
    value = ({"a": torch.ones(1), "b": [torch.zeros(2), 3]}, "x")
    leaves, spec = tp.tree_flatten(value)
    assert [type(x) for x in leaves] == [torch.Tensor, torch.Tensor, int, str]
    assert tp.tree_unflatten(leaves, spec)[0]["b"][1] == 3 and len(tp.tree_leaves(value)) == 4


@check("torch.utils._python_dispatch.TorchDispatchMode")
def _dispatch_mode():
    seen = []

    class Record(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen


@check("torch._subclasses.fake_tensor: FakeTensorMode(allow_non_fake_inputs=True), FakeTensor, is_fake, "
       "unset_fake_temporarily")
def _fake_tensors():
    real = torch.ones(4)
    with tp.FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.empty(3, 4) + real  # a real input is allowed
        with tp.unset_fake_temporarily():
            inside = torch.ones(2)
    assert isinstance(fake, tp.FakeTensor) and tp.is_fake(fake) and fake.shape == (3, 4)
    assert not tp.is_fake(real) and not tp.is_fake(inside) and inside.sum().item() == 2


@check("torch.autograd.graph._engine_run_backward(outputs, grads, keep_graph, create_graph, inputs, "
       "allow_unreachable=, accumulate_grad=)")
def _engine_run_backward():
    x = torch.ones(3, requires_grad=True)
    loss = (x * x).sum()
    tp.engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True,
                           accumulate_grad=True)
    assert torch.equal(x.grad, 2 * torch.ones(3))


@check("torch.nn.modules.batchnorm._NormBase")
def _norm_base():
    assert all(issubclass(c, tp.NormBase) for c in (nn.BatchNorm1d, nn.BatchNorm2d, nn.InstanceNorm2d))
    assert not issubclass(nn.LayerNorm, tp.NormBase) and nn.BatchNorm2d(2).track_running_stats


@check("torch._C.DisableTorchFunction")
def _disable_torch_function():
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    one = torch.ones(1)
    with Mode():
        with tp.DisableTorchFunction():
            torch.add(one, 1)
        assert seen == []
        torch.add(one, 1)
    assert seen == [torch.add]


@check("torch.ops.aten's underscore ops: _softmax, _safe_softmax, _convolution, the attention kernels")
def _aten_kernels():
    packets = (*tp.SOFTMAX_KERNELS, tp.CONVOLUTION_KERNEL, *tp.ATTENTION_KERNELS)
    assert all(isinstance(p, torch._ops.OpOverloadPacket) for p in packets)
    assert [p.__name__ for p in tp.SOFTMAX_KERNELS] == ["_softmax", "_safe_softmax"]
    seen = set()

    class Record(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 8, 16)
    with Record():
        F.scaled_dot_product_attention(q, q, q)
        F.softmax(q, -1)
        F.conv2d(torch.randn(1, 1, 4, 4), torch.randn(1, 1, 3, 3))
    assert {tp.CPU_FLASH_ATTENTION, tp.SOFTMAX_KERNELS[0]} <= seen
    conv = [a.name for a in tp.op_schema(tp.CONVOLUTION_KERNEL.default).arguments]
    assert conv[:3] == ["input", "weight", "bias"]


@check("aten._scaled_dot_product_{flash,efficient}_attention, _scaled_dot_product_attention_math: arguments")
def _attention_calls():
    names = {fn: [a.name for a in tp.op_schema(op.default).arguments] for fn, op in (
        ("flash", torch.ops.aten._scaled_dot_product_flash_attention),
        ("efficient", torch.ops.aten._scaled_dot_product_efficient_attention))}
    assert names["flash"] == ["query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"]
    assert names["efficient"] == ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p",
                                  "is_causal", "scale"]
    q, k, v = torch.randn(3, 1, 2, 8, 16)
    mask = torch.randn(8, 8)
    out = tp.math_attention(q, k, v, mask, 0.0, False, 0.5)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, mask, scale=0.5), atol=1e-6)
    with tp.FakeTensorMode(allow_non_fake_inputs=True):  # the CUDA kernels as a plan calls them: fake
        flash = tp.flash_attention(q, k, v, 0.0, False, None)
        efficient = tp.efficient_attention(q, k, v, None, True, 0.0, True, 0.25)
    assert flash.shape == efficient.shape == q.shape and tp.is_fake(flash) and tp.is_fake(efficient)


@check("OpOverload._schema: returns[].alias_info, arguments[].name/alias_info.is_write, is_mutable")
def _schema():
    add_ = tp.op_schema(torch.ops.aten.add_.Tensor)
    assert add_.is_mutable and add_.arguments[0].alias_info.is_write and add_.arguments[0].name == "self"
    assert tp.op_schema(torch.ops.aten.view.default).returns[0].alias_info is not None
    assert tp.op_schema(torch.ops.aten.mm.default).returns[0].alias_info is None


@check("Tensor._version")
def _version():
    t = torch.zeros(2)
    before = tp.tensor_version(t)
    t.add_(1)
    assert tp.tensor_version(t) == before + 1


@check("UntypedStorage._cdata")
def _storage_key():
    t = torch.zeros(4)
    assert tp.storage_key(t.untyped_storage()) == tp.storage_key(t[1:].untyped_storage())
    assert tp.storage_key(t.untyped_storage()) != tp.storage_key(torch.zeros(4).untyped_storage())
    with tp.FakeTensorMode():
        f = torch.zeros(4)
        assert tp.storage_key(f.untyped_storage()) == tp.storage_key(f.view(2, 2).untyped_storage())


@check("nn.Module._parameters / _buffers (the live tables)")
def _module_tables():
    m = nn.BatchNorm1d(2)
    tp.parameters_of(m)["weight"] = nn.Parameter(torch.full((2,), 3.0))
    tp.buffers_of(m)["running_mean"] = torch.full((2,), 5.0)
    assert m.weight[0] == 3 and m.running_mean[0] == 5 and dict(m.named_parameters())["weight"][0] == 3


@check("nn.Module._apply(fn, recurse=True), what .to() / .half() / .cuda() call")
def _apply():
    assert list(inspect.signature(nn.Module._apply).parameters) == ["self", "fn", "recurse"]
    calls = []

    class Own(tp.ConvertsItself):
        def convert(self, fn):
            calls.append(fn(torch.zeros(1)).dtype)
            return self

    Own().to(torch.float16)
    Own().double()
    nn.Sequential(Own()).half()  # through a parent too
    assert calls == [torch.float16, torch.float64, torch.float16]


@check("torch._fused_adam_ / torch._fused_adamw_ (lists, state_steps, lr=, beta1=, ..., amsgrad=, maximize=)")
def _fused_adam():
    for decoupled in (False, True):
        p = torch.randn(5)
        ref = nn.Parameter(p.clone())
        ref.grad = torch.randn(5)
        kw = {"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}
        (torch.optim.AdamW if decoupled else torch.optim.Adam)([ref], foreach=False, **kw).step()
        m, v = torch.zeros(5), torch.zeros(5)
        tp.fused_adam(decoupled)([p], [ref.grad.clone()], [m], [v], [], [torch.tensor(1.0)], lr=0.1,
                                 beta1=0.9, beta2=0.99, weight_decay=0.01, eps=1e-8, amsgrad=False,
                                 maximize=False)
        assert torch.allclose(p, ref.detach(), atol=1e-6), decoupled


@check("torch.optim.Adam._init_group(group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, "
       "state_steps)")
def _init_group():
    assert list(inspect.signature(torch.optim.Adam._init_group).parameters) == [
        "self", "group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
        "state_steps"]
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([p])
    tp.init_adam_state(optimizer, optimizer.param_groups[0])
    state = optimizer.state[p]
    assert set(state) >= {"step", "exp_avg", "exp_avg_sq"} and state["exp_avg"].shape == (3,)
    assert torch.equal(p.detach(), torch.ones(3))  # no step taken


@check("torch._C._get_sdp_priority_order / _set_sdp_priority_order / _get_overrideable_sdp_enabled")
def _sdp_priority():
    before = tp.sdp_priority_order()
    assert sorted(before) == list(range(len(before))) and isinstance(tp.overrideable_sdp_enabled(), bool)
    try:
        tp.set_sdp_priority_order(before[::-1])
        assert tp.sdp_priority_order() == before[::-1]
    finally:
        tp.set_sdp_priority_order(before)


@check("torch._C._current_graph_task_id")
def _in_backward():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(tp.in_backward()))
    assert not tp.in_backward()
    y.sum().backward()
    assert seen == [True] and not tp.in_backward()


@check("torch.distributed._tools.mem_tracker.MemTracker: _track_module_params_and_buffers, _pre_fw_hook, "
       "_update_peak_stats, _curr_mem_snap, _peak_mem, _peak_mem_snap")
def _mem_tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    for name, params in (("_track_module_params_and_buffers", ["self", "module", "install_grad_hooks"]),
                         ("_pre_fw_hook", ["self", "module", "inputs"]),
                         ("_update_peak_stats", ["self", "peak_state"])):  # overridden
        assert list(inspect.signature(getattr(MemTracker, name)).parameters) == params, name
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    model[0].requires_grad_(False)  # a frozen parameter: MemTracker alone would refuse its gradient hook
    tracker = tp.frozen_aware_mem_tracker()
    with tracker:
        tracker.track_external(model)
        for _ in range(2):  # a model called again
            model(torch.randn(8, 64)).sum().backward()
        big = torch.zeros(1 << 20)
        del big
        assert isinstance(tracker._peak_mem, dict) and isinstance(tracker._peak_mem_snap, dict)
        assert isinstance(tracker._curr_mem_snap, dict)
        total = lambda kind: sum(s["Total"] for s in tracker.get_tracker_snapshot(kind).values())  # noqa: E731
        assert total("peak") >= total("current") + (1 << 22)
        tp.restart_peak(tracker)
        assert total("peak") == total("current")


def test_every_name_of_torch_private_is_exported_and_checked():
    """Every public name of torch_private is in its __all__, and some check above uses it."""
    imported = {"annotations", "Any", "Callable", "torch", "nn", "aten"}  # its own imports, not its API
    assert set(tp.__all__) == {n for n in vars(tp) if not n.startswith("_")} - imported
    checks = [f for f in ast.parse(Path(__file__).read_text()).body if isinstance(f, ast.FunctionDef)
              and any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "check"
                      for d in f.decorator_list)]
    used = {n.attr for f in checks for n in ast.walk(f)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "tp"}
    assert len(checks) == len(CHECKS) and set(tp.__all__) <= used, sorted(set(tp.__all__) - used)


@pytest.mark.parametrize("api", sorted(CHECKS))
def test_each_private_api_still_works(api):
    try:
        CHECKS[api]()
    except Exception as e:  # an AttributeError, TypeError, a wrong result: which API changed, loudly
        pytest.fail(f"torch {torch.__version__} changed {api} (lora_lab/torch_private.py): "
                    f"{type(e).__name__}: {e}")


# -- no other module touches torch's private names ------------------------------------------------------


def _torch_private_attributes() -> set[str]:
    """The private attribute names of the torch objects lora_lab's code meets."""
    from torch.distributed._tools.mem_tracker import MemTracker

    param = nn.Parameter(torch.zeros(1))
    objects = [nn.Linear(1, 1), nn.ModuleList(), torch.zeros(1), param, torch.zeros(1).untyped_storage(),
               torch.ops.aten.add, torch.ops.aten.add.Tensor, torch.optim.AdamW([param]), MemTracker(),
               tp.FakeTensorMode(), tp.TorchDispatchMode(), torch.overrides.TorchFunctionMode()]
    return {n for o in objects for n in dir(o) if n.startswith("_") and not n.startswith("__")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def torch_private_uses(source: str, attributes: set[str]) -> list[str]:
    """Each private torch name `source` touches: a private module or name imported from torch, a private
    part of an attribute chain from a name bound to torch, a private attribute of torch's objects read on
    anything, or one of their private methods overridden."""
    tree = ast.parse(source)
    torch_names: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
                    torch_names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] == "torch":
            if any(_private(part) for part in node.module.split(".")):
                found.append(f"{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                torch_names.add(alias.asname or alias.name)
    for node in ast.walk(tree):  # `aten = torch.ops.aten`: a name bound to torch too
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in torch_names:
                torch_names.add(node.targets[0].id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if (isinstance(root, ast.Name) and root.id in torch_names) or node.attr in attributes:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ClassDef):
            found += [f"{f.lineno}: def {f.name}" for f in node.body
                      if isinstance(f, ast.FunctionDef) and f.name in attributes]
    return found


def test_no_other_module_touches_torch_private_names():
    attributes = _torch_private_attributes()
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "torch_private.py" and (uses := torch_private_uses(path.read_text(), attributes)):
            found[str(path.relative_to(PACKAGE.parent))] = uses
    assert not found, f"torch's private API outside lora_lab/torch_private.py (add it there, why): {found}"


def test_the_check_sees_each_way_of_touching_torch_private_names():
    attributes = _torch_private_attributes()
    assert {"_parameters", "_modules", "_version", "_cdata", "_schema", "_init_group", "_peak_mem",
            "_apply"} <= attributes
    cases = {
        "from torch._subclasses.fake_tensor import is_fake": 1,
        "from torch.autograd.graph import _engine_run_backward": 1,
        "import torch._dynamo": 1,
        "import torch\ntorch._C._get_sdp_priority_order()": 2,  # torch._C and ._get_sdp_priority_order
        "import torch\naten = torch.ops.aten\naten._softmax": 1,
        "from torch import nn\nnn.modules.batchnorm._NormBase": 1,
        "m._parameters['w'] = p": 1,
        "t._version": 1,
        "optimizer._init_group(g)": 1,
        "class M:\n    def _apply(self, fn, recurse=True):\n        pass": 1,
    }
    for source, n in cases.items():
        assert len(torch_private_uses(source, attributes)) == n, source
    clean = ("import torch\nfrom torch import nn\nimport torch.nn.functional as F\nself._mine = 1\n"
             "obj._own_thing\ntorch.ops.aten.mm\nx.__class__\nnamed._replace(a=1)\n")
    assert torch_private_uses(clean, attributes) == []
