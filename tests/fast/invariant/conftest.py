"""Shared fixtures of the invariant-op tests: the thread counts an op must not depend on."""

import pytest
import torch


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def threads(request):
    """Run the test body with ``torch.set_num_threads(n)`` for n in 1, 2 (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def with_threads(n, fn, *args):
    """``fn(*args)`` computed with ``n`` threads (the previous count restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)
