"""lora_lab 0.1's spellings still work for one release, each with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import lora_lab
import lora_lab.checkpointing
import lora_lab.formats
import lora_lab.models
import lora_lab.notebook.digits
import lora_lab.planning
from lora_lab._moved import FORWARDED, OLD_MODULES

OLD = "the old spelling goes in lora_lab"


@pytest.mark.parametrize("old, new", sorted(OLD_MODULES.items()))
def test_an_old_module_path_is_the_new_module_with_a_warning(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is now {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)  # the same object: patching one patches the other


@pytest.mark.parametrize("old, new", [
    ("LoraModule", lora_lab.formats.LoraWeights),
    ("fit", lora_lab.planning.fit_vram),
    ("checkpoint", lora_lab.checkpointing.checkpointed),
    ("checkpoint_plan", lora_lab.checkpointing.checkpointing_plan),
    ("CheckpointError", lora_lab.checkpointing.CheckpointingError),
    ("TensorKindError", lora_lab.errors.TensorTypeError),
    ("QuantReport", lora_lab.quant.QuantReport),
    ("encode_prompts", lora_lab.models.encode_prompts),
])
def test_an_old_top_level_name_warns_and_is_the_new_object(old, new):
    with pytest.warns(DeprecationWarning, match=OLD):
        assert getattr(lora_lab, old) is new


def test_old_names_of_subpackages_and_of_modules_that_were_also_functions():
    with pytest.warns(DeprecationWarning, match="LoraWeights"):
        from lora_lab.formats import LoraModule
    assert LoraModule is lora_lab.formats.LoraWeights
    with pytest.warns(DeprecationWarning, match="lora_lab.models.build_pipeline"):
        from lora_lab.diffusion import build_pipeline
    assert build_pipeline is lora_lab.models.build_pipeline
    with pytest.warns(DeprecationWarning, match="fit is now lora_lab.notebook.digits.train_classifier"):
        from lora_lab.digits import fit
    assert fit is lora_lab.notebook.digits.train_classifier
    # `lora_lab.checkpoint` and `lora_lab.diffusion.train` were a module and a function: both spellings work
    with pytest.warns(DeprecationWarning, match="checkpointing_plan"):
        from lora_lab.checkpoint import checkpoint_plan
    assert checkpoint_plan is lora_lab.checkpointing.checkpointing_plan
    with pytest.warns(DeprecationWarning, match="lora_lab.diffusion.trainer.TrainConfig"):
        from lora_lab.diffusion.train import TrainConfig
    assert TrainConfig is lora_lab.TrainConfig
    assert callable(lora_lab.diffusion.train) and callable(lora_lab.train)  # still the function


def test_an_unknown_name_is_an_attribute_error_and_new_spellings_do_not_warn():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lora_lab.nope  # noqa: B018
    with pytest.raises(ImportError):
        from lora_lab.checkpoint import nope  # noqa: F401
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import lora_lab, lora_lab.models, lora_lab.planning, lora_lab.notebook, lora_lab.functional\n"
            "from lora_lab import *\n")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert set(FORWARDED) == {"lora_lab.checkpoint", "lora_lab.diffusion.train"}


def test_train_config_checkpoint_policy_is_the_old_name_of_checkpointing_policy():
    config = lora_lab.TrainConfig(gradient_checkpointing="selective")
    with pytest.warns(DeprecationWarning, match="checkpointing_policy"):
        assert config.checkpoint_policy() == config.checkpointing_policy() == "selective"
