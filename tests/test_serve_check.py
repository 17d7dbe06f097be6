"""serve-check on the CPU: the real vLLM replaced at its one boundary (engines.vllm.run_job) by an engine that
serves the directory it is given with eaglewire's own decoder, reading the tap ids as vLLM does (top level,
id j = tap j). Everything else is real: export, import, the tiny chat target, the suite file, the comparison.
vLLM's own objects are faked only where their readers are checked (counters, logprobs, the log line)."""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import doctor_fixtures as fx
import pytest
import torch
from chat_target import char_tokenizer
from decoding import fit, new_draft
from safetensors.torch import load_file, save_file

from eaglewire import checkpoint, interop
from eaglewire.bench import run as bench
from eaglewire.capture import locate
from eaglewire.cli import main as cli_main
from eaglewire.data.suites import encode_prompt
from eaglewire.engines import serve_check as sc
from eaglewire.engines import serve_report
from eaglewire.engines import sglang as sglang_engine
from eaglewire.engines import vllm as engine
from eaglewire.errors import UsageError
from eaglewire.taps import TapContract

pytestmark = pytest.mark.usefixtures("one_thread")
TAPS = (2, 4, 5)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A chat target whose per-token layers make each tap a different function of the token (doctor_fixtures),
    a draft fitted to read taps [2, 4, 5] of it, and a four-prompt suite file."""
    d = tmp_path_factory.mktemp("serve")
    model = fx.probe_target()
    model.save_pretrained(d / "target")
    char_tokenizer().save_pretrained(d / "target")
    target = fx.as_target(model)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (48,), generator=g) for _ in range(16)]
    draft = fit(new_draft(model, TapContract(8, TAPS)), model, TapContract(8, TAPS), seqs, steps=300)
    checkpoint.save_draft(draft, d / "ck", contract=TapContract(8, TAPS), target_fingerprint=target.fingerprint)
    (d / "suite.txt").write_text("say hello\nname three colours\ncount to five\nspell water\n")
    return d


class FakeVllm:
    """run_job's stand-in: greedy, batch 1, the served directory read as vLLM reads it, our decoder doing the
    work. `lose` takes that many accepted tokens off every verification step that accepted some. `reround`
    scales the target's final norm by 1 + reround * noise: its head picks other tokens at some positions, as another
    kernel's rounding does, while every tap the draft reads stays as it was."""

    def __init__(self, world, lose: int = 0, flip: dict | None = None, reround: float = 0.0):
        self.world, self.lose, self.flip, self.reround, self.jobs = world, lose, flip or {}, reround, []

    def __call__(self, job, log_path=None):
        self.jobs.append(job)
        w = self.world
        cfg = bench.BenchConfig(suite=str(w / "suite.txt"), max_new_tokens=job.max_new_tokens,
                                shape=bench.shape_from("cpu", chain=job.num_speculative_tokens), hf=False, device="cpu",
                                warmup=False)
        ids = None
        if job.draft is None:
            native = w / "ck"
        else:  # vLLM reads the top-level ids, id j = tap j
            ids = json.loads((Path(job.draft) / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
            native = w / f"as-served-{'-'.join(map(str, ids))}"
            if not native.exists():
                # vLLM 0.26.0 feeds the last layer's output at id 0 (interfaces.py _maybe_add_hidden_state keeps the
                # embedding tensor, which layernorm.py's in-place fused add-RMSNorm overwrites): the draft is served
                # as such, its fc slots reordered so that the taps it reads can be written in increasing order
                fed = [8 if i == 0 else i for i in ids]
                order = sorted(range(len(fed)), key=fed.__getitem__)
                served = Path(job.draft).with_name(Path(job.draft).name + "-as-fed")
                served.mkdir(exist_ok=True)
                tensors = load_file(str(Path(job.draft) / "model.safetensors"))
                H = tensors["fc.weight"].shape[1] // len(fed)
                tensors["fc.weight"] = torch.cat([tensors["fc.weight"][:, k * H:(k + 1) * H] for k in order], 1)
                save_file(tensors, str(served / "model.safetensors"))
                conf = json.loads((Path(job.draft) / "config.json").read_text())
                conf["eagle_aux_hidden_state_layer_ids"] = sorted(fed)
                (served / "config.json").write_text(json.dumps(conf))
                interop.import_draft(served, native, target=str(w / "target"))
        _, _, _, t, draft, meta, _, eos = bench.prepare(str(w / "target"), str(native), cfg)
        if self.reround:
            norm = locate(t.model).norm.weight
            with torch.no_grad():
                norm.mul_(1 + self.reround * torch.randn(norm.shape, generator=torch.Generator().manual_seed(0)))
        prompts = [encode_prompt(t.tokenizer, c) for c in job.conversations]
        _, run, _ = bench.decoder_runner(t, draft, meta, cfg, torch.device("cpu"), eos, speculate=job.draft is not None)
        out = []
        for i, p in enumerate(prompts):
            gen = run(p, job.max_new_tokens)
            acc = [max(0, a - self.lose) if a else 0 for a in (gen.accepted or [])]
            tokens = list(gen.tokens)
            if job.draft is not None and i in self.flip:
                tokens[self.flip[i][0]] = (tokens[self.flip[i][0]] + 1) % 128
            out.append({"prompt_tokens": int(p.shape[1]), "tokens": tokens, "seconds": gen.wall_s,
                        "counters": {"drafts": len(acc), "draft_tokens": len(acc) * job.num_speculative_tokens,
                                     "accepted": sum(acc),
                                     "accepted_per_pos": [sum(a > k for a in acc) for k in range(job.num_speculative_tokens)]},
                        "gaps": [self.flip.get(i, (0, 5.0))[1]] * len(tokens) if job.logprobs else None})
        return {"vllm_version": "fake", "prompts": out,
                "aux_layers": {"from": "config", "ids": ids} if ids is not None else None, "log_tail": []}


def _check(world, monkeypatch, fake, **kw):
    import tempfile

    monkeypatch.setattr(engine, "run_job", fake)
    monkeypatch.setattr(engine, "require", lambda: None)
    return sc.serve_check(world / "ck", str(world / "target"), suite=str(world / "suite.txt"), max_prompts=4,
                          max_new_tokens=24, chain=4, device="cpu", log=lambda m: None,
                          work=tempfile.mkdtemp(dir=world), **kw)


def test_a_faithful_engine_agrees_and_its_greedy_tokens_are_the_targets(world, monkeypatch):
    fake = FakeVllm(world)
    r = _check(world, monkeypatch, fake)
    assert r["ok"], sc.render(r)
    assert r["ours"]["acceptance_length"] == pytest.approx(r["vllm"]["acceptance_length"])
    assert r["ours"]["acceptance_length"] > 1.2  # the draft accepts: a comparison with something in it
    assert r["greedy"]["identical"] == 4 and r["engine_aux_layers"] == {"from": "config", "taps": list(TAPS)}
    # on the engine's text the replay counts what the engine counted, each prompt's last round too: it runs on past
    # the text's end, where the engine (vLLM, SGLang and our decoder alike) counts before it trims at the stop
    assert [r["same_text"][k] for k in ("drafts", "accepted")] == [r["vllm"][k] for k in ("drafts", "accepted")]
    served = Path(fake.jobs[1].draft)  # exported to vLLM's format, ids in its convention
    assert served.name == "vllm" and json.loads((served / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert [j.logprobs for j in fake.jobs] == [2, 0]  # the run without the draft tells near-ties apart
    assert [len(j.conversations) for j in fake.jobs] == [4, 4]
    assert "within the tolerance of 5%" in sc.render(r)


def test_on_the_engines_own_text_the_replayed_draft_counts_what_the_engine_counts(world, monkeypatch):
    """An engine whose head rounds differently writes another greedy text, faithfully: its draft reads the same
    taps. Acceptance on each side's own text then differs, but our draft replayed on the engine's text
    (doctor/chain.py's walk, the text's next token as the target's choice) counts exactly what the engine
    counted: the verdict is taken there."""
    r = _check(world, monkeypatch, FakeVllm(world, reround=0.5))
    # past the text's end the replay follows our target, whose head may pick other tokens than the engine's there
    assert r["same_text"]["acceptance_length"] == pytest.approx(r["vllm"]["acceptance_length"], abs=0.05)
    assert r["same_text"]["agree"] and r["ok"], sc.render(r)
    assert not r["agreement"]["agree"] and abs(r["agreement"]["relative"]) > 0.2  # each side's own text
    text = sc.render(r)
    assert "eaglewire's draft replayed there" in text and "the gap above is in the texts each side wrote" in text


def test_the_gpu_memory_share_reaches_every_served_job(world, monkeypatch):
    fake = FakeVllm(world)
    _check(world, monkeypatch, fake, wirings=sc.ALL, gpu_memory_utilization=0.3)
    assert len(fake.jobs) == 5 and {j.gpu_memory_utilization for j in fake.jobs} == {0.3}


def test_an_engine_that_accepts_less_fails_the_check(world, monkeypatch, tmp_path):
    r = _check(world, monkeypatch, FakeVllm(world, lose=1))
    assert not r["ok"] and not r["agreement"]["agree"] and r["agreement"]["relative"] > 0.05
    # its text is ours, so the replay there accepts what our decoder did, and the engine still falls short of it
    assert r["same_text"]["acceptance_length"] == pytest.approx(r["ours"]["acceptance_length"], abs=0.05)
    assert not r["same_text"]["agree"] and "BEYOND the tolerance" in sc.render(r)


def test_greedy_tokens_that_change_with_the_draft_fail_unless_at_a_near_tie(world, monkeypatch):
    r = _check(world, monkeypatch, FakeVllm(world, flip={1: (3, 2.5)}))
    assert not r["greedy"]["ok"] and r["greedy"]["mismatches"] == [{"prompt": 1, "position": 3, "top2_gap": 2.5}]
    assert not r["ok"]
    r = _check(world, monkeypatch, FakeVllm(world, flip={1: (3, 0.01)}))
    assert r["greedy"]["ok"] and len(r["greedy"]["near_ties"]) == 1 and r["ok"]


def test_wirings_serve_the_same_weights_with_other_ids(world, monkeypatch):
    fake = FakeVllm(world)
    r = _check(world, monkeypatch, fake, wirings=sc.ALL)
    got = {w["label"].split(":")[0]: w for w in r["wirings"]}
    assert set(got) == {"every tap -1", "every tap +1", "id 0 for tap 2"}
    assert got["every tap +1"]["ids"] == [3, 5, 6] and got["every tap +1"]["captured"]["taps"] == [3, 5, 6]
    assert got["id 0 for tap 2"]["ids"] == [0, 4, 5]
    # the draft was fitted to [2, 4, 5]: the engine accepts less with the ids one layer off, and least where id 0
    # hands it the last layer's output
    assert got["every tap +1"]["acceptance_length"] < r["vllm"]["acceptance_length"]
    assert got["id 0 for tap 2"]["acceptance_length"] < r["vllm"]["acceptance_length"]
    assert all(j.enforce_eager for j in fake.jobs[2:])
    # each row against the draft's own ids, paired over the same prompts
    zero = got["id 0 for tap 2"]["vs_draft_ids"]
    assert zero["difference"] == pytest.approx(got["id 0 for tap 2"]["acceptance_length"]
                                               - r["vllm"]["acceptance_length"])
    assert zero["interval"][0] <= zero["difference"] <= zero["interval"][1] < 0
    assert "id 0 for tap 2" in sc.render(r)
    # the doctor, before each was served, on the edit as a hand edit of the export leaves it (record kept)
    assert r["draft"]["doctor"] == {"exit": 0, "findings": []}
    assert {k: w["doctor"] for k, w in got.items()} == {
        "every tap +1": {"exit": 1, "findings": ["error:TAPS_SHIFTED"]},
        "every tap -1": {"exit": 1, "findings": ["error:TAPS_SHIFTED"]},
        "id 0 for tap 2": {"exit": 1, "findings": ["error:TAPS_UNSUPPORTED"]}}
    assert "error TAPS_SHIFTED" in sc.render(r)


def test_wirings_named_are_the_only_ones_served_and_a_name_the_engine_lacks_stops_before_serving(world,
                                                                                                monkeypatch):
    fake = FakeVllm(world)
    r = _check(world, monkeypatch, fake, wirings=("embedding", "minus1"))
    assert [w["key"] for w in r["wirings"]] == ["minus1", "embedding"] and len(fake.jobs) == 4  # engine's order
    assert [w["label"].split(":")[0] for w in r["wirings"]] == ["every tap -1", "id 0 for tap 2"]
    fake = FakeVllm(world)
    with pytest.raises(sc.UsageError, match=r"--wirings missing: vLLM has no such wiring .* it has "
                                            r"minus1,plus1,embedding"):
        _check(world, monkeypatch, fake, wirings=("missing", "plus1"))
    assert fake.jobs == []  # nothing served: the user's mistake costs no engine start
    assert sc.wiring_keys("all") == sc.ALL and sc.wiring_keys("missing, plus1") == ("missing", "plus1")
    with pytest.raises(argparse.ArgumentTypeError, match="invalid value 'plus1,plus2': must be all or wirings among"):
        sc.wiring_keys("plus1,plus2")


def test_a_run_cut_short_leaves_the_rows_it_served_and_names_the_rest(world, monkeypatch):
    """Run 44 (an H100, 2026-12-07) lost its lease during a wiring: the log kept the rows, the JSON nothing. The
    result so far now lands once the draft is served and after each wiring."""
    fake, seen = FakeVllm(world), []

    def dies_on_the_fourth_job(job, log_path=None):
        if len(fake.jobs) == 3:
            raise KeyboardInterrupt  # the machine taken back: no EaglewireError, no row
        return fake(job, log_path)

    with pytest.raises(KeyboardInterrupt):
        _check(world, monkeypatch, dies_on_the_fourth_job, wirings=sc.ALL, progress=seen.append)
    assert [[w["key"] for w in r["wirings"]] for r in seen] == [[], ["minus1"]]
    assert [r["wirings_pending"] for r in seen] == [["minus1", "plus1", "embedding"], ["plus1", "embedding"]]
    last = json.loads(json.dumps(seen[-1]))  # as --json writes it
    assert last["wirings"][0]["acceptance_length"] < last["vllm"]["acceptance_length"] and last["ok"]
    r = _check(world, monkeypatch, FakeVllm(world), wirings=("plus1",))
    assert r["wirings_pending"] == [] and [w["key"] for w in r["wirings"]] == ["plus1"]


def test_a_wiring_the_engine_cannot_serve_is_a_row_not_the_end_of_the_check(world, monkeypatch, tmp_path):
    """vLLM 0.26.0 fails at id 0 on a DeepSeek-family target (models/deepseek_v2.py:1468-1469 adds a residual that
    is still None): that wiring's row says so, and the other rows and the report stand."""
    fake = FakeVllm(world)

    def engine_run(job, log_path=None):
        ids = job.draft and json.loads((Path(job.draft) / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
        if ids and ids[0] == 0:
            raise sc.EaglewireError("vLLM exited with 1 serving the draft: TypeError: unsupported operand type(s) "
                                    "for +: 'Tensor' and 'NoneType'")
        return fake(job, log_path)

    r = _check(world, monkeypatch, engine_run, wirings=sc.ALL)
    got = {w["label"].split(":")[0]: w for w in r["wirings"]}
    zero = got["id 0 for tap 2"]
    assert zero["acceptance_length"] is None and zero["vs_draft_ids"] is None and "NoneType" in zero["failed"]
    assert got["every tap +1"]["acceptance_length"] < r["vllm"]["acceptance_length"]
    assert got["every tap +1"]["vs_draft_ids"]["difference"] < 0
    text = sc.render(r)
    assert "vLLM failed to serve these ids: vLLM exited with 1" in text and r["ok"]
    assert json.loads(json.dumps(r))["wirings"][2]["failed"] == zero["failed"]
    assert [name for name, _ in serve_report.wiring_bars(r)][1:] == [
        "every tap -1: taps [1, 3, 4]", "every tap +1: taps [3, 5, 6]", "id 0 for tap 2: vLLM failed"]
    sc.plot(r, tmp_path / "r.png")


def test_an_engine_export_is_served_as_it_is(world, monkeypatch, tmp_path):
    out = tmp_path / "export"
    interop.export_draft(world / "ck", "vllm", out)
    fake = FakeVllm(world)
    monkeypatch.setattr(engine, "run_job", fake)
    monkeypatch.setattr(engine, "require", lambda: None)
    r = sc.serve_check(out, str(world / "target"), suite=str(world / "suite.txt"), max_prompts=4, max_new_tokens=16,
                       chain=3, device="cpu", log=lambda m: None)
    assert r["draft"]["how"] == "served as it is" and fake.jobs[1].draft == str(out) and r["ok"]


def test_without_vllm_the_command_names_the_extra(world, capsys):
    if engine.available():
        pytest.skip("vLLM is installed here")
    code = cli_main(["serve-check", "--draft", str(world / "ck"), "--target", str(world / "target")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'eaglewire[vllm]'" in err[0]


# --- readers of vLLM's objects (vllm/v1/metrics/reader.py, vllm/outputs.py, eagle3_utils.py) --------------

def test_counters_are_read_summed_over_engines_and_differenced_per_call():
    C = lambda name, v: SimpleNamespace(name=name, value=v)  # noqa: E731
    V = lambda v: SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=v)  # noqa: E731
    before = engine.read_counters([C("vllm:spec_decode_num_drafts", 10), C("vllm:spec_decode_num_accepted_tokens", 12),
                                   C("vllm:spec_decode_num_draft_tokens", 70), V([6, 4, 2]),
                                   C("vllm:prompt_tokens", 999)])
    after = engine.read_counters([C("vllm:spec_decode_num_drafts", 15), C("vllm:spec_decode_num_drafts", 1),
                                  C("vllm:spec_decode_num_accepted_tokens", 20),
                                  C("vllm:spec_decode_num_draft_tokens", 112), V([9, 7, 3]), V([1, 0, 0])])
    assert before == {"drafts": 10, "draft_tokens": 70, "accepted": 12, "accepted_per_pos": [6, 4, 2]}
    assert engine.minus(after, before) == {"drafts": 6, "draft_tokens": 42, "accepted": 8,
                                           "accepted_per_pos": [4, 3, 1]}
    assert sc.counts([{"drafts": 6, "accepted": 8, "accepted_per_pos": [4, 3, 1]}], 3)["acceptance_length"] == \
        pytest.approx(1 + 8 / 6)


def test_top2_gaps_and_the_aux_layer_log_line():
    L = lambda lp: SimpleNamespace(logprob=lp)  # noqa: E731
    assert engine.top2_gaps([{5: L(-0.1), 7: L(-2.6)}, {3: L(-0.5)}]) == [pytest.approx(2.5), None]
    log = ("INFO 12-01 [eagle3_utils.py:40] Using Eagle3 auxiliary layers from model: (2, 15, 27)\n"
           "INFO ... Using Eagle3 auxiliary layers from config: (3, 16, 28)\n")
    assert engine.aux_layers(log) == {"from": "config", "ids": [3, 16, 28]}
    assert engine.aux_layers("nothing here") is None


def test_with_ids_rewrites_only_the_ids_and_links_the_weights(world, tmp_path):
    src = tmp_path / "src"
    interop.export_draft(world / "ck", "vllm", src)
    out = sc.with_ids(src, [3, 5, 6], tmp_path / "w")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6] and "eaglewire" not in cfg
    assert (out / "model.safetensors").is_symlink()
    assert interop.read_engine_view(out, "vllm", num_layers=8).captured_taps == [3, 5, 6]


# --- SGLang: its run_job replaced by an engine that reads the served directory as SGLang 0.5.17 does ---------

class FakeSglang:
    """engines.sglang.run_job's stand-in: the served directory read as SGLang 0.5.17 reads it, written here from its
    source, not from eaglewire's interop: the ids only from the nested eagle_config, inside a bare except that turns
    a missing or misspelled key into "no ids" (spec_aux_hidden_state.py:80-94); no ids -> layers [2, N//2, N-3] as
    they are, ids -> `val + 1` (llama.py:885-897); topk 1 forces draft tokens to steps + 1 (speculative_hook.py:
    656-664). Our decoder does the work on the native draft given those taps. The result is shaped like the
    worker's: meta_info's counters and spec_correct_drafts_histogram, the forward hook's layers_to_capture, the
    resolved arguments. `plus_one=False`: an SGLang that took the ids as taps; `force=False`: one that kept the
    asked draft tokens; `flip`: {prompt: position} of a token the draft run writes otherwise."""

    def __init__(self, world, plus_one: bool = True, force: bool = True, flip: dict | None = None):
        self.world, self.plus_one, self.force, self.flip, self.jobs = world, plus_one, force, flip or {}, []

    def native(self, layers) -> Path:
        out = self.world / f"sglang-as-served-{'-'.join(map(str, layers))}"
        if not out.exists():
            model, meta = checkpoint.load_draft(self.world / "ck")
            checkpoint.save_draft(model, out, contract=TapContract(8, tuple(layers)),
                                  target_fingerprint=meta.target)
        return out

    def __call__(self, job, log_path=None, where=None):
        self.jobs.append(job)
        w, layers = self.world, []
        steps, topk, ndt = job.num_steps, job.eagle_topk, job.num_draft_tokens
        native = w / "ck"
        if job.draft is not None:
            if self.force and topk == 1:
                ndt = steps + 1
            cfg = json.loads((Path(job.draft) / "config.json").read_text())
            try:
                ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
            except:  # noqa: E722 -- SGLang's own bare except
                ids = None
            layers = [2, 8 // 2, 8 - 3] if ids is None else [i + 1 if self.plus_one else i for i in ids]
            native = self.native(layers)
        cfg = bench.BenchConfig(suite=str(w / "suite.txt"), max_new_tokens=job.max_new_tokens,
                                shape=bench.shape_from("cpu", chain=steps or 1), hf=False, device="cpu", warmup=False)
        _, _, _, t, draft, meta, _, eos = bench.prepare(str(w / "target"), str(native), cfg)
        _, run, _ = bench.decoder_runner(t, draft, meta, cfg, torch.device("cpu"), eos, speculate=job.draft is not None)
        out = []
        for i, ids in enumerate(job.input_ids):
            gen = run(torch.tensor([ids]), job.max_new_tokens)
            tokens = list(gen.tokens)
            if job.draft is not None and i in self.flip:
                tokens[self.flip[i]] = (tokens[self.flip[i]] + 1) % 128
            m = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "finish_reason": {"type": "length"}}
            if job.draft is not None:  # tokenizer_manager.py:2435-2436: only with a speculative algorithm
                acc = gen.accepted or []
                hist = [sum(a == k for a in acc) for k in range(max(acc, default=0) + 1)]
                m.update(spec_verify_ct=len(acc), spec_num_correct_drafts=sum(acc),
                         spec_num_proposed_drafts=len(acc) * (ndt - 1), spec_correct_drafts_histogram=hist,
                         spec_accept_length=len(tokens) / len(acc))
            row = {"tokens": tokens, "prompt_tokens": len(ids), "seconds": gen.wall_s if job.batch else None,
                   "meta": m}
            if job.top_logprobs:
                row["top_logprobs"] = [[[-0.1, tok], [-5.1, (tok + 1) % 128]] for tok in tokens]
            out.append(row)
        spec = job.draft is not None
        return {"sglang_version": "fake", "prompts": out, "seconds": None, "log_tail": [],
                "resolved": {"speculative_algorithm": "EAGLE3" if spec else None, "speculative_num_steps": steps,
                             "speculative_eagle_topk": topk, "speculative_num_draft_tokens": ndt},
                "hooks": [{"module": "sglang.srt.models.llama.LlamaModel", "layers_to_capture": layers}]}


def _check_sglang(world, monkeypatch, fake, **kw):
    import tempfile

    from eaglewire.engines import sglang

    monkeypatch.setattr(sglang, "run_job", fake)
    monkeypatch.setattr(sglang, "require", lambda where=None: "fake")
    kw.setdefault("chain", None if "engine_args" in kw else 4)
    kw.setdefault("log", lambda m: None)
    return sc.serve_check(world / "ck", str(world / "target"), engine_name="sglang", suite=str(world / "suite.txt"),
                          max_prompts=4, max_new_tokens=24, device="cpu", work=tempfile.mkdtemp(dir=world), **kw)


def test_sglang_a_faithful_engine_agrees_and_shows_what_it_captured(world, monkeypatch):
    fake = FakeSglang(world)
    r = _check_sglang(world, monkeypatch, fake)
    assert r["ok"], sc.render(r)
    assert r["engine"] == "sglang" and r["sglang"]["acceptance_length"] == pytest.approx(r["ours"]["acceptance_length"])
    assert r["sglang"]["rate_by_position"] == pytest.approx(r["ours"]["rate_by_position"])  # from the histogram
    assert r["ours"]["acceptance_length"] > 1.2
    assert r["engine_aux_layers"]["taps"] == list(TAPS) and r["greedy"]["identical"] == 4
    served = Path(fake.jobs[1].draft)  # exported to SGLang's format: nested ids, id j = tap j + 1
    assert json.loads((served / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    plain, spec = fake.jobs[:2]
    assert plain.draft is None and plain.top_logprobs == 2 and plain.num_steps is None
    assert (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens, spec.batch) == (4, 1, 5, 1)
    assert spec.input_ids == plain.input_ids and len(spec.input_ids) == 4  # our decoder's prompt ids
    text = sc.render(r)
    assert "SGLang fake" in text and "spec_accept_length" in text and "within the tolerance of 5%" in text


def test_sglang_that_takes_the_ids_as_taps_is_caught(world, monkeypatch):
    """Negative control: an SGLang without the +1 captures taps [1, 3, 4]: the hook shows it and the run fails."""
    r = _check_sglang(world, monkeypatch, FakeSglang(world, plus_one=False))
    assert r["engine_aux_layers"]["taps"] == [1, 3, 4] and not r["ok"]
    assert "captured taps [1, 3, 4], not [2, 4, 5]" in sc.render(r)


def test_sglang_greedy_tokens_are_counted_not_failed(world, monkeypatch):
    r = _check_sglang(world, monkeypatch, FakeSglang(world, flip={2: 5}))
    g = r["greedy"]
    assert g["mismatches"] == [{"prompt": 2, "position": 5, "top2_gap": pytest.approx(5.0)}] and not g["must_match"]
    assert g["identical"] == 3 and g["ok"] and r["ok"]
    assert "1 differ (first: prompt 2 position 5) (counted, not held" in sc.render(r)


def test_sglang_wirings_on_a_deepseek_target_shift_the_ids_the_export_writes():
    """SGLang 0.5.17's deepseek_v2 (first-id heuristic, models/deepseek_v2.py:3146-3149): the default taps
    [2, N//2, N-3] export as ids [1, ...], which every version reads alike. Their +1, the seed incident's edit,
    starts at 2 and is read as-is: the trained taps after all. Their -1 starts at 0: the embedding, which this
    family's SGLang captures (layers/communicator.py:619-620), as does the embedding wiring."""
    got = {w["label"].split(" (")[0]: w for w in sglang_engine.Serving.wirings((2, 6, 9), 12, "deepseek_v3")}
    assert [(w["ids"], w["taps"]) for w in got.values()] == [([2, 6, 9], [2, 6, 9]), ([0, 4, 7], [0, 4, 7]),
                                                              ([0, 6, 9], [0, 6, 9]), (None, [2, 6, 9])]
    assert list(got) == ["every nested id +1", "every nested id -1", "the embedding", "nested key misspelled"]
    assert [w["key"] for w in got.values()] == list(sc.WIRINGS)  # the names --wirings takes
    cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 8]}}
    got["the embedding"]["edit"](cfg)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 6, 9]
    # llama's SGLang adds 1 to every id: no id reaches the embedding, so no such wiring
    assert not any("embedding" in w["label"] for w in sglang_engine.Serving.wirings((2, 15, 27), 30, "llama"))


def test_vllm_id0_wiring_says_the_deepseek_family_fails_where_llama_is_fed_another_tensor():
    """vLLM 0.26.0 runs DeepSeek-V2/V3/V3.2 and Kimi-K2 through models/deepseek_v2.py (registry.py), whose capture
    adds a residual that is None before layer 0 (deepseek_v2.py:1430, :1468-1469): id 0 fails there (served: a
    TypeError). Llama's keeps the embedding tensor the first layer then updates in place."""
    def id0(model_type):
        return next(w for w in engine.Serving.wirings((2, 6, 9), 12, model_type) if w["key"] == "embedding")
    for family in ("deepseek_v3", "kimi_k2"):
        assert id0(family)["ids"] == [0, 6, 9] and "fails on this family" in id0(family)["label"]
    assert "fails" not in id0("llama")["label"] and "not what vLLM feeds" in id0("llama")["label"]
    assert [w["key"] for w in engine.Serving.wirings((2, 6, 9), 12, "deepseek_v3")] == ["minus1", "plus1", "embedding"]


def test_sglang_wirings_in_its_own_words(world, monkeypatch):
    fake, logged = FakeSglang(world), []
    r = _check_sglang(world, monkeypatch, fake, wirings=sc.ALL, log=logged.append)
    got = {w["label"].split(" (")[0].split(":")[0]: w for w in r["wirings"]}
    # each acceptance is logged as it lands, so a run cut short (a lost machine) keeps what it measured
    assert f"with the draft: acceptance length {r['sglang']['acceptance_length']:.3f}" in "\n".join(logged)
    for w in r["wirings"]:
        assert f"given ids {w['ids']}: acceptance length {w['acceptance_length']:.3f}" in "\n".join(logged)
    plus, minus, fallback = (got["every nested id +1"], got["every nested id -1"], got["nested key misspelled"])
    assert (plus["ids"], plus["taps"], plus["captured"]["taps"]) == ([2, 4, 5], [3, 5, 6], [3, 5, 6])
    assert (minus["ids"], minus["taps"], minus["captured"]["taps"]) == ([0, 2, 3], [1, 3, 4], [1, 3, 4])
    # the misspelled key: SGLang's default [2, N//2, N-3] = [2, 4, 5], without the +1 (= this draft's taps)
    assert fallback["ids"] is None and fallback["taps"] == fallback["captured"]["taps"] == [2, 4, 5]
    cfg = json.loads((Path(fake.jobs[4].draft) / "config.json").read_text())["eagle_config"]
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and cfg[sglang_engine.MISSPELLED] == [1, 3, 4]
    assert plus["acceptance_length"] < r["sglang"]["acceptance_length"]
    assert fallback["acceptance_length"] == pytest.approx(r["sglang"]["acceptance_length"])
    # the doctor named each before it was served: the shifts as errors; the fallback, which reaches the trained
    # taps only through SGLang's default, as a warning
    assert plus["doctor"]["findings"] == minus["doctor"]["findings"] == ["error:TAPS_SHIFTED"]
    assert fallback["doctor"] == {"exit": 0, "findings": ["warning:TAPS_MISSING"]}
    assert r["draft"]["doctor"]["exit"] == 0
    assert all(not j.cuda_graph for j in fake.jobs[2:]) and fake.jobs[0].cuda_graph and fake.jobs[1].cuda_graph
    assert r["settings"]["engine_cuda_graphs"] and r["settings"]["eaglewire_compiled"]
    # --eager: the engine without CUDA graphs, and our decoder without torch.compile's minutes of warm-up
    seen, runner = [], bench.decoder_runner
    monkeypatch.setattr(bench, "decoder_runner", lambda t, d, m, cfg, *a, **k: seen.append(cfg) or runner(
        t, d, m, cfg, *a, **k))
    fake = FakeSglang(world)
    eager = _check_sglang(world, monkeypatch, fake, eager=True)
    assert [j.cuda_graph for j in fake.jobs] == [False, False]
    assert [c.speedups.compile for c in seen[:2]] == [False, False]  # ours (the fake engine's runs follow)
    assert not eager["settings"]["eaglewire_compiled"]
    assert "nested key misspelled" in sc.render(r)
    # eager tokens/s are launch-bound, not the served speed: the table says so (SGLang at batch 1 on an H200,
    # 2026-12-05: 74 tok/s eager)
    assert "tokens/s with the draft (eager)" in sc.render(eager) and "not the served speed" in sc.render(eager)
    assert "(eager)" not in sc.render(r)


def test_sglang_engine_flag_trap_reports_what_sglang_resolved(world, monkeypatch):
    """The seed incident's flags: steps 1, topk 1, 16 draft tokens. SGLang runs 2 (speculative_hook.py:656-664);
    the doctor predicts 2; the draft proposes 1 token a step. An SGLang that kept 16 shows the doctor wrong."""
    trap = "--speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 16"
    fake = FakeSglang(world)
    r = _check_sglang(world, monkeypatch, fake, engine_args=trap)
    assert (fake.jobs[1].num_steps, fake.jobs[1].eagle_topk, fake.jobs[1].num_draft_tokens) == (1, 1, 16)
    assert r["settings"]["chain"] == 1 and r["ok"], sc.render(r)
    sp, ask = r["speculation"], r["engine_args"]
    assert (sp["num_steps"], sp["eagle_topk"], sp["num_draft_tokens"], sp["proposed_per_step"]) == (1, 1, 2, 1.0)
    assert ask["requested"] == {"num_steps": "1", "eagle_topk": "1", "num_draft_tokens": "16"}
    assert ask["doctor"]["num_draft_tokens"] == 2 and ask["doctor_agrees"]
    assert "as SGLang resolved" in sc.render(r)
    # the doctor, given the flags as served, names the cut before SGLang runs (a warning: it serves, shorter)
    assert r["draft"]["doctor"] == {"exit": 0, "findings": ["warning:ENGINE_ARGS_OVERRIDE"]}
    r = _check_sglang(world, monkeypatch, FakeSglang(world, force=False), engine_args=trap)
    assert not r["engine_args"]["doctor_agrees"] and "NOT what SGLang resolved" in sc.render(r)


def test_sglang_engine_args_that_cannot_be_compared_are_usage_errors(world, monkeypatch):
    fake = FakeSglang(world)
    with pytest.raises(UsageError, match="tree"):
        _check_sglang(world, monkeypatch, fake, engine_args="--speculative-num-steps 3 --speculative-eagle-topk 4 "
                                                            "--speculative-num-draft-tokens 8")
    with pytest.raises(UsageError, match="refuse"):
        _check_sglang(world, monkeypatch, fake, engine_args="--speculative-eagle-topk 1")
    with pytest.raises(UsageError, match="passes only"):
        _check_sglang(world, monkeypatch, fake, engine_args="--speculative-num-steps 2 --tp 2")
    with pytest.raises(UsageError, match="vLLM drafts --chain K"):
        sc.serve_check(world / "ck", str(world / "target"), engine_name="vllm", engine_args="--speculative-num-steps 2")
    assert not fake.jobs


def test_without_sglang_the_command_says_how_to_install_it(world, capsys, tmp_path):
    code = cli_main(["serve-check", "--engine", "sglang", "--draft", str(world / "ck"), "--target",
                     str(world / "target"), "--sglang-python", str(tmp_path / "no-python")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'sglang==0.5.17'" in err[0] and "--sglang-python" in err[0]
