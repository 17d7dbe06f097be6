"""The probe: run prompts through the target, capture EVERY tap at once, and measure the draft's
step-1..K accuracy under the wiring the engine will really use and under the plausible mistakes
(each tap shifted by +-1, all shifted, the embedding in or out, other fc orders, the post-norm final
state instead of tap N). Also compares the per-tap activation statistics recorded at training time
(checkpoint.tap_stats) with the live target's, which catches wrong taps without running the draft.

Accuracy is the trainer's own measure (ttt.TTTModel + metrics.summarize): at position t, step k
reads x_{t+1+k} and its own previous hidden state and must reproduce the target's argmax at t+1+k.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .. import metrics
from ..capture import capture, locate
from ..checkpoint import tap_stats
from ..taps import TapContract
from ..ttt import TTTModel, TTTSpec, target_side
from .findings import Remedy, finding

FINAL = "post-norm"  # the final norm's output (HF hidden_states[N]) in place of tap N

# A few short, varied prompts: the probe needs the target's own continuations, not a benchmark.
BUILTIN_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue to a ten-year-old.",
    "List three uses of a paperclip.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is 17 times 23? Show your working.",
    "Give me a haiku about autumn leaves.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


@dataclass(frozen=True)
class Wiring:
    """What feeds each fc slot, in slot order: tap k (int) or FINAL."""

    sources: tuple
    label: str

    @property
    def plain(self) -> bool:
        """Taps only, low to high: what an engine can be configured to capture."""
        return all(isinstance(s, int) for s in self.sources) and list(self.sources) == sorted(set(self.sources))

    def describe(self) -> str:
        return "[" + ", ".join(str(s) for s in self.sources) + "]"


def candidates(engine: tuple[int, ...], trained: tuple[int, ...] | None, num_layers: int,
               first: str = "what the engine captures") -> list[Wiring]:
    """The engine's wiring first, then the trained one and every plausible mistake around the engine's."""
    N, n = num_layers, len(engine)
    out = [Wiring(tuple(engine), first)]
    if trained is not None and len(trained) == n:
        out.append(Wiring(tuple(trained), "the draft's recorded taps"))
    for d in (-1, 1):
        out.append(Wiring(tuple(t + d for t in engine), f"every tap {d:+d}"))
        for i in range(n):
            s = list(engine)
            s[i] += d
            out.append(Wiring(tuple(s), f"tap {engine[i]} -> {s[i]}"))
    if 0 not in engine:
        out.append(Wiring((0,) + tuple(engine[1:]), f"embedding in place of tap {engine[0]}"))
        out.append(Wiring((0,) + tuple(engine[:-1]), f"embedding in, tap {engine[-1]} out"))
    else:
        rest = tuple(t for t in engine if t != 0)
        if len(rest) > 1:  # the seed incident: [embedding, 3, 31] assumed for a draft trained on [3, 31, 59]
            nxt = min(N, 2 * rest[-1] - rest[-2])
            out.append(Wiring(rest + (nxt,), f"embedding out, tap {nxt} in"))
        out.append(Wiring(tuple(1 if t == 0 else t for t in engine), "embedding out, tap 1 in"))
    orders = itertools.permutations(engine) if n <= 3 else [tuple(reversed(engine))]
    out += [Wiring(tuple(p), "fc slots in another order") for p in orders]
    if N in engine:
        out.append(Wiring(tuple(FINAL if t == N else t for t in engine), f"post-norm final state for tap {N}"))
    seen, keep = set(), []
    for w in out:
        ints = [s for s in w.sources if isinstance(s, int)]
        if w.sources in seen or len(set(w.sources)) != n or any(not 0 <= s <= N for s in ints):
            continue
        seen.add(w.sources)
        keep.append(w)
    return keep


# --- probe inputs ---------------------------------------------------------------------------------

def probe_sequences(target, n: int, prompts=None, new_tokens: int = 32, seed: int = 0, max_len: int = 512
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n sequences (input_ids LongTensor[T], mask BoolTensor[T]) to measure on.

    A conversation with assistant replies (from --prompts) is used as written, masked on the replies:
    the training distribution. A bare prompt gets the target's own greedy continuation, masked on it.
    A target without a tokenizer (a test model) gets seeded random token sequences, masked everywhere.
    """
    tok = target.tokenizer
    if tok is None:
        g = torch.Generator().manual_seed(seed)
        V = target.config.vocab_size
        return [(torch.randint(0, V, (48,), generator=g), torch.ones(48, dtype=torch.bool)) for _ in range(n)]
    texts = list(prompts) if prompts else BUILTIN_PROMPTS
    seqs = []
    for i in range(n):
        prompt = texts[i % len(texts)]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if any(m["role"] == "assistant" for m in messages) and getattr(tok, "chat_template", None):
            from ..chat import encode_conversation

            ids, mask = encode_conversation(tok, messages, max_len)
            if mask.any():
                seqs.append((ids, mask))
                continue
        ids = _encode_prompt(tok, messages)[-max_len:]
        with torch.no_grad():
            out = target.model.generate(ids[None].to(target.device), max_new_tokens=new_tokens, do_sample=False,
                                        pad_token_id=tok.pad_token_id or tok.eos_token_id)
        full = out[0].cpu()
        mask = torch.zeros(full.numel(), dtype=torch.bool)
        mask[ids.numel():] = True
        seqs.append((full, mask))
    return seqs


def _encode_prompt(tok, messages: list[dict]) -> torch.Tensor:
    from ..chat import render

    messages = [m for m in messages if m["role"] != "assistant"] or messages
    if getattr(tok, "chat_template", None):
        text = render(tok, messages, add_generation_prompt=True)
        return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    return torch.tensor(tok(messages[-1]["content"])["input_ids"], dtype=torch.long)


@torch.no_grad()
def capture_states(model, input_ids: torch.Tensor) -> dict:
    """Every tap 0..N and the post-norm final state of one sequence: {k: (T, H), FINAL: (T, H)}."""
    stack = locate(model)
    N = stack.num_layers
    dev = next(model.parameters()).device
    got = capture(model, input_ids[None].to(dev), TapContract(N, tuple(range(N + 1))), final_norm=True, stack=stack)
    H = got.taps.shape[-1] // (N + 1)
    states = {k: got.taps[0, :, k * H:(k + 1) * H].float().cpu() for k in range(N + 1)}
    states[FINAL] = got.final_hidden[0].float().cpu()
    return states


# --- measurement ----------------------------------------------------------------------------------

@torch.no_grad()
def measure(draft, head, seqs: list, states: list[dict], wiring: Wiring, steps: int) -> dict:
    """Step-1..K accuracy of `draft` fed `wiring`, summed over the sequences (metrics.summarize)."""
    model = TTTModel(draft, TTTSpec(steps=steps)).eval()
    p0 = next(draft.parameters())
    draft_ids = (torch.arange(draft.d2t.numel(), device=draft.d2t.device) + draft.d2t)
    counts = metrics.zeros(steps, "cpu")
    for (ids, mask), st in zip(seqs, states):
        taps = torch.cat([st[s] for s in wiring.sources], dim=-1)[None].to(p0.device, p0.dtype)  # (1, T, n*H)
        hp = next(head.parameters())
        final = st[FINAL][None].to(hp.device, hp.dtype)
        p, top, in_vocab = target_side(head, final, draft.t2d, draft_ids.to(hp.device), extra=steps + 1)
        dev = p0.device
        _, c = model(ids[None].to(dev), mask[None].to(dev), taps, p.to(dev), top.to(dev), in_vocab.to(dev),
                     denom=1.0)
        counts += c.cpu()
    return metrics.summarize(counts)


def _se(p: float | None, n: int) -> float:
    if p is None or n <= 0:
        return 1.0
    return math.sqrt(max(p * (1 - p), 1.0 / n) / n)


def clearly_better(best: dict, base: dict) -> bool:
    """best's step-1 accuracy beats base's by more than noise (3 standard errors) and by 5 points."""
    a, b = best["acc"][0] or 0.0, base["acc"][0] or 0.0
    margin = max(0.05, 3 * math.hypot(_se(a, best["positions"]), _se(b, base["positions"])))
    return a - b > margin


def recorded_accuracy(meta_metrics: dict | None) -> list[float] | None:
    """Held-out per-step accuracy the trainer recorded (`metrics` in the checkpoint), if any."""
    if not isinstance(meta_metrics, dict):
        return None
    for cand in (meta_metrics.get("heldout"), meta_metrics):  # train.py writes {"heldout": summarize(...)}
        if isinstance(cand, dict) and isinstance(cand.get("acc"), list) and cand["acc"] and cand["acc"][0] is not None:
            return [float(a) if a is not None else 0.0 for a in cand["acc"]]
    return None


# --- activation statistics ------------------------------------------------------------------------

def _stat_distance(a: dict, b: dict) -> float:
    """Scale-free distance between two tap statistics: log ratios of magnitudes, mean shift in stds."""
    d = 0.0
    for key in ("rms", "token_rms_mean", "std"):
        x, y = a.get(key), b.get(key)
        if x and y and x > 0 and y > 0:
            d += abs(math.log(x / y))
    if a.get("std") and b.get("std"):
        d += abs(a.get("mean", 0.0) - b.get("mean", 0.0)) / max(a["std"], b["std"])
    return d


def live_tap_stats(states: list[dict], num_layers: int) -> dict:
    """checkpoint.tap_stats of each single tap 0..N (and FINAL) over all probe sequences."""
    keys = list(range(num_layers + 1)) + [FINAL]
    return {k: tap_stats(torch.cat([st[k] for st in states]), 1)["per_tap"][0] for k in keys}


def compare_tap_stats(recorded: dict, live: dict, engine: tuple) -> list[dict]:
    """Per fc slot: the live tap whose statistics best match the recorded ones, against the engine's."""
    per = recorded.get("per_tap") or []
    rows = []
    for i, rec in enumerate(per[:len(engine)]):
        dist = {k: _stat_distance(rec, s) for k, s in live.items()}
        best = min(dist, key=dist.get)
        rows.append({"slot": i, "engine_tap": engine[i], "engine_distance": round(dist[engine[i]], 3),
                     "best_tap": best, "best_distance": round(dist[best], 3)})
    return rows


def stats_mismatch(row: dict) -> bool:
    """A slot whose engine tap is far from the recorded statistics and another tap is much closer."""
    return (row["best_tap"] != row["engine_tap"] and row["engine_distance"] > 0.3
            and row["best_distance"] < 0.5 * row["engine_distance"])


# --- the probe as a whole ---------------------------------------------------------------------------

def best_of(results: list) -> tuple:
    """The best (wiring, summary) by step-1 accuracy; near-ties go to the earliest candidate
    (the engine's wiring, then the recorded one), so noise never names a stranger."""
    top = max(r["acc"][0] or 0.0 for _, r in results)
    return next((w, r) for w, r in results if (r["acc"][0] or 0.0) >= top - 0.01)


def permuted_fc(draft, sources: tuple) -> torch.Tensor | None:
    """fc.weight with its input blocks reordered so that the engine's low-to-high feed gives each
    block the tap it was trained on (None when per-tap norms would need reordering too)."""
    c = draft.config
    if c.fc_norm or c.norm_before_fc:
        return None
    H = c.target_hidden_size
    W = draft.fc.weight.detach().cpu()
    blocks = [W[:, sources.index(t) * H:(sources.index(t) + 1) * H] for t in sorted(sources)]
    return torch.cat(blocks, dim=1).contiguous()


def _change(w: Wiring, draft, change_for) -> tuple[str, object]:
    if w.plain:
        return change_for(w.sources)
    if FINAL in w.sources:
        return ("no engine feeds the post-norm final state: this draft was trained on HF hidden_states[N] (after "
                "the final norm); retrain it on tap N, which eaglewire datagen captures before the final norm"), None
    W = permuted_fc(draft, w.sources)
    text, remedy = change_for(tuple(sorted(w.sources)))
    if W is None:
        return "engines feed the taps low to high: re-export with fc's input blocks (and fc norms) reordered", None
    return ("engines feed the taps low to high: reorder fc's input blocks to match"
            + (f" and {text}" if remedy and remedy.config_set else ""),
            Remedy(tensors={"fc.weight": W.to(draft.fc.weight.dtype)}, why="input blocks reordered low to high",
                   config_set=dict(remedy.config_set) if remedy else {}))


def run(target, draft, *, engine_taps, trained, n: int, prompts=None, steps: int = 3, recorded_metrics=None,
        recorded_stats=None, change_for=None, who: str = "the engine") -> tuple[list, dict]:
    """Measure; -> (findings, the probe's JSON record). `change_for(taps)` -> (text, Remedy|None)."""
    stack = locate(target.model)
    N, n_taps = stack.num_layers, draft.config.num_taps
    draft = draft.to(next(stack.lm_head.parameters()).device)  # fp32 as loaded; the target may be bf16 on a GPU
    seqs = probe_sequences(target, n, prompts)
    states = [capture_states(target.model, ids) for ids, _ in seqs]
    base = tuple(engine_taps) if engine_taps is not None else tuple(trained)
    record = {"prompts": len(seqs), "steps": steps, "engine_wiring": list(base), "wirings": []}
    if len(base) != n_taps:
        record["note"] = f"{who} feeds {len(base)} taps, the draft's fc reads {n_taps}: only other wirings measured"
        wirings = [Wiring(tuple(trained), "the draft's recorded taps")] if trained and len(trained) == n_taps else []
    else:
        wirings = candidates(base, tuple(trained) if trained else None, N,
                             "what the engine captures" if engine_taps is not None else "the recorded taps")
    results = [(w, measure(draft, stack.lm_head, seqs, states, w, steps)) for w in wirings]
    for w, r in results:
        record["wirings"].append({"taps": [str(s) if s == FINAL else s for s in w.sources], "label": w.label,
                                  **{k: metrics.rounded(r[k], 4) for k in ("acc", "cond_acc", "acceptance_length")},
                                  "positions": r["positions"]})
    findings = []
    if not results:
        return findings, record
    record["positions"] = results[0][1]["positions"]
    eng = results[0] if len(base) == n_taps else None
    best_w, best_r = best_of(results)
    if eng is not None and best_w.sources != eng[0].sources and clearly_better(best_r, eng[1]):
        text, remedy = _change(best_w, draft, change_for)
        stale = (" The recorded taps are not what this draft reads best either." if trained and
                 tuple(best_w.sources) != tuple(trained) and best_w.plain else "")
        findings.append(finding("PROBE_WIRING", "error",
                                f"step-1 accuracy {_pct(eng[1])} with the wiring {who} will use {eng[0].describe()}, "
                                f"{_pct(best_r)} with {best_w.describe()} ({best_w.label}), over "
                                f"{best_r['positions']} positions.{stale}", text, remedy))
    elif eng is not None:
        findings.append(finding("PROBE_OK", "info", f"the wiring {who} will use {eng[0].describe()} scores best: "
                                f"step-1 accuracy {_pct(eng[1])}, estimated acceptance length "
                                f"{eng[1]['acceptance_length']:.2f} over {eng[1]['positions']} positions", ""))
    findings += _low_acceptance(eng, recorded_metrics, record, bool(findings and findings[-1].code == "PROBE_WIRING"),
                                prompts is not None or target.tokenizer is None)
    if recorded_stats and eng is not None:
        findings += _tap_stat_findings(recorded_stats, states, N, base, record)
    return findings, record


def _pct(r: dict) -> str:
    return f"{100 * (r['acc'][0] or 0.0):.1f}%"


def _low_acceptance(eng, recorded_metrics, record: dict, wiring_found: bool, own_prompts: bool) -> list:
    """Far below the held-out accuracy of training. On the user's prompts (the training distribution) a
    drop is an error when halved, else a warning; on the built-in prompts, whose text differs from any
    training set, only a halving is worth a warning."""
    rec = recorded_accuracy(recorded_metrics)
    if rec is None or eng is None:
        return []
    record["recorded_acc"] = rec
    got = eng[1]["acc"][0] or 0.0
    halved = got < 0.5 * rec[0]
    if got >= rec[0] - max(0.15, 3 * _se(got, eng[1]["positions"])) or (not own_prompts and not halved):
        return []
    sev = ("error" if halved else "warning") if own_prompts or wiring_found else "warning"
    return [finding("PROBE_LOW_ACCEPTANCE", sev, f"step-1 accuracy {100 * got:.1f}% under the engine's wiring, "
                    f"{100 * rec[0]:.1f}% held out at training time",
                    "fix the wiring first (PROBE_WIRING)" if wiring_found else
                    "check the target (TARGET_MISMATCH) and measure on prompts like the training data (--prompts)")]


def _tap_stat_findings(recorded_stats: dict, states: list, N: int, base: tuple, record: dict) -> list:
    live = live_tap_stats(states, N)
    rows = compare_tap_stats(recorded_stats, live, base)
    record["tap_stats"] = rows
    bad = [r for r in rows if stats_mismatch(r)]
    if not bad:
        return []
    slots = "; ".join(f"slot {r['slot']}: the engine feeds tap {r['engine_tap']}, the training data's statistics "
                      f"match tap {r['best_tap']}" for r in bad)
    # Statistics point, they do not prove: the fix is to measure, and the accuracy probe's finding says what to write.
    return [finding("PROBE_TAP_STATS", "warning", f"activation statistics recorded at training differ from what "
                    f"the engine will capture ({slots})",
                    "follow PROBE_WIRING when the accuracy probe agrees; if it does not, the prompts differ too much "
                    "from the training data: pass --prompts with prompts like them")]
