"""The real SGLang (0.5.17), at its one boundary: a job (what to serve, on which prompts) in, what SGLang did out.

    from eaglewire.engines import sglang
    r = sglang.run_job(sglang.Job(target="MODEL_DIR", draft="SGLANG_DRAFT_DIR", conversations=convs,
                                  max_new_tokens=256, num_steps=7, eagle_topk=1, num_draft_tokens=8, batch=0),
                       where=sglang.locate(python=None, path="SGLANG_SITE"))  # or $EAGLEWIRE_SGLANG_PATH
    sglang.counts(r)              # acceptance length, by position, over the prompts
    r["resolved"]                 # what SGLang resolved its speculative arguments to
    sglang.captured_taps(r)       # the taps SGLang's target fed the draft (its layers_to_capture)

`Job` is frozen and keyword-only. Its fields:
- `target`: a Hugging Face model directory. `draft`: an SGLang-format draft directory (`eaglewire export
  --format sglang`), or None: the target alone.
- `conversations`: chat message lists, rendered by the target's chat template in SGLang's process. Or
  `input_ids`: token ids per prompt, used as they are. Then `max_new_tokens`.
- `num_steps`, `eagle_topk`, `num_draft_tokens`: SGLang's --speculative-* arguments. None leaves them to
  SGLang, which then chooses all three, or refuses topk / draft tokens without steps.
- `batch`: 1 is a warm-up, then one prompt a call, each timed (tokens/s). 0 is every prompt in one call:
  acceptance only, fast.
- `dtype`, `mem_fraction_static`, `cuda_graph` (decode steps). `prefill_cuda_graph` is off by default: an
  eager prefill lets the forward hook read the target's capture list.
- `attention_backend`: "triton" by default, as the GPU bundle has no FA3. `top_logprobs`: per new token, the
  k most likely (2 tells a near-tie).
- `concurrency` (c, ...): after the warm-up, for each c the prompts in consecutive calls of c (c requests at
  once), each call timed: the result's "concurrency" rows {c, calls, seconds, tokens, counters} (counters: the
  calls' meta_info counts summed, sglang_worker.SUMMED_KEYS; None without a draft) and "max_running_requests",
  the limit SGLang's scheduler logged. At batch 1 the per-prompt calls are skipped then ("prompts" is empty): the
  c = 1 row is them.

`run_job(job, log_path=None, where=None) -> dict` runs it in a Python process of its own (SGLang's own
interpreter, `where`), never in eaglewire's: SGLang 0.5.17 pins transformers 5.12.1, eaglewire needs 5.17 or
newer. The worker is engines/sglang_worker.py, which imports no eaglewire module; it is copied into the job's
private folder and run there. The result holds `sglang_version`, `resolved` (SGLang's server_args after its own
adjustments), `prompts`, `seconds` (the batch-0 call), `hooks` (what the forward hook saw) and `log_tail`. Each of
`prompts` holds `tokens` (new token ids), `prompt_tokens`, `seconds` (batch 1; None at batch 0), `meta` and
`top_logprobs` if asked. `meta` is meta_info's completion_tokens, spec_verify_ct, spec_accept_length,
spec_num_correct_drafts, spec_num_proposed_drafts, spec_correct_drafts_histogram and finish_reason.

Where SGLang is (`Where`, `locate`): the interpreter `--sglang-python` / $EAGLEWIRE_SGLANG_PYTHON (a venv with
sglang==0.5.17; default: this Python), and site folders put first on that process's PYTHONPATH,
`--sglang-path` / $EAGLEWIRE_SGLANG_PATH (a folder the wheels were unpacked into). Only the worker's process
sees them; an inherited PYTHONPATH is not passed on to it.

Per-position acceptance: SGLang 0.5.17 exposes it per request. meta_info's spec_correct_drafts_histogram counts
the verify steps that accepted k draft tokens (managers/tokenizer_manager.py:2797-2809, schedule_batch.py:
1091-1094); `counters` turns it into the steps that accepted at least i + 1, the counters vLLM reports. The rest
of the facts are cited in sglang_worker.py, where they are used.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UsageError, engine_exit

VERSION = "0.5.17"  # the release whose source these rules were read from, and which served our drafts
REQUIREMENT = f"sglang=={VERSION}"
PYTHON_ENV, PATH_ENV = "EAGLEWIRE_SGLANG_PYTHON", "EAGLEWIRE_SGLANG_PATH"
# SGLang pins transformers 5.12.1 and eaglewire needs 5.17 or newer, so pip cannot put both in one environment:
# SGLang lives in a venv of its own, and eaglewire runs its worker with that venv's Python.
INSTALL = (f"python3 -m venv ~/.venvs/sglang && ~/.venvs/sglang/bin/pip install '{REQUIREMENT}', then pass "
           f"--sglang-python ~/.venvs/sglang/bin/python (or set {PYTHON_ENV})")
WORKER = Path(__file__).with_name("sglang_worker.py")
WORKER_NAME = "eaglewire_sglang_worker.py"  # its name in the job's folder: what SGLang's scheduler imports
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "1"}
# The scheduler's own line once its pools are sized (managers/scheduler.py:1068-1075); the last one is the limit
RUNNING_LINE = re.compile(r"max_running_requests=(\d+)")


@dataclass(frozen=True, kw_only=True)
class Job:
    """One SGLang run, greedy: the target, the draft directory or None, the prompts (see the module docstring)."""

    target: str
    draft: str | None
    max_new_tokens: int
    conversations: list = field(default_factory=list)
    input_ids: list | None = None
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    batch: int = 1
    dtype: str = "bfloat16"
    mem_fraction_static: float = 0.5
    cuda_graph: bool = True  # decode steps in CUDA graphs, as served; False: all eager (starts faster)
    # SGLang 0.5.17 graphs prefills too by default; its forward hooks fire on eager forwards only
    # (cuda_graph_setup.py:157-164), so by default prefills run eager and the hook sees the target's capture list
    prefill_cuda_graph: bool = False
    attention_backend: str = "triton"
    top_logprobs: int = 0
    context_length: int | None = None
    concurrency: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise UsageError(f"SGLang job: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "concurrency", tuple(self.concurrency))  # a list after the JSON trip
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.concurrency):
            raise UsageError(f"SGLang job: concurrency {list(self.concurrency)}: each c must be an integer >= 1")
        if self.batch not in (0, 1):
            raise UsageError(f"SGLang job: batch is 1 (one prompt a call, timed) or 0 (all in one call), got "
                             f"{self.batch}")
        if bool(self.conversations) == bool(self.input_ids):
            raise UsageError("SGLang job: give the prompts as conversations or as input_ids, one of them")
        spec = {"num_steps": self.num_steps, "eagle_topk": self.eagle_topk, "num_draft_tokens": self.num_draft_tokens}
        bad = {k: v for k, v in spec.items() if v is not None and (not isinstance(v, int) or v < 1)}
        if bad:
            raise UsageError(f"SGLang job: speculative arguments must be positive integers, got {bad}")
        if self.draft is None and any(v is not None for v in spec.values()):
            raise UsageError("SGLang job: speculative arguments without a draft")
        if self.num_steps is None and (self.eagle_topk is not None or self.num_draft_tokens is not None):
            # arg_groups/speculative_hook.py:588-601: with steps unset SGLang asserts the other two are unset too
            raise UsageError("SGLang job: SGLang refuses eagle_topk or num_draft_tokens without num_steps "
                             "(speculative_hook.py asserts it): give all three or none")


@dataclass(frozen=True)
class Where:
    """Where SGLang is: the Python that runs the worker, and folders put first on its PYTHONPATH."""

    python: str
    path: tuple[str, ...] = ()

    def env(self, job_dir: Path) -> dict:
        """The worker's environment: this one's, less PYTHONPATH (eaglewire's, whose transformers SGLang's
        clashes with), plus SGLang's folders and the job's folder (for the scheduler's hook import)."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update({k: v for k, v in ENV.items() if k not in env})
        env["PYTHONPATH"] = os.pathsep.join([*self.path, str(job_dir)])
        return env

    def describe(self) -> str:
        return self.python + (f" with {os.pathsep.join(self.path)} first on its path" if self.path else "")


def locate(python: str | None = None, path: str | None = None) -> Where:
    """The flags, else the environment ($EAGLEWIRE_SGLANG_PYTHON, $EAGLEWIRE_SGLANG_PATH), else this Python."""
    python = python or os.environ.get(PYTHON_ENV) or sys.executable
    path = path if path is not None else os.environ.get(PATH_ENV, "")
    return Where(python=python, path=tuple(p for p in path.split(os.pathsep) if p))


@functools.cache
def _version(where: Where) -> str | None:
    """sglang's installed version as `where` sees it (its metadata; nothing imported), None if it has none."""
    code = ("import importlib.metadata as m\ntry:\n    print(m.version('sglang'))\n"
            "except m.PackageNotFoundError:\n    pass\n")
    with tempfile.TemporaryDirectory(prefix="eaglewire-sglang-") as tmp:
        try:
            r = subprocess.run([where.python, "-c", code], env=where.env(Path(tmp)), cwd=tmp, capture_output=True,
                               text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return None
    return r.stdout.strip() or None


def require(where: Where | None = None) -> str:
    """SGLang's version where `where` (default: `locate()`) finds it; a one-line UsageError where it is not."""
    where = where or locate()
    v = _version(where)
    if v is None:
        # a site folder on eaglewire's own PYTHONPATH (the GPU bundle's assemble script puts it there) never reaches
        # the worker, and would hand eaglewire SGLang's transformers
        held = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d and (Path(d) / "sglang").is_dir()]
        hint = (f"; {held[0]} on PYTHONPATH holds sglang: pass it with --sglang-path (or {PATH_ENV}) and take it off "
                "PYTHONPATH" if held else "")
        raise UsageError(f"this runs the real SGLang {VERSION} in a Python of its own, and {where.describe()} cannot "
                         f"import sglang: {INSTALL}{hint}")
    return v


def run_job(job: Job, log_path: Path | None = None, where: Where | None = None) -> dict:
    """Run `job` in SGLang's own process (see the module docstring); -> the worker's result plus `log_tail`."""
    where = where or locate()
    require(where)
    with tempfile.TemporaryDirectory(prefix="eaglewire-sglang-") as tmp:
        tmp = Path(tmp)
        shutil.copyfile(WORKER, tmp / WORKER_NAME)
        jf, of = tmp / "job.json", tmp / "out.json"
        jf.write_text(json.dumps(asdict(job)))
        log = Path(log_path) if log_path else tmp / "sglang.log"
        with open(log, "w") as f:
            r = subprocess.run([where.python, str(tmp / WORKER_NAME), str(jf), str(of)], env=where.env(tmp),
                               cwd=tmp, stdout=f, stderr=subprocess.STDOUT)
        text = log.read_text(errors="replace")
        if r.returncode != 0 or not of.is_file():
            raise engine_exit("SGLang", r.returncode, job.draft or job.target, text, log_path)
        out = json.loads(of.read_text())
    if job.concurrency:
        out["max_running_requests"] = running_limit(text)
    out["log_tail"] = text.splitlines()[-20:]
    return out


def running_limit(log: str) -> int | None:
    """The most requests SGLang's scheduler said it runs at once (its last "max_running_requests=N"), or None."""
    found = RUNNING_LINE.findall(log)
    return int(found[-1]) if found else None


# --- readers of SGLang's outputs (pure, tested on the CPU) --------------------------------------------

def counters(meta: dict, positions: int) -> dict:
    """One request's speculative counters from its meta_info: verification steps ("drafts", as vLLM names them),
    accepted draft tokens (the bonus token not counted) and the draft tokens SGLang proposed. Also, per draft
    position i, the steps that accepted at least i + 1 tokens (from spec_correct_drafts_histogram), and whether
    that histogram adds up to the totals. A request that never verified (no draft, or done at its prefill) has
    zeros."""
    steps = int(meta.get("spec_verify_ct") or 0)
    hist = [int(c) for c in meta.get("spec_correct_drafts_histogram") or []]
    accepted = meta.get("spec_num_correct_drafts")
    accepted = int(accepted) if accepted is not None else sum(k * c for k, c in enumerate(hist))
    return {"drafts": steps, "accepted": accepted, "draft_tokens": int(meta.get("spec_num_proposed_drafts") or 0),
            "accepted_per_pos": [sum(hist[i + 1:]) for i in range(positions)],
            # the histogram spans the same steps and tokens as the totals (schedule_batch.py:1192-1202)
            "histogram_agrees": not hist or (sum(hist) == steps and sum(k * c for k, c in enumerate(hist)) == accepted)}


def rows(result: dict, positions: int) -> list[dict]:
    """Per prompt, what serve-check compares: new tokens, seconds and the counters."""
    return [{"tokens": len(p["tokens"]), "seconds": p["seconds"], **counters(p["meta"], positions)}
            for p in result["prompts"]]


def counts(result: dict, positions: int | None = None) -> dict:
    """Acceptance over a job's prompts: length (1 + accepted / steps, the bonus token included), steps, accepted
    and the rate at each draft position. Also SGLang's own spec_accept_length averaged over steps (completion
    tokens / steps): it counts the token the prefill wrote too, so it reads a little higher."""
    if positions is None:
        positions = int(result["resolved"].get("speculative_num_steps") or 0)
    rs = rows(result, positions)
    steps, accepted = sum(r["drafts"] for r in rs), sum(r["accepted"] for r in rs)
    completion = sum(int(p["meta"].get("completion_tokens") or 0) for p in result["prompts"])
    return {"acceptance_length": 1 + accepted / steps if steps else None, "drafts": steps, "accepted": accepted,
            "rate_by_position": [sum(r["accepted_per_pos"][i] for r in rs) / steps if steps else 0.0
                                 for i in range(positions)],
            "reported_accept_length": completion / steps if steps else None}


def top2_gaps(top_logprobs) -> list[float | None]:
    """Per new token: the log-probability gap between SGLang's two most likely tokens (None where not known).
    `top_logprobs`: per position [[logprob, token_id], ...] (the worker's copy of output_top_logprobs)."""
    gaps = []
    for pos in top_logprobs or []:
        lps = sorted((lp for lp, _ in pos or []), reverse=True)
        gaps.append(lps[0] - lps[1] if len(lps) > 1 else None)
    return gaps


def captured_taps(result: dict) -> dict | None:
    """The taps SGLang's target fed the draft: the inner model's layers_to_capture, as the forward hook saw it
    (layer i captured = the residual stream entering layer i = tap i). None: the hook never fired on the target
    (CUDA graphs on every forward) or there was no draft (an empty list)."""
    for h in result.get("hooks") or []:
        if h.get("layers_to_capture"):
            return {"from": "layers_to_capture", "module": h["module"], "taps": list(h["layers_to_capture"])}
    return None


def speculation(result: dict) -> dict:
    """The speculative run SGLang resolved: steps, topk, draft tokens a step, and the draft tokens a step its own
    counters show (spec_num_proposed_drafts / spec_verify_ct = num_draft_tokens - 1, tokenizer_manager.py:2757)."""
    r = result.get("resolved") or {}
    steps = sum(int(p["meta"].get("spec_verify_ct") or 0) for p in result["prompts"])
    proposed = sum(int(p["meta"].get("spec_num_proposed_drafts") or 0) for p in result["prompts"])
    return {"algorithm": r.get("speculative_algorithm"), "num_steps": r.get("speculative_num_steps"),
            "eagle_topk": r.get("speculative_eagle_topk"), "num_draft_tokens": r.get("speculative_num_draft_tokens"),
            "verify_steps": steps, "proposed_per_step": proposed / steps if steps else None}


# --- what serve-check needs of SGLang (engines/serve_check.py drives every engine through one such class) ----

# A key SGLang never reads, in place of the nested ids: the seed incident's silent fallback
# (model_runner_components/spec_aux_hidden_state.py:80-94: `eagle_config["eagle_aux_hidden_state_layer_ids"]`
# inside a bare `except:` that turns the KeyError into "no ids").
MISSPELLED = "eagle_aux_hidden_states_layer_ids"


class Serving:
    """`eaglewire serve-check`'s view of SGLang: its jobs, the counters its meta_info carries, the tap ids it reads
    (nested `eagle_config`, id j = tap j + 1 for Llama-like targets) and the wirings worth serving in its words."""

    name, label = "sglang", "SGLang"
    export_version = VERSION
    # Not a rule yet: with two different drafts of one target, SGLang 0.5.17 (bf16, eager, triton attention) wrote
    # the same greedy reply on 5 of 20 prompts (2026-12-03), so its greedy tokens with and without a draft are
    # counted and reported, not held to identity.
    greedy_must_match = False

    def __init__(self, mem_fraction_static: float | None = None, where: Where | None = None,
                 spec: dict | None = None):
        self.memory = {} if mem_fraction_static is None else {"mem_fraction_static": mem_fraction_static}
        self.where = where or locate()
        self.spec = spec  # {num_steps, eagle_topk, num_draft_tokens} as asked; None: a chain of `chain`

    def require(self) -> str:
        return require(self.where)

    def run(self, target: str, *, conversations: list, input_ids: list | None, max_new_tokens: int, chain: int,
            draft: str | None = None, eager: bool = False, gaps: bool = False, concurrency: tuple = ()) -> dict:
        """The prompts as token ids when given (serve-check's, eaglewire's own rendering), else the conversations,
        rendered by the target's chat template in SGLang's process."""
        spec = {}
        if draft is not None:
            spec = self.spec or {"num_steps": chain, "eagle_topk": 1, "num_draft_tokens": chain + 1}
        prompts = {"input_ids": input_ids} if input_ids else {"conversations": conversations}
        return run_job(Job(target=target, draft=draft, **prompts, max_new_tokens=max_new_tokens,
                           cuda_graph=not eager, top_logprobs=2 if gaps else 0, concurrency=tuple(concurrency),
                           **spec, **self.memory),
                       where=self.where)

    @staticmethod
    def rows(result: dict, positions: int) -> list[dict]:
        return rows(result, positions)

    @staticmethod
    def tokens(result: dict) -> list[list[int]]:
        return [p["tokens"] for p in result["prompts"]]

    @staticmethod
    def concurrency_rows(result: dict, positions: int) -> list[dict]:
        """Job.concurrency's rows: per c the calls, seconds, new tokens and the calls' summed meta_info read as
        serve-check's counters (`counters`), None without a draft."""
        return [{**r, "counters": None if r["counters"] is None else counters(r["counters"], positions)}
                for r in result["concurrency"]]

    @staticmethod
    def running_limit(result: dict) -> int | None:
        """The most requests SGLang ran at once, as its scheduler logged it (None: no such line)."""
        return result.get("max_running_requests")

    @staticmethod
    def gaps(result: dict) -> list[list | None]:
        return [top2_gaps(p["top_logprobs"]) if "top_logprobs" in p else None for p in result["prompts"]]

    @staticmethod
    def captured(result: dict) -> dict | None:
        return captured_taps(result)

    @staticmethod
    def version(result: dict) -> str | None:
        return result.get("sglang_version")

    @staticmethod
    def speculation(result: dict) -> dict:
        return speculation(result)

    @staticmethod
    def wirings(taps: tuple[int, ...], num_layers: int, model_type: str | None) -> list[dict]:
        """The faults of the seed incident in SGLang's words: every nested id +1 and -1 of the ids eaglewire's
        export writes, the nested key misspelled, which SGLang's bare except turns into its default taps
        [2, N//2, N-3] WITHOUT the +1 (models/llama.py:889-892), and, where the family's SGLang captures the
        embedding (DeepSeek's id 0, the MoE families' id -1: eaglewire.taps), the embedding in place of the first
        tap. Each: key (a name --wirings takes), label, the ids written (None: not read), the taps SGLang will
        capture (computed by its rules, eaglewire.taps) and the config edit."""
        from ..errors import TapError
        from ..interop.common import IDS_KEY
        from ..interop.sglang import choose_ids, convention_for
        from ..taps import CONVENTIONS, TapContract, sglang_default_taps

        conv = CONVENTIONS[convention_for(model_type, VERSION)]
        ids = choose_ids(TapContract(num_layers, tuple(taps)), model_type, VERSION)[0]

        def nested(new_ids, key=IDS_KEY):
            def edit(cfg):
                block = dict(cfg.get("eagle_config") or {})
                block.pop(IDS_KEY, None)
                block[key] = [int(i) for i in new_ids]
                cfg["eagle_config"] = block
            return edit

        out = []
        for d, key, label in ((1, "plus1", "every nested id +1 (the seed incident's fault)"),
                              (-1, "minus1", "every nested id -1")):
            shifted = [i + d for i in ids]
            try:
                out.append({"key": key, "label": label, "ids": shifted,
                            "taps": list(conv.from_ids(shifted, num_layers)), "edit": nested(shifted)})
            except TapError:
                pass  # a tap SGLang cannot capture (id -1 crashes, id N-1 is never reached)
        if conv.lowest_tap(num_layers) == 0 and taps[0] != 0:  # the tap the incident's "fix" assumed
            first = [0, *taps[1:]]
            first_ids = conv.to_ids(first, num_layers)
            out.append({"key": "embedding", "label": f"the embedding (id {first_ids[0]}) in place of tap {taps[0]}",
                        "ids": first_ids, "taps": first, "edit": nested(first_ids)})
        if len(taps) == 3:  # without nested ids SGLang builds fc for 3 taps (llama_eagle3.py:148-153)
            fallback = list(sglang_default_taps(num_layers))
            out.append({"key": "missing", "label": f"nested key misspelled ({MISSPELLED}): SGLang's default taps, "
                        "no +1", "ids": None, "taps": fallback, "edit": nested(ids, MISSPELLED)})
        return out
