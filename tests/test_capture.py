"""Capture: tap k equals HF hidden_states[k] (k < N), tap N is the pre-norm state, per family."""

import pytest
import torch
from torch import nn

from eaglewire.capture import TapHooks, capture, locate
from conftest import no_hooks_left
from eaglewire.errors import UnknownArchitectureError
from eaglewire.taps import TapContract

from tiny import FAMILIES, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_taps_equal_hf_hidden_states_and_tap_n_is_pre_norm(family):
    model = tiny_model(family)
    n = locate(model).num_layers
    ids = torch.randint(0, 128, (2, 11))
    ref = model(input_ids=ids, output_hidden_states=True)
    hs = ref.hidden_states
    assert len(hs) == n + 1
    contract = TapContract(n, tuple(range(n + 1)))  # every tap, 0..N
    with no_hooks_left(model):
        got = capture(model, ids, contract, final_norm=True, logits=True)
    per_tap = got.taps.split(got.taps.shape[-1] // (n + 1), dim=-1)
    for k in range(n):
        torch.testing.assert_close(per_tap[k], hs[k], msg=f"{family}: tap {k} != hidden_states[{k}]")
    # hidden_states[N] is AFTER the final norm; tap N is BEFORE it.
    stack = locate(model)
    assert not torch.allclose(per_tap[n], hs[n])
    torch.testing.assert_close(stack.norm(per_tap[n]), hs[n])
    torch.testing.assert_close(got.final_hidden, hs[n])
    torch.testing.assert_close(got.logits, ref.logits)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "gpt2"])
def test_default_taps_in_contract_order_and_early_stop(family):
    model = tiny_model(family)
    contract = TapContract.default(8)  # (2, 4, 5)
    ids = torch.randint(0, 128, (1, 7))
    hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hs[k] for k in contract.taps], dim=-1)
    torch.testing.assert_close(capture(model, ids, contract).taps, expected)


def test_early_stop_skips_later_layers():
    model = tiny_model("llama")
    stack = locate(model)
    ran = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, layer in enumerate(stack.layers)]
    capture(model, torch.randint(0, 128, (1, 5)), TapContract(8, (1, 2)))
    for h in hooks:
        h.remove()
    assert ran == [0, 1, 2], "capture of taps up to 2 must not run layers 3..7"


def test_hooks_work_around_a_cached_decoding_forward():
    """The decoder captures taps during incremental forwards with a KV cache."""
    from transformers import DynamicCache
    from eaglewire.targets import cache_kwarg

    model = tiny_model("qwen3")
    stack = locate(model)
    contract = TapContract(8, (1, 3, 8))
    ids = torch.randint(0, 128, (1, 9))
    full = capture(model, ids, contract).taps
    cache = DynamicCache(config=model.config)
    parts = []
    for chunk in (ids[:, :4], ids[:, 4:5], ids[:, 5:]):
        with TapHooks(stack, contract) as hooks:
            model(input_ids=chunk, use_cache=True, **{cache_kwarg(model): cache})
        parts.append(hooks.taps)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)


def test_unknown_architecture_is_named_not_guessed():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.Sequential(nn.Linear(4, 4))

    with pytest.raises(UnknownArchitectureError, match="Odd: no decoder layer list found"):
        locate(Odd())

    class NoNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])
            self.embed_tokens = nn.Embedding(4, 4)

    with pytest.raises(UnknownArchitectureError, match="no final norm"):
        locate(NoNorm())


def test_contract_for_another_layer_count_is_refused():
    model = tiny_model("llama")
    with pytest.raises(UnknownArchitectureError, match="contract is for 30 layers, target has 8"):
        capture(model, torch.randint(0, 128, (1, 3)), TapContract(30, (2, 15, 27)))
