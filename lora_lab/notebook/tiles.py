"""Samples as a person reads them: tiles with the strict reader's reading, the strip over steps, the strength
sweep, and the strength slider.

    reading_grid(rows, asked, reader, title="", note="") -> matplotlib Figure
        rows: {row label: images (N, 3, H, W) in [0, 1]}; asked: (N,) the digit each column asked for
    tiles_read(rows, asked, reader) -> {row label: tiles read as the digit asked for}
    show_strip(ax, strip, steps, row_labels): a run's samples/strip.png, a column per sampled step
    strength_figure(images, strengths, rates, accs) -> Figure: tiles at each strength beside the two rates
    strength_slider(sample_at, picture, reader, prompts, seed): the live widget (JupyterLab) of notebook 07

Every tile is drawn with nearest-neighbour pixels: what is shown is what the reader reads, each pixel a
square. A tile's title is what `effect.StrictReader` reads in it: the digit and its confidence, green when
it is the digit asked for with confidence >= STRICT_CONFIDENCE, red otherwise ("no digit": like no real
digit); a caption line under the grid says so on the figure itself.
"""

from __future__ import annotations

import torch

from .effect import STRICT_CONFIDENCE, StrictReader

READ = "#1a7f37"  # green: read as the digit asked for
NOT_READ = "#cf222e"  # red


def tile_label(digit: int, confidence: float, like_a_digit: bool) -> str:
    """What the reader says about one tile, in a few characters."""
    return f"{digit}  {confidence:.1f}" if like_a_digit else "no digit"


def caption(reader: StrictReader) -> str:
    """The line under a grid that says what a tile's title means."""
    return (f"Title: the digit the strict reader reads and its confidence (how many of its {reader.k} "
            f"nearest real digits agree); green: the digit asked for, confidence >= {STRICT_CONFIDENCE}. "
            f"'no digit': farther from every real digit than 99% of real digits are from theirs.")


def _tile(ax, image: torch.Tensor) -> None:
    ax.imshow(image.float().mean(0), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def reading_grid(rows: dict[str, torch.Tensor], asked, reader: StrictReader, title: str = "", note: str = ""):
    """A figure: one row of tiles per entry of `rows`, each titled with its strict reading; under it the
    caption line (and `note`, a line of the notebook's own)."""
    import matplotlib.pyplot as plt  # the notebooks extra

    asked = torch.as_tensor(asked)
    n = len(asked)
    fig, axes = plt.subplots(len(rows), n, figsize=(1.05 * n + 0.9, 1.5 * len(rows) + 0.5), squeeze=False)
    for r, (label, images) in enumerate(rows.items()):
        reading = reader.read(images[:n] * 2 - 1)
        ok = reader.confidence(images[:n] * 2 - 1, asked) >= STRICT_CONFIDENCE
        for c in range(n):
            ax = axes[r, c]
            _tile(ax, images[c])
            text = tile_label(reading.digit[c].item(), reading.confidence[c].item(),
                              reading.like_a_digit[c].item())
            ax.set_title(text, fontsize=9, color=READ if ok[c] else NOT_READ)
            for side in ax.spines.values():
                side.set_color(READ if ok[c] else NOT_READ)
                side.set_linewidth(2)
        axes[r, 0].set_ylabel(label, fontsize=9)
    for c in range(n):
        axes[-1, c].set_xlabel(f"asked {asked[c].item()}", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    lines = caption(reader) + (f"\n{note}" if note else "")
    fig.tight_layout(rect=(0, 0.06 + 0.04 * bool(note), 1, 1))
    fig.text(0.01, 0.01, lines, fontsize=7.5, va="bottom", wrap=True)
    return fig


def tiles_read(rows: dict[str, torch.Tensor], asked, reader: StrictReader) -> dict[str, int]:
    """How many of each row's first len(asked) tiles the reader reads as the digit asked for."""
    n = len(asked)
    return {label: int((reader.confidence(images[:n] * 2 - 1, asked) >= STRICT_CONFIDENCE).sum())
            for label, images in rows.items()}


def show_strip(ax, strip, steps, row_labels) -> None:
    """A run's strip (an (H, W, 3) array: one column of prompts per sampled step), steps and prompts named."""
    ax.imshow(strip, interpolation="nearest")
    column, row = (strip.shape[1] - 1) / len(steps), (strip.shape[0] - 1) / len(row_labels)
    ax.set_xticks([column * (i + 0.5) for i in range(len(steps))], [str(s) for s in steps])
    ax.set_yticks([row * (i + 0.5) for i in range(len(row_labels))], row_labels, fontsize=8)
    ax.set_xlabel("step")


def strength_figure(images, strengths, rates, accs):
    """Four tiles at each strength (images: one (4, 3, H, W) per strength) beside both rates against it."""
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 3.4))
    grid = fig.add_gridspec(4, len(strengths) + 4)
    for col, imgs in enumerate(images):
        for row in range(4):
            ax = fig.add_subplot(grid[row, col])
            _tile(ax, imgs[row])
            if row == 0:
                ax.set_title(f"t = {strengths[col]}", fontsize=8)
    ax = fig.add_subplot(grid[:, len(strengths) + 1:])
    ax.plot(strengths, rates, "o-", label="inverted rate")
    ax.plot(strengths, accs, "s--", label="digit rate (strict)")
    ax.set_xlabel("LoRA strength t")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8)
    return fig


def strength_slider(sample_at, picture, reader: StrictReader, prompts: list[str], seed: int):
    """Sliders for the strength and the digit and a button for a new seed; `sample_at(strength, prompt, seed)`
    gives the (1, 3, H, W) image in [0, 1], shown as `picture(image)` with the reader's reading. Returns the
    widget box."""
    import ipywidgets as widgets
    from IPython.display import display

    strength = widgets.FloatSlider(value=1.0, min=0.0, max=1.5, step=0.05, description="strength",
                                   continuous_update=False)
    digit = widgets.IntSlider(value=3, min=0, max=9, description="digit", continuous_update=False)
    button, shown, seeds = widgets.Button(description="sample"), widgets.Output(), [seed]

    def show(*_):
        img = sample_at(strength.value, prompts[digit.value], seeds[0])
        read = reader.read(img * 2 - 1)
        with shown:
            shown.clear_output(wait=True)
            display(picture(img))
            said = tile_label(read.digit.item(), read.confidence.item(), read.like_a_digit.item())
            print(f"'{prompts[digit.value]}', strength {strength.value:.2f}, seed {seeds[0]}: the strict "
                  f"reader reads {said}")

    def new_seed(_):
        seeds[0] += 1
        show()

    strength.observe(show, names="value")
    digit.observe(show, names="value")
    button.on_click(new_seed)
    show()
    return widgets.VBox([widgets.HBox([strength, digit, button]), shown])
