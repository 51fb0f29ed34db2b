"""Each phase's bar adds up to its peak, and a part too thin to see is named at the bar's end."""

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

from lora_lab.notebook.phases import GiB, phase_bars, phase_segments  # noqa: E402

PARTS = {"frozen weights": 5 * GiB, "adapter weights": GiB // 20, "optimizer state": GiB // 40,
         "gradients": 0, "saved activations (live at peak)": GiB // 2, "working set at peak": GiB // 4}
PLAN = SimpleNamespace(phases={"cache": 3 * GiB, "load": 5 * GiB + 7, "train step": sum(PARTS.values()),
                               "save": 5 * GiB + GiB // 10, "sample": 6 * GiB},
                       parts=PARTS, peak=6 * GiB, peak_phase="sample")


def test_every_phase_splits_into_parts_that_add_up_to_its_peak():
    segments = phase_segments(PLAN)
    assert set(segments) == set(PLAN.phases)
    for phase, parts in segments.items():
        assert sum(parts.values()) == PLAN.phases[phase], phase
    assert segments["cache"] == {"text encoders and VAE (caching the data)": 3 * GiB}
    assert segments["train step"]["adapter, its gradients and optimizer state"] == GiB // 20 + GiB // 40


def test_the_figure_prints_totals_and_names_the_thin_adapter():
    fig = phase_bars({"sdxl": PLAN}, budget=24 * GiB, title="fits?")
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "6.0 GiB  <- the run's peak" in labels
    assert any(t.startswith("5.8 GiB (of which adapter 0.07)") for t in labels)
