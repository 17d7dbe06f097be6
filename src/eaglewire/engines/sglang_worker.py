"""SGLang's side of eaglewire's boundary to SGLang: one job, run in SGLang's own Python.

Self-contained on purpose: this file imports the standard library and, inside its functions, sglang and the
transformers SGLang brings (0.5.17 pins 5.12.1, which eaglewire's own pin excludes). It never imports eaglewire.
engines/sglang.py copies it into the job's private folder as `eaglewire_sglang_worker.py` and runs

    SGLANG_PYTHON eaglewire_sglang_worker.py JOB.json OUT.json

with PYTHONPATH = SGLang's site folders (if any), then that folder. The folder holds only this file and the
job, so nothing of eaglewire shadows a module SGLang imports. SGLang's scheduler process imports
`aux_layers_hook` from here through its `forward_hooks` server argument (below).

Facts this relies on (sglang 0.5.17, python/sglang/srt/...):
- entrypoints/engine.py:229-236: `Engine(**kwargs)` builds `ServerArgs(**kwargs)` (log level "error" unless
  given) and keeps it as `engine.server_args`. server_args.py:3590-3592 (`__post_init__`) runs
  arg_groups/speculative_hook.py `handle_speculative_decoding`, which rewrites the speculative arguments in that
  object. Steps/topk/draft tokens are auto-chosen when steps is unset (:588-601,
  `_auto_choose_speculative_params` :795-825). Draft tokens are forced to steps + 1 under topk 1 (:656-664,
  a log warning only). So what SGLang RESOLVED is read from `engine.server_args` once the engine is up
  (`resolved`).
- entrypoints/engine.py:1670: SGLang starts its processes with `spawn`, so the job runs under
  `if __name__ == "__main__"`.
- server_args.py:3421-3428 `forward_hooks` (JSON list of {name, target_modules, hook_factory, config}). The
  scheduler process imports `hook_factory` (model_executor/hook_manager.py:11-55), calls it with `config` and
  registers the returned forward hook on every module whose name matches. It registers them after CUDA-graph capture
  (model_runner_components/cuda_graph_setup.py:157-164), so they fire on eager forwards only. So prefills run eager
  unless the job asks otherwise (server_args.py:1848 `disable_prefill_cuda_graph`); decode steps stay in graphs
  unless cuda_graph is off. `aux_layers_hook` reads `layers_to_capture` of the target's inner model:
  models/llama.py:411 (the list). At layer i (:434-437) it captures `hidden_states + residual`, the residual stream
  entering layer i: eaglewire's tap i. `set_eagle3_layers_to_capture` (:885-897) maps no ids to [2, N//2, N-3] as
  they are, and ids to `val + 1`. SGLang logs none of this.
- managers/tokenizer_manager.py:2435-2436 and 2739-2809: a finished request's meta_info carries
  `spec_verify_ct` (verify steps) and `spec_num_correct_drafts` (accepted draft tokens, no bonus). It carries
  `spec_num_proposed_drafts` (= verify steps x (num_draft_tokens - 1), :2757-2759) and `spec_accept_length`
  (= completion_tokens / verify steps, :2767-2769: the prefill's token counts too). It carries
  `spec_correct_drafts_histogram` (:2797-2809): index k = verify steps that accepted k draft tokens
  (managers/schedule_batch.py:1091-1094, 1192-1202). `output_top_logprobs`: per new token a list of
  (logprob, token_id, text) (tokenizer_manager.py:2699-2717).
- Job.concurrency: `generate(input_ids=[ids, ...])` is a batch whenever input_ids' first item is a list, a batch
  of one included (managers/io_struct.py:420-428), answered with a list; the tokenizer manager sends every request
  of the batch to the scheduler before it waits for any (tokenizer_manager.py:1770-1811), so a call of c prompts
  runs c requests at once. The worker sets no max_running_requests: SGLang sizes it from its KV pool,
  max(min(token capacity / context length x 512, 4096), 2048) capped at half the token capacity
  (mem_cache/kv_cache_configurator.py:1719-1733), and its scheduler logs the result as "max_running_requests=N"
  (managers/scheduler.py:1068-1075), which engines/sglang.py reads back.
"""

from __future__ import annotations

import json
import os
import sys
import time

# What of a finished request's meta_info the job keeps (tokenizer_manager.py:2214-2266, 2739-2809).
META_KEYS = ("prompt_tokens", "completion_tokens", "finish_reason", "spec_verify_ct", "spec_accept_length",
             "spec_accept_rate", "spec_num_correct_drafts", "spec_num_proposed_drafts",
             "spec_correct_drafts_histogram")
# The speculative settings SGLang resolved (server_args.py fields), and what else shapes the run.
RESOLVED_KEYS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                 "speculative_num_draft_tokens", "speculative_draft_model_path", "attention_backend",
                 "page_size", "disable_cuda_graph", "disable_prefill_cuda_graph", "max_running_requests", "dtype",
                 "mem_fraction_static", "disable_radix_cache", "sampling_backend")
# The modules whose `layers_to_capture` says what the target feeds the draft: the target's inner model.
HOOK_MODULES = ["model", "language_model.model"]
# What of a request's meta_info adds up over a call's requests: engines/sglang.py's `counters` reads the sum as it
# reads one request's (the histogram too: each of its entries counts verify steps).
SUMMED_KEYS = ("completion_tokens", "spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts",
               "spec_correct_drafts_histogram")


def engine_kwargs(job: dict, hook_file: str) -> dict:
    """sglang.Engine's keywords for a job (a dict of engines/sglang.py's Job): greedy runs of the target, with
    the draft as EAGLE3 when there is one. Speculative arguments left None are left to SGLang."""
    kw = dict(model_path=job["target"], dtype=job["dtype"], mem_fraction_static=job["mem_fraction_static"],
              attention_backend=job["attention_backend"], sampling_backend="pytorch", grammar_backend="none",
              disable_cuda_graph=not job["cuda_graph"], disable_prefill_cuda_graph=not job["prefill_cuda_graph"],
              disable_radix_cache=True, random_seed=0, log_level="info",
              forward_hooks=[{"name": "eaglewire_aux_layers", "target_modules": HOOK_MODULES,
                              "hook_factory": f"{hook_module()}:aux_layers_hook", "config": {"out": hook_file}}])
    if job["draft"] is not None:
        kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=job["draft"])
        for name in ("num_steps", "eagle_topk", "num_draft_tokens"):
            if job[name] is not None:
                kw[f"speculative_{name}"] = job[name]
    if job.get("context_length"):
        kw["context_length"] = job["context_length"]
    return kw


def hook_module() -> str:
    """This module's name as SGLang's scheduler will import it (the file's name: it runs as a script)."""
    return os.path.splitext(os.path.basename(__file__))[0]


def aux_layers_hook(config: dict):
    """SGLang hook factory (hook_manager.py): a forward hook that appends, once per module, the module's class
    and its `layers_to_capture` to the file config["out"] as a JSON line."""
    out, seen = config["out"], set()

    def hook(module, args, output):
        if id(module) in seen:
            return None
        seen.add(id(module))
        layers = getattr(module, "layers_to_capture", None)
        cls = type(module)
        with open(out, "a") as f:
            f.write(json.dumps({"module": f"{cls.__module__}.{cls.__qualname__}",
                                "layers_to_capture": None if layers is None else [int(i) for i in layers]}) + "\n")
        return None

    return hook


def read_hook_file(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def resolved(server_args) -> dict:
    """What SGLang resolved the run's arguments to (its ServerArgs after __post_init__), as JSON values."""
    out = {}
    for k in RESOLVED_KEYS:
        v = getattr(server_args, k, None)
        out[k] = v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
    return out


def prompt_ids(job: dict) -> list[list[int]]:
    """The prompts' token ids: as given, or the conversations under the target's chat template (SGLang's
    transformers), generation prompt added."""
    if job.get("input_ids"):
        return [[int(t) for t in ids] for ids in job["input_ids"]]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(job["target"])
    out = []
    for conv in job["conversations"]:
        enc = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = enc["input_ids"]
        out.append([int(t) for t in (ids[0] if ids and isinstance(ids[0], list) else ids)])
    return out


def one(out: dict, top_logprobs: int) -> dict:
    """One request's output dict (tokenizer_manager.py:2337-2360: text, output_ids, meta_info) as kept."""
    meta = out.get("meta_info") or {}
    row = {"tokens": [int(t) for t in out.get("output_ids") or []],
           "meta": {k: meta[k] for k in META_KEYS if k in meta}}
    if top_logprobs:
        row["top_logprobs"] = [None if pos is None else [[float(lp), int(tid)] for lp, tid, *_ in pos]
                               for pos in meta.get("output_top_logprobs") or []]
    return row


def add_up(a: dict | None, b: dict | None) -> dict | None:
    """Two sets of counters summed key by key: numbers added, lists added item by item (the shorter one padded with
    0). None, and a key's None, count as nothing; other values (text) are dropped."""
    if a is None or b is None:
        return a if b is None else (b if a is None else None)
    out = {}
    for k in [*a, *(k for k in b if k not in a)]:
        x, y = a.get(k), b.get(k)
        if x is None or y is None:
            v = y if x is None else x
            if isinstance(v, list) or (isinstance(v, (int, float)) and not isinstance(v, bool)):
                out[k] = list(v) if isinstance(v, list) else v
        elif isinstance(x, list) and isinstance(y, list):
            n = max(len(x), len(y))
            out[k] = [p + q for p, q in zip(x + [0] * (n - len(x)), y + [0] * (n - len(y)))]
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y)):
            out[k] = x + y
    return out


def sweep(items: list, concurrency, call) -> list[dict]:
    """Job.concurrency's calls, whatever the engine (engines/vllm.py uses this too): for each c, `items` in
    consecutive chunks of c (the last may be shorter), one `call(chunk)` each, which returns (seconds, new tokens,
    counters or None). Per c: the number of calls and their seconds, tokens and counters summed (`add_up`)."""
    rows = []
    for c in concurrency:
        row = {"c": c, "calls": 0, "seconds": 0.0, "tokens": 0, "counters": None}
        for at in range(0, len(items), c):
            seconds, tokens, counters = call(items[at:at + c])
            row["calls"] += 1
            row["seconds"] += seconds
            row["tokens"] += tokens
            row["counters"] = add_up(row["counters"], counters)
        rows.append(row)
    return rows


def summed_meta(outs: list) -> dict | None:
    """One call's speculative counters: SUMMED_KEYS of its requests' meta_info, summed. None without a draft (a
    request that never verified carries no spec keys, tokenizer_manager.py:2435-2436)."""
    metas = [o.get("meta_info") or {} for o in outs]
    if not any("spec_verify_ct" in m for m in metas):
        return None
    total = None
    for m in metas:
        total = add_up(total, {k: m[k] for k in SUMMED_KEYS if k in m})
    return total


def concurrent(engine, prompts: list, concurrency, params: dict) -> list[dict]:
    """Job.concurrency on a started engine: a warm-up call of the first max(c) prompts (every batch size's kernels
    run once), then per c the prompts in consecutive calls of c (`sweep`), each timed around `generate` alone.
    No logprobs: timed as served."""
    def call(chunk):
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=chunk, sampling_params=params)  # a list of lists: a batch, even of one
        seconds = time.perf_counter() - t0
        return seconds, sum(len(o.get("output_ids") or []) for o in outs), summed_meta(outs)

    engine.generate(input_ids=prompts[:max(concurrency)], sampling_params=params)
    return sweep(prompts, concurrency, call)


def serve(job: dict, hook_file: str) -> dict:
    """Greedy generation of every prompt: batch 1 (a warm-up, then each prompt in its own call, timed) or
    batch 0 (all prompts in one call: acceptance only). With `concurrency` (c, ...), its rows under "concurrency"
    (`concurrent`); at batch 1 the per-prompt calls are skipped then ("prompts" is empty): the c = 1 row is them."""
    import sglang

    prompts = prompt_ids(job)
    engine = sglang.Engine(**engine_kwargs(job, hook_file))
    try:
        params = {"temperature": 0.0, "max_new_tokens": job["max_new_tokens"]}
        lp = ({"return_logprob": True, "top_logprobs_num": job["top_logprobs"]} if job["top_logprobs"] else {})
        rows, total = [], None
        if job["batch"] == 1:
            engine.generate(input_ids=prompts[0], sampling_params=params, **lp)  # warm-up
            for ids in [] if job.get("concurrency") else prompts:
                t0 = time.perf_counter()
                out = engine.generate(input_ids=ids, sampling_params=params, **lp)
                rows.append({**one(out, job["top_logprobs"]), "seconds": time.perf_counter() - t0})
        else:
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params, **lp)
            total = time.perf_counter() - t0
            rows = [{**one(o, job["top_logprobs"]), "seconds": None} for o in outs]
        for ids, row in zip(prompts, rows):
            row["prompt_tokens"] = len(ids)
        out = {"sglang_version": sglang.__version__, "resolved": resolved(engine.server_args),
               "prompts": rows, "seconds": total, "hooks": read_hook_file(hook_file)}
        if job.get("concurrency"):
            out["concurrency"] = concurrent(engine, prompts, job["concurrency"], params)
        return out
    finally:
        engine.shutdown()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python eaglewire_sglang_worker.py JOB.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    result = serve(job, os.path.join(os.path.dirname(os.path.abspath(argv[1])), "hooks.jsonl"))
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
