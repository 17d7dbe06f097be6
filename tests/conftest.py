"""Shared fixtures. Test modules import their helpers (tiny.py, decoding.py, ...) from this folder."""

from contextlib import contextmanager

import pytest
import torch

from decoding import CONTRACT, as_target, fit, new_draft, reference_greedy, save_load
from tiny import tiny_model


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


# --- the decoding tests' target and drafts (helpers in decoding.py) -------------------------------

@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return as_target(tiny_model("llama"))


@pytest.fixture(scope="module")
def seqs(llama):
    """Greedy continuations of random prompts: the draft's training data and the 'familiar' prompts."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(6):
        p = torch.randint(0, 128, (4,), generator=g)
        out.append(torch.cat([p, torch.tensor(reference_greedy(llama.model, p.tolist(), 36))]))
    return out


@pytest.fixture(scope="module")
def drafts(llama, seqs, tmp_path_factory):
    """name -> (draft, meta): random, trained, trained+noise."""
    root = tmp_path_factory.mktemp("drafts")
    m = llama.model
    out = {"random": save_load(new_draft(m), CONTRACT, llama, root / "random")}
    trained = fit(new_draft(m), m, CONTRACT, seqs, steps=60)
    out["trained"] = save_load(trained, CONTRACT, llama, root / "trained")
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.add_(0.3 * p.std() * torch.randn_like(p))
    out["perturbed"] = save_load(trained, CONTRACT, llama, root / "perturbed")
    return out
