"""STARE over OpenRLHF's micro-batches: one controller call over the whole step, weights split back per micro-batch."""

from __future__ import annotations

import pytest
import torch

from stare_agent.config import RLConfig
from stare_agent.entropy_control import EntropyControl, EntropyControlConfig
from stare_agent.stare import StareConfig, StareController
from stare_agent.step import MicroBatch, control_step
from stare_agent.theory import REGIMES


def rollout_batch(rows: int = 12, width: int = 20, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows with a prompt (mask 0), then action tokens up to a random end, then padding; one advantage per row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r in range(rows):
        start, end = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(8, width + 1, (1,), generator=g))
        mask[r, start:end] = True
    row_adv = torch.randn(rows, generator=g)
    entropy = torch.rand(rows, width, generator=g) * 2
    return {
        "log_probs": -torch.rand(rows, width, generator=g) * 4,
        "advantages": row_adv[:, None].expand(rows, width) * mask,
        "mask": mask,
        "entropy": entropy,
        "s2": entropy**2 + torch.rand(rows, width, generator=g),
    }


def split(batch: dict[str, torch.Tensor], bounds: list[tuple[int, int]]) -> list[MicroBatch]:
    """Micro-batches of the given rows, each cut to its own width (its longest row), as OpenRLHF pads them."""
    parts = []
    for lo, hi in bounds:
        t = int(batch["mask"][lo:hi].nonzero()[:, 1].max()) + 1
        parts.append(
            MicroBatch(
                batch["log_probs"][lo:hi, :t],
                batch["advantages"][lo:hi, :t],
                batch["mask"][lo:hi, :t],
                batch["entropy"][lo:hi, :t],
                batch["s2"][lo:hi, :t],
            )
        )
    return parts


CONFIG = StareConfig(op="O1", top_ratio=0.2, w=1.5, target_entropy=5.0, gate="batch")


def stare(config: StareConfig) -> EntropyControl:
    return EntropyControl(RLConfig(entropy_control=EntropyControlConfig("stare"), stare=config))


def test_micro_batches_get_the_weights_of_the_whole_batch():
    batch = rollout_batch()
    parts = split(batch, [(0, 5), (5, 9), (9, 12)])
    assert len({p.action_mask.shape[1] for p in parts}) > 1  # really different widths
    weights, metrics = control_step(stare(CONFIG), parts)

    surprisal = torch.where(batch["mask"], -batch["log_probs"], torch.zeros(()))
    whole, _ = StareController(CONFIG)(surprisal, batch["advantages"], batch["mask"], batch["entropy"])
    for (lo, hi), part, w in zip([(0, 5), (5, 9), (9, 12)], parts, weights, strict=True):
        assert w.shape == part.action_mask.shape
        torch.testing.assert_close(w, whole[lo:hi, : w.shape[1]])
    assert (torch.cat([w.flatten() for w in weights]) > 1).any() and metrics["stare/gate"] == 1.0
    assert sum(v for k, v in metrics.items() if k.startswith("theory/regime_")) == 1.0


def test_the_selection_is_over_the_whole_step_not_each_micro_batch():
    """The most surprising positive-advantage tokens all sit in the first micro-batch: the second gets none."""
    batch = rollout_batch(rows=8, seed=1)
    batch["advantages"] = batch["advantages"].abs()  # all positive
    batch["log_probs"][:4] -= 10.0  # rows 0-3: far more surprising
    control = stare(CONFIG)
    weights, _ = control_step(control, split(batch, [(0, 4), (4, 8)]))
    assert (weights[0] > 1).any() and (weights[1] == 1).all()
    assert control.stare.step == 1 and control.step == 1  # one call per optimizer step


def test_the_gate_reads_the_mean_entropy_of_the_whole_step():
    batch = rollout_batch(rows=8, seed=2)
    batch["entropy"][:4] = 0.01  # the first micro-batch alone is far below the target, the step is above it
    batch["entropy"][4:] = 3.0
    batch["s2"] = batch["entropy"] ** 2 + 0.1
    config = StareConfig(op="O1", top_ratio=0.2, w=1.5, target_entropy=1.0, gate="batch")
    weights, metrics = control_step(stare(config), split(batch, [(0, 4), (4, 8)]))
    assert metrics["stare/gate"] == 0.0 and all((w == 1).all() for w in weights)


def test_critical_mode_gets_the_whole_step_critical_weight():
    """control_step measures W* on the whole step and hands it to the controller, which sets W from it."""
    config = StareConfig(
        op="O1", top_ratio=0.2, w=1.05, target_entropy=5.0, w_mode="critical", w_max=1e6, w_margin=0.0, w_smoothing=0
    )
    seen = []
    for seed in range(12):
        control = stare(config)
        controller = control.stare
        _, metrics = control_step(control, split(rollout_batch(seed=seed), [(0, 6), (6, 12)]))
        w_star = metrics["theory/critical_weight"]
        expected = 1.05 if w_star != w_star else w_star  # NaN where undefined: the fixed W
        assert controller.w == metrics["stare/w"] and controller.w == pytest.approx(expected, rel=1e-6)
        seen.append(w_star == w_star)
    assert any(seen) and not all(seen)  # both cases were met


def test_one_advantage_per_row_is_every_action_token_s_advantage():
    """The local backend's (B,) GRPO advantages give the weights and metrics of the same advantage on every token."""
    batch = rollout_batch(seed=3)
    rows = batch["advantages"].sum(1) / batch["mask"].sum(1)  # each row's advantage
    whole = [MicroBatch(batch["log_probs"], rows, batch["mask"], batch["entropy"], batch["s2"])]
    per_token = [MicroBatch(batch["log_probs"], batch["advantages"], batch["mask"], batch["entropy"], batch["s2"])]
    (w1,), m1 = control_step(stare(CONFIG), whole)
    (w2,), m2 = control_step(stare(CONFIG), per_token)
    torch.testing.assert_close(w1[batch["mask"]], w2[batch["mask"]])
    assert m1.keys() == m2.keys()
    assert [k for k in m1 if m1[k] != pytest.approx(m2[k], rel=1e-5, abs=1e-6, nan_ok=True)] == []


def test_the_regime_of_a_metrics_row_old_and_new():
    from stare_agent.step import regime_of

    _, metrics = control_step(stare(CONFIG), split(rollout_batch(), [(0, 12)]))
    assert regime_of(metrics) in REGIMES and sum(metrics[f"theory/regime_{n}"] for n in REGIMES) == 1.0
    assert regime_of({"theory/regime": "needs_w"}) == "needs_w"  # a run logged before the one-hot schema
    assert regime_of({"stare/w": 1.1}) is None
