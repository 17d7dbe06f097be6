"""attention.py: grouped-query attention over K/V heads read in place, against transformers' sdpa path
(transformers.integrations.sdpa_attention: `repeat_kv`, then F.scaled_dot_product_attention)."""

import types

import pytest
import torch
import transformers as tf
from decoding import decoder
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eaglewire.runtime import attention
from eaglewire.targets import Target

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(t: int, heads: int, kv_heads: int, s: int = 24, additive: bool = True, seed: int = 0, b: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, t, 16, generator=g)
    k, v = torch.randn(2, b, kv_heads, s, 16, generator=g)
    allowed = torch.rand(b, 1, t, s, generator=g) > 0.4
    allowed[..., 0] = True  # every row sees something
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min) if additive else allowed
    return q, k, v, mask


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("additive", [True, False])
def test_grouped_attention_equals_transformers_sdpa_with_repeated_kv(t, additive):
    """Batches of rows with masks of their own (batchgen.py's left-padded rows) included."""
    b = 1 if t == 1 else 2
    q, k, v, mask = inputs(t, heads=6, kv_heads=2, additive=additive, b=b)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)  # (1, T, 6, 16)
    got, none = attention.grouped_sdpa(module, q, k, v, mask, scaling=0.25)
    assert none is None and got.shape == want.shape == (b, t, 6, 16)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # query head h reads K/V head h // 3, as repeat_kv has it: swapping K/V heads must change heads 0-2 only
    swapped, _ = attention.grouped_sdpa(module, q, k.flip(1), v.flip(1), mask, scaling=0.25)
    assert not torch.allclose(swapped[:, :, :3], want[:, :, :3]) and not torch.allclose(swapped[:, :, 3:], want[:, :, 3:])
    torch.testing.assert_close(swapped[:, :, :3], sdpa_attention_forward(module, q, k.flip(1), v.flip(1), mask,
                                                                         scaling=0.25)[0][:, :, :3])


def test_rows_keep_their_own_mask():
    """Row t of every query head sees what the mask's row t allows, not another row's."""
    q, k, v, mask = inputs(4, heads=4, kv_heads=2, additive=False)
    out = attention.grouped_attention(q, k, v, mask)
    for t in range(4):
        keep = mask[0, 0, t]
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, t:t + 1], k.repeat_interleave(2, 1)[:, :, keep],
                                                               v.repeat_interleave(2, 1)[:, :, keep])
        torch.testing.assert_close(out[:, :, t:t + 1], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("additive", [True, False])
def test_a_one_row_step_is_two_matmuls_not_a_fused_kernel(monkeypatch, additive):
    """A decode step (one query row per head, a batch of rows with masks of their own) gives sdpa's output
    without calling it: the fused kernels split their work by query rows, of which such a step has 3."""
    q, k, v, mask = inputs(1, heads=6, kv_heads=2, additive=additive, b=2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                            attn_mask=mask)

    def refuse(*a, **kw):
        raise AssertionError("a one-row step went through scaled_dot_product_attention")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)
    got = attention.grouped_attention(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grouped = attention.grouped_attention(q, k, v, attention.rows_mask(mask, 3))  # as the runners pass it
    torch.testing.assert_close(grouped, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("additive", [True, False])
def test_a_one_row_step_of_many_rows_goes_to_sdpa_from_sdpa_min_heads(monkeypatch, additive):
    """Regeneration's step (benchmarks/regen_step.py's sdpa arm): from SDPA_MIN_HEADS rows x K/V heads a one-row
    step is scaled_dot_product_attention over the grouped rows, each row under its own mask, equal to the
    matmuls; below it, matmuls still."""
    q, k, v, mask = inputs(1, heads=6, kv_heads=2, additive=additive, b=3)
    want = attention.grouped_attention(q, k, v, mask)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a[0].shape) or sdpa(*a, **kw))
    monkeypatch.setattr(attention, "SDPA_MIN_HEADS", 7)  # 3 rows x 2 K/V heads = 6: below
    torch.testing.assert_close(attention.grouped_attention(q, k, v, mask), want, rtol=0, atol=0)
    assert not calls
    monkeypatch.setattr(attention, "SDPA_MIN_HEADS", 6)
    got = attention.grouped_attention(q, k, v, mask)
    assert calls == [(3, 2, 3, 16)]  # the 3 query heads of each K/V head as its rows, K/V not repeated
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(attention.grouped_attention(q, k, v, attention.rows_mask(mask, 3)), want, rtol=1e-6,
                               atol=1e-6)  # the mask as the runners pass it


@pytest.mark.parametrize("t", [2, 8])
def test_verifies_up_to_matmul_max_rows_are_matmuls_too(monkeypatch, t):
    """`decode_steps.py --attention matmul`: verify rows spelt as two matmuls and a softmax, each row with its
    own mask (a tree's), equal to transformers' sdpa; past MATMUL_MAX_ROWS, sdpa again."""
    q, k, v, mask = inputs(t, heads=6, kv_heads=2)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    monkeypatch.setattr(attention, "MATMUL_MAX_ROWS", 8)
    got, _ = attention.grouped_sdpa(module, q, k, v, mask, scaling=0.25,
                                    **{attention.ROWS_MASK: attention.rows_mask(mask, 3)})
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not calls
    monkeypatch.setattr(attention, "MATMUL_MAX_ROWS", t - 1)
    torch.testing.assert_close(attention.grouped_sdpa(module, q, k, v, mask, scaling=0.25)[0], want, rtol=1e-6,
                               atol=1e-6)
    assert calls


def test_without_shared_heads_it_is_transformers_sdpa():
    q, k, v, mask = inputs(3, heads=2, kv_heads=2)
    module = types.SimpleNamespace(num_key_value_groups=1, is_causal=True)
    got, _ = attention.grouped_sdpa(module, q, k, v, mask)
    assert torch.equal(got, sdpa_attention_forward(module, q, k, v, mask)[0])


def llama(attn: str = "sdpa", kv_heads: int = 2):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64)
    cfg._attn_implementation = attn
    return tf.LlamaForCausalLM(cfg).eval()


def test_a_model_switched_to_grouped_sdpa_gives_the_same_logits():
    """A 4D mask as the runners pass it; transformers 5.x returns such a mask as-is (masking_utils)."""
    plain = llama()
    switched = llama()
    assert attention.use_grouped(switched) and switched.config._attn_implementation == attention.NAME
    ids = torch.randint(0, 64, (1, 7))
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        want, got = (m(input_ids=ids, attention_mask=mask).logits for m in (plain, switched))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn,kv_heads", [("eager", 2), ("sdpa", 4)])
def test_models_it_does_not_help_are_left_alone(attn, kv_heads):
    m = llama(attn, kv_heads)
    assert not attention.use_grouped(m) and m.config._attn_implementation == attn


@pytest.mark.parametrize("grouped", [True, False, None])
def test_the_decoder_switches_its_own_copy_not_the_callers_target(grouped):
    """None (the default) is grouped on CUDA only: it won every round on the H200 and was mixed on a
    2-core CPU (benchmarks/results/2026-11-30-run11-slots-regeneration.md)."""
    model = llama()
    target = Target(spec="tiny", model=model, tokenizer=None)
    dec = decoder(target, fuse_projections=False, prepack=False, grouped_attention=grouped)
    grouped = bool(grouped)  # a CPU here
    assert dec.applied.grouped_attention is grouped
    assert model.config._attn_implementation == "sdpa"
    assert (dec.plain.model.config._attn_implementation == attention.NAME) is grouped
    assert (dec.plain.model is model) is not grouped


def test_a_mask_grouped_once_per_forward_is_used_as_given():
    """The runners pass the mask grouped once a forward (ROWS_MASK), so a compiled forward does not
    repeat it in every layer; grouped_sdpa takes that one instead of grouping attention_mask itself."""
    q, k, v, mask = inputs(4, heads=6, kv_heads=2)
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True)
    want, _ = attention.grouped_sdpa(module, q, k, v, mask)
    rows = attention.rows_mask(mask, 3)
    assert rows.shape == (1, 1, 12, 24) and torch.equal(rows[0, 0, 4:8], mask[0, 0])
    got, _ = attention.grouped_sdpa(module, q, k, v, mask, **{attention.ROWS_MASK: rows})
    assert torch.equal(got, want)
    other, _ = attention.grouped_sdpa(module, q, k, v, mask, **{attention.ROWS_MASK: rows.flip(2)})
    assert not torch.allclose(other, want)


@pytest.mark.parametrize("static", [False, True])
def test_greedy_tokens_are_the_same_with_grouped_attention(static):
    """Plain decoding on the runners, exact and padded to static sizes (the mask grouped once a forward)."""
    model = llama()
    target = Target(spec="tiny", model=model, tokenizer=None)
    ids = torch.tensor([3, 9, 27, 5, 11])
    runs = [decoder(target, fuse_projections=False, prepack=False, static_shapes=static, grouped_attention=g)
            .generate_plain(ids, 12).tokens for g in (False, True)]
    assert len(runs[0]) == 12 and list(runs[0]) == list(runs[1])
