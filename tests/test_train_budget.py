"""Training under a time budget: where it starts (at the call, set-up counted, or after the first optimizer step,
its compilation apart, as the peers' harness times every trainer: benchmarks/peers/train_eaglewire.py), where it
stops, and the schedule and evaluations that follow the horizon its clock estimates."""

import json
import time
from types import SimpleNamespace

import pytest
import torch
from chat_target import CONTRACT, conversations_file, make_target
from safetensors.torch import load_file

from eaglewire import targets
from eaglewire.checkpoint import load_draft
from eaglewire.data.datagen import run_datagen
from eaglewire.errors import UsageError
from eaglewire.train.config import BudgetClock, TrainConfig, lr_at
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


def weights(path):
    return load_file(str(path / "model.safetensors"))


def test_lr_cosine_ends_at_the_horizon_when_one_is_given():
    cfg = TrainConfig(lr=1e-3, min_lr_ratio=0.1, warmup_steps=10)
    assert lr_at(cfg, 5, 1000, horizon=100) == lr_at(cfg, 5, 1000)  # warmup follows the planned total
    assert lr_at(cfg, 99, 1000, horizon=100) == pytest.approx(1e-4, rel=1e-2)
    assert lr_at(cfg, 500, 1000, horizon=100) == pytest.approx(1e-4)  # past the horizon: the floor
    assert lr_at(cfg, 99, 1000, horizon=5000) == lr_at(cfg, 99, 1000)  # never beyond the plan


def test_default_warmup_is_a_share_of_the_horizon_not_of_the_plan():
    """A budget-stopped run on two H200s (train.log; benchmarks/results/2026-11-30-run12-decoder-defaults.md): 750
    steps under a time budget, planned 27,920; a warmup of 2% of the plan took 558 of them. 2% of the horizon warms
    up for 15, then the cosine runs to the floor."""
    cfg = TrainConfig(lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(cfg, 14, 27920, horizon=750) == pytest.approx(1e-3)
    assert lr_at(cfg, 14, 27920) == pytest.approx(1e-3 * 15 / 558)  # no horizon yet: the plan's warmup
    assert lr_at(cfg, 749, 27920, horizon=750) == pytest.approx(1e-4, rel=1e-2)
    lrs = [lr_at(cfg, s, 27920, horizon=750) for s in range(14, 750)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_a_budget_the_run_fits_in_leaves_the_schedule_alone(setup):
    root, target = setup
    data = root / "data"
    train(TrainConfig(steps=6, **FAST), target, data, out=root / "plain", progress=False)
    timed = train(TrainConfig(steps=6, time_budget_s=3600, **FAST), target, data, out=root / "timed", progress=False)
    assert load_draft(timed.checkpoint)[1].training["lr_horizon"] == 6
    for k, v in weights(root / "plain").items():
        assert torch.equal(v, weights(root / "timed")[k]), k


def test_time_budget_stops_early_and_still_saves(setup):
    root, target = setup
    data = root / "data"
    r = train(TrainConfig(steps=50, time_budget_s=1e-3, **{**FAST, "log_every": 1}), target, data,
              out=root / "budget", progress=False)
    assert r.metrics["steps"] == 1 and "time budget" in r.metrics["stopped_early"]
    meta = json.loads((root / "budget" / "config.json").read_text())
    assert meta["training"]["steps"] == 1 and meta["training"]["planned_steps"] == 50


def test_the_budget_clock_leaves_out_compilation_and_spreads_evaluations():
    """A 300 s budget after 20 s of setup: the first 10 steps take 8 s (compilation), then 0.1 s a step, and an
    evaluation of 6 s every 200 steps. The clock stops the run at step 2,131. Estimated from the last interval
    with its evaluation in it, the horizon fell to a few hundred steps right after each evaluation (what dipped a
    real run's rate for ten steps); estimated from the first interval, it ended the warmup early."""
    clock = BudgetClock(budget_s=300.0, started=0.0, first_step=0)
    now, estimates, stop = 20.0, {}, None
    for done in range(1, 5000):
        now += 8.0 / 10 if done <= 10 else 0.1
        if done % 10 == 0:
            clock.logged(done, 8.0 if done == 10 else 1.0)
            estimates[done] = clock.horizon(done, now)
        if done % 200 == 0:
            now += 6.0  # an evaluation, after the log line
            clock.paused(done, 6.0)
        if now > 300.0:
            stop = done
            break
    assert estimates[10] is None  # one interval, compilation in it: the plan stands
    late = [h for d, h in estimates.items() if d > 200]  # from the first evaluation on
    assert all(abs(h - stop) / stop < 0.03 for h in late), (stop, min(late), max(late))
    for d in (400, 600, 1000):  # the log after an evaluation does not dip
        assert abs(estimates[d + 10] - estimates[d]) / stop < 0.03, (d, estimates[d], estimates[d + 10])


def test_default_evaluations_follow_the_horizon_a_time_budget_moves():
    """Ten evaluations a run by default, spaced over the horizon: when the clock moves the cosine's end
    from step 1000 to step 300, evaluations come every 30 steps, not every 100 (two in the run)."""
    def evaluations(cfg, horizon_at):
        run = SimpleNamespace(cfg=cfg, horizon=horizon_at(0), evaluated_at=0)
        run._eval_spacing = lambda: _Run._eval_spacing(run)
        done_at = []
        for done in range(1, 301):
            run.horizon = horizon_at(done)
            if _Run._eval_due(run, done):
                done_at.append(done)
                run.evaluated_at = done
        return done_at

    moved = lambda done: 1000 if done < 50 else 300  # noqa: E731
    assert evaluations(TrainConfig(steps=1000), moved) == [50, 80, 110, 140, 170, 200, 230, 260, 290]
    assert evaluations(TrainConfig(steps=1000), lambda done: 1000) == [100, 200, 300]
    assert evaluations(TrainConfig(steps=1000, eval_every=70), moved) == [70, 140, 210, 280]  # as given
