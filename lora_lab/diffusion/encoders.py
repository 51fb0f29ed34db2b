"""The text encoders and the VAE of a run: on the device only while they work (caching, sampling).

    encoders = Encoders(pipe, device, reload)      # the pipeline's text encoders and VAE, wherever they are
    with encoders.on_device(): encode the dataset  # ... then
    encoders.release()                             # off the device for the training steps
    with encoders.on_device(): sample              # back for a moment

Training needs them only to cache the dataset's latents and text embeddings, and again to sample: in
between they would hold device memory for nothing (T5-XXL alone is 8.9 GiB in bf16). Where they go:

    training on a GPU   host memory (`to("cpu")`), and back with `to(device)`
    training on the CPU the host is the device: they are dropped, and `reload(names)` builds them again from
                        the base (its files, or its seed) when sampling needs them

`keep=True` (`--keep-encoders`) leaves them on the device throughout.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import torch

from ..models.kinds import kind_of


def component_names(pipe) -> list[str]:
    """The pipeline's components that only caching and sampling need: its text encoders and its VAE."""
    return [e.component for e in kind_of(pipe).text_encoders] + ["vae"]


class Encoders:
    """Where a pipeline's text encoders and VAE are, and moving them for the phases that need them."""

    def __init__(self, pipe, device: torch.device, reload: Callable[[list[str]], dict], keep: bool = False):
        self.pipe, self.device, self.reload, self.keep = pipe, torch.device(device), reload, keep
        self.names = component_names(pipe)
        self.host: dict[str, torch.nn.Module] = {}  # released to host memory (GPU runs)

    @property
    def dropped(self) -> bool:
        return any(getattr(self.pipe, n) is None for n in self.names)

    def release(self) -> None:
        """Off the device (unless kept): to host memory when the device is not the host, else dropped."""
        if self.keep:
            return
        for name in self.names:
            module = getattr(self.pipe, name)
            if module is None:
                continue
            if self.device.type != "cpu":
                self.host[name] = module.to("cpu")
            setattr(self.pipe, name, None)
        gc.collect()  # modules in reference cycles go now, not at some later collection

    def restore(self, names: list[str] | None = None) -> None:
        """Back on the device (from host memory, or built again from the base): all, or only `names`."""
        names = self.names if names is None else names
        missing = [n for n in names if getattr(self.pipe, n) is None and n not in self.host]
        built = {}
        if missing:
            built = self.reload(missing)
            gc.collect()  # the loaders' garbage goes before the phase that needs the encoders
        for name in names:
            if getattr(self.pipe, name) is None:
                setattr(self.pipe, name, _on(self.host.pop(name, None) or built[name], self.device))

    @contextlib.contextmanager
    def on_device(self, names: list[str] | None = None):
        """The encoders and VAE (or only `names`, e.g. ["vae"] to decode) on the device for the block,
        released again after it (unless kept)."""
        self.restore(names)
        try:
            yield self.pipe
        finally:
            self.release()


def _on(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`module` on `device` (moved only where a tensor is elsewhere)."""
    if any(t.device != device for t in (*module.parameters(), *module.buffers())):
        module = module.to(device)
    return module
