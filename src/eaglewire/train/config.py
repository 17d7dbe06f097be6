"""`TrainConfig`: everything that decides a trained draft (saved in its checkpoint), the learning-rate
schedule, and the model-FLOPs estimate behind the reported MFU."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from .. import targets
from ..capture import locate
from ..data import datagen
from ..draft import DraftConfig
from ..errors import UsageError

LOSSES = ("soft-ce", "kl")  # see ttt.py
# After the warmup: a cosine or a straight line down to lr * min_lr_ratio at the horizon, or lr throughout.
# speculators decays linearly over its planned epochs, so a short budget keeps it near its peak.
SCHEDULES = ("cosine", "linear", "constant")
# The draft's lm_head at the start: "random" (EAGLE-3, SpecForge), or the target's own rows for the draft
# vocabulary, trained from there ("target") or frozen ("target-frozen": speculators 0.9.0, model.py
# `_load_verifier_weights` copies the verifier's lm_head rows and sets requires_grad False).
HEADS = ("random", "target", "target-frozen")
OPTIMIZERS = ("adamw", "muon")  # muon: torch.optim.Muon on the draft's hidden matrices, AdamW on the rest
PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16 peak, the denominator of the reported MFU


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that decides the trained weights (saved in the checkpoint). Flags: --field-name."""

    epochs: int = 1
    steps: int | None = None  # optimizer steps in all; overrides epochs
    batch_tokens: int | None = None  # padded tokens per micro-batch (default 8192 unless batch_size)
    batch_size: int | None = None  # samples per micro-batch instead
    grad_accum: int = 1
    lr: float = 1e-4
    min_lr_ratio: float = 0.0  # the decay ends at lr * min_lr_ratio
    schedule: str = "cosine"  # SCHEDULES
    warmup_steps: int | None = None  # default: 2% of the steps
    weight_decay: float = 0.0  # on matrices only, never on norms
    betas: tuple[float, float] = (0.9, 0.95)
    optimizer: str = "adamw"
    clip_grad: float = 0.5  # max global grad norm; 0 = off
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    loss: str = "soft-ce"
    head: str = "random"  # HEADS
    draft_vocab_size: int | None = None  # default min(32000, target vocab)
    draft_layers: int | None = None  # default 1; None = not asked (a fine-tuned draft keeps its own)
    draft_overrides: dict | None = None  # other DraftConfig fields (norm flags, hidden_size, ...)
    init_from: str | None = None  # a native draft checkpoint to start from (weights and vocabulary): fine-tuning
    taps: tuple[int, ...] | None = None  # None: the data's (offline) or the default 2,N//2,N-3 (online)
    seed: int = 0
    eval_fraction: float = 0.05
    # The first N samples of the training split (in the data's order), the draft's vocabulary counted over them
    # alone; the held-out split is unchanged. None: all of them.
    max_train_samples: int | None = None
    eval_every: int | None = None  # steps; default: ten evaluations per run
    ckpt_every: int | None = None  # steps; default: ten resume states per run; 0 = none
    log_every: int = 10
    max_len: int = 2048
    device: str | None = None  # default cuda if available
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 elsewhere; or "fp32" / "bf16"
    fsdp: bool = False
    num_workers: int | None = None  # data-loading workers (default 4 on CUDA, 0 on CPU)
    regen: bool = False  # online: the target rewrites the assistant turns first (datagen --regen)
    regen_max_new_tokens: int = 512
    regen_temperature: float = 0.0
    regen_batch_size: int = 32
    time_budget_s: float | None = None  # stop early (and save) once training has run this long
    # Where that budget starts: "setup" (the call, so loading and regeneration count) or "first-step" (after the
    # first optimizer step, compilation included, as the peers' harness times every trainer)
    budget_from: str = "setup"

    def __post_init__(self):
        def bad(name, why):
            raise UsageError(f"--{name.replace('_', '-')} {why}, got {getattr(self, name)!r}")

        if self.batch_tokens is None and self.batch_size is None:
            object.__setattr__(self, "batch_tokens", 8192)
        if self.batch_tokens is not None and self.batch_size is not None:
            raise UsageError("--batch-tokens and --batch-size exclude each other: give one")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.taps is not None:
            object.__setattr__(self, "taps", tuple(int(t) for t in self.taps))
        positive = ["epochs", "grad_accum", "ttt_steps", "log_every", "regen_max_new_tokens", "regen_batch_size",
                    "max_len"]
        optional = ["steps", "batch_tokens", "batch_size", "draft_vocab_size", "draft_layers", "eval_every",
                    "max_train_samples"]
        for name in positive + optional:
            v = getattr(self, name)
            if (v is not None or name in positive) and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                bad(name, "must be a positive integer")
        for name in ("warmup_steps", "ckpt_every", "num_workers"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                bad(name, "must be an integer >= 0")
        if not self.lr > 0:
            bad("lr", "must be > 0")
        for name in ("min_lr_ratio", "eval_fraction"):
            if not 0 <= getattr(self, name) < 1:
                bad(name, "must be in [0, 1)")
        if not 0 < self.ttt_decay <= 1:
            bad("ttt_decay", "must be in (0, 1]")
        if self.weight_decay < 0 or self.clip_grad < 0 or self.regen_temperature < 0:
            raise UsageError("--weight-decay, --clip-grad and --regen-temperature must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad("betas", "must be two numbers in [0, 1)")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"must be one of {list(OPTIMIZERS)}")
        if self.head not in HEADS:
            bad("head", f"must be one of {list(HEADS)}")
        if self.loss not in LOSSES:
            bad("loss", f"must be one of {list(LOSSES)}")
        if self.schedule not in SCHEDULES:
            bad("schedule", f"must be one of {list(SCHEDULES)}")
        if self.dtype not in ("auto", "fp32", "bf16"):
            bad("dtype", "must be auto, fp32 or bf16")
        if self.batch_tokens is not None and self.batch_tokens < self.max_len:
            raise UsageError(f"--batch-tokens {self.batch_tokens} is below --max-len {self.max_len}: a full-length "
                             "sample would not fit a micro-batch")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            bad("time_budget_s", "must be > 0")
        if self.budget_from not in ("setup", "first-step"):
            bad("budget_from", "must be 'setup' or 'first-step'")
        if self.draft_overrides is not None and not isinstance(self.draft_overrides, dict):
            bad("draft_overrides", "must be a JSON object of DraftConfig fields")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UsageError(f"training config: unknown field(s) {unknown}")
        return cls(**d)

    @staticmethod
    def overrides(items, flag: str = "--set") -> dict:
        """FIELD=VALUE texts (`recipe --set`, the benchmarks' --set) -> {field: value}. A value is read as JSON
        where it parses (numbers, true, lists, objects), else kept as text; FIELD may use dashes. Refuses a name
        that is not a field, listing them."""
        out = {}
        for item in items or []:
            key, eq, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if key not in TrainConfig.__dataclass_fields__ or not eq:
                raise UsageError(f"{flag} {item!r}: expected FIELD=VALUE with a training field "
                                 f"({', '.join(sorted(TrainConfig.__dataclass_fields__))})")
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError:
                out[key] = value
        return out

    def gen(self) -> datagen.GenConfig | None:
        return datagen.GenConfig(max_new_tokens=self.regen_max_new_tokens, temperature=self.regen_temperature,
                                 batch_size=self.regen_batch_size, seed=self.seed) if self.regen else None


def lr_at(cfg: TrainConfig, step: int, total: int, horizon: int | None = None) -> float:
    """Linear warmup, then cfg.schedule: cosine (or linear) from lr to lr * min_lr_ratio at step `horizon` (default:
    total), or constant at lr.

    A pure function of its arguments. Under a time budget the trainer moves the horizon to the
    step the clock will stop it at (BudgetClock), so the cosine still ends at its floor. The
    default warmup is 2% of that horizon, not of the planned total: a 270 s run of 750 steps planned
    as 20 epochs (27,920 steps) once spent 558 of its steps warming up. Until the first estimate
    (two --log-every intervals in) the horizon is the plan, so that estimate ends a warmup it cuts short.
    """
    end = total if horizon is None else min(total, horizon)
    warm = cfg.warmup_steps if cfg.warmup_steps is not None else round(0.02 * end)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - warm) / max(1, end - warm))
    low = cfg.lr * cfg.min_lr_ratio
    left = 1 - progress if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return low + (cfg.lr - low) * left


@dataclass
class BudgetClock:
    """A run's training seconds, and under --time-budget-s the step the clock will stop training at: where the
    cosine ends (lr_at's horizon).

    A step costs its training seconds plus its share of the evaluations and saves, measured over the steps up to
    the last one. Training seconds are measured since the first log, so that the first interval's compilation and
    data-loader start-up do not count (counted, they could end a warmup early). So an evaluation does not pull
    the horizon in for the interval it falls in (it would dip the learning rate for the steps after
    each)."""

    budget_s: float | None  # None: no budget, only the seconds are kept
    started: float  # when the budget began: it counts setup (loading, regeneration) too
    first_step: int  # the step this process's loop starts at (a resumed run's)
    first_log: tuple[int, float] | None = None  # (step, training seconds) at this process's first log
    train_s: float = 0.0  # training seconds of this process, evaluations and saves left out
    paused_s: float = 0.0  # seconds of evaluations and saves
    paused_at: int | None = None  # the step of the last one

    def logged(self, done: int, train_seconds: float) -> None:
        """A log interval ended at step `done` after `train_seconds` of training (evaluations and saves not in it)."""
        self.train_s += train_seconds
        if self.first_log is None:
            self.first_log = (done, self.train_s)

    def paused(self, done: int, seconds: float) -> None:
        """An evaluation or a save after step `done` took `seconds`."""
        self.paused_s += seconds
        self.paused_at = done

    def horizon(self, done: int, now: float) -> int | None:
        """The estimated step the budget runs out at; None until there is a rate to estimate it from."""
        if self.budget_s is None or self.first_log is None or done <= self.first_log[0]:
            return None
        per_step = (self.train_s - self.first_log[1]) / (done - self.first_log[0])
        if self.paused_at is not None:
            per_step += self.paused_s / max(1, self.paused_at - self.first_step)
        left = self.budget_s - (now - self.started)
        return done + int(max(left, 0.0) / max(per_step, 1e-9))


def flops_per_token(d: DraftConfig, target_model, ttt_steps: int, mean_len: float, online: bool) -> float:
    """Model FLOPs per trained token: draft fwd+bwd over K TTT steps (3x forward), plus the target's
    lm_head (the distillation target) and, online, the target's forward. Causal attention over
    mean_len/2 keys on average; matmul FLOPs = 2 x multiply-adds."""
    q, kv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    layer0 = 2 * d.hidden_size * (q + 2 * kv) + q * d.hidden_size + 3 * d.hidden_size * d.intermediate_size
    layer = d.hidden_size * (q + 2 * kv) + q * d.hidden_size + 3 * d.hidden_size * d.intermediate_size
    per_step = 2 * (layer0 + (d.num_layers - 1) * layer + d.hidden_size * d.draft_vocab_size)
    per_step += d.num_layers * 4 * q * (mean_len / 2)
    draft = 3 * (2 * d.fc_in_features * d.hidden_size + ttt_steps * per_step)
    tc = targets.text_config(target_model.config)
    stack = locate(target_model)
    head = stack.lm_head.weight.numel() if stack.lm_head is not None else tc.vocab_size * tc.hidden_size
    target = 2 * head
    if online:
        body = sum(p.numel() for p in stack.layers.parameters())
        hd = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        target += 2 * body + tc.num_hidden_layers * 4 * tc.num_attention_heads * hd * (mean_len / 2)
    return float(draft + target)
