"""The probe: run distinct prompts through the target, capture every tap at once, and replay the
decoder's greedy chain of K draft tokens (chain.py) at every position. It replays under the wiring the
engine will really use and under the plausible mistakes: each tap shifted by +-1, all shifted, the
embedding in or out, other fc orders, the post-norm final state instead of tap N. Wirings are compared
on the same prompts and positions (paired.py), and the verdict is in acceptance length, the figure
`bench` and the engines report. Also compares the per-tap activation statistics recorded at training
time (checkpoint.tap_stats) with the live target's, which catches wrong taps without running the
draft.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass

import torch

from ..capture import locate
from ..checkpoint import tap_stats
from . import chain, paired
from .findings import Remedy, finding
from .probe_inputs import FINAL, Sequences, capture_states

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
               first: str = "what the engine captures", stated: tuple = ()) -> list[Wiring]:
    """The engine's wiring first, then the trained one, taps stated elsewhere ((label, taps) pairs: ids under
    a key the engine ignores) and every plausible mistake around the engine's."""
    N, n = num_layers, len(engine)
    out = [Wiring(tuple(engine), first)]
    if trained is not None and len(trained) == n:
        out.append(Wiring(tuple(trained), "the draft's recorded taps"))
    out += [Wiring(tuple(taps), label) for label, taps in stated if len(taps) == n]
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


# --- measurement ----------------------------------------------------------------------------------

@torch.no_grad()
def measure(draft, seqs: list, states: list[dict], wiring: Wiring, steps: int) -> tuple[dict, paired.PerPrompt]:
    """The decoder's chain of `steps` replayed with `draft` fed `wiring`: (chain.summarize's figures, the
    per-prompt tallies the paired comparison needs)."""
    tallies = []
    for (ids, mask), st in zip(seqs, states):
        taps = torch.cat([st[s] for s in wiring.sources], dim=-1)  # (T, n*H)
        tallies.append(chain.tally(draft, taps, ids, mask, st["top"], steps))
    return chain.summarize(tallies, steps), paired.PerPrompt.of(tallies)


def recorded_accuracy(meta_metrics: dict | None) -> list[float] | None:
    """Held-out per-step accuracy the trainer recorded (`metrics` in the checkpoint), if any."""
    if not isinstance(meta_metrics, dict):
        return None
    for cand in (meta_metrics.get("heldout"), meta_metrics):  # train/trainer.py writes {"heldout": summarize(...)}
        if isinstance(cand, dict) and isinstance(cand.get("acc"), list) and cand["acc"] and cand["acc"][0] is not None:
            return [float(a) if a is not None else 0.0 for a in cand["acc"]]
    return None


def _se(p: float | None, n: int) -> float:
    if p is None or n <= 0:
        return 1.0
    return math.sqrt(max(p * (1 - p), 1.0 / n) / n)


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
    return {k: tap_stats(torch.cat([st[k].float() for st in states]), 1)["per_tap"][0] for k in keys}


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


def run(target, draft, *, engine_taps, trained, inputs: Sequences, steps: int = 7, recorded: bool = True,
        recorded_metrics=None, recorded_stats=None, change_for=None, who: str = "the engine",
        pin_ids: bool = False, stated: tuple = (), progress: bool = False) -> tuple[list, dict]:
    """Measure; -> (findings, the probe's JSON record). `change_for(taps)` -> (text, Remedy|None).
    `trained`: the taps the draft was trained on, as eaglewire recorded them (recorded) or as inferred from
    its files. `pin_ids`: the engine reads no explicit ids (it falls back to its defaults), so a wiring found
    right is also written down."""
    stack = locate(target.model)
    N, n_taps = stack.num_layers, draft.config.num_taps
    draft = draft.to(next(stack.lm_head.parameters()).device)  # fp32 as loaded; the target may be bf16 on a GPU
    seqs = inputs.seqs
    say = (lambda m: print(f"eaglewire doctor: probe: {m}", file=sys.stderr, flush=True)) if progress else \
        (lambda m: None)
    t0 = time.perf_counter()
    states = [capture_states(target.model, ids) for ids, _ in seqs]
    say(f"every tap of {len(seqs)} sequence(s) captured in {time.perf_counter() - t0:.1f} s")
    base = tuple(engine_taps) if engine_taps is not None else tuple(trained)
    record = {"prompts": len(seqs), "prompt_source": inputs.source, "steps": steps, "engine_wiring": list(base),
              "level": paired.LEVEL, "wirings": [], "notes": list(inputs.notes)}
    if len(base) != n_taps:
        record["notes"].append(f"{who} feeds {len(base)} taps, the draft's fc reads {n_taps}: only other wirings "
                               "measured")
        wirings = [Wiring(tuple(trained), "the draft's recorded taps")] if trained and len(trained) == n_taps else []
    else:
        wirings = candidates(base, tuple(trained) if trained and recorded else None, N,
                             "what the engine captures" if engine_taps is not None else "the recorded taps", stated)
    measured = []
    for i, w in enumerate(wirings):
        measured.append((w, *measure(draft, seqs, states, w, steps)))
        say(f"wiring {i + 1}/{len(wirings)} {w.describe()}: acceptance length "
            f"{measured[-1][1]['acceptance_length']:.2f} ({time.perf_counter() - t0:.0f} s)")
    eng = measured[0] if measured and len(base) == n_taps else None
    diffs = paired.compare(eng[2], [pp for _, _, pp in measured[1:]]) if eng else [None] * len(measured)
    for (w, r, _), d in zip(measured, [None] + diffs if eng else diffs):
        record["wirings"].append({"taps": [str(s) if s == FINAL else s for s in w.sources], "label": w.label,
                                  **{k: _round(v) for k, v in r.items()}, "vs_engine": d.to_dict() if d else None})
    if not measured:
        return [], record
    record["positions"], record["rounds"] = measured[0][1]["positions"], measured[0][1]["rounds"]
    findings = []
    if eng is not None:
        findings.append(_verdict(eng, list(zip(measured[1:], diffs)), draft, change_for, who,
                                 trained if recorded else None, pin_ids, steps, len(seqs)))
        record["verdict"] = findings[-1].code
    findings += _low_acceptance(eng, recorded_metrics, record, bool(findings and findings[-1].code == "PROBE_WIRING"),
                                inputs.source.startswith("--prompts") or target.tokenizer is None)
    if recorded_stats and eng is not None:
        findings += _tap_stat_findings(recorded_stats, states, N, base, record)
    return findings, record


def _round(v):
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, list):
        return [_round(x) for x in v]
    return v


def _ci(d: paired.Difference) -> str:
    lo, hi = d.length_ci
    return f"{d.length:+.2f}, interval {lo:+.2f}..{hi:+.2f}"


def _ll(d: paired.Difference) -> str:
    lo, hi = d.loglik_ci
    return f"{d.loglik:+.3f} nats, interval {lo:+.3f}..{hi:+.3f}"


SHIFTS = ("every tap -1", "every tap +1")  # candidates()'s labels of the whole-list shifts


def _verdict(eng, alts, draft, change_for, who: str, trained, pin_ids: bool, K: int, P: int):
    """PROBE_WIRING when another wiring reads significantly better: an error from a cost of paired.COSTLY of
    acceptance length. It is a warning when the gain is smaller, or when only the step-1 log-probability of the
    target's tokens tells the two apart (a draft that rarely hits ties on acceptance). PROBE_UNSURE when a
    whole-list shift reads no worse by either measure, so the measurement cannot tell the engine's wiring from
    the seed's fault. Else PROBE_OK, saying whether it is the best or tied within noise."""
    ew, er, _ = eng
    scale = (f"acceptance length {er['acceptance_length']:.2f} (a greedy chain of {K}, {P} prompts, "
             f"{er['rounds']} rounds)")
    flagged = [(w, r, d) for (w, r, _), d in alts if d.better or (d.likelier and not d.worse)]
    if flagged:
        return _wiring(ew, er, flagged, draft, change_for, who, trained, scale)
    # The seed's faults are whole-list shifts: a wiring is told right only when each of them reads significantly
    # worse. A draft that predicts little, or too few prompts, ties with them, and that is no evidence either way.
    shifts = [(w, d) for (w, _, _), d in alts if w.label in SHIFTS and not d.worse and not d.less_likely]
    if shifts:
        w, d = max(shifts, key=lambda x: x[1].length)
        msg = (f"could not tell the wiring {who} will use, {ew.describe()}, from {w.describe()} ({w.label}): "
               f"{_ci(d)}" + (f", step-1 log-probability {_ll(d)}" if d.loglik_ci is not None else "")
               + f", paired over the same prompts; {scale}, step-1 accuracy {_pct(er['acc1'])}")
        return finding("PROBE_UNSURE", "warning", msg,
                       f"measure on more prompts (--probe {2 * P} --probe-tokens 256), or on a draft that has trained "
                       "longer; until then the taps are unverified")
    msg = _ok_message(ew, er, alts, who, scale)
    if pin_ids and change_for is not None:
        text, remedy = change_for(ew.sources)
        if remedy is not None:
            return finding("PROBE_OK", "info", msg + "; the engine reaches it only through its default taps",
                           f"write it down so that it does not depend on the engine's fallback: {text}", remedy)
    return finding("PROBE_OK", "info", msg, "")


def _wiring(ew, er, flagged, draft, change_for, who: str, trained, scale: str):
    # Of the wirings that read better, the one the draft gives the target's tokens the most probability: the
    # finer measure of what it was trained on (one tap fixed may gain acceptance too, the whole list more)
    costly = [x for x in flagged if x[2].better and x[2].cost >= paired.COSTLY]
    w, r, d = max(costly or flagged, key=lambda x: (x[2].loglik if x[2].loglik is not None else 0.0, x[2].length))
    text, remedy = _change(w, draft, change_for)
    stale = (" The recorded taps are not what this draft reads best either." if trained and
             tuple(w.sources) != tuple(trained) and w.plain else
             "" if trained else f" Nothing records which taps it was trained on: of the wirings tried it reads "
             f"{w.describe()} best.")
    if d.better:
        how = (f"better: {r['acceptance_length']:.2f} ({_ci(d)}, paired over the same prompts), so the engine's "
               f"wiring costs {100 * d.cost:.1f}% of acceptance length")
    else:
        how = (f"better, by the log-probability it gives the target's next token: {_ll(d)}, paired over the "
               f"same prompts; acceptance length {r['acceptance_length']:.2f} ({_ci(d)}) is too close to tell "
               "at this draft's accuracy")
    msg = (f"{who} will feed {ew.describe()}: {scale}; the draft reads {w.describe()} ({w.label}) {how}; "
           f"step-1 accuracy {_pct(er['acc1'])} against {_pct(r['acc1'])}.{stale}")
    if not costly:
        text = (f"a small but measured gain (under {100 * paired.COSTLY:.0f}% of acceptance length): {text}"
                if d.better else f"the draft was likely trained on {w.describe()}: {text}")
    return finding("PROBE_WIRING", "error" if costly else "warning", msg, text, remedy)


def _ok_message(ew, er, alts, who: str, scale: str) -> str:
    ties = sorted(((w, d) for (w, _, _), d in alts if d.length >= 0), key=lambda x: -x[1].length)
    if ties:
        lead_w, lead = ties[0]
        names = ", ".join(w.describe() for w, _ in ties[:3]) + (f" and {len(ties) - 3} more" if len(ties) > 3 else "")
        exact = all(d.length_ci == (0.0, 0.0) for _, d in ties)
        how = "the same acceptance on every prompt" if exact else f"the closest, {lead_w.describe()}, {_ci(lead)}"
        msg = f"the wiring {who} will use {ew.describe()} is tied with {names} within noise ({how}): {scale}"
    elif alts:
        (nw, _, _), nd = max(alts, key=lambda x: x[1].length)
        lower = "significantly lower" if nd.worse else "within noise"
        msg = (f"the wiring {who} will use {ew.describe()} reads best of the {len(alts) + 1} wirings tried: {scale}; "
               f"the next, {nw.describe()}, {_ci(nd)} ({lower})")
    else:
        msg = f"the wiring {who} will use {ew.describe()}: {scale} (no other wiring to compare)"
    msg += f"; step-1 accuracy {_pct(er['acc1'])}"
    by_ll = [w for (w, _, _), d in alts if w.label in SHIFTS and not d.worse]
    if by_ll:
        msg += (f"; {', '.join(w.describe() for w in by_ll)} told apart only by the log-probability the draft gives "
                "the target's next token")
    return msg


def _pct(x: float | None) -> str:
    return f"{100 * (x or 0.0):.1f}%"


def _low_acceptance(eng, recorded_metrics, record: dict, wiring_found: bool, own_prompts: bool) -> list:
    """Far below the held-out accuracy of training. On the user's prompts (the training distribution) a
    drop is an error when halved, else a warning; on other prompts, whose text differs from any training
    set, only a halving is worth a warning."""
    rec = recorded_accuracy(recorded_metrics)
    if rec is None or eng is None:
        return []
    record["recorded_acc"] = rec
    got, positions = eng[1]["acc1"] or 0.0, eng[1]["positions"]
    halved = got < 0.5 * rec[0]
    if got >= rec[0] - max(0.15, 3 * _se(got, positions)) or (not own_prompts and not halved):
        return []
    sev = ("error" if halved else "warning") if own_prompts or wiring_found else "warning"
    return [finding("PROBE_LOW_ACCEPTANCE", sev, f"step-1 accuracy {_pct(got)} under the engine's wiring, "
                    f"{_pct(rec[0])} held out at training time",
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
