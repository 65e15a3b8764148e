"""One RL step's batch: exactly `prompts_per_step` groups that carry a signal, or the run ends.

The rule both backends follow (DESIGN 4, "steps" in docs/stare.md): a step trains one full batch of
`rollout.prompts_per_step` groups. A group is dropped when it cannot be trained on:

- `sandbox`: an episode's sandbox failed (not the model's fault, never scored as wrong);
- `prompt_too_long`: the prompt leaves no room for a response under the episode budget;
- `equal`: every reward in the group is the same (no GRPO signal; only with rollout.dynamic_sampling).

Dropped groups are replaced by new prompts from the prompt stream (endless passes over the prompt file) until the
batch is full. Prompts are dispatched up front (`dispatch_count`): the groups still needed divided by the keep rate
of the last step (rollout.initial_keep_rate at the first), at most rollout.max_dispatch_factor times the need, so
that the groups dynamic sampling drops are replaced in the same round rather than by one refill after another.
Groups kept after the batch is full are not trained (the update is on-policy): they are counted as surplus
(`rollout/groups_surplus`) and their prompts as consumed; where generation runs asynchronously (the openrlhf
backend), groups still being generated when the batch is full are stopped (`rollout/groups_cancelled`), their
prompts consumed too. Later rounds (the local loop) or each finished group (openrlhf) dispatch what is then still
needed, counting the groups in flight. Two things stop a run instead of training a partial
batch:

- the step has consumed `rollout.max_prompts_per_step` prompts and the batch is still not full
  (the filter rate is too high for the run to make progress): the run ends cleanly after the steps it trained;
- more than `rollout.max_sandbox_failure_fraction` of the step's groups failed in the sandbox: the sandbox is
  broken, and the run stops with an error rather than burn the prompt set.

Plain Python: the local loop and the OpenRLHF trainer actor both use `BatchFill`, so the rule, its
counts, the step's episode statistics and their metric names (docs/metrics.md) live here once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from stare_agent.protocol import is_void_turn

if TYPE_CHECKING:
    from stare_agent.agent import EpisodeResult

Verdict = Literal["kept", "equal", "sandbox", "prompt_too_long"]
DROP_REASONS: tuple[Verdict, ...] = ("equal", "sandbox", "prompt_too_long")


class SandboxFailures(RuntimeError):
    """A step's share of groups dropped for sandbox failures exceeded rollout.max_sandbox_failure_fraction."""


class NoStepTrained(RuntimeError):
    """The run ended before it trained one full batch."""


def group_verdict(
    rewards: Sequence[float | None],
    sandbox_failed: Sequence[bool],
    prompt_too_long: Sequence[bool],
    *,
    drop_equal: bool,
) -> Verdict:
    """Whether one prompt's group is trained on, and if not, why (the first reason that applies, in this order).

    rewards: one per episode (None where the episode could not be scored); sandbox_failed, prompt_too_long:
    per episode. A group is dropped for the sandbox if any episode's sandbox failed, for the prompt if it left no
    room for a response, and (drop_equal) for equal rewards.
    """
    if any(sandbox_failed):
        return "sandbox"
    if any(prompt_too_long):
        return "prompt_too_long"
    if any(r is None for r in rewards):
        raise ValueError("a group has an unscored episode that is neither a sandbox failure nor a too-long prompt")
    if drop_equal and len(set(rewards)) <= 1:
        return "equal"
    return "kept"


EPISODE_STATS = (
    "reward",
    "response_length",
    "sampled_tokens",
    "tool_output_tokens",
    "turns",
    "tool_calls",
    "tool_errors",
    "tool_seconds",
    "void_turns",
    "finish_answer",
    "finish_eos",
    "finish_length",
    "finish_tool_limit",
    "finish_sandbox_error",
    "finish_invalid_token",
    "prompt_too_long",
)
"""The numbers of one episode, the same keys for every episode: OpenRLHF merges per-sample logs key by key."""


def episode_stats(result: EpisodeResult) -> dict[str, float]:
    """One episode's numbers (EPISODE_STATS), which a step averages into its rollout/ metrics.

    reward is NaN when the episode could not be scored (sandbox failure, or no room for a response); a prompt with
    no room for a response counts under prompt_too_long, not finish_length.
    """
    too_long, finish = result.prompt_too_long, result.finish_reason
    sampled = sum(result.action_mask)
    stats = {
        "reward": math.nan if result.reward is None or too_long else float(result.reward),
        "response_length": float(result.response_len),
        "sampled_tokens": float(sampled),
        "tool_output_tokens": float(result.response_len - sampled),
        "turns": float(len(result.turns)),
        "tool_calls": float(result.tool_calls),
        "tool_errors": float(result.tool_errors),
        "tool_seconds": sum(turn.duration_ms for turn in result.turns) / 1000,
        "void_turns": float(sum(is_void_turn(turn.text) for turn in result.turns)),
        "finish_answer": float(finish == "answer"),
        "finish_eos": float(finish == "eos"),
        "finish_length": float(finish == "length" and not too_long),
        "finish_tool_limit": float(finish == "tool_limit"),
        "finish_sandbox_error": float(finish == "sandbox_error"),
        "finish_invalid_token": float(finish == "invalid_token"),
        "prompt_too_long": float(too_long),
    }
    assert tuple(stats) == EPISODE_STATS
    return stats


def rollout_metrics(episodes: Sequence[dict[str, float]]) -> dict[str, float]:
    """The step's rollout/ metrics from its episodes' `episode_stats`: means over every episode generated (kept
    groups and dropped ones); reward and accuracy over the scored episodes only."""
    n = max(len(episodes), 1)
    scored = [e["reward"] for e in episodes if not math.isnan(e["reward"])]
    metrics = {
        "rollout/episodes": float(len(episodes)),
        "rollout/reward": sum(scored) / max(len(scored), 1),
        "rollout/accuracy": sum(r == 1.0 for r in scored) / max(len(scored), 1),
    }
    for key in EPISODE_STATS:
        if key != "reward":
            metrics[f"rollout/{key}"] = sum(e[key] for e in episodes) / n
    return metrics


@dataclass
class BatchFill:
    """The accounting of one step's batch while it is filled.

    target: groups in a full batch (rollout.prompts_per_step); budget: prompts the step may consume
    (rollout.max_prompts_per_step); max_sandbox_failure_fraction: the share of consumed groups dropped for the
    sandbox above which the run stops.
    """

    target: int
    budget: int
    max_sandbox_failure_fraction: float
    kept: int = 0
    surplus: int = 0
    """Groups that would have been kept but came after the batch was full: not trained."""
    cancelled: int = 0
    """Groups still being generated when the batch was full, stopped there (openrlhf backend): not trained."""
    consumed: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    episodes: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.target < 1 or self.budget < self.target:
            raise ValueError(f"a batch needs target >= 1 and budget >= target; got {self.target}, {self.budget}")

    @property
    def full(self) -> bool:
        return self.kept >= self.target

    def room(self) -> int:
        """Prompts to draw now: what the batch still needs, within what is left of the budget."""
        return max(0, min(self.target - self.kept, self.budget - self.consumed))

    def record(self, verdict: Verdict) -> Verdict | Literal["surplus"]:
        """One consumed prompt's group and its verdict; "surplus" for a group kept after the batch was full."""
        self.consumed += 1
        if verdict != "kept":
            self.dropped[verdict] += 1
        elif self.full:
            self.surplus += 1
            return "surplus"
        else:
            self.kept += 1
        return verdict

    def cancel(self) -> None:
        """One dispatched prompt whose group was stopped unfinished once the batch was full: consumed, no verdict."""
        self.consumed += 1
        self.cancelled += 1

    def keep_rate(self) -> float | None:
        """The share of this step's judged groups that carried a signal (kept or surplus); None before any."""
        judged = self.consumed - self.cancelled
        return (self.kept + self.surplus) / judged if judged else None

    def add_group(self, episodes: Sequence[dict[str, float]], *, drop_equal: bool) -> Verdict | Literal["surplus"]:
        """One consumed prompt's group, from its episodes' `episode_stats`: judged, counted, and its episodes kept
        for the step's rollout metrics (a surplus group's too: they were generated this step)."""
        verdict = group_verdict(
            [None if math.isnan(e["reward"]) else e["reward"] for e in episodes],
            [bool(e["finish_sandbox_error"]) for e in episodes],
            [bool(e["prompt_too_long"]) for e in episodes],
            drop_equal=drop_equal,
        )
        self.episodes.extend(episodes)
        return self.record(verdict)

    def check_sandbox(self) -> None:
        """SandboxFailures when too large a share of this step's groups failed in the sandbox."""
        failed = self.dropped["sandbox"]
        if self.consumed and failed / self.consumed > self.max_sandbox_failure_fraction:
            raise SandboxFailures(
                f"{failed} of the {self.consumed} groups of this step failed in the sandbox, more than "
                f"rollout.max_sandbox_failure_fraction={self.max_sandbox_failure_fraction}: the sandbox is not "
                "working (see the run's log for its errors); stopped with the last checkpoint intact"
            )

    def why_not_full(self) -> str:
        """Why the step ended without a full batch (call when it is not full)."""
        drops = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in self.dropped.items() if n)
        return (
            f"the step consumed {self.consumed} prompts (rollout.max_prompts_per_step={self.budget}) and kept "
            f"{self.kept} of the {self.target} groups a batch needs (dropped: {drops or 'none'})"
        )

    def metrics(self) -> dict[str, float]:
        """The step's group counts and, when its groups came through `add_group`, its episodes' rollout metrics:
        the rollout/ names both backends log."""
        return {
            "rollout/groups_kept": float(self.kept),
            "rollout/groups_surplus": float(self.surplus),
            "rollout/groups_cancelled": float(self.cancelled),
            **{f"rollout/groups_dropped_{reason}": float(n) for reason, n in self.dropped.items()},
            "rollout/prompts_consumed": float(self.consumed),
            **(rollout_metrics(self.episodes) if self.episodes else {}),
        }


def dispatch_count(need: int, budget_left: int, keep_rate: float, max_factor: float, in_flight: int = 0) -> int:
    """Prompts to dispatch now for `need` more groups while `in_flight` groups are still being generated: so that
    need / keep_rate groups (rounded up; at most max_factor x need, at least need) are out in all, within
    `budget_left` (the prompts the step may still consume). With max_factor 1 this replaces each dropped group by
    one prompt, as OpenRLHF does."""
    if need <= 0 or budget_left <= 0:
        return 0
    wanted = math.ceil(need / max(keep_rate, 1e-9) - 1e-9)
    out = max(need, min(wanted, math.floor(max_factor * need)))
    return max(0, min(out - in_flight, budget_left))


def end_message(trained: int, steps: int, reason: str) -> str:
    """The one line a run prints when it ends: how many steps it trained, of how many, and why it stopped."""
    if trained >= steps:
        return f"trained {trained} of {steps} steps"
    return f"trained {trained} of {steps} steps; stopped early: {reason}"
