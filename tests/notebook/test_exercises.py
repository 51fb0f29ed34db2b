import math

import pytest
import torch

from lora_lab.notebook.exercises import ANSWERS, ExerciseError, check_exercise


def test_a_prediction_that_matches_holds_and_one_that_does_not_fails(capsys):
    assert check_exercise("01_autograd", 1, -2.0) is True
    assert "held" in capsys.readouterr().out
    assert check_exercise("01_autograd", 1, 2) is False  # an int is a number too
    out = capsys.readouterr().out
    assert "did not hold" in out and "-2.0" in out  # the answer is told after a miss


def test_no_prediction_yet_asks_for_one(capsys):
    assert check_exercise("01_autograd", 2, None) is False
    assert "predict" in capsys.readouterr().out


@pytest.mark.parametrize("args, words", [
    (("99_none", 1, 1.0), "no notebook"),
    (("01_autograd", 5, 1.0), "no checkable exercise 5"),
    (("01_autograd", 1, "minus two"), "takes a float"),
    (("01_autograd", 1, True), "takes a float"),
    (("01_autograd", 1, float("nan")), "takes a float"),
])
def test_bad_calls_name_what_is_wrong(args, words):
    with pytest.raises(ExerciseError, match=words):
        check_exercise(*args)


def test_every_stored_answer_is_well_formed():
    for notebook, table in ANSWERS.items():
        assert notebook[:2].isdigit()
        for n, ex in table.items():
            assert 1 <= n <= 4 and ex.question and ex.answer, (notebook, n)
            assert ex.kind in (float, int, str, bool), (notebook, n)


def test_01_answers_are_what_autograd_computes():
    x32, h = torch.tensor(2.0), 1e-6
    assert ANSWERS["01_autograd"][3].held(abs(((x32 + h) ** 2 - (x32 - h) ** 2).item() / (2 * h) - 4.0))
    x = torch.tensor(-1.0, requires_grad=True)
    (x**2).backward()
    assert ANSWERS["01_autograd"][1].held(x.grad.item())
    x = torch.tensor(2.0, requires_grad=True)
    (x**2).backward()
    (x**2).backward()
    assert ANSWERS["01_autograd"][2].held(x.grad.item())
    w = torch.tensor(3.0, requires_grad=True)
    torch.sin(w * 2.0 + 1.0).backward()
    assert ANSWERS["01_autograd"][4].held(w.grad.item()) and not ANSWERS["01_autograd"][4].held(math.cos(7.0))
