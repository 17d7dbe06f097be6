"""benchmarks/peers: the side-by-side harness's own parts on a tiny chat target (CPU).

The peers' trainers themselves are run for real in test_peers_speculators.py and test_peers_specforge.py; the
whole harness with all three trainers in test_peers_run.py.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from chat_target import conversations_file, make_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from peers import features, run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from eaglewire import targets

    root = tmp_path_factory.mktemp("peers")
    make_target(root / "target")
    conversations_file(root / "convs.jsonl", 24)
    return root, targets.load_target(str(root / "target"), device="cpu")


def test_split_holds_out_the_same_conversations_whatever_their_order():
    convs = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(300)]
    train, held = run.split(convs)
    assert len(held) == 6 and len(train) + len(held) == 300  # 2%
    assert not {json.dumps(c) for c in train} & {json.dumps(c) for c in held}
    _, held_again = run.split(convs[::-1])
    assert sorted(map(json.dumps, held_again)) == sorted(map(json.dumps, held))
    assert len(run.split(convs[:10])[1]) == run.MIN_HELDOUT


class Recorder:
    """A peer writer that keeps what it is handed."""

    def __init__(self):
        self.samples, self.closed = [], False

    def add(self, input_ids, loss_mask, taps, last, final):
        self.samples.append((input_ids, loss_mask, taps, last, final))

    def close(self):
        self.closed = True
        return {"samples": len(self.samples)}


def test_one_pass_gives_every_format_the_tensors_datagen_writes(chat, tmp_path):
    """The eaglewire shards of the shared pass are `eaglewire datagen`'s, tensor for tensor, and a peer's writer
    is handed the same taps, the pre-norm tap N and the post-norm state of the same forward."""
    from eaglewire.capture import capture
    from eaglewire.data import datagen, shards
    from eaglewire.prompts import load_pool
    from eaglewire.taps import TapContract

    root, tgt = chat
    N, H = tgt.num_layers, tgt.config.hidden_size
    contract = TapContract.default(N)
    cfg = datagen.DatagenConfig(max_len=256, dtype="fp32", batch_size=4)
    pool = load_pool(root / "convs.jsonl")
    rec = Recorder()
    writers = {"eaglewire": features.ShardsWriter(tmp_path / "ours", target=tgt, contract=contract, pset=pool, cfg=cfg),
               "peer": rec}
    r = features.capture_all(tgt, pool, writers, cfg=cfg, chunk=10)
    assert r["counts"]["samples"] == 24 and rec.closed and r["written"]["eaglewire"]["samples"] == 24
    assert set(r["timing"]) >= {"forward_s", "eaglewire_write_s", "peer_write_s"}

    datagen.run_datagen(tgt, root / "convs.jsonl", tmp_path / "datagen", contract, max_len=256, dtype="fp32",
                        batch_size=4, progress=False)
    ours, theirs = shards.open_dataset(tmp_path / "ours"), shards.open_dataset(tmp_path / "datagen")
    assert len(ours) == len(theirs) == 24
    for i in range(24):
        a, b = ours[i], theirs[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert torch.allclose(a["taps"], b["taps"], atol=1e-5) and torch.allclose(a["final_hidden"], b["final_hidden"],
                                                                                   atol=1e-5)
    ids, mask, taps, last, final = rec.samples[3]
    full = capture(tgt.model, ids[None], TapContract(N, tuple(range(N + 1))), final_norm=True)
    every = full.taps[0].view(-1, N + 1, H)
    assert torch.allclose(taps, every[:, list(contract.taps)], atol=1e-5)
    assert torch.allclose(last, every[:, N], atol=1e-5)  # pre-norm: what speculators' 4th slot holds
    assert torch.allclose(final, full.final_hidden[0], atol=1e-5)  # post-norm: SpecForge's hidden_state
    assert not torch.allclose(last, final, atol=1e-3)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_doctors_shifted_copy_moves_every_id_by_one(engine, tmp_path):
    """The +1 copy the doctor must flag: the engine reads every trained tap one layer deeper."""
    from eaglewire import interop

    from interop_tiny import save_tiny

    save_tiny(tmp_path / "ck")
    interop.export_draft(tmp_path / "ck", engine, tmp_path / "exp")
    shifted = run.shifted(tmp_path / "exp", engine, 8, tmp_path / "plus1")
    assert tuple(interop.read_engine_view(tmp_path / "exp", engine, num_layers=8).captured_taps) == (2, 4, 5)
    assert tuple(interop.read_engine_view(shifted, engine, num_layers=8).captured_taps) == (3, 5, 6)
    assert load_file(shifted / "model.safetensors").keys() == load_file(tmp_path / "exp" / "model.safetensors").keys()


def test_bad_arguments_are_one_line_usage_errors(capsys):
    assert run.main(["--work", "w", "--trainers", "eaglewire,medusa"]) == 2
    assert "medusa" in capsys.readouterr().err
    assert run.main(["--work", "w", "--minutes", "0"]) == 2
    assert run.main(["--work", "w", "--prompts", "0"]) == 2


def test_a_variant_is_one_more_eaglewire_row_with_its_fields_changed(monkeypatch, tmp_path):
    """--variant ttt3:ttt_steps=3,ttt_decay=1.0 (speculators' 3 equally weighted TTT steps) trains eaglewire's
    row again with those fields, under its own name, after --set's."""
    a = run.parse(["--work", str(tmp_path), "--set", "lr=0.002", "--variant", "ttt3:ttt_steps=3,ttt_decay=1.0"])
    assert a.trainers == ["eaglewire", "speculators", "specforge", "eaglewire-ttt3"]
    assert run.parse(["--work", "w", "--trainers", "speculators", "--variant", "x:lr=1"]).trainers == ["speculators"]
    assert run.parse(["--work", "w", "--trainers", "eaglewire-x", "--variant", "x:lr=1"]).trainers == ["eaglewire-x"]
    seen = {}

    def fake_run(argv, log, env=None):
        seen["argv"] = [str(x) for x in argv]
        js = argv[argv.index("--json") + 1]
        Path(js).write_text(json.dumps({"checkpoint": "c", "steps": 1, "train_s": 1.0}))

    monkeypatch.setattr(run, "_run", fake_run)
    run.train_one(run.Work(tmp_path), a, "eaglewire-ttt3")
    sets = [seen["argv"][i + 1] for i, x in enumerate(seen["argv"]) if x == "--set"]
    assert sets == ["lr=0.002", "ttt_steps=3", "ttt_decay=1.0"]
    assert seen["argv"][seen["argv"].index("--out") + 1].endswith("trained/eaglewire-ttt3")
    for bad in ("ttt3", "ttt3:", "t t:lr=1", "x:lr"):
        with pytest.raises(run.UsageError, match="--variant"):
            run.parse(["--work", "w", "--variant", bad])
    # speculators' draft norms in one JSON value: its comma stays inside it, and train_eaglewire reads it as JSON
    norms = run.parse(["--work", "w", "--variant",
                       'norms:draft_overrides={"norm_before_residual":true,"norm_before_fc":true},lr=1'])
    assert norms.variants["eaglewire-norms"] == ['draft_overrides={"norm_before_residual":true,"norm_before_fc":true}',
                                                 "lr=1"]
