"""What the probe measures on: distinct prompts, the target's own greedy continuations of them, and
every tap of each sequence captured once.

Prompts come from the built-in list, from a benchmark suite (`--suite`, suites.py), or from a prompt
file (`--prompts`, whose written assistant replies are measured as they are: the training
distribution). The built-in list is assets/probe_prompts.jsonl: 76 short prompts of many kinds,
interleaved so that any first N are varied. A prompt is never measured twice: asking for more than
there are measures all of them and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..capture import capture, locate
from ..taps import TapContract

BUILTIN = Path(__file__).resolve().parent.parent / "assets" / "probe_prompts.jsonl"
FINAL = "post-norm"  # the final norm's output (HF hidden_states[N]) in place of tap N
RANDOM_LENGTH = 48  # a target without a tokenizer (a test model) is measured on random sequences


@dataclass
class Sequences:
    """The probe's sequences: (input_ids (T,), mask (T,) bool over the measured tokens) each."""

    seqs: list[tuple[torch.Tensor, torch.Tensor]]
    source: str  # where the prompts came from, in words
    asked: int
    notes: list[str] = field(default_factory=list)


def builtin_prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": json.loads(line)["prompt"]}]
            for line in BUILTIN.read_text().splitlines() if line.strip()]


def distinct(convs: list[list[dict]]) -> list[list[dict]]:
    seen, out = set(), []
    for c in convs:
        key = json.dumps(c, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


Writer = Callable[[list[list[int]], int], list[list[int]]]  # (prompts' ids, new tokens) -> each one's continuation


def sequences(target, n: int, convs: list[list[dict]] | None = None, source: str = "built-in prompts",
              new_tokens: int = 128, max_len: int = 1024, seed: int = 0, writer: Writer | None = None) -> Sequences:
    """Up to n distinct sequences. A conversation with assistant replies is used as written, masked on the
    replies; a bare prompt gets the target's own greedy continuation (`new_tokens`, one batched generate, or
    whatever `writer` writes), masked on it. A target without a tokenizer gets n seeded random sequences, masked
    everywhere."""
    tok = target.tokenizer
    if tok is None:
        g = torch.Generator().manual_seed(seed)
        V = target.config.vocab_size
        seqs = [(torch.randint(0, V, (RANDOM_LENGTH,), generator=g), torch.ones(RANDOM_LENGTH, dtype=torch.bool))
                for _ in range(n)]
        return Sequences(seqs, "random token sequences (the target has no tokenizer)", n)
    pool = distinct(convs if convs is not None else builtin_prompts())
    chosen = pool[:n]
    out = Sequences([], source, n)
    if len(chosen) < n:
        out.notes.append(f"--probe {n}: {source} hold {len(pool)} distinct prompts, all measured once")
    written, bare = {}, []
    for i, messages in enumerate(chosen):
        if any(m["role"] == "assistant" for m in messages) and getattr(tok, "chat_template", None):
            from ..chat import encode_conversation

            ids, mask = encode_conversation(tok, messages, max_len)
            if mask.any():
                written[i] = (ids, mask)
                continue
        bare.append(i)
    prompt_ids = {i: _encode_prompt(tok, chosen[i])[-(max_len - new_tokens):].tolist() for i in bare}
    continued = {}
    if bare:
        write = writer or _greedy_writer(target)
        for i, new in zip(bare, write([prompt_ids[i] for i in bare], new_tokens)):
            ids = torch.tensor(prompt_ids[i] + new, dtype=torch.long)
            mask = torch.zeros(ids.numel(), dtype=torch.bool)
            mask[len(prompt_ids[i]):] = True
            continued[i] = (ids, mask)
    out.seqs = [written[i] if i in written else continued[i] for i in range(len(chosen))]
    return out


def _greedy_writer(target) -> Writer:
    from ..data.datagen import GenConfig, generate_ids

    return lambda prompt_ids, new_tokens: generate_ids(target, prompt_ids,
                                                       GenConfig(max_new_tokens=new_tokens, batch_size=32))


def chosen(target, n: int, prompts: str | None = None, suite: str | None = None, new_tokens: int = 128,
           writer: Writer | None = None) -> Sequences:
    """The probe's sequences as the command line asks: --prompts FILE (written replies measured as they are),
    --suite NAME|FILE (its first turns, evenly spaced for a named suite as `bench` takes them), or the
    built-in prompts. The target continues every bare prompt itself (or `writer` does)."""
    if prompts:
        from ..prompts import load_conversations

        convs = load_conversations(prompts, need_assistant=False).conversations
        return sequences(target, n, convs, f"--prompts {prompts}", new_tokens, writer=writer)
    if suite:
        from ..data.suites import SUITES, load_suite

        sp = load_suite(suite, n if suite in SUITES else None)  # a FILE: its first n distinct prompts, below
        return sequences(target, n, sp.conversations, f"--suite {sp.name}", new_tokens, writer=writer)
    return sequences(target, n, None, "the built-in prompts", new_tokens, writer=writer)


def _encode_prompt(tok, messages: list[dict]) -> torch.Tensor:
    from ..chat import render

    messages = [m for m in messages if m["role"] != "assistant"] or messages
    if getattr(tok, "chat_template", None):
        text = render(tok, messages, add_generation_prompt=True)
        return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return torch.tensor(tok(messages[-1]["content"])["input_ids"], dtype=torch.long)


@torch.no_grad()
def continuation(model, input_ids: torch.Tensor, n: int) -> list[int]:
    """The target's next n greedy tokens after a sequence, through any stop token: what an engine's last round
    verifies past the end of the text it returns."""
    dev = next(model.parameters()).device
    ids = input_ids.to(dev)
    for _ in range(n):
        ids = torch.cat([ids, model(ids[None]).logits[0, -1].argmax(-1, keepdim=True)])
    return ids[input_ids.numel():].tolist()


@torch.no_grad()
def capture_states(model, input_ids: torch.Tensor) -> dict:
    """Every tap 0..N, the post-norm final state and the target's argmax of one sequence:
    {k: (T, H), FINAL: (T, H), "top": (T,)}, on the CPU in the target's dtype."""
    stack = locate(model)
    N = stack.num_layers
    dev = next(model.parameters()).device
    got = capture(model, input_ids[None].to(dev), TapContract(N, tuple(range(N + 1))), final_norm=True, stack=stack)
    H = got.taps.shape[-1] // (N + 1)
    states = {k: got.taps[0, :, k * H:(k + 1) * H].cpu() for k in range(N + 1)}
    states[FINAL] = got.final_hidden[0].cpu()
    head = stack.lm_head
    states["top"] = head(got.final_hidden[0].to(head.weight.dtype)).argmax(-1).cpu()
    return states
