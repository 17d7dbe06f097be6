"""`eaglewire bench`: HF `generate`, our decoder without and with the draft, on the same prompts, in one run.

Three runs are timed prompt by prompt, each run in turn, after a warm-up of each (`run_prompts`):
  (a) `hf`: transformers `generate` (dynamic cache on CPU; static cache on CUDA, which transformers
      compiles by itself; `hf_cache` picks), batch 1;
  (b) `base`: our decoder, no speculation (one target step per token, same engine as (c));
  (c) `spec`: our decoder with the draft (chain of K or EAGLE-2 tree).
(b) and (c) run torch.compile'd forwards by default on CUDA (`compile`, recorded in the settings);
the warm-up compiles them, and a size first met while timed is counted in `graphs_compiled_while_timed`.
On a CPU in fp32 they run oneDNN-packed linear layers (prepack.py; "+onednn" in the run's name), while
(a) keeps transformers' own: the engines differ in their matrix kernels too, and (b) shows by how much.
`fuse_projections` (on: the decoder's default, targets up to 1B parameters; speedups.py) runs (b) and (c)
with q/k/v and gate/up as one matmul each ("+fused"; projections.py). `grouped_attention` (None: the
decoder's default, on for CUDA) runs a target whose query heads share K/V heads through attention.py ("+grouped").
Speculation on static shapes runs its rounds (rounds.py) at fixed shapes, compiled or captured ("+rounds").
`--shapes` times several draft shapes against one run without a draft instead (shapes.py).

Acceptance length = generated tokens / verification steps, the bonus token included (SGLang
`completion_tokens / spec_verify_ct`, vLLM `1 + accepted / drafts`). Acceptance rate at draft
position i = the share of verification steps that accepted at least i draft tokens (vLLM's
`spec_decode_num_accepted_tokens_per_pos[i] / num_drafts`); `conditional` divides by the steps
that accepted i-1 instead. Suites with categories (MT-bench) also get the acceptance length of each
category: where a draft falls short is often one kind of prompt. A target step's physical floor is the
bytes of its weights read once at memory bandwidth (report.BANDWIDTH, or `--bandwidth`). On a CPU only
ms/step is reported.

Greedy runs check that (b) and (c) emit the tokens of (a) (or of (b) with `hf=False`). In fp32 a
mismatch is a failure unless the target's top-2 logits at the divergence are a near tie (< TIE_GAP
apart: different batch shapes round differently). In bf16 the divergences are only reported, with
the target's top-2 logit gap at each: small gaps are rounding, a large one points at a wiring bug.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from .. import stats, targets
from ..data import suites
from ..decode.decoder import SpecConfig
from ..decode.draft_runner import DraftRunner
from ..decode.speedups import Speedups
from ..errors import UsageError
from ..parallel import pick_device
from ..runtime.runners import TargetRunner
from ..runtime.sampling import SamplingParams
from .report import floor_ms, machine_info, plot_acceptance, write_json

PROGRESS_EVERY_S = 10.0  # a line at most this often while the runs are timed
TIE_GAP = 1e-3  # fp32 top-2 logit gap below which a greedy divergence is rounding, not a bug
DTYPES = targets.DTYPES


def _bad(flag: str, value, why: str):
    raise UsageError(f"bench: --{flag.replace('_', '-')} {why}, got {value!r}")


def _device(device: str | torch.device | None) -> torch.device:
    """A --device name checked against this machine; a torch.device is taken as it is (a run's own device)."""
    return device if isinstance(device, torch.device) else pick_device(device)


def shape_from(device, mode: str = "chain", *, chain: int | None = None, depth: int | None = None,
               topk: int | None = None, budget: int | None = None) -> SpecConfig:
    """The decoder's shape from the bench's flags (each None: decode.DEFAULT_SHAPES for the device), checked
    under the flags' names so that an error names what the user typed."""
    if mode not in ("chain", "tree"):
        _bad("mode", mode, "must be chain or tree")
    for flag, v in (("chain", chain), ("depth", depth), ("topk", topk), ("budget", budget)):
        if v is not None and v < 1:
            _bad(flag, v, "must be >= 1")
    return SpecConfig.for_device(_device(device), mode, K=chain, depth=depth, topk=topk, budget=budget)


def speedups_from(device, *, compile: bool | str = "auto", cuda_graphs: bool = True, prepack: bool = True,
                  fuse_projections: bool = True, grouped_attention: bool | None = None) -> Speedups:
    """The decoder's speed-ups from the bench's flags for a device: compile "auto" is on CUDA only, CUDA graphs
    are ignored on a CPU, and prepack/fuse_projections True leave the choice to the decoder (None) while False
    turns them off."""
    if compile not in ("auto", True, False):
        _bad("compile", compile, "must be auto, True or False")
    for flag, v in (("cuda_graphs", cuda_graphs), ("prepack", prepack), ("fuse_projections", fuse_projections)):
        if not isinstance(v, bool):
            _bad(flag, v, "must be True or False")
    if not isinstance(grouped_attention, bool | None):
        _bad("grouped_attention", grouped_attention, "must be True, False or None (auto)")
    cuda = _device(device).type == "cuda"
    return Speedups(cuda_graphs=cuda_graphs and cuda, compile=cuda if compile == "auto" else compile,
                    prepack=None if prepack else False, fuse_projections=None if fuse_projections else False,
                    grouped_attention=grouped_attention)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to run: the bench's own settings, and the decoder's three parts as the decoder takes them (its shape,
    the sampling, its speed-ups), so that a run is described once and the bench adds no second vocabulary."""

    suite: str
    max_prompts: int | None = None
    max_new_tokens: int = 256
    shape: SpecConfig | None = None  # None: decode.DEFAULT_SHAPES' chain for the device, resolved here
    sampling: SamplingParams = SamplingParams()  # greedy
    speedups: Speedups | None = None  # None: the device's choice (speedups_from's defaults), resolved per run
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: fp32 on cpu, bf16 on cuda
    hf: bool = True
    hf_cache: str = "auto"  # auto: static on cuda, dynamic on cpu
    warmup: bool = True
    seed: int = 0
    bandwidth: float | None = None  # bytes/s; None: bench_report.BANDWIDTH by device name

    def __post_init__(self):
        if self.max_prompts is not None and self.max_prompts < 1:
            _bad("max_prompts", self.max_prompts, "must be >= 1")
        if self.max_new_tokens < 1:
            _bad("max_new_tokens", self.max_new_tokens, "must be >= 1")
        device = pick_device(self.device)  # a device this machine lacks fails here, before anything loads
        if self.shape is None:
            object.__setattr__(self, "shape", shape_from(device))  # frozen: resolved once, here
        for name, kind, what in (("shape", SpecConfig, "SpecConfig"), ("sampling", SamplingParams, "SamplingParams"),
                                 ("speedups", Speedups | None, "Speedups or None")):
            if not isinstance(getattr(self, name), kind):
                raise UsageError(f"bench: {name} must be a {what}, got {type(getattr(self, name)).__name__}")
        if self.dtype is not None and self.dtype not in DTYPES:
            _bad("dtype", self.dtype, f"must be one of {list(DTYPES)}")
        if self.hf_cache not in ("auto", "dynamic", "static"):
            _bad("hf_cache", self.hf_cache, "must be auto, dynamic or static")
        if self.bandwidth is not None and not self.bandwidth > 0:
            _bad("bandwidth", self.bandwidth, "must be > 0 (bytes/s)")

    def speedups_for(self, device: torch.device) -> Speedups:
        """Our decoder's speed-ups on this device: the given ones (CUDA graphs only where there is CUDA), or the
        device's choice."""
        if self.speedups is None:
            return speedups_from(device)
        return replace(self.speedups, cuda_graphs=self.speedups.cuda_graphs and device.type == "cuda")

    def compiles(self, device: torch.device) -> bool:
        """Whether our decoder runs compiled forwards on this device."""
        return self.speedups_for(device).compile

    def draft_shape(self) -> dict:
        s = self.shape
        if s.mode == "chain":
            return {"mode": "chain", "K": s.K}
        return {"mode": "tree", "depth": s.depth, "topk": s.topk, "budget": s.budget}

    def flat(self, device: torch.device) -> dict:
        """The settings as one flat dict, the keys bench.json has always had (its readers and the docs use them):
        prepack and fuse_projections say whether they were asked for, compile and cuda_graphs what ran."""
        s, ups = self.shape, self.speedups_for(device)
        return {"max_prompts": self.max_prompts, "max_new_tokens": self.max_new_tokens,
                "temperature": self.sampling.temperature, "top_p": self.sampling.top_p, "top_k": self.sampling.top_k,
                "mode": s.mode, "chain": s.K, "depth": s.depth, "topk": s.topk, "budget": s.budget,
                "device": str(device), "dtype": self.dtype, "hf": self.hf, "hf_cache": self.hf_cache,
                "cuda_graphs": ups.cuda_graphs, "compile": ups.compile, "prepack": ups.prepack is not False,
                "fuse_projections": ups.fuse_projections is not False, "grouped_attention": ups.grouped_attention,
                "warmup": self.warmup, "seed": self.seed, "bandwidth": self.bandwidth}


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One prompt's output under one run."""

    tokens: list[int]
    wall_s: float
    steps: int  # target forwards after the prefill (HF: one per token after the first)
    accepted: list[int] | None = None  # draft tokens accepted per verification step (spec only)
    timings: dict | None = None  # the decoder's own split (prefill_s, decode_s, ...)


# --- timing ---------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device):
    """fn() and its wall time, the device drained before and after."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


# --- the three runs -------------------------------------------------------------------------------


def hf_runner(target, cfg: BenchConfig, device: torch.device, eos: list[int]):
    """(name, run(ids, max_new, seed) -> Generation, None) for transformers' own `generate`."""
    cache = cfg.hf_cache if cfg.hf_cache != "auto" else ("static" if device.type == "cuda" else "dynamic")
    s = cfg.sampling
    kw = dict(eos_token_id=eos, pad_token_id=eos[0] if eos else None, do_sample=not s.greedy,
              # neutral values override what a model's generation_config.json may set (our decoder has none)
              repetition_penalty=1.0, no_repeat_ngram_size=0, min_length=0)
    if not s.greedy:  # top_k=0, not None: an unset top_k falls back to transformers' default of 50
        kw.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    if cache == "static":
        kw["cache_implementation"] = "static"  # transformers compiles the decode step for a static cache on CUDA

    def run(ids: torch.Tensor, max_new: int, seed: int = 0) -> Generation:
        torch.manual_seed(seed)  # HF samples from the global generator
        attn = torch.ones_like(ids)
        out, wall = timed(lambda: target.model.generate(ids, attention_mask=attn, max_new_tokens=max_new, **kw),
                          device)
        toks = out[0, ids.shape[1]:].tolist()
        return Generation(tokens=toks, wall_s=wall, steps=max(len(toks) - 1, 0))

    return f"hf-{cache}", run, None


def decoder_runner(target, draft, meta, cfg: BenchConfig, device: torch.device, eos: list[int], speculate: bool):
    """(name, run, decoder) for our decoder, with the draft or without speculation (same engine)."""
    from torch._dynamo.utils import counters

    from ..decode.decoder import SpecDecoder

    # The pair check (taps, hidden size, vocab, fingerprint) runs here, before anything is timed.
    dec = SpecDecoder(target, draft if speculate else None, meta if speculate else None, shape=cfg.shape,
                      speedups=cfg.speedups_for(device))
    greedy = cfg.sampling.greedy

    def run(ids: torch.Tensor, max_new: int, seed: int = 0) -> Generation:
        graphs = counters["stats"]["unique_graphs"]
        res, wall = timed(lambda: dec.generate(ids, max_new, cfg.sampling, eos, seed=None if greedy else seed),
                          device)
        # a size first met in a timed run compiles there (seconds): counted, so the report can say so
        compiled = counters["stats"]["unique_graphs"] - graphs
        return Generation(tokens=list(res.tokens), wall_s=wall, steps=int(res.num_steps),
                          accepted=list(res.accepted_per_step) if speculate else None,
                          timings={**res.timings, "graphs_compiled": compiled})

    shape = cfg.shape
    name = "eaglewire-" + ("base" if not speculate else
                           f"chain-K{shape.K}" if shape.mode == "chain"
                           else f"tree-d{shape.depth}-k{shape.topk}-b{shape.budget}")
    # every speculative round is rounds.py's; "+rounds" names those on static shapes (compiled, captured on CUDA)
    rounds = speculate and dec.verifier.static
    done = dec.applied
    return name + ("+compile" if cfg.compiles(device) else "") + ("+onednn" if done.prepack else "") + \
        ("+fused" if done.fuse_projections else "") + ("+grouped" if done.grouped_attention else "") + \
        ("+rounds" if rounds else ""), run, dec


def run_prompts(runs: dict[str, tuple[str, Callable]], prompts: list[torch.Tensor], cfg: BenchConfig,
                device: torch.device, log, warmed: tuple[str, ...] = ()) -> dict[str, list[Generation]]:
    """Warm every run up (but those in `warmed`), then time prompt by prompt, each run in turn ({key: (label,
    run)} -> {key: gens}).

    Interleaved so that a slow spell of the machine (a job on the next GPU, clocks, the host) lands on every
    run alike. The ratios are the figures: HF's step can move by 15% from one bench to the next.
    """
    warm_up({k: r for k, r in runs.items() if k not in warmed}, prompts, cfg, device, log)
    gens: dict[str, list[Generation]] = {k: [] for k in runs}
    shown = time.perf_counter()
    for i, ids in enumerate(prompts):  # sampling: prompt i draws from a generator seeded with seed + i in every run
        for k, (_, run) in runs.items():
            gens[k].append(run(ids, cfg.max_new_tokens, cfg.seed + i))
        if time.perf_counter() - shown > PROGRESS_EVERY_S and i + 1 < len(prompts):
            log(f"eaglewire bench: timed {i + 1} of {len(prompts)} prompts")
            shown = time.perf_counter()
    for k, (label, _) in runs.items():
        tokens, wall = sum(len(g.tokens) for g in gens[k]), sum(g.wall_s for g in gens[k])
        log(f"eaglewire bench: {label}: {len(gens[k])} prompts, {tokens} tokens in {wall:.2f} s")
    return gens


def warm_up(runs: dict[str, tuple[str, Callable]], prompts: list[torch.Tensor], cfg: BenchConfig,
            device: torch.device, log) -> None:
    """Each run once over the longest prompt for the full length on CUDA (first, so HF allocates its largest
    static cache once and compiles for it) or 8 tokens on a CPU. Then every prompt for 2 tokens: on a GPU the
    first forward of each new prompt length picks kernels, a fraction of a second per prompt. Nothing if
    cfg.warmup is off."""
    if not cfg.warmup:
        return
    longest = max(prompts, key=lambda p: p.shape[1])
    for label, run in runs.values():
        log(f"eaglewire bench: {label}: warm-up" + (" (compiling every shape it meets: a minute or more the "
                                                    "first time)" if device.type == "cuda" else ""))
        t0 = time.perf_counter()
        run(longest, cfg.max_new_tokens if device.type == "cuda" else min(cfg.max_new_tokens, 8), cfg.seed)
        for ids in prompts:
            run(ids, min(cfg.max_new_tokens, 2), cfg.seed)
        log(f"eaglewire bench: {label}: warmed up in {time.perf_counter() - t0:.1f} s")


# --- metrics --------------------------------------------------------------------------------------


def summarize(gens: list[Generation], floor_ms: float | None) -> dict:
    """Totals over prompts. A step is one target forward; the prefill counts as one per prompt."""
    tokens, wall = sum(len(g.tokens) for g in gens), sum(g.wall_s for g in gens)
    forwards = sum(g.steps for g in gens) + len(gens)
    ms_step = 1e3 * wall / forwards
    out = {"prompts": len(gens), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
           "steps": sum(g.steps for g in gens), "ms_per_step": ms_step,
           "steps_over_floor": ms_step / floor_ms if floor_ms else None}
    if all(g.timings for g in gens):  # our decoder splits prefill from the decode loop
        prefill, decode = sum(g.timings["prefill_s"] for g in gens), sum(g.timings["decode_s"] for g in gens)
        out.update(prefill_s=prefill, decode_s=decode,
                   decode_ms_per_step=1e3 * decode / out["steps"] if out["steps"] else None,
                   graphs_compiled_while_timed=sum(g.timings.get("graphs_compiled", 0) for g in gens))
    return out


def acceptance(gens: list[Generation], positions: int) -> dict:
    """Acceptance length and per-position rates of a speculative run (see the module docstring)."""
    acc = [a for g in gens for a in (g.accepted or [])]
    steps = sum(g.steps for g in gens)
    tokens = sum(len(g.tokens) for g in gens)
    n = max([positions, *acc])
    reached = [sum(a >= i for a in acc) for i in range(n + 1)]  # reached[0] = verification steps
    interval = stats.ratio_interval([len(g.tokens) for g in gens], [g.steps for g in gens])
    return {
        "acceptance_length": tokens / steps if steps else None,
        "acceptance_length_interval": list(interval) if interval else None,  # 95%, bootstrap over prompts
        "mean_accepted_plus_bonus": (sum(acc) + len(acc)) / len(acc) if acc else None,
        "verification_steps": steps,
        "rate_by_position": [reached[i] / reached[0] if reached[0] else 0.0 for i in range(1, n + 1)],
        "conditional_rate_by_position": [reached[i] / reached[i - 1] if reached[i - 1] else None
                                         for i in range(1, n + 1)],
        "accepted_histogram": [sum(a == i for a in acc) for i in range(n + 1)],
    }


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (or where the shorter ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def logit_gap(model, prompt: torch.Tensor, prefix: list[int]) -> float:
    """The target's top-1 minus top-2 logit after prompt + prefix (a full, uncached forward)."""
    ids = torch.cat([prompt, torch.tensor([prefix], dtype=prompt.dtype, device=prompt.device)], dim=1)
    top = model(ids).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def greedy_check(target, prompts: list[torch.Tensor], runs: dict[str, list[Generation]], ref: str,
                 dtype: torch.dtype) -> dict:
    """Compare every run's tokens with the reference run's, prompt by prompt."""
    strict = dtype == torch.float32
    mismatches = []
    for name, gens in runs.items():
        if name == ref:
            continue
        for i, (g, r) in enumerate(zip(gens, runs[ref])):
            pos = first_divergence(r.tokens, g.tokens)
            if pos is None:
                continue
            gap = logit_gap(target.model, prompts[i], r.tokens[:pos]) if pos < len(r.tokens) else None
            mismatches.append({"run": name, "prompt": i, "position": pos, "top2_logit_gap": gap,
                               "tie": strict and gap is not None and gap < TIE_GAP,
                               "ref_token": r.tokens[pos] if pos < len(r.tokens) else None,
                               "token": g.tokens[pos] if pos < len(g.tokens) else None})
    failed = [m for m in mismatches if not m["tie"]]
    return {"reference": ref, "strict": strict, "compared": [n for n in runs if n != ref],
            "mismatches": mismatches, "ok": (not failed) if strict else None}


# --- the whole run --------------------------------------------------------------------------------


def overflowing(prompts: list[torch.Tensor], cfg: BenchConfig, target) -> tuple[int | None, list[int]]:
    """(the target's positions, the prompts that with max_new_tokens do not fit them: the decoder's rule)."""
    limit = getattr(target.config, "max_position_embeddings", None)
    return limit, [i for i, p in enumerate(prompts) if limit and p.shape[1] + cfg.max_new_tokens > limit]


def check_context(prompts: list[torch.Tensor], cfg: BenchConfig, target, suite_name: str) -> None:
    """Every prompt + max_new_tokens must fit the target's positions, checked up front."""
    limit, over = overflowing(prompts, cfg, target)
    if over:
        i = over[0]
        raise UsageError(f"--max-new-tokens {cfg.max_new_tokens}: prompt {i} of {suite_name} has {prompts[i].shape[1]} "
                         f"tokens, together more than the target's context of {limit} (max_position_embeddings); "
                         "lower --max-new-tokens or --max-prompts")


def _load(target, draft, device: torch.device, dtype: torch.dtype):
    from ..checkpoint import load_draft

    if isinstance(target, targets.Target):
        t = target
        t.model.to(device=device, dtype=dtype)
    else:
        t = targets.load_target(target, dtype=dtype, device=device)
    model, meta = draft if isinstance(draft, tuple) else load_draft(draft, device=device, dtype=dtype)
    return t, model.to(device=device, dtype=dtype), meta


def prepare(target, draft, cfg: BenchConfig) -> tuple:
    """(device, dtype, suite prompts, target, draft, meta, encoded prompts, EOS ids) for a run; the cheap
    errors (device, suite, context) before the models load or anything is timed."""
    device = pick_device(cfg.device)
    dtype = targets.dtype_of(cfg.dtype, device)
    named = cfg.suite in suites.SUITES
    # a named suite is read whole, so that prompts the target cannot hold are left out before the even spacing
    sp = suites.load_suite(cfg.suite, None if named else cfg.max_prompts)
    t, draft_model, meta = _load(target, draft, device, dtype)
    prompts = [suites.encode_prompt(t.tokenizer, c) for c in sp.conversations]
    if named:
        sp, prompts = fitting(sp, prompts, cfg, t)
    check_context(prompts, cfg, t, sp.name)
    return device, dtype, sp, t, draft_model, meta, [p.to(device) for p in prompts], targets.eos_ids(t)


def fitting(sp, prompts: list[torch.Tensor], cfg: BenchConfig, target) -> tuple:
    """A named suite without the prompts that, with --max-new-tokens, overflow the target's context (Arena-Hard
    holds prompts of 11k tokens), then cut to --max-prompts evenly spaced; the cuts noted."""
    limit, over = overflowing(prompts, cfg, target)
    if len(over) == len(prompts):
        raise UsageError(f"--suite {cfg.suite}: no prompt fits the target's context of {limit} tokens with "
                         f"--max-new-tokens {cfg.max_new_tokens}")
    if over:
        dropped = set(over)
        keep = [i for i in range(len(prompts)) if i not in dropped]
        sp = suites.subset(sp, keep, f"{len(over)} prompts longer than the target's context of {limit} tokens (with "
                           f"--max-new-tokens {cfg.max_new_tokens}) left out")
        prompts = [prompts[k] for k in keep]
    sp, pick = suites.spaced(sp, cfg.max_prompts)
    return sp, [prompts[k] for k in pick]


def run_bench(target, draft, suite: str, *, json_out=None, plot=None, log=None, **settings) -> dict:
    """Run (a) HF generate, (b) our decoder without and (c) with speculation on one suite; return the result dict.

    target: a `--target` spec or a loaded `targets.Target`; draft: a checkpoint dir or (Eagle3Draft, DraftMeta);
    settings: the fields of BenchConfig (shape, sampling and speedups as the decoder's own configs). Writes JSON
    to `json_out` and the acceptance PNG to `plot` if given.
    """
    return warm(target, draft, suite, log=log, **settings).run(json_out=json_out, plot=plot)


@dataclass
class Bench:
    """A bench built and warmed up (`warm`), ready to be timed (`run`).

    A bench can be warmed with one draft and timed with another of the same config: `run(draft)` copies the
    trained weights into the decoder in place, so the compiled code and CUDA graphs made for the first draft
    run the second. A recipe warms its bench before training and times it after, so the compile counts
    before the training budget is set, and not after it has run out.
    """

    cfg: BenchConfig
    device: torch.device
    dtype: torch.dtype
    suite: object  # suites.Suite
    target: targets.Target
    meta: object  # the draft's DraftMeta
    prompts: list[torch.Tensor]
    runners: dict[str, tuple]  # key -> (name, run, decoder or None)
    log: Callable
    warmup_s: float = 0.0

    def estimate_s(self) -> float:
        """An estimate of the seconds `run` will time: each run once over the longest prompt, times the prompts.
        It reads high where the longest prompt costs most and the draft timed accepts more than this one (an
        untrained draft accepts least), and low where this reply stops at EOS before the others do."""
        longest = max(self.prompts, key=lambda p: p.shape[1])
        once = sum(run(longest, self.cfg.max_new_tokens, self.cfg.seed).wall_s for _, run, _ in self.runners.values())
        return once * len(self.prompts)

    def run(self, draft=None, *, json_out=None, plot=None) -> dict:
        """Time every run on every prompt (with `draft`'s weights, a checkpoint dir or (Eagle3Draft, DraftMeta),
        if given) and return the result; writes JSON to `json_out` and the acceptance PNG to `plot` if given."""
        spec = self.runners["spec"][2]
        if draft is not None:
            _, model, self.meta = _load(self.target, draft, self.device, self.dtype)
            spec.load_draft_weights(model, self.meta)
        runs = {k: (f"{k} ({name})", run) for k, (name, run, _) in self.runners.items()}
        gens = run_prompts(runs, self.prompts, self.cfg, self.device, self.log, warmed=tuple(runs))
        result = build_result(self.cfg, self.target, self.meta, self.suite, self.prompts, gens,
                              {k: r[0] for k, r in self.runners.items()}, self.device, self.dtype)
        result["warnings"] = list(spec.warnings)
        result["settings"]["linears"] = spec.applied.linears
        result["warmup_s"] = round(self.warmup_s, 2)
        if json_out:
            write_json(result, json_out)
        if plot:
            plot_acceptance(result, Path(plot))
        return result


def warm(target, draft, suite: str, *, log=None, **settings) -> Bench:
    """A Bench of `draft` on `suite` (run_bench's arguments), built and warmed up: every shape it will time
    compiled and captured."""
    cfg = BenchConfig(suite=suite, **settings)
    log = log or (lambda msg: print(msg, file=sys.stderr))
    device, dtype, sp, t, draft_model, meta, prompts, eos = prepare(target, draft, cfg)
    runners = {"hf": hf_runner(t, cfg, device, eos)} if cfg.hf else {}
    runners["base"] = decoder_runner(t, draft_model, meta, cfg, device, eos, speculate=False)
    runners["spec"] = decoder_runner(t, draft_model, meta, cfg, device, eos, speculate=True)
    t0 = time.perf_counter()
    warm_up({k: (f"{k} ({name})", run) for k, (name, run, _) in runners.items()}, prompts, cfg, device, log)
    return Bench(cfg, device, dtype, sp, t, meta, prompts, runners, log, time.perf_counter() - t0)


def autotuned(device: torch.device) -> dict[str, bool]:
    """Whose compiled single-row decode-step matmuls are autotuned (CUDA only): a bench's speed depends on it."""
    cuda = device.type == "cuda"
    return {"target": TargetRunner.autotune and cuda, "draft": DraftRunner.autotune and cuda}


def describe(cfg: BenchConfig, t, meta, sp, device, dtype) -> dict:
    """What a result is about: machine, target, draft, suite, settings and the target step's floor."""
    machine = machine_info(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in t.model.parameters())  # tied weights once
    bw, fms = floor_ms(weight_bytes, machine["device_name"], cfg.bandwidth)
    return {
        "machine": machine,
        "target": {"spec": t.spec, "fingerprint": t.fingerprint, "weight_bytes": weight_bytes,
                   "parameters": sum(p.numel() for p in t.model.parameters())},
        "draft": {"path": str(meta.path), "taps": list(meta.contract.taps),
                  "draft_vocab_size": meta.config.draft_vocab_size, "target_fingerprint": meta.target},
        "suite": sp.summary(),
        "settings": {**cfg.flat(device), "dtype": targets.dtype_name(dtype), "draft": cfg.draft_shape(),
                     "autotune": autotuned(device) if cfg.compiles(device) else None},
        "floor": {"weight_bytes": weight_bytes, "bandwidth": bw, "ms": fms},
    }


def summarize_runs(t, gens: dict, names: dict, floor: float | None) -> dict:
    """{run: its name and totals}; HF's name says whether transformers compiled its forward (it does so by
    itself for a static cache on CUDA)."""
    runs = {k: {"name": names[k], **summarize(g, floor)} for k, g in gens.items()}
    if "hf" in runs:
        runs["hf"]["compiled"] = getattr(t.model, "_compiled_call", None) is not None
        runs["hf"]["name"] += "+compile" if runs["hf"]["compiled"] else ""
    return runs


def build_result(cfg: BenchConfig, t, meta, sp, prompts, gens: dict, names: dict, device, dtype) -> dict:
    """The JSON-ready result: machine, target, draft, suite, settings, runs, speed-ups, acceptance, check."""
    head = describe(cfg, t, meta, sp, device, dtype)
    runs = summarize_runs(t, gens, names, head["floor"]["ms"])
    tps = {k: v["tokens_per_s"] for k, v in runs.items()}

    def ratio(a, b):
        return tps[a] / tps[b] if tps.get(a) and tps.get(b) else None

    return {
        "eaglewire_bench": 1,
        **head,
        "runs": runs,
        "speedups": {"base/hf": ratio("base", "hf"), "spec/base": ratio("spec", "base"),
                     "spec/hf": ratio("spec", "hf")},
        "acceptance": acceptance(gens["spec"], cfg.shape.levels),
        "acceptance_by_group": {k: acceptance([g for g, x in zip(gens["spec"], sp.groups) if x == k], 0)
                                ["acceptance_length"] for k in dict.fromkeys(sp.groups)} if sp.groups else None,
        "greedy_check": greedy_check(t, prompts, gens, "hf" if cfg.hf else "base", dtype)
        if cfg.sampling.greedy else None,
        "per_prompt": [{"prompt_tokens": p.shape[1], **{f"{k}_tokens": len(g[i].tokens) for k, g in gens.items()},
                        **{f"{k}_wall_s": g[i].wall_s for k, g in gens.items()}, "spec_steps": gens["spec"][i].steps,
                        "group": sp.groups[i] if sp.groups else None}
                       for i, p in enumerate(prompts)],
    }
