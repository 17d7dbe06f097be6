"""`eaglewire datagen` on tiny random targets (SmolLM2's real tokenizer and ChatML template)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from eaglewire import cli, targets
from eaglewire.capture import capture
from eaglewire.chat import encode_conversation
from eaglewire.data import datagen
from eaglewire.data.datagen import GenConfig, generate_batched, plan_batches, regenerate, run_datagen
from eaglewire.data.shards import open_dataset, read_manifest
from eaglewire.errors import EaglewireError
from eaglewire.prompts import load_conversations
from eaglewire.taps import TapContract

CONTRACT = TapContract(4, (1, 2, 4))


pytestmark = pytest.mark.usefixtures("one_thread")


def make_target(root, family):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(LlamaConfig(**common)) if family == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    path = root / family
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(targets.prepare("smollm2-135m").path).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("targets"), "llama")


@pytest.fixture(scope="module")
def llama(llama_dir):
    return targets.load_target(str(llama_dir), device="cpu")


def sharegpt_file(path, n, extra=()):
    with open(path, "w") as f:
        for i in range(n):
            reply = " ".join(["word"] * (i % 7 + 1))  # varied lengths, so batches need padding
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Question {i}?"},
                                                  {"from": "gpt", "value": f"Answer {i}: {reply}."}]}) + "\n")
        for line in extra:
            f.write(line + "\n")
    return path


def assert_matches_unbatched(target, ds, contract, atol=1e-5):
    """Every stored sample equals an unpadded single-sequence capture, and lm_head(final_hidden) = logits."""
    for i in range(len(ds)):
        item = ds[i]
        ids = item["input_ids"][None]
        ref = capture(target.model, ids, contract, final_norm=True, logits=True)
        assert torch.allclose(item["taps"].float(), ref.taps[0], atol=atol)
        assert torch.allclose(item["final_hidden"].float(), ref.final_hidden[0], atol=atol)
        assert torch.allclose(target.model.lm_head(item["final_hidden"].float()), ref.logits[0], atol=1e-4)


def test_capture_batched_equals_single_forwards(llama, tmp_path):
    p = sharegpt_file(tmp_path / "p.jsonl", 7, extra=["{broken", json.dumps({"conversations": [
        {"from": "human", "value": "unanswered"}]})])
    m = run_datagen(llama, p, tmp_path / "out", CONTRACT, batch_size=3, shard_size=4, dtype="fp32", progress=False)
    ds = open_dataset(tmp_path / "out", expect_fingerprint=llama.fingerprint, expect_contract=CONTRACT, verify="open")
    assert len(ds) == 7 and [s["samples"] for s in m["shards"]] == [4, 3]
    assert m["final_hidden"] == "post-norm" and m["target"] == llama.fingerprint
    assert m["prompts"]["skipped"] == {"malformed JSON": 1, "no assistant turn (pass --regen to have the target "
                                       "write the replies)": 1}
    assert m["prompts"]["file"] == "p.jsonl" and len(m["prompts_sha256"]) == 64
    convs = [json.loads(line)["conversations"] for line in p.read_text().splitlines()[:7]]
    for i, conv in enumerate(convs):
        msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in conv]
        ids, mask = encode_conversation(llama.tokenizer, msgs)
        assert torch.equal(ds[i]["input_ids"], ids) and torch.equal(ds[i]["loss_mask"], mask)
    assert_matches_unbatched(llama, ds, CONTRACT)
    assert m["counts"]["assistant_tokens"] == sum(int(ds[i]["loss_mask"].sum()) for i in range(7))


def test_qwen2_family(tmp_path):
    qwen = targets.load_target(str(make_target(tmp_path, "qwen2")), device="cpu")
    p = sharegpt_file(tmp_path / "p.jsonl", 5)
    contract = TapContract(4, (0, 2, 3))
    run_datagen(qwen, p, tmp_path / "out", contract, batch_size=2, dtype="fp32", progress=False)
    ds = open_dataset(tmp_path / "out", expect_contract=contract)
    assert read_manifest(tmp_path / "out")["target"]["model_type"] == "qwen2"
    assert_matches_unbatched(qwen, ds, contract)


def test_regeneration_is_batched_left_padded_and_turn_by_turn(llama):
    convs = [[{"role": "user", "content": "Hi"}, {"role": "user", "content": "And then?"}],  # MT-bench style
             [{"role": "user", "content": "A much longer question, with many more words in it than the others."},
              {"role": "assistant", "content": "the file's reply, to be replaced"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
    gen = GenConfig(max_new_tokens=5, batch_size=3)
    out = regenerate(llama, convs, gen, max_len=256)
    one_by_one = regenerate(llama, convs, GenConfig(max_new_tokens=5, batch_size=1), max_len=256)
    assert out == one_by_one  # left padding changes nothing
    assert [[m["role"] for m in c] for c in out] == [["user", "assistant", "user", "assistant"],
                                                     ["user", "assistant"], ["system", "user", "assistant"]]
    assert out[1][1]["content"] != "the file's reply, to be replaced"
    # turn 2 is generated after the target's own turn-1 reply
    prompt = llama.tokenizer.apply_chat_template(out[0][:3], tokenize=True, add_generation_prompt=True,
                                                 return_dict=True)["input_ids"]
    assert generate_batched(llama, [prompt], gen) == [out[0][3]["content"]]
    # greedy replies are the model's argmax continuation, up to an end-of-turn token
    prompt = llama.tokenizer.apply_chat_template(out[2][:2], tokenize=True, add_generation_prompt=True,
                                                 return_dict=True)["input_ids"]
    ids = torch.tensor([prompt])
    for _ in range(5):
        nxt = llama.model(ids).logits[0, -1].argmax()
        if nxt == 2:
            break
        ids = torch.cat([ids, nxt.view(1, 1)], 1)
    assert llama.tokenizer.decode(ids[0, len(prompt):], skip_special_tokens=True).strip() == out[2][2]["content"]
    # a prompt that fills --max-len leaves nothing to reply to
    assert regenerate(llama, convs[1:2], gen, max_len=10)[0].reason == "prompt longer than --max-len"


def test_batches_keep_to_the_token_budget_and_static_shapes_repeat():
    lengths = [5, 300, 40, 700, 260, 12, 511, 900, 30, 1000, 257, 3]
    gen = GenConfig(max_new_tokens=100, batch_size=4, batch_tokens=2000)
    for static in (False, True):
        plan = plan_batches(lengths, gen, static)
        assert sorted(k for b in plan for k in b.prompts) == list(range(len(lengths)))  # each prompt once
        widths = [b.width for b in plan]
        assert widths == sorted(widths)  # length-sorted
        for b in plan:
            assert len(b.prompts) <= b.rows <= gen.batch_size
            assert max(lengths[k] for k in b.prompts) <= b.width
            assert b.rows == 1 or b.rows * (b.width + gen.max_new_tokens) <= gen.batch_tokens
        if static:  # widths on the compile grid, one row count per width: one decode shape per width
            assert all(w % datagen.STATIC_WIDTH_STEP == 0 for w in widths)
            assert len({(b.width, b.rows) for b in plan}) == len(set(widths))
        else:  # no padding beyond the longest prompt, no extra rows
            assert all(b.width == max(lengths[k] for k in b.prompts) and b.rows == len(b.prompts) for b in plan)
    # a prompt longer than the budget still gets a batch of its own
    assert [b.rows for b in plan_batches([5000], gen, True)] == [1]
    with pytest.raises(EaglewireError, match="--gen-batch-tokens"):
        GenConfig(max_new_tokens=100, batch_tokens=50)
    with pytest.raises(EaglewireError, match="--gen-cache"):
        GenConfig(cache="paged")


def test_static_cache_regeneration_matches_dynamic(llama, monkeypatch):
    """The GPU path (static cache, prompts padded to a width grid, filler rows) on a CPU: same replies."""
    monkeypatch.setattr(datagen, "STATIC_WIDTH_STEP", 16)
    convs = [[{"role": "user", "content": "Hi"}],
             [{"role": "user", "content": "A much longer question, with many more words in it than the others."}],
             [{"role": "user", "content": "Why is the sky blue?"}], [{"role": "user", "content": "Name a prime."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
    static = GenConfig(max_new_tokens=6, batch_size=2, batch_tokens=120, cache="static")
    lengths = [len(llama.tokenizer(llama.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                                   add_special_tokens=False)["input_ids"]) for c in convs]
    plan = plan_batches(lengths, static, True)
    assert any(b.rows > len(b.prompts) for b in plan) and len({b.width for b in plan}) > 1  # fillers, 2+ widths
    assert regenerate(llama, convs, static, max_len=256) == \
        regenerate(llama, convs, GenConfig(max_new_tokens=6, batch_size=1, cache="dynamic"), max_len=256)


@pytest.mark.parametrize("family,prefill_tokens", [("llama", None), ("qwen2", None), ("llama", 5)])
def test_slots_engine_regenerates_what_hf_generate_does(llama, tmp_path, monkeypatch, family, prefill_tokens):
    """batchgen.py (left-padded rows over a slot cache, grouped-query attention; CUDA graphs on a GPU)
    against transformers' generate, greedy, fp32: the same replies, filler rows and several widths; and with the
    prefill in slices of 2 columns (5 tokens over 2 rows), each attending to the slices before it."""
    monkeypatch.setattr(datagen, "STATIC_WIDTH_STEP", 16)
    if prefill_tokens is not None:
        monkeypatch.setattr(datagen.batchgen, "PREFILL_TOKENS", prefill_tokens)
    target = llama if family == "llama" else targets.load_target(str(make_target(tmp_path, family)), device="cpu")
    convs = [[{"role": "user", "content": "Hi"}],
             [{"role": "user", "content": "A much longer question, with many more words in it than the others."}],
             [{"role": "user", "content": "Why is the sky blue?"}], [{"role": "user", "content": "Name a prime."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
    slots = GenConfig(max_new_tokens=7, batch_size=2, batch_tokens=120, engine="slots")
    hf = GenConfig(max_new_tokens=7, batch_size=1, cache="dynamic")
    log = []
    assert regenerate(target, convs, slots, max_len=256, on_batch=log.append) == regenerate(target, convs, hf,
                                                                                            max_len=256)
    assert any(b["rows"] > b["prompts"] for b in log) and len({b["width"] for b in log}) > 1
    sampled = GenConfig(max_new_tokens=7, batch_size=2, temperature=1.0, engine="slots")
    torch.manual_seed(0)
    first = regenerate(target, convs, sampled, max_len=256)
    torch.manual_seed(0)
    assert regenerate(target, convs, sampled, max_len=256) == first  # seeded like generate


def test_slots_step_never_reads_the_device(llama):
    """The decode step is captured in a CUDA graph on a GPU: no host read-back inside (make_fx
    refuses `aten._local_scalar_dense`), checked here on a CPU with its inputs as tracing tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from eaglewire.data.batchgen import BatchGenerator

    gen = BatchGenerator(llama.model, rows=2, width=4, max_new=3, cuda_graphs=False)
    gen.prefill(torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]]), torch.tensor([1, 0]))
    keys = sorted(gen.inputs)

    def step(*values):
        saved = dict(gen.inputs)
        gen.inputs.update(zip(keys, values))
        try:
            return gen._step()
        finally:
            gen.inputs.update(saved)

    gen.inputs["at"].fill_(4)
    make_fx(step)(*[gen.inputs[k] for k in keys])


def test_regeneration_batches_fit_the_free_memory(llama, capsys):
    """The K/V a batch caches is what fills the GPU: kv_bytes_per_token must be what the slot cache really
    allocates a token, and a --gen-batch-tokens larger than KV_SHARE of the free memory holds is cut to it."""
    from eaglewire.data.batchgen import BatchGenerator

    gen = BatchGenerator(llama.model, rows=3, width=4, max_new=5, cuda_graphs=False)
    gen.prefill(torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11], [0, 0, 1, 2]]), torch.tensor([1, 0, 2]))
    cached = sum(layer.slots.keys.nbytes + layer.slots.values.nbytes for layer in gen.cache.layers)
    per_token = datagen.kv_bytes_per_token(llama.model)
    assert per_token == cached // (3 * (4 + 5)) and cached % (3 * 9) == 0

    asked = GenConfig(max_new_tokens=8, batch_size=64, batch_tokens=100_000)
    roomy = datagen.fit_to_memory(asked, llama.model, free_bytes=10**12)
    assert roomy is asked and capsys.readouterr().err == ""
    free = int(4000 * per_token / datagen.KV_SHARE) + 1  # room for 4,000 tokens of K/V
    cut = datagen.fit_to_memory(asked, llama.model, free_bytes=free)
    assert cut.batch_tokens == 4000 and "at most 4000 tokens" in capsys.readouterr().err
    assert max(b.rows * (b.width + 8) for b in datagen.plan_batches([30] * 500, cut, static=False)) <= 4000
    assert datagen.fit_to_memory(GenConfig(max_new_tokens=8), llama.model, free_bytes=free).batch_tokens == 4000


@pytest.mark.parametrize("family", ["mistral", "qwen3", "deepseek_v3", "gemma", "gpt2"])
def test_kv_bytes_per_token_is_what_each_familys_cache_holds(family):
    """generate's cache (regeneration off the slots engine) holds rows x tokens x the measure: grouped K/V, a
    head_dim of its own (Qwen3, Gemma), MLA's latent (DeepSeek-V3), GPT-2's own config names."""
    from transformers import DynamicCache

    from tiny import tiny_model

    model = tiny_model(family)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (2, 5)), use_cache=True, **{targets.cache_kwarg(model): cache})
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert held == 2 * 5 * datagen.kv_bytes_per_token(model)


def test_slots_engine_refuses_what_it_cannot_run(llama, monkeypatch):
    with pytest.raises(EaglewireError, match="--gen-engine must be auto, hf or slots"):
        GenConfig(engine="vllm")
    monkeypatch.setattr(datagen.batchgen, "SUPPORTED", {"qwen3"})  # as for a model outside the family list
    with pytest.raises(EaglewireError, match="this one is llama: use --gen-engine hf"):
        generate_batched(llama, [[1, 2, 3]], GenConfig(max_new_tokens=2, engine="slots"))


def test_auto_engine_is_slots_on_cuda_for_the_models_batchgen_runs(llama, monkeypatch):
    """Measured (benchmarks/results/2026-11-30-run11-slots-regeneration.md): slots regenerated 2.1x faster than
    generate on an H200 and 2.2x slower on a 2-core CPU; a model outside batchgen's families keeps generate."""
    auto, cuda = GenConfig(), torch.device("cuda")
    assert auto.engine == "auto" and auto.engine_for(llama.model, torch.device("cpu")) == "hf"
    assert auto.engine_for(llama.model, cuda) == "slots"
    assert GenConfig(engine="hf").engine_for(llama.model, cuda) == "hf"
    monkeypatch.setattr(datagen.batchgen, "SUPPORTED", {"qwen3"})
    assert auto.engine_for(llama.model, cuda) == "hf"


def test_the_target_writes_its_own_prompts(llama):
    """Magpie-style prompts: sampled after the template's user header (SmolLM2's ChatML with its
    default system prompt), cut at the end of the turn, distinct, at least MIN_PROMPT_WORDS words."""
    from eaglewire.chat import user_header

    header = user_header(llama.tokenizer)
    assert header.startswith("<|im_start|>system\n") and header.endswith("<|im_end|>\n<|im_start|>user\n")
    torch.manual_seed(0)
    written = datagen.self_prompts(llama, 12, GenConfig(max_new_tokens=12, temperature=1.0, batch_size=12))
    assert 0 < len(written) <= 12 and len(set(written)) == len(written)
    assert all(len(p.split()) >= datagen.MIN_PROMPT_WORDS and "<|im_end|>" not in p for p in written)
    with pytest.raises(EaglewireError, match="temperature > 0"):
        datagen.self_prompts(llama, 4, GenConfig(max_new_tokens=4))


def test_openers_start_the_prompts_and_the_target_writes_the_rest(llama, monkeypatch):
    """Prompt i opens with openers[i % len(openers)]: the opener ends the model's input, and its text
    joins the continuation as decoded (a leading space kept, no space invented)."""
    torch.manual_seed(0)
    gen = GenConfig(max_new_tokens=12, temperature=1.0, batch_size=12)
    written = datagen.self_prompts(llama, 12, gen, openers=("Write", "Solve"))
    assert written and all(p.startswith(("Write", "Solve")) for p in written)
    seen = []

    def fake(target, prompts_ids, gen, on_batch=None, strip=True):
        seen.extend(llama.tokenizer.decode(p)[-5:] for p in prompts_ids)
        assert not strip
        return [" a poem about rain", "r's block, the cure", "  "][:len(prompts_ids)]

    monkeypatch.setattr(datagen, "generate_batched", fake)
    assert datagen.self_prompts(llama, 3, gen, openers=("Write",)) == ["Write a poem about rain",
                                                                       "Writer's block, the cure"]
    assert seen == ["Write"] * 3


def test_user_header_needs_a_template_that_keeps_the_text(llama, monkeypatch):
    from eaglewire.chat import user_header

    class Upper:  # a template that rewrites what the user wrote
        def apply_chat_template(self, messages, **kw):
            return "".join(f"<{m['role']}>{m['content'].upper()}" for m in messages)

    with pytest.raises(EaglewireError, match="does not place a user message's text verbatim"):
        user_header(Upper())


def test_max_samples_grows_and_overlong_policies(llama, tmp_path):
    p = sharegpt_file(tmp_path / "p.jsonl", 8)
    m = run_datagen(llama, p, tmp_path / "out", CONTRACT, max_samples=3, shard_size=2, progress=False)
    assert m["counts"]["samples"] == 3 and m["progress"]["complete"]
    first = [open_dataset(tmp_path / "out")[i]["input_ids"] for i in range(3)]
    m = run_datagen(llama, p, tmp_path / "out", CONTRACT, max_samples=6, shard_size=2, progress=False)
    ds = open_dataset(tmp_path / "out")
    assert len(ds) == 6 and all(torch.equal(ds[i]["input_ids"], first[i]) for i in range(3))
    # samples are 42..48 tokens, the first reply token at 34: at 45 some are cut, at 34 no reply is left
    encoded = [encode_conversation(llama.tokenizer, c) for c in load_conversations(p).conversations]
    assert [ids.numel() for ids, _ in encoded] == [42, 43, 44, 45, 46, 47, 48, 42]
    assert {int(mask.nonzero()[0]) for _, mask in encoded} == {34}
    m = run_datagen(llama, p, tmp_path / "t", CONTRACT, max_len=45, progress=False)
    assert m["counts"]["truncated"] == 3 and open_dataset(tmp_path / "t").lengths() == [42, 43, 44, 45, 45, 45, 45, 42]
    m = run_datagen(llama, p, tmp_path / "s", CONTRACT, max_len=45, overlong="skip", progress=False)
    assert m["counts"]["skipped"] == {"longer than --max-len": 3} and m["counts"]["samples"] == 5
    with pytest.raises(EaglewireError, match="no usable sample.*no assistant token within --max-len"):
        run_datagen(llama, p, tmp_path / "none", CONTRACT, max_len=34, progress=False)


# The CLI's own main(), with only this command registered: other commands' modules play no part here.
ONLY_DATAGEN = {"datagen": "eaglewire.data.cli"}
CLI_SCRIPT = ("import sys; from eaglewire import cli; cli.COMMANDS = %r; sys.exit(cli.main(sys.argv[1:]))"
              % ONLY_DATAGEN)


@pytest.fixture(autouse=True)
def _restore_commands(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))


def run_cli(capsys, *argv):
    cli.COMMANDS = ONLY_DATAGEN
    rc = cli.main(["datagen", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_errors_are_one_line(llama_dir, tmp_path, capsys):
    good = sharegpt_file(tmp_path / "p.jsonl", 3)
    (tmp_path / "empty.jsonl").write_text("")
    questions = tmp_path / "questions.txt"
    questions.write_text("What is 2+2?\nName a colour.\n")
    bare = tmp_path / "no-template"
    shutil.copytree(llama_dir, bare)
    (bare / "chat_template.jinja").unlink()
    cases = [
        (["--target", llama_dir, "--prompts", tmp_path / "empty.jsonl"], 2, "is empty"),
        (["--target", llama_dir, "--prompts", tmp_path / "nope.jsonl"], 2, "no such file"),
        (["--target", llama_dir, "--prompts", good, "--taps", "1,2,9"], 2, "taps [9] out of range"),
        (["--target", bare, "--prompts", good, "--taps", "1,2,4"], 2, "has no chat template"),
        (["--target", llama_dir, "--prompts", good, "--max-len", "1"], 2, "--max-len must be >= 2"),
        (["--target", llama_dir, "--prompts", questions, "--taps", "1,2,4"], 2, "no assistant turn (pass --regen"),
    ]
    for argv, code, msg in cases:
        rc, out, err = run_cli(capsys, *argv, "--out", tmp_path / "out")
        errors = [line for line in err.splitlines() if "error" in line]
        assert rc == code and errors == [f"eaglewire datagen: error: {errors[0].split('error: ', 1)[1]}"], (argv, err)
        assert msg in errors[0] and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "out").exists()
    rc, out, err = run_cli(capsys, "--target", llama_dir, "--prompts", good, "--out", tmp_path / "out",
                           "--taps", "1,2,4")
    assert rc == 0 and "3 samples" in out
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    rc, out, err = run_cli(capsys, "--target", llama_dir, "--prompts", good, "--out", tmp_path / "out",
                           "--taps", "1,2,3")
    assert rc == 1 and "error: --out" in err and "already holds data made differently (contract.taps" in err
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before


def test_sigkill_mid_run_then_rerun_completes_without_duplicates(llama_dir, tmp_path, capsys):
    n = 60  # 30 shards of 2: the kill after the second one leaves most of the run to do
    p = sharegpt_file(tmp_path / "p.jsonl", n)
    argv = ["--target", llama_dir, "--prompts", p, "--taps", "1,2,4", "--shard-size", "2", "--batch-size", "2",
            "--regen", "--max-new-tokens", "4", "--gen-batch-size", "2", "--dtype", "fp32"]
    assert run_cli(capsys, *argv, "--out", tmp_path / "ref")[0] == 0  # an unbroken run, for comparison

    out = tmp_path / "out"
    with open(tmp_path / "stderr.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", CLI_SCRIPT, "datagen", *map(str, argv), "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if len(json.loads((out / "manifest.json").read_text())["shards"]) >= 2:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()[-2000:]
    m = read_manifest(out)
    assert not m["progress"]["complete"] and 2 <= len(m["shards"]) < n // 2
    assert len(open_dataset(out, verify="open", allow_incomplete=True)) == m["counts"]["samples"]

    rc, _, err = run_cli(capsys, *argv, "--out", out)
    assert rc == 0 and "resuming at conversation" in err
    got, ref = open_dataset(out, verify="open"), open_dataset(tmp_path / "ref", verify="open")
    spans = [s["sources"] for s in got.manifest["shards"]]
    assert spans == [[i, i + 2] for i in range(0, n, 2)]  # every conversation once, in order
    assert len(got) == len(ref) == n
    for i in range(n):
        a, b = got[i], ref[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.allclose(a["taps"], b["taps"], atol=1e-5)
    assert got.manifest["token_freqs"] == ref.manifest["token_freqs"]


def test_datagen_pools_several_prompt_files(llama, llama_dir, tmp_path, capsys):
    """`datagen --prompts a b`: the shards of the pooled files hold what one file of all their conversations gives,
    a conversation in both once; the file set is part of the data's identity, so a rerun with another set is
    refused rather than resumed."""
    whole = sharegpt_file(tmp_path / "whole.jsonl", 9)
    lines = whole.read_text().splitlines(keepends=True)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(lines[:6]))
    b.write_text("".join(lines[4:]))  # conversations 4 and 5 in both
    ref = run_datagen(llama, whole, tmp_path / "ref", CONTRACT, dtype="fp32", progress=False)
    rc, out, err = run_cli(capsys, "--target", llama_dir, "--prompts", a, b, "--out", tmp_path / "pool",
                           "--taps", ",".join(map(str, CONTRACT.taps)), "--target-dtype", "fp32", "--dtype", "fp32")
    m = read_manifest(tmp_path / "pool")
    assert rc == 0 and m["counts"]["samples"] == 9 and m["prompts"]["duplicates"] == 2, err
    assert [f["file"] for f in m["prompts"]["files"]] == ["a.jsonl", "b.jsonl"]
    pooled = open_dataset(tmp_path / "pool", expect_contract=CONTRACT)
    one = open_dataset(tmp_path / "ref", expect_contract=CONTRACT)
    assert ref["counts"]["samples"] == 9
    for i in range(9):
        assert torch.equal(pooled[i]["input_ids"], one[i]["input_ids"])
        assert torch.allclose(pooled[i]["taps"].float(), one[i]["taps"].float(), atol=1e-5)
    rc, out, err = run_cli(capsys, "--target", llama_dir, "--prompts", a, "--out", tmp_path / "pool",
                           "--taps", ",".join(map(str, CONTRACT.taps)), "--target-dtype", "fp32", "--dtype", "fp32")
    assert rc == 1 and "already holds data made differently (prompts_sha256" in err
