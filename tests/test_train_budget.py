"""Where a time budget starts: at the call (set-up counts), or after the first optimizer step (its compilation
apart), as the peers' harness times every trainer (benchmarks/peers/train_eaglewire.py)."""

import time

import pytest
from chat_target import CONTRACT, conversations_file, make_target

from eaglewire import targets
from eaglewire.data.datagen import run_datagen
from eaglewire.errors import UsageError
from eaglewire.train.config import TrainConfig
from eaglewire.train.trainer import Trainer as _Run, train

FAST = dict(batch_tokens=512, log_every=1, eval_fraction=0.2, max_len=256, lr=3e-3, eval_every=100)
FIRST_STEP_S = 3.0  # a slow first step, as a compiled one is
BUDGET_S = 2.0
STEP_S = 0.3  # a slow step, as a large online target's is
# Slower still where a check must fall between logs: 20 steps must end inside the budget with up to 0.24 s of
# work each (a 2-core CI machine running two test processes), and 30 steps of sleep alone must pass it
SLOWER_STEP_S = 0.6
SLOW_BUDGET_S = 16.8

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    target = targets.load_target(str(make_target(root / "target")), device="cpu")
    run_datagen(target, conversations_file(root / "prompts.jsonl", 20), root / "data", CONTRACT, max_len=256,
                dtype="fp32", batch_size=5, progress=False)
    return root, target


def _slow_down(monkeypatch, seconds, first_only: bool) -> None:
    """Each training step (or only the first) sleeps `seconds` before it runs."""
    step = _Run._step

    def slow(self, i, *a, **k):
        if i == 0 or not first_only:
            time.sleep(seconds)
        return step(self, i, *a, **k)

    monkeypatch.setattr(_Run, "_step", slow)


@pytest.fixture
def slow_first_step(monkeypatch):
    _slow_down(monkeypatch, FIRST_STEP_S, first_only=True)


@pytest.fixture
def slow_steps(monkeypatch):
    _slow_down(monkeypatch, STEP_S, first_only=False)


@pytest.fixture
def slower_steps(monkeypatch):
    _slow_down(monkeypatch, SLOWER_STEP_S, first_only=False)


@pytest.mark.usefixtures("slow_first_step")
@pytest.mark.parametrize("budget_from,steps", [("setup", 1), ("first-step", 4)])
def test_the_first_step_counts_against_the_budget_only_from_setup(setup, budget_from, steps):
    root, target = setup
    r = train(TrainConfig(steps=4, time_budget_s=BUDGET_S, budget_from=budget_from, **FAST), target, root / "data",
              out=root / budget_from, progress=False)
    assert r.metrics["steps"] == steps
    assert (r.metrics["stopped_early"] is not None) == (budget_from == "setup")
    # the budget's wall time starts where the budget does
    assert (r.metrics["budget_seconds"] > FIRST_STEP_S) == (budget_from == "setup")


def test_an_unknown_budget_start_is_a_usage_error():
    with pytest.raises(UsageError, match="--budget-from"):
        TrainConfig(budget_from="epoch")


@pytest.mark.usefixtures("slow_first_step")
@pytest.mark.parametrize("kept", [0.0, 100.0])
def test_before_loop_sees_the_draft_and_what_it_returns_comes_off_the_budget(setup, kept):
    """A recipe builds its held-out bench around the untrained draft before the first step (recipes._WarmBench) and
    returns what the bench's timed runs will take: training must leave that much of its budget."""
    import json

    root, target = setup
    seen = []
    r = train(TrainConfig(steps=4, time_budget_s=102.0, **FAST), target, root / "data", out=root / f"kept{kept:.0f}",
              progress=False, before_loop=lambda s: seen.append((s.draft.config.num_taps, s.total)) or kept)
    assert seen == [(3, 4)]
    assert r.metrics["steps"] == (4 if kept == 0 else 1)  # 102 - 100 s: the slow first step outlasts what is left
    config = json.loads((root / f"kept{kept:.0f}" / "config.json").read_text())["training"]["config"]
    assert config["time_budget_s"] == 102.0 - kept


@pytest.mark.usefixtures("slower_steps")
def test_a_budget_stops_at_its_estimated_step_between_logs(setup):
    """Slow steps (0.6 s of sleep and some work) and rare logs. The late check runs at logs: at 20 (12-16.8 s) it
    finds time left, at 30 (past 18 s) too late. Training stops at the step the clock was estimated to
    end at instead, from the rate over the two logs, its last interval logged."""
    import json

    root, target = setup
    cfg = TrainConfig(steps=60, time_budget_s=SLOW_BUDGET_S, budget_from="first-step", **{**FAST, "log_every": 10})
    r = train(cfg, target, root / "data", out=root / "slow", progress=False)
    assert r.metrics["steps"] < 30 and "estimated" in r.metrics["stopped_early"]
    assert r.metrics["budget_seconds"] < SLOW_BUDGET_S + 2 * SLOWER_STEP_S
    logged = [json.loads(x) for x in (root / "slow" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in logged if x["kind"] == "train"][-1] == r.metrics["steps"]


@pytest.mark.usefixtures("slow_steps")
def test_one_process_stops_at_the_first_step_past_its_budget_however_far_apart_its_logs(setup):
    """Slow steps and no log before the plan's end: a single process checks its clock after every step, so it
    stops one step past the budget, not minutes later at a log (a recipe on a slow device did)."""
    root, target = setup
    cfg = TrainConfig(steps=60, time_budget_s=BUDGET_S, **{**FAST, "log_every": 100})
    r = train(cfg, target, root / "data", out=root / "rare-logs", progress=False)
    assert r.metrics["steps"] < 20 and "reached" in r.metrics["stopped_early"]
    assert r.metrics["budget_seconds"] < BUDGET_S + 2 * STEP_S
