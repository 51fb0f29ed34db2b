"""The spellings of lora_lab 0.1 that moved in 0.2, kept importable for this release with a
DeprecationWarning.

    import lora_lab.digits            -> lora_lab.notebook.digits (the same module object), with a warning
    from lora_lab import LoraModule   -> lora_lab.formats.LoraWeights, with a warning

`OLD_MODULES` maps each old module path to its new one (`ModuleFinder`, on `sys.meta_path`, answers an
import of an old path with the new module itself, so patching one patches the other); `old_name`
builds a package's module-level `__getattr__` for the names that moved or were renamed.
`lora_lab.checkpoint` and `lora_lab.diffusion.train` were module paths and function names at once: a
module loaded there would replace the function on its package, so these two are `ForwardingModule`s put
in `sys.modules` (an import finds them without setting the package's attribute) that forward each name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable

REMOVED_IN = "0.3"

OLD_MODULES = {
    "lora_lab.lowrank": "lora_lab.functional.lowrank",
    "lora_lab.dora": "lora_lab.functional.dora",
    "lora_lab.adam": "lora_lab.functional.adam",
    "lora_lab.blockwise": "lora_lab.functional.blockwise",
    "lora_lab.lora_config": "lora_lab.lora.config",
    "lora_lab.lora_layers": "lora_lab.lora.layer",
    "lora_lab.checkpoint_segment": "lora_lab.checkpointing.segment",
    "lora_lab.checkpoint_ops": "lora_lab.checkpointing.ops",
    "lora_lab.checkpoint_tape": "lora_lab.checkpointing.tape",
    "lora_lab.checkpoint_budget": "lora_lab.checkpointing.budget",
    "lora_lab.diffusion.kinds": "lora_lab.models.kinds",
    "lora_lab.diffusion.inputs": "lora_lab.models.inputs",
    "lora_lab.diffusion.models": "lora_lab.models.builders",
    "lora_lab.diffusion.real": "lora_lab.models.real",
    "lora_lab.diffusion.effect": "lora_lab.notebook.effect",
    "lora_lab.diffusion.train_config": "lora_lab.diffusion.config",
    "lora_lab.diffusion.train_state": "lora_lab.diffusion.state",
    "lora_lab.fakedevice": "lora_lab.planning.fakedevice",
    "lora_lab.step_memory": "lora_lab.planning.measure",
    "lora_lab.planner": "lora_lab.planning.planner",
    "lora_lab.budget": "lora_lab.planning.fit",
    "lora_lab.notebook_params": "lora_lab.notebook.parameters",
    "lora_lab.digits": "lora_lab.notebook.digits",
}


def warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is now {new}; the old spelling goes in lora_lab {REMOVED_IN}", DeprecationWarning,
                  stacklevel=3)


class _Alias(importlib.abc.Loader):
    """Loads an old module path as the new module itself (no second copy of its code or state)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warn(spec.name, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        pass  # the new module is already executed


class ModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of `OLD_MODULES` (and nothing else)."""

    def find_spec(self, fullname, path=None, target=None):
        new = OLD_MODULES.get(fullname)
        return importlib.util.spec_from_loader(fullname, _Alias(new)) if new else None


def old_name(package: str, moved: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` for `package`: `moved` maps an old name to "module:new_name" (where it is
    now)."""

    def __getattr__(name: str):
        if name not in moved:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, new = moved[name].partition(":")
        warn(f"{package}.{name}", f"{module}.{new}")
        return getattr(importlib.import_module(module), new)

    return __getattr__


class ForwardingModule(types.ModuleType):
    """An old module path whose last part is also a function's name: forwards its names (some renamed) to the
    module they live in now, with a warning."""

    def __init__(self, name: str, target: str, renamed: dict[str, str]):
        super().__init__(name)
        self._target, self._renamed = target, renamed

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        new = self._renamed.get(name, name)
        value = getattr(importlib.import_module(self._target), new)  # AttributeError for a name it never had
        warn(f"{self.__name__}.{name}", f"{self._target}.{new}")
        return value


FORWARDED = {
    "lora_lab.checkpoint": ("lora_lab.checkpointing", {
        "checkpoint": "checkpointed", "checkpoint_plan": "checkpointing_plan",
        "CheckpointError": "CheckpointingError", "CheckpointPlan": "CheckpointingPlan"}),
    "lora_lab.diffusion.train": ("lora_lab.diffusion.trainer", {"Trainable": "Learner"}),
}


def install() -> None:
    """The finder of the old module paths on `sys.meta_path`, the two forwarding modules in `sys.modules`."""
    if not any(isinstance(f, ModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(ModuleFinder())
    for name, (target, renamed) in FORWARDED.items():
        sys.modules.setdefault(name, ForwardingModule(name, target, renamed))
