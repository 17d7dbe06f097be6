"""Proof against the real client: vllm-project/speculators 0.9.0 (its own Eagle3DraftModel, in its own
venv, see speculators_env.py) loads our speculators export and computes the same logits as our draft,
and a checkpoint written by speculators' own save_pretrained imports into ours with the same logits.

All speculators work runs in ONE subprocess (speculators_probe.py batch): importing it takes seconds.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglewire import interop
from eaglewire.checkpoint import load_draft

from interop_tiny import LLAMA, draft_steps, save_tiny
from speculators_env import run_probe, speculators_python
from tiny import tiny_model

ATOL = 1e-5  # fp32; HF eager attention vs SDPA differ by ~1e-7
FLAG_NAMES = ("norm_before_residual", "fc_norm", "norm_output", "norm_before_fc")
OURS = {"eagle3": {}, "eagle3.1": dict(norm_before_residual=True, fc_norm=True, norm_output=True),
        "norm_before_fc": dict(norm_before_fc=True)}
THEIRS = {"plain": dict(norm_before_residual=False, ids=[2, 4, 5]),
          "flags": dict(norm_before_residual=True, norm_before_fc=True, norm_output=True, ids=[1, 3, 7])}


def _inputs(path, width, T=7):
    g = torch.Generator().manual_seed(7)
    inputs = {"taps": torch.randn(1, T, width, generator=g), "input_ids": torch.randint(0, 128, (1, T), generator=g),
              "position_ids": torch.arange(T)[None]}
    save_file(inputs, str(path))
    return inputs


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """Every case prepared here, then one speculators process runs them all: name -> (dir, info)."""
    py = speculators_python()
    root = tmp_path_factory.mktemp("speculators")
    verifier = root / "verifier"  # from_pretrained loads its verifier's embedding, norm and lm_head
    tiny_model("llama").save_pretrained(verifier)
    jobs, cases = {}, {}
    for name, flags in OURS.items():
        d = root / f"ours-{name}"
        d.mkdir()
        m = save_tiny(d / "ck", **flags)
        interop.export_draft(d / "ck", "speculators", d / "sp", target_path=str(verifier))
        cases[name] = (d, m, _inputs(d / "in.safetensors", m.config.fc_in_features))
        jobs[name] = ["run", str(d / "sp"), str(d / "in.safetensors"), str(d / "out.safetensors")]
    for name, flags in THEIRS.items():
        d = root / f"theirs-{name}"
        d.mkdir()
        cases[name] = (d, None, _inputs(d / "in.safetensors", 3 * 32))
        jobs[name] = ["write", str(d / "theirs"), str(d / "in.safetensors"), str(d / "out.safetensors"),
                      json.dumps(flags)]
    (root / "jobs.json").write_text(json.dumps(jobs))
    infos = json.loads(run_probe(py, "batch", root / "jobs.json").strip().splitlines()[-1])
    return {k: (*cases[k], infos[k]) for k in cases}


def _same_logits(ours, theirs):
    for step, (a, b) in enumerate(zip(ours, (theirs["logits0"], theirs["logits1"]))):
        assert torch.allclose(a, b, atol=ATOL, rtol=0), f"TTT step {step}: max |diff| {(a - b).abs().max()}"


@pytest.mark.parametrize("name", list(OURS))
def test_speculators_loads_our_export_with_the_same_logits(probed, name):
    d, m, inputs, info = probed[name]
    assert info["class"] == "Eagle3DraftModel" and info["layer_ids"] == [2, 4, 5]
    assert {f: info[f] for f in FLAG_NAMES} == {f: getattr(m.config, f) for f in FLAG_NAMES}
    theirs = load_file(d / "out.safetensors")
    _same_logits(draft_steps(m, inputs["taps"], inputs["input_ids"], inputs["position_ids"]), theirs)
    assert torch.equal(theirs["d2t"], m.d2t) and torch.equal(theirs["t2d"], m.t2d)


@pytest.mark.parametrize("name", list(THEIRS))
def test_speculators_own_checkpoint_imports_with_the_same_logits(probed, name, tmp_path):
    d, _, inputs, info = probed[name]
    flags = THEIRS[name]
    assert info["class"] == "Eagle3DraftModel"
    path, meta = interop.import_draft(d / "theirs", tmp_path / "ours", target=interop.TargetInfo(fingerprint=dict(LLAMA)))
    assert meta.source in ("speculators", "vllm") and list(meta.contract.taps) == flags["ids"]
    m, _ = load_draft(path)
    for f in FLAG_NAMES:
        assert getattr(m.config, f) is flags.get(f, False), f
    theirs = load_file(d / "out.safetensors")
    _same_logits(draft_steps(m, inputs["taps"], inputs["input_ids"], inputs["position_ids"]), theirs)


# --- a speculators checkpoint through import and export, and back into speculators' own loader ----------------

WINDOW = 4  # speculators trains with 2048 (train/config/schema.py); 4 shows at T = 7
LAYER_READ = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_hidden_layers", "max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
              "rms_norm_eps", "hidden_act", "attention_bias", "mlp_bias", "sliding_window", "layer_types",
              "use_sliding_window")
TOP_READ = ("speculators_model_type", "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
            *FLAG_NAMES)


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """speculators writes a windowed draft that records its verifier; we import it without --target and export it
    to the speculators format; speculators loads that export with its own from_pretrained (offline: the verifier is
    a local directory) and runs it. Two probe processes: the write, then the load."""
    py = speculators_python()
    root = tmp_path_factory.mktemp("speculators-rt")
    verifier = root / "verifier"
    tiny_model("llama").save_pretrained(verifier)
    inputs = _inputs(root / "in.safetensors", 3 * 32)
    flags = dict(norm_before_residual=True, ids=[1, 3, 7], verifier=str(verifier),
                 layer=dict(sliding_window=WINDOW, use_sliding_window=True, layer_types=["sliding_attention"]))
    run_probe(py, "write", root / "theirs", root / "in.safetensors", root / "theirs.safetensors", json.dumps(flags))
    path, meta = interop.import_draft(root / "theirs", root / "ours")  # the recorded verifier is the target
    interop.export_draft(path, "speculators", root / "again")
    info = json.loads(run_probe(py, "run", root / "again", root / "in.safetensors",
                                root / "again.safetensors").strip().splitlines()[-1])
    return root, meta, inputs, info


def test_speculators_round_trip_keeps_every_field_it_reads(round_trip):
    root, meta, _, info = round_trip
    assert meta.target_from.startswith(str(root / "verifier"))
    theirs, again = (json.loads((root / d / "config.json").read_text()) for d in ("theirs", "again"))
    for k in TOP_READ:
        assert again.get(k) == theirs.get(k), k
    lt, la = theirs["transformer_layer_config"], again["transformer_layer_config"]
    assert {k: la.get(k) for k in LAYER_READ} == {k: lt.get(k) for k in LAYER_READ}
    assert lt["layer_types"] == ["sliding_attention"] and lt["sliding_window"] == WINDOW  # as speculators wrote
    assert again["speculators_config"]["verifier"] == theirs["speculators_config"]["verifier"]
    a, b = load_file(root / "theirs" / "model.safetensors"), load_file(root / "again" / "model.safetensors")
    assert set(b) >= set(a) and all(torch.equal(a[k], b[k]) for k in a)
    assert info["class"] == "Eagle3DraftModel" and info["layer_ids"] == [1, 3, 7]


def test_speculators_runs_the_round_trip_with_its_own_logits(round_trip):
    """speculators' own model on its own checkpoint, and on ours after import and export: the same logits."""
    root, *_ = round_trip
    theirs, again = load_file(root / "theirs.safetensors"), load_file(root / "again.safetensors")
    for k in ("logits0", "logits1", "d2t", "t2d"):
        assert torch.equal(theirs[k], again[k]), k


def test_the_imported_window_attends_as_speculators_trained_it(round_trip):
    """TTT step 0 past the window: our logits equal speculators'. Step 1: speculators' training mask windows the
    step-0 keys by INDEX (models/eagle3/attention.py:16-19, kv_idx > q_idx - W, the query's own step-1 key added),
    while vLLM serves by POSITION (a step-1 query sits one position later), as eaglewire's draft does: so step 1
    is compared under speculators' index mask, and differs under eaglewire's own rule only at the window's edge."""
    import dataclasses

    from eaglewire.draft import Eagle3Draft, causal_mask

    root, _, inputs, _ = round_trip
    m, _ = load_draft(root / "ours")
    assert m.config.sliding_window == WINDOW
    theirs = load_file(root / "theirs.safetensors")
    taps, ids, pos = inputs["taps"], inputs["input_ids"], inputs["position_ids"]
    T = ids.shape[1]
    ours0, ours1 = draft_steps(m, taps, ids, pos)
    assert torch.allclose(ours0, theirs["logits0"], atol=ATOL, rtol=0)
    plain = Eagle3Draft(dataclasses.replace(m.config, sliding_window=None)).eval()
    plain.load_state_dict(m.state_dict())
    near = causal_mask(T, T) & (torch.arange(T)[:, None] - torch.arange(T)[None] < WINDOW)
    index_mask = torch.cat([near, torch.eye(T, dtype=torch.bool)], 1)[None, None]
    with torch.no_grad():
        cache = m.new_cache(1)
        _, h = m(ids, m.fuse(taps), pos, cache=cache)  # step 0 windowed, as both count it
        ids1 = torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=torch.long)], dim=1)
        theirs1, _ = plain(ids1, h, pos + 1, cache=cache, attn_mask=index_mask)
    assert torch.allclose(theirs1, theirs["logits1"], atol=ATOL, rtol=0)
    edge = torch.arange(T) >= WINDOW - 1  # the rows whose window lost a step-0 key to the position rule
    assert torch.allclose(ours1[0, ~edge], theirs["logits1"][0, ~edge], atol=ATOL, rtol=0)
    assert not torch.allclose(ours1[0, edge], theirs["logits1"][0, edge], atol=ATOL, rtol=0)
