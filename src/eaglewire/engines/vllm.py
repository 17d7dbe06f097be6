"""The real vLLM, at its one boundary: a job (what to serve, on which conversations) in, what vLLM did out.

`run_job(job)` is the boundary: it runs the job in a Python process of its own
(`python -m eaglewire.engines.vllm JOB.json OUT.json`) and returns the worker's JSON. A process per job
because vLLM keeps its metrics in one process-wide registry that a new `LLM` resets, and gives its GPU
memory back only when the process ends. Nothing else in eaglewire imports vllm; CPU tests replace
`run_job` and check the pure readers below on objects shaped like vLLM's.

Facts this relies on (vLLM 0.26.0, docs/CONVENTIONS.md section 5):
- `LLM(disable_log_stats=False)`, else `get_metrics()` asserts; the counters `vllm:spec_decode_num_drafts`
  (verification steps, summed over requests), `..._num_draft_tokens`, `..._num_accepted_tokens` and the
  vector `..._num_accepted_tokens_per_pos` are cumulative: a prompt's are the difference around its call
  (v1/spec_decode/metrics.py, v1/metrics/reader.py). Acceptance length = 1 + accepted / drafts.
- The draft's taps come from the top-level `eagle_aux_hidden_state_layer_ids` of its config.json, logged as
  "Using Eagle3 auxiliary layers from config: (...)" (or "... from model: (...)" for the default
  (2, N//2, N-3)) by v1/worker/gpu/spec_decode/eagle/eagle3_utils.py.
- `LLM.chat` applies the tokenizer's chat template with the generation prompt; outputs come back in input
  order; `outputs[0].token_ids` are the new tokens.
- `max_num_seqs` caps the requests running at once (v1/core/sched/scheduler.py:110, 673), and CUDA graphs are
  captured up to min(max_num_seqs x (1 + num_speculative_tokens) x 2, 512) tokens (config/vllm.py:1789-1795): a
  call of c conversations runs as c requests at once when max_num_seqs >= c.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import UsageError, engine_exit
from ..files import atomic_path, write_json
from .sglang_worker import sweep  # the chunk loop of both workers' sweeps: SGLang's worker may import nothing of ours

EXTRA = "pip install 'eaglewire[vllm]'"  # vLLM 0.26.0: the last release that pins torch 2.11
SPEC = "vllm:spec_decode_"
# vLLM's own log line naming the taps it will capture (eagle3_utils.py); "model" means its default
AUX_LINE = re.compile(r"Using Eagle3 auxiliary layers from (config|model): \(([\d,\s]*)\)")
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0",  # FlashInfer's sampler is not always installed; vLLM's own is exact
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process: its log and its metrics are the job's
       "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True, kw_only=True)
class Job:
    """One engine run: the target (a Hugging Face model directory), the draft directory or None, greedy chat."""

    target: str
    draft: str | None
    conversations: list
    max_new_tokens: int
    num_speculative_tokens: int = 7
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False  # CUDA graphs, as served; True starts in half the time (acceptance only)
    logprobs: int = 0  # top-k logprobs of every new token (2: the gap that tells a near-tie)
    tensor_parallel_size: int = 1
    # 1: one request at a time, each timed and counted (batch 1, as a user's latency); 0: every conversation in one
    # call (acceptance only, in seconds: the counters are the call's, not a prompt's, and no time is a prompt's)
    batch: int = 1
    groups: list | None = None  # batch 0: sizes of consecutive groups of conversations, one call and counters each
    # (c, ...): after the warm-up, for each c the conversations in consecutive calls of c (c requests at once), each
    # call timed and counted: result["concurrency"] (`concurrent`). At batch 1 the per-prompt loop is skipped then
    # ("prompts" is empty): the c = 1 row is that loop. At batch 0 its calls run first, as without.
    concurrency: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.num_speculative_tokens < 1:
            raise UsageError(f"engine job: max_new_tokens {self.max_new_tokens} and num_speculative_tokens "
                             f"{self.num_speculative_tokens} must be >= 1")
        object.__setattr__(self, "concurrency", tuple(self.concurrency))  # a list after the JSON trip
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.concurrency):
            raise UsageError(f"engine job: concurrency {list(self.concurrency)}: each c must be an integer >= 1")
        if self.batch not in (0, 1):
            raise ValueError(f"engine job: batch {self.batch}: 1 (one request at a time) or 0 (all in one call)")
        if self.groups is not None and (self.batch != 0 or sum(self.groups) != len(self.conversations)):
            raise ValueError(f"engine job: groups {self.groups} need batch 0 and must cover the "
                             f"{len(self.conversations)} conversations")


@dataclass(frozen=True, kw_only=True)
class RegenJob:
    """The target writes every assistant turn of the conversations itself, turn by turn (datagen --regen)."""

    target: str
    conversations: list  # the user turns (and an optional system message) of each conversation
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_len: int = 2048  # a prompt that fills this ends its conversation, as datagen.regenerate does
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.8
    tensor_parallel_size: int = 1


@dataclass(frozen=True, kw_only=True)
class CaptureJob:
    """The target's residual stream at `layer_ids` (vLLM's ids: id j = tap j, id N = the last layer's output
    before the final norm) for every token of each sequence. One file a chunk of sequences goes in `out_dir`
    (`chunk-00000.safetensors`: "hidden" (sum T, len(ids), H), "offsets" (len + 1,)). A file already there is
    kept."""

    target: str
    chunks: list  # lists of sequences of token ids
    layer_ids: list
    out_dir: str
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.8
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if list(self.layer_ids) != sorted(set(self.layer_ids)):
            # vLLM concatenates the layers it captures in layer order, whatever order the ids are listed in
            raise ValueError(f"layer ids must be distinct and ascending, got {self.layer_ids}")


KINDS = {"serve": Job, "regen": RegenJob, "capture": CaptureJob}


def memory_share(gpu_memory_utilization: float | None) -> dict:
    """A job's gpu_memory_utilization as a keyword, or none: each job keeps its own default (above)."""
    return {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}


def max_num_seqs(job: Job) -> int:
    """The requests vLLM runs at once for `job`: 1 at batch 1, 256 at batch 0, and at least the largest concurrency."""
    return max([job.batch or 256, *job.concurrency])


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require() -> None:
    if not available():
        raise UsageError(f"this command runs the real vLLM, which is not installed: {EXTRA}")


def run_job(job, log_path: Path | None = None) -> dict:
    """Run `job` (a Job, RegenJob or CaptureJob) in its own process; -> the worker's result plus `log_tail` and
    `aux_layers`."""
    require()
    kind = next(k for k, cls in KINDS.items() if isinstance(job, cls))
    # Capture keeps vLLM's engine process: a finished request's hidden states are written on the engine's next
    # step, which an in-process engine never takes after the last request (example_hidden_states_connector.py).
    env = {**os.environ, **ENV, **({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"} if kind == "capture" else {})}
    with tempfile.TemporaryDirectory(prefix="eaglewire-vllm-") as tmp:
        jf, of = Path(tmp) / "job.json", Path(tmp) / "out.json"
        jf.write_text(json.dumps({"kind": kind, **asdict(job)}))
        log = Path(log_path) if log_path else Path(tmp) / "vllm.log"
        with open(log, "w") as f:
            r = subprocess.run([sys.executable, "-m", "eaglewire.engines.vllm", str(jf), str(of)],
                               env=env, stdout=f, stderr=subprocess.STDOUT)
        text = log.read_text(errors="replace")
        if r.returncode != 0 or not of.is_file():
            raise engine_exit("vLLM", r.returncode, job.draft or job.target, text, log_path)
        out = json.loads(of.read_text())
    out["aux_layers"] = aux_layers(text)
    out["log_tail"] = text.splitlines()[-20:]
    return out


# --- readers of vLLM's objects (pure, tested on the CPU) ------------------------------------------------

def read_counters(metrics) -> dict:
    """vLLM's speculative-decoding counters from `LLM.get_metrics()` (Counter: .value, Vector: .values), summed
    over label sets (one per engine)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {SPEC + "num_drafts": "drafts", SPEC + "num_draft_tokens": "draft_tokens",
             SPEC + "num_accepted_tokens": "accepted"}
    for m in metrics:
        name = getattr(m, "name", "")
        if name in names:
            out[names[name]] += int(m.value)
        elif name == SPEC + "num_accepted_tokens_per_pos":
            vals, acc = [int(v) for v in m.values], out["accepted_per_pos"]
            n = max(len(vals), len(acc))
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * (n - len(acc)), vals + [0] * (n - len(vals)))]
    return out


def minus(after: dict, before: dict) -> dict:
    """One call's counters: the cumulative counters after it less those before."""
    pos_b = before["accepted_per_pos"] + [0] * max(0, len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    return {k: (after[k] - before[k]) if k != "accepted_per_pos" else
            [a - b for a, b in zip(after[k], pos_b)] for k in after}


def top2_gaps(logprobs) -> list[float | None]:
    """Per new token: the log-probability gap between the engine's two most likely tokens (None: not asked).
    `logprobs` is CompletionOutput.logprobs: one {token_id: Logprob(logprob, rank, ...)} per token."""
    if logprobs is None:
        return []
    gaps = []
    for pos in logprobs:
        lps = sorted((lp.logprob for lp in pos.values()), reverse=True)
        gaps.append(lps[0] - lps[1] if len(lps) > 1 else None)
    return gaps


def aux_layers(log: str) -> dict | None:
    """The taps vLLM said it captures: {"from": "config"|"model", "ids": [...]} from its last such log line."""
    found = AUX_LINE.findall(log)
    if not found:
        return None
    src, ids = found[-1]
    return {"from": src, "ids": [int(x) for x in ids.replace(" ", "").split(",") if x]}


# --- what serve-check needs of vLLM (engines/serve_check.py drives every engine through one such class) --

class Serving:
    """`eaglewire serve-check`'s view of vLLM: its jobs, the counters it returns, the tap ids it reads (top-level,
    id j = tap j) and the wirings worth serving in its words."""

    name, label = "vllm", "vLLM"
    export_version = None  # vLLM's reading of an export does not depend on its version here
    # vLLM's greedy tokens are the same with and without a draft (serve-check measures it on every run): a
    # divergence other than at a near-tie is a fault
    greedy_must_match = True

    def __init__(self, gpu_memory_utilization: float | None = None):
        self.memory = memory_share(gpu_memory_utilization)

    def require(self) -> None:
        require()

    def run(self, target: str, *, conversations: list, input_ids: list | None, max_new_tokens: int, chain: int,
            draft: str | None = None, eager: bool = False, gaps: bool = False, concurrency: tuple = ()) -> dict:
        return run_job(Job(target=target, draft=draft, conversations=conversations, max_new_tokens=max_new_tokens,
                           num_speculative_tokens=chain, enforce_eager=eager, logprobs=2 if gaps else 0,
                           concurrency=tuple(concurrency), **self.memory))

    @staticmethod
    def rows(result: dict, positions: int) -> list[dict]:
        return [{"tokens": len(p["tokens"]), "seconds": p["seconds"], **p["counters"]} for p in result["prompts"]]

    @staticmethod
    def tokens(result: dict) -> list[list[int]]:
        return [p["tokens"] for p in result["prompts"]]

    @staticmethod
    def concurrency_rows(result: dict, positions: int) -> list[dict]:
        """Job.concurrency's rows: per c the calls, seconds, new tokens and counters (already serve-check's)."""
        return [dict(r) for r in result["concurrency"]]

    @staticmethod
    def running_limit(result: dict) -> int | None:
        """The most requests the engine ran at once (max_num_seqs, as the job set it)."""
        return result.get("max_num_seqs")

    @staticmethod
    def gaps(result: dict) -> list[list | None]:
        return [p.get("gaps") for p in result["prompts"]]

    @staticmethod
    def captured(result: dict) -> dict | None:
        """The taps vLLM said it captures (its ids are taps; id 0 is not the embedding, taps._VLLM_ID0)."""
        seen = result.get("aux_layers")
        return None if seen is None else {"from": seen["from"], "taps": seen["ids"]}

    @staticmethod
    def version(result: dict) -> str | None:
        return result.get("vllm_version")

    @staticmethod
    def speculation(result: dict) -> None:
        return None  # a chain of num_speculative_tokens, as asked

    @staticmethod
    def wirings(taps: tuple[int, ...], num_layers: int, model_type: str | None) -> list[dict]:
        """The doctor's main alternatives in vLLM's ids: every tap -1 and +1, and id 0 for the first tap. Id 0 is
        the embedding on paper. vLLM 0.26.0 feeds the last layer's output eager, something undefined compiled
        (taps._VLLM_ID0), and fails on the DeepSeek family (taps.VLLM_ID0_FAILS). Each: key (a name --wirings takes),
        label, ids, the taps vLLM will capture (None: not a tap) and the config edit."""
        from ..doctor.probe import candidates
        from ..interop.common import IDS_KEY
        from ..taps import CONVENTIONS, VLLM_ID0_FAILS

        def top_level(ids):
            return lambda cfg: cfg.__setitem__(IDS_KEY, [int(i) for i in ids])

        conv, out = CONVENTIONS["vllm"], []
        for w in candidates(taps, None, num_layers):
            if w.label in ("every tap -1", "every tap +1") and w.plain and min(w.sources) >= 1:
                ids = conv.to_ids(w.sources, num_layers)
                key = "minus1" if w.label == "every tap -1" else "plus1"
                out.append({"key": key, "label": w.label, "ids": ids, "taps": list(w.sources),
                            "edit": top_level(ids)})
        if taps[0] > 0:
            ids = [0] + conv.to_ids(taps[1:], num_layers)
            what = ("vLLM fails on this family, adding a residual still None" if model_type in VLLM_ID0_FAILS
                    else "the embedding on paper, not what vLLM feeds")
            out.append({"key": "embedding", "label": f"id 0 for tap {taps[0]}: {what}", "ids": ids, "taps": None,
                        "edit": top_level(ids)})
        return out


# --- the worker (runs inside the job's own process) ---------------------------------------------------

def serve(job: Job) -> dict:
    """Greedy chat on each conversation in turn (batch 1), a warm-up first; per prompt the new token ids,
    the prompt's length, the wall time, the speculative counters and, if asked, the top-2 logprob gaps.
    With `job.batch == 0`, every conversation in one call (or one call per `job.groups`): the same per prompt,
    without times or counters, and each call's counters under "groups". With `job.concurrency`, its rows under
    "concurrency" (`concurrent`) and the max_num_seqs they ran under."""
    import vllm

    spec = None
    if job.draft is not None:
        spec = {"method": "eagle3", "model": job.draft, "num_speculative_tokens": job.num_speculative_tokens}
    llm = vllm.LLM(model=job.target, tokenizer=job.target, dtype=job.dtype, max_model_len=job.max_model_len,
                   gpu_memory_utilization=job.gpu_memory_utilization, enforce_eager=job.enforce_eager,
                   disable_log_stats=False, enable_prefix_caching=False, max_num_seqs=max_num_seqs(job), seed=0,
                   tensor_parallel_size=job.tensor_parallel_size, speculative_config=spec)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=job.max_new_tokens,
                                 logprobs=job.logprobs or None)
    llm.chat(job.conversations[:1], params, use_tqdm=False)  # warm-up: kernels, graphs, allocator
    if job.batch == 0:
        groups, prompts, at = [], [], 0
        for size in job.groups or [len(job.conversations)]:
            before = read_counters(llm.get_metrics())
            outs = llm.chat(job.conversations[at:at + size], params, use_tqdm=False)
            groups.append(minus(read_counters(llm.get_metrics()), before))
            prompts += [{"prompt_tokens": len(o.prompt_token_ids), "tokens": list(o.outputs[0].token_ids),
                         "seconds": None, "counters": None,
                         "gaps": top2_gaps(o.outputs[0].logprobs) if job.logprobs else None} for o in outs]
            at += size
        out = {"vllm_version": vllm.__version__, "groups": groups, "prompts": prompts}
        return {**out, **concurrent(llm, job)} if job.concurrency else out
    prompts = []
    for conv in [] if job.concurrency else job.conversations:  # the sweep's c = 1 row is this loop
        before = read_counters(llm.get_metrics())
        t0 = time.perf_counter()
        out = llm.chat([conv], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        c = out.outputs[0]
        prompts.append({"prompt_tokens": len(out.prompt_token_ids), "tokens": list(c.token_ids),
                        "seconds": seconds, "counters": minus(read_counters(llm.get_metrics()), before),
                        "gaps": top2_gaps(c.logprobs) if job.logprobs else None})
    out = {"vllm_version": vllm.__version__, "prompts": prompts}
    return {**out, **concurrent(llm, job)} if job.concurrency else out


def concurrent(llm, job: Job) -> dict:
    """Job.concurrency on a started LLM: a warm-up call of the first max(c) conversations (every batch size's
    kernels run once), then per c the conversations in consecutive calls of c (sglang_worker.sweep), each timed
    around `llm.chat` alone, its counters read around it. Greedy, no logprobs: timed as served."""
    import vllm

    params = vllm.SamplingParams(temperature=0.0, max_tokens=job.max_new_tokens)

    def call(chunk):
        before = read_counters(llm.get_metrics())
        t0 = time.perf_counter()
        outs = llm.chat(chunk, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return seconds, sum(len(o.outputs[0].token_ids) for o in outs), minus(read_counters(llm.get_metrics()), before)

    llm.chat(job.conversations[:max(job.concurrency)], params, use_tqdm=False)
    return {"max_num_seqs": max_num_seqs(job), "concurrency": sweep(job.conversations, job.concurrency, call)}


def regenerate(job: RegenJob) -> dict:
    """Every conversation with its assistant turns written by the target, turn by turn as datagen.regenerate
    does (turn t of all conversations in one batch, after the target's own replies to turns < t)."""
    import vllm

    llm = vllm.LLM(model=job.target, tokenizer=job.target, dtype=job.dtype, max_model_len=job.max_len,
                   gpu_memory_utilization=job.gpu_memory_utilization, seed=job.seed,
                   tensor_parallel_size=job.tensor_parallel_size)
    tok = llm.get_tokenizer()
    params = vllm.SamplingParams(temperature=job.temperature, top_p=job.top_p, max_tokens=job.max_new_tokens,
                                 seed=job.seed if job.temperature > 0 else None)
    users = [[m for m in c if m["role"] == "user"] for c in job.conversations]
    out = [[m for m in c if m["role"] == "system"] for c in job.conversations]
    live = set(range(len(users)))  # conversations still being extended
    for t in range(max((len(u) for u in users), default=0)):
        todo = []
        for k in sorted(live):
            if t >= len(users[k]):
                live.discard(k)
                continue
            msgs = out[k] + [users[k][t]]
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            if len(tok(text, add_special_tokens=False)["input_ids"]) >= job.max_len:  # no room for a reply
                live.discard(k)
                continue
            todo.append((k, msgs))
        for (k, msgs), o in zip(todo, llm.chat([m for _, m in todo], params, use_tqdm=False)):
            out[k] = msgs + [{"role": "assistant", "content": o.outputs[0].text.strip()}]
    return {"vllm_version": vllm.__version__, "conversations": out}


def capture(job: CaptureJob) -> dict:
    """Hidden states through vLLM's `extract_hidden_states` method and ExampleHiddenStatesConnector: one prefill
    of each whole sequence (max_tokens=1), its file read back and checked against the sequence's tokens."""
    import vllm
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states, load_hidden_states)
    from vllm.inputs import TokensPrompt

    import torch

    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eaglewire-hidden-", dir=out_dir) as store:
        llm = vllm.LLM(model=job.target, tokenizer=job.target, dtype=job.dtype, max_model_len=job.max_model_len,
                       gpu_memory_utilization=job.gpu_memory_utilization, enable_prefix_caching=False,
                       tensor_parallel_size=job.tensor_parallel_size,
                       speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                           "draft_model_config": {"hf_config": {
                                               "eagle_aux_hidden_state_layer_ids": list(job.layer_ids)}}},
                       kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                           "kv_connector_extra_config": {"shared_storage_path": store}})
        params = vllm.SamplingParams(temperature=0.0, max_tokens=1)
        files = []
        for k, seqs in enumerate(job.chunks):
            path = out_dir / f"chunk-{k:05d}.safetensors"
            files.append(path.name if seqs else None)
            if path.exists() or not seqs:
                continue
            outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
            states = []
            for seq, o in zip(seqs, outs):
                where = o.kv_transfer_params["hidden_states_path"]
                got = load_hidden_states(where)
                if got["token_ids"].tolist() != list(seq):
                    raise RuntimeError(f"vLLM returned hidden states of other tokens than a sequence of chunk {k}")
                states.append(got["hidden_states"])
                cleanup_hidden_states(where)
            offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
            with atomic_path(path) as tmp:
                save_file({"hidden": torch.cat(states).contiguous(), "offsets": offsets}, str(tmp))
    return {"vllm_version": vllm.__version__, "files": files}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m eaglewire.engines.vllm JOB.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    kind = spec.pop("kind")
    job = KINDS[kind](**spec)
    result = {"serve": serve, "regen": regenerate, "capture": capture}[kind](job)
    write_json(argv[1], result, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
