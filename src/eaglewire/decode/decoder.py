"""`SpecDecoder`: a target plus an EAGLE-3 draft, chain or EAGLE-2 tree drafting, batch size 1.

Which file does what:

  decode.py        the loop: prefill, then rounds until EOS or the token limit (`SpecDecoder`);
  acceptance.py    the rules: what a round accepts, greedy and lossless sampling, chain and tree, each
                   written once for both kinds of round;
  tree.py          EAGLE-2 trees: grow, prune, their attention masks;
  draft_runner.py  the draft's drafting loops as one replay each, over runtime/runners.py's static-shape
                   forwards (slot KV caches, padded fixed sizes, compiled functions and CUDA graphs);
  rounds.py        the device-resident rounds: the same round with its verdict kept on the device;
  speedups.py      the speed-ups (fused projections, prepacking, grouped attention, compile, CUDA graphs),
                   applied from outside the models in one ordered function.

The models' fixed-shape calls, their K/V storage and sampling are the runtime's (runtime/): the data stage
runs the target with them too, without the decoder.

One round (`_step`), after a prefill that ran the target over the prompt and chose the first token:

  1. draft: extend the draft with what the target committed last round (the taps of those positions with
     the tokens that follow them: docs/ARCHITECTURE.md "Token alignment"), then a chain of K tokens, or a
     tree (top-k children per depth, the best top-k expanded, pruned to `budget` nodes by cumulative
     log-prob: EAGLE-2). With static shapes either is ONE function of the draft runner (one CUDA-graph
     replay on a GPU), not a host loop over steps;
  2. verify all of it in ONE target forward with the tree attention mask;
  3. accept: acceptance.py decides (greedy: exact; sampling: lossless), read back in one copy;
  4. commit the accepted path in both KV caches (slot caches: nothing to roll back).

Greedy and sampled decoding on static shapes keep the verdict on the device after the first round and read
several rounds back at once (rounds.py): the GPU never waits for the host between rounds.

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
from ..runtime.sampling import SamplingParams, logits_to_probs, sample_with
from .acceptance import verify_chain_greedy, verify_chain_sampling, verify_tree_greedy, verify_tree_sampling
from .draft_runner import DraftRunner
from .rounds import ROUNDS_AHEAD, ChainRounds, SampledChainRounds, SampledTreeRounds, TreeRounds
from .speedups import Speedups, apply, refresh
from .tree import DraftTree, grow, prune, tree_attention

MODES = ("chain", "tree")
PLAIN_AHEAD = 8  # plain decoding on CUDA: steps queued between read-backs (generate_plain)
GREEDY = SamplingParams()
# The shape a round drafts where none is given (measured: benchmarks/results/). On a GPU a round is bound by
# launches, so a long chain or a wide tree costs little more than one token: chain 7 and tree d6 k8 b63 were the
# fastest on an H200. On a CPU each draft step and each verified row costs its own time. Two cores of an Intel Xeon,
# one bench: chain 2 1.30x HF, chain 3 1.14x, chain 7 1.00x, tree d4 k3 b8 1.16x, d6 k8 b63 0.86x
# (benchmarks/results/2026-11-30-run17-grown-layer.md); on an AMD EPYC chain 3 and d4 k3 b8 led chain 2 by 6-9%.
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
        # greedy rounds on static shapes go on without waiting for the host (rounds.py)
        self.rounds = None if not self.drafter.static else ChainRounds(self.drafter, self.verifier, s.K) \
            if s.mode == "chain" else TreeRounds(self.drafter, self.verifier, s.depth, s.topk, s.budget)
        self.rounds_ahead = ROUNDS_AHEAD if p.device.type == "cuda" else 1
        # the next rounds queued before a read-back: on a CPU they would run before it, for nothing
        self.rounds_overlap = p.device.type == "cuda"
        # sampled chains and trees on static shapes go on without waiting too, one set of rounds per SamplingParams
        self.sample_in_rounds = self.rounds is not None
        self._sampled: dict[SamplingParams, SampledChainRounds | SampledTreeRounds] = {}

    # -- entry points ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int, sampling: SamplingParams = GREEDY, eos_ids=(),
                 stream=None, seed: int | None = None) -> GenerationResult:
        """New tokens for a prompt (P,) or (1, P); stream(list of new ids) is called once per step
        (without a draft on CUDA: once per PLAIN_AHEAD tokens)."""
        if self.draft is None:
            return self.generate_plain(input_ids, max_new_tokens, sampling, eos_ids, stream, seed)
        ids, gen, out = self._start(input_ids, max_new_tokens, sampling, eos_ids, stream, seed)
        ahead = self.rounds.headroom(self.rounds_ahead) if self.rounds else 0
        for run in (self.verifier, self.drafter):
            run.reset(len(ids) + max_new_tokens + ahead)
        logits, taps = self.verifier.prefill(ids)
        tok = self._choose(logits, sampling, gen)
        out.add([int(tok)])
        feed = (taps, torch.cat([ids[1:], tok.view(1)]))  # taps[t] goes with token t+1
        accepted, rounds = [], self._rounds(feed, sampling, gen, out)
        while not out.done:  # rounds queued past the end are dropped
            n, tokens = next(rounds)
            accepted.append(n)
            out.add(tokens)
        return out.result(accepted, self.spec.levels)

    def _rounds(self, feed, sampling: SamplingParams, gen, out: "_Output"):
        """(accepted draft tokens, committed tokens) of each round, for as long as asked. After the first
        round (its extend carries the whole prompt), greedy decoding on static shapes runs rounds.py's
        rounds, and so does sampling (`sample_in_rounds`): `rounds_ahead` queued, then read back
        together, with `rounds_overlap` after the next batch is queued. Never more rounds queued than could
        all be needed before the token limit (each commits at most `rows` tokens, the ones in flight too),
        so only an EOS wastes any."""
        path, tokens, feed = self._step(feed, sampling, gen)
        yield len(path), tokens
        r = self.rounds if sampling.greedy else self._sampled_rounds(sampling, gen)
        if r is not None:
            r.start(feed)
            flying = None  # a batch queued and not read back
            while True:
                left = out.max_new - len(out.tokens)
                count = min(self.rounds_ahead, left // r.rows - (flying[1] if flying else 0))
                queued = r.queue(max(1, count)) if flying is None or count > 0 else None  # never none at all
                if flying is not None:
                    yield from r.collect(flying)
                flying = queued
                if not self.rounds_overlap and flying is not None:
                    yield from r.collect(flying)
                    flying = None
        while True:
            path, tokens, feed = self._step(feed, sampling, gen)
            yield len(path), tokens

    def _sampled_rounds(self, sampling: SamplingParams, gen) -> SampledChainRounds | SampledTreeRounds | None:
        if not self.sample_in_rounds:
            return None
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

    # -- one round: draft -> verify -> accept -> commit ---------------------------------------------------
    def _step(self, feed, sampling: SamplingParams, gen):
        """One round that reads its verdict back. feed = (taps, next tokens): what the target committed last
        round, for the draft's extend; the root (the last committed token) is the last of the next tokens.
        Returns (accepted node indices, committed tokens (accepted + 1 more), the next round's feed)."""
        taps, next_ids = feed
        tree, q, attn = self._draft({"ids": next_ids, "taps": taps}, sampling, gen)  # draft_runner.py, tree.py
        logits, taps = self._verify(next_ids[-1:], tree, attn)  # runtime/runners.py
        path, tokens = self._accept(tree, q, logits, sampling, gen)  # acceptance.py
        rows = [0] + [1 + i for i in path]  # the root's row and the accepted nodes'
        self.verifier.commit(rows)  # the draft's rows were never kept (_draft): its next extend rewrites them
        # a chain, or a tree's first nodes: a slice, no gather
        taps = taps[:len(rows)] if path == list(range(len(path))) else taps[rows]
        return path, tokens, (taps, torch.tensor(tokens, device=self.device))

    def _verify(self, root: torch.Tensor, tree: DraftTree, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """[root] + the tree's nodes through the target in ONE forward: (logits, taps) at every row."""
        v, ids = self.verifier, torch.cat([root, tree.tokens])
        if self.spec.mode == "chain":  # a chain's tree mask is causal: the runner's cached block
            return v.forward({"ids": ids}, v.length, copy=False)
        block, rel = attn  # (n+1, n+1), depth offsets
        return v.forward({"ids": ids}, v.length + rel, block, copy=False)

    def _accept(self, tree: DraftTree, q, logits, sampling: SamplingParams, gen) -> tuple[list[int], list[int]]:
        """acceptance.py's verdict: (accepted node indices, the tokens to commit), one read-back."""
        chain = self.spec.mode == "chain"
        if sampling.greedy:
            if chain:
                n, tokens = verify_chain_greedy(tree.tokens, logits)
                return list(range(n)), tokens
            return verify_tree_greedy(tree, logits, self.spec.depth)
        probs = logits_to_probs(logits, sampling)
        if chain:
            n, tokens = verify_chain_sampling(tree.tokens, q, probs, generator=gen)
            return list(range(n)), tokens
        return verify_tree_sampling(tree, probs, gen, self.spec.depth)

    # -- drafting ----------------------------------------------------------------------------------
    def _draft(self, extend: dict[str, torch.Tensor], sampling: SamplingParams, gen):
        """Extend the draft with the last round's committed tokens and their taps, then draft: a greedy
        chain on static shapes does both in one replay. Returns (tree, q, verify block and offsets)."""
        d, chain = self.drafter, self.spec.mode == "chain"
        tokens = d.extend_greedy_chain(extend, self.spec.K - 1) if chain and sampling.greedy else None
        if tokens is not None:
            tree, q, attn = DraftTree.chain(tokens), None, None
        else:
            # copy=False (here and for the verify): each output is used, or copied into another graph's
            # inputs, before its graph replays again in the next round
            logits, hidden = d.forward(extend, d.length, copy=False)
            d.commit(len(extend["ids"]))
            draft = self._draft_chain if chain else self._draft_tree
            tree, q, attn = draft(logits[-1], hidden[-1], d.length - 1, sampling, gen)
        d.commit(0)  # the draft's own speculative rows are never kept: the next extend rewrites them
        return tree, q, attn

    def _draft_chain(self, logits, hidden, root_pos: int, sampling, gen):
        """K tokens, each fed back with the draft's own hidden state. Returns (chain, q (K, V) or None, None):
        greedy takes the draft's argmax; sampling draws from the draft's distribution (its q goes to
        the verifier) with K uniform draws made first, so that one replay can sample the K-1 feedback
        steps as the step-by-step path does. Tokens stay on the device: no host sync between draft steps."""
        K, static = self.spec.K, self.drafter.static
        if sampling.greedy and static:  # the K-1 feedback steps as one replay
            first = self.draft_ids[logits.argmax().view(1)]  # a 1-d index: a 0-d one is read back (a sync)
            rest = self.drafter.greedy_chain(first, hidden[None], root_pos + 1, K - 1) if K > 1 else first[:0]
            return DraftTree.chain(torch.cat([first, rest])), None, None
        u = None if sampling.greedy else torch.rand(K, generator=gen, device=self.device)
        if u is not None and static:
            qd = logits_to_probs(logits, sampling)[None]  # (1, Vd) over the draft vocabulary
            tokens = [self.draft_ids[sample_with(qd[0], u[:1])]]
            if K > 1:
                rest, q_rest = self.drafter.sample_chain(tokens[0], hidden[None], root_pos + 1, K - 1, u[1:], sampling)
                tokens, qd = tokens + [rest], torch.cat([qd, q_rest])
        else:
            tokens, qs = [], []
            for i in range(K):
                if i:  # token i-1 at position root_pos + i, seeing the round's earlier draft rows (causal)
                    logits, hidden = self.drafter.forward({"ids": tokens[-1], "hidden": hidden[None]}, root_pos + i)
                    logits, hidden = logits[0], hidden[0]
                if u is None:
                    tokens.append(self.draft_ids[logits.argmax().view(1)])
                    continue
                qs.append(logits_to_probs(logits, sampling))
                tokens.append(self.draft_ids[sample_with(qs[-1], u[i:i + 1])])
            qd = torch.stack(qs) if qs else None
        q = None if qd is None else torch.zeros(K, self.vocab, device=self.device).index_copy_(1, self.draft_ids, qd)
        return DraftTree.chain(torch.cat(tokens)), q, None

    def _draft_tree(self, logits, hidden, root_pos: int, sampling, gen):
        """EAGLE-2: top-k children of each frontier node, the best top-k (cumulative log-prob) form the
        next frontier; `depth` levels, then pruned to `budget`. Candidates are deterministic: the
        verifier's tree rule needs no q. Also returns the verify forward's block and depth offsets."""
        s, d = self.spec, self.drafter
        if d.static:  # the whole expansion, pruning and mask as one replay
            tree, block, rel = d.tree(logits, hidden[None], root_pos, s.depth, s.topk, s.budget)
            return tree, None, (block, rel)

        def forward(tokens, h_in, block, rel):
            return d.forward({"ids": tokens, "hidden": h_in}, root_pos + rel, block)

        tree = grow(logits, hidden, s.depth, s.topk, self.draft.draft_to_target, forward)
        tree = prune(tree, s.budget, s.depth)
        block, rel = tree_attention(tree, 0, s.depth)
        return tree, None, (block[0, 0], rel)

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
