"""Chat template -> `input_ids` and an assistant-only `loss_mask`, for any template.

No template is parsed or special-cased. For assistant message i the template is rendered twice:
messages[:i] with the generation prompt (ending where the model starts writing) and messages[:i+1]
(ending after the reply's end of turn). The characters between the two are the reply as the model
would write it; offset mappings carry that span to tokens. The mask keeps the reply up to and
including its last special token (the end of turn the draft must learn to predict: `<|im_end|>`,
`<|eot_id|>`, ...) and drops what follows it (ChatML's "\n"), which the model never generates.

Every rendering must be a prefix of the full conversation's rendering. A template that rewrites
earlier turns (e.g. strips reasoning from past replies) breaks that, and raises ChatTemplateError:
a sample is skipped rather than given a wrong mask.
"""

from __future__ import annotations

import torch

from .errors import EaglewireError, UsageError


class ChatTemplateError(EaglewireError):
    """This conversation cannot be masked exactly under this template (the sample is skipped).

    `reason` is a fixed phrase to count skips under; the message adds the particulars.
    """

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def require_chat_template(tokenizer, target: str = "the target") -> str:
    """The tokenizer's chat template, or a UsageError naming the fix."""
    tmpl = getattr(tokenizer, "chat_template", None)
    if not tmpl:
        raise UsageError(f"{target} has no chat template (tokenizer.chat_template is empty): use an instruct/chat "
                         "model, or add `chat_template.jinja` (or a chat_template field in tokenizer_config.json) "
                         "to the model directory")
    if not getattr(tokenizer, "is_fast", True):
        raise UsageError(f"{target}: the tokenizer has no offset mappings (not a fast tokenizer); "
                         "add its tokenizer.json to the model directory")
    return tmpl


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja's TemplateError and raise_exception() calls from templates
        raise ChatTemplateError("the chat template refused the conversation", str(e)) from None
    assert isinstance(out, str), type(out)
    return out


def user_header(tokenizer) -> str:
    """The rendering of a conversation up to where its first user message's text begins (the system
    prompt the template adds by default, then the user turn's opening): what a model continues to
    write a user prompt itself."""
    mark = "\u2063eaglewire-user\u2063"
    text = render(tokenizer, [{"role": "user", "content": mark}])
    if text.count(mark) != 1:
        raise UsageError("the chat template does not place a user message's text verbatim, so the start of a user "
                         "turn cannot be found; self-written prompts need it (leave --self-prompts at 0)")
    return text[:text.index(mark)]


def special_ids(tokenizer) -> set[int]:
    """Ids of special tokens: the end-of-turn markers are among them."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def assistant_spans(tokenizer, messages: list[dict], limit_chars: int | None = None
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and, per assistant message, its character span [start, end) in it.

    Replies starting at or after `limit_chars` are not looked at (they will be cut off anyway).
    """
    full = render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        if limit_chars is not None and len(before) >= limit_chars:
            break
        after = full if i == len(messages) - 1 else render(tokenizer, messages[:i + 1])
        if not (after.startswith(before) and full.startswith(after)):
            raise ChatTemplateError("the chat template rewrites earlier turns",
                                    f"turn {i} renders differently once later turns follow, so the loss mask "
                                    "cannot be derived exactly")
        if spans and len(before) < spans[-1][1]:
            raise ChatTemplateError("assistant turns overlap in the rendering", f"turn {i}")
        spans.append((len(before), len(after)))
    return full, spans


CHARS_PER_TOKEN = 8  # generous: replies starting past max_len * 8 characters nearly always lie past max_len


def encode_conversation(tokenizer, messages: list[dict], max_len: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids LongTensor[T], loss_mask BoolTensor[T]) of one conversation, T <= max_len if given.

    loss_mask is True on assistant reply tokens including their end-of-turn token, False on
    everything else (system, user, the generation-prompt header, trailing separators).
    """
    out = encode_many(tokenizer, [messages], max_len)[0]
    if isinstance(out, ChatTemplateError):
        raise out
    return out[0], out[1]


def encode_many(tokenizer, conversations: list[list[dict]], max_len: int | None
                ) -> list[tuple[torch.Tensor, torch.Tensor, bool] | ChatTemplateError]:
    """Per conversation (input_ids, loss_mask, truncated: longer than max_len), or why it cannot be masked.

    The texts are tokenized in one batch (the tokenizer's threads share the work).
    """
    require_chat_template(tokenizer)
    limit = CHARS_PER_TOKEN * max_len if max_len is not None else None
    rendered = []
    for conv in conversations:
        try:
            rendered.append(assistant_spans(tokenizer, conv, limit))
        except ChatTemplateError as e:
            rendered.append(e)
    texts = [r[0] for r in rendered if not isinstance(r, ChatTemplateError)]
    # the template writes BOS itself: the tokenizer must add nothing
    batch = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else {}
    encs = zip(batch.get("input_ids", []), batch.get("offset_mapping", []))
    specials = special_ids(tokenizer)
    out = []
    for conv, r in zip(conversations, rendered):
        if isinstance(r, ChatTemplateError):
            out.append(r)
            continue
        full, spans = r
        ids, offsets = next(encs)
        if limit is not None and len(ids) > 0 and offsets[min(max_len, len(ids)) - 1][1] > limit:
            _, spans = assistant_spans(tokenizer, conv)  # kept tokens reach past the replies looked at
        mask = _mask(ids, offsets, spans, specials)
        out.append((torch.tensor(ids[:max_len], dtype=torch.long), torch.tensor(mask[:max_len], dtype=torch.bool),
                    max_len is not None and len(ids) > max_len))
    return out


def _mask(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]], specials: set[int]) -> list[bool]:
    """True on each reply's tokens up to and including its last special token (the end of turn)."""
    mask = [False] * len(ids)
    t = 0
    for start, end in spans:
        while t < len(ids) and offsets[t][0] < start:
            t += 1  # a token straddling the header boundary is never generated as such: left out
        reply = []
        while t < len(ids) and offsets[t][1] <= end and offsets[t][0] < end:
            reply.append(t)
            t += 1
        last_special = max((k for k in reply if ids[k] in specials), default=None)
        for k in reply:
            if last_special is None or k <= last_special:
                mask[k] = True
    return mask
