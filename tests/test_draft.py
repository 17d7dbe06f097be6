"""The EAGLE-3 draft: config, forward, KV cache, TTT mask (tiny fp32 models)."""

import dataclasses
import json

import pytest
import torch

from eaglewire.draft import DraftConfig, Eagle3Draft, KVCache, causal_mask, rope_inv_freq, ttt_mask
from eaglewire.errors import EaglewireError, UsageError

TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_config(**kw) -> DraftConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                draft_vocab_size=40, num_layers=2, rope_theta=500.0)
    return DraftConfig(**(base | kw))


def tiny_model(seed=0, **kw) -> Eagle3Draft:
    torch.manual_seed(seed)
    m = Eagle3Draft(tiny_config(**kw)).eval()
    with torch.no_grad():  # norms away from 1 so a mis-wired norm shows in the output
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return m


def inputs(m, B=2, T=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, m.config.vocab_size, (B, T), generator=g)
    hidden = torch.randn(B, T, m.config.hidden_size, generator=g)
    pos = torch.arange(T).expand(B, T)
    return ids, hidden, pos


# --- config ----------------------------------------------------------------------------------

def test_config_derives_missing_dims():
    c = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=100)
    assert (c.head_dim, c.num_key_value_heads, c.target_hidden_size, c.draft_vocab_size) == (8, 4, 32, 100)
    assert not (c.norm_before_residual or c.norm_before_fc or c.fc_norm or c.norm_output)  # EAGLE-3 / SGLang


@pytest.mark.parametrize("field,value", [("hidden_size", 0), ("num_key_value_heads", 3), ("draft_vocab_size", 98),
                                         ("hidden_act", "swish"), ("hidden_act", ["silu"]), ("norm_output", 1), ("rope_theta", -1.0),
                                         ("head_dim", 7), ("num_layers", True)])
def test_config_rejects_bad_values_naming_field_and_value(field, value):
    with pytest.raises(UsageError, match=field) as e:
        tiny_config(**{field: value})
    assert repr(value) in str(e.value)


def test_norm_before_fc_and_fc_norm_exclude_each_other_as_in_speculators_eagle3_config():
    """speculators src/speculators/models/eagle3/config.py refuses both flags together."""
    with pytest.raises(UsageError, match="exclude each other"):
        tiny_config(norm_before_fc=True, fc_norm=True)


def test_rope_scaling_normalised_and_unsupported_types_refused():
    assert tiny_config(rope_scaling={"rope_type": "default", "rope_theta": 1.0}).rope_scaling is None
    assert tiny_config(rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling == {"factor": 2.0,
                                                                                      "rope_type": "linear"}
    with pytest.raises(UsageError, match="'yarn' is not supported"):
        tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UsageError, match="low_freq_factor"):
        tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0})


def test_config_round_trips_through_json_and_rejects_unknown_keys():
    c = tiny_config(norm_before_residual=True, fc_norm=True, norm_output=True,
                    rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert DraftConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert hash(DraftConfig.from_dict(c.to_dict())) == hash(c)
    with pytest.raises(UsageError, match=r"unknown field\(s\) \['midlayer'\]"):
        DraftConfig.from_dict(c.to_dict() | {"midlayer": 1})
    with pytest.raises(UsageError, match="missing field.*vocab_size"):
        DraftConfig.from_dict({k: v for k, v in c.to_dict().items() if k != "vocab_size"})


def test_for_target_copies_llama_dims_rope_and_applies_overrides():
    from transformers import LlamaConfig

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    t = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2,
                    vocab_size=300, rope_theta=5e5, rope_scaling=dict(llama3), max_position_embeddings=512,
                    rms_norm_eps=1e-5)
    c = DraftConfig.for_target(t, num_taps=3, draft_vocab_size=100)
    assert (c.hidden_size, c.target_hidden_size, c.intermediate_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.vocab_size, c.draft_vocab_size) == (64, 64, 160, 8, 2, 8, 300, 100)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (5e5, 1e-5, 512)
    assert c.rope_scaling == llama3
    small = DraftConfig.for_target(t, 3, 100, hidden_size=32, num_attention_heads=4, norm_output=True)
    assert (small.hidden_size, small.target_hidden_size, small.head_dim, small.norm_output) == (32, 64, 8, True)
    with pytest.raises(UsageError, match="unknown override"):
        DraftConfig.for_target(t, 3, 100, hidden=32)


def test_for_target_keeps_a_decoupled_head_dim():
    from transformers import Qwen3Config

    t = Qwen3Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, vocab_size=200)
    assert DraftConfig.for_target(t, num_taps=3, draft_vocab_size=None).head_dim == 16


# --- forward ---------------------------------------------------------------------------------

def test_shapes_and_draft_to_target():
    m = tiny_model()
    ids, hidden, pos = inputs(m, B=2, T=7)
    fused = m.fuse(torch.randn(2, 7, 3 * 32))
    logits, h = m(ids, fused, pos)
    assert logits.shape == (2, 7, 40) and h.shape == (2, 7, 32)
    d2t = torch.arange(40)  # offsets: draft id i -> target 2i
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[torch.arange(40) * 2] = True
    m.set_vocab(d2t, t2d)
    assert m.draft_to_target(torch.tensor([[0, 3, 39]])).tolist() == [[0, 6, 78]]


def test_fuse_names_expected_and_found_width():
    m = Eagle3Draft(tiny_config(target_hidden_size=576))
    with pytest.raises(EaglewireError, match=r"fc input width 1152 != 3 taps x 576"):
        m.fuse(torch.randn(1, 2, 1152))


def test_forward_refuses_taps_in_place_of_the_fused_hidden():
    m = tiny_model()
    ids, _, pos = inputs(m, B=1, T=3)
    with pytest.raises(EaglewireError, match=r"call fuse\(taps\) first"):
        m(ids, torch.randn(1, 3, 96), pos)


def test_layers_after_the_first_match_transformers_llama_decoder_layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    t = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=97, rope_theta=500.0, rms_norm_eps=1e-6)
    t._attn_implementation = "sdpa"
    m = tiny_model()
    assert DraftConfig.for_target(t, 3, 40, num_layers=2, max_position_embeddings=4096) == m.config
    hf = LlamaDecoderLayer(t, layer_idx=1).eval()
    hf.load_state_dict(m.layers[1].state_dict())  # eaglewire's layers.N names are Llama's
    x = torch.randn(2, 9, 32)
    pos = torch.arange(3, 12).expand(2, 9)
    cos, sin = LlamaRotaryEmbedding(t)(x, pos)
    want = hf(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
    want = want[0] if isinstance(want, tuple) else want
    ours = m.layers[1](x, *m._rope(pos, x.dtype), None, None)
    torch.testing.assert_close(ours, want, **TOL)


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256}])
def test_rope_scaling_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    t = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=5e5, rope_scaling=dict(scaling),
                    max_position_embeddings=4096)
    c = DraftConfig.for_target(t, 3, None)
    assert c.head_dim == 128
    torch.testing.assert_close(rope_inv_freq(c), LlamaRotaryEmbedding(t).inv_freq, rtol=1e-6, atol=0)


# --- cache -----------------------------------------------------------------------------------

@pytest.mark.parametrize("max_len", [16, None], ids=["static", "growing"])
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_decoding_with_cache_equals_one_full_pass(step, max_len):
    m = tiny_model()
    ids, hidden, pos = inputs(m, B=2, T=10)
    with torch.no_grad():
        full_logits, full_h = m(ids, hidden, pos)
        cache = m.new_cache(2, max_len)
        parts = [m(ids[:, s:s + step], hidden[:, s:s + step], pos[:, s:s + step], cache) for s in range(0, 10, step)]
    assert cache.length == 10
    torch.testing.assert_close(torch.cat([p[0] for p in parts], 1), full_logits, **TOL)
    torch.testing.assert_close(torch.cat([p[1] for p in parts], 1), full_h, **TOL)


def test_explicit_causal_mask_equals_the_default_with_and_without_cache():
    m = tiny_model()
    ids, hidden, pos = inputs(m, B=2, T=10)
    with torch.no_grad():
        want = m(ids, hidden, pos)
        got = m(ids, hidden, pos, attn_mask=causal_mask(10, 10)[None, None])
        torch.testing.assert_close(got, want, **TOL)
        c1, c2 = m.new_cache(2, 16), m.new_cache(2, 16)
        m(ids[:, :4], hidden[:, :4], pos[:, :4], c1)
        m(ids[:, :4], hidden[:, :4], pos[:, :4], c2)
        a = m(ids[:, 4:], hidden[:, 4:], pos[:, 4:], c1)
        b = m(ids[:, 4:], hidden[:, 4:], pos[:, 4:], c2, attn_mask=causal_mask(6, 10).expand(2, 1, 6, 10))
    torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(a[0], want[0][:, 4:], **TOL)


def test_mask_of_the_wrong_shape_is_refused():
    m = tiny_model()
    ids, hidden, pos = inputs(m, B=2, T=4)
    with pytest.raises(EaglewireError, match=r"attn_mask must be bool \(2 or 1, 1, 4, 4\)"):
        m(ids, hidden, pos, attn_mask=torch.ones(1, 1, 4, 5, dtype=torch.bool))


def test_crop_drops_rejected_tokens():
    m = tiny_model()
    ids, hidden, pos = inputs(m, B=2, T=8)
    with torch.no_grad():
        want, _ = m(ids, hidden, pos)
        cache = m.new_cache(2, 12)
        m(ids[:, :5], hidden[:, :5], pos[:, :5], cache)
        m(torch.zeros_like(ids[:, 5:]), torch.randn(2, 3, 32), pos[:, 5:], cache)  # drafts, then rejected
        cache.crop(5)
        got, _ = m(ids[:, 5:], hidden[:, 5:], pos[:, 5:], cache)
    torch.testing.assert_close(got, want[:, 5:], **TOL)
    with pytest.raises(EaglewireError, match="crop"):
        cache.crop(9)


@pytest.mark.parametrize("max_len", [16, None], ids=["static", "growing"])
@pytest.mark.parametrize("per_row", [False, True])
def test_keep_an_accepted_tree_branch_equals_decoding_that_branch_alone(max_len, per_row):
    """A 2-branch tree [a1, b1, a2, b2] under a tree mask; keeping one branch per row must leave
    the cache as if only that branch had been decoded."""
    m = tiny_model()
    ids, hidden, pos = inputs(m, B=2, T=5)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 97, (2, 2), generator=g), torch.randint(0, 97, (2, 2), generator=g)
    ha, hb = torch.randn(2, 2, 32, generator=g), torch.randn(2, 2, 32, generator=g)
    tree_ids = torch.stack([a[:, 0], b[:, 0], a[:, 1], b[:, 1]], 1)
    tree_h = torch.stack([ha[:, 0], hb[:, 0], ha[:, 1], hb[:, 1]], 1)
    tree_pos = torch.tensor([5, 5, 6, 6]).expand(2, 4)
    tree = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 5, dtype=torch.bool), tree], 1)[None, None]
    # row 0 keeps branch a (cache slots 5, 7) and row 1 branch b (6, 8); or both keep b
    keep = torch.tensor([[5, 7], [6, 8]]) if per_row else torch.tensor([6, 8])
    branch_ids = torch.stack([a[0], b[1]]) if per_row else b
    branch_h = torch.stack([ha[0], hb[1]]) if per_row else hb
    nxt = (torch.randint(0, 97, (2, 1), generator=g), torch.randn(2, 1, 32, generator=g), torch.full((2, 1), 7))
    with torch.no_grad():
        c_tree, c_ref = m.new_cache(2, max_len), m.new_cache(2, max_len)
        for c in (c_tree, c_ref):
            m(ids, hidden, pos, c)
        tree_logits, _ = m(tree_ids, tree_h, tree_pos, c_tree, attn_mask=mask)
        ref_logits, _ = m(branch_ids, branch_h, tree_pos[:, ::2], c_ref)
        c_tree.keep(keep, start=5)
        assert c_tree.length == c_ref.length == 7
        torch.testing.assert_close(m(*nxt, c_tree), m(*nxt, c_ref), **TOL)
    rows = keep - 5 if per_row else keep.expand(2, 2) - 5
    torch.testing.assert_close(torch.gather(tree_logits, 1, rows[..., None].expand(-1, -1, 40)), ref_logits, **TOL)
    for layer in range(2):
        torch.testing.assert_close(c_tree.k[layer][:, :, :8], c_ref.k[layer][:, :, :8], **TOL)
    with pytest.raises(EaglewireError, match=r"indices must lie in \[5, 8\)"):
        c_tree.keep([4], start=5)


def test_static_cache_refuses_overflow_and_autograd():
    m = tiny_model()
    ids, hidden, pos = inputs(m, B=1, T=4)
    cache = m.new_cache(1, 3)
    with torch.no_grad(), pytest.raises(EaglewireError, match="max_len 3"):
        m(ids, hidden, pos, cache)
    cache = m.new_cache(1, 8)
    with pytest.raises(EaglewireError, match="growing cache"):
        m(ids, hidden, pos, cache)
    cache.reset()
    assert cache.length == 0 and isinstance(cache, KVCache)


# --- training-time test ----------------------------------------------------------------------

@pytest.mark.parametrize("T,k", [(1, 0), (4, 0), (5, 2), (3, 3)])
def test_ttt_mask_matches_a_naive_loop(T, k):
    naive = torch.zeros(T, (k + 1) * T, dtype=torch.bool)
    for i in range(T):
        for j in range((k + 1) * T):
            step, col = divmod(j, T)
            naive[i, j] = col <= i if step == 0 else col == i
    assert torch.equal(ttt_mask(T, k)[0, 0], naive)


def test_ttt_through_a_growing_cache_equals_per_position_decoding_and_backprops():
    """TTT step k with ttt_mask: position t sees step-0 keys 0..t and its own keys of steps 1..k,
    i.e. exactly what decoding position t alone for k more steps sees (SpecForge llama3_eagle.py)."""
    m = tiny_model(num_layers=2)
    B, T, K = 2, 6, 3
    ids, _, pos = inputs(m, B=B, T=T)
    step_ids = [ids] + [torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(k)) for k in (1, 2)]
    fused = m.fuse(torch.randn(B, T, 96))
    hidden = fused.detach()
    cache, h, logits = m.new_cache(B), fused, []
    for k in range(K):
        lg, h = m(step_ids[k], h, pos + k, cache, attn_mask=ttt_mask(T, k))
        logits.append(lg)
    assert cache.length == K * T
    sum(lg.logsumexp(-1).mean() for lg in logits).backward()
    assert m.fc.weight.grad.abs().sum() > 0 and m.layers[1].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert m.embed_tokens.weight.grad is None  # frozen copy of the target's
    with torch.no_grad():
        for t in range(T):
            c = m.new_cache(B, 8)
            lg, h = m(ids[:, :t + 1], hidden[:, :t + 1], pos[:, :t + 1], c)
            torch.testing.assert_close(lg[:, t], logits[0][:, t], **TOL)
            h = h[:, t:t + 1]
            for k in (1, 2):
                lg, h = m(step_ids[k][:, t:t + 1], h, pos[:, t:t + 1] + k, c)
                torch.testing.assert_close(lg[:, 0], logits[k][:, t].detach(), **TOL)


# --- variants --------------------------------------------------------------------------------

def test_draft_narrower_than_target_trains_its_own_embedding():
    m = Eagle3Draft(tiny_config(target_hidden_size=48))
    assert m.fc.weight.shape == (32, 144) and m.embed_tokens.weight.requires_grad
    ids, _, pos = inputs(m, B=1, T=4)
    logits, h = m(ids, m.fuse(torch.randn(1, 4, 144)), pos)
    assert logits.shape == (1, 4, 40) and h.shape == (1, 4, 32)
    with pytest.raises(UsageError, match="hidden_size 32 != the target's 48"):
        m.load_target_embedding(torch.randn(97, 48))


def test_load_target_embedding_copies_and_freezes():
    m = tiny_model()
    w = torch.randn(97, 32)
    m.load_target_embedding(w)
    assert torch.equal(m.embed_tokens.weight, w) and not m.embed_tokens.weight.requires_grad
    with pytest.raises(UsageError, match=r"\(96, 32\)"):
        m.load_target_embedding(torch.randn(96, 32))


def _twin(flag):
    base = tiny_model(num_layers=1)
    other = Eagle3Draft(dataclasses.replace(base.config, **{flag: True})).eval()
    missing, unexpected = other.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all("fc_norm" in k or "fc_input_norm" in k for k in missing)
    return base, other


@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm"])
def test_fc_input_norm_flags_change_fuse(flag):
    base, other = _twin(flag)
    taps = 3 * torch.randn(2, 5, 96) + 1
    with torch.no_grad():
        assert not torch.allclose(base.fuse(taps), other.fuse(taps), atol=1e-3)
        rms = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
        want = (torch.cat([rms(c) for c in taps.chunk(3, -1)], -1) if flag == "fc_norm" else rms(taps))
        torch.testing.assert_close(other.fuse(taps), base.fc(want), **TOL)
    assert DraftConfig.from_dict(other.config.to_dict()) == other.config


def test_norm_before_residual_changes_the_output():
    base, other = _twin("norm_before_residual")
    ids, hidden, pos = inputs(base, T=5)
    with torch.no_grad():
        assert not torch.allclose(base(ids, 3 * hidden, pos)[0], other(ids, 3 * hidden, pos)[0], atol=1e-3)
    assert DraftConfig.from_dict(other.config.to_dict()).norm_before_residual


def test_norm_output_feeds_back_the_post_norm_state_with_the_same_logits():
    base, other = _twin("norm_output")
    ids, hidden, pos = inputs(base, T=5)
    with torch.no_grad():
        (lb, hb), (lo, ho) = base(ids, hidden, pos), other(ids, hidden, pos)
        torch.testing.assert_close(lo, lb, **TOL)
        torch.testing.assert_close(ho, base.norm(hb), **TOL)
        assert not torch.allclose(ho, hb, atol=1e-3)
    assert DraftConfig.from_dict(other.config.to_dict()).norm_output


@pytest.mark.parametrize("family", ["gpt2", "deepseek_v3", "qwen3_moe", "gemma"])
def test_for_target_shapes_a_draft_for_every_supported_family(family):
    """GPT-2 has no intermediate_size (n_inner, None = 4 x hidden); MoE targets use the dense one."""
    from tiny import tiny_model

    cfg = tiny_model(family).config
    dc = DraftConfig.for_target(cfg, num_taps=3, draft_vocab_size=64)
    assert dc.hidden_size == 32 and dc.target_hidden_size == 32
    assert dc.intermediate_size == (128 if family == "gpt2" else cfg.intermediate_size)
    logits, h = Eagle3Draft(dc)(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, 32), torch.arange(4)[None])
    assert logits.shape == (1, 4, 64) and h.shape == (1, 4, 32)


def test_a_deepened_draft_predicts_as_before_until_its_new_layers_train():
    """Block expansion (LLaMA Pro): layers added after the draft's own start as the identity, so a trained draft
    grows without losing what it knows; their weights still get gradients through o_proj and down_proj."""
    m = tiny_model(num_layers=1)
    m.set_vocab(torch.arange(40), torch.zeros(97, dtype=torch.bool).index_fill_(0, 2 * torch.arange(40), True))
    deep = m.deepened(3)
    assert deep.config.num_layers == 3 and m.config.num_layers == 1 and len(deep.layers) == 3
    assert torch.equal(deep.d2t, m.d2t) and torch.equal(deep.t2d, m.t2d)
    assert not deep.embed_tokens.weight.requires_grad and not deep.training
    ids, hidden, pos = inputs(m)
    for model in (m, deep):  # the draft's output hidden state feeds its next step: it must match too
        model.out = model(ids, hidden, pos, model.new_cache(2))
    torch.testing.assert_close(deep.out[0], m.out[0], **TOL)
    torch.testing.assert_close(deep.out[1], m.out[1], **TOL)
    deep.out[0].logsumexp(-1).mean().backward()
    assert deep.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0
    assert deep.layers[1].self_attn.o_proj.weight.grad.abs().sum() > 0
    with pytest.raises(UsageError, match="deepens to more, not to 1"):
        m.deepened(1)


# --- sliding window (speculators trains its draft layer with one; vLLM applies it: vllm llama.py:182-201) ----

def _one_layer_windowed(W):
    base = tiny_model(num_layers=1)
    windowed = Eagle3Draft(dataclasses.replace(base.config, sliding_window=W)).eval()
    windowed.load_state_dict(base.state_dict())
    return base, windowed


@pytest.mark.parametrize("W,T", [(4, 11), (2048, 2060)])
def test_a_windowed_draft_sees_exactly_the_last_W_positions(W, T):
    """One layer: the query at position p with window W reads what an unwindowed draft reads from positions
    p-W+1..p alone, so past position W the logits equal the unwindowed draft's over that slice."""
    base, windowed = _one_layer_windowed(W)
    ids, hidden, pos = inputs(base, B=1, T=T)
    with torch.no_grad():
        full, _ = windowed(ids, hidden, pos)
        for p in (W - 1, W, T - 1):
            lo = max(0, p - W + 1)
            ref, _ = base(ids[:, lo:p + 1], hidden[:, lo:p + 1], pos[:, lo:p + 1])
            torch.testing.assert_close(full[0, p], ref[0, -1], **TOL)
        plain, _ = base(ids, hidden, pos)
    assert torch.equal(full[0, :W], plain[0, :W])  # inside the window: no change at all
    assert not torch.allclose(full[0, W:], plain[0, W:])


@pytest.mark.parametrize("max_len", [None, 32])
def test_a_windowed_draft_decodes_through_its_cache_as_in_one_pass(max_len):
    base = tiny_model(num_layers=2)
    m = Eagle3Draft(dataclasses.replace(base.config, sliding_window=3)).eval()
    m.load_state_dict(base.state_dict())
    ids, hidden, pos = inputs(m, B=2, T=9)
    with torch.no_grad():
        full, _ = m(ids, hidden, pos)
        cache = m.new_cache(2, max_len)
        parts = [m(ids[:, a:b], hidden[:, a:b], pos[:, a:b], cache=cache)[0] for a, b in ((0, 5), (5, 6), (6, 9))]
    torch.testing.assert_close(torch.cat(parts, 1), full, **TOL)
    assert not torch.allclose(full, base(ids, hidden, pos)[0])


def test_a_windowed_ttt_step_sees_keys_by_position():
    """TTT step 1 (positions p+1 over the step-0 keys and its own diagonal): the window counts positions."""
    m = tiny_model(num_layers=1, sliding_window=2)
    ids, hidden, pos = inputs(m, B=1, T=6)
    with torch.no_grad():
        cache = m.new_cache(1)
        _, h = m(ids, hidden, pos, cache=cache)
        l1, _ = m(ids, h, pos + 1, cache=cache, attn_mask=ttt_mask(6, 1))
        # by hand: position t+1 sees step-0 key t (distance 1) and its own step-1 key; step-0 key t-1 is 2 away
        keys = torch.cat([pos, pos + 1], 1)
        allowed = ttt_mask(6, 1)[0, 0] & ((pos[0, :, None] + 1 - keys[0][None]) < 2)
        assert allowed.sum(1).tolist() == [2, 2, 2, 2, 2, 2]
        cache2 = m.new_cache(1)
        m(ids, hidden, pos, cache=cache2)
        cfg_plain = dataclasses.replace(m.config, sliding_window=None)
        plain = Eagle3Draft(cfg_plain).eval()
        plain.load_state_dict(m.state_dict())
        ref, _ = plain(ids, h, pos + 1, cache=cache2, attn_mask=allowed[None, None])
    torch.testing.assert_close(l1, ref, **TOL)


def test_sliding_window_must_be_a_positive_integer():
    with pytest.raises(UsageError, match="sliding_window"):
        tiny_config(sliding_window=0)
    assert tiny_config().sliding_window is None
