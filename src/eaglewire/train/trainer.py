"""`eaglewire train`: an EAGLE-3 draft trained with training-time test, offline or online, 1..N devices.

    eaglewire train --target T --data DIR --out CKPT               # from datagen shards
    eaglewire train --target T --prompts FILE [FILE ...] --online --out CKPT  # the target computes taps on the fly
    torchrun --nproc_per_node 8 -m eaglewire.cli train ...          # DDP (nccl; gloo on CPUs), --fsdp for big drafts

One step = grad_accum micro-batches on each of the world's ranks; micro-batches are length-grouped
and hold <= batch_tokens padded tokens (or batch_size samples). The plan of every epoch is a pure
function of (seed, epoch, data), so a resumed or multi-rank run trains on exactly the batches an
uninterrupted single-process run would. See ttt.py for the loss and metrics.py for the metrics.

Read in order. `set_up` builds what training needs (a `Setup`: target, data and split, draft, optimizers,
batch plan). A `Trainer` runs the loop over it (steps, log lines, evaluations, resume states, the finished
draft). `train` joins the two. The command line is cli.py's, which calls `train`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import checkpoint, parallel, targets
from ..capture import capture, locate
from ..checkpoint import check_pair
from ..data import shards
from ..draft import DraftConfig, Eagle3Draft
from ..draft_config import unsupported_rope
from ..errors import EaglewireError, UsageError
from ..parallel import Dist
from ..taps import TapContract
from ..vocab import draft_ids, select_draft_vocab
from . import data as train_data
from . import metrics
from . import state as train_state
from .config import PEAK_TFLOPS, BudgetClock, TrainConfig, flops_per_token, lr_at
from .ttt import TTTModel, TTTSpec, target_side

TAP_STATS_TOKENS = 4096  # tokens of training data the checkpoint's tap statistics are taken over
# Settings that change neither the batches nor the weights: a run may resume with other values.
RUNTIME_FIELDS = {"device", "num_workers", "log_every", "eval_every", "ckpt_every", "time_budget_s", "budget_from"}


@dataclass(frozen=True)
class TrainResult:
    checkpoint: Path
    metrics: dict


def optimizers(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> list[torch.optim.Optimizer]:
    """AdamW over every trained parameter, weight decay on matrices only; or with --optimizer muon (speculators'
    default, its train/trainer.py), Muon over the hidden matrices (fc, attention, MLP) and AdamW over the rest:
    the lm_head and the norms. Muon scales its update to AdamW's RMS (adjust_lr_fn "match_rms_adamw", as
    speculators sets it), so --lr means the same under both."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if p.dim() == 2 and "lm_head" not in n and "embed" not in n]
    mine = {id(p) for p in hidden} if cfg.optimizer == "muon" else set()
    rest = [p for _, p in named if id(p) not in mine]
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}], lr=cfg.lr,
                              betas=cfg.betas, fused=device.type == "cuda" or None)
    if not mine:
        return [adamw]
    if not hasattr(torch.optim, "Muon"):
        raise UsageError(f"--optimizer muon needs torch.optim.Muon (torch 2.9 or later); this torch is "
                         f"{torch.__version__}")
    muon = torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=0.95, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    return [muon, adamw]


# ---- set-up: what training needs, built once before the loop ------------------------------------

@dataclass
class Setup:
    """The target, the data and its split, the draft wrapped for training-time test (and DDP/FSDP), its
    optimizers and the batch plan: what the loop trains with, none of it changed by the loop."""
    target: targets.Target
    stack: object  # the target's located layers: its embedding, final norm and lm_head
    corpus: train_data.Corpus
    train_idx: list[int]
    eval_idx: list[int]
    draft: Eagle3Draft
    draft_ids: torch.Tensor  # each draft id's target id, on the device
    inner: TTTModel  # the draft under training-time test, unwrapped: evaluation and saving use it
    model: torch.nn.Module  # the same, wrapped for DDP/FSDP: training steps use it
    params: list[torch.nn.Parameter]
    optims: list[torch.optim.Optimizer]
    schedule: train_data.Schedule
    total: int  # planned optimizer steps
    flops: float  # per trained token, for the MFU

    @property
    def contract(self) -> TapContract:
        return self.corpus.contract


def set_up(cfg: TrainConfig, target, data, dist: Dist, progress: bool) -> Setup:
    """Load the target, open or build the corpus, split it, make the draft and its optimizers. The order is
    the seeds' order: the draft is initialised from cfg.seed, and the wrapper exists before the optimizers
    take its parameters (FSDP replaces them)."""
    device = dist.device
    target = target if isinstance(target, targets.Target) else targets.load_target(target, device=device)
    stack = locate(target.model)
    if stack.lm_head is None:
        raise EaglewireError(f"--target {target.spec}: no lm_head found: the distillation target needs it")
    corpus = _corpus(cfg, target, data, dist, progress)
    train_idx, eval_idx = train_data.split(corpus.keys, cfg.eval_fraction, cfg.seed)
    if cfg.max_train_samples is not None:  # cut after the split, so that the same samples stay held out
        train_idx = train_idx[:cfg.max_train_samples]
    draft = _initial_draft(cfg, target, corpus.contract) if cfg.init_from else _new_draft(cfg, target, stack, corpus,
                                                                                           train_idx)
    draft.lm_head.weight.requires_grad_(cfg.head != "target-frozen")
    draft = draft.to(device)
    ids = draft_ids(draft.d2t)
    inner = TTTModel(draft, TTTSpec(cfg.ttt_steps, cfg.ttt_decay, cfg.loss))
    model = parallel.wrap(inner, dist, cfg.fsdp)
    params = [p for p in inner.parameters() if p.requires_grad]
    optims = optimizers(inner, cfg, device)
    schedule = train_data.Schedule(train_idx, corpus.lengths, cfg.seed, cfg.batch_tokens, cfg.batch_size,
                                   cfg.grad_accum * dist.world)
    total = schedule.total_steps(cfg.epochs, cfg.steps)
    mean_len = sum(corpus.lengths) / len(corpus)
    flops = flops_per_token(draft.config, target.model, cfg.ttt_steps, mean_len, corpus.mode == "online")
    return Setup(target, stack, corpus, train_idx, eval_idx, draft, ids, inner, model, params, optims, schedule,
                 total, flops)


def _corpus(cfg: TrainConfig, target, data, dist: Dist, progress: bool) -> train_data.Corpus:
    n = target.num_layers
    want = TapContract(n, cfg.taps) if cfg.taps is not None else None
    if isinstance(data, train_data.Corpus):  # built once by a caller that trains several drafts on it
        if want is not None and data.contract != want:
            raise UsageError(f"--taps {list(want.taps)} differ from the corpus's taps {list(data.contract.taps)}")
        return data
    if isinstance(data, (str, Path)) and Path(data).is_dir():
        if want is not None:
            found = TapContract.from_dict(shards.read_manifest(data)["contract"])
            if found != want:
                raise UsageError(f"--taps {list(want.taps)} differ from the taps {list(found.taps)} of --data "
                                 f"{data} (manifest.json 'contract'): train with the data's taps, or run datagen "
                                 "again with --taps")
        return train_data.open_offline(data, target.fingerprint, want, cfg.max_len)
    if want is None and cfg.init_from:  # online fine-tuning captures the draft's taps (offline data has its own)
        draft_taps = checkpoint.load_meta(cfg.init_from).contract
        want = draft_taps if draft_taps.num_layers == n else None  # another target: check_pair says so
    contract = want or TapContract.default(n)
    return train_data.build_online(target, data, contract, cfg.max_len, cfg.gen(), dist, progress)


def _initial_draft(cfg: TrainConfig, target, contract: TapContract) -> Eagle3Draft:
    """Fine-tuning: the checkpoint's weights, vocabulary and shape; it must fit this target and these taps."""
    where = f"--init-from {cfg.init_from}"
    draft, meta = checkpoint.load_draft(cfg.init_from, dtype=torch.float32)  # fp32 master weights
    for line in check_pair(target, draft, meta):  # a fine-tuned target may differ in weights: say so
        print(f"eaglewire train: warning: {line}", file=sys.stderr)
    if meta.contract != contract:
        raise UsageError(f"{where}: the draft reads taps {list(meta.contract.taps)}, the training data "
                         f"{list(contract.taps)}: fine-tune on data with the draft's taps or train a new "
                         "draft")
    c, vocab = draft.config, target.config.vocab_size
    for name, asked, has in (("draft_vocab_size", cfg.draft_vocab_size and min(cfg.draft_vocab_size, vocab),
                              c.draft_vocab_size), ("draft_layers", cfg.draft_layers, c.num_layers)):
        layers = name == "draft_layers"
        if asked is not None and asked != has and not (layers and asked > has):  # more layers: deepened below
            raise UsageError(f"{where}: its {name} is {has}, --{name.replace('_', '-')} asks for {asked}: "
                             "a fine-tuned draft keeps its shape (drop the flag"
                             + ("; --draft-layers may add layers, not remove them)" if layers else ")"))
    if cfg.draft_overrides:
        raise UsageError(f"{where}: --draft-config does not apply to a fine-tuned draft (it keeps its shape)")
    if cfg.max_len + cfg.ttt_steps > c.max_position_embeddings:
        raise UsageError(f"{where}: draft.max_position_embeddings is {c.max_position_embeddings}, below --max-len "
                         f"{cfg.max_len} + --ttt-steps {cfg.ttt_steps}: lower --max-len")
    if cfg.draft_layers and cfg.draft_layers > c.num_layers:
        print(f"eaglewire train: deepening the draft from {c.num_layers} to {cfg.draft_layers} layers: the new "
              "ones start as the identity, so it begins where the checkpoint left off", file=sys.stderr)
        draft = draft.deepened(cfg.draft_layers)
    return draft.train()


def _new_draft(cfg: TrainConfig, target, stack, corpus: train_data.Corpus, train_idx: list[int]) -> Eagle3Draft:
    tc = target.config
    V = tc.vocab_size
    size = min(cfg.draft_vocab_size or 32000, V)
    if cfg.draft_vocab_size and cfg.draft_vocab_size > V:
        print(f"eaglewire train: the draft vocabulary is the target's whole {V} tokens ({cfg.draft_vocab_size} asked)",
              file=sys.stderr)
    always = targets.eos_ids(target)  # the draft must be able to end a reply
    # A draft trained on part of the data must not choose its vocabulary from the rest
    freqs = corpus.token_freqs if cfg.max_train_samples is None else corpus.token_freqs_of(train_idx)
    d2t, t2d = select_draft_vocab(dict(freqs), size, always=always, vocab_size=V)
    over = {"num_layers": cfg.draft_layers or 1, **(cfg.draft_overrides or {})}
    kind = unsupported_rope(target.model.config)
    if kind and "rope_scaling" not in over:  # DraftConfig.for_target leaves it out
        print(f"eaglewire train: the draft uses plain RoPE: the target's {kind} scaling is not one it implements, and "
              "a draft is served with its own (its exports say rope_scaling null)", file=sys.stderr)
    over.setdefault("max_position_embeddings", max(getattr(tc, "max_position_embeddings", 0) or 0,
                                                   cfg.max_len + cfg.ttt_steps))
    dcfg = DraftConfig.for_target(target.model.config, len(corpus.contract.taps), size, **over)
    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(dcfg)
    if dcfg.hidden_size == dcfg.target_hidden_size:
        draft.load_target_embedding(stack.embed.weight.detach().float().cpu())
    draft.set_vocab(d2t, t2d)
    if cfg.head != "random":  # a fine-tuned draft (--init-from) keeps its own head
        check_head(cfg, stack.lm_head)
        draft.load_target_head(stack.lm_head.weight.detach().float().cpu())
    return draft


def check_head(cfg: TrainConfig, lm_head) -> None:
    """A head copied from the target must be one the draft can hold: the draft's lm_head has no bias."""
    if cfg.head != "random" and getattr(lm_head, "bias", None) is not None:
        raise UsageError(f"--head {cfg.head}: the target's lm_head has a bias, the draft's has none: use --head random "
                         "(in a recipe: --set head=random)")


# ---- the loop -----------------------------------------------------------------------------------

class Trainer:
    """The loop over a Setup: optimizer steps, log lines, evaluations, resume states, the finished draft.
    All its state is made in __init__; a resumed run starts where the saved one stopped."""

    def __init__(self, s: Setup, cfg: TrainConfig, out: Path, status: str, progress: bool, dist: Dist,
                 t_start: float):
        self.s, self.cfg, self.out, self.status, self.progress, self.dist = s, cfg, out, status, progress, dist
        self.t_start = t_start  # the time budget counts setup (loading, regeneration) too
        self.device, self.flops = dist.device, s.flops
        self.autocast = cfg.dtype == "bf16" or (cfg.dtype == "auto" and self.device.type == "cuda")
        self.horizon = s.total  # where the cosine ends: moved to the clock's end under a time budget
        self.estimated = False  # whether this process has estimated that end (a resumed run's is its last run's)
        self.ckpt_every = max(1, s.total // 10) if cfg.ckpt_every is None else cfg.ckpt_every
        self.start, acc = self.load() if status == "resume" else (0, None)  # load() restores the horizon too
        self.acc = acc or self._fresh_acc()  # counts since the last log line, summed on the device
        self.log = None  # the JSONL log (rank 0 only)
        if dist.main:
            out.mkdir(parents=True, exist_ok=True)
            self.log = metrics.JsonlLog(out / train_state.LOG, self.start if status == "resume" else None)
        dist.barrier()
        self.bad = torch.zeros((), dtype=torch.bool, device=self.device)  # a non-finite value seen; no host sync
        self.norm = torch.zeros((), device=self.device)  # the last step's gradient norm, on the device
        self.tick = t_start  # the last log line's time (reset as the loop starts)
        self.t_setup = 0.0  # loading, encoding, regeneration (known as the loop starts): the time budget counts it
        self.evaluated_at = self.start - self.start % self._eval_spacing()  # where an unbroken run evaluated
        self.t_other = 0.0  # seconds in evals/saves since the last log
        self.clock = BudgetClock(cfg.time_budget_s, t_start, self.start)  # training seconds; the budget's horizon
        self.tokens_run = 0  # tokens this run trained on, all ranks'

    def run(self) -> TrainResult:
        from tqdm import tqdm

        cfg, start = self.cfg, self.start
        bar = tqdm(total=self.s.total, initial=start, unit="step", desc="train", file=sys.stderr,
                   disable=not (self.progress and self.dist.main), dynamic_ncols=True)
        self.tick = time.perf_counter()
        self.t_setup = self.tick - self.t_start
        done, stopped = start, None
        self.s.inner.train()
        for step, epoch, group, batches in self._batches():
            self._step(step, group, batches, self.acc)
            bar.update(1)
            done = step + 1
            if done == start + 1 and cfg.budget_from == "first-step":
                self._start_budget()
            if done % cfg.log_every == 0 or done == self.s.total or self._over_budget_alone():
                stopped = self._log(done, epoch, self.acc, bar)
                self.acc = self._fresh_acc()
            if not stopped and self.estimated and done >= self.horizon < self.s.total:
                # Stop where the clock was estimated to end: the late check runs only at logs, which slow steps
                # space far apart. The interval is logged first, so that its seconds are counted.
                if done % cfg.log_every:
                    self._log(done, epoch, self.acc, bar)
                stopped = f"time budget of {cfg.time_budget_s:g} s estimated to end at step {done} of {self.s.total}"
            if done == self.s.total or stopped:
                break
            self._evaluate_and_save(done)
        bar.close()
        return self._finish(done, stopped)

    def _batches(self):
        """(step, epoch, all ranks' micro-batches, this rank's collated batches) from the start to the plan's end."""
        cfg = self.cfg
        workers = cfg.num_workers if cfg.num_workers is not None else (4 if self.device.type == "cuda" else 0)
        return train_data.rank_batches(self.s.corpus, self.s.schedule.steps(self.start, self.s.total),
                                       self.dist.rank, cfg.grad_accum, workers, pin_memory=self.device.type == "cuda")

    def _evaluate_and_save(self, done: int) -> None:
        """The evaluation and resume state due after step `done`; their seconds are kept off the training clock."""
        t, paused = time.perf_counter(), False
        if self._eval_due(done):
            self._log_eval(done)
            self.evaluated_at, paused = done, True
        if self.ckpt_every and done % self.ckpt_every == 0:
            self.save(done, self.acc)
            paused = True
        if paused:
            spent = time.perf_counter() - t
            self.t_other += spent
            self.clock.paused(done, spent)

    def _over_budget_alone(self) -> bool:
        """One process past its time budget: checked after every step, where the logs that check it under torchrun
        (all ranks at once) can be minutes apart when steps are slow."""
        return (self.dist.world == 1 and self.cfg.time_budget_s is not None
                and time.perf_counter() - self.clock.started > self.cfg.time_budget_s)

    def _start_budget(self) -> None:
        """The budget starts now, after this process's first step (its compilation included)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.clock.started = time.perf_counter()

    def _eval_due(self, done: int) -> bool:
        """Every --eval-every steps; by default ten times a run, counted to the horizon so that a run the
        clock stops early still gets its ten evaluations (the horizon is the same on every rank)."""
        return done - self.evaluated_at >= self._eval_spacing()

    def _eval_spacing(self) -> int:
        return self.cfg.eval_every or max(1, self.horizon // 10)

    def _fresh_acc(self) -> dict:
        return {"counts": metrics.zeros(self.cfg.ttt_steps, self.device), "denom": 0, "tokens": 0}

    # -- one step ------------------------------------------------------------------------------
    def _step(self, step: int, group: list[list[int]], batches: list[dict], acc: dict) -> None:
        """One optimizer step over this rank's micro-batches; no host sync."""
        cfg, s = self.cfg, self.s
        denom = max(1, sum(s.corpus.loss_tokens[i] for mb in group for i in mb))  # all ranks' micro-batches
        for j, batch in enumerate(batches):
            inputs = self._inputs(batch)
            with parallel.grad_sync(s.model, self.dist, cfg.fsdp, j == len(batches) - 1):
                with self._amp():
                    loss, cnt = s.model(**inputs, denom=denom / self.dist.world)  # ranks' grads are averaged
                loss.backward()
            acc["counts"] += cnt
        norm = torch.nn.utils.clip_grad_norm_(s.params, cfg.clip_grad if cfg.clip_grad > 0 else float("inf"))
        self.norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
        self.bad |= ~torch.isfinite(self.norm)
        for o in s.optims:
            for g in o.param_groups:
                g["lr"] = lr_at(cfg, step, s.total, self.horizon)
            o.step()
            o.zero_grad(set_to_none=True)
        tokens = sum(s.corpus.lengths[i] for mb in group for i in mb)
        acc["denom"] += denom
        acc["tokens"] += tokens
        self.tokens_run += tokens

    def _inputs(self, batch: dict) -> dict:
        """One micro-batch on the device, with the target's side of the loss (its taps, probabilities, top ids)."""
        s, nb = self.s, self.device.type == "cuda"
        ids = batch["input_ids"].to(self.device, non_blocking=nb)
        if s.corpus.mode == "online":
            am = batch["attention_mask"].to(self.device, non_blocking=nb)
            cap = capture(s.target.model, ids, s.contract, attention_mask=am, final_norm=True, stack=s.stack)
            taps, fh = cap.taps, cap.final_hidden
            self.bad |= ~(torch.isfinite(taps).all() & torch.isfinite(fh).all())  # no host sync here
        else:
            taps = batch["taps"].to(self.device, non_blocking=nb)
            fh = batch["final_hidden"].to(self.device, non_blocking=nb)
        if not self.autocast:
            taps = taps.float()
        p, top, in_vocab = target_side(s.stack.lm_head, fh, s.draft.t2d, s.draft_ids, self.cfg.ttt_steps + 1)
        return {"input_ids": ids, "loss_mask": batch["loss_mask"].to(self.device, non_blocking=nb), "taps": taps,
                "target_p": p, "target_top": top, "in_vocab": in_vocab}

    def _amp(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else nullcontext()

    # -- logging and evaluation ----------------------------------------------------------------
    def _log(self, done, epoch, acc, bar) -> str | None:
        """One JSONL training record (the loop's only host sync); returns why training stops, if it does."""
        cfg = self.cfg
        counts = self.dist.all_sum(acc["counts"].clone())
        flag = self.dist.all_sum(self.bad.double().reshape(1))
        s = metrics.summarize(counts)
        c = counts.cpu()
        now = time.perf_counter()
        seconds = max(now - self.tick - self.t_other, 1e-9)
        self.clock.logged(done, seconds)
        self.tick, self.t_other = now, 0.0
        loss = sum(cfg.ttt_decay ** k * float(c[k, 0]) for k in range(cfg.ttt_steps)) / max(1, acc["denom"])
        tps = acc["tokens"] / seconds
        rec = {"kind": "train", "step": done, "epoch": epoch, "lr": lr_at(cfg, done - 1, self.s.total, self.horizon),
               "loss": loss, "loss_k": s["loss"], "acc": s["acc"], "grad_norm": float(self.norm),
               "tokens": acc["tokens"], "tokens_per_s": tps, "mfu": self._mfu(tps), "elapsed_s": now - self.t_start}
        if self.dist.main:
            self.log.write(rec)
        bar.set_postfix(loss=f"{loss:.3f}", acc1=f"{(s['acc'][0] or 0):.3f}", tok_s=f"{tps:.0f}", refresh=False)
        if float(flag) > 0:
            raise EaglewireError(f"non-finite loss, gradient or hidden state by step {done}: training stopped; the "
                                 f"last resume state in {self.out} is intact (lower --lr, or check the target/data)")
        if cfg.time_budget_s is not None:
            late = torch.tensor([float(now - self.clock.started > cfg.time_budget_s)], device=self.device)
            if float(self.dist.all_sum(late)) > 0:
                return f"time budget of {cfg.time_budget_s:g} s reached at step {done} of {self.s.total}"
            self._move_horizon(done, now)
        return None

    def _move_horizon(self, done: int, now: float) -> None:
        """Under a time budget, end the cosine at the step the clock will stop training at (BudgetClock), so a
        budget-stopped draft is annealed. Rank 0 decides: every rank must use the same learning rate."""
        est = self.clock.horizon(done, now) if self.dist.main else None
        h = torch.tensor([float(min(self.s.total, max(done, est))) if est is not None else 0.0], device=self.device)
        h = int(float(self.dist.all_sum(h)))
        if h > 0:  # 0: no rate yet (the first interval), the plan stands
            self.horizon, self.estimated = h, True

    def _mfu(self, tokens_per_s: float | None) -> float | None:
        if not tokens_per_s or self.device.type != "cuda":
            return None  # the peak is a GPU's
        return tokens_per_s * self.flops / (PEAK_TFLOPS * 1e12 * self.dist.world)  # tokens_per_s is all ranks

    def _log_eval(self, done: int) -> dict:
        s = self.evaluate()
        if self.dist.main:
            self.log.write({"kind": "eval", "step": done, **s, "elapsed_s": time.perf_counter() - self.t_start})
        return s

    @torch.no_grad()
    def evaluate(self) -> dict:
        c, inner = self.cfg, self.s.inner
        batches = train_data.group(self.s.eval_idx, self.s.corpus.lengths, c.batch_tokens, c.batch_size)
        counts = metrics.zeros(c.ttt_steps, self.device)
        if batches:
            w = self.dist.world
            per = -(-len(batches) // w)  # equal forwards on every rank (FSDP all-gathers inside them)
            mine = [(batches[i] if i < len(batches) else batches[0], i < len(batches))
                    for i in range(self.dist.rank, per * w, w)]
            inner.eval()
            it = train_data.loader(self.s.corpus, [mb for mb, _ in mine], 0, False)
            for (_, real), batch in zip(mine, it):
                with self._amp():
                    _, cnt = inner(**self._inputs(batch), denom=1.0)
                counts += cnt if real else 0 * cnt
            inner.train()
        return metrics.summarize(self.dist.all_sum(counts))

    # -- resume state --------------------------------------------------------------------------
    def _identity(self) -> dict:
        """What a resumed run must share with the one that saved the state (not where or how often it logs)."""
        config = {k: v for k, v in self.cfg.to_dict().items() if k not in RUNTIME_FIELDS}
        return {"config": config, "data": self.s.corpus.data_hash or self.s.corpus.provenance,
                "target": self.s.target.fingerprint, "world": self.dist.world, "split": train_data.SPLIT_RULE}

    def save(self, step: int, acc: dict) -> None:
        model_sd, optim_sd = parallel.full_state(self.s.inner, self.s.optims)  # a collective under FSDP: all call
        if self.dist.main:
            total = self.s.total
            meta = {"step": step, "identity": self._identity(), "acc_denom": acc["denom"],
                    "acc_tokens": acc["tokens"], "total_steps": total,
                    "next_lr": lr_at(self.cfg, step, total, self.horizon), "horizon": self.horizon,
                    "data_position": "the next step's micro-batches follow from (seed, step): epoch plans are pure"}
            rng = {**train_state.rng_state(self.device), "acc_counts": acc["counts"].cpu()}
            train_state.save_state(self.out, model_sd, optim_sd, rng, meta)
        self.dist.barrier()

    def load(self) -> tuple[int, dict]:
        model_sd, optim_sd, rng, meta = train_state.load_state(self.out)
        want, found = self._identity(), meta["identity"]
        # a state saved before a field existed ran with that field's default
        found["config"] = {**{k: v for k, v in TrainConfig().to_dict().items() if k in want["config"]},
                           **found.get("config", {})}
        diffs = [k for k in want if json.dumps(want[k], sort_keys=True) != json.dumps(found.get(k), sort_keys=True)]
        if diffs:
            detail = [f"config.{f}" for f in want["config"] if want["config"][f] != found["config"].get(f)] \
                + [k if k != "split" else "split (an older eaglewire held other samples out)" for k in diffs
                   if k != "config"]
            raise UsageError(f"--out {self.out}: the unfinished run there differs in {', '.join(detail)}; resume "
                             "with the same target, data and settings, or choose another --out")
        parallel.load_full_state(self.s.inner, self.s.optims, model_sd, optim_sd)
        train_state.set_rng_state(rng, self.device)
        acc = {"counts": rng["acc_counts"].to(self.device), "denom": meta["acc_denom"], "tokens": meta["acc_tokens"]}
        self.horizon = int(meta.get("horizon", self.s.total))
        return int(meta["step"]), acc

    # -- the finished draft --------------------------------------------------------------------
    def _finish(self, done: int, stopped: str | None) -> TrainResult:
        budget_s = time.perf_counter() - self.clock.started  # the budget's wall time: evaluations and saves in it
        final = self._log_eval(done)
        model_sd, _ = parallel.full_state(self.s.inner, None)  # a collective under FSDP: all ranks call
        tps = self.tokens_run / self.clock.train_s if self.clock.train_s > 0 else None
        if self.dist.main:
            self._write_checkpoint(model_sd, done, stopped, final, tps)
        self.dist.barrier()
        return TrainResult(self.out, {"heldout": final, "steps": done, "stopped_early": stopped,
                                      "tokens_per_s": tps, "mfu": self._mfu(tps), "flops_per_token": self.flops,
                                      "peak_tflops": PEAK_TFLOPS, "world_size": self.dist.world,
                                      "train_seconds": self.clock.train_s, "setup_seconds": self.t_setup,
                                      "budget_seconds": budget_s})

    def _write_checkpoint(self, model_sd: dict, done: int, stopped: str | None, final: dict,
                          tps: float | None) -> None:
        """The native checkpoint, its curves, and no resume state: rank 0 only."""
        s = self.s
        draft = checkpoint.draft_from_tensors(s.draft.config, {k[len("draft."):]: v for k, v in model_sd.items()
                                                               if k.startswith("draft.")},
                                              where=f"{self.out}: the trained draft")
        training = {"config": self.cfg.to_dict(), "data": s.corpus.provenance, "steps": done,
                    "planned_steps": s.total, "lr_horizon": self.horizon, "stopped_early": stopped,
                    "world_size": self.dist.world, "flops_per_token": self.flops, "peak_tflops": PEAK_TFLOPS,
                    "train_seconds": self.clock.train_s, "setup_seconds": self.t_setup, "tokens_per_s": tps,
                    "mfu": self._mfu(tps)}
        result = {"heldout": metrics.rounded(final), "eval_samples": len(s.eval_idx),
                  "train_samples": len(s.train_idx)}
        train_state.finish(self.out, draft, contract=s.contract, target_fingerprint=s.target.fingerprint,
                           data_manifest_hash=s.corpus.data_hash, training=training, metrics=result,
                           tap_stats=train_data.tap_stats(s.corpus, s.train_idx, s.target.model, s.stack,
                                                          TAP_STATS_TOKENS))
        try:
            metrics.plot_curves(self.out / train_state.LOG, self.out / train_state.PNG)
        except Exception as e:  # a plot must not cost the checkpoint
            print(f"eaglewire train: could not draw {train_state.PNG}: {e}", file=sys.stderr)
        train_state.drop_state(self.out)


def train(cfg: TrainConfig, target, data_or_prompts, *, out, resume: bool = False, progress: bool = True,
          before_loop: Callable[[Setup], float | None] | None = None) -> TrainResult:
    """Train a draft. target: a registry name / model path, or a loaded targets.Target.

    data_or_prompts: a datagen directory (offline), one or more prompt files (online), or a train.data.Corpus
    already built from either (several drafts trained on one corpus encode it once). Writes the native
    checkpoint, train_log.jsonl and train_curves.png into `out` (rank 0), and returns its path and
    the held-out metrics. before_loop(setup), if given, runs on every rank once the draft exists and before
    the first step. Its own time counts against cfg.time_budget_s, and the seconds it returns are taken off
    that budget: work the caller will do after training, measured now.
    """
    t_start = time.perf_counter()  # the time budget counts setup (loading, regeneration) too
    dist, out, trainer, ok = Dist.setup(cfg.device), Path(out), None, False
    created = not out.exists()
    try:
        status = train_state.out_status(out, resume)
        dist.barrier()  # every rank has looked at --out before rank 0 writes there
        if status == "done":  # only the finished draft to report: nothing to load or train
            meta = checkpoint.load_meta(out)
            print(f"eaglewire train: {out} already holds the finished draft", file=sys.stderr)
            ok = True
            return TrainResult(out, meta.metrics or {})
        setup = set_up(cfg, target, data_or_prompts, dist, progress)
        after = before_loop(setup) if before_loop is not None else None
        if after and cfg.time_budget_s is not None:
            cfg = dataclasses.replace(cfg, time_budget_s=max(cfg.time_budget_s - after, 1.0))
        trainer = Trainer(setup, cfg, out, status, progress, dist, t_start)
        result = trainer.run()
        ok = True
        return result
    except BaseException:
        if trainer is not None and trainer.status == "fresh" and dist.main:
            train_state.discard(out, created)  # a run that saved nothing leaves nothing behind
        raise
    finally:
        dist.close(ok)
