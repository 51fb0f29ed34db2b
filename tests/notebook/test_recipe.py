"""The style task's recipe is a valid TrainConfig and its held-out set is the inverted digits, captioned."""

from lora_lab.diffusion import TrainConfig
from lora_lab.notebook.recipe import prompts, style_recipe, watched, write_held_out


def test_recipe_fields_make_a_config_and_changes_win(tmp_path):
    held = write_held_out(tmp_path / "held", n=3)
    names = sorted(p.name for p in held.iterdir())
    assert names == ["000.png", "000.txt", "001.png", "001.txt", "002.png", "002.txt"]
    assert (held / "000.txt").read_text().endswith(", inverted")
    config = TrainConfig(**style_recipe("sd3", tmp_path / "out", 40, lr=0.5, **watched(40, held)))
    assert (config.rank, config.feed_forward, config.conv, config.warmup_steps) == (8, True, False, 4)
    assert config.lr == 0.5 and config.sample_every == 8 and config.validate_every == 4
    assert config.sample_prompts == prompts((0, 3, 5, 8)) and not config.progress
    unet = style_recipe("sdxl", tmp_path / "out", 40)
    assert unet["conv"] and not unet["feed_forward"]


def test_content_models_and_make_runs_families_are_pretrained_bases_the_notebook_takes():
    """The bases notebook 07 claims the content on, and the families `make run` sweeps it over (the
    Makefile's FAMILIES), each have a pre-trained base in data/base/ and are values of its MODEL parameter."""
    import re
    from pathlib import Path

    from lora_lab.models import shipped_base
    from lora_lab.notebook.parameters import expected_parameters
    from lora_lab.notebook.recipe import CONTENT_MODELS

    root = Path(__file__).resolve().parents[2]
    families = re.search(r"^FAMILIES \?= *(.*)$", (root / "Makefile").read_text(), re.M).group(1).split(",")
    notebook = root / "notebooks" / "07_diffusion_lora.ipynb"
    for model in (*CONTENT_MODELS, *families):
        assert shipped_base(model) is not None, model
        assert expected_parameters(notebook, {"MODEL": model})["MODEL"] == model
    assert "sd3" in CONTENT_MODELS and "sd3" not in families  # the default runs in `make run` itself
