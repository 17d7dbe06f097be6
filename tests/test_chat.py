"""Assistant-only loss masks from chat templates (the real SmolLM2 tokenizer, several templates)."""

import copy

import pytest
import torch

from eaglewire import targets
from eaglewire.chat import ChatTemplateError, encode_conversation, encode_many
from eaglewire.errors import UsageError

CONV = [
    {"role": "user", "content": "Hi, assistant!"},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "Say more."},
    {"role": "assistant", "content": "Sure: more."},
]

# The shape of Meta's Llama-3 Instruct template (tokenizer_config.json of Meta-Llama-3-8B-Instruct):
# BOS once, a header per message, trimmed content, <|eot_id|> after every turn.
LLAMA3 = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(targets.prepare("smollm2-135m").path)


def segments(tok, ids, mask):
    """Decoded runs of masked tokens."""
    out, run = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            run.append(i)
        elif run:
            out.append(tok.decode(run))
            run = []
    return out + ([tok.decode(run)] if run else [])


def test_chatml_smollm2_template(smol_tok):
    ids, mask = encode_conversation(smol_tok, CONV)
    assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape
    # same tokens as the template's own tokenization
    assert ids.tolist() == smol_tok.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"]
    # the replies and their <|im_end|>; not the "<|im_start|>assistant\n" header, not the "\n" after the end
    assert segments(smol_tok, ids, mask) == ["Hello there!<|im_end|>", "Sure: more.<|im_end|>"]
    im_end = smol_tok.convert_tokens_to_ids("<|im_end|>")
    ends = (ids == im_end).nonzero().flatten().tolist()
    assert [bool(mask[e]) for e in ends] == [False, False, True, False, True]  # system, user, reply, user, reply
    assert not mask[-1] and smol_tok.decode(ids[-1:]) == "\n"


def test_llama3_style_template(smol_tok):
    tok = copy.deepcopy(smol_tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3
    conv = [{"role": "system", "content": "Be brief."}] + copy.deepcopy(CONV)
    conv[2]["content"] = "  Hello there!  \n"  # the template trims it: the mask must follow the rendering
    ids, mask = encode_conversation(tok, conv)
    assert tok.decode(ids[:1]) == tok.bos_token  # the template's BOS, not a second one from the tokenizer
    assert segments(tok, ids, mask) == ["Hello there!<|eot_id|>", "Sure: more.<|eot_id|>"]
    assert tok.decode(ids[~mask]).count("<|start_header_id|>assistant<|end_header_id|>\n\n") == 2


def test_template_rewriting_earlier_turns_is_refused(smol_tok):
    tok = copy.deepcopy(smol_tok)
    # Like reasoning templates that strip past replies: a reply renders differently once it is not the last.
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{% if m['role'] == 'assistant' and not loop.last %}[earlier reply]{% else %}{{ m['content'] }}"
                         "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ChatTemplateError, match="rewrites earlier turns") as e:
        encode_conversation(tok, CONV)
    assert e.value.reason == "the chat template rewrites earlier turns"
    encode_conversation(tok, CONV[:2])  # one reply: nothing earlier to rewrite


def test_template_that_raises_is_a_chat_template_error(smol_tok):
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="refused the conversation: roles must alternate"):
        encode_conversation(tok, [CONV[0], CONV[0], CONV[1]])


def test_no_chat_template_names_the_fix(smol_tok):
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = None
    with pytest.raises(UsageError, match="no chat template.*chat_template.jinja"):
        encode_conversation(tok, CONV)


def test_max_len_truncates(smol_tok):
    full_ids, full_mask = encode_conversation(smol_tok, CONV)
    ids, mask = encode_conversation(smol_tok, CONV, max_len=30)
    assert ids.tolist() == full_ids[:30].tolist() and mask.tolist() == full_mask[:30].tolist()


def test_encode_many_equals_one_by_one_and_long_tokens_reach_later_replies(smol_tok):
    """Replies far into the text are not rendered when max_len cannot reach them, unless the kept
    tokens are long (64 spaces make one SmolLM2 token): then they are, and the mask stays exact."""
    long_turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 30}
                  for i in range(8)]
    spaces = [{"role": "user", "content": "a" + " " * 2000 + "b"}, {"role": "assistant", "content": "reply"}]
    convs = [CONV, long_turns, spaces, [{"role": "user", "content": "no reply"}]]
    for max_len in (None, 40, 66, 300):
        many = encode_many(smol_tok, convs, max_len)
        for conv, (ids, mask, truncated) in zip(convs, many):
            full_ids, full_mask = encode_conversation(smol_tok, conv)
            assert ids.tolist() == full_ids[:max_len].tolist() and mask.tolist() == full_mask[:max_len].tolist()
            assert truncated == (max_len is not None and full_ids.numel() > max_len)
    ids, mask, _ = encode_many(smol_tok, [spaces], 66)[0]  # the reply starts ~2100 characters in: > 8 * 66
    assert smol_tok.decode(ids[mask]) == "reply<|im_end|>"
