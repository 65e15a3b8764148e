"""One RL step's batch: exactly `prompts_per_step` groups that carry a signal, or the run ends.

The rule both backends follow (DESIGN 4, "steps" in docs/stare.md): a step trains one full batch of
`rollout.prompts_per_step` groups. A group is dropped when it cannot be trained on:

- `sandbox`: an episode's sandbox failed (not the model's fault, never scored as wrong);
- `prompt_too_long`: the prompt leaves no room for a response under the episode budget;
- `equal`: every reward in the group is the same (no GRPO signal; only with rollout.dynamic_sampling).

Dropped groups are replaced by new prompts from the prompt stream (endless passes over the prompt file) until the
batch is full. Two things stop a run instead of training a partial batch:

- the step has consumed `rollout.max_prompts_per_step` prompts and the batch is still not full
  (the filter rate is too high for the run to make progress): the run ends cleanly after the steps it trained;
- more than `rollout.max_sandbox_failure_fraction` of the step's groups failed in the sandbox: the sandbox is
  broken, and the run stops with an error rather than burn the prompt set.

Plain Python: the local loop and the OpenRLHF trainer actor both use `BatchFill`, so the rule, its
counts and their metric names live here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

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
    consumed: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))

    def __post_init__(self) -> None:
        if self.target < 1 or self.budget < self.target:
            raise ValueError(f"a batch needs target >= 1 and budget >= target; got {self.target}, {self.budget}")

    @property
    def full(self) -> bool:
        return self.kept >= self.target

    def room(self) -> int:
        """Prompts to draw now: what the batch still needs, within what is left of the budget."""
        return max(0, min(self.target - self.kept, self.budget - self.consumed))

    def record(self, verdict: Verdict) -> None:
        """One consumed prompt's group and its verdict."""
        if verdict == "kept":
            if self.full:
                raise ValueError(f"the batch already holds its {self.target} groups")
            self.kept += 1
        else:
            self.dropped[verdict] += 1
        self.consumed += 1

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
        """The step's group counts, under the names both backends log."""
        return {
            "rollout/groups_kept": float(self.kept),
            **{f"rollout/groups_dropped_{reason}": float(n) for reason, n in self.dropped.items()},
            "rollout/prompts_consumed": float(self.consumed),
        }


def end_message(trained: int, steps: int, reason: str) -> str:
    """The one line a run prints when it ends: how many steps it trained, of how many, and why it stopped."""
    if trained >= steps:
        return f"trained {trained} of {steps} steps"
    return f"trained {trained} of {steps} steps; stopped early: {reason}"
