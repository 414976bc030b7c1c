"""Fixtures of the offload tests."""

import pytest
import torch

from offload_helpers import toy  # noqa: F401


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared machine run far faster on one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
