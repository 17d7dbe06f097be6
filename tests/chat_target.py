"""A tiny random chat target for trainer tests, built offline in a second.

A Llama of hidden 32 and 8 layers over a 128-token CHARACTER tokenizer (printable ASCII, newline
and ChatML's special tokens) with a ChatML chat template, saved as a local model directory. The
lm_head is scaled up so the target's distributions are peaked: a draft can learn its argmax in a
few dozen steps.
"""

import json

import torch

from eaglewire.taps import TapContract

CONTRACT = TapContract(8, (2, 4, 5))  # EAGLE-3's default for 8 layers: 2, N//2, N-3
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "green", "quiet", "north", "lamp"]


def char_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    chars += [chr(0xC0 + i) for i in range(128 - len(SPECIALS) - len(chars))]  # a letter per remaining id:
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}  # every generated id decodes and re-encodes as itself
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))  # no merges: one token per char
    tok.decoder = decoders.Fuse()  # decode joins the characters back without spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS})
    fast.chat_template = CHATML
    return fast


def make_target(path, seed: int = 0, sharpen: float = 30.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def conversations_file(path, n: int, seed: int = 0):
    """n ShareGPT records with short replies of varied length (so batches need padding)."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = [WORDS[j] for j in torch.randint(len(WORDS), (2 + i % 5,), generator=g).tolist()]
            f.write(json.dumps({"conversations": [
                {"from": "human", "value": f"Words {i}?"},
                {"from": "gpt", "value": " ".join(words) + "."}]}) + "\n")
    return path
