"""The full-batch rule shared by both backends (stare_agent/batching.py): verdicts, refill room, stop rules."""

from __future__ import annotations

import math

import pytest

from stare_agent.batching import (
    EPISODE_STATS,
    BatchFill,
    SandboxFailures,
    dispatch_count,
    end_message,
    episode_stats,
    group_verdict,
)


def test_a_group_is_dropped_for_the_sandbox_first_then_the_prompt_then_equal_rewards():
    ok, no = [False] * 3, [False] * 3
    assert group_verdict([1.0, 0.0, 1.0], ok, no, drop_equal=True) == "kept"
    assert group_verdict([1.0, 1.0, 1.0], ok, no, drop_equal=True) == "equal"
    assert group_verdict([1.0, 1.0, 1.0], ok, no, drop_equal=False) == "kept"  # no dynamic sampling
    assert group_verdict([None, 1.0, 0.0], [True, False, False], no, drop_equal=True) == "sandbox"
    assert group_verdict([0.0, 0.0, 0.0], [False, False, True], [True] * 3, drop_equal=True) == "sandbox"
    assert group_verdict([0.0, 0.0, 0.0], ok, [True, False, False], drop_equal=False) == "prompt_too_long"
    with pytest.raises(ValueError, match="unscored episode"):
        group_verdict([None, 1.0, 0.0], ok, no, drop_equal=True)


def test_room_asks_for_what_the_batch_needs_within_the_budget():
    fill = BatchFill(target=4, budget=7, max_sandbox_failure_fraction=0.5)
    assert fill.room() == 4
    for verdict in ("kept", "equal", "kept", "sandbox"):
        fill.record(verdict)
    assert fill.room() == 2 and not fill.full
    fill.record("kept")
    fill.record("prompt_too_long")
    assert fill.room() == 1  # 1 needed, 1 left of the budget
    fill.record("equal")
    assert fill.room() == 0 and not fill.full  # the budget is spent: the batch stays partial
    assert fill.metrics() == {
        "rollout/groups_kept": 3.0,
        "rollout/groups_surplus": 0.0,
        "rollout/groups_cancelled": 0.0,
        "rollout/groups_dropped_equal": 2.0,
        "rollout/groups_dropped_sandbox": 1.0,
        "rollout/groups_dropped_prompt_too_long": 1.0,
        "rollout/prompts_consumed": 7.0,
    }
    assert "consumed 7 prompts (rollout.max_prompts_per_step=7) and kept 3 of the 4 groups" in fill.why_not_full()
    assert "(dropped: 2 equal, 1 sandbox, 1 prompt too long)" in fill.why_not_full()


def test_a_full_batch_counts_later_groups_as_surplus_and_trains_none_of_them():
    fill = BatchFill(target=2, budget=6, max_sandbox_failure_fraction=0.5)
    assert fill.keep_rate() is None
    assert [fill.record(v) for v in ("kept", "equal", "kept")] == ["kept", "equal", "kept"]
    assert fill.full and fill.room() == 0
    assert [fill.record(v) for v in ("kept", "equal")] == ["surplus", "equal"]  # up-front dispatch's late groups
    assert (fill.kept, fill.surplus, fill.consumed) == (2, 1, 5)
    assert fill.keep_rate() == 3 / 5  # what carried a signal, surplus included
    metrics = fill.metrics()
    assert metrics["rollout/groups_kept"] == 2 and metrics["rollout/groups_surplus"] == 1
    assert metrics["rollout/prompts_consumed"] == 5 and metrics["rollout/groups_dropped_equal"] == 2
    fill.cancel()  # a group still generating when the batch was full (openrlhf): consumed, not judged
    assert (fill.consumed, fill.cancelled, fill.keep_rate()) == (6, 1, 3 / 5)
    assert fill.metrics()["rollout/groups_cancelled"] == 1


@pytest.mark.parametrize(
    ("need", "budget_left", "rate", "factor", "expected"),
    [
        (8, 64, 1.0, 2.0, 8),  # everything kept last step: what is needed
        (8, 64, 0.5, 2.0, 16),  # half kept: twice the need
        (8, 64, 0.5, 1.0, 8),  # the factor caps it: exactly the need
        (8, 64, 0.1, 3.0, 24),  # a low rate: capped at factor x need
        (8, 10, 0.5, 2.0, 10),  # never beyond what the step may still consume
        (8, 5, 0.5, 2.0, 5),  # the budget below the need: what is left
        (3, 64, 0.6, 2.0, 5),  # ceil(3 / 0.6) = 5
        (0, 64, 0.5, 2.0, 0),
    ],
)
def test_dispatch_count(need, budget_left, rate, factor, expected):
    assert dispatch_count(need, budget_left, rate, factor) == expected


@pytest.mark.parametrize(
    ("need", "budget_left", "rate", "factor", "in_flight", "expected"),
    [
        (2, 60, 1.0, 1.0, 1, 1),  # factor 1: one dropped group, one new prompt (OpenRLHF's refill)
        (2, 60, 0.5, 2.0, 3, 1),  # 4 groups should be out for 2 more at a keep rate of 1/2
        (2, 60, 0.5, 2.0, 4, 0),  # enough in flight already
        (2, 60, 0.5, 2.0, 9, 0),  # more in flight than wanted: nothing, never negative
        (4, 1, 0.5, 2.0, 2, 1),  # what the step may still consume
    ],
)
def test_dispatch_count_counts_the_groups_in_flight(need, budget_left, rate, factor, in_flight, expected):
    assert dispatch_count(need, budget_left, rate, factor, in_flight) == expected


def test_the_sandbox_stop_fires_above_the_fraction_only():
    fill = BatchFill(target=2, budget=8, max_sandbox_failure_fraction=0.5)
    for verdict in ("sandbox", "kept"):
        fill.record(verdict)
    fill.check_sandbox()  # 1 of 2 is not above 0.5
    fill.record("sandbox")
    with pytest.raises(SandboxFailures, match="2 of the 3 groups of this step failed in the sandbox"):
        fill.check_sandbox()
    BatchFill(target=1, budget=1, max_sandbox_failure_fraction=0.0).check_sandbox()  # nothing consumed yet


def test_budget_below_the_batch_is_refused():
    with pytest.raises(ValueError, match="budget >= target"):
        BatchFill(target=4, budget=3, max_sandbox_failure_fraction=0.5)


def test_end_message_says_how_many_steps_and_why():
    assert end_message(5, 5, "") == "trained 5 of 5 steps"
    assert end_message(2, 5, "no prompts") == "trained 2 of 5 steps; stopped early: no prompts"


def test_episode_stats_and_the_step_s_rollout_metrics():
    from stare_agent.agent import EpisodeResult, Turn

    call = Turn("<code>1/0</code>", 2, code="1/0", status="error", duration_ms=500.0, observation_tokens=2)
    turns = [call, Turn("so", 1), Turn("<answer>3</answer>", 1), Turn("\\boxed{3}", 1)]
    answered = EpisodeResult("p", [1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 0, 0, 1], [0.0] * 7, 2, turns,
                             "3", 1.0, "answer")  # fmt: skip
    too_long = EpisodeResult("p", [1, 2], [0, 0], [0.0] * 2, 2, [], None, None, "length")
    stats = episode_stats(answered)
    assert tuple(stats) == EPISODE_STATS
    assert (stats["response_length"], stats["sampled_tokens"], stats["tool_output_tokens"]) == (5, 3, 2)
    assert (stats["turns"], stats["tool_calls"], stats["tool_errors"], stats["tool_seconds"]) == (4, 1, 1, 0.5)
    assert stats["void_turns"] == 1  # "so": neither a code block nor an answer
    long_stats = episode_stats(too_long)
    assert math.isnan(long_stats["reward"]) and long_stats["prompt_too_long"] == 1
    assert long_stats["finish_length"] == 0  # counted as a prompt with no room, not a response cut at the budget

    fill = BatchFill(1, 4, 0.5)
    assert fill.add_group([long_stats, stats], drop_equal=True) == "prompt_too_long"
    assert fill.add_group([stats, {**stats, "reward": 0.0}], drop_equal=True) == "kept"
    metrics = fill.metrics()
    assert metrics["rollout/episodes"] == 4 and metrics["rollout/prompts_consumed"] == 2
    assert metrics["rollout/reward"] == pytest.approx(2 / 3)  # over the 3 scored episodes
    assert metrics["rollout/sampled_tokens"] == pytest.approx(9 / 4)  # over all 4, the dropped group's too
    assert metrics["rollout/prompt_too_long"] == 0.25 and metrics["rollout/finish_answer"] == 0.75


@pytest.mark.parametrize("factor", [1.0, 1.5, 2.0, 3.0, 8.0])
def test_a_step_never_has_more_groups_out_than_its_config_says(factor):
    """Whatever the keep rate and however the groups come back, what dispatch_count keeps out never exceeds
    RolloutConfig.max_groups_in_flight, which sizes the sandbox (stateful episodes in flight)."""
    from stare_agent.config import RolloutConfig

    rollout = RolloutConfig(prompts_per_step=5, group_size=2, max_dispatch_factor=factor, max_prompts_per_step=30)
    bound = rollout.max_groups_in_flight
    assert bound == min(30, max(5, int(factor * 5)))
    for rate in (1.0, 0.7, 0.5, 0.2, 0.01):
        for kept in range(5):
            for in_flight in range(bound + 1):
                new = dispatch_count(5 - kept, 30 - in_flight, rate, factor, in_flight)  # in flight: dispatched
                assert in_flight + new <= max(bound, in_flight), (rate, kept, in_flight, new)
