"""lora_lab.threads: the thread policy of the many-small-op work (the 8-bit step, the notebooks)."""

import pytest
import torch

from lora_lab.threads import THREADS_ENV, ThreadSettingError, notebook_threads, one_thread


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_thread_inside_and_the_count_restored_after_an_error(two_threads):
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(KeyError), one_thread():
        raise KeyError("inside")
    assert torch.get_num_threads() == 2


def test_notebook_threads_default_and_setting(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert notebook_threads() == 1
    monkeypatch.setenv(THREADS_ENV, " 2 ")
    assert notebook_threads() == 2
    for bad in ("0", "two", "-1", "1.5"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ThreadSettingError, match=THREADS_ENV):
            notebook_threads()
