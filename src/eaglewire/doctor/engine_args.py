"""Parse `--engine-args` as written on the SGLang / vLLM serve command line and resolve what the
engine will REALLY run with: its auto-chosen defaults, the settings it silently rewrites, and the
combinations it refuses at start-up.

Rules read from (SGLang 0.5.17 lines; 0.5.11 and 0.5.23 checked where said):
- SGLang python/sglang/srt/arg_groups/speculative_hook.py (server_args.py before 0.5.13), run from
  `ServerArgs.__post_init__` (server_args.py:3590-3592) through `_handle_eagle_family` (:525).
  Steps/topk/draft tokens are auto-chosen only when steps is unset, and then topk and draft tokens must be
  unset too, an assert (:588-601). `_auto_choose_speculative_params` (:795-825; 0.5.11 server_args.py:
  7471-7506, 0.5.23 the same) gives (5, 4, 8) for LlamaForCausalLM and Grok-1. It gives (3, 1, 4) for the
  DeepSeek/GLM families listed there, for a STANDALONE draft AND for every other architecture (Qwen
  included). `trtllm_mha` refuses topk > 1 (:603-607). A topk of 1 forces draft tokens to steps + 1 with only a
  log warning (:656-664). A topk > 1 with page size > 1 is refused unless the attention backend is one of
  flashinfer, fa3, triton (:666-681; flashinfer and fa3 only before 0.5.13, 0.5.11 server_args.py:
  3548-3555). NEXTN (and EAGLE) resolve to EAGLE (:24-59).
- SGLang speculative/eagle_worker_v2.py:259-266: an EAGLE-3 draft ignores --speculative-token-map;
  speculative/eagle_utils.py:100-119 `organize_draft_results`: a tree verifies at most
  topk + (steps - 1) x topk^2 + 1 tokens (torch.topk over the drafted candidates).
- vLLM vllm/config/speculative.py: without "method", the method is detected from the draft path
  ("eagle-" -> eagle, then "eagle3" -> eagle3), else the draft is run as a plain draft model.
  `num_speculative_tokens` falls back to the draft config, else it is required.
`eaglewire serve-check --engine sglang --engine-args ...` serves the same arguments in SGLang and reports
what it resolved them to beside this module's prediction.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from ..errors import UsageError
from ..interop.serve import sglang_max_draft_tokens
from ..interop.sglang import parse_version

ENGINES = ("sglang", "vllm")

# SGLang _auto_choose_speculative_params (speculative_hook.py:795-825): target architecture -> (steps, topk,
# draft tokens); every architecture it does not name gets (3, 1, 4), as do the DeepSeek/GLM/... it names.
SGLANG_AUTO = {"LlamaForCausalLM": (5, 4, 8), "Grok1ForCausalLM": (5, 4, 8), "Grok1VForCausalLM": (5, 4, 8)}
SGLANG_AUTO_OTHER = (3, 1, 4)
SGLANG_EAGLE3 = "EAGLE3"
# Attention backends that run topk > 1 with page size > 1 (speculative_hook.py:666-681 `_PAGE_TREE_SPEC_BACKENDS`).
SGLANG_PAGED_TREE = ("flashinfer", "fa3", "triton")
SGLANG_PAGED_TREE_BEFORE = ("flashinfer", "fa3")  # before 0.5.13 (0.5.11 and 0.5.12 server_args.py)
PAGED_TREE_TRITON_SINCE = (0, 5, 13)


@dataclass(frozen=True, kw_only=True)
class Override:
    """A setting the engine uses differently from what was asked (requested None: not given)."""

    setting: str
    requested: object
    used: object
    why: str
    severity: str = "warning"


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """A combination the engine refuses at start-up, and the options that make it start (option -> value;
    for vLLM, speculative_config keys)."""

    why: str
    fix: dict


@dataclass(frozen=True, kw_only=True)
class EngineRun:
    """What the engine will really run with, resolved from its command line."""

    engine: str
    algorithm: str | None  # SGLang --speculative-algorithm / vLLM method, as resolved
    num_steps: int | None  # draft forward passes per round (SGLang steps; vLLM num_speculative_tokens)
    topk: int | None  # branching per draft step (vLLM chains: 1)
    num_draft_tokens: int | None  # tokens verified per round (chain: steps + 1 incl. the root)
    draft_path: str | None
    given: dict = field(default_factory=dict)  # option -> value, as written
    overrides: tuple[Override, ...] = ()
    refusals: tuple[Refusal, ...] = ()

    @property
    def is_eagle3(self) -> bool:
        return (self.algorithm or "").lower() == "eagle3"

    def summary(self) -> str:
        if self.engine == "sglang":
            return (f"algorithm {self.algorithm}, steps {self.num_steps}, topk {self.topk}, "
                    f"draft tokens {self.num_draft_tokens}")
        return f"method {self.algorithm}, num_speculative_tokens {self.num_steps}"


def _tokens(text: str) -> dict[str, str | None]:
    """`--a b --c=d --flag` -> {"a": "b", "c": "d", "flag": None}; names normalised to dashes."""
    try:
        toks = shlex.split(text)
    except ValueError as e:
        raise UsageError(f"--engine-args: cannot split {text!r}: {e}") from None
    out: dict[str, str | None] = {}
    positional: list[str] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        if t.startswith("--"):
            name, eq, value = t[2:].partition("=")
            name = name.replace("_", "-").lower()
            if not eq:
                nxt = toks[i + 1] if i + 1 < len(toks) else None
                if nxt is not None and not nxt.startswith("--"):
                    value, i = nxt, i + 1
                else:
                    value = None
            out[name] = value
        else:
            positional.append(t)
        i += 1
    out["__positional__"] = " ".join(positional) or None
    return out


def _int(given: dict, name: str) -> int | None:
    v = given.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise UsageError(f"--engine-args: --{name} must be an integer, got {v!r}") from None


def parse(engine: str, text: str, *, target_arch: str | None = None, draft_path: str | None = None,
          draft_config: dict | None = None, engine_version: str | None = None) -> EngineRun:
    """Resolve an engine command line. `target_arch` picks SGLang's auto defaults; `draft_config`
    (the draft's config.json) supplies vLLM's fallbacks; `engine_version` (SGLang; None: the latest
    rules) picks the rules that changed between releases."""
    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {ENGINES}, got {engine!r}")
    given = _tokens(text)
    if engine == "sglang":
        return _sglang(given, target_arch, draft_path, parse_version(engine_version))
    return _vllm(given, draft_path, draft_config or {})


def _sglang(given: dict, target_arch: str | None, draft_path: str | None, version: tuple) -> EngineRun:
    overrides: list[Override] = []
    refusals: list[str] = []
    algo = (given.get("speculative-algorithm") or "").upper() or None
    if algo == "NEXTN":  # server_args: "NEXTN shares the same implementation of EAGLE"
        overrides.append(Override(setting="--speculative-algorithm", requested="NEXTN", used="EAGLE",
                                  why="SGLang treats NEXTN as EAGLE", severity="info"))
        algo = "EAGLE"
    if algo is None:
        overrides.append(Override(setting="--speculative-algorithm", requested=None, used="none",
                                  why="without --speculative-algorithm SGLang serves without speculation: "
                                      "the draft is never loaded", severity="error"))
    steps, topk, ndt = (_int(given, "speculative-num-steps"), _int(given, "speculative-eagle-topk"),
                        _int(given, "speculative-num-draft-tokens"))
    if algo is not None and steps is None:
        if topk is not None or ndt is not None:
            refusals.append(Refusal(why="SGLang asserts that --speculative-eagle-topk and --speculative-num-draft-tokens "
                                    "are unset when --speculative-num-steps is: give all three or none",
                                    fix={"speculative-num-steps": max(1, (ndt or 2) - 1) if (topk or 1) == 1 else 3}))
        else:
            auto = SGLANG_AUTO.get(target_arch or "", SGLANG_AUTO_OTHER)
            steps, topk, ndt = auto
            who = target_arch or ("an unknown target architecture (pass --target to know: a Llama target gets "
                                  f"{SGLANG_AUTO['LlamaForCausalLM']})")
            overrides.append(Override(setting="--speculative-num-steps/-eagle-topk/-num-draft-tokens",
                                      requested=None, used=list(auto), severity="info",
                                      why=f"SGLang auto-chooses (steps, topk, draft tokens) = {auto} for {who}"))
    backends = {given.get(k) for k in ("attention-backend", "decode-attention-backend", "prefill-attention-backend")}
    page = _int(given, "page-size") or 1
    paged_tree = SGLANG_PAGED_TREE if version >= PAGED_TREE_TRITON_SINCE else SGLANG_PAGED_TREE_BEFORE
    if topk is not None and topk > 1:
        if "trtllm_mha" in backends:
            refusals.append(Refusal(why="the trtllm_mha attention backend only supports --speculative-eagle-topk 1",
                                    fix={"speculative-eagle-topk": 1, "speculative-num-draft-tokens": (steps or 1) + 1}))
        elif page > 1 and given.get("attention-backend") and given["attention-backend"] not in paged_tree:
            # unset, SGLang picks a backend for the hardware first; only a named one is known to be refused
            refusals.append(Refusal(why=f"--speculative-eagle-topk {topk} with --page-size {page} is refused on the "
                                    f"{given['attention-backend']} attention backend (only {', '.join(paged_tree)} run "
                                    "it)", fix={"attention-backend": "flashinfer"}))
    most = sglang_max_draft_tokens(steps, topk) if topk and topk > 1 and steps else None
    if most is not None and ndt is not None and ndt > most:
        refusals.append(Refusal(why=f"--speculative-num-draft-tokens {ndt}: steps {steps} of topk {topk} draft at "
                                f"most {most - 1} candidates and the verify picks num_draft_tokens - 1 of them "
                                "(torch.topk in eagle_utils.py organize_draft_results): the first request, the "
                                "server's warm-up, fails", fix={"speculative-num-draft-tokens": most}))
    if topk == 1 and ndt is not None and steps is not None and ndt != steps + 1:
        overrides.append(Override(setting="--speculative-num-draft-tokens", requested=ndt, used=steps + 1,
                                  why=f"with --speculative-eagle-topk 1 SGLang forces draft tokens to "
                                      f"--speculative-num-steps + 1 = {steps + 1} (only a log warning)"))
        ndt = steps + 1
    if algo == SGLANG_EAGLE3 and given.get("speculative-token-map"):
        overrides.append(Override(setting="--speculative-token-map", requested=given["speculative-token-map"],
                                  used=None, why="an EAGLE-3 draft brings its own d2t: SGLang ignores the token map"))
    path = given.get("speculative-draft-model-path") or given.get("speculative-draft-model") or draft_path
    return EngineRun(engine="sglang", algorithm=algo, num_steps=steps, topk=topk, num_draft_tokens=ndt,
                     draft_path=path, given=given, overrides=tuple(overrides), refusals=tuple(refusals))


def _speculative_config(given: dict) -> dict:
    raw = given.get("speculative-config")
    cfg: dict = {}
    if raw is not None:
        try:
            cfg = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UsageError(f"--engine-args: --speculative-config is not JSON ({e.msg}): {raw!r}") from None
        if not isinstance(cfg, dict):
            raise UsageError(f"--engine-args: --speculative-config must be a JSON object, got {raw!r}")
    for k, v in given.items():  # newer vLLM also takes --speculative-config.KEY VALUE
        if k.startswith("speculative-config."):
            key = k.split(".", 1)[1].replace("-", "_")
            try:
                cfg[key] = json.loads(v) if v is not None else True
            except json.JSONDecodeError:
                cfg[key] = v
    # vLLM before the JSON form: --speculative-model / --num-speculative-tokens
    if "speculative-model" in given:
        cfg.setdefault("model", given["speculative-model"])
    if "num-speculative-tokens" in given:
        cfg.setdefault("num_speculative_tokens", _int(given, "num-speculative-tokens"))
    return cfg


def _vllm(given: dict, draft_path: str | None, draft_config: dict) -> EngineRun:
    overrides: list[Override] = []
    refusals: list[str] = []
    cfg = _speculative_config(given)
    path = cfg.get("model") or draft_path
    method = cfg.get("method")
    if not cfg:
        overrides.append(Override(setting="--speculative-config", requested=None, used="none", severity="error",
                                  why="without --speculative-config vLLM serves without speculation"))
    elif method is None:
        name = (path or "").lower()
        if draft_config.get("speculators_model_type"):
            method, why = draft_config["speculators_model_type"], "from the draft's speculators config"
        elif "eagle-" in name:
            method, why = "eagle", f"the draft path {path!r} contains 'eagle-'"
        elif "eagle3" in name:
            method, why = "eagle3", f"the draft path {path!r} contains 'eagle3'"
        else:
            method, why = "draft_model", (f"the draft path {path!r} names no method, so vLLM runs it as a plain "
                                          "draft LLM")
        overrides.append(Override(setting="speculative_config.method", requested=None, used=method,
                                  why=f"vLLM detects the method: {why}",
                                  severity="info" if method == "eagle3" else "warning"))
    k = cfg.get("num_speculative_tokens")
    if cfg and k is None:
        k = draft_config.get("n_predict") or _speculators_tokens(draft_config)
        if k is None:
            refusals.append(Refusal(why="vLLM requires speculative_config.num_speculative_tokens (the draft config "
                                    "has none)", fix={"num_speculative_tokens": 3}))
        else:
            overrides.append(Override(setting="speculative_config.num_speculative_tokens", requested=None, used=k,
                                      why="vLLM takes it from the draft config", severity="info"))
    return EngineRun(engine="vllm", algorithm=method, num_steps=k, topk=1 if cfg else None,
                     num_draft_tokens=(k + 1) if k else None, draft_path=path, given=given,
                     overrides=tuple(overrides), refusals=tuple(refusals))


def _speculators_tokens(draft_config: dict) -> int | None:
    methods = (draft_config.get("speculators_config") or {}).get("proposal_methods") or []
    return methods[0].get("speculative_tokens") if methods and isinstance(methods[0], dict) else None


def with_option(text: str, option: str, value) -> str:
    """`text` with `--option value` set (replacing any earlier value), for fixes that are arguments."""
    norm = option.lstrip("-").replace("_", "-")
    return shlex.join(_without(shlex.split(text), lambda name: name == norm) + [f"--{norm}", str(value)])


def _without(toks: list[str], drop) -> list[str]:
    """The tokens less every option whose normalised name `drop(name)` selects, with its value."""
    out, i = [], 0
    while i < len(toks):
        t = toks[i]
        name = t[2:].partition("=")[0].replace("_", "-") if t.startswith("--") else ""
        if name and drop(name):
            if "=" not in t and i + 1 < len(toks) and not toks[i + 1].startswith("--"):
                i += 1  # its value
        else:
            out.append(t)
        i += 1
    return out


def with_speculative_config(text: str, **values) -> str:
    """`text` with vLLM's --speculative-config JSON updated by `values` (added when absent)."""
    given = _tokens(text)
    cfg = {k: v for k, v in _speculative_config(given).items()}
    cfg.update(values)
    out = _without(shlex.split(text), lambda name: name == "speculative-config" or  # every old spelling
                   name.startswith("speculative-config.") or name in ("speculative-model", "num-speculative-tokens"))
    return shlex.join(out + ["--speculative-config", json.dumps(cfg)])
