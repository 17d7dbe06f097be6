"""Tiny random models of each supported family, built from transformers configs (no downloads)."""

import torch
from torch import nn

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _build(family: str):
    import transformers as tf

    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON))
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**COMMON))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON))
    if family == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=8))
    if family == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=16, decoder_sparse_step=1))
    if family == "deepseek_v3":  # MLA + MoE, the Kimi-K2 family
        cfg = tf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=24,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                                  n_group=1, topk_group=1, n_shared_experts=1)
        return tf.DeepseekV3ForCausalLM(cfg)
    if family == "gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(**COMMON, head_dim=8))
    if family == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=32, n_layer=8, n_head=4, n_positions=256,
                                                bos_token_id=0, eos_token_id=0))
    if family == "multimodal":
        return MultimodalWrapper(_build("llama"))
    raise ValueError(family)


class MultimodalWrapper(nn.Module):
    """A wrapper whose language model sits inside one attribute, as Kimi-K2.5's does."""

    def __init__(self, lm):
        super().__init__()
        self.vision_tower = nn.Linear(4, 4)
        self.language_model = lm
        self.config = lm.config

    def forward(self, *args, **kwargs):
        return self.language_model(*args, **kwargs)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gemma", "gpt2", "multimodal"]


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    m = _build(family).eval()
    return m
