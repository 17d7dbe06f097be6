"""projections.py: q/k/v and gate/up fused into one matmul each give the model's outputs, leave the
caller's model alone, and decode greedily token for token like the target (also compiled)."""

import pytest
import torch
from decoding import CHAIN, TREE, decoder, prompts, reference_greedy
from tiny import tiny_model

from eaglewire.runtime import projections
from eaglewire.runtime.projections import FusedFirst, FusedSlice

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])  # qwen2: q/k/v biases; qwen3: q/k norms
def test_fused_model_matches_and_leaves_the_model_alone(family):
    m = tiny_model(family)
    layers = m.config.num_hidden_layers
    fused = projections.fused(m)
    # attention everywhere; the MLP where it is dense (the MoE's experts are not gate_proj/up_proj Linears)
    assert projections.groups(m) == (layers if family == "qwen3_moe" else 2 * layers)
    assert sum(isinstance(x, FusedFirst) for x in fused.modules()) == projections.groups(m)
    assert not any(isinstance(x, (FusedFirst, FusedSlice)) for x in m.modules())  # the caller's model: untouched
    assert fused.model.embed_tokens.weight is m.model.embed_tokens.weight  # everything else shared
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, m(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_slice_called_on_another_input_computes_its_own():
    m = tiny_model("llama")
    attn, ref = projections.fused(m).model.layers[0].self_attn, m.model.layers[0].self_attn
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    with torch.no_grad():
        attn.q_proj(x)  # leaves x's fused output behind
        torch.testing.assert_close(attn.k_proj(x), ref.k_proj(x))
        torch.testing.assert_close(attn.v_proj(y), ref.v_proj(y))  # not x: not the cached slice


def test_a_model_without_groups_is_returned_as_is():
    m = tiny_model("gpt2")  # one fused c_attn already, no q/k/v or gate/up Linears
    assert projections.groups(m) == 0 and projections.fused(m) is m


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_fused_decoding_is_greedy_exact(llama, seqs, drafts, compile):  # noqa: F811
    for shape in (CHAIN, TREE):
        dec = decoder(llama, *drafts["trained"], fuse_projections=True, compile=compile,
                      static_shapes=compile, **shape)
        assert dec.applied.fuse_projections
        for p in prompts(seqs)[:3]:
            assert dec.generate(p, 24).tokens == reference_greedy(llama.model, p, 24), (shape, compile)


def test_compiled_step_runs_one_matmul_per_group():
    """Under torch.compile the later projections must find the group's output (dynamo resolves the
    `input is x` check while tracing); otherwise each computes its own matmul and nothing is saved.
    Counted in the code inductor writes for one static decode step of a 2-layer Llama."""
    import re

    from torch._inductor.utils import run_and_get_code

    from eaglewire.runtime.runners import TargetRunner

    m = tiny_model("llama")
    m.model.layers = m.model.layers[:2]
    m.config.num_hidden_layers = 2
    counts = {}
    for name, model in (("plain", m), ("fused", projections.fused(m))):
        torch._dynamo.reset()
        r = TargetRunner(model, None, sizes=(1,), static=True, compile=True, cuda_graphs=False)
        r.reset(64)
        with torch.no_grad():
            r.forward({"ids": torch.tensor([1, 2, 3])}, torch.arange(3), exact=True)
            r.commit(3)
            r.forward({"ids": torch.tensor([5])}, torch.tensor([3]))  # eager: allocates the cache
            r.commit(1)
            out, code = run_and_get_code(lambda: r.forward({"ids": torch.tensor([6])}, torch.tensor([4])))
        counts[name] = (len(re.findall(r"extern_kernels\.(?:mm|addmm)\(", "\n".join(code))), out[0])
    assert counts["plain"][0] == 2 * 7 + 1 and counts["fused"][0] == 2 * 4 + 1  # q,k,v,o,gate,up,down + lm_head
    torch.testing.assert_close(counts["fused"][1], counts["plain"][1], rtol=1e-5, atol=1e-5)
