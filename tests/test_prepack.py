"""prepack.py: oneDNN-packed linears give the dense model's outputs and leave the caller's model alone."""

import pytest
import torch
from decoding import CHAIN, TREE, as_target, decoder, prompts, reference_greedy
from tiny import tiny_model

from eaglewire.runtime import prepack
from eaglewire.errors import UsageError

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")]


def test_packed_linear_equals_linear():
    torch.manual_seed(0)
    for bias in (False, True):
        lin = torch.nn.Linear(24, 40, bias=bias)
        packed = prepack.PackedLinear(lin)
        for shape in ((1, 24), (3, 24), (2, 5, 24)):
            x = torch.randn(*shape)
            torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)
        x = torch.randn(24, 6).t()  # a non-contiguous input
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)


@pytest.fixture
def pack_all(monkeypatch):
    monkeypatch.setattr(prepack, "MIN_WEIGHTS", 0)  # the tiny test layers are below the size that pays


def test_prepacked_model_matches_and_shares_everything_but_the_packing(llama, pack_all):  # noqa: F811
    m = llama.model
    packed = prepack.prepacked(m)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = m(ids).logits, packed(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert all(type(x) is not torch.nn.Linear for x in packed.modules())
    assert any(type(x) is torch.nn.Linear for x in m.modules())  # the caller's model is untouched
    same = {p.data_ptr() for p in m.parameters()}
    assert all(p.data_ptr() in same for p in packed.parameters())  # shared, not copied


def test_small_layers_stay_dense(llama, drafts):  # noqa: F811
    assert prepack.prepacked(llama.model) is llama.model  # hidden 32: nothing is large enough
    assert not decoder(llama, *drafts["trained"], **CHAIN).applied.prepack
    big = torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.LayerNorm(1536), torch.nn.Linear(1536, 8))
    packed = prepack.prepacked(big)
    assert type(packed[0]) is prepack.PackedLinear and type(packed[2]) is torch.nn.Linear


def test_decoder_packs_on_cpu_fp32_unless_told_or_compiling(llama, seqs, drafts, pack_all):  # noqa: F811
    on = decoder(llama, *drafts["trained"], **CHAIN)
    off = decoder(llama, *drafts["trained"], prepack=False, **TREE)
    assert on.applied.prepack and not off.applied.prepack
    assert not decoder(llama, *drafts["trained"], compile=True, **CHAIN).applied.prepack
    assert type(on.verifier.model.lm_head) is prepack.PackedLinear
    assert type(on.drafter.draft.lm_head) is prepack.PackedLinear
    assert type(off.verifier.model.lm_head) is torch.nn.Linear
    # the target lm_head, the draft fc
    assert off.applied.linears is None and set(on.applied.linears) >= {"32x128", "96x32"}
    # timed at the rows each runs: a step, the verify (K+1), PACK_ROWS; the draft's extends and steps
    assert set(on.verifier.model.lm_head.dense_at) == {1, CHAIN["K"] + 1, prepack.PACK_ROWS}
    assert set(on.drafter.draft.lm_head.dense_at) == {1, CHAIN["K"] + 1, prepack.PACK_ROWS}
    for p in prompts(seqs)[:3]:
        ref = reference_greedy(llama.model, p, 24)
        assert on.generate(p, 24).tokens == ref and off.generate(p, 24).tokens == ref


def test_prepack_refuses_what_it_cannot_pack():
    assert not prepack.available(torch.device("cpu"), torch.bfloat16)
    t = as_target(tiny_model("llama").to(torch.bfloat16))
    with pytest.raises(UsageError, match="prepack needs an fp32 target on a CPU"):
        decoder(t, prepack=True)
    assert not decoder(t).applied.prepack  # auto: off for bf16


def test_each_layer_calls_the_linear_this_machine_runs_faster(monkeypatch, pack_all):
    """Packing pays on one CPU and not on another (prepack.py: an AMD EPYC against an Intel Xeon):
    `prepacked` times both ways per shape, at each row count it is given, in passes over every layer (weights
    from memory, as in a step), and each layer calls the faster for the rows it gets. The clock is rigged here:
    dense wins at one row, packed at eight."""
    torch.manual_seed(0)
    monkeypatch.setattr(prepack, "_timed", {})
    costs = {(1, "dense"): 1, (1, "packed"): 3, (8, "dense"): 3, (8, "packed"): 1}
    now, calls = [0.0], []
    monkeypatch.setattr(prepack.time, "perf_counter", lambda: now[0])  # a call moves it on by its rigged cost
    real = {side: getattr(prepack.PackedLinear, side) for side in ("dense", "packed")}
    for side in real:
        def spy(self, x, side=side):
            rows = x.numel() // x.shape[-1]
            now[0] += costs.get((rows, side), 0)
            calls.append((id(self), rows, side))
            return real[side](self, x)
        monkeypatch.setattr(prepack.PackedLinear, side, spy)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 24),
                                torch.nn.Linear(24, 40))
    packed = prepack.prepacked(model)
    first, second = packed[0], packed[3]
    assert first.dense_at == second.dense_at == packed[2].dense_at == {1: True, 8: False}
    timing = calls[:]
    assert len(timing) == 2 * 2 * (prepack.TIMING_REPEATS + 1) * 3  # rows x sides x passes x layers
    # a pass calls every layer in turn, as a forward does (the weights come from memory, not from cache)
    assert timing[:4] == [(id(first), 1, "dense"), (id(packed[2]), 1, "dense"), (id(second), 1, "dense"),
                          (id(first), 1, "packed")]
    threads = torch.get_num_threads()
    assert prepack._timed[(24, 40, True, threads, 1)] is True and prepack._timed[(24, 40, True, threads, 8)] is False
    assert prepack.choices(packed) == {"24x40": "mkl at 1 row, onednn at 8", "40x24": "mkl at 1 row, onednn at 8"}
    assert prepack.choices(model) is None  # nothing packed there
    calls.clear()
    again = prepack.prepacked(model)  # timed once a shape, row count and thread count
    assert not calls and again[0].dense_at == {1: True, 8: False}
    x1, x3 = torch.randn(1, 1, 24), torch.randn(3, 24)
    torch.testing.assert_close(first(x1), model[0](x1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first(x3), model[0](x3), rtol=1e-5, atol=1e-5)
    assert [c[1:] for c in calls] == [(1, "dense"), (3, "packed")]  # 3 rows: as at 8, the next count timed
    alone = prepack.PackedLinear(model[0])
    assert alone.dense_at == {} and alone.packed_weight.numel() > 0  # a layer alone packs
    # MKL's cost jumps between 3 rows and 4 on the Intel Xeon (prepack.py): a 3-row verify is timed as such
    costs.update({(3, "dense"): 1, (3, "packed"): 3})
    calls.clear()
    three = prepack.prepacked(model, (1, 3, 8))
    assert {c[1] for c in calls} == {3}  # only the row count not timed before
    assert three[0].dense_at == {1: True, 3: True, 8: False}
    assert prepack.choices(three)["24x40"] == "mkl at 1 row, mkl at 3, onednn at 8"
    calls.clear()
    for rows in (1, 2, 3, 4, 8, 20):
        three[0](torch.randn(rows, 24))
    assert [c[2] for c in calls] == ["dense", "dense", "dense", "packed", "packed", "packed"]
    monkeypatch.setattr(prepack, "_timed", {})
    costs.update({(8, "dense"): 1, (8, "packed"): 3})  # dense wins at both: the packed copy is let go
    dense_only = prepack.prepacked(model)
    assert dense_only[0].dense_at == {1: True, 8: True} and dense_only[0].packed_weight.numel() == 0
    torch.testing.assert_close(dense_only[0](x3), model[0](x3), rtol=1e-5, atol=1e-5)
