"""benchmarks/engine_speed.py and the engines' concurrency sweep (Job.concurrency) on the CPU. The engines are faked
only at their one boundary (`run_job`): the fakes time each call of c requests by a cost model (a verify step
dearer than a plain one, dearer still in a larger batch) and count as the engines do. The workers' chunk loop is
tested on its own, vLLM's worker on a stand-in for its `LLM`, SGLang's in its own process on a stand-in for its
public API (as tests/test_engines_sglang.py)."""

import json
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from chat_target import make_target
from decoding import new_draft

from eaglewire import checkpoint, targets
from eaglewire.engines import sglang, vllm
from eaglewire.engines.sglang_worker import add_up, sweep
from eaglewire.errors import UsageError
from eaglewire.taps import TapContract

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import engine_speed  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TAPS = (2, 4, 5)
K = 3
NEW = 24  # new tokens a request
ACCEPTED = 2  # draft tokens every verify step accepts: acceptance length 3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny chat target, an (untrained) native draft of it and a 20-prompt suite file."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    d = tmp_path_factory.mktemp("engine-speed")
    make_target(d / "target")
    model = LlamaForCausalLM.from_pretrained(d / "target")
    tok = AutoTokenizer.from_pretrained(d / "target")
    checkpoint.save_draft(new_draft(model, TapContract(8, TAPS)), d / "ck", contract=TapContract(8, TAPS),
                          target_fingerprint=targets.fingerprint(model, tok))
    (d / "suite.txt").write_text("".join(f"question {i}?\n" for i in range(20)))
    return d


def seconds(n: int, draft: bool, k: int = K) -> float:
    """A call of n requests of NEW tokens: NEW plain steps, or NEW / 3 verify steps, each dearer with n and with
    the chain's length k (its acceptance stays ACCEPTED: the draft tokens past it earn nothing)."""
    return NEW * (0.010 + 0.001 * n) if not draft else NEW / (1 + ACCEPTED) * (0.012 + 0.004 * n + 0.002 * (k - K))


class FakeEngines:
    """Both engines' run_job: each call of the sweep timed by `seconds`, counted in the engine's own words."""

    def __init__(self, sglang_limit: int | None = 2048):
        self.jobs, self.sglang_limit, self.served = [], sglang_limit, []

    def vllm(self, job, log_path=None):
        self.jobs.append(("vllm", job))
        if job.draft:  # the export lives as long as the benchmark's run: read as vLLM would, while it is there
            self.served.append(json.loads((Path(job.draft) / "config.json").read_text()))

        def call(chunk):
            steps = len(chunk) * NEW // (1 + ACCEPTED) if job.draft else 0
            counters = {"drafts": steps, "draft_tokens": steps * job.num_speculative_tokens,
                        "accepted": steps * ACCEPTED, "accepted_per_pos": [steps] * ACCEPTED + [0]}
            return seconds(len(chunk), job.draft is not None, job.num_speculative_tokens), len(chunk) * NEW, counters

        return {"vllm_version": "fake", "prompts": [], "max_num_seqs": vllm.max_num_seqs(job),
                "concurrency": sweep(job.conversations, job.concurrency, call), "aux_layers": None, "log_tail": []}

    def sglang(self, job, log_path=None, where=None):
        self.jobs.append(("sglang", job))

        def call(chunk):
            steps = len(chunk) * NEW // (1 + ACCEPTED)
            meta = {"completion_tokens": len(chunk) * NEW, "spec_verify_ct": steps,
                    "spec_num_correct_drafts": steps * ACCEPTED, "spec_num_proposed_drafts": steps * job.num_steps,
                    "spec_correct_drafts_histogram": [0, 0, steps]} if job.draft else None
            return seconds(len(chunk), job.draft is not None, job.num_steps), len(chunk) * NEW, meta

        return {"sglang_version": "fake", "resolved": {"speculative_num_steps": job.num_steps}, "prompts": [],
                "seconds": None, "hooks": [], "max_running_requests": self.sglang_limit,
                "concurrency": sweep(job.conversations, job.concurrency, call), "log_tail": []}


def _faked(monkeypatch, fake):
    monkeypatch.setattr(vllm, "run_job", fake.vllm)
    monkeypatch.setattr(vllm, "require", lambda: None)
    monkeypatch.setattr(sglang, "run_job", fake.sglang)
    monkeypatch.setattr(sglang, "require", lambda where=None: "fake")
    return fake


def _argv(world, engine, *extra):
    return ["--target", str(world / "target"), "--draft", str(world / "ck"), "--engine", engine, "--suite",
            str(world / "suite.txt"), "--prompts", "20", "--new-tokens", str(NEW), "--chain", str(K), *extra]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_both_runs_carry_the_sweep_and_the_table_pairs_them(world, monkeypatch, tmp_path, capsys, engine):
    fake = _faked(monkeypatch, FakeEngines())
    code = engine_speed.main(_argv(world, engine, "--json", str(tmp_path / "r.json"),
                                   "--plot", str(tmp_path / "r.png")))
    out, err = capsys.readouterr()
    assert code == 0, err
    (_, plain), (_, spec) = fake.jobs
    assert [e for e, _ in fake.jobs] == [engine, engine] and plain.draft is None and spec.draft is not None
    assert plain.concurrency == spec.concurrency == (1, 4, 16) and len(plain.conversations) == 20
    assert plain.conversations == spec.conversations and plain.batch == spec.batch == 1
    if engine == "vllm":  # vLLM runs max_num_seqs requests at once: at least the largest c
        assert vllm.max_num_seqs(plain) == vllm.max_num_seqs(spec) == 16 and spec.num_speculative_tokens == K
        assert fake.served[0]["eagle_aux_hidden_state_layer_ids"] == list(TAPS)  # exported as serve-check does
    else:  # SGLang's limit is its own (sized from its KV pool, >= 16 here): the worker sets none
        from test_engines_sglang import worker_module

        assert "max_running_requests" not in worker_module().engine_kwargs(asdict(spec), "/h")
        assert (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens) == (K, 1, K + 1) and not spec.input_ids
    r = json.loads((tmp_path / "r.json").read_text())
    rows = {x["c"]: x for x in r["rows"]}
    assert list(rows) == [1, 4, 16] and [rows[c]["calls"] for c in rows] == [20, 5, 2]
    for c, x in rows.items():
        # each run's tokens/s from its own calls (20 prompts: the last call at c = 16 holds 4)
        calls = [16, 4] if c == 16 else [c] * (20 // c)
        assert x["tokens_per_s_without"] == pytest.approx(20 * NEW / sum(seconds(n, False) for n in calls))
        assert x["tokens_per_s_with"] == pytest.approx(20 * NEW / sum(seconds(n, True) for n in calls))
        assert x["speedup"] == pytest.approx(x["tokens_per_s_with"] / x["tokens_per_s_without"])
        assert x["acceptance_length"] == pytest.approx(1 + ACCEPTED)  # from the with-draft counters
        # a step with the draft against a plain one: what the fake engine charges each, whatever the speed-up says
        per_step = (0.012 + 0.004 * calls[0]) / (0.010 + 0.001 * calls[0]) if c < 16 else None
        assert per_step is None or x["step_cost"] == pytest.approx(per_step)
        assert x["rate_by_position"] == pytest.approx([1.0, 1.0, 0.0]) and x["engine_ran_at_most"] is None
    assert rows[1]["speedup"] == pytest.approx(3 * 0.011 / 0.016) and rows[16]["speedup"] < rows[4]["speedup"]
    assert r["engine"] == engine and r["engine_version"] == "fake" and r["settings"]["concurrency"] == [1, 4, 16]
    assert r["machine"]["eaglewire"] and r["draft"]["taps"] == list(TAPS)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert table[0] == "| c | tokens/s without | tokens/s with | speed-up | acceptance length | step cost |"
    assert len(table) == 5 and table[2].startswith("| 1 | ")
    assert table[2].endswith(f"| {rows[1]['speedup']:.2f}x | 3.00 | {0.016 / 0.011:.2f} |")
    assert "engine_speed: " in err and "with the draft" in err  # progress on stderr


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_chain_sweep_serves_one_run_per_length_beside_one_run_without(world, monkeypatch, tmp_path, capsys, engine):
    fake = _faked(monkeypatch, FakeEngines())
    argv = _argv(world, engine, "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"))
    argv[argv.index("--chain") + 1] = "2,4"
    assert engine_speed.main(argv) == 0
    out = capsys.readouterr().out
    jobs = [j for _, j in fake.jobs]
    assert [j.draft is None for j in jobs] == [True, False, False]  # the run without the draft serves both
    if engine == "vllm":
        assert [j.num_speculative_tokens for j in jobs[1:]] == [2, 4]
    else:  # exported once per length: SGLang's steps travel with the export
        assert [(j.num_steps, j.num_draft_tokens) for j in jobs[1:]] == [(2, 3), (4, 5)]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["settings"]["chains"] == [2, 4] and [(x["chain"], x["c"]) for x in r["rows"]] == [
        (k, c) for k in (2, 4) for c in (1, 4, 16)]
    by = {(x["chain"], x["c"]): x for x in r["rows"]}
    for c in (1, 4, 16):
        # one run without the draft under both lengths; the longer chain's verify steps cost more for nothing
        assert by[2, c]["tokens_per_s_without"] == by[4, c]["tokens_per_s_without"]
        assert by[2, c]["speedup"] > by[4, c]["speedup"] and by[2, c]["acceptance_length"] == pytest.approx(3)
    assert by[2, 1]["speedup"] == pytest.approx(3 * 0.011 / 0.014)
    table = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert table[0].startswith("| chain | c | tokens/s without") and len(table) == 8
    assert table[2].startswith("| 2 | 1 |")
    assert f"c = 1: a chain of 2 gave the highest speed-up measured, {by[2, 1]['speedup']:.2f}x" in out
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_engine_that_runs_fewer_than_c_at_once_is_named_beside_the_row(world, monkeypatch, capsys):
    _faked(monkeypatch, FakeEngines(sglang_limit=8))
    assert engine_speed.main(_argv(world, "sglang")) == 0
    out = capsys.readouterr().out
    assert "c = 16: SGLang ran at most 8 requests at once" in out and "c = 4:" not in out


@pytest.mark.parametrize("flags, says", [
    (["--engine", "tgi"], "--engine 'tgi': one of vllm, sglang"),
    (["--concurrency", "1,0,16"], "--concurrency 1,0,16: give integers >= 1"),
    (["--chain", "3,0"], "--chain 3,0: give draft tokens a step, integers >= 1"),
    (["--prompts", "8"], "--prompts 8: fewer than the largest concurrency 16"),
    (["--draft", "NOWHERE"], "--draft NOWHERE: no config.json"),
])
def test_bad_input_is_one_line_naming_the_flag_exit_2(world, monkeypatch, capsys, flags, says):
    fake = _faked(monkeypatch, FakeEngines())
    argv = _argv(world, "vllm")
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    assert engine_speed.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not fake.jobs


def test_an_engine_not_installed_gives_the_engines_own_line(world, capsys):
    if vllm.available():
        pytest.skip("vLLM is installed here")
    assert engine_speed.main(_argv(world, "vllm")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'eaglewire[vllm]'" in err[0]


# --- the sweep itself ------------------------------------------------------------------------------------------

def test_the_sweep_runs_consecutive_chunks_of_c_and_sums_each_cs_calls():
    seen = []

    def call(chunk):
        seen.append(list(chunk))
        return 0.5 * len(chunk), 10 * len(chunk), {"drafts": len(chunk), "accepted_per_pos": [1] * len(chunk)}

    rows = sweep(list(range(10)), (1, 4, 16), call)
    assert seen[:10] == [[i] for i in range(10)]
    assert seen[10:] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], list(range(10))]
    assert [(r["c"], r["calls"], r["tokens"]) for r in rows] == [(1, 10, 100), (4, 3, 100), (16, 1, 100)]
    assert [r["seconds"] for r in rows] == [pytest.approx(5.0)] * 3
    assert rows[1]["counters"] == {"drafts": 10, "accepted_per_pos": [3, 3, 2, 2]}
    assert sweep([1, 2], (2,), lambda chunk: (1.0, 2, None))[0]["counters"] is None  # no draft: nothing counted


def test_counters_add_up_key_by_key():
    a = {"spec_verify_ct": 3, "spec_correct_drafts_histogram": [1, 2], "finish_reason": {"type": "length"}}
    b = {"spec_verify_ct": 4, "spec_correct_drafts_histogram": [0, 1, 3], "spec_num_correct_drafts": None}
    assert add_up(a, b) == {"spec_verify_ct": 7, "spec_correct_drafts_histogram": [1, 3, 3]}
    assert add_up(None, b) is b and add_up(a, None) is a and add_up(None, None) is None


def test_summed_meta_reads_as_one_requests_counters():
    """sglang.counters reads a call's summed meta_info as it reads one request's: the histogram adds up too."""
    from test_engines_sglang import worker_module

    w = worker_module()
    first = {"completion_tokens": 5, "spec_verify_ct": 2, "spec_num_correct_drafts": 3,
             "spec_correct_drafts_histogram": [0, 1, 1], "spec_accept_length": 2.5, "finish_reason": {"type": "length"}}
    second = {"completion_tokens": 4, "spec_verify_ct": 3, "spec_num_correct_drafts": 1,
              "spec_correct_drafts_histogram": [2, 1]}
    outs = [{"output_ids": [0] * 5, "meta_info": first}, {"output_ids": [0] * 4, "meta_info": second}]
    total = w.summed_meta(outs)
    assert total == {"completion_tokens": 9, "spec_verify_ct": 5, "spec_num_correct_drafts": 4,
                     "spec_correct_drafts_histogram": [2, 2, 1]}
    c = sglang.counters(total, 2)
    assert (c["drafts"], c["accepted"], c["accepted_per_pos"], c["histogram_agrees"]) == (5, 4, [3, 1], True)
    assert w.summed_meta([{"output_ids": [1], "meta_info": {"completion_tokens": 1}}]) is None  # no draft


# --- the jobs ----------------------------------------------------------------------------------------------------

def test_jobs_refuse_a_concurrency_below_1_and_travel_as_json():
    with pytest.raises(UsageError, match="concurrency"):
        vllm.Job(target="/m", draft=None, conversations=[[]], max_new_tokens=4, concurrency=(1, 0))
    with pytest.raises(UsageError, match="concurrency"):
        sglang.Job(target="/m", draft=None, max_new_tokens=4, input_ids=[[1]], concurrency=(-4,))
    v = vllm.Job(target="/m", draft="/d", conversations=[[]], max_new_tokens=4, concurrency=[1, 4])
    assert v.concurrency == (1, 4) and vllm.Job(**json.loads(json.dumps(asdict(v)))) == v
    s = sglang.Job(target="/m", draft=None, max_new_tokens=4, input_ids=[[1]], concurrency=(1, 16))
    assert sglang.Job(**json.loads(json.dumps(asdict(s)))) == s
    # vLLM's cap on requests at once: as before without a sweep, at least the largest c with one
    base = dict(target="/m", draft=None, conversations=[[]], max_new_tokens=4)
    assert [vllm.max_num_seqs(vllm.Job(**base, **kw)) for kw in
            ({}, {"batch": 0}, {"concurrency": (1, 4, 16)}, {"batch": 0, "concurrency": (512,)})] == [1, 256, 16, 512]


class FakeLLM:
    """vllm.LLM's stand-in: chat answers each conversation with max_tokens tokens; every request verifies 4 steps
    accepting 2 draft tokens each, added to the cumulative counters get_metrics reports."""

    made = []

    def __init__(self, **kw):
        self.kw, self.calls, self.steps = kw, [], 0
        FakeLLM.made.append(self)

    def chat(self, convs, params, use_tqdm=True):
        self.calls.append((len(convs), getattr(params, "logprobs", None)))
        self.steps += 4 * len(convs)
        return [SimpleNamespace(prompt_token_ids=[1, 2], outputs=[SimpleNamespace(token_ids=[7] * params.max_tokens,
                                                                                  logprobs=None)]) for _ in convs]

    def get_metrics(self):
        C = lambda name, v: SimpleNamespace(name="vllm:spec_decode_" + name, value=v)  # noqa: E731
        return [C("num_drafts", self.steps), C("num_draft_tokens", 3 * self.steps),
                C("num_accepted_tokens", 2 * self.steps),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[self.steps] * 2 + [0])]


def test_the_vllm_worker_sweeps_after_its_warm_up_and_keeps_batch_1_as_it_was(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=FakeLLM, __version__="fake",
                                                             SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    convs = [[{"role": "user", "content": str(i)}] for i in range(6)]
    job = dict(target="/m", draft="/d", conversations=convs, max_new_tokens=5, logprobs=2)
    old = vllm.serve(vllm.Job(**job))
    llm = FakeLLM.made[-1]
    assert set(old) == {"vllm_version", "prompts"} and len(old["prompts"]) == 6 and llm.kw["max_num_seqs"] == 1
    assert [n for n, _ in llm.calls] == [1] * 7 and old["prompts"][0]["counters"]["drafts"] == 4
    r = vllm.serve(vllm.Job(**job, concurrency=(1, 4)))
    llm = FakeLLM.made[-1]
    # the warm-ups (one conversation, then max(c)), then the sweep without logprobs; no per-prompt loop
    assert llm.calls == [(1, 2), (4, None)] + [(1, None)] * 6 + [(4, None), (2, None)]
    assert llm.kw["max_num_seqs"] == 4 and r["max_num_seqs"] == 4 and r["prompts"] == []
    assert [(x["c"], x["calls"], x["tokens"]) for x in r["concurrency"]] == [(1, 6, 30), (4, 2, 30)]
    assert r["concurrency"][1]["counters"] == {"drafts": 24, "draft_tokens": 72, "accepted": 48,
                                               "accepted_per_pos": [24, 24, 0]}
    b = vllm.serve(vllm.Job(**job, batch=0, concurrency=(4,)))  # batch 0: its call first, then the sweep
    assert set(b) == {"vllm_version", "groups", "prompts", "max_num_seqs", "concurrency"} and len(b["prompts"]) == 6
    assert [n for n, _ in FakeLLM.made[-1].calls] == [1, 6, 4, 4, 2] and b["max_num_seqs"] == 256


FAKE_SGLANG = '''
"""A stand-in for SGLang's public API only (Engine: keywords in, generate, server_args, shutdown), for
tests/test_engine_speed.py: each request writes max_new_tokens tokens in 2 verify steps of 1 accepted draft token."""
import os, sys, types
__version__ = "0.5.17"


class Engine:
    def __init__(self, **kw):
        self.server_args = types.SimpleNamespace(**kw)
        print("[scheduler] max_total_num_tokens=100000, max_running_requests=2048, context_len=4096", file=sys.stderr)

    def generate(self, input_ids=None, sampling_params=None, **kw):
        batch = isinstance(input_ids[0], list)
        with open(os.environ["FAKE_SGLANG_CALLS"], "a") as f:
            f.write(f"{len(input_ids) if batch else 0}\\n")
        outs = []
        for ids in (input_ids if batch else [input_ids]):
            n = sampling_params["max_new_tokens"]
            meta = {"prompt_tokens": len(ids), "completion_tokens": n, "finish_reason": {"type": "length"}}
            if getattr(self.server_args, "speculative_algorithm", None):
                meta.update(spec_verify_ct=2, spec_num_correct_drafts=2, spec_correct_drafts_histogram=[0, 2])
            outs.append({"text": "t", "output_ids": list(range(n)), "meta_info": meta})
        return outs if batch else outs[0]

    def shutdown(self):
        pass
'''


def test_the_sglang_worker_sweeps_in_its_own_process(tmp_path, monkeypatch):
    site = tmp_path / "ssite"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text(FAKE_SGLANG)
    (site / "sglang-0.5.17.dist-info").mkdir()
    (site / "sglang-0.5.17.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.17\n")
    where = sglang.Where(sys.executable, (str(site),))
    monkeypatch.setenv("FAKE_SGLANG_CALLS", str(tmp_path / "calls.txt"))  # the worker's environment is this one's
    job = sglang.Job(target="/m", draft="/d", max_new_tokens=6, input_ids=[[1, 2]] * 5, num_steps=1, eagle_topk=1,
                     num_draft_tokens=2, concurrency=(1, 2))
    r = sglang.run_job(job, where=where)
    # the warm-ups (one prompt alone, then max(c) as a batch), then the sweep: every call a batch, a batch of one too
    assert (tmp_path / "calls.txt").read_text().split() == ["0", "2"] + ["1"] * 5 + ["2", "2", "1"]
    assert r["prompts"] == [] and r["max_running_requests"] == 2048
    assert [(x["c"], x["calls"], x["tokens"]) for x in r["concurrency"]] == [(1, 5, 30), (2, 3, 30)]
    rows = sglang.Serving.concurrency_rows(r, 1)
    assert rows[1]["counters"]["drafts"] == 10 and rows[1]["counters"]["accepted_per_pos"] == [10]
    plain = sglang.run_job(sglang.Job(target="/m", draft=None, max_new_tokens=6, input_ids=[[1, 2]] * 2), where=where)
    assert "concurrency" not in plain and "max_running_requests" not in plain and len(plain["prompts"]) == 2

