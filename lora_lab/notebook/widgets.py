"""The notebooks' plumbing for views: a figure under a slider, and notebook 03's accuracy-and-digits view.

    slider_view(draw, start=1.0, low=0.0, high=1.5)   # draw(t) -> a matplotlib Figure, redrawn as t moves

In JupyterLab the figure is rendered to PNG and shown in an `Image` widget under a `FloatSlider` (it works
with any matplotlib backend); in a batch run (`batch_run()`) it is drawn once, at `start`, as a plain image:
nobody can move a slider there, and widget messages can stall papermill's client. matplotlib, IPython and
ipywidgets are imported when a view is made: they belong to the notebooks extra.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import LoraLabError
from .record import batch_run


class WidgetError(LoraLabError, ValueError):
    """A view asked for with a start outside its slider's range, or with nothing to draw."""


def figure_png(fig, dpi: int = 80) -> bytes:
    """`fig` as PNG bytes; the figure is closed (a view redraws a new one each time)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def slider_view(draw: Callable[[float], Any], *, start: float = 1.0, low: float = 0.0, high: float = 1.5,
                step: float = 0.05, description: str = "adapter strength t"):
    """Show `draw(t)`'s figure under a slider over [low, high] that redraws it when moved (released).
    Returns the (slider, image) widgets, or None in a batch run, where the figure at `start` is shown once."""
    from IPython.display import Image, display

    if not low <= start <= high or step <= 0:
        raise WidgetError(f"slider_view: start {start} must lie in [{low}, {high}] and step {step} be > 0")
    if batch_run():
        display(Image(figure_png(draw(start))))
        return None
    import ipywidgets as widgets

    slider = widgets.FloatSlider(value=start, min=low, max=high, step=step, description=description,
                                 style={"description_width": "initial"}, continuous_update=False)
    picture = widgets.Image(value=figure_png(draw(start)), format="png")
    slider.observe(lambda change: setattr(picture, "value", figure_png(draw(change["new"]))), names="value")
    display(widgets.VBox([slider, picture]))
    return slider, picture


def accuracy_and_digits(title: str, accuracies: Mapping[str, Sequence[float]], digits: torch.Tensor,
                        labels: Sequence[str], tasks: Sequence[str] = ("0-4", "5-9")):
    """A bar pair per model (its accuracy on each task) beside a row of digits titled with `labels`."""
    import matplotlib.pyplot as plt

    if len(digits) != len(labels) or not accuracies:
        raise WidgetError(f"accuracy_and_digits: {len(digits)} digits for {len(labels)} labels, "
                          f"{len(accuracies)} models")
    side = int(digits[0].numel() ** 0.5)
    fig, (ax, *digit_axes) = plt.subplots(1, 1 + len(digits), figsize=(3 + len(digits), 2.2),
                                          gridspec_kw={"width_ratios": [3] + [1] * len(digits)})
    for i, acc in enumerate(accuracies.values()):
        for j, a in enumerate(acc):
            ax.bar(i + 0.4 * (j - 0.5), a, width=0.4, color=f"C{j}",
                   label=f"digits {tasks[j]}" if i == 0 else None)
    ax.set_xticks(range(len(accuracies)), list(accuracies))
    ax.set_ylim(0, 1.3)  # room above the bars for the legend
    ax.set_yticks([0, 0.5, 1])
    ax.set_ylabel("test accuracy")
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    ax.set_title(title, fontsize=8)
    for a, img, label in zip(digit_axes, digits, labels):
        a.imshow(img.reshape(side, side).numpy(), cmap="gray_r")
        a.set_axis_off()
        a.set_title(label, fontsize=8)
    return fig
