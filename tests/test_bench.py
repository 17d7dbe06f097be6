"""`eaglewire bench` on tiny CPU models: HF generate vs our decoder without and with a draft.

Two targets share a character-level ChatML tokenizer (99 tokens, vocab 128):
- `random`: a random Llama (attention and MLP live); its draft is random too (acceptance near 0),
  which makes the greedy equality check meaningful over real attention;
- `shift`: attention and MLP outputs zeroed, so the residual stream is the token embedding and
  lm_head makes greedy decoding a walk x -> x + 1 (mod 128). Its draft maps taps[t] = e(x_t) to
  x_t + 2 = x_{t+2}, exactly the token its first position must predict; fed its own hidden state
  again, it predicts x_t + 2 once more, wrong for position 2. So every verification step accepts
  exactly one draft token: acceptance rates (1, 0, 0) and acceptance length ~2, known in advance.
"""

import dataclasses
import json
import re

import pytest
import torch

from eaglewire import targets
from eaglewire.bench import run as bench
from eaglewire.bench.run import (BenchConfig, Generation, acceptance, first_divergence, greedy_check, run_bench,
                                 run_prompts)
from eaglewire.bench.report import format_table
from eaglewire.bench.shapes import format_shapes
from eaglewire.checkpoint import save_draft
from eaglewire.cli import main
from eaglewire.decode.speedups import Speedups
from eaglewire.draft import DraftConfig, Eagle3Draft
from eaglewire.errors import UsageError
from eaglewire.runtime import prepack
from eaglewire.runtime.sampling import SamplingParams
from eaglewire.taps import TapContract

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONTRACT = TapContract(4, (1, 2, 3))
V, H = 128, 32
PROMPTS = ["Name three colours.", "What is 2 + 2?", "Write a haiku about rain."]


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(32, 127)] + ["\n"]
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(chars)}, [], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def save_pair(root, model, draft):
    tok = tiny_tokenizer()
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    save_draft(draft, root / "draft", contract=CONTRACT, target_fingerprint=targets.fingerprint(model, tok))
    return str(root / "target"), str(root / "draft")


def new_draft(model, seed: int):
    torch.manual_seed(seed)
    d = Eagle3Draft(DraftConfig.for_target(model.config, num_taps=3, draft_vocab_size=None))
    d.load_target_embedding(model.model.embed_tokens.weight)
    return d.eval()


@torch.no_grad()
def shift_pair(seed: int = 0):
    """The `shift` target and its one-position-perfect draft (module docstring)."""
    model = tiny_llama(seed)
    e = model.model.embed_tokens.weight
    e.copy_(torch.nn.functional.normalize(torch.randn(V, H), dim=-1))  # also row pad_token_id, zero by default
    for layer in model.model.layers:  # residual stream = embedding everywhere
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.lm_head.weight.copy_(10 * e.roll(1, dims=0))  # row y = e(y - 1): argmax after x is x + 1
    draft = new_draft(model, seed)
    draft.fc.weight.zero_()
    draft.fc.weight[:, :H].copy_(torch.eye(H))  # hidden = tap 1 = e(x_t)
    for layer in draft.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    draft.lm_head.weight.copy_(10 * e.roll(2, dims=0))  # row y = e(y - 2): predicts x_t + 2
    return model, draft


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("suite") / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return str(f)


@pytest.fixture(scope="module")
def shift(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("shift"), *shift_pair())


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    model = tiny_llama(1)
    return save_pair(tmp_path_factory.mktemp("random"), model, new_draft(model, 2))


def test_shift_model_is_what_the_docstring_says():
    model, _ = shift_pair()
    ids = torch.arange(V)[:, None]  # each token alone
    assert torch.equal(model(ids).logits[:, -1].argmax(-1), (torch.arange(V) + 1) % V)


def test_bench_chain_json_table_plot(shift, prompt_file, tmp_path, capsys):
    target, draft = shift
    out, png = tmp_path / "bench.json", tmp_path / "acc.png"
    code = main(["bench", "--target", target, "--draft", draft, "--suite", prompt_file, "--max-new-tokens", "12",
                 "--chain", "3", "--device", "cpu", "--json", str(out), "--plot", str(png)])
    table = capsys.readouterr().out
    assert code == 0
    r = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "acceptance length" in table and "greedy check vs hf: OK" in table

    assert set(r["runs"]) == {"hf", "base", "spec"} and r["runs"]["hf"]["name"] == "hf-dynamic"
    assert r["suite"]["prompts"] == 3 and r["settings"]["dtype"] == "fp32"
    assert r["machine"]["torch"] == torch.__version__ and r["machine"]["date"]
    for k, run in r["runs"].items():
        assert run["tokens"] == sum(p[f"{k}_tokens"] for p in r["per_prompt"])
        assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["wall_s"])
    sp = r["speedups"]
    tps = {k: v["tokens_per_s"] for k, v in r["runs"].items()}
    assert sp["spec/base"] == pytest.approx(tps["spec"] / tps["base"]) and sp["base/hf"] == pytest.approx(
        tps["base"] / tps["hf"]) and sp["spec/hf"] == pytest.approx(tps["spec"] / tps["hf"])

    acc = r["acceptance"]
    assert acc["verification_steps"] == r["runs"]["spec"]["steps"]
    assert acc["acceptance_length"] == pytest.approx(r["runs"]["spec"]["tokens"] / acc["verification_steps"])
    assert acc["rate_by_position"] == [1.0, 0.0, 0.0]  # known in advance for the shift pair
    assert acc["mean_accepted_plus_bonus"] == 2.0 and 1.5 < acc["acceptance_length"] <= 2.5
    assert sum(acc["accepted_histogram"]) == acc["verification_steps"]
    g = r["greedy_check"]
    assert g["ok"] is True and g["mismatches"] == [] and g["compared"] == ["base", "spec"]
    assert r["settings"]["compile"] is False  # auto: off on cpu, where fp32 runs oneDNN-packed linears instead
    assert r["settings"]["autotune"] is None  # nothing compiled, nothing autotuned
    assert bench.autotuned(torch.device("cuda")) == {"target": True, "draft": False}  # as the decoder ships
    assert r["settings"]["prepack"] is True  # asked for; the tiny layers are too small to pack:
    assert r["settings"]["linears"] is None  # nor timed (prepack.choices: MKL or oneDNN for each packed shape)
    # "+onednn" names runs that did; "+fused": q/k/v and gate/up as one matmul each (small targets: default)
    assert r["runs"]["base"]["name"] == "eaglewire-base+fused"
    assert r["runs"]["spec"]["graphs_compiled_while_timed"] == 0


def test_default_shape_text_follow_the_device():
    """A shape left out is the device's (decode.DEFAULT_SHAPES): a chain of 2 and a d4 k3 b8 tree on a CPU;
    what is given is kept. The JSON's settings carry the resolved values."""
    cpu = BenchConfig(suite="s", device="cpu")
    assert (cpu.shape.K, cpu.shape.depth, cpu.shape.topk, cpu.shape.budget) == (2, 4, 3, 8)
    assert cpu.draft_shape() == {"mode": "chain", "K": 2}
    tree = BenchConfig(suite="s", device="cpu", shape=bench.shape_from("cpu", "tree", depth=2))
    assert tree.draft_shape() == {"mode": "tree", "depth": 2, "topk": 3, "budget": 8}
    with pytest.raises(UsageError, match="--chain must be >= 1"):
        BenchConfig(suite="s", device="cpu", shape=bench.shape_from("cpu", chain=0))
    with pytest.raises(UsageError, match="--device tpu: not a device torch knows"):
        BenchConfig(suite="s", device="tpu")


def test_compile_setting(monkeypatch):
    cfg = BenchConfig(suite="s")
    assert cfg.speedups is None and cfg.compiles(torch.device("cuda")) and not cfg.compiles(torch.device("cpu"))
    assert BenchConfig(suite="s", speedups=Speedups(compile=True)).compiles(torch.device("cpu"))
    assert not BenchConfig(suite="s", speedups=Speedups(compile=False)).compiles(torch.device("cuda"))
    with pytest.raises(UsageError, match="--compile must be auto, True or False"):
        BenchConfig(suite="s", speedups=bench.speedups_from("cpu", compile="yes"))
    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: seen.append(kw["speedups"].compile) or
                        (_ for _ in ()).throw(UsageError("stop")))
    # the command line resolves "auto" for the device it picks: on where CUDA is
    for flags, want in (([], torch.cuda.is_available()), (["--compile"], True), (["--no-compile"], False)):
        assert main(["bench", "--target", "t", "--draft", "d", *flags]) == 2
        assert seen[-1] == want, flags
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: seen.append(kw["speedups"].prepack is not False) or
                        (_ for _ in ()).throw(UsageError("stop")))
    for flags, want in (([], True), (["--no-prepack"], False)):
        assert main(["bench", "--target", "t", "--draft", "d", *flags]) == 2
        assert seen[-1] == want, flags
    monkeypatch.setattr(bench, "run_bench", lambda *a, **kw: seen.append(kw["speedups"].grouped_attention) or
                        (_ for _ in ()).throw(UsageError("stop")))
    for flags, want in (([], None), (["--grouped-attention"], True), (["--no-grouped-attention"], False)):
        assert main(["bench", "--target", "t", "--draft", "d", *flags]) == 2
        assert seen[-1] == want, flags


def test_bench_tree_on_random_pair_is_lossless(random_pair, prompt_file):
    target, draft = random_pair
    r = run_bench(target, draft, prompt_file, max_new_tokens=10, shape=bench.shape_from("cpu", "tree", depth=3, topk=2,
                  budget=5), device="cpu", log=lambda m: None)
    assert r["greedy_check"]["ok"] is True, r["greedy_check"]
    acc = r["acceptance"]
    assert len(acc["rate_by_position"]) == 3 and all(0 <= x <= 1 for x in acc["rate_by_position"])
    assert acc["acceptance_length"] == pytest.approx(r["runs"]["spec"]["tokens"] / acc["verification_steps"])
    assert r["runs"]["spec"]["name"] == "eaglewire-tree-d3-k2-b5+fused"
    apart = run_bench(target, draft, prompt_file, max_new_tokens=10, shape=bench.shape_from("cpu", "tree", depth=3,
                      topk=2, budget=5), device="cpu",
                      speedups=bench.speedups_from("cpu", fuse_projections=False, grouped_attention=True),
                      log=lambda m: None)  # --no-fuse-projections --grouped-attention (K/V heads read in place)
    assert apart["runs"]["spec"]["name"] == "eaglewire-tree-d3-k2-b5+grouped" and apart["greedy_check"]["ok"] is True
    assert apart["runs"]["spec"]["tokens"] == r["runs"]["spec"]["tokens"]


def test_no_hf_and_sampling(shift, prompt_file):
    target, draft = shift
    r = run_bench(target, draft, prompt_file, max_new_tokens=6, max_prompts=2, hf=False,
                  sampling=SamplingParams(temperature=0.7), shape=bench.shape_from("cpu", chain=2), device="cpu",
                  log=lambda m: None)
    assert set(r["runs"]) == {"base", "spec"} and r["greedy_check"] is None
    assert r["speedups"]["spec/hf"] is None and r["suite"]["prompts"] == 2


def test_acceptance_by_category_where_the_suite_has_them(shift, prompt_file, monkeypatch, tmp_path):
    """MT-bench's records carry a category (suites.py); the bench reports the acceptance length of each."""
    target, draft = shift
    load = bench.suites.load_suite

    def with_groups(spec, limit):
        return dataclasses.replace(load(spec, limit), groups=["writing", "math", "writing"])
    monkeypatch.setattr(bench.suites, "load_suite", with_groups)
    r = run_bench(target, draft, prompt_file, max_new_tokens=6, hf=False, shape=bench.shape_from("cpu", chain=2),
                  device="cpu", log=lambda m: None)
    pp = r["per_prompt"]
    assert [p["group"] for p in pp] == ["writing", "math", "writing"]
    want = {"writing": (pp[0]["spec_tokens"] + pp[2]["spec_tokens"]) / (pp[0]["spec_steps"] + pp[2]["spec_steps"]),
            "math": pp[1]["spec_tokens"] / pp[1]["spec_steps"]}
    assert r["acceptance_by_group"] == pytest.approx(want) and list(r["acceptance_by_group"]) == ["writing", "math"]
    assert "acceptance by category: writing " in format_table(r)
    png = bench.plot_acceptance(r, tmp_path / "acc.png").read_bytes()  # a second panel: the categories
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1260


def test_greedy_check_reports_divergence(random_pair, prompt_file):
    target = targets.load_target(random_pair[0], device="cpu")
    ids = torch.tensor([[1, 40, 41, 42]])
    ref = Generation(tokens=[5, 6, 7, 8], wall_s=1.0, steps=3)
    bad = Generation(tokens=[5, 6, 9, 8], wall_s=1.0, steps=3)
    short = Generation(tokens=[5, 6], wall_s=1.0, steps=1)
    r = greedy_check(target, [ids, ids], {"hf": [ref, ref], "spec": [bad, short]}, "hf", torch.float32)
    assert [(m["prompt"], m["position"], m["token"], m["ref_token"]) for m in r["mismatches"]] == [
        (0, 2, 9, 7), (1, 2, None, 7)]
    assert r["mismatches"][0]["top2_logit_gap"] > 0
    assert first_divergence([1, 2], [1, 2]) is None
    assert r["mismatches"][1]["top2_logit_gap"] > 0  # where the short run stopped: the reference went on
    # bf16: only reported, with the gap (small: rounding; large: a wiring bug), never called a tie
    soft = greedy_check(target, [ids], {"hf": [ref], "spec": [bad]}, "hf", torch.bfloat16)
    assert soft["ok"] is None and soft["mismatches"][0]["top2_logit_gap"] == r["mismatches"][0]["top2_logit_gap"]
    assert not soft["mismatches"][0]["tie"]


def test_a_report_in_bf16_says_its_acceptance_is_on_its_own_text(shift, prompt_file):
    """Outside fp32 the speculative text may part from the plain one at a near-tie (benchmarks/results run 23: 70 of
    80 prompts in bf16 on an H200); the report says on how many, so that two dtypes' figures are read as two texts."""
    target, draft = shift
    r = run_bench(target, draft, prompt_file, max_new_tokens=6, hf=False, shape=bench.shape_from("cpu", chain=2),
                  device="cpu", log=lambda m: None)
    assert "parts from" not in format_table(r)  # fp32: every token the plain decoder's
    r["settings"]["dtype"] = "bf16"
    r["greedy_check"] = {"reference": "base", "strict": False, "compared": ["spec"], "ok": None, "mismatches": [
        {"run": "spec", "prompt": p, "position": 3, "top2_logit_gap": 0.0, "tie": False, "ref_token": 5, "token": 6}
        for p in (0, 2)]}
    assert f"in bf16 the speculative text parts from the plain decoder's on 2 of {len(r['per_prompt'])} prompts" \
        in format_table(r)


def test_acceptance_rates_by_position():
    gens = [Generation(tokens=[0] * 9, wall_s=1.0, steps=4, accepted=[3, 1, 0, 2]),
            Generation(tokens=[0] * 3, wall_s=1.0, steps=1, accepted=[1])]
    a = acceptance(gens, 3)
    assert a["rate_by_position"] == [0.8, 0.4, 0.2]
    assert a["conditional_rate_by_position"] == [0.8, 0.5, 0.5]
    assert a["acceptance_length"] == 12 / 5 and a["accepted_histogram"] == [1, 2, 1, 1]
    # two prompts at 9/4 and 3/1: resampling prompts gives 2.25 (the first twice), 2.4 or 3 (the second twice)
    lo, hi = a["acceptance_length_interval"]
    assert lo == pytest.approx(9 / 4) and hi == pytest.approx(3.0)
    assert acceptance(gens[:1], 3)["acceptance_length_interval"] is None  # one prompt: no spread to measure


def test_the_acceptance_interval_is_the_bootstrap_over_prompts():
    """A reply that loops is accepted at every position: positions within a prompt are not independent, so the
    interval comes from resampling prompts (stats.py). Ten prompts alike give no spread; one outlier widens it."""
    same = [Generation(tokens=[0] * 10, wall_s=1.0, steps=4, accepted=[1, 2, 1, 2]) for _ in range(10)]
    lo, hi = acceptance(same, 3)["acceptance_length_interval"]
    assert lo == pytest.approx(2.5) and hi == pytest.approx(2.5)
    loop = same[:9] + [Generation(tokens=[0] * 40, wall_s=1.0, steps=5, accepted=[7] * 5)]
    a = acceptance(loop, 7)
    lo, hi = a["acceptance_length_interval"]
    assert lo < a["acceptance_length"] < hi and hi - lo > 0.5


def test_bad_inputs_are_one_line_errors(shift, random_pair, prompt_file, tmp_path, capsys):
    target, draft = shift
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    other = tiny_llama(3)
    big = tmp_path / "wide"
    other.config.hidden_size = 48
    from transformers import LlamaForCausalLM
    wide = LlamaForCausalLM(other.config)
    wide.save_pretrained(big)
    tiny_tokenizer().save_pretrained(big)
    capsys.readouterr()
    cases = [
        (["--suite", str(empty)], "the file is empty"),
        (["--suite", "mt-bench-9"], "not a suite"),
        (["--suite", prompt_file, "--target", str(big)], "target_hidden_size is 32 but target"),
        (["--suite", prompt_file, "--max-new-tokens", "250"], "context of 256"),
        (["--suite", prompt_file, "--tree", "--chain", "3"], "exclude each other"),
        (["--suite", prompt_file, "--shapes", "chain:3,tree:2x2"], "'tree:2x2' is neither chain:K nor tree:"),
        (["--suite", prompt_file, "--shapes", "chain:3,chain:3"], "chain:3 is listed twice"),
        (["--suite", prompt_file, "--shapes", "chain:0"], "--shapes: chain:0 holds a 0"),
        (["--suite", prompt_file, "--shapes", "chain:3,tree:2x0x4"], "--shapes: tree:2x0x4 holds a 0"),
        (["--suite", prompt_file, "--shapes", "chain:3", "--chain", "3"], "leave out --chain and --tree"),
    ]
    for extra, msg in cases:
        args = ["bench", "--target", target, "--draft", draft, "--device", "cpu", "--max-new-tokens", "4"] + extra
        assert main(args) == 2, extra
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("eaglewire bench")]  # not progress bars
        assert "Traceback" not in err and len(lines) == 1 and msg in lines[0], (extra, err)
        assert lines[0].startswith("eaglewire bench: error: ")


def test_bench_shapes_times_each_shape_in_turn_with_the_run_without_a_draft(shift, prompt_file, tmp_path, capsys,
                                                                            monkeypatch):
    """`bench --shapes`: HF and the base decoder once, then each shape; every row named in SGLang's and vLLM's
    words (interop/serve.py: SGLang counts the verified root among its draft tokens, and forces steps + 1 on
    a chain), the fastest named with its export command. The shift pair accepts exactly one draft token a
    step, whatever the chain's length. Its layers packed, each shape's linears are timed at its verify's rows."""
    monkeypatch.setattr(prepack, "MIN_WEIGHTS", 0)  # the tiny layers are below the size that pays
    target, draft = shift
    out, png = tmp_path / "shapes.json", tmp_path / "shapes.png"
    code = main(["bench", "--target", target, "--draft", draft, "--suite", prompt_file, "--max-new-tokens", "12",
                 "--device", "cpu", "--shapes", "chain:1, chain:3,tree:2x2x3", "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr()
    table = printed.out
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = json.loads(out.read_text())
    assert set(r["runs"]) == {"hf", "base"} and r["base_check"]["ok"] is True
    # ours without a draft: warmed once, timed in the first pass and again in turn with each of the 3 shapes
    base_lines = [line for line in printed.err.splitlines() if line.startswith("eaglewire bench: base (eaglewire-base")]
    assert len(base_lines) == 6 and sum(line.endswith("warm-up") for line in base_lines) == 1
    assert re.search(r": warmed up in \d+\.\d s$", base_lines[1])  # where a GPU's minutes of compilation go
    assert [row["shape"] for row in r["shapes"]] == ["chain 1", "chain 3", "tree d2 k2 b3"]
    chain1, chain3, tree = r["shapes"]
    assert chain1["acceptance"]["rate_by_position"] == [1.0] and chain3["acceptance"]["rate_by_position"] == [1, 0, 0]
    assert tree["acceptance"]["rate_by_position"][0] == 1.0
    assert chain3["engines"] == {"sglang": {"num_steps": 3, "topk": 1, "draft_tokens": 4},
                                 "vllm": {"num_speculative_tokens": 3}}
    assert tree["engines"] == {"sglang": {"num_steps": 2, "topk": 2, "draft_tokens": 4}, "vllm": None}
    for row in r["shapes"]:
        assert row["greedy_check"]["ok"] is True and row["greedy_check"]["compared"] == ["spec"]
        assert row["spec/base"] == pytest.approx(row["tokens_per_s"] / row["base_tokens_per_s"])
        assert row["spec/hf"] == pytest.approx(row["spec/base"] * r["runs"]["base"]["tokens_per_s"]
                                               / r["runs"]["hf"]["tokens_per_s"])
    fastest = max(r["shapes"], key=lambda row: row["spec/base"])
    assert r["fastest"] == fastest["shape"] and f"fastest here: {fastest['shape']}," in table
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in table
    a = fastest["engines"]["sglang"]
    assert (f"--format sglang --num-steps {a['num_steps']} --topk {a['topk']} --draft-tokens {a['draft_tokens']}"
            in table)
    assert r["settings"]["draft"][2] == {"mode": "tree", "depth": 2, "topk": 2, "budget": 3}
    rows_timed = [{n for v in linears.values() for n in re.findall(r"at (\d+)", v)}
                  for linears in [r["settings"]["linears"]] + [row["linears"] for row in r["shapes"]]]
    assert rows_timed == [{"1", "8"}, {"1", "2", "8"}, {"1", "4", "8"}, {"1", "2", "3", "4", "8"}]
    assert "judged in fp32 only" not in table
    for check in [r["base_check"]] + [row["greedy_check"] for row in r["shapes"]]:  # as a bf16 run reports them
        check.update(ok=None, mismatches=[{"run": "spec", "prompt": 0, "position": 3}])
    r["settings"]["dtype"] = "bf16"
    bf16 = format_shapes(r)
    assert "differs" in bf16 and "greedy: in bf16 a run may differ from hf where kernels round differently" in bf16


def test_shapes_that_sglang_cannot_express():
    from eaglewire.bench.shapes import engine_shapes

    # SGLang verifies at most topk + (steps - 1) x topk^2 draft tokens (interop/serve.py, SpecArgs)
    def tree(depth, topk, budget):
        return BenchConfig(suite="s", shape=bench.shape_from(None, "tree", depth=depth, topk=topk, budget=budget))
    assert engine_shapes(tree(2, 2, 7))["sglang"] is None
    assert engine_shapes(tree(6, 8, 63))["sglang"] == \
        {"num_steps": 6, "topk": 8, "draft_tokens": 64}


def test_runs_are_timed_prompt_by_prompt_in_turn_after_every_warm_up(monkeypatch):
    # Interleaved, so that a slow spell of the machine lands on HF and on ours alike (the ratio is the figure).
    calls = []

    def recorder(key):
        def run(ids, max_new, seed=0):
            calls.append((key, ids.shape[1], max_new, seed))
            return Generation(tokens=[1] * max_new, wall_s=0.5, steps=max_new - 1)
        return run

    prompts = [torch.zeros(1, n, dtype=torch.long) for n in (3, 5)]
    cfg = BenchConfig(suite="x", max_new_tokens=16, seed=7)
    logs = []
    gens = run_prompts({"hf": ("hf (h)", recorder("hf")), "base": ("base (b)", recorder("base"))}, prompts, cfg,
                       torch.device("cpu"), logs.append)
    warm = [("hf", 5, 8, 7), ("hf", 3, 2, 7), ("hf", 5, 2, 7), ("base", 5, 8, 7), ("base", 3, 2, 7), ("base", 5, 2, 7)]
    timed = [("hf", 3, 16, 7), ("base", 3, 16, 7), ("hf", 5, 16, 8), ("base", 5, 16, 8)]
    assert calls == warm + timed
    assert [len(g) for g in gens.values()] == [2, 2] and list(gens) == ["hf", "base"]
    assert logs[-2:] == ["eaglewire bench: hf (h): 2 prompts, 32 tokens in 1.00 s",
                         "eaglewire bench: base (b): 2 prompts, 32 tokens in 1.00 s"]
    assert not any("timed" in m for m in logs)  # quick runs: no progress lines
    monkeypatch.setattr(bench, "PROGRESS_EVERY_S", -1.0)
    logs.clear()
    run_prompts({"hf": ("hf (h)", recorder("hf"))}, prompts, dataclasses.replace(cfg, warmup=False),
                torch.device("cpu"), logs.append)
    assert logs[0] == "eaglewire bench: timed 1 of 2 prompts" and len(logs) == 2  # none after the last prompt


@pytest.mark.parametrize("shape", [("chain", {"chain": 2}), ("tree", {"depth": 3, "topk": 2, "budget": 5})])
def test_a_bench_warmed_with_one_draft_times_another_as_if_built_for_it(shift, tmp_path, prompt_file, shape,
                                                                       monkeypatch):
    """A recipe warms its held-out bench before training (its compile then counts before the training budget is
    set) and times it with the trained weights copied in. Warmed on a random draft that accepts almost nothing,
    then given the shift draft, the bench must decode exactly as one built for the shift draft: the fused
    projections and the oneDNN-packed layers (both derived from the draft's weights) derived again."""
    from eaglewire.checkpoint import load_draft

    monkeypatch.setattr(prepack, "MIN_WEIGHTS", 0)  # the tiny layers are below the size that pays
    target, _ = shift
    model, draft = shift_pair()
    with torch.no_grad():  # attention and MLP live, so that every fused and packed weight changes what it drafts
        torch.manual_seed(3)
        for layer in draft.layers:
            for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
                w.copy_(0.2 * torch.randn_like(w))
    trained, untrained = str(tmp_path / "trained"), tmp_path / "untrained"
    fingerprint = targets.fingerprint(model, tiny_tokenizer())
    save_draft(draft, trained, contract=CONTRACT, target_fingerprint=fingerprint)
    save_draft(new_draft(model, 5), untrained, contract=CONTRACT, target_fingerprint=fingerprint)
    settings = dict(max_new_tokens=8, hf=False, shape=bench.shape_from("cpu", shape[0], **shape[1]), device="cpu",
                    speedups=bench.speedups_from("cpu", prepack=True), log=lambda m: None)
    warm = bench.warm(target, str(untrained), prompt_file, **settings)
    assert warm.runners["spec"][0].endswith("+onednn+fused") and warm.warmup_s > 0 and warm.estimate_s() > 0
    before = warm.run()["acceptance"]["acceptance_length"]
    after = warm.run(trained)
    fresh = run_bench(target, trained, prompt_file, **settings)
    assert after["per_prompt"] == [{**p, "base_wall_s": q["base_wall_s"], "spec_wall_s": q["spec_wall_s"]}
                                   for p, q in zip(fresh["per_prompt"], after["per_prompt"])]
    assert after["acceptance"] == fresh["acceptance"] and after["greedy_check"]["ok"] is True
    assert before < 1.5 < after["acceptance"]["acceptance_length"]  # the trained weights really ran
    assert after["draft"]["path"] == str(load_draft(trained)[1].path)
    with pytest.raises(UsageError, match="config differs"):
        other = Eagle3Draft(dataclasses.replace(load_draft(trained)[0].config, intermediate_size=16))
        warm.runners["spec"][2].load_draft_weights(other, load_draft(trained)[1])
