"""What each entropy-control arm of an experiment selects on the first rollout batch, before any arm runs.

    stare-agent lab calibrate_control --config EXPERIMENT.yaml [--seed 0] [--json PATH] [KEY=VALUE ...]

One rollout batch of the experiment's RL settings from its SFT model (its output folder is prepared or restored
as `stare-agent experiment` does: data, SFT model), the batch every arm of that seed trains on first. On it:
- the covariance term (A - mean A)(log pi - mean log pi) of Clip-Cov and KL-Cov over the action tokens, at the
  sampling policy (update 0 of an on-policy step): its quantiles, and how many tokens lie in each Clip-Cov band;
- each variant's selection as configured (`control/selected_share`, mean weight, coefficient), and, for the
  methods with a gate (stare, low_prob_reweight, entropy_bonus), what it selects once the gate is on (the target
  entropy moved above the batch's), since at the SFT model's entropy the gate is usually off.
Nothing is trained. The settings a pre-stated comparison fixes from these numbers go into its docs first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from stare_agent.backends.local.rl import TimedClient, Trainer
from stare_agent.config import RLConfig, load_config
from stare_agent.entropy_control import EntropyControl, covariance_term
from stare_agent.lab.experiment import ExperimentConfig, open_folder, prepare, rl_with_changes
from stare_agent.runtime import make_client, start_client
from stare_agent.step import UpdatePart, update_selection

QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)
GATED = ("stare", "low_prob_reweight", "entropy_bonus")
GATE_ON = 100.0
"""A target entropy far above any batch's: the gate is on."""


def first_batch(rl: RLConfig) -> tuple[Trainer, list]:
    """A trainer of `rl` and the groups of its first rollout batch (nothing trained, nothing written)."""
    trainer = Trainer(rl)
    episodes = rl.stateful_episodes_in_flight
    client = make_client(rl.sandbox, episodes)

    async def collect() -> list:
        await start_client(client, rl.sandbox, episodes, RLConfig.IN_FLIGHT_KEYS)
        try:
            groups, fill, _ = await trainer.rollouts(TimedClient(client))
        finally:
            await client.close()
        fill.check_sandbox()
        if not fill.full:
            raise SystemExit(f"calibrate_control: the first batch is not full: {fill.why_not_full()}")
        return groups

    return trainer, asyncio.run(collect())


def selection(trainer: Trainer, groups: list, rl: RLConfig) -> dict[str, float]:
    """The method of `rl` on the groups: selected share, mean weight and coefficient (update 0 for Clip-Cov and
    KL-Cov, whose selection is per update)."""
    trainer.config, trainer.control = rl, EntropyControl(rl)
    batch, metrics = trainer.prepare(groups)
    out = {k.removeprefix("control/"): v for k, v in metrics.items() if k.startswith("control/")}
    out = {k: v for k, v in out.items() if "_share_" not in k}  # by class: in the run's metrics
    picked = update_selection(
        trainer.control,
        [UpdatePart(batch.old_logprobs, batch.old_logprobs, batch.advantages, batch.action_mask)],
        0,
    )
    if picked is not None:
        out["selected_share"] = float(picked[0].sum() / batch.action_mask.sum())
        out["selected_tokens"] = int(picked[0].sum())
    if rl.entropy_control.method == "clip_cov":  # the band's candidates (at update 0 PPO has clipped none)
        cov = covariance_term(batch.advantages, batch.old_logprobs, batch.action_mask)
        band = batch.action_mask.bool() & (cov > rl.clip_cov.lb) & (cov < rl.clip_cov.ub)
        out["candidates"] = int(band.sum())
    out["entropy"] = metrics.get("stare/entropy_mean", float("nan"))
    return out


def covariance_summary(trainer: Trainer, groups: list) -> dict[str, Any]:
    """Quantiles of the covariance term over the batch's action tokens and the token counts in Clip-Cov bands."""
    batch, _ = trainer.prepare(groups)
    mask = batch.action_mask.bool()
    cov = covariance_term(batch.advantages, batch.old_logprobs, mask)[mask].double()
    q = torch.quantile(cov, torch.tensor(QUANTILES, dtype=torch.float64))
    return {
        "action_tokens": int(mask.sum()),
        "quantiles": {f"{p:g}": float(v) for p, v in zip(QUANTILES, q, strict=True)},
        "min": float(cov.min()),
        "max": float(cov.max()),
        "above_1": int((cov > 1).sum()),
        "in_1_5": int(((cov > 1) & (cov < 5)).sum()),
        "positive": int((cov > 0).sum()),
    }


def calibrate(config: ExperimentConfig, seed: int) -> dict[str, Any]:
    run_dir, config = open_folder(config)
    files = prepare(config, run_dir)

    def variant(name: str) -> RLConfig:
        rl = config.variant_rl(name)
        return replace(
            rl,
            steps=1,
            run=replace(config.run, output_dir=str(run_dir), name=f"calibration-s{seed}", seed=seed),
            model=replace(rl.model, path=str(files["sft_model"])),
            data=replace(rl.data, train_file=str(files["rl"])),
            resume="",
        )

    names = list(config.variants)
    trainer, groups = first_batch(variant(names[0]))
    out: dict[str, Any] = {"seed": seed, "covariance": covariance_summary(trainer, groups), "variants": {}}
    for name in names:
        rl = variant(name)
        row = {"method": rl.entropy_control.method, "as_configured": selection(trainer, groups, rl)}
        if rl.entropy_control.method in GATED:
            section = "entropy_bonus" if rl.entropy_control.method == "entropy_bonus" else "stare"
            gated = rl_with_changes(rl, {section: {"target_entropy": GATE_ON}}, f"variants.{name}")
            row["gate_on"] = selection(trainer, groups, gated)
        out["variants"][name] = row
    return out


def table(result: dict[str, Any]) -> list[str]:
    cov = result["covariance"]
    quantiles = ", ".join(f"q{p} {v:.3g}" for p, v in cov["quantiles"].items())
    lines = [
        f"Covariance term over the {cov['action_tokens']} action tokens of the first batch (seed {result['seed']}): "
        f"min {cov['min']:.3g}, {quantiles}, max {cov['max']:.3g}; {cov['positive']} positive, "
        f"{cov['above_1']} above 1, {cov['in_1_5']} in (1, 5).",
        "",
        "| variant | method | selected share | mean weight | coefficient | Clip-Cov candidates "
        "| selected share, gate on | coefficient, gate on |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def num(row: dict[str, float] | None, key: str, digits: int = 4) -> str:
        return "-" if row is None or key not in row else f"{row[key]:.{digits}g}"

    for name, row in result["variants"].items():
        configured, gate_on = row["as_configured"], row.get("gate_on")
        lines.append(
            f"| {name} | {row['method']} | {num(configured, 'selected_share')} | {num(configured, 'weight_mean')} "
            f"| {num(configured, 'coef')} | {num(configured, 'candidates')} | {num(gate_on, 'selected_share')} "
            f"| {num(gate_on, 'coef')} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stare-agent lab calibrate_control", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="an experiment config (stare-agent experiment)")
    parser.add_argument("--seed", type=int, default=0, help="the RL seed whose first batch is measured")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE changes to the experiment config")
    args = parser.parse_args(argv)
    result = calibrate(load_config(ExperimentConfig, args.config, args.overrides), args.seed)
    print("\n".join(table(result)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
