"""benchmarks/decode_steps.py's accounting of a round's graph replays (its GPU timing needs CUDA)."""

import sys
from pathlib import Path

import pytest
from decoding import CHAIN, TREE, decoder, fake_capture, host_rounds, prompts, reference_greedy

from eaglewire.runtime.runners import SlotRunner
from eaglewire.runtime.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from decode_steps import generation, replays_per_round, warmed  # noqa: E402
from round_kernels import by_kind, kind, ms_cell, per_round  # noqa: E402


def test_replays_are_counted_per_round_without_the_prefill(llama, seqs, drafts, monkeypatch):
    """A greedy round's replays, every round rounds.py's: the draft's round, the verify, the verdict (and a
    tree's move, every round); the draft's prefill is one exact forward, no replay. The target's prefill
    chunks are not a round's work. A broken count (e.g. the prefill counted, or a graph left out) would make
    the benchmark's host time wrong."""
    monkeypatch.setattr(SlotRunner, "_capture", fake_capture)
    p = prompts(seqs)[0]
    for shape in (CHAIN, TREE):
        dec = decoder(llama, *drafts["trained"], static_shapes=True, **shape)
        for r in (dec.verifier, dec.drafter):
            r.cuda_graphs = True
        dec.generate(p, 16)  # every size met is captured
        per_round, res = replays_per_round([dec.drafter, dec.verifier], lambda: dec.generate(p, 16))
        assert res.tokens == reference_greedy(llama.model, p, 16)
        verify = f"TargetRunner{(dec.verifier.sizes[0], ('ids',))}"
        assert per_round[verify] == 1.0, per_round
        draft_round, _, verdict, *move = (f"{type(r).__name__}{k}" for r, k in dec.rounds.keys)
        assert per_round[draft_round] == per_round[verdict] == 1.0, per_round
        others = sum(per_round[k] for k in per_round if k.startswith("DraftRunner") and k not in (draft_round, verdict))
        assert others == 0, per_round
        if shape is TREE:  # the rounds' move every round, no other
            assert per_round[move[0]] == 1.0 and per_round.get("TargetRunnermove", 0) == 0, per_round
        assert "prefill" not in dec.verifier.__dict__  # the wrapper is gone


def test_kernel_kinds_of_names_an_h200_profile_showed():
    """round_kernels.py sorts a round's kernels by name (names from torch.profiler on the H200)."""
    assert kind("nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN") == "matmul"
    assert kind("triton_per_fused_mm_t_view_12") == "matmul"  # Inductor's one-row matmul
    assert kind("triton_tem_fused__to_copy_bmm_transpose_view_6") == "matmul"
    assert kind("triton_red_fused__to_copy__unsafe_view_add_argmax_copy__index_copy_mm_select_view_24") == "matmul"
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64") == "attention"
    assert kind("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_add") == "pointwise"
    assert kind("triton_red_fused__unsafe_view_argmax_select_20") == "selection"
    assert kind("Memset (Device)") == kind("Memcpy DtoH (Device -> Pageable)") == "copy"
    assert kind("triton_per_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_16") == "reduction"
    assert kind("mkldnn::_linear_pointwise") == kind("aten::addmm") == "matmul" and kind("aten::mul") == "pointwise"


def test_a_rounds_kernels_are_the_long_profile_less_the_short_one(llama, seqs, drafts):
    """Per round: a long generation's operators less a short one's, over the rounds between (CPU: operators)."""
    p = prompts(seqs)[0]
    dec = decoder(llama, *drafts["trained"], static_shapes=True, **CHAIN)
    dec.generate(p, 24)
    row = per_round(dec, p, 6, 24, plain=False)
    assert row["rounds"] > 0
    kinds = by_kind(row)
    assert kinds["matmul"]["calls"] > 0 and kinds["attention"]["calls"] > 0
    assert sum(v["calls"] for v in kinds.values()) == pytest.approx(sum(c for c, _ in row["kernels"].values()))
    plain = per_round(decoder(llama, static_shapes=True), p, 6, 24, plain=True)
    assert plain["rounds"] == 18  # a plain round is one token


def test_sampled_arms_make_the_same_tokens(llama, seqs, drafts):
    """--temperature: every arm samples with seed 0, so rounds whose next batch is queued before a read-back
    (--rounds on) and rounds read back batch by batch (--rounds batched) make the tokens of the reference round
    that reads each verdict back (decoding.HostRound): a timing compares like with like."""
    hot, p = SamplingParams(temperature=1.0), prompts(seqs)[0]
    for shape in (CHAIN, TREE):
        def make(**kw):
            return decoder(llama, *drafts["perturbed"], static_shapes=True, **shape, **kw)
        on = warmed(make, "none", "default", "on", "ours", p, 16, False, hot)
        on.rounds_overlap = True  # as on CUDA
        batched = warmed(make, "none", "default", "batched", "ours", p, 16, False, hot)
        assert not batched.rounds_overlap and on._sampled and batched._sampled  # the warm-ups ran sampled rounds
        ref = generation(host_rounds(make()), p, 24, False, hot).tokens
        assert generation(on, p, 24, False, hot).tokens == generation(batched, p, 24, False, hot).tokens == ref


def test_kinds_with_nothing_in_a_round_print_a_dash():
    """A profile difference of about nothing (or below it) is no time: "-", never "-0.000" (a plain step's
    attention, fused into Inductor's kernels, once printed so)."""
    assert ms_cell(-0.3) == ms_cell(0.0) == ms_cell(0.2) == "-"
    assert ms_cell(198.0) == "0.198" and ms_cell(1303.4) == "1.303"


def test_the_benchmark_runs_a_plain_decoder_beside_a_chain(tmp_path):
    """`decode_steps.py --modes plain,chain`: the plain arm is a decoder without a draft, which has no rounds to
    switch (it once failed there on its first line, on every machine). On the CPU only the round is timed."""
    import json

    from chat_target import make_target
    from decode_steps import main

    make_target(tmp_path / "t")
    out = tmp_path / "steps.json"
    assert main(["--target", str(tmp_path / "t"), "--random-draft", "--device", "cpu", "--new", "6", "--repeats", "1",
                 "--modes", "plain,chain", "--prompt-len", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"plain", "chain K=7"} and rows["plain"]["round_ms"] > 0 and rows["chain K=7"]["round_ms"] > 0
