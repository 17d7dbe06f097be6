"""The slot runners (runners.py) on tiny random models (fp32, CPU): a target runner's prefill, tree
blocks and kept branches against plain forwards; a draft runner against the uncached draft; the
compile settings of each side. The decoder built on them is tested in test_decode.py."""

import pytest
import torch
from conftest import no_hooks_left
from decoding import CONTRACT, new_draft
from tiny import tiny_model

from eaglewire.capture import capture
from eaglewire.decode.draft_runner import DraftRunner
from eaglewire.runtime import attention
from eaglewire.runtime.runners import TargetRunner
from eaglewire.targets import shared_copy

pytestmark = pytest.mark.usefixtures("one_thread")


def tree_block(parents):
    """(n, n) bool: row i sees itself and its ancestors (parents[i] < i, -1 for none)."""
    block = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            block[i, j], j = True, parents[j]
    return block


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "deepseek_v3", "gemma", "multimodal", "llama-eager",
                                    "llama-grouped", "qwen3-grouped"])
@pytest.mark.parametrize("static, chunk", [(False, None), (True, None), (True, 5), (True, 3)],
                         ids=["exact", "static", "chunks-overlap", "chunks-even"])
def test_target_runner_matches_full_forward(family, static, chunk):
    """Prefill, a tree block with branches, a kept branch, then more tokens: logits and taps equal
    a plain forward over each path (transformers' own masks, no cache). A static runner prefills in
    chunks: one padded chunk for the 6-token prompt, or chunks of 5 (the last one rewriting rows
    1-4) and of 3."""
    m = tiny_model(family.split("-")[0])
    if family.endswith("eager"):
        m.set_attn_implementation("eager")
    run = m
    if family.endswith("grouped"):  # attention.py's grouped sdpa on the runner's copy; the reference keeps sdpa
        run = shared_copy(m)
        assert attention.use_grouped(run)
    r = TargetRunner(run, CONTRACT, static=static, cuda_graphs=False, sizes=(1, 4, 8))
    assert (r.kv_groups > 1) == family.endswith("grouped")
    if chunk:
        r.prefill_chunk = chunk
    r.reset(32)
    prompt = [5, 17, 99, 3, 42, 7]

    def ref(seq):
        cap = capture(m, torch.tensor(seq)[None], CONTRACT, logits=True)
        return cap.logits[0], cap.taps[0]

    with no_hooks_left(run):
        logits, taps = r.prefill(torch.tensor(prompt))
    assert ((r.prefill_chunk, ("ids",)) in r._static) == static
    L, T = ref(prompt)
    torch.testing.assert_close(logits, L[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(taps, T, atol=1e-5, rtol=1e-5)
    # [root 10] -> 11 -> 13, and 12 under the root: rows see their ancestors only
    logits, taps = r.forward({"ids": torch.tensor([10, 11, 12, 13])}, r.length + torch.tensor([0, 1, 1, 2]),
                             tree_block([-1, 0, 0, 1]))
    for row, path in enumerate([[10], [10, 11], [10, 12], [10, 11, 13]]):
        L, T = ref(prompt + path)
        torch.testing.assert_close(logits[row], L[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(taps[row], T[-1], atol=1e-5, rtol=1e-5)
    r.commit([0, 2])  # keep 10, 12: slot of 12 copied down over 11's
    logits, _ = r.forward({"ids": torch.tensor([20, 21])}, r.length + torch.arange(2),
                          torch.ones(2, 2, dtype=torch.bool).tril())
    torch.testing.assert_close(logits, ref(prompt + [10, 12, 20, 21])[0][-2:], atol=1e-5, rtol=1e-5)
    assert r.length == 8 and r.pending == 2


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_layers_share_one_arena_and_a_kept_branch_moves_in_every_layer(family):
    """Every layer's K/V are views of the runner's arena (DeepSeek-V3's MLA: keys and values of
    different widths, an arena each), so a kept tree branch moves with one gather and one scatter per
    arena. A layer whose shapes do not fit the arena keeps buffers of its own, and is moved too: its
    logits after the move match a plain forward over the kept path."""
    m = tiny_model(family)
    r = TargetRunner(m, CONTRACT, static=False, cuda_graphs=False, sizes=(1, 4))
    r.reset(32)
    prompt = [5, 17, 99, 3, 42, 7]
    r.prefill(torch.tensor(prompt))
    layers = r._layers()
    arena = layers[0].arena
    assert not any(layer.own for layer in layers)
    assert all(layer.keys.untyped_storage().data_ptr() == arena.keys.untyped_storage().data_ptr() for layer in layers)
    # layer 1 as a layer of another shape would be: buffers of its own
    layers[1].keys, layers[1].values, layers[1].own = layers[1].keys.clone(), layers[1].values.clone(), True
    ops = []
    r.move_rows = (lambda move: lambda feed, width: ops.append(1) or move(feed, width))(r.move_rows)
    r.forward({"ids": torch.tensor([10, 11, 12, 13])}, r.length + torch.tensor([0, 1, 1, 2]), tree_block([-1, 0, 0, 1]))
    r.commit([0, 2])  # keep 10, 12: the slot of 12 moves down over 11's, in the arena and in layer 1
    assert ops == [1]
    logits, _ = r.forward({"ids": torch.tensor([20])}, r.length)
    ref = capture(m, torch.tensor([prompt + [10, 12, 20]]), CONTRACT, logits=True).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, atol=1e-5, rtol=1e-5)
    a = type(arena)(2)  # shapes that do not fit the arena's first layer: None
    k = torch.zeros(1, 2, 1, 4)
    assert a.views(0, k, k, 8) is not None and a.views(1, torch.zeros(1, 3, 1, 4), k, 8) is None


@pytest.mark.parametrize("static", [False, True])
def test_draft_runner_matches_uncached_draft(static):
    d = new_draft(tiny_model("llama"), draft_vocab=100)
    seq, taps = torch.randint(0, 128, (12,)), torch.randn(12, 96)
    full, _ = d(seq[None], d.fuse(taps[None]), torch.arange(12)[None])
    r = DraftRunner(d, static=static, cuda_graphs=False, sizes=(1, 4), max_pending=4)
    r.reset(32)
    logits, h = r.forward({"ids": seq[:8], "taps": taps[:8]}, torch.arange(8),
                          torch.ones(8, 8, dtype=torch.bool).tril())
    r.commit(8)
    torch.testing.assert_close(logits, full[0, :8], atol=1e-5, rtol=1e-5)
    # a speculative step on the draft's own hidden state, then dropped: the extend after it is unaffected
    step, _ = r.forward({"ids": seq[8:9], "hidden": h[-1:]}, torch.tensor([8]), torch.ones(1, 1, dtype=torch.bool))
    own, _ = d(seq[None, :9], torch.cat([d.fuse(taps[None, :8]), h[None, -1:]], 1), torch.arange(9)[None])
    torch.testing.assert_close(step, own[0, -1:], atol=1e-5, rtol=1e-5)
    r.commit(0)
    logits, _ = r.forward({"ids": seq[8:11], "taps": taps[8:11]}, 8,  # positions 8, 9, 10 as an int
                          torch.ones(3, 3, dtype=torch.bool).tril())
    torch.testing.assert_close(logits, full[0, 8:11], atol=1e-5, rtol=1e-5)


def test_target_forwards_autotune_their_matmuls_on_cuda_only():
    """The target's compiled forwards get torch's "max-autotune-no-cudagraphs" settings on CUDA (the
    mode's own option list, so a torch that changes it shows here), quietly; the draft's and every
    CPU compile keep inductor's defaults. torch.compile checks option names when it is called."""
    import torch._inductor as inductor

    from eaglewire.runtime.compiled import compile_options

    opts = compile_options(torch.device("cuda"), autotune=True)
    assert inductor.list_mode_options("max-autotune-no-cudagraphs").items() <= opts.items()
    assert opts.get("autotune_num_choices_displayed") == 0
    torch.compile(lambda x: x, dynamic=False, options=opts)  # an unknown option name raises here
    assert compile_options(torch.device("cpu"), autotune=True) == compile_options(torch.device("cuda"), False) == {}
    assert TargetRunner.autotune and not DraftRunner.autotune


def test_only_single_row_forwards_are_autotuned(monkeypatch):
    """Autotuning pays for a 1-row decode step only: on the H200 it made the plain step faster and an 8-row verify 25%
    slower (benchmarks/results/2026-11-29-run08-autotune-plain-step.md), and a prefill chunk runs once a prompt.
    Other sizes go through a compiled function without autotuning: on CUDA a separate torch.compile wrapper, on a
    CPU the same one (nothing is autotuned)."""
    import eaglewire.runtime.runners as runners

    asked = []
    monkeypatch.setattr(runners, "compile_options", lambda device, autotune: asked.append(autotune) or {})

    class Tuned(runners.SlotRunner):
        autotune = True

    cuda = Tuned(torch.device("cuda"), static=True, cuda_graphs=False, sizes=(1,), compile=True)
    assert asked == [True, False] and cuda._compiled_untuned is not cuda._compiled  # torch.compile is lazy
    r = TargetRunner(tiny_model("llama"), CONTRACT, static=True, cuda_graphs=False, sizes=(1, 3), max_pending=4,
                     compile=True)
    assert r._compiled_untuned is r._compiled
    calls = []

    def spy(kind):
        return lambda feed, view_len: calls.append((kind, feed["pos"].shape[1])) or r.masked_forward(feed, view_len)

    r._compiled, r._compiled_untuned = spy("tuned"), spy("untuned")
    r.prefill_chunk = 4
    r.reset(32)
    r.prefill(torch.tensor([5, 17, 99, 3, 42, 7]))
    r.forward({"ids": torch.tensor([10])}, torch.tensor([r.length]))
    r.forward({"ids": torch.tensor([11, 12, 13])}, torch.arange(r.length, r.length + 3))
    # the first call after a new cache runs eagerly (it allocates the K/V buffers), so no second prefill call
    assert calls == [("untuned", 4), ("tuned", 1), ("untuned", 3)], calls


def test_autotuning_skips_are_not_logged_as_errors():
    """Inductor logs each matmul template it skips while autotuning as an ERROR (torch/_inductor/
    select_algorithm.py, "Runtime error during autotuning ... Ignoring this choice."); those records
    are dropped once the target's options are asked for, the logger's other records are not."""
    import logging

    from eaglewire.runtime.compiled import _SkippedChoice, compile_options

    compile_options(torch.device("cuda"), autotune=True)
    compile_options(torch.device("cuda"), autotune=True)
    log = logging.getLogger("torch._inductor.select_algorithm")
    assert sum(isinstance(f, _SkippedChoice) for f in log.filters) == 1  # added once

    def passes(msg):
        return log.filter(logging.LogRecord(log.name, logging.ERROR, __file__, 1, msg, ("x",), None))

    assert not passes("Runtime error during autotuning: \n%s. \nIgnoring this choice.")
    assert passes("something else went wrong: %s")


@pytest.mark.parametrize("static", [False, True])
def test_a_windowed_draft_runner_counts_positions_through_a_moved_tree_branch(static):
    """A draft with a sliding window (speculators' default, vLLM applies it) in the slot runner: the window is over
    positions, and a committed tree branch's slots move down with their positions. Reference: the draft's own
    uncached forward over the accepted sequence."""
    import dataclasses

    from eaglewire.draft import Eagle3Draft

    plain = new_draft(tiny_model("llama"), draft_vocab=100)
    d = Eagle3Draft(dataclasses.replace(plain.config, sliding_window=3)).eval()
    d.load_state_dict(plain.state_dict())
    seq, taps = torch.randint(0, 128, (12,)), torch.randn(12, 96)
    r = DraftRunner(d, static=static, cuda_graphs=False, sizes=(1, 4), max_pending=4)
    r.reset(32)
    logits, _ = r.forward({"ids": seq[:6], "taps": taps[:6]}, torch.arange(6), torch.ones(6, 6, dtype=torch.bool).tril())
    r.commit(6)
    with torch.no_grad():
        full, _ = d(seq[None, :6], d.fuse(taps[None, :6]), torch.arange(6)[None])
    torch.testing.assert_close(logits, full[0], atol=1e-5, rtol=1e-5)
    # a tree: 6 (depth 0), two children at position 7, a grandchild at 8 under the second; keep 6, 7, 8: the
    # grandchild's slot moves down over the second child's, which held position 7
    block = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    pick = [6, 11, 7, 8]
    r.forward({"ids": seq[pick], "taps": taps[pick]}, torch.tensor([6, 7, 7, 8]), block)
    r.commit([0, 2, 3])
    logits, _ = r.forward({"ids": seq[9:11], "taps": taps[9:11]}, 9, torch.ones(2, 2, dtype=torch.bool).tril())
    with torch.no_grad():
        full, _ = d(seq[None, :11], d.fuse(taps[None, :11]), torch.arange(11)[None])
        unwindowed, _ = plain(seq[None, :11], plain.fuse(taps[None, :11]), torch.arange(11)[None])
    torch.testing.assert_close(logits, full[0, 9:11], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits, unwindowed[0, 9:11], atol=1e-3)
