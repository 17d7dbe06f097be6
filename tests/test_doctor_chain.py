"""The probe's chain replay (doctor/chain.py) against the decoder itself: on the target's own greedy
continuation, the rounds the replay walks are the rounds SpecDecoder ran, accepted token for accepted
token (fp32); and the paired comparison (doctor/paired.py) tells a small consistent difference from
noise where unpaired intervals cannot."""

import pytest
import torch

from eaglewire.doctor import chain, paired
from eaglewire.doctor.probe_inputs import capture_states

from decoding import CONTRACT, decoder, prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("K", [1, 3, 5])
def test_the_replayed_chain_walks_the_decoders_rounds(llama, drafts, seqs, K):
    draft, meta = drafts["trained"]
    dec = decoder(llama, draft, meta, mode="chain", K=K, prepack=False, fuse_projections=False)
    compared = accepted = 0
    for p in prompts(seqs):
        res = dec.generate(torch.tensor(p), 30)
        ids = torch.tensor(p + res.tokens)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[len(p):] = True
        st = capture_states(llama.model, ids)
        taps = torch.cat([st[t] for t in CONTRACT.taps], dim=-1)
        starts, runs = chain.run_lengths(draft, taps, ids, mask, st["top"], K)[:2]
        walked = chain.walk(starts, runs)
        # the decoder's last round may accept past max_new_tokens, which the replay cannot see
        assert walked[:-1] == res.accepted_per_step[:len(walked) - 1], p
        compared += len(walked) - 1
        accepted += sum(walked[:-1])
    assert compared > 20 and accepted > compared // 4  # rounds that accepted something, not only misses


def test_summary_is_the_walk_and_the_trainers_estimate_apart():
    """acceptance_length counts the decoder's rounds; acceptance_length_all_starts averages every start, which
    counts a long easy stretch once per position: on a sequence half easy, half hard they differ a lot."""
    K, T = 7, 64
    starts = torch.ones(T, dtype=torch.bool)
    runs = torch.cat([torch.full((T // 2,), K), torch.zeros(T // 2, dtype=torch.long)])
    rounds = chain.walk(starts, runs)
    assert rounds[:4] == [K] * 4 and set(rounds[4:]) == {0}
    walked = (sum(rounds) + len(rounds)) / len(rounds)
    uniform = 1 + runs.float().mean().item()
    assert walked < 2.0 < 4.0 < uniform


def _per_prompt(tokens, rounds, hits, starts):
    f = lambda x: torch.as_tensor(x, dtype=torch.float64)  # noqa: E731
    return paired.PerPrompt(f(tokens), f(rounds), f(hits), f(starts))


def test_paired_comparison_finds_a_small_consistent_gain_that_unpaired_intervals_miss():
    """40 prompts of very different difficulty (acceptance length 1.2 to 4.0); the alternative wiring gains
    5% on every one of them. Paired by prompt that is plain; wiring by wiring, the prompts' spread hides it."""
    g = torch.Generator().manual_seed(0)
    P = 40
    rounds = torch.full((P,), 50.0)
    base_len = 1.2 + 2.8 * torch.rand(P, generator=g)
    alt_len = base_len * (1.05 + 0.01 * torch.randn(P, generator=g))
    starts = torch.full((P,), 120.0)
    base_hits = (starts * (base_len - 1) / 3).round()
    base = _per_prompt(base_len * rounds, rounds, base_hits, starts)
    alt = _per_prompt(alt_len * rounds, rounds, (base_hits * 1.04).round(), starts)
    same = _per_prompt(base_len * rounds, rounds, base_hits, starts)
    worse = _per_prompt(base_len * rounds * 0.9, rounds, base_hits, starts)
    d_alt, d_same, d_worse = paired.compare(base, [alt, same, worse])
    assert d_alt.better and 0.03 < d_alt.cost < 0.07
    assert not d_same.better and not d_same.worse and d_same.length_ci == (0.0, 0.0)
    assert d_worse.worse and not d_worse.better
    # the same data compared unpaired (each wiring resampled on its own) cannot tell the gain from noise
    lo, hi = _unpaired_interval(base, alt, len([alt, same, worse]))
    assert lo < 0 < hi


def _unpaired_interval(a: paired.PerPrompt, b: paired.PerPrompt, m: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(1)
    P, B = a.tokens.numel(), paired.RESAMPLES

    def boot(x):
        idx = torch.randint(0, P, (B, P), generator=g)
        return x.tokens[idx].sum(1) / x.rounds[idx].sum(1)

    d = boot(b) - boot(a)
    tail = (1 - paired.LEVEL) / (2 * m)
    q = torch.quantile(d, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return float(q[0]), float(q[1])
