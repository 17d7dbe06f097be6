"""Shared fixtures. Test modules import their helpers (tiny.py, ...) from this folder."""

from contextlib import contextmanager

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine OpenMP's spinning threads
    make their matmuls many times slower. Modules opt in with pytestmark; the setting is restored."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@contextmanager
def no_hooks_left(module):
    """Hooks installed during the block must all be removed by its end."""
    count = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())  # noqa: E731
    before = count()
    yield
    assert count() == before, f"{count() - before} hooks leaked"
