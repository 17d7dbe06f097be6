"""The probe: a draft built to read exactly taps [2, 4, 7] of a target built so that only those taps
predict its next token (tests/doctor_fixtures.py). Mis-wirings must be measured, named, and their
fix applied must make the probe agree with the engine."""

import json

import pytest
import torch

from eaglewire import interop
from eaglewire.checkpoint import save_draft
from eaglewire.doctor import diagnose
from eaglewire.doctor import probe as P
from eaglewire.taps import TapContract

import doctor_fixtures as fx

IDS = "eagle_aux_hidden_state_layer_ids"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    torch.set_num_threads(1)  # tiny tensors: threads only contend on shared CPUs
    d = tmp_path_factory.mktemp("probe")
    model = fx.probe_target()
    fx.save_probe_checkpoint(d / "ck", model)
    return d, model, fx.as_target(model)


def _export(world, fmt, name):
    d, _, _ = world
    out = d / name
    interop.export_draft(d / "ck", fmt, out)
    return out


def test_candidates_cover_shifts_embedding_orders_and_post_norm():
    ws = {w.sources: w.label for w in P.candidates((3, 31, 61), (2, 30, 60), 61)}
    assert (2, 30, 60) in ws and (4, 32, 61) not in ws  # 62 is past the last tap
    assert (3, 30, 61) in ws and (0, 31, 61) in ws and (61, 31, 3) in ws
    assert (3, 31, P.FINAL) in ws
    seed = {w.sources for w in P.candidates((0, 3, 31), None, 61)}
    assert (3, 31, 59) in seed  # the seed incident: [embedding, 3, 31] assumed for a draft trained on [3, 31, 59]


def test_draft_reads_exactly_its_taps(world):
    """The fixture is meaningful: the right taps give near-perfect step-1 accuracy, one layer off does not."""
    _, model, target = world
    draft = fx.probe_draft(model)
    seqs = P.probe_sequences(target, 4)
    states = [P.capture_states(model, ids) for ids, _ in seqs]
    acc = {t: P.measure(draft, model.lm_head, seqs, states, P.Wiring(t, ""), 1)["acc"][0]
           for t in [(2, 4, 7), (2, 4, 6), (3, 5, 8)]}
    assert acc[(2, 4, 7)] > 0.95 and acc[(2, 4, 6)] < 0.7 and acc[(3, 5, 8)] < 0.2


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_probe_of_clean_exports_is_ok(world, fmt):
    d, _, target = world
    out = _export(world, fmt, f"clean-{fmt}")
    r = diagnose(out, target=target, probe=4, records=str(d / "ck"))
    assert r.codes() == ["PROBE_OK"], r.findings
    assert r.probe["wirings"][0]["acc"][0] > 0.95


def test_shifted_config_is_measured_named_and_fixed(world):
    d, _, target = world
    out = _export(world, "sglang", "shifted")
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"][IDS] = [0, 2, 5]  # SGLang reads taps [1, 3, 6]; trained on [2, 4, 7] = ids [1, 3, 6]
    (out / "config.json").write_text(json.dumps(cfg))
    r = diagnose(out, target=target, probe=6, records=str(d / "ck"))
    f = r.get("PROBE_WIRING")
    assert f.severity == "error" and "[2, 4, 7]" in f.message and "[1, 3, 6]" in f.message
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [1, 3, 6]" in f.fix
    assert {"TAPS_SHIFTED", "PROBE_LOW_ACCEPTANCE", "PROBE_TAP_STATS"} <= set(r.codes())
    f.remedy.apply(out)
    again = diagnose(out, target=target, probe=6, records=str(d / "ck"))
    assert again.codes() == ["PROBE_OK"], again.findings


def test_fc_slots_in_another_order_are_fixed_by_permuting_fc(world, tmp_path):
    _, model, target = world
    draft = fx.probe_draft(model, key_slot=0)  # reads tap 7 from slot 0: trained high -> low
    save_draft(draft, tmp_path / "ck", contract=TapContract(8, fx.TAPS), target_fingerprint=target.fingerprint)
    r = diagnose(tmp_path / "ck", target=target, probe=4)
    f = r.get("PROBE_WIRING")
    assert "another order" in f.message and "fc.weight" in f.fix
    f.remedy.apply(tmp_path / "ck")
    assert diagnose(tmp_path / "ck", target=target, probe=4).codes() == ["PROBE_OK"]


def test_foreign_draft_taps_are_unverified_until_measured(world):
    _, _, target = world
    out = _export(world, "vllm", "foreign")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("eaglewire")
    (out / "config.json").write_text(json.dumps(cfg))
    assert diagnose(out, target=target).get("TAPS_UNVERIFIED").severity == "warning"
    r = diagnose(out, target=target, probe=4)
    assert r.get("TAPS_UNVERIFIED").severity == "info" and "PROBE_OK" in r.codes() and r.exit_code == 0


def test_wrong_target_lowers_acceptance_and_the_right_one_restores_it(world):
    d, _, target = world
    other = fx.as_target(fx.probe_target(seed=1))  # same shapes, other weights
    r = diagnose(d / "ck", target=other, probe=4)
    assert "PROBE_LOW_ACCEPTANCE" in r.codes()
    assert any("weights_hash" in f.message for f in r.findings if f.code == "TARGET_MISMATCH")
    assert diagnose(d / "ck", target=target, probe=4).codes() == ["PROBE_OK"]


def test_a_trained_draft_exported_for_every_engine_passes_clean(tmp_path):
    """No false alarms on what eaglewire itself makes: datagen -> train (tests/chat_target.py settings) ->
    export -> doctor with the probe on the training prompts, the trainer's records compared."""
    from chat_target import CONTRACT, conversations_file, make_target
    from eaglewire import targets
    from eaglewire.datagen import run_datagen
    from eaglewire.train import train
    from eaglewire.train_config import TrainConfig

    torch.set_num_threads(1)
    target = targets.load_target(str(make_target(tmp_path / "target")), device="cpu")
    prompts = conversations_file(tmp_path / "prompts.jsonl", 40)
    run_datagen(target, prompts, tmp_path / "data", CONTRACT, max_len=256, dtype="fp32", batch_size=5, progress=False)
    train(TrainConfig(steps=40, draft_vocab_size=64, batch_tokens=512, eval_fraction=0.2, max_len=256, lr=3e-3),
          target, tmp_path / "data", out=tmp_path / "ck", progress=False)
    r = diagnose(tmp_path / "ck", target=target, probe=8, prompts=str(prompts))
    assert r.codes() == ["PROBE_OK"], r.findings
    assert "tap_stats" in r.probe and r.probe["recorded_acc"]
    for fmt in ("sglang", "vllm", "speculators"):
        interop.export_draft(tmp_path / "ck", fmt, tmp_path / fmt)
        r = diagnose(tmp_path / fmt, target=target, probe=8, prompts=str(prompts), records=str(tmp_path / "ck"))
        assert r.codes() == ["PROBE_OK"], (fmt, r.findings)
