"""train_data.py: the held-out split, the online corpus (encoding in chunks, several prompt files pooled).
The training itself is test_train.py's."""

from types import SimpleNamespace

import pytest
import torch
from chat_target import CONTRACT, conversations_file, make_target

from eaglewire import cli, targets
from eaglewire.errors import EaglewireError
from eaglewire.parallel import Dist
from eaglewire.train import data as train_data

ONE = Dist(0, 1, torch.device("cpu"), False)  # one process on the CPU
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """The tiny chat target (its directory and loaded) and 40 conversations for it, under `root`."""
    root = tmp_path_factory.mktemp("train_data")
    directory = make_target(root / "target")
    return SimpleNamespace(root=root, dir=directory, target=targets.load_target(str(directory), device="cpu"),
                           prompts=conversations_file(root / "prompts.jsonl", 40))


def test_the_held_out_split_follows_each_samples_content():
    """A sample is held out by a seeded hash of its tokens: growing the data (new replies for an --init-from
    run) keeps every held-out sample held out, copies never straddle the split, and the seed picks another."""
    seqs = [torch.tensor([i, i * 7 % 13, 3]) for i in range(2000)]
    keys = [train_data.content_key(x) for x in seqs]
    tr, ev = train_data.split(keys, 0.1, seed=0)
    assert sorted(tr + ev) == list(range(2000)) and 140 < len(ev) < 260
    grown = keys[:1000] + [train_data.content_key(torch.tensor([5000 + i, 1])) for i in range(3000)]
    _, ev_grown = train_data.split(grown, 0.1, seed=0)
    # a permutation of 4000 would keep only ~10% of them held out
    assert {i for i in ev if i < 1000} == {i for i in ev_grown if i < 1000}
    copies = keys[:50] * 3
    _, ev_copies = train_data.split(copies, 0.3, seed=0)
    assert {i % 50 for i in ev_copies} == {i for i in ev_copies if i < 50} and len(ev_copies) % 3 == 0
    assert train_data.split(keys, 0.1, seed=1)[1] != ev
    assert train_data.split(keys[:2], 0.001, seed=0)[1] and train_data.split(keys[:2], 0.999, seed=0)[0]
    with pytest.raises(EaglewireError, match="too few"):
        train_data.split(keys[:1], 0.1, seed=0)


def test_online_samples_do_not_depend_on_the_encoding_chunk(chat, monkeypatch, capsys):
    """build_online tokenizes a chunk of conversations per call: chunks of 7 (40 conversations, the
    last chunk short) give the same samples, in the same order, as one call for all. With progress
    on, the encoding shows a bar (96k conversations take the better part of a minute)."""
    whole = train_data.build_online(chat.target, chat.prompts, CONTRACT, 256, None, ONE)
    assert "encode" not in capsys.readouterr().err
    monkeypatch.setattr(train_data, "ENCODE_CHUNK", 7)
    chunked = train_data.build_online(chat.target, chat.prompts, CONTRACT, 256, None, ONE, progress=True)
    assert "encode: 100%" in capsys.readouterr().err
    assert len(whole) == len(chunked) == 40
    for i in range(40):
        a, b = whole.item(i), chunked.item(i)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), i


def test_online_training_pools_several_prompt_files(chat, capsys):
    """`train --prompts a b --online`: the samples of both halves of the prompt file, a conversation that both
    hold once; a missing file is refused before the target loads."""
    root = chat.root
    lines = chat.prompts.read_text().splitlines(keepends=True)
    first, second = root / "first.jsonl", root / "second.jsonl"
    first.write_text("".join(lines[:25]))
    second.write_text("".join(lines[20:]))  # five conversations in both
    whole = train_data.build_online(chat.target, chat.prompts, CONTRACT, 256, None, ONE)
    pooled = train_data.build_online(chat.target, [first, second], CONTRACT, 256, None, ONE)
    assert pooled.keys == whole.keys
    assert "40 conversations from 2 file(s), 5 repeats dropped" in capsys.readouterr().err
    assert pooled.provenance["prompts"]["duplicates"] == 5
    assert cli.main(["train", "--target", str(chat.dir), "--prompts", str(first), str(root / "nope.jsonl"),
                     "--online", "--out", str(root / "never")]) == 2
    assert "--prompts " + str(root / "nope.jsonl") + ": no such file" in capsys.readouterr().err
    assert not (root / "never").exists()


def test_max_train_samples_cuts_the_training_split_after_the_held_out_split(chat):
    """--max-train-samples N: the first N samples of the training split, in the data's order, the draft's vocabulary
    counted over them alone; the same samples are held out as without it. A bad value is refused naming the flag."""
    from collections import Counter

    from eaglewire.errors import UsageError
    from eaglewire.train.config import TrainConfig
    from eaglewire.train.trainer import set_up

    fast = dict(batch_tokens=512, max_len=256, eval_fraction=0.2, draft_vocab_size=16, device="cpu")
    whole = set_up(TrainConfig(**fast), chat.target, chat.prompts, ONE, False)
    cut = set_up(TrainConfig(max_train_samples=5, **fast), chat.target, chat.prompts, ONE, False)
    assert cut.eval_idx == whole.eval_idx and len(whole.eval_idx) > 0
    assert cut.train_idx == whole.train_idx[:5] and len(whole.train_idx) > 5
    assert cut.schedule.indices == cut.train_idx  # what the steps draw from
    counts = Counter()  # the five samples' reply tokens, counted here from the samples themselves
    for i in cut.train_idx:
        x = cut.corpus.item(i)
        counts.update(x["input_ids"][x["loss_mask"]].tolist())
    top = sorted(counts, key=lambda t: (-counts[t], t))[:15]
    chosen = set(cut.draft.draft_to_target(torch.arange(16)).tolist())
    assert set(top) <= chosen and chosen != set(whole.draft.draft_to_target(torch.arange(16)).tolist())
    more = set_up(TrainConfig(max_train_samples=10_000, **fast), chat.target, chat.prompts, ONE, False)
    assert more.train_idx == whole.train_idx  # more than the split holds: all of it
    for bad in (0, -3, 2.5, True):
        with pytest.raises(UsageError, match="--max-train-samples must be a positive integer"):
            TrainConfig(max_train_samples=bad)
