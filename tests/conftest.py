"""Shared fixtures. Test modules import their helpers (tiny.py, ...) from this folder."""

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
