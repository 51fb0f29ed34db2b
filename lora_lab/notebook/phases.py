"""What holds memory in a LoRA training run, phase by phase, drawn from memory plans (notebook 08).

    phase_segments(plan) -> {phase: {segment: bytes}}: each phase's peak split into the four things a reader
        can tell apart (they add up to the phase's peak)
    phase_bars(plans, budget, title) -> matplotlib Figure: one panel per model, one stacked bar per phase,
        each bar's total printed at its end (with any segment too thin to see: named there with its size),
        the card's budget as a dashed line

A plan is anything with `phases` ({phase: peak bytes}) and `parts` (the training step's peak in parts, as
`lora_lab.planning.MemoryPlan` has them). Outside the training step only the frozen denoiser's weights are
known as a part; the rest of a phase is what that phase adds: the text encoders and VAE while caching, the
loading's temporaries, the adapter being written, the sampler's activations and the VAE's decoding.
"""

from __future__ import annotations

GiB = 2**30
SEGMENTS = {  # segment: colour
    "frozen denoiser weights": "#4c72b0",
    "adapter, its gradients and optimizer state": "#dd8452",
    "activations and working memory": "#55a868",
    "text encoders and VAE (caching the data)": "#8c8c8c",
}
THIN = 0.01  # a segment narrower than this share of the axis is named, not drawn
ADAPTER_PARTS = ("adapter weights", "optimizer state", "EMA of the adapter", "gradients")


def phase_segments(plan) -> dict[str, dict[str, int]]:
    """Each phase's peak in SEGMENTS (bytes; they add up to the phase's peak)."""
    weights = plan.parts["frozen weights"]
    adapter = sum(plan.parts.get(p, 0) for p in ADAPTER_PARTS)
    names = list(SEGMENTS)
    out = {}
    for phase, peak in plan.phases.items():
        if phase == "cache":
            out[phase] = {names[3]: peak}
        elif phase == "train step":
            out[phase] = {names[0]: weights, names[1]: adapter, names[2]: peak - weights - adapter}
        elif phase == "save":
            out[phase] = {names[0]: min(weights, peak), names[1]: max(0, peak - weights)}
        else:  # load, sample: the weights and what the phase works with
            out[phase] = {names[0]: min(weights, peak), names[2]: max(0, peak - weights)}
    return out


def phase_bars(plans: dict, budget: int, title: str):
    """One panel per model (plans: {model: plan}), one bar per phase in SEGMENTS, totals printed."""
    import matplotlib.pyplot as plt  # the notebooks extra

    fig, axes = plt.subplots(len(plans), 1, figsize=(11, 0.3 + 1.7 * len(plans)), sharex=True, squeeze=False)
    top = max(budget, *(p.peak for p in plans.values())) / GiB * 1.45  # room for the labels
    for ax, (model, plan) in zip(axes[:, 0], plans.items()):
        segments = phase_segments(plan)
        phases = list(segments)
        for row, phase in enumerate(phases):
            left, thin = 0.0, []
            for name, n in segments[phase].items():
                if n / GiB < THIN * top:  # too thin to see: named in the bar's label instead
                    thin.append(f"{name.split(',')[0]} {n / GiB:.2f}")
                ax.barh(row, n / GiB, left=left, color=SEGMENTS[name], height=0.7)
                left += n / GiB
            label = f"{left:.1f} GiB" + (f" (of which {', '.join(thin)})" if thin else "")
            label += "  <- the run's peak" if phase == plan.peak_phase else ""
            ax.text(left + top * 0.01, row, label, va="center", fontsize=8)
        ax.axvline(budget / GiB, color="red", ls="--", lw=1.2)
        ax.set_yticks(range(len(phases)), phases, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, top)
        ax.set_title(model, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("GiB of tensors at the phase's peak (predicted; a card adds its own overhead)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in SEGMENTS.values()]
    handles.append(plt.Line2D([], [], color="red", ls="--"))
    fig.legend(handles, [*SEGMENTS, f"the card: {budget / GiB:g} GiB"], fontsize=8, loc="lower center",
               ncol=3, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig
