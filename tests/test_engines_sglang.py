"""engines/sglang.py, eaglewire's boundary to SGLang 0.5.17, on the CPU: the job, where SGLang is, the readers of its
meta_info (objects shaped as managers/tokenizer_manager.py:2214-2266 and 2739-2809 build them), and the worker's
process. The worker runs for real in a subprocess, against a stand-in for SGLang's public API only (sglang.Engine:
keywords in, generate, server_args, shutdown; sglang.__version__) that also calls the forward-hook factory as
model_executor/hook_manager.py does."""

import ast
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from eaglewire.engines import sglang
from eaglewire.errors import UsageError

WORKER = Path(sglang.__file__).with_name("sglang_worker.py")


def worker_module():
    spec = importlib.util.spec_from_file_location("eaglewire_sglang_worker_test", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def job(**kw):
    return sglang.Job(**{"target": "/m", "draft": "/d", "max_new_tokens": 8, "input_ids": [[1, 2, 3]], **kw})


# --- the job ------------------------------------------------------------------------------------------------

def test_a_job_refuses_what_sglang_would_refuse_or_cannot_mean():
    assert job(num_steps=1, eagle_topk=1, num_draft_tokens=16).batch == 1  # the seed's flags are served as asked
    for bad, match in [(dict(batch=2), "batch"), (dict(max_new_tokens=0), "max_new_tokens"),
                       (dict(eagle_topk=4), "without num_steps"),  # speculative_hook.py:588-601 asserts
                       (dict(num_draft_tokens=8), "without num_steps"), (dict(num_steps=0), "positive"),
                       (dict(draft=None, num_steps=3), "without a draft"),
                       (dict(conversations=[[{"role": "user", "content": "hi"}]]), "one of them"),
                       (dict(input_ids=None), "one of them")]:
        with pytest.raises(UsageError, match=match):
            job(**bad)


# --- where SGLang is ------------------------------------------------------------------------------------------

def test_where_sglang_is_comes_from_the_flags_then_the_environment(monkeypatch):
    monkeypatch.setenv(sglang.PYTHON_ENV, "/venv/bin/python")
    monkeypatch.setenv(sglang.PATH_ENV, os.pathsep.join(["/site-a", "/site-b"]))
    assert sglang.locate() == sglang.Where("/venv/bin/python", ("/site-a", "/site-b"))
    assert sglang.locate("/other/python", "/s") == sglang.Where("/other/python", ("/s",))
    monkeypatch.delenv(sglang.PYTHON_ENV)
    monkeypatch.delenv(sglang.PATH_ENV)
    assert sglang.locate() == sglang.Where(sys.executable, ())


def test_the_worker_sees_sglangs_folders_and_its_own_never_eaglewires_pythonpath(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", "/eaglewire/src")
    env = sglang.Where("/py", ("/ssite",)).env(tmp_path)
    assert env["PYTHONPATH"] == os.pathsep.join(["/ssite", str(tmp_path)]) and env["HF_HUB_OFFLINE"] == "1"


def test_sglang_out_of_reach_is_one_line_with_the_install_command(tmp_path):
    with pytest.raises(UsageError) as e:
        sglang.require(sglang.Where(str(tmp_path / "no-python")))
    assert "\n" not in str(e.value) and f"pip install '{sglang.REQUIREMENT}'" in str(e.value)
    if importlib.util.find_spec("sglang") is None:  # this Python has no sglang: nor has it with an empty folder first
        with pytest.raises(UsageError, match="cannot import sglang"):
            sglang.require(sglang.Where(sys.executable, (str(tmp_path),)))


def test_sglang_on_eaglewires_own_pythonpath_is_named_in_the_error(tmp_path, monkeypatch):
    (tmp_path / "ssite" / "sglang").mkdir(parents=True)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "ssite"))
    with pytest.raises(UsageError, match="on PYTHONPATH holds sglang: pass it with --sglang-path"):
        sglang.require(sglang.Where(str(tmp_path / "no-python")))


# --- readers of SGLang's meta_info ----------------------------------------------------------------------------

def test_counters_from_meta_info_and_its_histogram():
    """schedule_batch.py:1091-1094: histogram[k] = verify steps that accepted k draft tokens (no bonus)."""
    meta = {"completion_tokens": 21, "spec_verify_ct": 8, "spec_num_correct_drafts": 12,
            "spec_num_proposed_drafts": 32, "spec_accept_length": 21 / 8,
            "spec_correct_drafts_histogram": [1, 3, 1, 3]}  # 8 steps but 0 + 3 + 2 + 9 = 14 tokens, not 12
    assert not sglang.counters(meta, 4)["histogram_agrees"]
    meta["spec_correct_drafts_histogram"] = [2, 2, 2, 2]  # 8 steps, 0 + 2 + 4 + 6 = 12 tokens
    c = sglang.counters(meta, 4)
    assert c == {"drafts": 8, "accepted": 12, "draft_tokens": 32, "accepted_per_pos": [6, 4, 2, 0],
                 "histogram_agrees": True}
    # a request that never verified (no speculative algorithm: tokenizer_manager.py:2435 adds no spec keys)
    assert sglang.counters({"completion_tokens": 5}, 2) == {"drafts": 0, "accepted": 0, "draft_tokens": 0,
                                                             "accepted_per_pos": [0, 0], "histogram_agrees": True}


def test_counts_over_prompts_and_sglangs_own_accept_length():
    def p(hist, completion):
        steps, acc = sum(hist), sum(k * c for k, c in enumerate(hist))
        return {"tokens": [0] * completion, "seconds": 1.0,
                "meta": {"completion_tokens": completion, "spec_verify_ct": steps, "spec_num_correct_drafts": acc,
                         "spec_correct_drafts_histogram": hist}}

    r = {"resolved": {"speculative_num_steps": 3}, "prompts": [p([1, 1, 0, 2], 14), p([0, 2], 5)]}
    c = sglang.counts(r)
    assert c["drafts"] == 6 and c["accepted"] == 1 + 6 + 2 and c["acceptance_length"] == pytest.approx(1 + 9 / 6)
    assert c["rate_by_position"] == pytest.approx([5 / 6, 2 / 6, 2 / 6])
    assert c["reported_accept_length"] == pytest.approx(19 / 6)  # completion / steps: the prefill's token too
    assert sglang.rows(r, 3)[1] == {"tokens": 5, "seconds": 1.0, "drafts": 2, "accepted": 2, "draft_tokens": 0,
                                    "accepted_per_pos": [2, 0, 0], "histogram_agrees": True}


def test_top2_gaps_from_output_top_logprobs():
    assert sglang.top2_gaps([[[-0.1, 5], [-2.6, 7]], [[-0.5, 3]], None]) == [pytest.approx(2.5), None, None]
    assert sglang.top2_gaps(None) == []


def test_what_sglang_captured_and_resolved():
    r = {"hooks": [{"module": "sglang.srt.models.llama_eagle3.LlamaModel", "layers_to_capture": None},
                   {"module": "sglang.srt.models.llama.LlamaModel", "layers_to_capture": [3, 16, 28]}],
         "resolved": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 1, "speculative_eagle_topk": 1,
                      "speculative_num_draft_tokens": 2},
         "prompts": [{"meta": {"spec_verify_ct": 10, "spec_num_proposed_drafts": 10}}]}
    assert sglang.captured_taps(r)["taps"] == [3, 16, 28]
    assert sglang.captured_taps({"hooks": [{"module": "x", "layers_to_capture": []}]}) is None  # no draft
    s = sglang.speculation(r)
    assert (s["num_draft_tokens"], s["verify_steps"], s["proposed_per_step"]) == (2, 10, 1.0)


# --- the worker -------------------------------------------------------------------------------------------------

def test_the_worker_imports_neither_eaglewire_nor_transformers_at_its_top():
    """SGLang's side must not load eaglewire (its transformers pin clashes with SGLang's); transformers is imported
    only where conversations are rendered, inside SGLang's process."""
    tree = ast.parse(WORKER.read_text())
    top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    top |= {n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    assert top <= {"__future__", "json", "os", "sys", "time"}, top
    anywhere = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any((getattr(n, "module", None) or "").startswith("eaglewire") or n.level for n in anywhere
                   if isinstance(n, ast.ImportFrom))
    assert not any(a.name.startswith("eaglewire") for n in anywhere if isinstance(n, ast.Import) for a in n.names)


# server_args.py 0.5.17: the fields the worker sets (line of each declaration)
SERVER_ARGS_0517 = {"model_path": 483, "context_length": 572, "dtype": 631, "mem_fraction_static": 765,
                    "disable_radix_cache": 923, "random_seed": 1196, "log_level": 1442, "attention_backend": 1643,
                    "sampling_backend": 1670, "grammar_backend": 1679, "disable_prefill_cuda_graph": 1848,
                    "disable_cuda_graph": 1858,
                    "speculative_algorithm": 2024, "speculative_draft_model_path": 2029,
                    "speculative_num_steps": 2050, "speculative_eagle_topk": 2055,
                    "speculative_num_draft_tokens": 2060, "forward_hooks": 3421}


def test_engine_keywords_are_server_args_fields_and_leave_unset_arguments_to_sglang():
    from dataclasses import asdict

    w = worker_module()
    kw = w.engine_kwargs(asdict(job(num_steps=7, eagle_topk=1, num_draft_tokens=8, cuda_graph=False)), "/h")
    assert set(kw) <= set(SERVER_ARGS_0517)
    assert (kw["speculative_algorithm"], kw["speculative_num_steps"], kw["speculative_num_draft_tokens"]) == \
        ("EAGLE3", 7, 8) and kw["disable_cuda_graph"] and kw["attention_backend"] == "triton"
    assert kw["disable_prefill_cuda_graph"]  # the forward hook fires on eager forwards only
    (hook,) = kw["forward_hooks"]
    assert hook["hook_factory"].endswith(":aux_layers_hook") and hook["config"] == {"out": "/h"}
    auto = w.engine_kwargs(asdict(job()), "/h")  # None: SGLang auto-chooses all three (speculative_hook.py:588)
    assert "speculative_num_steps" not in auto and "speculative_eagle_topk" not in auto
    plain = w.engine_kwargs(asdict(job(draft=None)), "/h")
    assert "speculative_algorithm" not in plain and "context_length" not in plain


FAKE_SGLANG = '''
"""A stand-in for SGLang's public API only, for the worker's test (tests/test_engines_sglang.py)."""
import importlib, sys, types
__version__ = "0.5.17"


class Engine:
    def __init__(self, **kw):
        assert not [m for m in sys.modules if m.split(".")[0] in ("eaglewire", "torch")], "the worker loaded eaglewire"
        self.server_args = types.SimpleNamespace(**kw)
        if kw.get("speculative_eagle_topk") == 1:  # speculative_hook.py:656-664
            self.server_args.speculative_num_draft_tokens = kw["speculative_num_steps"] + 1
        layers = [3, 16, 28] if kw.get("speculative_algorithm") else []
        for spec in kw["forward_hooks"]:  # hook_manager.py: import the factory by name, call it with config
            mod, fn = spec["hook_factory"].split(":")
            hook = getattr(importlib.import_module(mod), fn)(spec["config"])
            target = type("LlamaModel", (), {"layers_to_capture": layers})()
            draft = type("LlamaModel", (), {})()
            for m in (target, draft, target):
                hook(m, (), None)
        self.calls = []

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, top_logprobs_num=0):
        batch = isinstance(input_ids[0], list)
        outs = []
        for ids in (input_ids if batch else [input_ids]):
            n = sampling_params["max_new_tokens"]
            meta = {"prompt_tokens": len(ids), "completion_tokens": n, "finish_reason": {"type": "length"},
                    "id": "x", "e2e_latency": 0.1}
            if self.server_args.speculative_algorithm:
                meta.update(spec_verify_ct=2, spec_num_correct_drafts=3, spec_accept_length=n / 2,
                            spec_correct_drafts_histogram=[0, 1, 1])
            if return_logprob:
                meta["output_top_logprobs"] = [[(-0.1, 5, "a"), (-1.1, 6, "b")]] * n
            outs.append({"text": "t", "output_ids": list(range(n)), "meta_info": meta})
        return outs if batch else outs[0]

    def shutdown(self):
        pass
'''


@pytest.fixture
def fake_site(tmp_path):
    site = tmp_path / "ssite"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text(FAKE_SGLANG)
    (site / "sglang-0.5.17.dist-info").mkdir()
    (site / "sglang-0.5.17.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.17\n")
    return site


def test_run_job_runs_the_worker_in_its_own_process_and_path(fake_site, tmp_path, monkeypatch):
    poison = tmp_path / "eaglewire-path"  # an inherited PYTHONPATH whose sglang would fail: never passed on
    (poison / "sglang").mkdir(parents=True)
    (poison / "sglang" / "__init__.py").write_text("raise ImportError('the inherited PYTHONPATH reached SGLang')\n")
    monkeypatch.setenv("PYTHONPATH", str(poison))
    where = sglang.Where(sys.executable, (str(fake_site),))
    assert sglang.require(where) == "0.5.17"
    log = tmp_path / "sglang.log"
    r = sglang.run_job(job(input_ids=[[1, 2, 3], [4, 5]], max_new_tokens=10, num_steps=1, eagle_topk=1,
                           num_draft_tokens=16, top_logprobs=2), log_path=log, where=where)
    assert r["sglang_version"] == "0.5.17" and log.is_file()
    assert r["resolved"]["speculative_num_draft_tokens"] == 2 and r["resolved"]["speculative_num_steps"] == 1
    assert [p["prompt_tokens"] for p in r["prompts"]] == [3, 2] and all(p["seconds"] > 0 for p in r["prompts"])
    assert r["prompts"][0]["meta"]["spec_verify_ct"] == 2 and "id" not in r["prompts"][0]["meta"]
    assert sglang.counts(r, 1)["rate_by_position"] == [1.0] and sglang.rows(r, 1)[0]["histogram_agrees"]
    assert sglang.top2_gaps(r["prompts"][0]["top_logprobs"]) == [pytest.approx(1.0)] * 10
    assert sglang.captured_taps(r)["taps"] == [3, 16, 28] and len(r["hooks"]) == 2  # once per module
    b = sglang.run_job(job(input_ids=[[1, 2, 3], [4, 5]], batch=0), where=where)
    assert [p["seconds"] for p in b["prompts"]] == [None, None] and b["seconds"] > 0


def test_a_failing_worker_is_one_line_naming_the_log(fake_site, tmp_path):
    (fake_site / "sglang" / "__init__.py").write_text("class Engine:\n    def __init__(self, **kw):\n"
                                                     "        raise RuntimeError('CUDA out of memory (fake)')\n"
                                                     "__version__ = '0.5.17'\n")
    from eaglewire.errors import EaglewireError

    with pytest.raises(EaglewireError) as e:
        sglang.run_job(job(), log_path=tmp_path / "l.log", where=sglang.Where(sys.executable, (str(fake_site),)))
    assert "CUDA out of memory (fake)" in str(e.value) and "\n" not in str(e.value) and "l.log" in str(e.value)


def test_a_failing_engine_names_its_first_and_last_exception_not_its_last_line_and_keeps_its_log(fake_site):
    # as vLLM 0.26.0 failed on an H100 (2026-12-07): the cause, a wrapper, then a shutdown warning as last line
    (fake_site / "sglang" / "__init__.py").write_text(
        "import atexit, sys\n"
        "atexit.register(lambda: print('Warning: destroy_process_group() was not called', file=sys.stderr))\n"
        "class Engine:\n    def __init__(self, **kw):\n        try:\n            import flashinfer_not_here\n"
        "        except ImportError as err:\n"
        "            raise RuntimeError('Engine core initialization failed. See root cause above.') from err\n"
        "__version__ = '0.5.17'\n")
    from eaglewire.errors import EaglewireError

    with pytest.raises(EaglewireError) as e:
        sglang.run_job(job(), where=sglang.Where(sys.executable, (str(fake_site),)))
    said = str(e.value)
    assert "ModuleNotFoundError: No module named 'flashinfer_not_here'" in said and "See root cause above" in said
    assert "destroy_process_group" not in said and "\n" not in said
    kept = Path(said.rsplit("(its log: ", 1)[1].rstrip(")"))
    assert "destroy_process_group" in kept.read_text()  # the whole log, kept past the job's temporary folder
    kept.unlink()


def test_the_job_travels_as_json(tmp_path):
    from dataclasses import asdict

    j = job(conversations=[[{"role": "user", "content": "hi"}]], input_ids=None, num_steps=3, eagle_topk=1,
            num_draft_tokens=4)
    assert sglang.Job(**json.loads(json.dumps(asdict(j)))) == j
