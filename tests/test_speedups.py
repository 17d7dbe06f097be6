"""speedups.py: the config validated, and apply()'s steps on copies, the caller's models untouched."""

import pytest
import torch
from decoding import as_target, new_draft
from tiny import tiny_model

from eaglewire.decode import speedups
from eaglewire.decode.decoder import SpecDecoder
from eaglewire.runtime import attention
from eaglewire.runtime.projections import FusedFirst
from eaglewire.draft import DraftAttention
from eaglewire.errors import UsageError


@pytest.mark.parametrize("kw, bad", [(dict(prepack="auto"), "prepack.*'auto'"),
                                     (dict(grouped_attention=1), "grouped_attention.*1"),
                                     (dict(compile=None), "compile.*None"), (dict(cuda_graphs="yes"), "cuda_graphs")])
def test_bad_speedups_are_usage_errors_naming_the_value(kw, bad):
    with pytest.raises(UsageError, match=bad):
        speedups.Speedups(**kw)


def test_a_decoder_takes_a_spec_config_and_speedups():
    t = as_target(tiny_model("llama"))
    with pytest.raises(UsageError, match="shape must be a SpecConfig"):
        SpecDecoder(t, shape={"mode": "chain", "K": 2})
    with pytest.raises(UsageError, match="speedups a Speedups"):
        SpecDecoder(t, speedups={"compile": True})


def test_apply_works_on_copies_in_order_and_reports_what_it_did():
    """Everything asked for on a CPU: the target fused and switched to grouped sdpa, the draft fused and its
    attention wrapped; the caller's models keep their modules and their config. Nothing asked for: the
    caller's models themselves. runner_options: what the runners are built with."""
    model = tiny_model("llama")
    draft = new_draft(model)
    on = speedups.Speedups(fuse_projections=True, prepack=False, grouped_attention=True, static_shapes=True)
    target, engine, done = speedups.apply(model, draft, on, verify_rows=5, draft_rows=(1, 5))
    assert (done.fuse_projections, done.prepack, done.grouped_attention, done.linears) == (True, False, True, None)
    assert target is not model and engine is not draft
    assert target.config._attn_implementation == attention.NAME and model.config._attn_implementation == "sdpa"
    assert any(isinstance(m, FusedFirst) for m in engine.modules())
    wrapped = [m.inner for m in engine.modules() if isinstance(m, attention.GroupedDraftAttention)]
    assert wrapped == [m for m in engine.modules() if isinstance(m, DraftAttention)] and wrapped
    for m in (model, draft):
        assert not any(isinstance(x, (FusedFirst, attention.GroupedDraftAttention)) for x in m.modules())
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():  # the same logits through the copies (fp32)
        torch.testing.assert_close(target(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    assert on.runner_options == {"static": True, "cuda_graphs": False, "compile": False}
    off = speedups.Speedups(fuse_projections=False, prepack=False, grouped_attention=False)
    target, engine, done = speedups.apply(model, draft, off)
    assert target is model and engine is draft and not (done.fuse_projections or done.grouped_attention)


def test_cuda_graphs_need_a_cuda_target():
    with pytest.raises(UsageError, match="CUDA graphs need the target on a CUDA device"):
        speedups.apply(tiny_model("llama"), None, speedups.Speedups(cuda_graphs=True))
