"""The few third-party log lines that tell a lora_lab user nothing, filtered one by one.

diffusers and transformers import peft, bitsandbytes and torchao whenever they are installed (the
dev extra installs them as test references), and those imports log about hardware and builds that
lora_lab never uses. Each entry names the logger and the start of the message, and why it is noise;
every other line of these loggers, and every warning, still shows.

Progress bars of loading a local pipeline folder (diffusers, transformers) are switched off around
that call by `quiet_loading()`; lora_lab's own training bar is tqdm.auto (a widget in a notebook).
"""

from __future__ import annotations

import contextlib
import logging

# diffusers and transformers are imported where used: ~4 s to import, which `import lora_lab` should not pay.

# (logger, the message starts with, and contains, why it says nothing to a lora_lab user)
KNOWN_NOISE: tuple[tuple[str, str, str, str], ...] = (
    ("torchao", "Failed to load ", ".so",
     "torchao's optional CUDA extensions (built for another Python), tried at import"),
    ("torch.utils._pytree", "", "is an Enum subclass and is now natively supported",
     "torchao registers Enum pytree constants at import; torch deprecates that"),
    ("transformers.utils.import_utils", "`", "requires torchvision (not installed)",
     "image processors fall back to PIL without torchvision; lora_lab uses no image processor"),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward", "",
     "an optional 4-bit CPU kernel from the hub; lora_lab uses no 4-bit bitsandbytes layer"),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects", "",
     "torchao-serialized checkpoints, which lora_lab never loads"),
    ("diffusers.loaders.lora_base", "No LoRA keys associated to ", "",
     "a LoRA file without text-encoder weights: nothing to load there, as the message itself says"),
    ("diffusers.loaders.peft", "No LoRA keys associated to ", "", "as above, diffusers' other loader"),
    ("papermill.translators", "Unable to parse line ", "",
     "papermill's own guess at a parameters cell trips on a '=' in a comment (`# alpha = rank`); the runner "
     "reads the cell itself (notebook/parameters.py) and checks every value before papermill runs"),
    ("papermill.execute", "Passed unknown parameter: ", "",
     "follows from the line above; a name the notebook does not take is refused before papermill runs "
     "(`expected_parameters`) and again in the kernel (`Record.start`)"),
    ("IPKernelApp", "Kernel is running over TCP without encryption", "",
     "the kernels of the batch runner, on localhost for it alone (`kernel_log_config`)"),
    ("IPKernelApp", "KeyboardInterrupt caught in kernel", "",
     "jupyter_client interrupts a kernel before it shuts it down, after the notebook ran; with two notebooks "
     "at once the interrupt often lands while the kernel still handles a message"),
)


class _DropKnown(logging.Filter):
    def __init__(self, start: str, also: str):
        super().__init__()
        self.start, self.also = start, also

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 (a malformed record is not ours to drop)
            return True
        return not (msg.startswith(self.start) and self.also in msg)


class KnownNoise(logging.Filter):
    """Drops every KNOWN_NOISE line, by logger and message: for a handler that sees several loggers."""

    def filter(self, record: logging.LogRecord) -> bool:
        return all(_DropKnown(start, also).filter(record)
                   for name, start, also, _ in KNOWN_NOISE if record.name == name)


def kernel_log_config() -> dict:
    """The traitlets config (JSON) of a Jupyter kernel whose log drops KNOWN_NOISE: the batch runner's kernels
    load it (`--config`), so that their one line of noise at start never reaches a batch run's terminal."""
    return {"IPKernelApp": {"logging_config": {
        "filters": {"lora_lab_known_noise": {"()": f"{__name__}.KnownNoise"}},
        "handlers": {"console": {"filters": ["lora_lab_known_noise"]}},
    }}}


def install_log_filters() -> None:
    """Drop exactly the KNOWN_NOISE lines (idempotent; cheap: imports nothing)."""
    for name, start, also, _ in KNOWN_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) and (f.start, f.also) == (start, also) for f in logger.filters):
            logger.addFilter(_DropKnown(start, also))


@contextlib.contextmanager
def quiet_loading():
    """No diffusers/transformers progress bars while a pipeline is read from a local folder."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    was = dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled()
    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        if was[0]:
            dlog.enable_progress_bar()
        if was[1]:
            tlog.enable_progress_bar()
