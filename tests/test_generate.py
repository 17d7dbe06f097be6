"""`eaglewire generate` end to end on a tiny chat target saved as a model directory (char tokenizer,
ChatML template): streamed text equals the target's own greedy text; bad input is one line, exit 2."""

import argparse
import io
import json
import re

import pytest
import torch

from eaglewire import targets
from eaglewire.checkpoint import save_draft
from eaglewire.cli import main
from eaglewire.decode.generate import TextStream, draft_shape, encode
from eaglewire.draft import DraftConfig, Eagle3Draft
from eaglewire.taps import TapContract

CONTRACT = TapContract(8, (2, 4, 5))
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


pytestmark = pytest.mark.usefixtures("one_thread")


def char_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)])}
    vocab.update({f"<|unused{i}|>": i for i in range(len(vocab), 128)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))  # one token per character
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.chat_template = CHATML
    return fast


def save_target(path, seed=0, layers=8):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked distributions, like a trained model's
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


def save_random_draft(target_dir, out, contract=CONTRACT):
    t = targets.load_target(target_dir, device="cpu")
    torch.manual_seed(1)
    d = Eagle3Draft(DraftConfig.for_target(t.model.config, num_taps=3, draft_vocab_size=None))
    d.load_target_embedding(t.model.get_input_embeddings().weight)
    save_draft(d, out, contract=contract, target_fingerprint=t.fingerprint)
    return str(out)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    target = save_target(root / "target")
    return {"target": target, "draft": save_random_draft(target, root / "draft"), "root": root}


def reference_text(target_dir, ids, n):
    """The target's own greedy continuation (a full forward per token), decoded like the CLI does."""
    t = targets.load_target(target_dir, device="cpu")
    ids = ids.tolist()
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(t.model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == 2:  # <|im_end|>
                break
    return t.tokenizer.decode(out, skip_special_tokens=True)


def run(capsys, *argv):
    try:
        rc = main(["generate", *map(str, argv)])
    except SystemExit as e:  # refused as the command line is parsed
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_generate_streams_the_targets_greedy_text(env, capsys):
    tok = char_tokenizer()
    ids = encode(tok, prompt="hello there")
    want = reference_text(env["target"], ids, 40)
    for extra in ([], ["--tree", "--depth", 3, "--topk", 3, "--budget", 8], ["--chain", 2], ["--no-spec"],
                  ["--no-prepack"]):
        rc, out, err = run(capsys, "--target", env["target"], "--draft", env["draft"], "--prompt", "hello there",
                           "--max-new-tokens", 40, *extra)
        assert rc == 0, err
        assert out == want + "\n", extra
        assert ("no speculation" in err) if extra == ["--no-spec"] else ("acceptance length" in err), err
        assert "compiling included" not in err
        if not extra:  # the shape a CPU gets when none is given (decode.DEFAULT_SHAPES)
            assert err.rstrip().endswith("(chain K=2)"), err


def test_default_shape_follows_the_device():
    """No shape flags: a chain of 7 on CUDA, 2 on a CPU; a tree takes what is not given from the device's
    defaults; given values are kept. Resolved from the device's type alone, so CUDA's is checked here too."""
    def args(**kw):
        return argparse.Namespace(**{"tree": False, "chain": None, "depth": None, "topk": None, "budget": None, **kw})

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
    assert draft_shape(args(), cuda) == {"mode": "chain", "K": 7}
    assert draft_shape(args(), cpu) == {"mode": "chain", "K": 2}
    assert draft_shape(args(chain=5), cpu) == {"mode": "chain", "K": 5}
    assert draft_shape(args(tree=True), cuda) == {"mode": "tree", "depth": 6, "topk": 8, "budget": 63}
    assert draft_shape(args(tree=True, topk=2), cpu) == {"mode": "tree", "depth": 4, "topk": 2, "budget": 8}


def test_compile_flag(env, capsys):
    """--compile (static shapes and torch.compile on a CPU): the same greedy text."""
    want = reference_text(env["target"], encode(char_tokenizer(), prompt="hi"), 12)
    rc, out, err = run(capsys, "--target", env["target"], "--draft", env["draft"], "--prompt", "hi",
                       "--max-new-tokens", 12, "--chain", 2, "--compile")
    assert rc == 0 and out == want + "\n", err
    assert "tok/s (compiling included)" in err, err  # a first run's speed, not the compiled decoder's


def test_messages_file_and_raw_prompt(env, capsys, tmp_path):
    msgs = tmp_path / "conv.json"
    msgs.write_text(json.dumps([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))
    tok = char_tokenizer()
    ids = encode(tok, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert tok.decode(ids).startswith("<|im_start|>system\nbe brief<|im_end|>")
    rc, out, err = run(capsys, "--target", env["target"], "--draft", env["draft"], "--messages", msgs,
                       "--max-new-tokens", 20)
    assert rc == 0 and out == reference_text(env["target"], ids, 20) + "\n", err
    share = tmp_path / "share.jsonl"  # any prompt file: its first conversation
    share.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    rc, out2, _ = run(capsys, "--target", env["target"], "--draft", env["draft"], "--messages", share,
                      "--max-new-tokens", 20)
    assert rc == 0 and out2 == reference_text(env["target"], encode(tok, prompt="hi"), 20) + "\n"
    rc, out3, _ = run(capsys, "--target", env["target"], "--draft", env["draft"], "--prompt", "abc", "--raw",
                      "--max-new-tokens", 10)
    assert rc == 0 and out3 == reference_text(env["target"], torch.tensor(tok("abc").input_ids), 10) + "\n"


def test_sampling_is_reproducible_with_a_seed(env, capsys):
    args = ("--target", env["target"], "--draft", env["draft"], "--prompt", "xyz", "--max-new-tokens", 30,
            "--temperature", 0.9, "--top-p", 0.95, "--seed", 3)
    a, b = run(capsys, *args), run(capsys, *args)
    assert a[0] == b[0] == 0 and a[1] == b[1]


def test_text_stream_writes_as_tokens_arrive():
    tok, buf = char_tokenizer(), io.StringIO()
    s = TextStream(tok, buf)
    ids = tok("stream me").input_ids
    seen = []
    for i in range(0, len(ids), 3):
        s(ids[i:i + 3])
        seen.append(buf.getvalue())
    s.close()
    assert buf.getvalue() == "stream me\n" and seen[0] == "str" and len(set(seen)) == len(seen)


@pytest.mark.parametrize("argv, msg", [
    (["--prompt", "hi"], "--draft CKPT is required"),
    (["--draft", "D", "--prompt", "hi", "--depth", "3"], "--depth shape a tree: add --tree"),
    (["--draft", "D", "--prompt", "   "], "--prompt is empty"),
    (["--draft", "D", "--prompt", "hi", "--max-new-tokens", 90], "exceeds the target's context of 96"),
    (["--draft", "D", "--prompt", "hi", "--chain", 0], "argument --chain: invalid value '0': must be an integer >= 1"),
    (["--draft", "D", "--prompt", "hi", "--temperature", -1], "argument --temperature: invalid value '-1': must be a number >= 0"),
    (["--draft", "D", "--prompt", "hi", "--device", "cuda"] if not torch.cuda.is_available() else
     ["--draft", "D", "--prompt", "hi", "--chain", -1], "CUDA is not available|argument --chain: invalid value '-1'"),
    (["--draft", "D", "--prompt", "hi", "--device", "gpu"], "--device gpu: not a device torch knows"),
])
def test_bad_input_is_one_line(env, capsys, argv, msg):
    argv = [env["draft"] if a == "D" else a for a in argv]
    rc, out, err = run(capsys, "--target", env["target"], *argv)
    errors = [line for line in err.splitlines() if line.startswith("eaglewire generate: error: ")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert re.search(msg, errors[0]), err


def test_conversation_ending_with_the_assistant_is_refused(env, capsys, tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]))
    rc, _, err = run(capsys, "--target", env["target"], "--draft", env["draft"], "--messages", f)
    assert rc == 2 and "ends with an assistant turn" in err


def test_draft_for_another_target(env, capsys):
    root = env["root"]
    six = save_target(root / "six", layers=6)
    rc, _, err = run(capsys, "--target", six, "--draft", env["draft"], "--prompt", "hi")
    assert rc == 2 and "8-layer target" in err and "has 6 layers" in err
    # same architecture and tokenizer, other weights: a warning line, an error with --strict
    other = save_target(root / "other", seed=9)
    rc, out, err = run(capsys, "--target", other, "--draft", env["draft"], "--prompt", "hi", "--max-new-tokens", 5)
    assert rc == 0 and "eaglewire generate: warning:" in err and "weights_hash" in err
    rc, _, err = run(capsys, "--target", other, "--draft", env["draft"], "--prompt", "hi", "--strict")
    assert rc == 2 and "strict" in err
