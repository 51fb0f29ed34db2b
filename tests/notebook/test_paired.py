"""Knobs against the default seed by seed: a verdict needs every seed's difference on one side of zero."""

import matplotlib

matplotlib.use("Agg")

from lora_lab.notebook.paired import differences, paired_figure, table, verdict  # noqa: E402

RESULTS = {  # two seeds; the default's loss differs a lot between seeds, the knob's shift is small and steady
    ("sd3", "default"): [{"loss": 1.0}, {"loss": 2.0}],
    ("sd3", "steady"): [{"loss": 1.1}, {"loss": 2.1}],
    ("sd3", "mixed"): [{"loss": 1.5}, {"loss": 1.9}],
    ("sd3", "far"): [{"loss": 9.0}, {"loss": 9.5}],
}


def test_paired_differences_see_a_steady_effect_that_ranges_hide():
    assert [round(d, 9) for d in differences(RESULTS, "sd3", "steady", "loss")] == [0.1, 0.1]
    # the ranges overlap (1.1..2.1 against 1.0..2.0), the pairs agree: higher
    assert verdict(differences(RESULTS, "sd3", "steady", "loss")) == "higher"
    assert verdict(differences(RESULTS, "sd3", "mixed", "loss")) == "same"
    assert verdict([-0.2, -0.1]) == "lower" and verdict([0.0, 0.3]) == "same"


def test_table_and_figure_show_each_knob_and_mark_off_scale_values():
    text = table(RESULTS, {"loss": "loss"})
    assert "| sd3 | steady | 1.60 (1.10..2.10) | +0.10, +0.10 | higher |" in text.splitlines()
    fig = paired_figure(RESULTS, {"loss": "loss"}, off_scale={"loss": 1.0})
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["sd3: steady", "sd3: mixed", "sd3: far"]
    assert any(t.get_text() == "off scale: +8.00, +7.50" for t in ax.texts)  # "far" drawn at the edge
    assert ax.get_xlim() == (-1.0, 1.0)
