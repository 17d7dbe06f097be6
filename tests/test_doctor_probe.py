"""The probe: a draft built to read exactly taps [2, 4, 7] of a target built so that only those taps
predict its next token (tests/doctor_fixtures.py). Mis-wirings must be measured, named, and their
fix applied must make the probe agree with the engine."""

import json

import doctor_fixtures as fx
import pytest
import torch

from eaglewire import interop, targets
from eaglewire.checkpoint import save_draft
from eaglewire.doctor import DoctorRequest, diagnose
from eaglewire.doctor import probe as P
from eaglewire.doctor import probe_inputs
from eaglewire.doctor.cli import render
from eaglewire.errors import UsageError
from eaglewire.taps import TapContract

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
    seqs = probe_inputs.sequences(target, 4).seqs
    states = [probe_inputs.capture_states(model, ids) for ids, _ in seqs]
    acc = {t: P.measure(draft, seqs, states, P.Wiring(t, ""), 1)[0]["acc1"] for t in [(2, 4, 7), (2, 4, 6), (3, 5, 8)]}
    assert acc[(2, 4, 7)] > 0.95 and acc[(2, 4, 6)] < 0.7 and acc[(3, 5, 8)] < 0.2


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_probe_of_clean_exports_is_ok(world, fmt):
    d, _, target = world
    out = _export(world, fmt, f"clean-{fmt}")
    r = diagnose(DoctorRequest(out, target=target, probe=4, records=str(d / "ck")))
    assert r.codes() == ["PROBE_OK"], r.findings
    assert r.probe["wirings"][0]["acc1"] > 0.95


def test_shifted_config_is_measured_named_and_fixed(world):
    d, _, target = world
    out = _export(world, "sglang", "shifted")
    cfg = json.loads((out / "config.json").read_text())
    cfg["eagle_config"][IDS] = [0, 2, 5]  # SGLang reads taps [1, 3, 6]; trained on [2, 4, 7] = ids [1, 3, 6]
    (out / "config.json").write_text(json.dumps(cfg))
    r = diagnose(DoctorRequest(out, target=target, probe=6, records=str(d / "ck")))
    f = r.get("PROBE_WIRING")
    assert f.severity == "error" and "[2, 4, 7]" in f.message and "[1, 3, 6]" in f.message
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [1, 3, 6]" in f.fix
    assert {"TAPS_SHIFTED", "PROBE_LOW_ACCEPTANCE", "PROBE_TAP_STATS"} <= set(r.codes())
    f.remedy.apply(out)
    again = diagnose(DoctorRequest(out, target=target, probe=6, records=str(d / "ck")))
    assert again.codes() == ["PROBE_OK"], again.findings


def test_fc_slots_in_another_order_are_fixed_by_permuting_fc(world, tmp_path):
    _, model, target = world
    draft = fx.probe_draft(model, key_slot=0)  # reads tap 7 from slot 0: trained high -> low
    save_draft(draft, tmp_path / "ck", contract=TapContract(8, fx.TAPS), target_fingerprint=target.fingerprint)
    r = diagnose(DoctorRequest(tmp_path / "ck", target=target, probe=4))
    f = r.get("PROBE_WIRING")
    assert "another order" in f.message and "fc.weight" in f.fix
    f.remedy.apply(tmp_path / "ck")
    assert diagnose(DoctorRequest(tmp_path / "ck", target=target, probe=4)).codes() == ["PROBE_OK"]


def test_foreign_draft_taps_are_unverified_until_measured(world):
    _, _, target = world
    out = _export(world, "vllm", "foreign")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("eaglewire")
    (out / "config.json").write_text(json.dumps(cfg))
    assert diagnose(DoctorRequest(out, target=target)).get("TAPS_UNVERIFIED").severity == "warning"
    r = diagnose(DoctorRequest(out, target=target, probe=4))
    assert r.get("TAPS_UNVERIFIED").severity == "info" and "PROBE_OK" in r.codes() and r.exit_code == 0


def test_a_draft_that_predicts_nothing_is_no_evidence(world, tmp_path):
    """Issue 45: an untrained foreign draft ties every wiring; the probe says it could not tell, as a warning, and
    TAPS_UNVERIFIED stays a warning (it was PROBE_OK, which lowered it to info)."""
    import doctor_fixtures

    _, model, target = world
    draft = doctor_fixtures.probe_draft(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.zero_()
    save_draft(draft, tmp_path / "ck", contract=TapContract(8, fx.TAPS), target_fingerprint=target.fingerprint)
    interop.export_draft(tmp_path / "ck", "vllm", tmp_path / "foreign")
    cfg = json.loads((tmp_path / "foreign" / "config.json").read_text())
    cfg.pop("eaglewire")
    (tmp_path / "foreign" / "config.json").write_text(json.dumps(cfg))
    r = diagnose(DoctorRequest(tmp_path / "foreign", target=target, probe=4))
    assert r.get("PROBE_UNSURE").severity == "warning" and "PROBE_OK" not in r.codes(), r.findings
    assert r.get("TAPS_UNVERIFIED").severity == "warning"


def test_wrong_target_lowers_acceptance_and_the_right_one_restores_it(world):
    d, _, target = world
    other = fx.as_target(fx.probe_target(seed=1))  # same shapes, other weights
    r = diagnose(DoctorRequest(d / "ck", target=other, probe=4))
    assert "PROBE_LOW_ACCEPTANCE" in r.codes()
    assert any("weights_hash" in f.message for f in r.findings if f.code == "TARGET_MISMATCH")
    assert diagnose(DoctorRequest(d / "ck", target=target, probe=4)).codes() == ["PROBE_OK"]


def test_a_trained_draft_exported_for_every_engine_passes_clean(tmp_path):
    """No false alarms on what eaglewire itself makes: datagen -> train (tests/chat_target.py settings) ->
    export -> doctor with the probe on the training prompts, the trainer's records compared."""
    from chat_target import CONTRACT, conversations_file, make_target

    from eaglewire import targets
    from eaglewire.data.datagen import run_datagen
    from eaglewire.train.config import TrainConfig
    from eaglewire.train.trainer import train

    torch.set_num_threads(1)
    target = targets.load_target(str(make_target(tmp_path / "target")), device="cpu")
    prompts = conversations_file(tmp_path / "prompts.jsonl", 40)
    run_datagen(target, prompts, tmp_path / "data", CONTRACT, max_len=256, dtype="fp32", batch_size=5, progress=False)
    train(TrainConfig(steps=40, draft_vocab_size=64, batch_tokens=512, eval_fraction=0.2, max_len=256, lr=3e-3),
          target, tmp_path / "data", out=tmp_path / "ck", progress=False)
    # The chat target's adjacent layers carry nearly the same information (random, 8 layers): every tap -1 reads as
    # well as the trained taps in acceptance, and only the log-probability the draft gives the target's tokens
    # tells them apart. Never an alarm on what eaglewire made.
    r = diagnose(DoctorRequest(tmp_path / "ck", target=target, probe=8, prompts=str(prompts)))
    assert r.codes() == ["PROBE_OK"] and r.exit_code == 0, r.findings
    assert "told apart only by the log-probability" in r.get("PROBE_OK").message
    assert "tap_stats" in r.probe and r.probe["recorded_acc"]
    minus = next(w for w in r.probe["wirings"] if w["label"] == "every tap -1")["vs_engine"]
    assert not minus["worse"] and minus["loglik1_ci"][1] < 0
    for fmt in ("sglang", "vllm", "speculators"):
        interop.export_draft(tmp_path / "ck", fmt, tmp_path / fmt)
        r = diagnose(DoctorRequest(tmp_path / fmt, target=target, probe=8, prompts=str(prompts),
                                   records=str(tmp_path / "ck")))
        assert r.codes() == ["PROBE_OK"] and r.exit_code == 0, (fmt, r.findings)
    # Issue 39: the same weak draft arriving from another trainer with every id +1. Acceptance cannot tell the
    # wirings apart; the log-probability names the taps it was trained on, as a warning with the fix.
    out = tmp_path / "foreign-plus1"
    interop.export_draft(tmp_path / "ck", "sglang", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("eaglewire")
    cfg["eagle_config"][IDS] = [i + 1 for i in cfg["eagle_config"][IDS]]
    (out / "config.json").write_text(json.dumps(cfg))
    r = diagnose(DoctorRequest(out, target=target, engine="sglang", probe=8, prompts=str(prompts)))
    f = r.get("PROBE_WIRING")
    assert f is not None and f.severity == "warning", r.findings
    assert "reads [2, 4, 5]" in f.message and "log-probability" in f.message and "trained on [2, 4, 5]" in f.fix
    assert f.remedy is not None


# --- drafts trained elsewhere: no eaglewire record ----------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A draft fitted (tests/decoding.py `fit`) to read taps [2, 4, 5] of the fixture target, whose per-token
    layers make every tap a different function of the token: one layer off costs it acceptance, not all of it."""
    from decoding import fit, new_draft

    d = tmp_path_factory.mktemp("trained")
    model = fx.probe_target()
    contract = TapContract(8, (2, 4, 5))
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (48,), generator=g) for _ in range(16)]
    draft = fit(new_draft(model, contract), model, contract, seqs, steps=300)
    target = fx.as_target(model)
    save_draft(draft, d / "ck", contract=contract, target_fingerprint=target.fingerprint)
    return d, target


def _foreign(d, fmt, name, edit):
    """An eaglewire export with its record removed, as another trainer's checkpoint arrives, ids edited."""
    out = d / name
    interop.export_draft(d / "ck", fmt, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("eaglewire")
    edit(cfg["eagle_config"] if fmt == "sglang" else cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_plus_one_ids_of_a_foreign_draft_are_measured_named_and_fixed(trained, fmt):
    """The seed incident without a record: ids one layer late. Only the probe can see it; it names the taps
    the draft reads best, with the paired interval and the cost, and its fix makes the engine feed them."""
    d, target = trained
    shifted = _foreign(d, fmt, f"{fmt}-plus1", lambda h: h.__setitem__(IDS, [i + 1 for i in h[IDS]]))
    static = diagnose(DoctorRequest(shifted, target=target))
    assert static.exit_code == 0 and "TAPS_UNVERIFIED" in static.codes()  # nothing to compare the ids with
    r = diagnose(DoctorRequest(shifted, target=target, probe=32))
    f = r.get("PROBE_WIRING")
    assert f.severity == "error" and r.exit_code == 1, r.findings
    assert "will feed [3, 5, 6]" in f.message and "reads [2, 4, 5]" in f.message and "interval +0." in f.message
    assert r.get("TAPS_UNVERIFIED").severity == "info"  # the measurement settled what the static check could not
    d_ = next(w for w in r.probe["wirings"] if w["taps"] == [2, 4, 5])["vs_engine"]
    assert d_["better"] and d_["cost"] >= 0.03 and d_["acceptance_length_ci"][0] > 0
    f.remedy.apply(shifted)
    again = diagnose(DoctorRequest(shifted, target=target, probe=32))
    assert again.get("PROBE_OK") is not None and again.exit_code == 0, again.findings
    right = _foreign(d, fmt, f"{fmt}-right", lambda h: None)
    ok = diagnose(DoctorRequest(right, target=target, probe=32))
    assert ok.exit_code == 0 and ok.get("PROBE_OK").message.startswith(
        f"the wiring {'SGLang' if fmt == 'sglang' else 'vLLM'}"), ok.findings
    assert "scores best" not in ok.get("PROBE_OK").message


def test_no_ids_anywhere_the_probe_decides_and_pins_them(trained):
    """With neither a record nor ids, which taps it was trained on is unknown: a warning naming the probe
    command; the probe then finds the engine's fallback right and --apply writes it down explicitly."""
    d, target = trained
    bare = _foreign(d, "vllm", "vllm-noids", lambda h: h.pop(IDS))
    f = diagnose(DoctorRequest(bare, target=target)).get("TAPS_MISSING")
    assert f.severity == "warning" and "unknown" in f.message and "happen" not in f.message
    assert "--probe 32" in f.fix
    r = diagnose(DoctorRequest(bare, target=target, probe=32))
    ok = r.get("PROBE_OK")
    assert ok is not None and r.get("TAPS_MISSING").severity == "info" and ok.remedy is not None, r.findings
    ok.remedy.apply(bare)
    assert json.loads((bare / "config.json").read_text())[IDS] == [2, 4, 5]
    assert "TAPS_MISSING" not in diagnose(DoctorRequest(bare, target=target)).codes()


def test_ids_under_a_key_the_engine_ignores_are_evidence(trained):
    """SGLang ids written under vLLM's file layout: vLLM never reads them and falls back to its default taps
    [2, 4, 5]; the ids state [3, 5, 6] as SGLang reads them. Different taps: an error giving both."""
    d, target = trained
    out = _foreign(d, "vllm", "vllm-nested", lambda h: h.setdefault("eagle_config", {}).__setitem__(IDS, h.pop(IDS)))
    f = diagnose(DoctorRequest(out, target=target)).get("TAPS_WRONG_PLACE")
    assert f.severity == "error" and "[3, 5, 6] as SGLang reads them" in f.message and "[2, 4, 5]" in f.message
    r = diagnose(DoctorRequest(out, target=target, probe=32))  # measured: the fallback is what the draft reads best
    assert r.get("PROBE_OK") is not None and r.get("TAPS_WRONG_PLACE").severity == "info", r.findings
    assert any(w["label"].startswith("as SGLang reads the ids under") for w in r.probe["wirings"])


def test_probe_prompts_are_distinct_and_never_repeated(world, tmp_path):
    builtin = probe_inputs.builtin_prompts()
    assert len(builtin) >= 64 and len(probe_inputs.distinct(builtin)) == len(builtin)
    target = targets.load_target(str(fx.save_target_dir(tmp_path / "t", world[1])), device="cpu")
    convs = [[{"role": "user", "content": f"say {w}"}] for w in ("a", "b", "a", "c")]
    got = probe_inputs.sequences(target, 10, convs, "a file", new_tokens=6)
    assert len(got.seqs) == 3 and "3 distinct prompts" in got.notes[0]  # the repeat dropped, nothing cycled
    assert len({tuple(ids.tolist()) for ids, _ in got.seqs}) == 3
    for ids, mask in got.seqs:
        assert 0 < int(mask.sum()) <= 6 and bool(mask[-1]) and not bool(mask[0])  # the target's own continuation


def test_probe_suite_file_and_counts_in_the_report(world, tmp_path):
    d, model, _ = world
    target = targets.load_target(str(fx.save_target_dir(tmp_path / "t", model)), device="cpu")
    suite = tmp_path / "suite.txt"
    suite.write_text("".join(f"question number {i}\n" for i in range(5)))
    r = diagnose(DoctorRequest(d / "ck", target=target, probe=4, suite=str(suite), probe_tokens=12))
    assert r.probe["prompts"] == 4 and r.probe["prompt_source"] == f"--suite {suite.name}"
    assert r.probe["positions"] > 0 and r.probe["rounds"] > 0
    text = render(r)
    assert "4 prompt(s)" in text and f"{r.probe['positions']} positions" in text
    with pytest.raises(UsageError):
        diagnose(DoctorRequest(d / "ck", target=target, probe=4, suite=str(suite), prompts=str(suite)))
