"""Shared helpers of the decoding tests: a tiny target, drafts for it, greedy references, the reference round
read back every round (HostRound), a CPU stand-in for CUDA graph capture, a count of the launches outside
replays. Their fixtures (llama, seqs, drafts) are in conftest.py."""

import torch

from eaglewire.capture import capture
from eaglewire.checkpoint import load_draft, save_draft
from eaglewire.decode.acceptance import (verify_chain_greedy, verify_chain_sampling, verify_tree_greedy,
                                         verify_tree_sampling)
from eaglewire.decode.decoder import SpecConfig, SpecDecoder
from eaglewire.decode.speedups import Speedups
from eaglewire.decode.tree import DraftTree, grow, prune, tree_attention
from eaglewire.runtime.runners import SlotRunner
from eaglewire.runtime.sampling import logits_to_probs, sample_with
from eaglewire.draft import DraftConfig, Eagle3Draft
from eaglewire.taps import TapContract
from eaglewire.targets import Target, fingerprint
from eaglewire.vocab import target_to_draft_ids

CONTRACT = TapContract(8, (2, 4, 8))  # tap 8: the last layer's output, through the post-hook
CHAIN = dict(mode="chain", K=4)
TREE = dict(mode="tree", depth=4, topk=3, budget=10)


SHAPE_FIELDS = ("mode", "K", "depth", "topk", "budget")


def decoder(target, draft=None, meta=None, *, strict: bool = False, **kw) -> SpecDecoder:
    """A SpecDecoder from keywords: its shape's fields (mode, K, depth, topk, budget; the others the target
    device's, SpecConfig.for_device) and its Speedups' fields."""
    shape = {k: kw.pop(k) for k in SHAPE_FIELDS if k in kw}
    device = next(target.model.parameters()).device
    return SpecDecoder(target, draft, meta, shape=SpecConfig.for_device(device, **shape), speedups=Speedups(**kw),
                       strict=strict)


def as_target(model, spec="tiny") -> Target:
    return Target(spec=spec, model=model, tokenizer=None, fingerprint=fingerprint(model))


def save_load(draft, contract, target, path):
    save_draft(draft, path, contract=contract, target_fingerprint=target.fingerprint)
    return load_draft(path)


def new_draft(model, contract=CONTRACT, draft_vocab=None, seed=0):
    torch.manual_seed(seed)
    cfg = model.config
    if cfg.model_type == "gpt2":  # DraftConfig.for_target reads intermediate_size, which GPT-2 configs lack
        c = DraftConfig(hidden_size=cfg.n_embd, intermediate_size=64, num_attention_heads=cfg.n_head,
                        vocab_size=cfg.vocab_size, num_taps=len(contract.taps), draft_vocab_size=draft_vocab)
    else:
        c = DraftConfig.for_target(cfg, num_taps=len(contract.taps), draft_vocab_size=draft_vocab)
    d = Eagle3Draft(c)
    d.load_target_embedding(model.get_input_embeddings().weight)
    return d


@torch.no_grad()
def reference_greedy(model, prompt, n) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor(ids)[None]).logits[0, -1].argmax()))
    return ids[len(prompt):]


def fit(draft, model, contract, seqs, steps):
    """A few Adam steps: the draft at t (taps[t], token t+1) learns the target's argmax at t+1."""
    data = []
    to_draft = target_to_draft_ids(draft.d2t, draft.config.vocab_size)
    with torch.no_grad():
        for s in seqs:
            cap = capture(model, s[None], contract, logits=True)
            data.append((s, cap.taps[0], to_draft[cap.logits[0].argmax(-1)]))
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for step in range(steps):
        loss = 0
        for s, taps, label in data:
            t = len(s) - 2
            logits, _ = draft(s[None, 1:t + 1], draft.fuse(taps[None, :t]), torch.arange(t)[None])
            loss = loss + torch.nn.functional.cross_entropy(logits[0], label[1:t + 1], ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


def prompts(seqs):
    g = torch.Generator().manual_seed(7)
    return [s[:4].tolist() for s in seqs[:3]] + [torch.randint(0, 128, (n,), generator=g).tolist() for n in (1, 5, 9)]


# What a CUDA graph capture refuses and a CPU run allows: a tensor made from host data (a copy to the device;
# torch: "Cannot copy between CPU and CUDA tensors during CUDA graph capture"), and reads that sync the host.
# A 0-dim host tensor passes: `mask[i] = True` makes one, and kernels take it as a scalar, with no copy.
NOT_CAPTURABLE = {"lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "nonzero"}


def capturable(fn):
    """fn() run as a CUDA graph capture would see it: an op on NOT_CAPTURABLE is an error naming it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in NOT_CAPTURABLE and not (name.startswith("lift") and args[0].dim() == 0):
                raise AssertionError(f"{name} inside a captured function: a CUDA graph capture refuses it")
            return func(*args, **(kwargs or {}))

    with Capture():
        return fn()


def fake_capture(self, fn, captured: list | None = None):
    """A CUDA graph's contract on a CPU: captured once, a replay re-runs into the SAME output tensors, and
    the capture refuses what CUDA's does (host data, host syncs)."""
    fn()  # capture_graph's warm-up runs outside the capture
    out = capturable(fn)
    if captured is not None:
        captured.append(type(self).__name__)

    def replay():
        for o, new in zip(out, fn()):
            o.copy_(new)
    return replay, out


def launch_counter(monkeypatch):
    """(replays, Ops): with SlotRunner's static functions marked, `with Ops() as ops` records the name
    of every tensor op run outside a replay (each a kernel launch on CUDA) and `replays` one entry
    per replay. Patch before the decoder is made."""
    from torch.utils._python_dispatch import TorchDispatchMode

    inside, replays = [], []
    make = SlotRunner._make_static

    def marked(self, inputs, fn):
        def run():
            if not inside:
                replays.append(1)
            inside.append(1)
            try:
                return fn()
            finally:
                inside.pop()
        return make(self, inputs, run)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside:
                self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(SlotRunner, "_make_static", marked)
    return replays, Ops


def counted_queues(monkeypatch, rounds, replays, Ops) -> list:
    """[(rounds queued, replays, names of the ops launched outside replays)] of each `rounds.queue` call from
    now on (launch_counter's replays and Ops)."""
    reads, queue = [], rounds.queue

    def counted(count):
        replays.clear()
        with Ops() as ops:
            batch = queue(count)
        reads.append((count, len(replays), ops.names))
        return batch

    monkeypatch.setattr(rounds, "queue", counted)
    return reads


def same_samples(a, b, sampling, ps, seeds: int, new: int) -> int:
    """Decoders a and b give the same tokens and acceptance for every prompt and seed; the rounds compared."""
    rounds = 0
    for p in ps:
        for seed in range(seeds):
            x, y = a.generate(p, new, sampling, seed=seed), b.generate(p, new, sampling, seed=seed)
            assert x.tokens == y.tokens and x.accepted_per_step == y.accepted_per_step, (p, seed)
            rounds += len(y.accepted_per_step)
    return rounds


class HostRound:
    """The reference round, read back every round: the draft's extend and its chain or tree step by step
    through the runners' own forwards (tree.grow, tree.prune), the verify, acceptance.py's host rules
    (verify_chain_greedy, verify_chain_sampling, verify_tree_greedy, verify_tree_sampling), both caches
    committed from the host. `host_rounds(dec)` puts it in the place of a decoder's rounds (rounds.py), which
    must commit what it commits, round by round: it shares their rules' definitions, not their code."""

    def __init__(self, dec, sampling, gen):
        self.dec, self.sampling, self.gen = dec, sampling, gen
        self.rows = dec.spec.K + 1 if dec.spec.mode == "chain" else dec.spec.depth + 1

    def headroom(self, ahead: int) -> int:
        return ahead * self.rows

    def start(self, feed) -> None:
        self.feed = feed

    def queue(self, count: int) -> list:
        return [self._step() for _ in range(count)]

    def collect(self, batch: list) -> list:
        return batch

    def _step(self) -> tuple[int, list[int]]:
        dec, sampling, gen = self.dec, self.sampling, self.gen
        taps, next_ids = self.feed
        d, v, s = dec.drafter, dec.verifier, dec.spec
        logits, hidden = d.forward({"ids": next_ids, "taps": taps}, d.length)  # the extend
        d.commit(len(next_ids))
        draft = self._chain if s.mode == "chain" else self._tree
        tree, q, attn = draft(logits[-1], hidden[-1], d.length - 1)
        d.commit(0)  # the draft's own rows are never kept
        ids = torch.cat([next_ids[-1:], tree.tokens])  # [root] + the draft's tokens, one verify
        logits, taps = v.forward({"ids": ids}, v.length) if attn is None else \
            v.forward({"ids": ids}, v.length + attn[1], attn[0])
        if sampling.greedy:
            if s.mode == "chain":
                n, tokens = verify_chain_greedy(tree.tokens, logits)
                path = list(range(n))
            else:
                path, tokens = verify_tree_greedy(tree, logits, s.depth)
        elif s.mode == "chain":
            n, tokens = verify_chain_sampling(tree.tokens, q, logits_to_probs(logits, sampling), generator=gen)
            path = list(range(n))
        else:
            path, tokens = verify_tree_sampling(tree, logits_to_probs(logits, sampling), gen, s.depth)
        rows = [0] + [1 + i for i in path]  # the root's row and the accepted nodes'
        v.commit(rows)
        self.feed = (taps[rows], torch.tensor(tokens, device=dec.device))
        return len(path), tokens

    def _chain(self, logits, hidden, root_pos: int):
        """K tokens, each fed back with the draft's own hidden state; sampled with K uniform draws made first."""
        dec, sampling, K = self.dec, self.sampling, self.dec.spec.K
        u = None if sampling.greedy else torch.rand(K, generator=self.gen, device=dec.device)
        tokens, qs = [], []
        for i in range(K):
            if i:  # token i-1 at position root_pos + i, seeing the round's earlier draft rows (causal)
                logits, hidden = dec.drafter.forward({"ids": tokens[-1], "hidden": hidden[None]}, root_pos + i)
                logits, hidden = logits[0], hidden[0]
            if u is None:
                tokens.append(dec.draft_ids[logits.argmax().view(1)])
                continue
            qs.append(logits_to_probs(logits, sampling))
            tokens.append(dec.draft_ids[sample_with(qs[-1], u[i:i + 1])])
        q = torch.zeros(K, dec.vocab, device=dec.device).index_copy_(1, dec.draft_ids, torch.stack(qs)) if qs else None
        return DraftTree.chain(torch.cat(tokens)), q, None

    def _tree(self, logits, hidden, root_pos: int):
        """EAGLE-2: grown a level at a time through the draft's forwards, pruned, masked."""
        dec, s = self.dec, self.dec.spec

        def forward(tokens, h_in, block, rel):
            return dec.drafter.forward({"ids": tokens, "hidden": h_in}, root_pos + rel, block)

        tree = prune(grow(logits, hidden, s.depth, s.topk, dec.draft.draft_to_target, forward), s.budget, s.depth)
        block, rel = tree_attention(tree, 0, s.depth)
        return tree, None, (block[0, 0], rel)


def host_rounds(dec):
    """`dec` with every round a HostRound (the reference): returned for chaining."""
    dec._rounds_for = lambda sampling, gen: HostRound(dec, sampling, gen)
    return dec
