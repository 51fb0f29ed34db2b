import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from lora_lab.notebook.record import BATCH_ENV  # noqa: E402
from lora_lab.notebook.widgets import WidgetError, accuracy_and_digits, figure_png, slider_view  # noqa: E402


def _draw(calls):
    def draw(t):
        calls.append(t)
        fig, ax = plt.subplots(figsize=(1, 1))
        ax.set_title(f"{t:.2f}")  # another t, another picture
        return fig
    return draw


def test_moving_the_slider_redraws_the_picture_at_its_value(monkeypatch):
    monkeypatch.delenv(BATCH_ENV, raising=False)
    calls = []
    slider, picture = slider_view(_draw(calls), start=1.0)
    first = bytes(picture.value)
    assert calls == [1.0] and first.startswith(b"\x89PNG")
    slider.value = 0.0  # what dragging the handle to 0 does
    assert calls == [1.0, 0.0] and bytes(picture.value) != first
    slider.value = 1.0
    assert calls[-1] == 1.0 and bytes(picture.value) == first  # the same t draws the same picture


def test_a_batch_run_shows_the_start_once_without_widgets(monkeypatch):
    monkeypatch.setenv(BATCH_ENV, "1")
    calls = []
    assert slider_view(_draw(calls), start=0.5) is None and calls == [0.5]


def test_a_start_outside_the_range_is_refused():
    with pytest.raises(WidgetError, match="start 2"):
        slider_view(_draw([]), start=2.0, low=0.0, high=1.5)


def test_accuracy_and_digits_draws_a_bar_per_model_and_task():
    accuracies = {"LoRA": (0.2, 0.9), "DoRA": (0.3, 0.8)}
    fig = accuracy_and_digits("t = 1", accuracies, torch.rand(3, 64), ["5", "6", "7"])
    bars = fig.axes[0].patches
    assert [round(b.get_height(), 2) for b in bars] == [0.2, 0.9, 0.3, 0.8]
    assert [a.get_title() for a in fig.axes[1:]] == ["5", "6", "7"]
    assert figure_png(fig).startswith(b"\x89PNG")
    with pytest.raises(WidgetError, match="2 digits for 3 labels"):
        accuracy_and_digits("t", {"LoRA": (0.1, 0.2)}, torch.rand(2, 64), ["5", "6", "7"])
