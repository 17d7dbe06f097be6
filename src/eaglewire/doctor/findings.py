"""What the doctor reports: a Finding (code, severity, message, fix) and the registry of codes.

A fix is text a person can follow. Where the fix is a file edit or different engine arguments, the
finding also carries a `Remedy` that does exactly what the text says. So `--apply` and the tests can
apply it and run the doctor again. The text is rendered from the remedy, never written beside it, so
the two cannot drift apart.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from .. import files
from ..errors import EaglewireError

SEVERITIES = ("error", "warning", "info")

# Stable codes, each with a one-line description. The CLI's help and docs/DOCTOR.md derive from this.
CODES: dict[str, str] = {
    "TAPS_MISSING": "no layer ids where the engine reads them: it silently falls back to its default taps",
    "TAPS_WRONG_PLACE": "layer ids present, but under a key the engine ignores",
    "TAPS_SHIFTED": "the engine will capture other taps than the draft was trained on",
    "TAPS_UNSUPPORTED": "taps (or a tap count) the engine cannot capture at that version; a warning where the "
                        "engine (SGLang 0.5.17, vLLM 0.26.0) cannot feed this target's class a draft at all",
    "TAPS_OUT_OF_RANGE": "layer ids beyond the target's layers",
    "TAPS_UNVERIFIED": "no recorded tap contract: the draft's taps are inferred from its ids, or unknown (the "
                       "probe decides)",
    "FC_SHAPE": "fc input width is not len(taps) x target hidden size (or not what the engine builds)",
    "FC_BYPASS": "engine settings that skip the fc fusion of an EAGLE-3 draft",
    "WEIGHTS_DROPPED": "weights the engine silently drops, or required weights missing",
    "WEIGHTS_NONFINITE": "weights holding NaN or infinity, which spread through every computation that reads them",
    "D2T_INVALID": "d2t is not a valid offset table (absolute ids, out of range, duplicates, disagrees with t2d)",
    "LM_HEAD_REPLACED": "the engine replaces the draft's lm_head, or its size disagrees with the draft vocabulary",
    "EMBED_MISMATCH": "the draft's embedding differs from the target's and the engine will swap it",
    "NORM_FLAGS_IMPLICIT": "a norm flag absent where engines' defaults differ",
    "NORM_UNSUPPORTED": "the draft needs a norm behaviour the engine hard-codes otherwise",
    "NORM_FLAG_MISMATCH": "a norm flag written with another value than the draft was trained with",
    "ENGINE_ARGS_OVERRIDE": "engine arguments the engine silently rewrites, with what the run will really use; "
                            "for SGLang also a sliding-window draft served without "
                            "`--speculative-draft-window-size` (SGLang reads the window from that flag alone)",
    "ENGINE_ARGS_REFUSED": "engine arguments the engine refuses at start-up",
    "CONFIG_TYPE": "an architecture field of a type or value the engine cannot build (a string for a number, an "
                   "activation other than silu): loading the draft fails",
    "CONFIG_SHAPE": "an architecture field (hidden_size, intermediate_size, heads, head_dim, vocab_size) disagrees "
                    "with the draft's own tensors: the engine refuses the weights at load",
    "CONFIG_DRIFT": "an architecture field the engine reads (rope, norm epsilon, activation, shapes, positions, "
                    "vocabulary) differs from the draft's training record or its target",
    "NOT_ENGINE_FORMAT": "the directory is not in a format the engine loads as an EAGLE-3 draft",
    "TARGET_MISMATCH": "hidden size (the width of the taps fc reads), vocabulary, layers, tokenizer or weights "
                       "differ from the draft's target",
    "DRAFT_UNREADABLE": "the draft directory cannot be read",
    "PROBE_WIRING": "measured: another wiring reads significantly better in acceptance or in step-1 "
                    "log-probability, paired on the same prompts (an error when the engine's wiring costs >= 3% of "
                    "acceptance length, else a warning)",
    "PROBE_LOW_ACCEPTANCE": "measured: accuracy far below the accuracy recorded at training time",
    "PROBE_TAP_STATS": "measured: the live taps' activation statistics do not match those recorded at training",
    "PROBE_UNSURE": "measured, but no evidence: every tap -1 or +1 reads no worse than the engine's wiring in "
                    "acceptance or in step-1 log-probability (a draft that predicts nothing, or too few prompts); the "
                    "taps stay unverified",
    "PROBE_OK": "measured: the wiring the engine will use reads significantly better than every tap -1 and +1, "
                "and best of those tried or tied with the best within noise (the message says which)",
}


@dataclass(frozen=True, kw_only=True)
class Remedy:
    """A fix the doctor can apply itself (file edits) or spell out exactly (arguments, commands).

    `config_set`: dotted key -> value ("eagle_config.eagle_aux_hidden_state_layer_ids": [1, 15, 26]).
    `config_delete`: dotted keys to remove. `tensors`: name -> tensor written into the weights file
    (with `why`, the words for what the new tensor is). `renames`: stored name -> new name.
    `engine_args`: the corrected --engine-args string. `commands`: eaglewire command lines (argv
    lists) to run, after which `then_doctor` is the directory to examine instead.
    """

    config_set: dict = field(default_factory=dict)
    config_delete: tuple[str, ...] = ()
    tensors: dict = field(default_factory=dict)
    why: str = ""
    renames: dict = field(default_factory=dict)
    engine_args: str | None = None
    commands: tuple[tuple[str, ...], ...] = ()
    then_doctor: str | None = None

    @property
    def edits_files(self) -> bool:
        return bool(self.config_set or self.config_delete or self.tensors or self.renames)

    def describe(self) -> str:
        parts = [f"in config.json set {k} = {_show(v)}" for k, v in self.config_set.items()]
        parts += [f"in config.json delete {k}" for k in self.config_delete]
        parts += [f"rewrite {k} in the weights file{' as ' + self.why if self.why else ''}" for k in self.tensors]
        parts += _describe_renames(self.renames)
        if self.engine_args is not None:
            parts.append(f"serve with --engine-args {json.dumps(self.engine_args)}")
        parts += ["run `" + shlex.join(c) + "`" for c in self.commands]
        if self.then_doctor:
            parts.append(f"then run the doctor on {self.then_doctor}")
        return "; ".join(parts)

    def apply(self, draft_dir: str | Path) -> None:
        """Edit the draft directory in place (atomic per file). Engine arguments are not files."""
        d = Path(draft_dir)
        if self.config_set or self.config_delete:
            cfg = files.read_json(d / "config.json", fix="repair or re-export the draft, then run the doctor again")
            for key in self.config_delete:
                _delete(cfg, key)
            for key, value in self.config_set.items():
                _set(cfg, key, value)
            files.write_json(d / "config.json", cfg)
        if self.tensors or self.renames:
            from safetensors.torch import save_file

            path = d / "model.safetensors"
            if not path.is_file():
                raise EaglewireError(f"{d}: no model.safetensors to rewrite (sharded weights: re-export instead)")
            state = files.read_safetensors(path, fix="repair or re-export the draft, then run the doctor again")
            for old, new in self.renames.items():
                state[new] = state.pop(old)
            state.update({k: v.contiguous() for k, v in self.tensors.items()})
            with files.atomic_path(path) as tmp:
                save_file(state, str(tmp))


def _describe_renames(renames: dict) -> list[str]:
    """One line per prefix rewrite ("layers.0.* -> midlayer.* (10 tensors)"), else one per tensor."""
    pairs = set()
    for old, new in renames.items():
        i = 0
        while i < min(len(old), len(new)) and old[-1 - i] == new[-1 - i]:
            i += 1
        cut = old[len(old) - i:].find(".") + 1 if i else 0  # keep whole name components as the shared tail
        pairs.add((old[:len(old) - i + cut], new[:len(new) - i + cut]))
    if len(pairs) == 1 and len(renames) > 1:
        (a, b), = pairs
        return [f"rename weights {a}* -> {b}* ({len(renames)} tensors)"]
    return [f"rename weight {k} -> {v}" for k, v in renames.items()]


def _show(v) -> str:
    if isinstance(v, dict) and "taps" in v and "definition" in v:  # a TapContract.to_dict()
        return f"the tap contract of taps {v['taps']} ({v['num_layers']} layers, in every convention's words)"
    return json.dumps(v)


def _set(cfg: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        cfg = cfg.setdefault(p, {})
        if not isinstance(cfg, dict):
            raise EaglewireError(f"config.json: {p} is not an object, cannot set {dotted}")
    cfg[last] = value


def _delete(cfg: dict, dotted: str) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        cfg = cfg.get(p)
        if not isinstance(cfg, dict):
            return
    cfg.pop(last, None)


@dataclass(frozen=True, kw_only=True)
class Finding:
    code: str
    severity: str
    message: str
    fix: str
    remedy: Remedy | None = None

    def __post_init__(self):
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}; known: {sorted(CODES)}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict:
        return {"code": self.code, "severity": self.severity, "message": self.message, "fix": self.fix}


def finding(code: str, severity: str, message: str, fix: str = "", remedy: Remedy | None = None) -> Finding:
    """A finding whose fix text is the remedy's own description, after any explanation given."""
    if remedy is not None:
        fix = f"{fix}: {remedy.describe()}" if fix else remedy.describe()
    return Finding(code=code, severity=severity, message=message, fix=fix, remedy=remedy)


def worst(findings: list[Finding]) -> str | None:
    for s in SEVERITIES:
        if any(f.severity == s for f in findings):
            return s
    return None
