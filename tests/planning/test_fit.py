"""fit_vram without planning every option: the memory orders it relies on, checked phase by phase on every
kind; its choice against planning every option; a plan stopped after its load phase; `train --vram
--dry-run` planning once."""

import pytest

from lora_lab.diffusion.trainer import PHASES
from lora_lab.planning import fit, fit_vram, plan_memory, planner
from lora_lab.planning.run import BEFORE_OPTIONS, OverLimit

VARIANTS = [(ck, opt) for ck in fit.CHECKPOINTING_ORDER for opt in fit.OPTIMIZER_ORDER]  # time order
KW = {"size": "tiny", "rank": 4}  # a plan's defaults otherwise: CUDA's rules, bf16, samples
# One worker for the module (-n 2 --dist loadgroup): `plans`, every option planned in full, is then made once
# per kind, not once per test that reads it on each worker.
pytestmark = pytest.mark.xdist_group("fit_plans")


@pytest.fixture(scope="module", params=["sd15", "sdxl", "sd3", "flux"])
def plans(request):
    """Every option fit chooses between, planned in full, for a tiny base of each kind."""
    return request.param, {(ck, opt): plan_memory(request.param, gradient_checkpointing=ck, optimizer=opt,
                                                  cache=False, **KW) for ck, opt in VARIANTS}


def test_the_memory_orders_fit_relies_on_hold_in_every_phase(plans):
    """`fit._at_most(a, b)`: a's plan peaks at most where b's does, in every phase; the phases before the
    adapter are the same in every option, to the byte."""
    _, by_variant = plans
    pairs = [(a, b) for a in VARIANTS for b in VARIANTS if a != b and fit._at_most(a, b)]
    assert len(pairs) == 5  # 8-bit <= fp32 (each checkpointing), checkpointing <= none (each optimizer), both
    for a, b in pairs:
        for phase in PHASES:
            assert by_variant[a].phases[phase] <= by_variant[b].phases[phase], (a, b, phase)
    first = by_variant[VARIANTS[0]].phases
    assert all(p.phases[phase] == first[phase] for p in by_variant.values() for phase in BEFORE_OPTIONS)


def test_fit_chooses_what_planning_every_option_chooses(plans, monkeypatch):
    """For a card's memory at every peak and between: fit's choice is the fastest option whose full plan
    fits (the same plan), found without planning the options the memory orders rule out."""
    kind, by_variant = plans
    planned = []

    def plan_once(config, **kw):
        planned.append(config)
        return by_variant[(config.gradient_checkpointing, config.optimizer)]

    monkeypatch.setattr(planner, "plan_memory", plan_once)
    peaks = sorted({p.peak for p in by_variant.values()})
    for vram in sorted({*peaks, *(p - 1 for p in peaks), peaks[-1] + 1}):
        planned.clear()
        fitting = [v for v in VARIANTS if by_variant[v].fits(vram)]
        if not fitting:
            with pytest.raises(planner.PlanError, match="nothing fits"):
                fit_vram(vram, kind, **KW)
            # the fastest and the least memory planned, then only the last resort: blocks swapped
            four = [(c.gradient_checkpointing, c.optimizer) for c in planned
                    if not (c.blocks_to_swap or c.vae_tiling)]
            assert four == [VARIANTS[0], VARIANTS[-1]]
            continue
        r = fit_vram(vram, kind, **KW)
        assert r.chosen is by_variant[fitting[0]]
        if fitting[0] == VARIANTS[0]:
            assert len(planned) == 1  # the fastest fits: nothing else planned


def test_fit_plans_nothing_past_the_least_memory_where_it_does_not_fit(monkeypatch):
    """The fastest option and the one of least memory do not fit: with full checkpointing the two others are
    not planned."""
    calls = []

    def fake(config, **kw):
        calls.append((config.gradient_checkpointing, config.optimizer))
        options = {k: getattr(config, k) for k in ("batch_size", "grad_accum", "gradient_checkpointing",
                                                   "optimizer", "vae_tiling", "blocks_to_swap")}
        return planner.MemoryPlan(config.model, "tiny", options, "flash", {"train step": 100},
                                  {"activations": 100}, 100, "train step", "backward", 0, 0)

    monkeypatch.setattr(planner, "plan_memory", fake)
    monkeypatch.setattr(fit, "_swappable_blocks", lambda config: 0)
    with pytest.raises(planner.PlanError, match="smallest predicted peak is 100 B"):
        fit_vram(50, "sdxl")
    assert calls == [(False, "adamw"), (True, "adamw8bit")]
    calls.clear()  # another policy is not ordered against no checkpointing: 8-bit without it is planned
    with pytest.raises(planner.PlanError, match="smallest predicted peak is 100 B"):
        fit_vram(50, "sdxl", checkpointing="selective")
    assert calls == [(False, "adamw"), ("selective", "adamw8bit"), (False, "adamw8bit")]


def test_a_plan_stops_after_loading_where_the_phases_before_the_options_exceed_its_limit(plans):
    """plan_memory(limit=): OverLimit with the cache and load phases of the full plan, to the byte; a limit
    they fit is the full plan."""
    kind, by_variant = plans
    full = by_variant[VARIANTS[0]]
    before = {p: full.phases[p] for p in BEFORE_OPTIONS}
    with pytest.raises(OverLimit) as e:
        plan_memory(kind, cache=False, limit=max(before.values()) - 1, **KW)
    assert e.value.phases == before
    same = plan_memory(kind, cache=False, limit=max(before.values()), **KW)
    assert same.phases == full.phases and same.parts == full.parts


def test_fit_where_caching_or_loading_does_not_fit_names_the_phase():
    with pytest.raises(planner.PlanError, match=r"nothing fits 1.0 KiB: the (cache|load) phase alone peaks"):
        fit_vram("1KiB", "sd15", **KW)


def test_train_vram_dry_run_plans_the_run_once(monkeypatch, tmp_path, capsys):
    """`train --vram --dry-run` prints the plan fit chose (the run's own options), not planned again."""
    from lora_lab.cli import main

    calls = []
    real = planner.plan_run
    monkeypatch.setattr(planner, "plan_run", lambda config, **kw: calls.append(config) or real(config, **kw))
    assert main(["train", "--model", "sd15", "--output", str(tmp_path / "out"), "--rank", "4", "--vram",
                 "8GiB", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "chose no checkpointing, adamw" in out and all(phase in out for phase in PHASES)
    assert len(calls) == 1


def test_nothing_fits_advises_only_a_quantization_the_run_can_take():
    """The cache phase is the text encoders' (quantizing the base does not lower it); the base's quantization
    is refused for LoKr/LoHa and pointless where the base is quantized already (advised in every case before
    the fix: `--adapter loha` was told to pass `--base-quantization nf4`, which it refuses)."""
    from lora_lab.diffusion import TrainConfig

    lora, loha = TrainConfig(model="qwen-image"), TrainConfig(model="qwen-image", adapter="loha")
    assert fit._quantize(lora, "cache") == "quantize the text encoders (--text-encoder-quantization nf4), "
    assert fit._quantize(loha, "cache") == fit._quantize(lora, "cache")
    assert fit._quantize(lora, "sample") == "quantize the base (--base-quantization nf4), "
    assert fit._quantize(loha, "train step") == ""
    assert fit._quantize(TrainConfig(model="qwen-image", base_quantization="nf4"), "load") == ""
    assert fit._quantize(TrainConfig(model="qwen-image", text_encoder_quantization="int8"), "cache") == ""
    with pytest.raises(planner.PlanError) as e:
        fit_vram("1KiB", "sd15", adapter="loha", **KW)
    assert ("--text-encoder-quantization" in str(e.value)) == ("the cache phase" in str(e.value))
    assert "--base-quantization" not in str(e.value)
