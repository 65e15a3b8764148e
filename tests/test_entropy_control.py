"""The entropy-control methods against plain-loop references written from their definitions (docs/entropy_control.md):
each selection, each scale, the loss value and its gradient; selections over the whole batch, never a micro-batch;
prompt, tool-output and padding positions outside every selection and every mean."""

from __future__ import annotations

import math

import pytest
import torch

from stare_agent.config import RLConfig
from stare_agent.entropy_control import (
    METHODS,
    ClipCovConfig,
    EntropyBonus,
    EntropyBonusConfig,
    EntropyControl,
    EntropyControlConfig,
    ForkingTokensConfig,
    KLCovConfig,
    LowProbReweightConfig,
    clip_cov_generator,
    clip_cov_select,
    forking_weights,
    kl_cov_select,
)
from stare_agent.loss import entropy_bonus_loss, policy_loss
from stare_agent.stare import StareConfig
from stare_agent.step import MicroBatch, UpdatePart, control_step, update_selection


def batch(rows: int = 10, width: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of prompt (mask 0), a turn, a tool output (mask 0), a turn, padding; one advantage per row (some 0).
    Outside the mask every value is extreme (huge entropy, tiny probability, huge advantage), so a selection or a
    mean that let those positions in would change."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r in range(rows):
        end = int(torch.randint(14, width + 1, (1,), generator=g))
        mask[r, 2:7] = True
        mask[r, 10:end] = True
    row_adv = torch.randn(rows, generator=g)
    row_adv[0] = 0.0
    adv = row_adv[:, None].expand(rows, width).clone()
    logp = -torch.rand(rows, width, generator=g) * 4
    entropy = torch.rand(rows, width, generator=g) * 2
    outside = ~mask
    adv[outside], logp[outside], entropy[outside] = 50.0, -30.0, 40.0
    return {"adv": adv, "logp": logp, "mask": mask, "entropy": entropy, "s2": entropy**2 + 0.1}


def action_tokens(mask: torch.Tensor) -> list[tuple[int, int]]:
    return [(r, t) for r in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[r, t]]


def cov_by_loop(b: dict, logp: torch.Tensor) -> dict[tuple[int, int], float]:
    tokens = action_tokens(b["mask"])
    mean_a = sum(float(b["adv"][i]) for i in tokens) / len(tokens)
    mean_l = sum(float(logp[i]) for i in tokens) / len(tokens)
    return {i: (float(b["adv"][i]) - mean_a) * (float(logp[i]) - mean_l) for i in tokens}


def as_set(selected: torch.Tensor) -> set[tuple[int, int]]:
    return {tuple(i) for i in selected.nonzero().tolist()}


def surrogate_by_loop(b, logp, old, *, weights=None, penalty=None, clip=True, n=None, eps=(0.2, 0.28)):
    tokens = action_tokens(b["mask"])
    total = 0.0
    for i in tokens:
        ratio = torch.exp(logp[i] - old[i])
        a = float(b["adv"][i])
        term = -torch.minimum(ratio * a, ratio.clamp(1 - eps[0], 1 + eps[1]) * a) if clip else -ratio * a
        term = term * (1.0 if weights is None else float(weights[i]))
        if penalty is not None and penalty.get(i):
            term = term + penalty[i] * (logp[i] - old[i]).abs()
        total = total + term
    return total / (len(tokens) if n is None else n)


def test_clip_cov_selection_is_the_loop_reference():
    b = batch()
    old = b["logp"]
    logp = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * 0.3  # off-policy: some clip
    cov = cov_by_loop(b, logp)
    clipped = set()
    for i in cov:
        ratio, a = math.exp(float(logp[i] - old[i])), float(b["adv"][i])
        if (a > 0 and ratio > 1.28) or (a < 0 and ratio < 0.8):
            clipped.add(i)
    candidates = [i for i in action_tokens(b["mask"]) if 0.05 < cov[i] < 3.0 and i not in clipped]
    k = max(int(0.05 * len(cov)), 1)
    order = torch.randperm(len(candidates), generator=clip_cov_generator(3, 7, 1)).tolist()
    expected = {candidates[j] for j in order[:k]}
    got = clip_cov_select(
        b["adv"], logp, old, b["mask"], ratio=0.05, lb=0.05, ub=3.0, eps_low=0.2, eps_high=0.28,
        generator=clip_cov_generator(3, 7, 1),
    )  # fmt: skip
    assert clipped and len(candidates) > k > 1 and as_set(got) == expected


def test_clip_cov_loss_and_gradient_drop_exactly_the_selected_tokens():
    b = batch(seed=2)
    old = b["logp"]
    logp = (old + torch.randn(old.shape, generator=torch.Generator().manual_seed(4)) * 0.3).requires_grad_()
    selected = clip_cov_select(
        b["adv"], logp, old, b["mask"], ratio=0.1, lb=0.0, ub=10.0, eps_low=0.2, eps_high=0.28,
        generator=clip_cov_generator(0, 1, 0),
    )  # fmt: skip
    assert selected.any()
    loss, _ = policy_loss(logp, old, b["adv"], b["mask"], eps_low=0.2, eps_high=0.28, weights=(~selected).float())
    ref = surrogate_by_loop(b, logp, old, weights={i: 0.0 if selected[i] else 1.0 for i in action_tokens(b["mask"])})
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(ref, logp)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(g1, g2)
    assert (g1[selected] == 0).all() and (g1[b["mask"] & ~selected & (b["adv"] != 0)] != 0).any()


def test_kl_cov_selects_the_top_covariance_tokens_and_penalises_only_them():
    b = batch(seed=5)
    old = b["logp"]
    logp = (old + torch.randn(old.shape, generator=torch.Generator().manual_seed(6)) * 0.2).requires_grad_()
    cov = cov_by_loop(b, logp.detach())
    k = max(int(0.1 * len(cov)), 1)
    expected = {i for i, _ in sorted(cov.items(), key=lambda kv: (-kv[1], kv[0]))[:k]}
    selected = kl_cov_select(b["adv"], logp, b["mask"], ratio=0.1)
    assert as_set(selected) == expected and k > 1

    loss, metrics = policy_loss(
        logp, old, b["adv"], b["mask"], eps_low=0.2, eps_high=0.28, clip=False, penalty=2.0 * selected.float()
    )
    ref = surrogate_by_loop(b, logp, old, clip=False, penalty={i: 2.0 for i in expected})
    (g1,) = torch.autograd.grad(loss, logp)
    (g2,) = torch.autograd.grad(ref, logp)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5) and float(metrics["policy/clip_frac"]) == 0.0
    torch.testing.assert_close(g1, g2)
    clipped_ref = surrogate_by_loop(b, logp, old, penalty={i: 2.0 for i in expected})
    assert clipped_ref.item() != pytest.approx(ref.item(), rel=1e-4)  # the ratio really would have clipped


@pytest.mark.parametrize("normalize", ["selected", "all"])
def test_forking_tokens_keep_the_top_entropy_share_of_the_whole_batch(normalize):
    b = batch(seed=7)
    tokens = action_tokens(b["mask"])
    k = math.ceil(0.2 * len(tokens))
    kept = {i for i, _ in sorted(((i, float(b["entropy"][i])) for i in tokens), key=lambda kv: (-kv[1], kv[0]))[:k]}
    weights = forking_weights(b["entropy"], b["mask"], top_ratio=0.2, normalize=normalize)
    scale = len(tokens) / k if normalize == "selected" else 1.0
    assert as_set(weights > 0) == kept and torch.allclose(weights[weights > 0], torch.tensor(scale))

    old = b["logp"]
    logp = (old + 0.1).requires_grad_()
    loss, _ = policy_loss(logp, old, b["adv"], b["mask"], eps_low=0.2, eps_high=0.28, weights=weights)
    n = k if normalize == "selected" else len(tokens)  # the token mean over the kept tokens, or over all
    ref = surrogate_by_loop(b, logp, old, weights={i: float(i in kept) for i in tokens}, n=n)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(ref, logp)[0])


def control(method: str, **sections) -> EntropyControl:
    return EntropyControl(RLConfig(entropy_control=EntropyControlConfig(method), **sections))


def parts_of(b: dict, bounds: list[tuple[int, int]]) -> list[MicroBatch]:
    return [
        MicroBatch(b["logp"][lo:hi], b["adv"][lo:hi], b["mask"][lo:hi], b["entropy"][lo:hi], b["s2"][lo:hi])
        for lo, hi in bounds
    ]


@pytest.mark.parametrize("target", [100.0, 0.01])
def test_low_prob_reweight_amplifies_positive_tokens_below_the_fixed_probability(target):
    b = batch(seed=8)
    stare = StareConfig(op="O1", w=1.7, target_entropy=target, gate="batch")
    method = control("low_prob_reweight", stare=stare, low_prob_reweight=LowProbReweightConfig(0.1))
    weights, metrics = control_step(method, parts_of(b, [(0, 10)]))
    tokens = action_tokens(b["mask"])
    gate_on = sum(float(b["entropy"][i]) for i in tokens) / len(tokens) < target
    chosen = {i for i in tokens if b["adv"][i] > 0 and math.exp(float(b["logp"][i])) < 0.1}
    expected = torch.ones_like(b["logp"])
    for i in chosen:
        expected[i] = 1.7 if gate_on else 1.0
    assert len(chosen) > 3
    torch.testing.assert_close(weights[0], expected)
    assert metrics["control/selected_share"] == pytest.approx(len(chosen) / len(tokens) if gate_on else 0.0)
    assert metrics["stare/entropy_mean"] == pytest.approx(sum(float(b["entropy"][i]) for i in tokens) / len(tokens))


def test_entropy_bonus_coefficient_follows_the_reference_rule():
    cfg = EntropyBonusConfig(target_entropy=0.5, delta=0.01, initial_coef=0.0, max_coef=0.025)
    bonus = EntropyBonus(cfg)
    coef, seen = 0.0, []
    for measured in [0.2, 0.3, 0.1, 0.4, 0.45, 0.6, 0.2, 0.7, 0.8, 0.9, 0.5, 0.3]:
        coef = min(max(coef + (0.01 if measured < 0.5 else -0.01), 0.0), 0.025)  # up below, down at or above
        alpha = bonus.step(measured)
        seen.append(alpha)
        assert bonus.coef == pytest.approx(coef) and alpha == pytest.approx(coef if measured < 0.5 else 0.0)
    assert max(seen) == pytest.approx(0.025) and 0.0 in seen


def test_entropy_bonus_loss_is_minus_alpha_times_the_token_mean_entropy():
    b = batch(seed=9)
    logits = torch.randn(10, 24, 7, requires_grad=True)
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    got = entropy_bonus_loss(entropy, b["mask"], 0.3, b["mask"].sum())
    tokens = action_tokens(b["mask"])
    ref = -0.3 * sum(entropy[i] for i in tokens) / len(tokens)
    assert got.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(
        torch.autograd.grad(got, logits, retain_graph=True)[0], torch.autograd.grad(ref, logits)[0]
    )


@pytest.mark.parametrize("measure", ["surprisal", "entropy"])
def test_the_entropy_bonus_step_measures_the_whole_batch(measure):
    b = batch(seed=10)
    tokens = action_tokens(b["mask"])
    value = {
        "entropy": sum(float(b["entropy"][i]) for i in tokens),
        "surprisal": -sum(float(b["logp"][i]) for i in tokens),
    }
    measured = value[measure] / len(tokens)
    cfg = EntropyBonusConfig(target_entropy=measured + 0.01, delta=0.002, max_coef=0.01, measure=measure)
    c = control("entropy_bonus", entropy_bonus=cfg)
    weights, metrics = control_step(c, parts_of(b, [(0, 4), (4, 10)]))
    assert metrics["control/coef"] == pytest.approx(0.002) and all((w == 1).all() for w in weights)
    c2 = control("entropy_bonus", entropy_bonus=EntropyBonusConfig(target_entropy=measured - 0.01, measure=measure))
    assert control_step(c2, parts_of(b, [(0, 10)]))[1]["control/coef"] == 0.0


@pytest.mark.parametrize("method", ["forking_tokens", "low_prob_reweight", "stare"])
def test_advantage_methods_select_over_the_whole_batch_not_each_micro_batch(method):
    b = batch(seed=11)
    sections = {
        "forking_tokens": ForkingTokensConfig(top_ratio=0.3),
        "stare": StareConfig(target_entropy=100.0, w=2.0),
    }
    (whole,), _ = control_step(control(method, **sections), parts_of(b, [(0, 10)]))
    split, metrics = control_step(control(method, **sections), parts_of(b, [(0, 3), (3, 4), (4, 10)]))
    torch.testing.assert_close(torch.cat(split), whole)
    assert (whole != 1).any() and 0 < metrics["control/selected_share"] < 1
    # Values outside the mask do not matter, and never get a weight other than 1 (forking: 0).
    b2 = dict(b, entropy=torch.where(b["mask"], b["entropy"], 0.0), logp=torch.where(b["mask"], b["logp"], 0.0))
    (again,), _ = control_step(control(method, **sections), parts_of(b2, [(0, 10)]))
    torch.testing.assert_close(again, whole)
    assert (whole[~b["mask"]] == (0.0 if method == "forking_tokens" else 1.0)).all()


@pytest.mark.parametrize("method", ["clip_cov", "kl_cov"])
def test_update_selection_is_over_the_whole_update(method):
    b = batch(seed=12)
    old = b["logp"]
    logp = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(13)) * 0.2
    sections = {"clip_cov": ClipCovConfig(ratio=0.05, lb=0.0, ub=10.0), "kl_cov": KLCovConfig(ratio=0.05)}

    def run(bounds, logp_values):
        c = control(method, **{method: sections[method]})
        parts = [UpdatePart(logp_values[lo:hi], old[lo:hi], b["adv"][lo:hi], b["mask"][lo:hi]) for lo, hi in bounds]
        return torch.cat(update_selection(c, parts, update=1))

    whole = run([(0, 10)], logp)
    assert torch.equal(run([(0, 2), (2, 10)], logp), whole) and whole.any()
    assert not (whole & ~b["mask"]).any()
    assert torch.equal(run([(0, 10)], torch.where(b["mask"], logp, 5.0)), whole)  # masked values do not count
    assert update_selection(control("stare"), [UpdatePart(logp, old, b["adv"], b["mask"])], 0) is None


def test_none_leaves_every_weight_at_one_and_logs_the_same_entropy():
    b = batch(seed=14)
    (weights,), metrics = control_step(control("none"), parts_of(b, [(0, 10)]))
    tokens = action_tokens(b["mask"])
    assert (weights == 1).all() and metrics["control/weight_mean"] == 1.0
    assert metrics["stare/entropy_mean"] == pytest.approx(sum(float(b["entropy"][i]) for i in tokens) / len(tokens))
    assert "stare/gate" not in metrics and "theory/critical_weight" in metrics


def test_every_method_resolves_from_the_command_line_and_an_unknown_one_is_refused(capsys):
    from stare_agent import cli

    for method in METHODS:
        assert cli.main(["config", "rl", f"entropy_control.method={method}"]) == 0
        assert f"method: {method}" in capsys.readouterr().out
    for override, named in (
        ("entropy_control.method=gpt", "clip_cov"),
        ("stare.enabled=false", "entropy_control.method"),
    ):
        assert cli.main(["config", "rl", override]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and named in err, err


def test_entropy_and_selected_share_by_token_class_over_the_whole_batch():
    """entropy/<class> and control/selected_share_<class> of control_step against a loop: reasoning, code, answer,
    and the first AFTER_TOOL_TOKENS sampled tokens after each tool output; tool output itself is in none."""
    from stare_agent import protocol

    b = batch(seed=15)
    g = torch.Generator().manual_seed(16)
    classes = torch.randint(1, 5, b["mask"].shape, generator=g)  # reasoning, code, tool output, answer
    classes[~b["mask"]] = protocol.TOOL_OUTPUT
    classes[:, :2] = protocol.PROMPT
    c = control("stare", stare=StareConfig(target_entropy=100.0, w=2.0, top_ratio=0.3))
    parts = [MicroBatch(*(t[lo:hi] for t in (b["logp"], b["adv"], b["mask"], b["entropy"], b["s2"], classes)))
             for lo, hi in [(0, 4), (4, 10)]]  # fmt: skip
    weights, metrics = control_step(c, parts)
    weights = torch.cat(weights)
    members = {name: set() for name in ("reasoning", "code", "answer", "after_tool")}
    names = {protocol.REASONING: "reasoning", protocol.CODE: "code", protocol.ANSWER: "answer"}
    for r in range(b["mask"].shape[0]):
        since_tool = None
        for t in range(b["mask"].shape[1]):
            if classes[r, t] == protocol.TOOL_OUTPUT:
                since_tool = 0
            if not b["mask"][r, t]:
                continue
            if int(classes[r, t]) in names:
                members[names[int(classes[r, t])]].add((r, t))
            if since_tool is not None:
                since_tool += 1
                if since_tool <= protocol.AFTER_TOOL_TOKENS:
                    members["after_tool"].add((r, t))
    for name, tokens in members.items():
        assert tokens, name
        mean = sum(float(b["entropy"][i]) for i in tokens) / len(tokens)
        share = sum(float(weights[i] != 1) for i in tokens) / len(tokens)
        assert metrics[f"entropy/{name}"] == pytest.approx(mean, rel=1e-5), name
        assert metrics[f"control/selected_share_{name}"] == pytest.approx(share), name
    assert 0 < metrics["control/selected_share_reasoning"] < 1
    _, plain = control_step(control("none"), parts)
    assert "entropy/code" in plain and "control/selected_share_code" not in plain


def test_a_resumed_run_keeps_the_token_reports_up_to_its_checkpoint(tmp_path):
    import json

    from stare_agent.entropy_control import keep_reports_until

    path = tmp_path / "selected_tokens.jsonl"
    path.write_text("".join(json.dumps({"step": s, "tokens": []}) + "\n" for s in (10, 20, 30)))
    keep_reports_until(path, 20)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [10, 20]
    keep_reports_until(path, None)  # a fresh run starts a new file
    assert not path.exists()
    keep_reports_until(path, None)  # and none is fine
