"""A training run planned on fake tensors: the trainer's own run, and each phase's peak of device memory.

    planned = plan_run(TrainConfig(model="sdxl", base="real:sdxl", resolution=1024, ...), device="cuda")
    planned.phases    {"cache": bytes, "load": ..., "train step": ..., "save": ..., "sample": ...}
    planned.parts     the training step's peak in parts (frozen weights, adapter, optimizer state, ...)
    planned.host      each phase's host memory beside it

`PlannedRun` is the trainer's `TrainingRun` (`lora_lab.diffusion.trainer`): its `run()` goes through the
same stages in the same order, and overrides only the hooks where a plan differs. The base is opened from its
configs (no weight file is read: `shapes_only`); the cache phase encodes examples of the planned sizes
(`encode_examples`); the denoiser is loaded from fake weights, the adapter added, by the trainer's own
stages; the step is the trainer's (`draws`, `accumulate_grads`, `optimizer_step`: with `reg_dataset` the
regularization batch's forward too), run once, and after it what the watch does where due (the validation
loss's batch, the samples of `sample_every`: counted in the "train step" phase, as the trainer enters it);
saving holds the host copy of the adapter that `save_outputs` writes, and the sample phase the `sample` of
`sample_outputs` (a run without samples: what it holds then).
They run under `fakedevice.fake_device()` (tensors with shapes and no memory), `DeviceRules` (the planned
GPU's attention kernels and autocast rules) and a `memory.LiveBytes`, phase by phase.

What a GPU run keeps in host memory is not counted on the device: the dataset's cache (`LiveBytes.exclude`),
the text encoders and VAE between the phases that use them (the plan drops them, as a run on the CPU does),
and the host copies made while saving; each phase's host bytes count it apart (`RunPeaks.host`: the cache,
less what a disk cache maps from its files, the parked encoders, swapped blocks). On the CPU the host is
the device, and all of it counts. The examples are the config's data (`examples.count_examples`); the plan
encodes one group of them (what one VAE call takes, `diffusion.encoded.ENCODE_PIXELS`) and counts the cache
of the others (`examples.CacheLedger`); it runs two micro-batches at most (a third as the second).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field, replace

import torch

from ..checkpointing import block_swap, disable_checkpointing, enable_checkpointing
from ..diffusion.adapters import clip_encoders
from ..diffusion.config import TrainConfig
from ..diffusion.datasets import RunData
from ..diffusion.diskcache import cache_folder
from ..diffusion.distributed import DistEnv
from ..diffusion.encoded import EncodedExamples, encode_examples
from ..diffusion.objectives import objective_for
from ..diffusion.sampling import vae_decoding
from ..diffusion.stages import SAMPLE_PROMPTS, quantize_encoders
from ..diffusion.step import StepDraws, denoising_loss, training_objective
from ..diffusion.trainer import PHASES, TrainingRun
from ..diffusion.watch import validation_batches
from ..lora import lora_state_dict
from ..memory import LiveBytes, plain_tensors
from ..models import decode_latents, default_resolution, denoiser, model_kind, predict
from ..torch_private import unset_fake_temporarily
from .blocks import Unreplayable, one_of_identical_blocks, replayed_blocks
from .examples import CacheLedger, PlannedExamples, count_examples
from .fakedevice import DeviceRules, fake_device
from .optstate import first_step_state

CPU = torch.device("cpu")  # the fake device every planned tensor is on
BEFORE_OPTIONS = ("cache", "load")  # the phases before the adapter: the same for every option fit chooses
# checkpointing policies whose blocks each keep and recompute alike (not every_k's or a budget's: those choose
# by a block's place), so the training step replays identical blocks with them as without
REPLAYED_POLICIES = (None, "full", "selective")


class OverLimit(Exception):
    """A plan stopped after its load phase: the phases before the adapter (`BEFORE_OPTIONS`) exceed the limit
    given, so no option of the adapter, optimizer, checkpointing, batch or swapping fits. `phases`: theirs."""

    def __init__(self, phases: dict[str, int]):
        super().__init__(phases)
        self.phases = phases


@dataclass
class RunPeaks:
    """What `plan_run` counted: each phase's peak, and the training step's peak in parts."""

    phases: dict[str, int]
    parts: dict[str, int]  # add up to phases["train step"]
    step_phase: str  # where in the step the peak is: "forward" | "backward" | "optimizer step"
    saved_activations: int  # everything the forward saved for backward (exact, saved-tensor hooks)
    gradients: int
    attention: dict[str, int] = field(default_factory=dict)  # the attention backends that ran, and how often
    moved_per_step: int = 0  # block swapping: host -> device bytes one step copies
    resolution: int = 0  # the image side planned
    host: dict[str, int] = field(default_factory=dict)  # each phase's host bytes (`PlannedRun.host_bytes`)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`, keyed by identity (fake tensors have no addresses)."""
    seen: dict[int, tuple] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[id(s)] = (s, s.nbytes())  # s kept: a storage object made for this call frees its id otherwise
    return sum(n for _, n in seen.values())


def plan_run(config: TrainConfig, *, device: str = "cuda", attention: str = "auto",
             checkpoint_options: dict | None = None, limit: int | None = None) -> RunPeaks:
    """Run the trainer's stages for `config` on fake tensors under the rules of `device` ("cuda": its
    attention kernels and autocast; "cpu") and return each phase's peak of device memory. The examples the
    run caches are read from the config's data as the trainer reads them (`examples.count_examples`);
    checkpoint_options: keywords for `enable_checkpointing` beside the config's policy.
    Raises what the trainer raises for a config it cannot run (TrainConfigError, ModelLoadError, ...);
    OverLimit where the cache or load phase exceeds `limit` bytes (the plan stops there).

    Without block swapping, and without checkpointing or with a policy that checkpoints each block alike
    (`REPLAYED_POLICIES`: a replay's backward window holds the block's recomputation), the training step
    replays the blocks between the first and the last of each run of identical transformer blocks
    (`blocks.replayed_blocks`, checked to the byte by every plan); where the check fails, the run is planned
    again with every block running."""
    config = replace(config, device="cpu", progress=False,
                     optimizer="adamw8bit" if config.optimizer == "bnb-adamw8bit" else config.optimizer)
    options = dict(device=device, attention=attention, checkpoint_options=checkpoint_options, limit=limit)
    replayable = config.checkpointing_policy() in REPLAYED_POLICIES
    if replayable and not (checkpoint_options or config.blocks_to_swap):
        try:
            return _plan_once(config, replay=True, **options)
        except Unreplayable:
            pass
    return _plan_once(config, replay=False, **options)


def _plan_once(config: TrainConfig, **options) -> RunPeaks:
    return PlannedRun(config, **options).run()


class PlannedRun(TrainingRun):
    """The trainer's run on fake tensors (the module docstring): `run()` returns its `RunPeaks`. replay: the
    training step replays identical blocks (`blocks.replayed_blocks`)."""

    shapes_only = True

    def __init__(self, config: TrainConfig, *, device: str, attention: str, checkpoint_options: dict | None,
                 replay: bool, limit: int | None = None):
        super().__init__(config)
        self.planned_device, self.checkpoint_options, self.replay = device, checkpoint_options, replay
        self.limit = limit
        self.on_host = device != "cpu"  # where the dataset's cache and the released encoders go
        self.tracker = LiveBytes()
        self.rules = DeviceRules(attention, device, cuda_autocast=device == "cuda")
        self.phase = self.tracker.phase

    def run(self) -> RunPeaks:
        with (fake_device(), self.rules, torch.random.fork_rng(devices=[]), _collect_young_only(),
              contextlib.ExitStack() as self.counting):
            super().run()
        return self.peaks()

    def setup(self) -> None:
        self.device, self.env = CPU, DistEnv()
        self.kind = model_kind(self.config.model)
        self.dtype = self.config.base_torch_dtype(torch.device(self.planned_device))

    def open_base(self) -> None:
        super().open_base()
        self.counting.enter_context(self.tracker)  # from here on, every tensor counts

    def cache(self) -> None:
        """The trainer's caching of one VAE call's group of examples (`encode_examples`), the text encoders
        quantized first where the run says; the cache of all the run's examples counted as `encode_run_data`
        makes it (`examples.CacheLedger`: the other examples' latents and embeddings where they are live, the
        copies its selections make): on the CPU in the phases, elsewhere in host memory (`host_cache`) while
        only the encoders' working sets count on the device. With a disk cache the latents, the prompts' and
        the empty caption's embeddings are the cache files' pages, mapped (the kernel may drop them): not
        counted."""
        tracker = self.tracker
        if not self.on_host:  # the host is the device: the encoders in the base dtype count before quantizing
            tracker.track(_encoder_tensors(self.encoders))
        quantize_encoders(self.config, self.pipe, self.device)  # the trainer's: each Linear counted as read
        tracker.track(_encoder_tensors(self.encoders))  # on the device now, also the parts no op reads
        pipe = self.pipe
        self.encoder_bytes = {name: storage_bytes((*m.parameters(), *m.buffers()))
                              for name in self.encoders.names if (m := getattr(pipe, name)) is not None}
        self.counts = count_examples(self.config, self.resolution)
        start = tracker.current
        self.cached = self.encode_data()
        self.data, self.reg, self.empty, self.samples, self.val, _ = self.cached
        data, samples, (vae_peak, captions_peak, encoded) = self.data, self.samples, self.group_peaks
        group = len(data.latents)
        plain = storage_bytes(data.latents) // group
        latent = plain + storage_bytes([*(data.flipped or ()), *(data.masks or ())]) // group  # flip, mask
        embed = storage_bytes(data.embeds.values()) // group
        mapped = cache_folder(self.config) is not None  # the disk cache's files' pages hold the latents
        held, held_plain = (0, 0) if mapped else (latent, plain)
        if self.on_host:
            tracker.exclude([*data.latents, *(data.flipped or ()), *(data.masks or ()), *data.embeds.values(),
                             *(samples[1].values() if samples else ()),
                             *(self.empty.values() if self.empty else ())])
            self.cached_bytes = 0
            ledger = CacheLedger(0, (group, data.sizes[0]), held, embed, vae=0, text=0, after=0,
                                 plain=held_plain)
            ledger.run_data(self.counts)  # the cache in host memory: the data, the prompts' embeddings
            prompts = 0 if mapped else storage_bytes([*(samples[1].values() if samples else ()),
                                                      *(self.empty.values() if self.empty else ())])
            self.host_cache = (ledger.peak + prompts, ledger.current + prompts)
            return
        ledger = CacheLedger(start, (group, data.sizes[0]), held, embed,
                             vae=vae_peak - start, text=captions_peak - start - group * (latent + embed),
                             after=tracker.peak - encoded, plain=held_plain)
        ledger.run_data(self.counts)
        tracker.phase_peaks["cache"] = max(tracker.phase_peaks["cache"], ledger.peak)
        tracker.current += ledger.current - start - group * (latent + embed)
        self.cached_bytes = ledger.current - start
        self.host_cache = (0, 0)  # counted in the phases: the host is the device

    def encode_examples(self, pipe) -> RunData:
        """As many training examples as the run's largest VAE call holds pixels, encoded (the peaks of its
        images' and of its captions' part kept, `group_peaks`); the held-out and regularization examples are
        the same tensors (the ledger counts their bytes, the step and the watch their shapes)."""
        counts, tracker, r = self.counts, self.tracker, self.resolution
        n, (h, w) = counts.train.largest_group()
        group = max(1, round(n * h * w / r**2))  # of the square size: the step's (buckets are about r^2)
        examples = PlannedExamples(group, (r, r), min(len(set(counts.train.captions)), group),
                                   self.config.masked_loss)
        peaks = []

        def phase(name: str) -> contextlib.AbstractContextManager:  # "cache captions": the images are done
            peaks.append(tracker.phase_peaks["cache"])
            return tracker.phase(name)

        data = encode_examples(pipe, examples, self.config.seed, phase, self.config.flip)
        self.group_peaks = (peaks[0], tracker.phase_peaks.pop("cache captions"), tracker.current)
        tracker.reset_peak()  # from here: the sample prompts and the empty caption
        same = EncodedExamples(data.latents, data.embeds, data.captions, data.sizes)
        return RunData(data, same if counts.reg is not None else None,
                       same if counts.held_out or counts.validation is not None else None)

    def add_adapter(self) -> None:
        before = {p: self.tracker.phase_peaks[p] for p in BEFORE_OPTIONS}
        if self.limit is not None and max(before.values()) > self.limit:
            raise OverLimit(before)
        super().add_adapter()

    def host_copies(self) -> contextlib.AbstractContextManager:
        return self.tracker.elsewhere()  # the swapped blocks' host copies

    def start(self) -> None:
        """Checkpointing with the plan's options, the optimizer's state as after a first step, the objective;
        the persistent parts of the step counted."""
        model, learner = denoiser(self.pipe), self.learner
        if self.checkpoint_options:
            disable_checkpointing(model)
            enable_checkpointing(model, self.kind.checkpoint_blocks(),
                                 **{"policy": self.config.checkpointing_policy(), **self.checkpoint_options})
            model.train()
        first_step_state(learner, self.planned_device)
        self.step_parts = {
            "adapters": storage_bytes(learner.params),
            "ema": storage_bytes(learner.ema.shadow.values()) if learner.ema is not None else 0,
            "state": storage_bytes(t for s in learner.optimizer.state.values() for t in plain_tensors(s))}
        self.objective = training_objective(self.config, self.pipe, self.resolution)

    def train_loop(self) -> None:
        """One optimizer step of at most two micro-batches (the second with the first's gradients live), on
        the cached examples (drawn as the trainer draws them, cyclically where they are fewer than a step
        takes), measured in parts: the peak of the last micro-batch's forward (with prior preservation its
        two denoiser calls), of the backward, of the optimizer step. Then what the watch does after a step
        where due (`watched`); on the CPU a run that samples during training keeps the VAE from its first
        samples on (`Watch.sample_step`)."""
        tracker, model, learner = self.tracker, denoiser(self.pipe), self.learner
        config = self.config
        accum = min(config.grad_accum, 2)
        self.config = replace(config, grad_accum=accum)
        calls = 2 if self.reg is not None else 1  # denoiser calls per micro-batch
        forwards, peaks = [0], {}
        replay = replayed_blocks(model, tracker, self.rules) if self.replay else contextlib.nullcontext()

        def before_forward(module, args):
            forwards[0] += 1
            if forwards[0] == (accum - 1) * calls + 1:  # the last micro-batch: all earlier is live in it
                tracker.reset_peak()
            tracker.in_forward = forwards[0] > (accum - 1) * calls

        def after_forward(module, args, output):
            if forwards[0] > (accum - 1) * calls:
                tracker.in_forward = False
                peaks["forward"] = (tracker.peak, tracker.saved_at_peak)

        with self.phase("train step"):
            if self.samples_while_training() and self.planned_device == "cpu":
                self.encoders.restore(["vae"])
                tracker.track(_encoder_tensors(self.encoders))
            draws = self.draws(0)
            hooks = [model.register_forward_pre_hook(before_forward),
                     model.register_forward_hook(after_forward)]
            try:
                with (torch.autograd.graph.saved_tensors_hooks(tracker.mark_saved, lambda x: x),
                      replay):
                    self.accumulate_grads(draws)
            finally:
                for h in hooks:
                    h.remove()
            peaks["backward"] = (tracker.peak, tracker.saved_at_peak)
            self.step_parts["grads"] = storage_bytes(p.grad for p in learner.params if p.grad is not None)
            self.optimizer_step(0)
            peaks["optimizer step"] = (tracker.peak, tracker.saved_at_peak)
            phase = next(p for p in peaks if peaks[p][0] == tracker.peak)
            self.step_parts.update(phase=phase, saved_at_peak=peaks[phase][1], saved=tracker.saved_bytes,
                                   resident=storage_bytes(  # kept encoders, the VAE kept to sample (their
                                       t for t in _encoder_tensors(self.encoders)  # LoRA: adapter weights)
                                       if id(t) not in {id(p) for p in learner.params}))
            del draws
            self.config = config
            del self.objective  # as after the trainer's loop
            self.watched()

    def samples_while_training(self) -> bool:
        return bool(self.config.sample_every and self.samples)

    def watched(self) -> None:
        """What `Watch.watched` holds after a step where due: the validation loss's first batch of rows
        through the denoiser without gradients (`watch.validation_batches`); the samples, batch_size prompts
        in one sampler call (`sampling`)."""
        model = denoiser(self.pipe)
        model.eval()
        if self.val is not None:
            objective = objective_for(self.pipe)
            with torch.no_grad(), unset_fake_temporarily():  # the fixed noise and timesteps: real tensors
                batch = next(validation_batches(self.config, self.val, objective, CPU))
            with torch.no_grad():
                denoising_loss(self.config, self.kind, self.pipe, objective, *batch[:4], weighted=False,
                               mask=batch[5])
            del batch
        if self.samples_while_training():
            on_device = contextlib.nullcontext() if self.planned_device == "cpu" else \
                self.encoders.on_device(["vae"])
            with on_device:
                self.tracker.track(_encoder_tensors(self.encoders))
                prompts = self.config.sample_prompts or \
                    list(dict.fromkeys(self.counts.train.captions))[:SAMPLE_PROMPTS]
                self.sampling(min(self.config.batch_size, len(prompts)))
        model.train()

    def draws(self, step: int) -> StepDraws:
        with unset_fake_temporarily():  # the indices of the examples drawn are read: real (and small) tensors
            return super().draws(step)

    def save(self) -> None:
        """What `save_outputs` holds: the host copy of the adapter each file is written from (of the denoiser
        and, with a text-encoder LoRA, the CLIP encoders), and with an EMA, the trained weights kept on the
        device while the average is swapped in for its file."""
        models = [denoiser(self.pipe), *(getattr(self.pipe, c) for c in clip_encoders(self.kind))
                  ] if self.config.text_encoder_lr is not None else [denoiser(self.pipe)]
        elsewhere = self.tracker.elsewhere if self.on_host else contextlib.nullcontext
        with elsewhere():
            copies = [lora_state_dict(m) for m in models]
        del copies
        if self.learner.ema is not None:
            with self.learner.ema.applied(self.learner.named), elsewhere():
                copies = [lora_state_dict(m) for m in models]
            del copies

    def sample(self) -> None:
        """What the trainer's sample grid holds on the device: the VAE back, and one image sampled
        (`sampling`); with samples during training (and no text-encoder LoRA) the grid's images are the
        watch's of step 0 and the last step, and nothing is sampled again."""
        if not self.config.sample_steps:
            return
        model = denoiser(self.pipe)
        if self.config.checkpointing_policy():
            disable_checkpointing(model)
        model.eval()
        with self.encoders.on_device(["vae"]):
            self.tracker.track(_encoder_tensors(self.encoders))  # back on the device, also what no op reads
            if not (self.samples_while_training() and self.config.text_encoder_lr is None):
                self.sampling(1)

    def sampling(self, prompts: int) -> None:
        """One sampler call for `prompts` prompts with the VAE on the device: the prompts' inputs (encoded
        while caching) on the device, one denoiser call on the guidance batch (every sampling step costs the
        same) and the decode of one image (the VAE slices), each by the function `diffusion.sampling.sample`
        uses. diffusers' sampling loop itself cannot run on fake tensors (its scheduler reads timestep
        values), so this is what the plan models: `bench_planner.py --real-cpu` checks it against a measured
        run."""
        model, kind, pipe = denoiser(self.pipe), self.kind, self.encoders.pipe
        _, inputs = self.samples
        with torch.no_grad():
            inputs = {k: v[:1].to(CPU, model.dtype if v.is_floating_point() else v.dtype)  # one prompt's,
                      for k, v in inputs.items()}  # on the device (a text mask stays bool)
            if prompts > 1:
                inputs = {k: v.expand(prompts, *v.shape[1:]).contiguous() for k, v in inputs.items()}
            embeds = {k: v for k, v in inputs.items() if not k.startswith("negative_")}
            if not kind.guidance_embedding:  # classifier-free guidance: the unconditional input too
                embeds = {k: torch.cat([inputs[f"negative_{k}"], v]) for k, v in embeds.items()}
            size = default_resolution(pipe) // pipe.vae_scale_factor
            channels = (getattr(model.config, "out_channels", None)
                        or model.config.in_channels // kind.latent_packing**2)
            latents = torch.randn(len(embeds["prompt_embeds"]), channels, size, size, dtype=model.dtype)
            t = torch.full((len(latents),), 0.5 if kind.objective == "flow" else 500.0)
            with one_of_identical_blocks(model):
                out = predict(kind, model, latents, t, embeds, vae_scale_factor=pipe.vae_scale_factor)
            del latents
            with vae_decoding(pipe.vae, self.config.vae_tiling):
                decode_latents(pipe, out[:1])

    def finish(self) -> None:
        pass  # the peaks are read after the fake tensors' contexts (`peaks`)

    def peaks(self) -> RunPeaks:
        """Each phase's peak, and the training step's in parts."""
        tracker, step, pipe = self.tracker, self.step_parts, self.pipe
        swap = block_swap(denoiser(pipe))
        on_host = {id(t.untyped_storage()) for h in (swap.host if swap else ()) for t in h.values()}
        model = denoiser(pipe)
        persistent = {"frozen weights": storage_bytes(t for t in (*model.parameters(), *model.buffers())
                                                      if not t.requires_grad and id(t.untyped_storage())
                                                      not in on_host),
                      "resident (VAE, text encoders)": step["resident"],
                      "adapter weights": step["adapters"], "optimizer state": step["state"],
                      "EMA of the adapter": step["ema"], "cached data": self.cached_bytes}
        parts = {**persistent, "gradients": step["grads"] if step["phase"] == "optimizer step" else 0,
                 "saved activations (live at peak)": step["saved_at_peak"]}
        parts["working set at peak"] = tracker.phase_peaks["train step"] - sum(parts.values())
        return RunPeaks({p: tracker.phase_peaks[p] for p in PHASES}, parts, step["phase"], step["saved"],
                        step["grads"], dict(self.rules.used), swap.bytes_per_step() if swap else 0,
                        self.resolution, self.host_bytes(swap))

    def host_bytes(self, swap) -> dict[str, int]:
        """Each phase's host memory: on the CPU its device bytes (the host is the device); elsewhere the
        dataset's cache (`host_cache`: with a disk cache its latents are mapped files' pages, not counted),
        the text encoders and VAE while off the device (all but the cache phase, where they work, and the
        VAE in the sample phase), the swapped blocks' pinned copies."""
        if not self.on_host:
            return {p: self.tracker.phase_peaks[p] for p in PHASES}
        peak, kept = self.host_cache
        parked = {} if self.config.keeps_encoders() else self.encoder_bytes
        swapped = storage_bytes(t for h in swap.host for t in h.values()) if swap else 0
        return {"cache": peak, "load": kept + sum(parked.values()), "train step": kept + sum(parked.values())
                + swapped, "save": kept + sum(parked.values()) + swapped,
                "sample": kept + sum(parked.values()) - parked.get("vae", 0) + swapped}


@contextlib.contextmanager
def _collect_young_only():
    """The trainer's stages call gc.collect() where they drop modules (3-5 times a run); in a plan each such
    collection would walk every object of the process (diffusers, transformers and torch imported: ~0.5-1 s
    each). What was made before the plan cannot hold the plan's fake tensors, so it is frozen (gc.freeze)
    for the plan: a collection walks only what the plan made, and frees the same."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _encoder_tensors(encoders) -> list[torch.Tensor]:
    return [t for name in encoders.names for m in [getattr(encoders.pipe, name)] if m is not None
            for t in (*m.parameters(), *m.buffers())]
