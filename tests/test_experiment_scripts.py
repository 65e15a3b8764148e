"""The lab's analysis tools that read runs (stare-agent lab rl_experiment, rl_diagnostics, heldout_noise,
program_styles, paired_evals): their tables from hand-made metrics rows and evaluation files."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace

import pytest

from stare_agent.config import save_config
from stare_agent.lab.analysis import heldout_noise, paired_evals, program_styles
from stare_agent.lab.analysis import rl_diagnostics as diagnostics
from stare_agent.lab.analysis import rl_experiment as experiment
from stare_agent.lab.quickstart import QuickstartConfig
from stare_agent.lab.stats import t_quantile
from stare_agent.lab.tasks import generate_tasks


def _row(step, entropy, accuracy, regime, w_star=None, lam=1.0, gam=1.0, precision=0.5):
    return {
        "step": step,
        "stare/entropy_mean": entropy,
        "rollout/accuracy": accuracy,
        "theory/regime": regime,
        "theory/critical_weight": w_star,
        "theory/lambda": lam,
        "theory/gamma": gam,
        "theory/proxy_precision": precision,
        "theory/critical_surprisal_mean": 0.4,
    }


# W* is defined (2 and 50) on the two needs_w steps only; the median over them is 26.
RUN = [
    _row(1, 0.20, 0.2, "needs_w", w_star=2.0, precision=0.9),
    _row(2, 0.18, 0.4, "no_w_helps", gam=-1.0, precision=0.1),
    _row(3, 0.16, 0.6, "needs_w", w_star=50.0),
    _row(4, 0.12, 0.8, "rising", lam=-1.0),
]


def test_run_table_counts_regimes_and_takes_the_w_star_median_over_defined_steps():
    lines = experiment.run_table({"grpo-ds": {0: RUN}})
    assert lines[0].endswith("| rising | needs_w | no_w_helps | undefined |")
    # first-5 mean 0.165, final window (last 1 of 4) 0.120 / 0.80, median W* 26 over 2 of 4 steps, regimes 1 2 1 0
    assert lines[2] == "| grpo-ds | 0 | 0.165 | 0.120 | 0.80 | 26.00 (2/4) | 0.50 | - | 1 | 2 | 1 | 0 |"
    assert "the last 1 of 4 steps" in lines[-1]
    changed = [*RUN[:2], _row(3, 0.16, 0.6, "needs_w", w_star=4.0), RUN[3]]
    assert "| 3.00 (2/4) |" in experiment.run_table({"grpo-ds": {0: changed}})[2]


def test_run_table_marks_runs_without_regimes_as_unknown_not_zero():
    old = [{k: v for k, v in r.items() if k != "theory/regime"} for r in RUN]
    lines = experiment.run_table({"grpo-ds": {0: old}})
    assert lines[2].endswith("| - | - | - | - |")
    assert "logged no theory/regime" in lines[-1]


def test_block_table_means_entropy_and_accuracy_per_block():
    lines = experiment.block_table({"grpo-ds": {0: RUN}, "stare-O1": {0: RUN[:3]}}, 2)
    assert lines[0] == "Mean entropy / rollout accuracy per block of 2 steps:"
    assert lines[2] == "| variant | seed | 1–2 | 3–4 |"
    assert lines[4] == "| grpo-ds | 0 | 0.190 / 0.30 | 0.140 / 0.70 |"
    assert lines[5] == "| stare-O1 | 0 | 0.190 / 0.30 | 0.160 / 0.60 |"


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)])
def test_t_quantile_matches_the_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)


def test_t_interval_and_the_cross_seed_summary():
    m, lo, hi = experiment.t_interval([1.0, 2.0, 3.0])
    assert m == 2.0 and hi - m == pytest.approx(4.3027 * 1.0 / 3**0.5, abs=1e-3) and m - lo == pytest.approx(hi - m)
    assert experiment.t_interval([0.5]) == (0.5, None, None)

    other = [dict(r, **{"stare/entropy_mean": 0.2, "rollout/accuracy": 0.4}) for r in RUN]
    lines, out = experiment.seed_summary({"grpo-ds": {0: RUN, 1: other}, "stare-O1": {0: RUN}})
    entropy = out["grpo-ds"]["entropy_final_window_mean"]
    half = 12.706 * statistics.stdev([0.12, 0.2]) / 2**0.5
    assert entropy["mean"] == pytest.approx(0.16) and entropy["ci95"] == pytest.approx(
        [0.16 - half, 0.16 + half], abs=1e-4
    )
    assert lines[2].startswith("| grpo-ds | 2 | 0.160 [")
    assert lines[3] == "| stare-O1 | 1 | 0.120 [one seed: no interval] | 0.80 [one seed: no interval] |"


def test_diagnostics_counts_regimes_and_signs_and_skips_undefined_w_star(tmp_path, capsys):
    lines = diagnostics.diagnostics(RUN)
    assert lines[0] == "- regimes (steps): rising 1, needs_w 2, no_w_helps 1, undefined 0"
    assert lines[1] == "- signs of (Lambda, Gamma) (steps): (+, +) 2, (+, -) 1, (-, +) 1"
    assert lines[2] == "- proxy precision: 0.10-0.90 (median 0.50 over 4 steps)"
    assert lines[3] == "- W* = 1 + Lambda/Gamma, defined on 2 of 4 steps: 2.00-50.00 (median 26.00 over 2 steps)"
    assert lines[4].endswith("0.40 nats")
    old = [{k: v for k, v in r.items() if k != "theory/regime"} for r in RUN]
    assert diagnostics.diagnostics(old)[0].endswith("not logged (a run from before theory/regime)")

    run = tmp_path / "p010"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RUN))
    diagnostics.main([str(run), "--per-step"])
    printed = capsys.readouterr().out
    assert f"### {run} (4 steps)" in printed and "| 2 | 1 | -1 | no_w_helps | - | 0.1 |" in printed


def test_rl_experiment_on_finished_runs_only_prints_its_tables(tmp_path, capsys):
    for name in ("rl-grpo-ds", "rl-stare-O1"):
        (tmp_path / "qs" / name).mkdir(parents=True)
        save_config(replace(QuickstartConfig().rl, steps=4), tmp_path / "qs" / name)
    for seed in (0, 1):
        run = tmp_path / "out" / f"grpo-ds-seed{seed}"
        run.mkdir(parents=True)
        rows = [dict(r, **{"stare/entropy_mean": r["stare/entropy_mean"] + 0.01 * seed}) for r in RUN]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    experiment.main(
        [str(tmp_path / "qs"), "--out", str(out), "--seeds", "0", "1", "--variants", "grpo-ds", "--blocks", "2"]
    )
    printed = capsys.readouterr().out
    assert "| grpo-ds | 1 | 0.175 | 0.130 | 0.80 | 26.00 (2/4) |" in printed
    assert "| grpo-ds | 2 | 0.125 [" in printed and "| grpo-ds | 1 | 0.200 / 0.30 | 0.150 / 0.70 |" in printed
    assert (out / "table.md").read_text().strip() in printed
    assert json.loads((out / "summary.json").read_text())["across_seeds"]["grpo-ds"]["seeds"] == [0, 1]


def test_heldout_noise_prints_the_interval_of_each_prefix(tmp_path, capsys):
    """Per-problem accuracies over scored samples (a sandbox error is not a sample), prefix by prefix."""
    folder = tmp_path / "eval-x"
    folder.mkdir()
    rewards = [[1.0, 1.0], [0.0, None], [1.0, 0.0], [None, None]] * 10  # the last kind is unscored
    problems = [{"problem_id": f"p{i}", "rewards": r} for i, r in enumerate(rewards)]
    (folder / "test.json").write_text(json.dumps({"report": {}, "problems": problems}))
    report = {"name": "test", "samples_per_problem": 2, "avg_at_k": 0.5, "pass_at": {"1": 0.5, "2": 0.6}}
    (folder / "results.json").write_text(json.dumps([report | {"mean_tool_calls": 1.0, "mean_response_length": 9}]))
    heldout_noise.main([str(folder), "--subsets", "3", "100"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| eval-x")]
    assert [row.split(" | ")[1:3] for row in rows] == [["3", "50.0"], ["30", "50.0"]]  # 30 scored problems
    with pytest.raises(SystemExit, match="no results.json"):
        heldout_noise.main([str(tmp_path)])


def test_rl_diagnostics_block_means():
    accuracy = [0.2, 0.4, 0.1, 0.3, 0.5]
    rows = [_row(step, 0.1 * step, accuracy[step - 1], "needs_w") for step in range(1, 6)]
    rows[1].pop("stare/entropy_mean")  # a step without an update: accuracy only
    lines = diagnostics.blocks(rows, 2)
    assert lines[2:] == ["| 1–2 | 0.100 | 0.30 |", "| 3–4 | 0.350 | 0.20 |", "| 5–5 | 0.500 | 0.50 |"]


def test_program_styles_matches_each_sample_to_its_problems_programs(tmp_path, capsys):
    """Real test tasks (three programs each); samples that reuse a style with other spacing, that write something
    else, that make no call or that end in a sandbox error."""
    first, second = generate_tasks(2, seed=0, split="test", difficulty=1, families=["mod_pow", "gcd"])
    test_file = tmp_path / "test.jsonl"
    test_file.write_text(
        "".join(json.dumps({"id": p.id, "problem": p.problem, "meta": p.meta}) + "\n" for p in [first, second])
    )
    a1, a2, _ = [first.meta["solution_code"], *first.meta["other_solutions"]]
    b1 = second.meta["solution_code"]
    spaced = "\n\n" + a2.replace(" ", "  ") + "\n"  # style 2 with other whitespace
    folder = tmp_path / "eval-x"
    folder.mkdir()
    problems = [
        {  # styles 1, 1, 2, other; the other sample is wrong; a fifth made no call
            "problem_id": first.id,
            "rewards": [1.0, 1.0, 1.0, 0.0, 0.0],
            "finish_reasons": ["answer"] * 5,
            "programs": [[a1], [a1, "print(1)"], [spaced], ["print('hello world, nothing alike')"], []],
        },
        {  # style 1 twice; the second ended in a sandbox error (no reward)
            "problem_id": second.id,
            "rewards": [0.0],
            "finish_reasons": ["answer", "sandbox_error"],
            "programs": [[b1], [b1]],
        },
    ]
    (folder / "test.json").write_text(json.dumps({"report": {}, "problems": problems}))
    (folder / "results.json").write_text(json.dumps([{"name": "test"}]))

    refs = program_styles.load_references(test_file)
    per_problem = program_styles.styles_of(problems, refs, 0.8, folder)
    assert [style for style, _, _ in per_problem[0][1]] == ["style 1", "style 1", "style 2", "other"]
    assert [reward for _, _, reward in per_problem[1][1]] == [0.0, None]
    out = program_styles.summary(per_problem, 3)
    assert out["tool_share"] == pytest.approx(6 / 7)
    assert out["shares"] == pytest.approx({"style 1": 4 / 6, "style 2": 1 / 6, "style 3": 0.0, "other": 1 / 6})
    # problem 1: shares 1/2, 1/4, 1/4; problem 2: one style
    assert out["style_entropy"] == pytest.approx((-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)) + 0.0) / 2)
    assert out["distinct"] == pytest.approx((3 + 1) / 2)  # the spaced style 2 is style 2's program
    assert out["accuracy"] == {"style 1": (2 / 3, 3), "style 2": (1.0, 1), "other": (0.0, 1)}

    program_styles.main([str(test_file), str(folder), "--by-family"])
    printed = capsys.readouterr().out
    assert "| eval-x | 85.7 | 66.7 | 16.7 | 0.0 | 16.7 | 0.520 | 2.00 |" in printed
    assert "| gcd | 100 / 0 / 0 / 0 |" in printed and "| mod_pow | 50 / 25 / 0 / 25 |" in printed

    old = tmp_path / "eval-old"
    old.mkdir()
    (old / "test.json").write_text(
        json.dumps({"problems": [{k: v for k, v in problems[0].items() if k != "programs"}]})
    )
    (old / "results.json").write_text(json.dumps([{"name": "test"}]))
    with pytest.raises(SystemExit, match="no per-sample programs"):
        program_styles.main([str(test_file), str(old)])


def _eval_folder(path, rewards_by_problem, pass_k):
    path.mkdir(parents=True)
    problems = [{"problem_id": pid, "rewards": r} for pid, r in rewards_by_problem.items()]
    (path / "test.json").write_text(json.dumps({"problems": problems}))
    avg = statistics.fmean(statistics.fmean(r) for r in rewards_by_problem.values())
    report = {"name": "test", "samples_per_problem": 2, "avg_at_k": avg, "pass_at": {"1": avg, "2": pass_k}}
    (path / "results.json").write_text(json.dumps([report | {"mean_tool_calls": 1.0, "mean_response_length": 9}]))
    return path


def test_paired_evals_prints_each_pairs_change_and_the_interval_over_pairs(tmp_path, capsys):
    before = [
        _eval_folder(tmp_path / "b0", {"p": [1.0, 0.0], "q": [0.0, 0.0]}, 0.5),
        _eval_folder(tmp_path / "b1", {"p": [1.0, 1.0], "q": [0.0, 0.0]}, 0.5),
    ]
    after = [
        _eval_folder(tmp_path / "a0", {"q": [1.0, 0.0], "p": [1.0, 1.0]}, 1.0),  # order differs: matched by id
        _eval_folder(tmp_path / "a1", {"p": [0.0, 0.0], "q": [0.0, 0.0]}, 0.0),
    ]
    paired_evals.main(["--before", *map(str, before), "--after", *map(str, after), "--curve"])
    out = capsys.readouterr().out
    assert f"| {before[0]} | {after[0]} | 25.0 | 75.0 | +50.0 | 50.0 | 100.0 | +50.0 |" in out
    assert f"| {before[1]} | {after[1]} | 50.0 | 0.0 | -50.0 | 50.0 | 0.0 | -50.0 |" in out
    half = 100 * 12.706 * statistics.stdev([0.5, -0.5]) / 2**0.5
    assert f"avg@k change, mean over 2 pairs (points, 95% t-interval): +0.0 [{-half:+.1f}, {half:+.1f}]" in out
    assert "pooled over pairs (4 problem-runs" in out
    assert "solved before and never after: 1 of 4; never before, solved after: 1 (sign test p = 1.000)" in out
    # the curve, by hand: pass@1 0.25 -> 0.75 and 0.5 -> 0; pass@2 (any right sample) 0.5 -> 1 and 0.5 -> 0
    assert "| 1 | 37.5 | 37.5 | +0.0 [" in out and "| 2 | 50.0 | 50.0 | +0.0 [" in out
    (pair0_k2,) = [line for line in paired_evals.curve([(before[0], after[0])]) if line.startswith("| 2 |")]
    assert pair0_k2.startswith("| 2 | 50.0 | 100.0 | +50.0 (one pair: no interval) | +50.0 [")
    assert paired_evals.sign_test(20, 9) == pytest.approx(0.0614, abs=1e-4)  # 2 * P(X <= 9), X ~ Bin(29, 1/2)
    assert paired_evals.sign_test(0, 5) == pytest.approx(2 / 32) and paired_evals.sign_test(0, 0) == 1.0

    with pytest.raises(SystemExit, match="not evaluations of the same problems"):
        paired_evals.main(["--before", str(before[0]), "--after", str(_eval_folder(tmp_path / "x", {"p": [1.0]}, 1))])
    with pytest.raises(SystemExit, match="pair them one to one"):
        paired_evals.main(["--before", str(before[0]), "--after", *map(str, after)])
