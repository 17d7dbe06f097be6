"""SERVE.md: the exact serve command for an exported draft and its taps in the engine's words.

Engine arguments are chosen so the engine has nothing to rewrite (docs/CONVENTIONS.md section 5):
SGLang forces --speculative-num-draft-tokens to --speculative-num-steps + 1 when
--speculative-eagle-topk is 1 (server_args.py, with only a log warning), so that is what we write.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import UsageError
from ..taps import TapContract


def sglang_max_draft_tokens(num_steps: int, topk: int) -> int:
    """The most tokens SGLang can verify a step. Its first draft step scores topk candidates and each later
    one topk^2 (the topk kept nodes' topk children). The verify takes the best num_draft_tokens - 1 of them
    and the root (sglang/srt/speculative/eagle_utils.py, organize_draft_results: torch.topk over them)."""
    return topk + (num_steps - 1) * topk ** 2 + 1


@dataclass(frozen=True, kw_only=True)
class SpecArgs:
    """Speculation shape: steps (chain depth), topk (branching) and tokens verified per step."""

    num_steps: int = 3
    topk: int = 1
    draft_tokens: int | None = None  # None: num_steps + 1 (required when topk > 1)

    def __post_init__(self):
        for f in ("num_steps", "topk"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise UsageError(f"--{f.replace('_', '-')} must be a positive integer, got {getattr(self, f)!r}")
        if self.topk == 1:
            if self.draft_tokens not in (None, self.num_steps + 1):
                raise UsageError(f"--draft-tokens {self.draft_tokens} with --topk 1: SGLang would silently replace it "
                                 f"with num_steps + 1 = {self.num_steps + 1}; pass that or leave it out")
            object.__setattr__(self, "draft_tokens", self.num_steps + 1)
        elif self.draft_tokens is None or not 2 <= self.draft_tokens <= self.max_draft_tokens:
            raise UsageError(f"--topk {self.topk} builds a tree: pass --draft-tokens between 2 and "
                             f"topk + (num_steps - 1) x topk^2 + 1 = {self.max_draft_tokens}")

    @property
    def max_draft_tokens(self) -> int:
        return sglang_max_draft_tokens(self.num_steps, self.topk)


def _taps_line(contract: TapContract, target: dict) -> str:
    what = f"{target.get('model_type', '?')} target, {contract.num_layers} decoder layers"
    return (f"Taps (eaglewire's words: tap k = residual stream entering decoder layer k): {list(contract.taps)} "
            f"of a {what}.")


def sglang_text(out: str, ids: list[int], convention: str, contract: TapContract, target: dict,
                engine_version: str, args: SpecArgs, target_path: str | None, notes: list[str],
                window: int | None = None) -> str:
    cmd = (f"python -m sglang.launch_server --model-path {target_path or '<target model>'} \\\n"
           f"    --speculative-algorithm EAGLE3 --speculative-draft-model-path {out} \\\n"
           f"    --speculative-num-steps {args.num_steps} --speculative-eagle-topk {args.topk} "
           f"--speculative-num-draft-tokens {args.draft_tokens}"
           + (f" \\\n    --speculative-draft-window-size {window}" if window is not None else ""))
    lines = ["# Serving this draft with SGLang", "", "```bash", cmd, "```", "",
             _taps_line(contract, target), "",
             f"SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` = {ids} from config.json "
             f"(the nested key only; convention `{convention}`, as SGLang {engine_version} reads it) and captures "
             f"the residual stream entering decoder layers {list(contract.taps)}.",
             "", "Notes:",
             f"- topk {args.topk}, steps {args.num_steps}, draft tokens {args.draft_tokens}: "
             + ("a chain; SGLang would force draft tokens to steps + 1 anyway." if args.topk == 1 else
                "a tree; with --page-size > 1 SGLang runs it only on the flashinfer, fa3 or triton attention "
                "backend (triton from 0.5.13)."),
             "- `embed_tokens.weight` is included so the directory is self-contained; SGLang uses the target's.",
             *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def vllm_text(out: str, ids: list[int], contract: TapContract, target: dict, k: int, fmt: str,
              target_path: str | None, notes: list[str]) -> str:
    spec = json.dumps({"method": "eagle3", "model": out, "num_speculative_tokens": k})
    cmd = f"vllm serve {target_path or '<target model>'} \\\n    --speculative-config '{spec}'"
    lines = ["# Serving this draft with vLLM", "", "```bash", cmd, "```", "",
             _taps_line(contract, target), "",
             f"vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` = {ids} (id j = the residual stream "
             f"entering decoder layer j) from this {fmt}-format config.json (`speculators_model_type: eagle3`), "
             "with every norm flag written explicitly (vLLM assumes norm_before_residual=true when it is absent).",
             "", "Notes:", f"- a chain of {k} draft tokens per step (vLLM's default is a chain).",
             *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)
