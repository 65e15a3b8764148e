"""STARE dynamics on a toy: does plain GRPO collapse entropy, and does the gate hold it at the target?

The policy is tabular: every (prompt, position) is an independent softmax over a small vocabulary,
trained by the exact GRPO policy gradient (on-policy, so the importance ratio is 1 and clipping
never binds) with plain SGD on the logits, on groups sampled each step. The reward is verifiable:
a response is correct iff at most `max_wrong` of its positions hold a token outside that
position's valid set. Several tokens are valid per position, so the reward never needs entropy
to fall to zero; plain GRPO drives it down anyway.

What this simplifies, compared with an LLM: positions do not share parameters or condition on each
other, all responses have the same length, and there is no tool call. Surprisal, entropy, S2 and
the STARE weights are computed exactly as in training (stare.py, theory.py, loss.py).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stare_agent.config import RunConfig, run_path, save_config
from stare_agent.loss import group_advantages, policy_loss
from stare_agent.stare import StareConfig, StareController, select_quadrants
from stare_agent.theory import REGIMES, batch_diagnostics, entropy_and_s2, phi

# --- the command's config ----------------------------------------------------------------------------------------


@dataclass
class ToyTaskConfig:
    """The STARE dynamics toy: independent softmax positions with a verifiable reward.

    Each prompt has `length` positions, each a free softmax over `vocab` tokens (a tabular
    policy). At every position `valid_tokens` of the tokens are correct; a response earns
    reward 1 iff at most `max_wrong` of its positions hold a wrong token.
    """

    vocab: int = 16
    """Tokens per position."""
    length: int = 64
    """Positions per response (the response length)."""
    prompts: int = 64
    """Distinct prompts, each with its own logits."""
    valid_tokens: int = 4
    """Correct tokens at each position; more than one leaves room for diversity the reward does not need."""
    max_wrong: int = 0
    """A response is correct iff at most this many positions hold a wrong token."""
    init_std: float = 1.0
    """Std of the initial logits."""
    valid_bias: float = 5.5
    """Added to the initial logits of valid tokens, so the first policy already succeeds sometimes."""
    steps: int = 400
    """Optimizer steps per run."""
    batch_prompts: int = 16
    """Prompts per step."""
    group_size: int = 8
    """Responses sampled per prompt (the GRPO group)."""
    lr: float = 4000.0
    """SGD step on the logits; the loss is a token-level mean, so this is per-token step x tokens per batch."""

    def __post_init__(self) -> None:
        for name in ("vocab", "length", "prompts", "steps", "batch_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for group-normalized advantages; got {self.group_size}")
        if not 1 <= self.valid_tokens < self.vocab:
            raise ValueError(f"valid_tokens must be in [1, vocab); got {self.valid_tokens} with vocab={self.vocab}")
        if not 0 <= self.max_wrong < self.length:
            raise ValueError(f"max_wrong must be in [0, length); got {self.max_wrong} with length={self.length}")
        if self.batch_prompts > self.prompts:
            raise ValueError(f"batch_prompts must be <= prompts={self.prompts}; got {self.batch_prompts}")
        if not (self.lr > 0 and self.init_std >= 0):
            raise ValueError(f"lr must be > 0 and init_std >= 0; got lr={self.lr}, init_std={self.init_std}")


@dataclass
class SimulateConfig:
    """`stare-agent simulate`: GRPO vs STARE on the toy task, entropy over steps."""

    run: RunConfig = field(default_factory=RunConfig)
    toy: ToyTaskConfig = field(default_factory=ToyTaskConfig)
    stare: StareConfig = field(default_factory=StareConfig)
    """Base STARE settings; the sweeps below vary w and the gate on top of them."""
    open_loop_w: list[float] = field(default_factory=lambda: [1.01, 1.05, 1.1, 1.5, 2.0, 4.0])
    """W values for op O1 with the gate off."""
    gated_w: list[float] = field(default_factory=lambda: [1.05, 1.1, 1.5, 2.0, 4.0])
    """W values for op O1 with stare.gate (batch unless set) at stare.target_entropy."""

    def __post_init__(self) -> None:
        bad = [w for w in [*self.open_loop_w, *self.gated_w] if w < 1.0]
        if bad:
            raise ValueError(f"open_loop_w and gated_w values must be >= 1; got {bad}")


# Columns of simulate.csv, one row per (run, step).
COLUMNS = [
    "run",
    "step",
    "entropy",
    "entropy_all",
    "entropy_all_change",
    "entropy_all_change_first_order",
    "reward",
    "gate",
    "w",
    "weight_mean",
    "critical_weight",
    "regime",
    "proxy_precision",
    "informative_groups",
]


@dataclass(frozen=True)
class Variant:
    """One training run of the sweep."""

    name: str
    stare: StareConfig | None
    """None: plain GRPO (every weight 1)."""


def sweep(config: SimulateConfig) -> list[Variant]:
    """GRPO, O1 open loop for each open_loop_w, and O1 gated for each gated_w."""
    base = config.stare
    gated = base.gate if base.gate != "off" else "batch"
    variants = [Variant("grpo", None)]
    for w in config.open_loop_w:
        variants.append(Variant(f"O1 open W={w:g}", dataclasses.replace(base, op="O1", w=w, gate="off")))
    for w in config.gated_w:
        name = f"O1 {gated} gate W={w:g}"
        variants.append(Variant(name, dataclasses.replace(base, op="O1", w=w, gate=gated, w_mode="fixed")))
    return variants


def train_toy(
    task: ToyTaskConfig, stare: StareConfig | None, seed: int, top_ratio: float | None = None
) -> list[dict[str, float]]:
    """One run; returns one metrics row per step. The problem and the initial policy depend only on the seed.

    stare None is plain GRPO (every weight 1, w reported as 1). top_ratio: P of the high+ set the theory
    diagnostics (W*, proxy precision) use; None = stare.top_ratio, or StareConfig's default without STARE.
    """
    gen = torch.Generator().manual_seed(seed)
    # The first `valid_tokens` of a random permutation are the valid tokens of each position.
    order = torch.rand(task.prompts, task.length, task.vocab, generator=gen).argsort(-1)
    valid = order.argsort(-1) < task.valid_tokens  # (P, L, V) bool
    logits = torch.randn(task.prompts, task.length, task.vocab, generator=gen) * task.init_std
    logits = (logits + task.valid_bias * valid).requires_grad_()
    controller = StareController(stare) if stare is not None else None
    if top_ratio is None:
        top_ratio = (stare or StareConfig()).top_ratio
    positions = task.prompts * task.length
    entropy_all = entropy_and_s2(logits.detach())[0].mean()
    rows = []
    for step in range(task.steps):
        prompt_ids = torch.randperm(task.prompts, generator=gen)[: task.batch_prompts]
        idx = prompt_ids.repeat_interleave(task.group_size)  # (B,), groups contiguous
        z = logits[idx]  # (B, L, V)
        logp_all = torch.log_softmax(z, dim=-1)
        tokens = torch.multinomial(logp_all.detach().exp().view(-1, task.vocab), 1, generator=gen)
        tokens = tokens.view(len(idx), task.length)
        logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)  # (B, L)
        wrong = ~valid[idx].gather(-1, tokens[..., None]).squeeze(-1)
        reward = (wrong.sum(dim=1) <= task.max_wrong).float()
        advantages = group_advantages(reward, task.group_size)
        action_mask = torch.ones_like(logp)  # (B, L); every position is sampled by the policy
        surprisal = -logp.detach()
        entropy, s2 = entropy_and_s2(z.detach())
        high_pos = select_quadrants(surprisal, advantages, action_mask, top_ratio, ("high+",))["high+"]
        theory = batch_diagnostics(surprisal, advantages, action_mask, entropy, s2, high_pos)
        if controller is None:
            weights, stare_metrics = torch.ones_like(surprisal), {}
        else:
            weights, stare_metrics = controller(
                surprisal, advantages, action_mask, entropy, critical_weight=theory["theory/critical_weight"]
            )
        loss, _ = policy_loss(
            logp, logp.detach(), advantages, action_mask, eps_low=0.2, eps_high=0.28, weights=weights
        )
        (grad,) = torch.autograd.grad(loss, logits)
        with torch.no_grad():
            logits -= task.lr * grad
        # First-order prediction of this step's change of the mean entropy over all (prompt, position):
        # each sampled token moves its position's logits by (lr / N) * omega * A * (e_a - pi).
        a_phi = weights * advantages[:, None] * phi(logp.detach().exp(), entropy, s2)
        predicted = -task.lr / action_mask.sum() * a_phi.sum() / positions
        previous, entropy_all = entropy_all, entropy_and_s2(logits.detach())[0].mean()
        rows.append(
            {
                "step": step,
                "entropy": float(entropy.mean()),
                "entropy_all": float(entropy_all),
                "entropy_all_change": float(entropy_all - previous),
                "entropy_all_change_first_order": float(predicted),
                "reward": float(reward.mean()),
                "gate": float(stare_metrics.get("stare/gate", torch.tensor(float("nan")))),
                "w": controller.w if controller is not None else 1.0,
                "weight_mean": float(weights.mean()),
                "critical_weight": float(theory["theory/critical_weight"]),
                "regime": REGIMES[int(theory["theory/regime"])],
                "proxy_precision": float(theory["theory/proxy_precision"]),
                "informative_groups": float((reward.view(-1, task.group_size).std(dim=1) > 0).float().mean()),
            }
        )
    return rows


def window_mean(rows: list[dict[str, float]], key: str, window: int) -> float:
    values = [r[key] for r in rows[-window:] if r[key] == r[key]]
    return sum(values) / len(values) if values else float("nan")


def summarize(config: SimulateConfig, results: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per run: final-window entropy (mean, min, max), reward, the steps in each regime, and the median critical
    weight over the steps where it is defined (the needs_w regime)."""
    window = max(1, config.toy.steps // 5)
    summary = {}
    for name, rows in results.items():
        tail = [r["entropy"] for r in rows[-window:]]
        crit = sorted(r["critical_weight"] for r in rows if r["critical_weight"] == r["critical_weight"])
        summary[name] = {
            "final_entropy": window_mean(rows, "entropy", window),
            "final_entropy_min": min(tail),
            "final_entropy_max": max(tail),
            "final_reward": window_mean(rows, "reward", window),
            "final_informative_groups": window_mean(rows, "informative_groups", window),
            "critical_weight_median": crit[len(crit) // 2] if crit else float("nan"),
            "critical_weight_steps": len(crit),
            **{f"regime_{name}": sum(r["regime"] == name for r in rows) for name in REGIMES},
            "proxy_precision_mean": window_mean(rows, "proxy_precision", len(rows)),
            "entropy_all_change": sum(r["entropy_all_change"] for r in rows),
            "entropy_all_change_first_order": sum(r["entropy_all_change_first_order"] for r in rows),
        }
    return summary


def plot(run_dir: Path, config: SimulateConfig, results: dict[str, list[dict[str, float]]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = config.stare.target_entropy
    groups = {
        "entropy_open_loop.png": ("O1 open loop vs GRPO", [n for n in results if n == "grpo" or " open " in n]),
        "entropy_gated.png": ("O1 with the gate vs GRPO", [n for n in results if n == "grpo" or " gate " in n]),
    }
    paths = []
    for filename, (title, names) in groups.items():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name in names:
            ax.plot([r["entropy"] for r in results[name]], label=name, lw=1.2)
        ax.axhline(target, color="k", ls="--", lw=0.8, label=f"H_tgt = {target:g}")
        ax.set(xlabel="step", ylabel="batch mean entropy (nats)", title=title)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(run_dir / filename, dpi=110)
        plt.close(fig)
        paths.append(run_dir / filename)

    fig, (ax_w, ax_r) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in [n for n in results if n == "grpo" or " gate " in n]:
        ax_w.plot([r["critical_weight"] for r in results[name]], label=name, lw=1)
        ax_r.plot([r["reward"] for r in results[name]], label=name, lw=1)
    ax_w.axhline(1.0, color="k", lw=0.6)
    ax_w.set(xlabel="step", ylabel="W* = 1 + Lambda/Gamma", title="critical weight per step", ylim=(0, 4))
    ax_r.set(xlabel="step", ylabel="mean reward", title="reward")
    ax_w.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(run_dir / "critical_weight_reward.png", dpi=110)
    plt.close(fig)
    paths.append(run_dir / "critical_weight_reward.png")
    return paths


def run(config: SimulateConfig) -> Path:
    """Train every variant of the sweep; write simulate.csv, summary.json, plots and config.yaml."""
    run_dir = run_path(config.run, "simulate")
    save_config(config, run_dir)
    results = {}
    started = time.perf_counter()
    for variant in sweep(config):
        results[variant.name] = train_toy(config.toy, variant.stare, config.run.seed, config.stare.top_ratio)
    elapsed = time.perf_counter() - started
    with open(run_dir / "simulate.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for name, rows in results.items():
            for row in rows:
                writer.writerow({"run": name, **row})
    summary = summarize(config, results)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plots = plot(run_dir, config, results)
    print(format_summary(summary, config.stare.target_entropy))
    print(f"\n{len(results)} runs x {config.toy.steps} steps in {elapsed:.1f}s. Wrote to {run_dir}/:")
    for path in [run_dir / "simulate.csv", run_dir / "summary.json", *plots, run_dir / "config.yaml"]:
        print(f"  {path.name}")
    return run_dir


def format_summary(summary: dict[str, dict[str, float]], target: float) -> str:
    header = (
        f"{'run':<22} {'final H':>8} {'H range':>15} {'reward':>7} {'W* median':>10} {'proxy prec':>10} "
        f"{'dH all':>8} {'1st-order':>9}  regimes (rising/needs_w/no_w_helps/undefined)"
    )
    lines = [
        f"final window = last 20% of steps; H_tgt = {target:g}; "
        "dH all = total change of the mean entropy over all positions, 1st-order = its first-order prediction; "
        "W* median over the needs_w steps only (elsewhere W* is undefined)",
        header,
    ]
    for name, s in summary.items():
        span = f"[{s['final_entropy_min']:.3f}, {s['final_entropy_max']:.3f}]"
        lines.append(
            f"{name:<22} {s['final_entropy']:>8.3f} {span:>15} {s['final_reward']:>7.3f} "
            f"{s['critical_weight_median']:>10.3f} {s['proxy_precision_mean']:>10.3f} "
            f"{s['entropy_all_change']:>8.3f} {s['entropy_all_change_first_order']:>9.3f}  "
            + "/".join(str(s[f"regime_{name}"]) for name in REGIMES)
        )
    return "\n".join(lines)
