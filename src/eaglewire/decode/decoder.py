"""`SpecDecoder`: a target plus an EAGLE-3 draft, chain or EAGLE-2 tree drafting, batch size 1.

Which file does what:

  decoder.py       the loop: the prefills, then rounds until EOS or the token limit (`SpecDecoder.generate`);
  rounds.py        the round, one traceable body per kind (chain, tree; greedy, sampled) over fixed buffers;
  acceptance.py    the rules: what a round accepts, greedy and lossless sampling, chain and tree;
  tree.py          EAGLE-2 trees: grow, prune, their attention masks;
  draft_runner.py  the draft's drafting loops, traceable, over runtime/runners.py's slot KV caches;
  speedups.py      the speed-ups (fused projections, prepacking, grouped attention, compile, CUDA graphs),
                   applied from outside the models in one ordered function.

The models' fixed-shape calls, their K/V storage and sampling are the runtime's (runtime/): the data stage
runs the target with them too, without the decoder.

A generation: the target's prefill over the prompt chooses the first token; the draft's prefill extends the
draft over the prompt but its last row; then rounds. Each round (rounds.py) is:

  1. draft: extend the draft with what the target committed last round (the taps of those positions with
     the tokens that follow them: docs/ARCHITECTURE.md "Token alignment"), then a chain of K tokens, or a
     tree (top-k children per depth, the best top-k expanded, pruned to `budget` nodes by cumulative
     log-prob: EAGLE-2);
  2. verify all of it in ONE target forward with the tree attention mask;
  3. the verdict: acceptance.py's rule decides (greedy: exact; sampling: lossless), the committed tokens
     and the next extend's inputs stay on the device (a tree also moves the accepted branch's K/V).

The same body runs everywhere: eagerly (a CPU, debugging), compiled with compile=True, captured in CUDA
graphs with cuda_graphs=True. On a CPU one round is queued and read back at once; on CUDA the next rounds
are queued before a read-back. A round's cost against plain decoding:
`python benchmarks/decode_steps.py --random-draft`.

`generate_plain` (and `generate` without a draft) runs the same engine one target step per token:
the baseline speculation is measured against.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from ..checkpoint import check_pair
from ..errors import UsageError
from ..runtime.runners import TargetRunner
from ..runtime.sampling import SamplingParams, logits_to_probs
from .draft_runner import DraftRunner
from .rounds import ROUNDS_AHEAD, ChainRounds, SampledChainRounds, SampledTreeRounds, TreeRounds
from .speedups import Speedups, apply, refresh

MODES = ("chain", "tree")
PLAIN_AHEAD = 8  # plain decoding on CUDA: steps queued between read-backs (generate_plain)
GREEDY = SamplingParams()
# The shape a round drafts where none is given. On a GPU a round is bound by launches, so a long chain or a wide
# tree costs little more than one token: chain 7 and tree d6 k8 b63 were the fastest there. On a CPU each draft
# step and each verified row costs its own time, so short chains and small trees win. `eaglewire bench --shapes
# chain:2,chain:3,tree:4x3x8` measures it on a machine (figures: benchmarks/results/).
DEFAULT_SHAPES = {"cuda": {"K": 7, "depth": 6, "topk": 8, "budget": 63},
                  "cpu": {"K": 2, "depth": 4, "topk": 3, "budget": 8}}


def default_shape(device: torch.device) -> dict[str, int]:
    """K, depth, topk and budget for a decoder on this device where none is given."""
    return DEFAULT_SHAPES["cuda" if device.type == "cuda" else "cpu"]


def fill_shape(device: torch.device, **given: int | None) -> dict[str, int]:
    """The given shape fields (K, depth, topk, budget), each one None taken from DEFAULT_SHAPES for the device."""
    defaults = default_shape(device)
    return {k: defaults[k] if v is None else v for k, v in given.items()}


def default_shape_text(key: str) -> str:
    """'7 on CUDA, 2 on a CPU' for K: a help text's default, from DEFAULT_SHAPES."""
    return f"{DEFAULT_SHAPES['cuda'][key]} on CUDA, {DEFAULT_SHAPES['cpu'][key]} on a CPU"


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """What one round drafts: a chain of K tokens, or a tree of `depth` levels, `topk` children per
    expanded node and `topk` nodes expanded per level, pruned to `budget` draft tokens."""

    mode: str = "chain"
    K: int
    depth: int
    topk: int
    budget: int

    def __post_init__(self):
        if self.mode not in MODES:
            raise UsageError(f"decoding mode must be one of {list(MODES)}, got {self.mode!r}")
        for name in ("K", "depth", "topk", "budget"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"speculative decoding: {name} must be an integer >= 1, got {v!r}")

    @classmethod
    def for_device(cls, device: torch.device, mode: str = "chain", *, K: int | None = None, depth: int | None = None,
                   topk: int | None = None, budget: int | None = None) -> "SpecConfig":
        """The shape with each field not given (None) taken from DEFAULT_SHAPES for the device (fill_shape)."""
        return cls(mode=mode, **fill_shape(torch.device(device), K=K, depth=depth, topk=topk, budget=budget))

    @property
    def levels(self) -> int:
        """Draft positions per round: the deepest a round can accept."""
        return self.K if self.mode == "chain" else self.depth


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only, truncated at EOS (included) and max_new_tokens
    num_steps: int  # target forwards after the prefill (verification steps when speculating)
    accepted_per_step: list[int]  # draft tokens accepted per verification step (bonus excluded)
    acceptance_by_position: list[float]  # fraction of steps whose draft token at position i was accepted
    timings: dict[str, float] = field(default_factory=dict)
    stop: str = "length"  # "eos" or "length"

    @property
    def acceptance_length(self) -> float:
        """Tokens per verification step, the bonus token included (as SGLang and vLLM report it)."""
        n = len(self.accepted_per_step)
        return (sum(self.accepted_per_step) + n) / n if n else float("nan")


class SpecDecoder:
    """Speculative decoding with an EAGLE-3 draft (or, draft=None, plain decoding on the same engine).

    dec = SpecDecoder(target, draft, meta, shape=SpecConfig.for_device(device, "tree", depth=6, topk=8, budget=63),
                      speedups=Speedups(cuda_graphs=True, compile=True))
    res = dec.generate(input_ids, 256, SamplingParams(temperature=0), eos_ids=[2], stream=print)

    shape: what a round drafts (SpecConfig); None: DEFAULT_SHAPES' chain for the target's device. speedups: what
    is applied to the models and runners (speedups.py; the defaults: the device's choices, no compile, no
    graphs); what was, in `applied`. The draft follows the target's device and dtype; a bad pair raises
    UsageError, a softer fingerprint difference warns (`warnings`), or raises with strict.
    """

    def __init__(self, target, draft=None, meta=None, *, shape: SpecConfig | None = None,
                 speedups: Speedups = Speedups(), strict: bool = False):
        p = next(target.model.parameters())
        self.spec = s = SpecConfig.for_device(p.device) if shape is None else shape
        if not isinstance(s, SpecConfig) or not isinstance(speedups, Speedups):
            raise UsageError(f"SpecDecoder: shape must be a SpecConfig and speedups a Speedups, got "
                             f"{type(s).__name__} and {type(speedups).__name__}")
        self.target, self.draft, self.speedups = target, draft, speedups
        self.device, self.vocab = p.device, target.config.vocab_size
        self.context = getattr(target.config, "max_position_embeddings", None)
        self.plain_ahead = PLAIN_AHEAD if p.device.type == "cuda" else 1  # a CPU runs each op as issued
        self.warnings: list[str] = []
        verify = sizes = pending = None
        if draft is not None:
            if meta is None:
                raise UsageError("SpecDecoder: a draft needs its checkpoint metadata (load_draft returns both)")
            self.warnings = check_pair(target, draft, meta, strict)
            for w in self.warnings:
                warnings.warn(w, stacklevel=2)
            if s.mode == "tree" and s.topk > draft.config.draft_vocab_size:
                raise UsageError(f"--topk {s.topk} exceeds the draft vocabulary ({draft.config.draft_vocab_size} "
                                 "tokens)")
            draft.to(device=p.device, dtype=p.dtype).eval()
            if s.mode == "chain":  # a verify of [root] + K; draft extends of up to K+1 rows, then single steps
                verify, sizes, pending = s.K + 1, (1, s.K + 1), s.K - 1
            else:  # a verify of [root] + budget; extends of up to depth+1 rows, then frontiers of topk
                verify, sizes, pending = s.budget + 1, (s.topk, s.depth + 1), (s.depth - 1) * s.topk
        model, engine_draft, self.applied = apply(target.model, draft, speedups, verify_rows=verify,
                                                  draft_rows=sizes or ())
        runs = speedups.runner_options  # compile and CUDA graphs: the runners' (speedups.py, step 4)
        self.plain = TargetRunner(model, None, sizes=(1,), **runs)
        if draft is None:
            return
        self.draft_ids = torch.arange(draft.config.draft_vocab_size, device=p.device) + draft.d2t  # -> target id
        self.verifier = TargetRunner(model, meta.contract, sizes=(verify,), **runs)
        self.drafter = DraftRunner(engine_draft, sizes=sizes, max_pending=pending, **runs)
        # the greedy rounds (rounds.py); sampled ones are made per SamplingParams (_rounds_for)
        self.rounds = ChainRounds(self.drafter, self.verifier, s.K) if s.mode == "chain" else \
            TreeRounds(self.drafter, self.verifier, s.depth, s.topk, s.budget)
        self.rounds_ahead = ROUNDS_AHEAD if p.device.type == "cuda" else 1
        # the next rounds queued before a read-back: on a CPU they would run before it, for nothing
        self.rounds_overlap = p.device.type == "cuda"
        self._sampled: dict[SamplingParams, SampledChainRounds | SampledTreeRounds] = {}

    # -- entry points ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, sampling: SamplingParams = GREEDY, eos_ids=(),
                 stream=None, seed: int | None = None) -> GenerationResult:
        """New tokens for a prompt (P,) or (1, P); stream(list of new ids) is called once per round
        (without a draft on CUDA: once per PLAIN_AHEAD tokens).

        The prefills, then rounds (rounds.py): `rounds_ahead` queued, then read back together, on CUDA
        after the next batch is queued (`rounds_overlap`). Never more rounds queued than could all be
        needed before the token limit (each commits at most `rows` tokens, the ones in flight too), so
        only an EOS wastes any; rounds read back past the end are dropped."""
        if self.draft is None:
            return self.generate_plain(input_ids, max_new_tokens, sampling, eos_ids, stream, seed)
        ids, gen, out = self._start(input_ids, max_new_tokens, sampling, eos_ids, stream, seed)
        r = self._rounds_for(sampling, gen)
        for run in (self.verifier, self.drafter):
            run.reset(len(ids) + max_new_tokens + r.headroom(self.rounds_ahead))
        logits, taps = self.verifier.prefill(ids)
        tok = self._choose(logits, sampling, gen)
        out.add([int(tok)])
        r.start(self._prefill_draft(taps, torch.cat([ids[1:], tok.view(1)])))  # taps[t] goes with token t+1
        accepted, flying = [], None  # flying: a batch queued and not read back
        while not out.done:
            left = (out.max_new - len(out.tokens)) // r.rows - (flying[1] if flying else 0)
            queued = r.queue(max(1, min(self.rounds_ahead, left))) if flying is None or left > 0 else None
            batch, flying = (flying, queued) if self.rounds_overlap else (queued, None)
            for n, tokens in r.collect(batch) if batch is not None else ():
                if not out.done:
                    accepted.append(n)
                    out.add(tokens)
        return out.result(accepted, self.spec.levels)

    def _prefill_draft(self, taps: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's extend over the prompt's rows but the last (one exact forward, kept): the first round's
        feed is then that last row, which fits a round's fixed rows. Returns that feed (taps, next tokens)."""
        d, n = self.drafter, len(next_ids) - 1
        if n:
            d.forward({"ids": next_ids[:n], "taps": taps[:n]}, 0, exact=True, copy=False)  # outputs unused
            d.commit(n)
        return taps[n:], next_ids[n:]

    def _rounds_for(self, sampling: SamplingParams, gen) -> ChainRounds | TreeRounds:
        """The rounds of this sampling: the greedy ones, or the sampled ones of these SamplingParams (made once),
        drawing from `gen`."""
        if sampling.greedy:
            return self.rounds
        s = self.spec
        if sampling not in self._sampled:
            self._sampled[sampling] = (
                SampledChainRounds(self.drafter, self.verifier, s.K, sampling, self.draft_ids, self.vocab)
                if s.mode == "chain" else
                SampledTreeRounds(self.drafter, self.verifier, s.depth, s.topk, s.budget, sampling, self.vocab))
        r = self._sampled[sampling]
        r.gen = gen
        return r

    @torch.no_grad()
    def generate_plain(self, input_ids, max_new_tokens: int, sampling: SamplingParams = GREEDY, eos_ids=(),
                       stream=None, seed: int | None = None) -> GenerationResult:
        """No speculation: one target step per token, same caches, masks and CUDA graphs.

        On CUDA the tokens are read back every PLAIN_AHEAD steps, not every step: the host queues
        the next steps while the GPU runs them (a read-back per token would leave the GPU idle while
        the host prepares each step). Up to PLAIN_AHEAD - 1 steps past an EOS are computed and dropped.
        Greedy with static shapes, each step's argmax feeds the next inside its replay (greedy_steps).
        """
        ids, gen, out = self._start(input_ids, max_new_tokens, sampling, eos_ids, stream, seed)
        run = self.plain
        run.reset(len(ids) + max_new_tokens)
        logits, = run.prefill(ids)
        tok = self._choose(logits, sampling, gen)
        out.add([int(tok)])
        while not out.done:
            n = min(self.plain_ahead, out.max_new - len(out.tokens))  # no host sync inside
            if sampling.greedy and run.static:  # the argmax feeds the next step inside the replay
                new = run.greedy_steps(tok, n)
                tok = new[-1]
            else:
                new = []
                for _ in range(n):
                    logits, = run.forward({"ids": tok.view(1)}, run.length)
                    run.commit(1)
                    tok = self._choose(logits[0], sampling, gen)
                    new.append(tok)
                new = torch.stack(new)
            out.add(new.tolist())  # the sync
        return out.result(None, 0)

    @torch.no_grad()
    def load_draft_weights(self, draft, meta) -> None:
        """Take another draft's weights, in place: it must have this draft's config (a checkpoint of the same
        training). What was compiled and captured for this decoder then replays with them, so a decoder can be
        warmed up before its draft is trained (`recipe`: the bench compiles before training, not after)."""
        if self.draft is None:
            raise UsageError("SpecDecoder.load_draft_weights: this decoder runs without a draft")
        if draft.config != self.draft.config:
            raise UsageError(f"draft {meta.path}: its config differs from the draft this decoder was built for; "
                             "build a new decoder for it")
        self.warnings = check_pair(self.target, draft, meta)
        theirs = draft.state_dict()
        for name, t in self.draft.state_dict().items():  # the same tensors the runners and their graphs read
            t.copy_(theirs[name])
        refresh(self.drafter.draft)
        self.draft_ids.copy_(torch.arange(self.draft_ids.numel(), device=self.device) + self.draft.d2t)

    # -- helpers -----------------------------------------------------------------------------------
    def _start(self, input_ids, max_new_tokens, sampling, eos_ids, stream, seed):
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1).to(self.device)
        if ids.numel() == 0:
            raise UsageError("the prompt is empty: give at least one token (e.g. --prompt TEXT)")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab:
            raise UsageError(f"prompt token ids must lie in 0..{self.vocab - 1} (the target's vocabulary), "
                             f"got {int(ids.min())}..{int(ids.max())}")
        if self.context and len(ids) + max_new_tokens > self.context:
            raise UsageError(f"the prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                             f"target's context of {self.context} tokens (max_position_embeddings): use "
                             f"--max-new-tokens <= {max(self.context - len(ids), 0)} or a shorter prompt")
        if not isinstance(sampling, SamplingParams):
            raise UsageError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        gen = None
        if seed is not None:
            gen = torch.Generator(self.device).manual_seed(seed)
        return ids, gen, _Output(max_new_tokens, set(eos_ids or ()), stream)

    @staticmethod
    def _choose(logits, sampling: SamplingParams, gen) -> torch.Tensor:
        """The target's own next token (a 0-d tensor on the logits' device) from (V,) logits."""
        if sampling.greedy:
            return logits.argmax()
        return torch.multinomial(logits_to_probs(logits, sampling), 1, generator=gen)[0]


class _Output:
    """Collects tokens, stops at EOS or max_new_tokens, streams, and builds the result."""

    def __init__(self, max_new: int, eos: set[int], stream):
        self.max_new, self.eos, self.stream = max_new, eos, stream
        self.tokens: list[int] = []
        self.stop = None
        self.t0 = time.perf_counter()
        self.t_first = None

    @property
    def done(self) -> bool:
        return self.stop is not None

    def add(self, new: list[int]) -> None:
        keep = []
        for t in new:
            keep.append(t)
            if t in self.eos:
                self.stop = "eos"
                break
            if len(self.tokens) + len(keep) >= self.max_new:
                self.stop = "length"
                break
        self.tokens += keep
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if self.stream and keep:
            self.stream(keep)

    def result(self, accepted: list[int] | None, levels: int) -> GenerationResult:
        end = time.perf_counter()
        decode_s = end - self.t_first
        steps = len(accepted) if accepted is not None else len(self.tokens) - 1
        by_pos = [sum(a > i for a in accepted) / len(accepted) for i in range(levels)] if accepted else []
        timings = {"prefill_s": self.t_first - self.t0, "decode_s": decode_s, "total_s": end - self.t0,
                   "decode_tokens_per_s": (len(self.tokens) - 1) / decode_s if decode_s > 0 else float("nan"),
                   "step_ms": 1e3 * decode_s / steps if steps else float("nan")}
        return GenerationResult(tokens=self.tokens, num_steps=steps, accepted_per_step=list(accepted or []),
                                acceptance_by_position=by_pos, timings=timings, stop=self.stop)
