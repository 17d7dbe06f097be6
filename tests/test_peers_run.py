"""benchmarks/peers/run.py end to end on a tiny chat target (CPU): the three trainers really installed and run
(speculators 0.9.0 and SpecForge 0.2.0 in the peers' venv, speculators_env.py), each peer's output read by
`eaglewire import` as it comes out, the doctor on it and on a +1 copy, the replay, and the engines faked only at
their one boundary (`run_job`): each fake reads the served directory as its engine would (interop's engine view)
and accepts only when the taps it would capture are the ones the draft was trained on."""

import json
import sys
from pathlib import Path

import pytest

from eaglewire import checkpoint, interop

import speculators_env
from chat_target import conversations_file, make_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from peers import run  # noqa: E402

SUITE = [f"Words {i}?" for i in range(900, 906)]
K = 3


TRAINED = (2, 4, 5)  # every trainer's taps here: EAGLE-3's default for 8 layers, in each tool's own ids


def _accepts(draft: str, engine: str) -> bool:
    """Whether `engine` feeds this served draft the taps it was trained on (what its real counters would show)."""
    view = interop.read_engine_view(Path(draft), engine, num_layers=8)
    return view.recognised and view.captured_taps is not None and tuple(view.captured_taps) == TRAINED


class FakeEngines:
    """Both engines' run_job: per prompt 3 verify steps, each accepting one draft token when wired right."""

    def __init__(self):
        self.jobs = []

    def vllm(self, job, log_path=None):
        self.jobs.append(("vllm", job))
        ok = job.draft is None or _accepts(job.draft, "vllm")
        if job.batch == 1:  # the speed stage: batch 1, timed
            return {"vllm_version": "fake", "prompts": [{"tokens": [5] * 10, "seconds": 0.5 if job.draft else 1.0,
                                                         "prompt_tokens": 3, "counters": None} for _ in job.conversations]}
        groups = [{"drafts": 3 * n, "draft_tokens": 3 * n * K, "accepted": 3 * n * ok,
                   "accepted_per_pos": [3 * n * ok, 0, 0]} for n in job.groups]
        return {"vllm_version": "fake", "groups": groups, "prompts": [{"tokens": [5]} for _ in job.conversations]}

    def sglang(self, job, log_path=None, where=None):
        self.jobs.append(("sglang", job))
        ok = _accepts(job.draft, "sglang")
        meta = {"completion_tokens": 10, "spec_verify_ct": 4, "spec_num_correct_drafts": 4 * (1 if ok else 0),
                "spec_correct_drafts_histogram": [0, 4, 0, 0] if ok else [4, 0, 0, 0]}
        return {"sglang_version": "fake", "resolved": {"speculative_num_steps": job.num_steps},
                "prompts": [{"tokens": [5] * 10, "meta": meta, "seconds": None} for _ in job.conversations],
                "hooks": []}


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    from eaglewire.engines import sglang, vllm

    py = speculators_env.speculators_python()
    root = tmp_path_factory.mktemp("peers-run")
    make_target(root / "target")
    conversations_file(root / "convs.jsonl", 80)
    (root / "suite.txt").write_text("\n".join(SUITE) + "\n")
    fake = FakeEngines()
    # The CPU's sizes: small micro-batches, a draft vocabulary the toy target has, SpecForge's step cap given (its
    # calibration run is test_peers_specforge.py's), a short probe.
    argv = ["--work", str(root / "w"), "--target", str(root / "target"), "--conversations-file",
            str(root / "convs.jsonl"), "--minutes", "0.05", "--peer-python", str(py), "--device", "cpu",
            "--speculators-args", "--num-workers 0 --total-seq-len 256 --draft-vocab-size 64",
            "--specforge-draft-vocab", "64", "--specforge-set", "training.max_steps=3",
            "--set", "batch_tokens=512", "--set", "max_len=512", "--set", "log_every=2", "--set", "draft_vocab_size=64",
            "--suites", str(root / "suite.txt"), "--prompts", "6", "--new-tokens", "16", "--chain", str(K),
            "--probe", "4", "--speed-prompts", "2", "--max-len", "512"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm, "run_job", fake.vllm)
        mp.setattr(sglang, "run_job", fake.sglang)
        assert run.main(argv) == 0
    (root / "argv.json").write_text(json.dumps(argv))
    return root / "w", fake, json.loads((root / "w" / "report.json").read_text())


def test_every_trainer_trained_on_the_same_capture_for_its_budget(done):
    w, _, rep = done
    cap = rep["stages"]["capture"]
    assert set(cap["written"]) == {"eaglewire", "speculators", "specforge"}
    samples = cap["counts"]["samples"]
    assert cap["written"]["eaglewire"]["samples"] == samples == cap["written"]["specforge"]["samples"]
    for name, tr in rep["stages"]["train"].items():
        assert tr["steps"] >= 1 and tr["train_s"] > 0, name
    rows = {r["trainer"]: r for r in rep["table"]}
    assert all(rows[t]["capture_min"] is not None and rows[t]["acc1"] is not None for t in rows)


def test_each_peer_is_read_by_eaglewire_import_as_its_tool_wrote_it(done):
    w, _, rep = done
    imp = rep["stages"]["import"]
    for name in ("speculators", "specforge"):
        meta = checkpoint.load_meta(imp[name]["native"])
        assert tuple(meta.contract.taps) == TRAINED, name
        assert Path(imp[name]["raw"]).is_relative_to(w / "trained" / name)


def test_engines_load_a_peers_output_as_written_where_they_read_it_right(done):
    """vLLM reads speculators' layers.0.* and SpecForge's midlayer.*; every served draft is wired right."""
    _, fake, rep = done
    serve = rep["stages"]["serve"]
    assert serve["vllm"]["speculators"]["how"] == "as its tool wrote it"
    assert serve["vllm"]["specforge"]["how"] == "as its tool wrote it"
    assert serve["sglang"]["specforge"]["how"] == "as its tool wrote it"
    # speculators trains with norm_before_residual on, which SGLang's llama_eagle3.py cannot compute: eaglewire
    # refuses to export it for SGLang, and the row says so rather than serving something else
    assert serve["sglang"]["speculators"]["how"].startswith("not servable") and "norm_before_residual" in \
        serve["sglang"]["speculators"]["how"]
    assert serve["sglang"]["eaglewire"]["how"].startswith("eaglewire's export")
    for engine in ("vllm", "sglang"):
        for name, row in serve[engine].items():
            if row["served"] is None:
                continue
            got = row["suites"][str(Path(rep["meta"]["suites"][0]))]
            assert got["acceptance_length"] == pytest.approx(2.0), (engine, name)  # the fakes' "wired right"
    served = [j for e, j in fake.jobs if e == "vllm" and j.batch == 0]
    assert all(len(j.conversations) == len(SUITE) and j.groups == [len(SUITE)] for j in served)


def test_the_doctor_ran_on_each_peers_output_and_its_plus_one_copy(done):
    _, _, rep = done
    doc = rep["stages"]["doctor"]
    right, plus = doc["speculators"]["as written"], doc["speculators"]["every id +1"]
    assert doc["speculators"]["engine"] == "vllm" and right["engine_ids"] == [2, 4, 5] and plus["engine_ids"] == [3, 5, 6]
    right, plus = doc["specforge"]["as written"], doc["specforge"]["every id +1"]  # SGLang's ids: tap j + 1
    assert doc["specforge"]["engine"] == "sglang" and right["engine_ids"] == [1, 3, 4] and plus["engine_ids"] == [2, 4, 5]
    assert right["exit"] == 0 and all(not c.startswith("error") for c in right["codes"])
    # each report kept whole beside the verdict: the probe's table of wirings, with both shifts in it
    w = done[0]
    text = (w / "logs" / plus["report"]).read_text()
    assert plus["report"] == "doctor-specforge-every-id-plus1.txt" and "eaglewire doctor:" in text
    assert "every tap -1" in text and "every tap +1" in text


def test_the_table_has_every_measured_column(done):
    w, _, rep = done
    text = (w / "report.md").read_text()
    for name in ("eaglewire", "speculators 0.9.0", "SpecForge 0.2.0"):
        assert f"| {name} |" in text
    rows = {r["trainer"]: r for r in rep["table"]}
    s = rep["meta"]["suites"][0]
    assert all(rows[t]["suites"][s]["eaglewire_decoder"] is not None for t in rows)
    # what ended each run: a row that ran out of passes with time left is not an equal-minutes row
    assert rows["eaglewire"]["stopped"] in ("clock", "passes") and rows["speculators"]["stopped"] in ("clock", "passes")
    assert "| stopped by |" in text and "| GPU min, all in |" in text
    for r in rows.values():  # the GPU held for a draft: its capture, its trainer's start-up and its training
        assert r["gpu_min_all_in"] == pytest.approx(r["capture_min"] + r["startup_min"] + r["train_min"])
    assert rows["eaglewire"]["vllm_tokens_per_s"] == pytest.approx(20.0)  # 10 tokens in 0.5 s a prompt
    assert rows["eaglewire"]["vllm_tokens_per_s_without"] == pytest.approx(10.0)
    assert (w / "report.png").stat().st_size > 10_000


def test_a_row_added_to_a_finished_run_is_the_only_one_trained_served_and_timed(done):
    """--variant on a finished directory: the new row is trained, imported, served and timed alone; the eval
    replays every draft again on the same text (its pairing needs them all); the other rows are kept."""
    from eaglewire.engines import sglang, vllm

    w, _, before = done
    argv = json.loads((w.parent / "argv.json").read_text()) + ["--variant", "ttt2:ttt_steps=2"]
    fake = FakeEngines()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm, "run_job", fake.vllm)
        mp.setattr(sglang, "run_job", fake.sglang)
        assert run.main(argv) == 0
    rep = json.loads((w / "report.json").read_text())
    new = "eaglewire-ttt2"
    assert {j.draft for _, j in fake.jobs} == {str(w / "served" / e / new) for e in ("vllm", "sglang")}
    assert rep["stages"]["train"][new]["settings"]["ttt_steps"] == 2
    for t in ("eaglewire", "speculators", "specforge"):
        assert rep["stages"]["train"][t] == before["stages"]["train"][t]
        assert rep["stages"]["serve"]["vllm"][t] == before["stages"]["serve"]["vllm"][t]
    assert set(rep["stages"]["speed"]["rows"]) == {"none", "eaglewire", "speculators", "specforge", new}
    assert all(new in text["rows"] for text in rep["stages"]["eval"].values() if isinstance(text, dict))
    assert f"| {new} |" in (w / "report.md").read_text()


def test_an_engine_failing_on_one_row_keeps_the_others_and_a_rerun_serves_only_it(done):
    """An engine that exits on one draft (seen on an H200: vLLM's memory profiling upset by a job beside it) fails
    the stage with that row named; the rows served before and after it are kept, a rerun serves only the failed
    one, and the report, written by a run asked for a subset, still holds every row."""
    from eaglewire.engines import sglang, vllm
    from eaglewire.errors import EaglewireError

    w, _, before = done
    argv = json.loads((w.parent / "argv.json").read_text())
    for t in ("eaglewire", "speculators"):
        (w / "stages" / f"serve-vllm-{t}.json").unlink()
    fake = FakeEngines()

    def flaky(job, log_path=None):
        if job.draft and "speculators" in job.draft:
            raise EaglewireError(f"vLLM exited with 1 serving {job.draft}: Error in memory profiling")
        return fake.vllm(job, log_path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm, "run_job", flaky)
        mp.setattr(sglang, "run_job", fake.sglang)
        assert run.main(argv + ["--stages", "serve"]) == 1
    assert (w / "stages" / "serve-vllm-eaglewire.json").is_file()
    assert not (w / "stages" / "serve-vllm-speculators.json").exists()
    fake = FakeEngines()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm, "run_job", fake.vllm)
        mp.setattr(sglang, "run_job", fake.sglang)
        assert run.main(argv + ["--stages", "serve", "--trainers", "speculators", "--engines", "vllm"]) == 0
        assert [j.draft for _, j in fake.jobs] == [before["stages"]["serve"]["vllm"]["speculators"]["served"]]
        assert run.main(argv + ["--stages", "report"]) == 0
    rep = json.loads((w / "report.json").read_text())
    for t in ("eaglewire", "speculators", "specforge"):
        assert rep["stages"]["serve"]["vllm"][t]["suites"] == before["stages"]["serve"]["vllm"][t]["suites"], t
