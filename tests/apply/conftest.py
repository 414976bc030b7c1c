"""One intra-op thread per test: the tiny models here gain nothing from more, and on a shared
machine OpenMP threads spinning against other processes make each step many times slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
