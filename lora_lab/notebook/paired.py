"""Knobs compared with a default run seed by seed (notebook 11): paired differences, verdicts, table, figure.

    differences(results, model, name, metric) -> [knob - default for each training seed]
    verdict(diffs) -> "higher" | "lower" | "same"
    table(results, metrics) -> a Markdown table: each knob's mean (range) and its paired difference
    paired_figure(results, metrics, off_scale) -> matplotlib Figure: one panel per metric, a row per knob,
        a dot per seed at its difference from the default run of the same seed, on a linear axis

`results` maps (model, knob name) to one dict of measurements per training seed, in the same seed order for
every knob; the knob named "default" is each model's default run. Pairing removes what a seed does to every
knob alike (its data order, noise and adapter init): a knob's effect is the difference on the same seed.
A verdict is "higher" (or "lower") only when every seed's difference lies above (below) zero: beyond the
spread of the paired differences; otherwise "same" (no difference this run can tell from the seeds' own
spread).
"""

from __future__ import annotations

DEFAULT = "default"


def differences(results: dict, model: str, name: str, metric: str) -> list[float]:
    """The knob's measurement minus the default's, seed by seed."""
    pairs = zip(results[(model, name)], results[(model, DEFAULT)], strict=True)
    return [r[metric] - d[metric] for r, d in pairs]


def verdict(diffs: list[float]) -> str:
    """'higher' when every paired difference is above zero, 'lower' when every one is below, else 'same'."""
    return "higher" if min(diffs) > 0 else "lower" if max(diffs) < 0 else "same"


def table(results: dict, metrics: dict[str, str]) -> str:
    """Markdown: per knob and metric the mean (min..max) over the seeds, the paired difference and verdict."""
    head = "| base | knob | " + " | ".join(f"{t} | difference (seeds) | verdict" for t in metrics.values())
    head += " |"
    rows = [head, "| --- | --- |" + " ---: | ---: | --- |" * len(metrics)]
    for model, name in results:
        cells = []
        for metric in metrics:
            v = [r[metric] for r in results[(model, name)]]
            digits = 3 if metric == "val_loss" else 2
            cells.append(f"{sum(v) / len(v):.{digits}f} ({min(v):.{digits}f}..{max(v):.{digits}f})")
            if name == DEFAULT:
                cells += ["", ""]
                continue
            d = differences(results, model, name, metric)
            cells += [", ".join(f"{x:+.{digits}f}" for x in d), verdict(d)]
        rows.append(f"| {model} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def paired_figure(results: dict, metrics: dict[str, str], off_scale: dict[str, float]):
    """Dots at each seed's difference from the default; a value beyond `off_scale[metric]` (a half-width of
    the axis) is drawn at the edge as a triangle with its value written beside it."""
    import matplotlib.pyplot as plt  # the notebooks extra

    knobs = [(m, n) for m, n in results if n != DEFAULT]
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 0.42 * len(knobs) + 1.6), sharey=True,
                             squeeze=False)
    axes = axes[0]
    colour = {"higher": "C3", "lower": "C0", "same": "0.55"}
    for ax, (metric, title) in zip(axes, metrics.items()):
        limit = off_scale[metric]
        for row, (model, name) in enumerate(knobs):
            d = differences(results, model, name, metric)
            c = colour[verdict(d)]
            inside = [x for x in d if abs(x) <= limit]
            ax.plot(inside, [row] * len(inside), "o", color=c, alpha=0.75)
            for side in (1, -1):  # the values beyond the axis on each side: one triangle, every value written
                out = [x for x in d if x * side > limit]
                if out:
                    edge = limit * 0.97 * side
                    ax.plot([edge], [row], ">" if side > 0 else "<", color=c, ms=9)
                    ax.annotate("off scale: " + ", ".join(f"{x:+.2f}" for x in out), (edge, row),
                                xytext=(-6 * side, 7), textcoords="offset points",
                                ha="right" if side > 0 else "left", fontsize=7, color=c)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_xlim(-limit, limit)
        ax.set_title(f"{title}: knob - default", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(knobs)), [f"{m}: {n}" for m, n in knobs])
    axes[0].invert_yaxis()
    handles = [plt.Line2D([], [], marker="o", ls="", color=c) for c in colour.values()]
    names = [f"{v} (every seed)" if v != "same" else "same: not every seed on one side" for v in colour]
    fig.legend(handles, names, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
