"""benchmarks/peers/peer_specforge.py against the real SpecForge 0.2.0 (in the peers venv, speculators_env.py).

One pipeline, run once for the module, on a tiny random Llama with tied embeddings (SmolLM2's case): taps
from eaglewire's own capture -> the Writer's files -> SpecForge's own offline reader -> the real
`specforge train` on the CPU (a calibration run, then the budgeted run) -> the real `specforge export --to hf`
-> `eaglewire import`. Then: the taps, the tensors against SpecForge's saved training state, and the logits
against SpecForge's own draft class (LlamaForCausalLMEagle3) loaded from the export.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglewire.capture import capture
from eaglewire.checkpoint import load_draft
from eaglewire.cli import main as eaglewire_main
from eaglewire.taps import TapContract

from interop_tiny import draft_steps
from speculators_env import peers_python
from tiny import COMMON

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))
import peer_specforge as ps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

N, H = COMMON["num_hidden_layers"], COMMON["hidden_size"]
TAPS = (2, N // 2, N - 3)  # HF hidden_states ids, the Writer's taps; SpecForge's ids [1, 3, 4]
LENGTHS = (9, 11, 7, 12, 10, 8)
ATOL = 1e-5

# Runs in SpecForge's interpreter: its own reader on the data (peer_specforge.py check), and two TTT steps of
# its own draft class the way OnlineEagle3Model runs them (algorithms/eagle3/model.py:297-420, the sdpa branch:
# one projection, the ids shifted left each step by utils.padding(left=False)). The class is built as the
# trainer and exporter build it (from_config, export/checkpoint_io.py:158-161): under transformers 5.19
# AutoDraftModel.from_pretrained leaves the rotary caches, non-persistent buffers, uninitialised (NaN logits).
PROBE = r"""
import json, sys, torch
from safetensors.torch import load_file, save_file
sys.path.insert(0, sys.argv[1])
from peer_specforge import _check
from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
data, hf, inputs, out, dump = sys.argv[2:7]
report = _check(data, dump)
m = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(hf + "/config.json"), torch_dtype=torch.float32)
m.load_state_dict(load_file(hf + "/model.safetensors"), strict=True)
m.eval()
x = load_file(inputs)
ids = x["input_ids"]
B, T = ids.shape
logits = {}
with torch.no_grad():
    hidden = m.project_hidden_states(x["taps"])
    mask = m.prepare_decoder_attention_mask(attention_mask=torch.ones(B, T, dtype=torch.bool), hidden_states=hidden,
                                            batch_size=B, seq_length=T, past_key_values_length=0)
    pos, cache = torch.arange(T)[None], [[], []]
    for k in range(2):
        emb = m.embed_input_ids(ids).to(hidden.dtype)
        hidden = m.backbone(input_embeds=emb, hidden_states=hidden, cache_hidden=cache, attention_mask=mask,
                            position_ids=pos, past_key_values=None, use_cache=True)
        logits[f"logits{k}"] = m.compute_logits(hidden)
        ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
save_file(logits, out)
print(json.dumps({**report, "class": type(m).__name__, "d2t": m.d2t.tolist()}))
"""


def tied_target(path):
    """Tied embeddings, saved as one model.safetensors without lm_head.weight and without an index."""
    import transformers as tf

    torch.manual_seed(0)
    m = tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, tie_word_embeddings=True)).eval()
    m.save_pretrained(path)
    return m


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    py = peers_python()
    root = tmp_path_factory.mktemp("specforge")
    target = tied_target(root / "target")
    g = torch.Generator().manual_seed(1)
    writer = ps.Writer(root / "data", target_dir=root / "target", hidden_size=H)
    written = []
    for i, T in enumerate(LENGTHS):
        ids = torch.randint(0, 128, (T,), generator=g)
        mask = torch.zeros(T, dtype=torch.bool)
        if i != 2:  # sample 2 has no trainable token: SpecForge's own preparation drops it
            mask[T // 2:] = True
        cap = capture(target, ids[None], TapContract(N, TAPS), final_norm=True)
        taps = cap.taps[0].reshape(T, 3, H)
        writer.add(ids, mask, taps, taps[:, -1], cap.final_hidden[0])
        if i != 2:
            written.append((ids, mask, taps, cap.final_hidden[0]))
    info = writer.close()
    result = ps.train(root / "data", root / "target", root / "out", seconds=3.0, python=str(py), device="cpu",
                      draft={"draft_vocab_size": 64}, calibrate_steps=ps.WARMUP_STEPS + 2)
    assert eaglewire_main(["import", "--from", result["checkpoint"], "--out", str(root / "ours"),
                           "--target", str(root / "target")]) == 0
    ids, _, taps, _ = written[0]
    save_file({"input_ids": ids[None], "taps": taps.reshape(1, -1, 3 * H).to(torch.bfloat16).float()},
              str(root / "inputs.safetensors"))
    r = subprocess.run([str(py), "-c", PROBE, str(Path(ps.__file__).parent), str(root / "data"), result["checkpoint"],
                        str(root / "inputs.safetensors"), str(root / "theirs.safetensors"),
                        str(root / "sample0.safetensors")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(root=root, info=info, written=written, result=result, probe=json.loads(r.stdout.splitlines()[-1]))


def test_writer_files_read_back_through_specforge_reader(pipeline):
    info, probe, written = pipeline["info"], pipeline["probe"], pipeline["written"]
    assert info["samples"] == 5 and info["skipped_no_loss"] == 1
    assert probe["samples"] == 5 and probe["tokens"] == info["tokens"] == sum(LENGTHS) - LENGTHS[2]
    assert probe["widths"] == [[3 * H, H, "torch.bfloat16"]]  # aux [1, T, 3H]; hidden_state [1, T, H]
    sample = load_file(pipeline["root"] / "sample0.safetensors")  # normalize_offline_sample's output
    ids, mask, taps, final = written[0]
    assert torch.equal(sample["input_ids"][0], ids)
    assert torch.equal(sample["hidden_state"][0], taps.reshape(-1, 3 * H).to(torch.bfloat16))  # low -> high
    assert torch.equal(sample["target"][0], final.to(torch.bfloat16))
    want = mask.long().clone()
    want[-1] = 0  # SpecForge drops the last position's loss (algorithms/eagle3/data.py:19-20)
    assert torch.equal(sample["loss_mask"][0], want)


def test_budget_settings_and_the_tied_target(pipeline):
    r = pipeline["result"]
    c, s = r["calibration"], r["settings"]
    assert r["steps"] == max(1, int(3.0 / c["step_s"])) == s["max_steps"]
    assert c["steps"] == ps.WARMUP_STEPS + 2 and r["startup_s"] > 0 and r["train_s"] > 0
    # SpecForge's own defaults (config/schema.py), the CPU's two necessities aside
    assert {k: s[k] for k in ("ttt_length", "learning_rate", "lr_scheduler", "warmup_ratio", "batch_size",
                              "accumulation_steps", "torch_dtype", "max_length", "draft_layers")} == {
        "ttt_length": 7, "learning_rate": 1e-4, "lr_scheduler": "cosine", "warmup_ratio": 0.015, "batch_size": 1,
        "accumulation_steps": 1, "torch_dtype": "bfloat16", "max_length": 2048, "draft_layers": 1}
    assert s["lm_head_key"] == ps.EMBED_KEY  # tied: no lm_head.weight in the file
    assert s["num_epochs"] * 5 >= r["steps"]
    out = Path(r["checkpoint"]).parent
    assert (out / "train" / f"specforge-run-step{r['steps']}" / "training_state.pt").is_file()
    assert json.loads((out / "target" / "model.safetensors.index.json").read_text())["weight_map"][ps.EMBED_KEY]
    hf = json.loads((Path(r["checkpoint"]) / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == s["exported_eagle_config_ids"] == [1, 3, 4]
    log = (out / "specforge.log").read_text()
    assert log.count("\nstep ") == c["steps"] + r["steps"]


def test_import_has_the_taps_and_specforge_saved_tensors(pipeline):
    root, r = pipeline["root"], pipeline["result"]
    ours, meta = load_draft(root / "ours")
    assert meta.contract == TapContract(N, TAPS)
    state = torch.load(Path(r["checkpoint"]).parent / "train" / f"specforge-run-step{r['steps']}" /
                       "training_state.pt", weights_only=False)["draft_state_dict"]
    mine = ours.state_dict()
    for name, theirs in state.items():
        key = name.replace("midlayer.", "layers.0.")
        assert torch.equal(mine[key].to(theirs.dtype), theirs), name
    assert torch.equal(mine["d2t"], torch.tensor(pipeline["probe"]["d2t"]))  # as SpecForge's class loads it
    embed = load_file(root / "target" / "model.safetensors")[ps.EMBED_KEY]
    assert torch.equal(mine["embed_tokens.weight"].to(torch.bfloat16), embed.to(torch.bfloat16))


def test_same_logits_as_specforge_own_draft_class(pipeline):
    root, probe = pipeline["root"], pipeline["probe"]
    assert probe["class"] == "LlamaForCausalLMEagle3"
    ours, _ = load_draft(root / "ours", dtype=torch.float32)
    x = load_file(root / "inputs.safetensors")
    T = x["input_ids"].shape[1]
    theirs = load_file(root / "theirs.safetensors")
    for k, mine in enumerate(draft_steps(ours, x["taps"], x["input_ids"], torch.arange(T)[None])):
        torch.testing.assert_close(mine, theirs[f"logits{k}"], atol=ATOL, rtol=0, msg=f"TTT step {k}")


# --- without SpecForge ------------------------------------------------------------------------------

def test_writer_refuses_wrong_shapes_and_old_files(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"num_hidden_layers": N, "hidden_size": H}))
    with pytest.raises(ValueError, match="hidden_size 16 != the target's 32"):
        ps.Writer(tmp_path / "d", target_dir=tmp_path / "t", hidden_size=16)
    w = ps.Writer(tmp_path / "d", target_dir=tmp_path / "t", hidden_size=H)
    T = 5
    with pytest.raises(ValueError, match=r"taps has shape \(5, 96\), expected \(5, 3, 32\)"):
        w.add(torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.bool), torch.zeros(T, 3 * H),
              torch.zeros(T, H), torch.zeros(T, H))
    w.add(torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.bool), torch.zeros(T, 3, H),
          torch.zeros(T, H), torch.zeros(T, H))
    assert w.close()["samples"] == 1
    with pytest.raises(ValueError, match="not empty"):
        ps.Writer(tmp_path / "d", target_dir=tmp_path / "t", hidden_size=H)


def test_writer_saves_no_more_than_the_sample(tmp_path):
    """torch.save writes a view's whole storage: a slice of a batch must be copied out first."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"num_hidden_layers": N, "hidden_size": H}))
    w = ps.Writer(tmp_path / "d", target_dir=tmp_path / "t", hidden_size=H)
    batch = torch.randn(64, 4, 3, H, dtype=torch.bfloat16)
    w.add(torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool), batch[0], batch[0, :, 2],
          batch[1, :, 0])
    assert w.close()["bytes"] < batch[:2].numel() * 2 + 4096


def test_target_view_keeps_an_existing_index(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {ps.EMBED_KEY: "a.safetensors", "lm_head.weight": "b.safetensors"}}))
    assert ps.target_view(tmp_path / "t", tmp_path / "w") == ((tmp_path / "t").resolve(), "lm_head.weight")
    assert not (tmp_path / "w").exists()


def test_train_refuses_data_without_manifest(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="no eaglewire-peer.json"):
        ps.train(tmp_path / "d", tmp_path, tmp_path / "o", seconds=1, python=sys.executable)


SGLANG_READ = ("architectures", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "num_hidden_layers", "vocab_size", "max_position_embeddings", "rope_parameters",
               "rope_theta", "rope_scaling", "rms_norm_eps", "hidden_act", "tie_word_embeddings", "draft_vocab_size",
               "eagle_config")


def test_specforge_export_round_trips_back_into_its_format(pipeline):
    """SpecForge's own `export --to hf` -> `eaglewire import` (the fixture) -> `eaglewire export --format sglang`
    (SpecForge's HF export IS the SGLang format, export/to_sglang.py): the fields SGLang reads as SpecForge wrote
    them, SpecForge's tensors, and SpecForge's own draft class on our export gives its logits bit for bit."""
    root, r = pipeline["root"], pipeline["result"]
    py = peers_python()
    assert eaglewire_main(["export", "--draft", str(root / "ours"), "--format", "sglang", "--out",
                           str(root / "again")]) == 0
    theirs = json.loads((Path(r["checkpoint"]) / "config.json").read_text())
    again = json.loads((root / "again" / "config.json").read_text())
    for cfg in (theirs, again):  # absent, SGLang reads it as True (spec_aux_hidden_state.py:86-88)
        cfg["eagle_config"].setdefault("use_aux_hidden_state", True)
    assert {k: again.get(k) for k in SGLANG_READ} == {k: theirs.get(k) for k in SGLANG_READ}
    a, b = load_file(Path(r["checkpoint"]) / "model.safetensors"), load_file(root / "again" / "model.safetensors")
    for k, v in a.items():
        assert torch.equal(b[k].to(v.dtype), v) and b[k].dtype == v.dtype, k
    out = root / "again-logits.safetensors"
    run = subprocess.run([str(py), "-c", PROBE, str(Path(ps.__file__).parent), str(root / "data"), str(root / "again"),
                          str(root / "inputs.safetensors"), str(out), str(root / "sample0-again.safetensors")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = load_file(root / "theirs.safetensors"), load_file(out)
    for k in ("logits0", "logits1"):
        assert torch.equal(first[k], second[k]), k
