"""The memory planner: predicted peaks against a real training step of lora_lab's trainer (tiny models, CPU),
the breakdown's parts against their own exact counts, the attention backends, fit's choices, budgets.

The full matrix (sd15/sdxl/sd3/flux x checkpointing x adamw/adamw8bit x fp32/bf16) is
`python benchmarks/bench_planner.py --validate`; two corners of it run here.
"""

import pytest
import torch
import torch.nn.functional as F

from lora_lab.diffusion import TrainConfig
from lora_lab.diffusion.trainer import PHASES
from lora_lab.memory import LiveBytes, saved_activation_bytes
from lora_lab.planning import (
    PlanError,
    fit_vram,
    measure_run,
    measure_training_step,
    parse_bytes,
    plan_memory,
    planner,
)
from lora_lab.planning.fakedevice import DeviceRules
from lora_lab.planning.run import RunPeaks

TOLERANCE = 0.05  # the claim: predicted peak within 5% of the measured peak


@pytest.mark.parametrize("kind,ckpt,opt,mp", [("sd15", False, "adamw", "no"),
                                              ("sdxl", True, "adamw8bit", "bf16")])
@pytest.mark.slow
def test_predicted_peak_matches_a_real_trainer_step(tmp_path, kind, ckpt, opt, mp):
    measured = measure_training_step(TrainConfig(model=kind, output=str(tmp_path), rank=8,
                                                 gradient_checkpointing=ckpt, optimizer=opt,
                                                 mixed_precision=mp))
    plan = plan_memory(kind, size="tiny", device="cpu", base_dtype="fp32", rank=8,
                       gradient_checkpointing=ckpt, optimizer=opt, mixed_precision=mp)
    assert plan.step_peak == pytest.approx(measured["peak"], rel=TOLERANCE)
    assert plan.parts["optimizer state"] == measured["optimizer_state"]  # exact, optimizer_state_bytes
    assert sum(plan.parts.values()) == plan.step_peak
    assert plan.peak == max(plan.phases.values()) and plan.peak_phase in plan.phases
    assert plan.attention == "native (cpu)"


@pytest.mark.slow
@pytest.mark.parametrize("kind,quantization", [("sdxl", None), ("sd3", "nf4")])
def test_every_phase_of_a_run_is_planned_within_the_tolerance(tmp_path, kind, quantization):
    """Each phase of a real run of the trainer (caching, loading, the steps, saving, sampling), measured with
    LiveBytes on the CPU, against the plan of the same run made from the trainer's own stages."""
    config = TrainConfig(model=kind, output=str(tmp_path), rank=8, steps=2, sample_steps=1, progress=False,
                         base_quantization=quantization, device="cpu")
    measured = measure_run(config)
    plan = plan_memory(config)  # the run's own config: one vocabulary
    assert list(plan.phases) == list(measured) == list(PHASES)
    for phase in PHASES:
        assert plan.phases[phase] == pytest.approx(measured[phase], rel=TOLERANCE), phase


@pytest.mark.slow
def test_an_ema_and_a_text_encoder_lora_are_planned_within_the_tolerance(tmp_path):
    """The EMA's fp32 copy (train step, save) and the text encoders kept on the device with their LoRA (its
    weights, grads and optimizer state; the captions through them at each step): every phase of a real run
    against its plan, and the plan's parts against the run's own files."""
    from safetensors.torch import load_file

    config = TrainConfig(model="sd15", output=str(tmp_path), rank=8, steps=1, sample_steps=0, progress=False,
                         device="cpu", ema_decay=0.9, text_encoder_lr=1e-4)
    measured = measure_run(config)
    plan = plan_memory(config)
    for phase in ("cache", "load", "train step", "save"):  # no sample grid: the plan's sample phase is 0
        assert plan.phases[phase] == pytest.approx(measured[phase], rel=TOLERANCE), phase
    trained = load_file(str(tmp_path / "lora.safetensors"))  # the UNet's and the text encoder's LoRA, fp32
    adapter = sum(4 * t.numel() for k, t in trained.items() if not k.endswith(".alpha"))
    assert any(k.startswith("lora_te_") for k in trained)
    assert plan.parts["adapter weights"] == plan.parts["EMA of the adapter"] == adapter
    assert plan.parts["resident (VAE, text encoders)"] > 0  # kept on the device, not released after caching


@pytest.mark.slow
def test_caching_with_a_quantized_text_encoder_is_planned_within_the_tolerance(tmp_path):
    """Tiny SD1.5 with CLIP quantized to nf4 for caching: each phase of a real run on the CPU (the encoder in
    fp32 until each Linear is quantized), counted by LiveBytes, against its plan. (PyTorch's MemTracker
    counts 0.3 MiB less in every phase: the process-wide quantization tables, made before it starts; a CUDA
    run makes them on the device when it first quantizes, and keeps them, as the plan counts.)"""
    config = TrainConfig(model="sd15", output=str(tmp_path), rank=8, steps=1, sample_steps=1, progress=False,
                         device="cpu", text_encoder_quantization="nf4")
    measured = measure_run(config)
    plan = plan_memory(config, cache=False)
    for phase in PHASES:
        assert plan.phases[phase] == pytest.approx(measured[phase], rel=TOLERANCE), phase


@pytest.mark.slow
def test_quantized_text_encoders_shrink_the_planned_cache_phase_by_the_bytes_their_codes_save(tmp_path):
    """A GPU plan (bf16, tiny SD1.5): with an fp8 CLIP the cache phase is smaller than with a bf16 one by what
    the codes save on every Linear weight, less at most one weight dequantized for its product (fp32, then
    bf16: `QuantLinear`); the phases after caching (the encoder in host memory) are the same but for the
    float8 decoding table the device keeps."""
    from lora_lab.models import model_kind, shipped_base
    from lora_lab.models.bases import open_base

    plans = {fmt: plan_memory(TrainConfig(model="sd15", output=str(tmp_path), rank=8, steps=1, sample_steps=0,
                                          progress=False, device="cuda", text_encoder_quantization=fmt),
                              cache=False) for fmt in (None, "fp8")}
    pipe = open_base(model_kind("sd15"), shipped_base("sd15"), torch.bfloat16).pipe  # as the plans open it
    weights = [m.weight for m in pipe.text_encoder.modules() if type(m) is torch.nn.Linear]
    saved = sum(w.numel() * w.element_size() - (w.numel() + 4) for w in weights)  # -> fp8 codes, a scale
    dequantized = max(w.numel() for w in weights) * (4 + 2)
    shrink = plans[None].phases["cache"] - plans["fp8"].phases["cache"]
    assert saved - dequantized <= shrink <= saved, (shrink, saved, dequantized)
    for phase in ("load", "train step", "save"):  # + float8's table of 256 fp32 values, kept on the device
        assert plans["fp8"].phases[phase] - plans[None].phases[phase] == 256 * 4, phase


@pytest.mark.slow
def test_saved_activations_equal_saved_activation_bytes():
    """The plan's saved bytes (fake tensors) = memory.saved_activation_bytes of the same forward on real
    tensors."""
    from lora_lab.diffusion import objective_for
    from lora_lab.diffusion.step import denoising_loss
    from lora_lab.diffusion.trainer import add_adapter
    from lora_lab.models import build_components, model_kind

    config = TrainConfig(model="sdxl", rank=8)
    unet = build_components("sdxl")["unet"]
    add_adapter(unet, config, model_kind("sdxl"))
    unet.train()
    pipe = type("P", (), {"unet": unet, "vae_scale_factor": 2})()
    x0, noise = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    cond = {"prompt_embeds": torch.randn(1, 16, 64), "pooled_prompt_embeds": torch.randn(1, 32)}
    t = torch.tensor([500])
    measured = saved_activation_bytes(lambda: denoising_loss(config, model_kind("sdxl"), pipe,
                                                             objective_for("sdxl"), x0, noise, t, cond))
    plan = plan_memory("sdxl", size="tiny", device="cpu", base_dtype="fp32", rank=8, mixed_precision="no")
    assert plan.saved_activations == measured


def test_live_bytes_counts_allocations_and_frees():
    tracker = LiveBytes()
    with tracker:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # +4000
        del b
        c = a.view(10, 100)  # a view: nothing new
        d = torch.empty(250, dtype=torch.float64)  # +2000
    assert tracker.peak == 8000
    assert tracker.current == 6000
    del a, c, d
    assert tracker.current == 0


def _saved_by_attention(backend: str, dtype=torch.bfloat16) -> int:
    """Bytes autograd keeps for one SDPA call on (B, H, L, D) = (1, 2, 256, 64) under a backend."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.randn(1, 2, 256, 64, dtype=dtype, requires_grad=True) for _ in range(3))
        tracker = LiveBytes()
        tracker.in_forward = True
        with tracker, DeviceRules(backend, "cuda"), torch.autograd.graph.saved_tensors_hooks(
                tracker.mark_saved, lambda x: x):
            out = F.scaled_dot_product_attention(q.transpose(1, 2).transpose(1, 2), k, v)
        del out
        return tracker.saved_bytes


def test_attention_backends_save_what_they_keep():
    L, D, H = 256, 64, 2
    flash = _saved_by_attention("flash")
    # flash keeps q, k, v (inputs, not new) and the output (bf16) and the log-sum-exp (fp32, B x H x L),
    # rng state
    assert flash >= H * L * D * 2 + H * L * 4
    assert flash < H * L * D * 2 + H * L * 4 + 64
    math_ = _saved_by_attention("math")
    assert math_ > H * L * L * 2  # the L x L probabilities
    assert _saved_by_attention("auto", torch.float32) == _saved_by_attention("efficient", torch.float32)


def _plan(model, peak, options, phase="train step"):
    phases = dict.fromkeys(PHASES, 0)
    phases[phase] = peak
    return planner.MemoryPlan(model, "tiny", options, "flash", phases, {"activations": peak}, peak, phase,
                              "backward", 0, 0)


def test_fit_tries_fast_options_first(monkeypatch):
    """fit's order: no checkpointing before checkpointing, adamw before adamw8bit, the largest micro-batch."""
    calls = []

    def fake_plan(config, **kw):
        c = config
        calls.append((c.gradient_checkpointing, c.optimizer, c.batch_size))
        peak = (10 * c.batch_size + (0 if c.gradient_checkpointing else 20)
                + (0 if c.optimizer == "adamw8bit" else 1))
        options = {"batch_size": c.batch_size, "grad_accum": c.grad_accum, "vae_tiling": False,
                   "gradient_checkpointing": c.gradient_checkpointing, "optimizer": c.optimizer,
                   "blocks_to_swap": 0}
        return _plan(c.model, peak, options)

    monkeypatch.setattr(planner, "plan_memory", fake_plan)
    r = fit_vram(45, "sdxl", batch_size=4)  # no-ckpt adamw: 31 (b1) fits, b4 71 no, b2 41 fits
    assert r.settings == {"gradient_checkpointing": False, "optimizer": "adamw", "batch_size": 2,
                          "grad_accum": 2, "vae_tiling": False, "blocks_to_swap": 0}
    assert calls == [(False, "adamw", 1), (False, "adamw", 4), (False, "adamw", 2)]
    calls.clear()
    r = fit_vram(30, "sdxl")  # adamw 31 does not fit, adamw8bit 30 does
    assert r.settings["optimizer"] == "adamw8bit" and not r.settings["gradient_checkpointing"]
    r = fit_vram(11, "sdxl")  # checkpointing, adamw: 11 fits
    assert r.settings["gradient_checkpointing"] and r.settings["optimizer"] == "adamw"
    r = fit_vram(10, "sdxl")
    assert r.settings["gradient_checkpointing"] and r.settings["optimizer"] == "adamw8bit"
    with pytest.raises(PlanError,
                       match=r"smallest predicted peak is .* in the train step, of which activations"):
        fit_vram(5, "sdxl")


def test_fit_decodes_samples_in_tiles_where_only_sampling_does_not_fit(monkeypatch):
    def fake_plan(config, **kw):
        options = {k: getattr(config, k) for k in ("batch_size", "grad_accum", "gradient_checkpointing",
                                                   "optimizer", "vae_tiling", "blocks_to_swap")}
        return _plan(config.model, 9 if config.vae_tiling else 30, options,
                     "sample" if not config.vae_tiling else "train step")

    monkeypatch.setattr(planner, "plan_memory", fake_plan)
    r = fit_vram(10, "sdxl")
    assert r.settings["vae_tiling"] and not r.settings["gradient_checkpointing"]
    assert "vae tiling" in r.reason()


def _counting_plan_run(monkeypatch, peak_of=None):
    """plan_run replaced by one that counts its calls and gives each option's peak from `peak_of(config)`."""
    calls = []
    real = planner.plan_run

    def counting(config, **kw):
        calls.append(config)
        if peak_of is None:
            return real(config, **kw)
        peak = peak_of(config)
        return RunPeaks({p: peak if p == "train step" else 0 for p in PHASES}, {"activations": peak},
                        "backward", 0, 0, {"flash": 1}, resolution=1024)

    monkeypatch.setattr(planner, "plan_run", counting)
    return calls


@pytest.mark.slow
def test_fit_reuses_the_plans_it_is_given(monkeypatch):
    """fit_vram(plans=...): an option already planned (same options) is not planned again; another one is."""
    calls = _counting_plan_run(monkeypatch)
    kw = {"size": "tiny", "device": "cpu", "base_dtype": "fp32", "rank": 4, "mixed_precision": "no",
          "sample_steps": 0}
    plans = [plan_memory("sd15", gradient_checkpointing=ck, optimizer=opt, **kw)
             for ck in (False, True) for opt in ("adamw", "adamw8bit")]
    assert len(calls) == 4
    r = fit_vram(max(p.peak for p in plans), "sd15", plans=plans, **kw)  # the first option fits
    assert r.chosen is plans[0] and r.tried == [plans[0]] and len(calls) == 4
    smallest = min(plans, key=lambda p: p.peak)
    # only the smallest fits: every option tried, the fastest and the least memory first, none re-planned
    r = fit_vram(smallest.peak, "sd15", plans=plans, **kw)
    assert r.chosen is next(p for p in plans if p.fits(smallest.peak)) and len(calls) == 4
    assert r.tried[:2] == [plans[0], plans[3]] and all(p in plans for p in r.tried)
    # other options: planned
    r = fit_vram(max(p.peak for p in plans), "sd15", plans=plans, **{**kw, "rank": 2})
    assert r.chosen not in plans and len(calls) == 5


def test_cli_plan_vram_plans_each_option_once(monkeypatch, capsys):
    """`lora-lab plan --vram` prints the table of 4 options and fit's choice from the same 4 plans."""
    from lora_lab.cli import main

    # only checkpointing fits 24 GiB
    calls = _counting_plan_run(monkeypatch, lambda c: (10 if c.gradient_checkpointing else 30) * 2**30)
    assert main(["plan", "--model", "sdxl", "--vram", "24GiB"]) == 0
    assert [(c.gradient_checkpointing, c.optimizer) for c in calls] == [
        (False, "adamw"), (False, "adamw8bit"), ("full", "adamw"), ("full", "adamw8bit")]
    out = capsys.readouterr().out
    assert "chose checkpointing, adamw, batch 1" in out and "train step" in out and "sample" in out


@pytest.mark.parametrize("command", ["plan", "train"])
def test_cli_vram_that_does_not_parse_is_refused_before_any_planning(command, monkeypatch, capsys):
    """A bad --vram ends in argparse's one-line error (exit 2) when the flags are read: nothing is planned."""
    from lora_lab.cli import main

    calls = _counting_plan_run(monkeypatch, lambda c: 1)
    for bad in ("24XB", "24i", "9" * 400 + "GiB"):
        with pytest.raises(SystemExit) as e:
            main([command, "--model", "sdxl", "--vram", bad])
        assert e.value.code == 2
        assert "argument --vram: cannot read memory size" in capsys.readouterr().err
    assert calls == []


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("24G") == 24 * 2**30
    assert parse_bytes("24GB") == 24 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5KiB") == 1536
    assert parse_bytes(1000) == 1000
    for bad in ("24", "lots", "-3GiB", "0GiB", "GiB", "24i", "9" * 400 + "GiB", "2000000000TiB", 0, -5, True):
        with pytest.raises(PlanError):
            parse_bytes(bad)


def test_small_sizes_are_printed_in_their_unit():
    assert planner.format_bytes(24 * 2**30) == "24.00 GiB"
    assert planner.format_bytes(512 * 2**20) == "0.50 GiB" and planner.format_bytes(50 * 2**20) == "50.0 MiB"
    assert planner.format_bytes(24) == "24 B" and planner.format_bytes(3000) == "2.9 KiB"


def test_bad_options_are_clear_errors(monkeypatch):
    """What the trainer refuses, the planner refuses (it runs the trainer's checks on the real shapes), and
    no option reaches a raw TypeError, OverflowError or diffusers' own error."""
    calls = _counting_plan_run(monkeypatch)
    with pytest.raises(PlanError, match="unknown real model"):
        plan_memory("sdxl-turbo")
    with pytest.raises(PlanError, match="attention"):
        plan_memory("sdxl", attention="xformers")
    with pytest.raises(PlanError, match="rank"):
        plan_memory("sdxl", size="tiny", rank=0)
    with pytest.raises(PlanError, match=r"unknown option\(s\) \['bogus_option'\]"):
        plan_memory("sdxl", bogus_option=1)
    with pytest.raises(PlanError, match=r"checkpoint_options \['bogus'\]"):
        plan_memory("sdxl", gradient_checkpointing=True, checkpoint_options={"bogus": 1})
    with pytest.raises(PlanError, match=r"unknown option\(s\) \[.ema.\]"):  # TrainConfig's: ema_decay
        plan_memory("sdxl", size="tiny", ema=True)
    assert calls == []  # each refused before anything was planned
    with pytest.raises(PlanError, match="rank=60000: larger than the targeted layer"):
        plan_memory("sd15", rank=60000, sample_steps=0)  # the real SD1.5's narrowest layer:
                                                          # what train checks
    with pytest.raises(PlanError, match="rank="):
        plan_memory("sd15", size="tiny", rank=10**30)
    with pytest.raises(PlanError, match="resolution=1000: the flux base needs a multiple of 16"):
        plan_memory("flux-dev", resolution=1000)
    with pytest.raises(PlanError, match="position embedding"):
        plan_memory("sd3", size="tiny", resolution=16384)


@pytest.mark.slow
def test_notebook_08_memory_plan(run_notebook):
    data = run_notebook("08_memory_plan", MODELS=[], SWEEP_RESOLUTIONS=[],
                        VALIDATE=[["sd3", False, "adamw", "no"]])
    assert data["passed"], data
    assert data["numbers"]["validation_worst_error"] <= TOLERANCE


@pytest.mark.slow
def test_cli_train_vram_that_nothing_fits_is_a_clear_error(tmp_path, capsys):
    from lora_lab.cli import main

    assert main(["train", "--model", "sd3", "--output", str(tmp_path / "out"), "--steps", "1",
                 "--vram", "1MiB"]) == 2
    err = capsys.readouterr().err
    # caching alone peaks above it: no option is planned past its load phase
    assert "nothing fits 1.0 MiB: the cache phase alone peaks at" in err and "before anything fit" in err
    assert not (tmp_path / "out").exists()  # refused before training started


@pytest.mark.slow
def test_train_dry_run_prints_every_phase_and_writes_nothing(tmp_path, capsys):
    from lora_lab.cli import main

    out = tmp_path / "out"
    assert main(["train", "--model", "sdxl", "--output", str(out), "--dry-run", "--rank", "4"]) == 0
    text = capsys.readouterr().out
    assert all(phase in text for phase in PHASES) and "<- the peak" in text and "frozen weights" in text
    assert not out.exists()


@pytest.mark.slow
def test_a_real_size_dry_run_plans_the_base_in_the_dtype_it_names(tmp_path, capsys):
    """`train --dry-run --base real:sd15 --base-dtype bf16`: the published SD1.5 UNet (859.5M parameters)
    planned in bf16 (2 bytes each), no weight file opened, nothing written."""
    from lora_lab.cli import main

    out = tmp_path / "out"
    assert main(["train", "--model", "sd15", "--base", "real:sd15", "--base-dtype", "bf16", "--resolution",
                 "256", "--output", str(out), "--dry-run", "--sample-steps", "0"]) == 0
    text = capsys.readouterr().out
    frozen = next(line for line in text.splitlines() if "frozen weights" in line)
    assert frozen.split()[-2:] == ["1.60", "GiB"], frozen  # 859,520,964 x 2 B
    assert "base bf16" in text and all(phase in text for phase in PHASES) and not out.exists()


def test_keeping_the_encoders_on_the_device_costs_exactly_their_bytes():
    kw = {"size": "tiny", "device": "cpu", "base_dtype": "fp32", "rank": 4, "mixed_precision": "no",
          "sample_steps": 0}
    kept, released = plan_memory("sdxl", keep_encoders=True, **kw), plan_memory("sdxl", **kw)
    assert released.parts["resident (VAE, text encoders)"] == 0
    resident = kept.parts["resident (VAE, text encoders)"]
    assert resident > 0 and kept.step_peak - released.step_peak == resident
    assert kept.options["keep_encoders"] is True


@pytest.mark.slow
def test_dora_locon_and_fp16_are_planned():
    kw = {"size": "tiny", "device": "cpu", "base_dtype": "fp32", "rank": 4}
    plain = plan_memory("sd15", mixed_precision="no", **kw)
    more = plan_memory("sd15", dora=True, conv=True, mixed_precision="fp16", **kw)
    assert more.parts["adapter weights"] > plain.parts["adapter weights"]  # magnitudes and LoCon convs
    assert more.options["mixed_precision"] == "fp16"


@pytest.mark.slow
def test_quantized_base_is_planned_as_stored(tmp_path):
    """base_quantization: the frozen weights are counted as `quantize_base` stores them (the same bytes as a
    quantized meta build), the int8 plan stays within the tolerance of a real trainer step on an int8 base,
    and NF4 plans less than int8, which plans less than the float base."""
    from diffusers import UNet2DConditionModel

    from lora_lab.memory import model_bytes
    from lora_lab.models.builders import CONFIGS
    from lora_lab.quant import quantize_base

    kw = {"size": "tiny", "device": "cpu", "base_dtype": "fp32", "rank": 8, "mixed_precision": "no"}
    measured = measure_training_step(TrainConfig(model="sdxl", output=str(tmp_path), rank=8,
                                                 base_quantization="int8"))
    plans = {q: plan_memory("sdxl", base_quantization=q, **kw) for q in (None, "int8", "nf4")}
    assert plans["int8"].step_peak == pytest.approx(measured["peak"], rel=TOLERANCE)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(CONFIGS["sdxl"]["unet"]).requires_grad_(False)
    quantize_base(unet, "nf4")
    assert plans["nf4"].parts["frozen weights"] == model_bytes(unet)
    assert plans["nf4"].step_peak < plans["int8"].step_peak < plans[None].step_peak
    assert plans["nf4"].options["base_quantization"] == "nf4"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sdxl", "sd3", "flux"])
def test_every_checkpointing_policy_is_planned_under_the_gpu_rules(kind):
    """The planner's default: CUDA rules, bf16 autocast, fake tensors. Selective and budgets record the
    blocks' ops there too (prim.device questions, casts cached by autocast, Flux's rotary embeddings in a
    tuple argument each broke them before), and a budget keeps what it planned."""
    saved = {}
    for policy in ("none", "full", "selective", "budget:0.3"):
        options = ({} if policy == "none"
                   else {"gradient_checkpointing": True, "checkpoint_options": {"policy": policy}})
        saved[policy] = plan_memory(kind, size="tiny", **options).saved_activations
    assert saved["full"] < saved["budget:0.3"] < saved["selective"] < saved["none"]
    assert saved["budget:0.3"] <= 0.3 * saved["none"] * 1.02


@pytest.mark.slow
def test_a_checkpointing_policy_is_planned_as_given_and_the_cli_plans_with_it(monkeypatch, capsys):
    """plan_memory(gradient_checkpointing="selective") plans selective (the trainer's spelling), not whole
    blocks; `lora-lab plan --gradient-checkpointing POLICY` plans its checkpointed options with that
    policy."""
    from lora_lab.cli import main

    full = plan_memory("sd3", size="tiny", gradient_checkpointing=True)
    selective = plan_memory("sd3", size="tiny", gradient_checkpointing="selective")
    same = plan_memory("sd3", size="tiny", gradient_checkpointing=True,
                       checkpoint_options={"policy": "selective"})
    assert selective.saved_activations == same.saved_activations > full.saved_activations
    assert "checkpointing selective" in selective.table()
    assert plan_memory("sd3", size="tiny", gradient_checkpointing="full").options == full.options

    calls = _counting_plan_run(monkeypatch, lambda c: (10 if c.gradient_checkpointing else 30) * 2**30)
    assert main(["plan", "--model", "sdxl", "--gradient-checkpointing", "budget:0.3", "--vram", "24GiB"]) == 0
    assert [c.gradient_checkpointing for c in calls] == [False, False, "budget:0.3",
                                                         "budget:0.3"]  # fit reused them
    assert "chose checkpointing budget:0.3, adamw, batch 1" in capsys.readouterr().out
    # nothing fits: the error also points at a policy that keeps less (the project's one exit code: 2)
    assert main(["plan", "--model", "sdxl", "--gradient-checkpointing", "selective", "--vram", "4GiB"]) == 2
    assert "or a checkpointing policy that keeps less than selective" in capsys.readouterr().err


@pytest.mark.slow
def test_a_plan_leaves_the_quantized_formats_tables_real():
    """A plan quantizes a base on fake tensors; the formats' cached lookup tables must be real ones after it
    (made first inside the plan they were fake, and every later NF4 quantization in the process was wrong)."""
    from lora_lab.quant import dequantize_weight, quantize_weight, weights

    for table in (weights._nf4_tables, weights._fp8_table, weights._fp8_values):
        table.cache_clear()
    plan_memory("sdxl", size="tiny", device="cpu", rank=4, base_quantization="nf4", sample_steps=0,
                cache=False)
    w = torch.randn(64, 64)
    for fmt in ("nf4", "fp8"):
        error = (dequantize_weight(quantize_weight(w, fmt), fmt, w.shape) - w).abs().max()
        assert error < 0.2 * w.abs().max(), fmt


def test_fit_keeps_the_optimizer_and_the_policy_it_does_not_choose(monkeypatch):
    """fit varies checkpointing, micro-batch and AdamW against 8-bit AdamW; a run's Prodigy (whose --lr is a
    multiplier: AdamW at lr 1.0 would diverge) and its checkpointing policy are kept."""
    calls = []

    def fake_plan(config, **kw):
        calls.append((config.gradient_checkpointing, config.optimizer, config.lr))
        options = {k: getattr(config, k) for k in ("batch_size", "grad_accum", "gradient_checkpointing",
                                                   "optimizer", "vae_tiling", "blocks_to_swap")}
        return _plan(config.model, 20 if config.gradient_checkpointing else 30, options)

    monkeypatch.setattr(planner, "plan_memory", fake_plan)
    r = fit_vram(25, TrainConfig(model="sd15", optimizer="prodigy", lr=1.0, device="cuda"))
    assert r.settings["optimizer"] == "prodigy" and {c[1] for c in calls} == {"prodigy"}
    calls.clear()
    r = fit_vram(25, TrainConfig(model="sd15", gradient_checkpointing="selective", device="cuda"))
    assert r.settings["gradient_checkpointing"] == "selective" and calls[-1][0] == "selective"
    with pytest.raises(PlanError, match="the model is the first argument"):
        plan_memory(model="flux-dev")
