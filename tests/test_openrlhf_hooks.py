"""The STARE hooks in OpenRLHF 0.11.2's PPO loop (stare_agent/backends/openrlhf/hooks.py), on OpenRLHF's own code.

Skipped where openrlhf is not installed (it is, with --no-deps, in .venv-openrlhf: docs/dev/openrlhf_cpu.md).
What cannot exist on this CPU machine is stood in for, and each test that does so says it:
- a policy actor rank is our subclass built without Ray (`object.__new__`, then the attributes its methods read:
  OpenRLHF's `Actor` around the tiny model, a strategy); a real rank initialises DeepSpeed on a GPU;
- OpenRLHF's `RayActorGroup` of such ranks is `LocalGroup`: it cuts the batch into per-rank chunks as
  `async_run_method_batch` does and runs the real methods of the local rank, results in Ray's object store;
- `torch.cuda.current_device()` / `torch.cuda.synchronize()`, which OpenRLHF calls unconditionally, are redirected
  to the CPU (a no-op) in the tests that run OpenRLHF's own forward or checkpoint code.
One local Ray instance (1 CPU) is started for the module, because OpenRLHF's experience maker and trainer pass
results through `ray.put` / `ray.get`; it is shut down at the end.
"""

from __future__ import annotations

import functools
import inspect
import math
import socket
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from stare_agent.config import RLConfig
from stare_agent.entropy_control import EntropyControl, EntropyControlConfig
from stare_agent.loss import policy_loss
from stare_agent.stare import StareConfig, StareController
from stare_agent.theory import REGIMES


@pytest.fixture(scope="module")
def hooks():
    pytest.importorskip("openrlhf")
    from stare_agent.backends.openrlhf import hooks

    return hooks


@pytest.fixture(scope="module")
def local_ray(hooks):
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def ds_args(**overrides):
    return NS(**{"packing_samples": False, "ring_attn_size": 1, "tensor_parallel_size": 1, "enable_sleep": False,
                 **overrides})  # fmt: skip


def openrlhf_args(n_samples: int = 4, micro_batch: int = 3, **ds):
    """The parts of OpenRLHF's parsed args that the experience maker and trainer read (GRPO as launch.py sets it)."""
    return NS(
        rollout=NS(n_samples_per_prompt=n_samples, micro_batch_size=micro_batch, max_new_tokens=None, batch_size=2),
        train=NS(
            dynamic_batch_enable=False, colocate_all=False, colocate_actor_ref=False, colocate_critic_reward=False
        ),
        algo=NS(
            advantage=NS(estimator="group_norm", gamma=1.0, lambd=1.0, no_std_norm=False, is_correction_level="off"),
            kl=NS(use_loss=False, estimator="k1", init_coef=0.0, target=None),
        ),
        reward=NS(
            clip_range=(-10, 10),
            overlong_buffer_len=None,
            overlong_penalty_factor=1.0,
            stop_properly_penalty_coef=None,
        ),
        data=NS(max_len=2048),
        ds=ds_args(**ds),
        critic=NS(freezing_steps=-1),
        vllm=NS(enable_sleep=False),
        logger=NS(wandb=NS(key=None), tensorboard_dir=None, logging_steps=1),
        ckpt=NS(best_metric_key="", save_steps=1, path="", load_enable=False, max_num=3, max_mem=1000),
    )


def actor_rank(hooks, model, temperature: float, args=None):
    """A StarePolicyModelActor without Ray (a real rank needs DeepSpeed on a GPU): OpenRLHF's Actor around `model`,
    packing samples as args.ds.packing_samples says."""
    from openrlhf.models import Actor

    args = args or openrlhf_args()
    actor = Actor(model, temperature=temperature)
    # What Actor sets only when it loads a model by name (actor.py): packing, and no KV cache in the forward, without
    # which transformers does not read the packed row's position ids as sample boundaries.
    actor.packing_samples = args.ds.packing_samples
    model.config.use_cache = False
    rank = object.__new__(hooks.StarePolicyModelActor)
    rank.actor = actor
    rank.strategy = NS(ring_attn_group=None, args=args)
    return rank


def rollout_batch(vocab: int, rows: int = 3, seed: int = 0):
    """Right-padded sequences of different lengths: prompt, action, observation (not an action), action."""
    g = torch.Generator().manual_seed(seed)
    lengths = [(3 + r % 3, 4 + 2 * r, 2, 3 + r) for r in range(rows)]  # prompt, action, observation, action
    width = max(sum(parts) for parts in lengths)
    sequences = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    action = torch.zeros(rows, width, dtype=torch.long)  # 1 at the sampled tokens themselves
    for r, (p, a1, o, a2) in enumerate(lengths):
        n = p + a1 + o + a2
        sequences[r, :n] = torch.randint(1, vocab, (n,), generator=g)
        attention[r, :n] = 1
        action[r, p : p + a1] = 1
        action[r, p + a1 + o : n] = 1
    return sequences, attention, action[:, 1:]  # OpenRLHF's action mask: at the predicting position, width S - 1


def direct_stats(model, sequences, attention, action_mask, temperature):
    """Log-prob of the next token, entropy and S2 of softmax(logits / T), computed plainly from the model's logits."""
    positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
    with torch.no_grad():
        logits = model(sequences, attention_mask=attention, position_ids=positions).logits.float() / temperature
    logp = torch.log_softmax(logits, -1)[:, :-1]
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    s2 = (p * p * (logp + entropy[..., None])).sum(-1)
    mask = action_mask.float()
    chosen = logp.gather(-1, sequences[:, 1:, None]).squeeze(-1)
    return chosen * mask, entropy * mask, s2 * mask


# --- the actor's forward -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_with_stats_is_openrlhfs_forward_plus_entropy_and_s2_of_the_sampling_policy(
    hooks, tiny_model, monkeypatch, temperature
):
    """Built without Ray (object.__new__): OpenRLHF's own `forward` runs with torch.cuda.current_device redirected
    to the CPU, which it calls unconditionally."""
    sequences, attention, action_mask = rollout_batch(tiny_model.config.vocab_size)
    rank = actor_rank(hooks, tiny_model, temperature)
    log_probs, entropy, s2 = rank.forward_with_stats(sequences, action_mask, attention)

    assert log_probs.shape == entropy.shape == s2.shape == action_mask.shape
    assert log_probs.device.type == entropy.device.type == s2.device.type == "cpu"
    ref_lp, ref_h, ref_s2 = direct_stats(tiny_model, sequences, attention, action_mask, temperature)
    torch.testing.assert_close(log_probs, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, ref_s2, rtol=1e-5, atol=1e-6)
    assert (entropy[action_mask == 0] == 0).all() and (entropy[action_mask == 1] > 0).all()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    openrlhf_log_probs = hooks.ORIGINAL_ACTOR.__ray_actor_class__.forward(rank, sequences, action_mask, attention)
    assert torch.equal(log_probs, openrlhf_log_probs)
    assert rank.actor.training  # put back in train mode, as OpenRLHF's forward leaves it


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_with_stats_on_packed_rows_equals_the_padded_pass(hooks, tiny_model, monkeypatch, temperature):
    """--ds.packing_samples: OpenRLHF's Actor runs the batch as one row of real tokens (position ids restarting per
    sample, no attention mask), with the attention implementation these tests load (sdpa), and flash_attn's padding
    helpers from upstream.py. Log-probs, H and S2 come back at the padded places and equal the padded pass's."""
    sequences, attention, action_mask = rollout_batch(tiny_model.config.vocab_size, rows=4)
    padded_rank = actor_rank(hooks, tiny_model, temperature)
    packed_rank = actor_rank(hooks, tiny_model, temperature, openrlhf_args(packing_samples=True))
    padded = padded_rank.forward_with_stats(sequences, action_mask, attention)
    packed = packed_rank.forward_with_stats(sequences, action_mask, attention)
    for mine, reference in zip(packed, padded, strict=True):
        assert mine.shape == reference.shape == action_mask.shape
        torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    assert (packed[1][action_mask == 1] > 0).all() and (packed[1][action_mask == 0] == 0).all()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    openrlhf_forward = hooks.ORIGINAL_ACTOR.__ray_actor_class__.forward
    # OpenRLHF's own packed log-probs, unchanged
    assert torch.equal(packed[0], openrlhf_forward(packed_rank, sequences, action_mask, attention))


def test_a_packed_row_attends_within_each_sample(hooks, tiny_model):
    """Changing the first sample's tokens changes its own statistics and no other sample's: attention does not cross
    the boundaries of the packed row (it would if the model took the row as one sequence)."""
    sequences, attention, action_mask = rollout_batch(tiny_model.config.vocab_size, rows=3)
    rank = actor_rank(hooks, tiny_model, 1.0, openrlhf_args(packing_samples=True))
    before = rank.forward_with_stats(sequences, action_mask, attention)
    changed = sequences.clone()
    changed[0, : int(attention[0].sum())] = (changed[0, : int(attention[0].sum())] % 7) + 1
    after = rank.forward_with_stats(changed, action_mask, attention)
    for old, new in zip(before, after, strict=True):
        assert not torch.allclose(old[0], new[0])
        torch.testing.assert_close(old[1:], new[1:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("ds", "flag"), [({"ring_attn_size": 2}, "--ds.ring_attn_size")])
def test_forward_with_stats_refuses_what_it_does_not_support(hooks, tiny_model, ds, flag):
    sequences, attention, action_mask = rollout_batch(tiny_model.config.vocab_size)
    rank = actor_rank(hooks, tiny_model, 1.0, openrlhf_args(**ds))
    with pytest.raises(NotImplementedError, match=flag):
        rank.forward_with_stats(sequences, action_mask, attention)


# --- the experience maker ------------------------------------------------------------------------------------------


class LocalGroup:
    """Stands in for OpenRLHF's RayActorGroup of policy ranks (a real one initialises DeepSpeed on a GPU).

    `async_run_method_batch` cuts the lists into `ranks` chunks as the real one does and runs the named method of
    the local rank item by item (as `execute_batch` does); results go into Ray's object store, one ref per chunk.
    `fit` (the DeepSpeed training step) returns `fit_status`; every call is recorded.
    """

    def __init__(self, rank, ranks: int = 2, fit_status=None):
        self.rank, self.ranks, self.fit_status = rank, ranks, fit_status or {}
        self.calls: list[tuple[str, dict]] = []

    def async_run_method_batch(self, method_name, **kwargs):
        import ray

        self.calls.append((method_name, kwargs))
        total = len(next(iter(kwargs.values())))
        chunk = math.ceil(total / self.ranks)
        refs = []
        for start in range(0, total, chunk):
            items = range(start, min(start + chunk, total))
            method = getattr(self.rank, method_name)
            refs.append(ray.put([method(**{k: v[i] for k, v in kwargs.items()}) for i in items]))
        return refs

    def async_run_method(self, method_name, **kwargs):
        import ray

        self.calls.append((method_name, kwargs))
        if method_name == "fit":
            return [ray.put(dict(self.fit_status))]
        return [ray.put(getattr(self.rank, method_name)(**kwargs))]


def rollout_samples(vocab: int, rewards: list[float], seed: int = 0, logprobs: bool = False):
    """One OpenRLHF Experience per episode, made by its own SamplesGenerator from agent-executor dicts; with
    `logprobs`, the engine's log-probs: random on sampled ids, 7.0 (never a log-prob) on the others."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    generator = SamplesGenerator(NS(args=openrlhf_args()), None, None, tokenizer=None, vllm_engines=[])
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, reward in enumerate(rewards):
        prompt, action_1, observation, action_2 = 3 + i % 2, 4 + (3 * i) % 7, 2, 2 + i % 4
        n = prompt + action_1 + observation + action_2
        response = {
            "prompt": f"p{i // 4}",
            "label": "",
            "observation_tokens": torch.randint(1, vocab, (n,), generator=g).tolist(),
            "action_ranges": [(prompt, prompt + action_1), (prompt + action_1 + observation, n)],
            "reward": reward,
            "scores": reward,
            "rollout_log_probs": None,
            "extra_logs": {},
        }
        if logprobs:
            sampled = torch.zeros(n, dtype=torch.bool)
            for start, end in response["action_ranges"]:
                sampled[start:end] = True
            values = torch.where(sampled, -torch.rand(n, generator=g) * 3, torch.full((n,), 7.0))
            response["rollout_log_probs"] = values.tolist()
        samples.append(generator._process_response_into_experience(response, max_len=2048))
    return samples


REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]  # two prompts' groups of 4
STARE_ON = StareConfig(op="C2", top_ratio=0.2, w=1.5, m=0.6, target_entropy=100.0, gate="batch")


def rl_config(method: str, **sections) -> RLConfig:
    return RLConfig(entropy_control=EntropyControlConfig(method), **sections)


def control(stare: StareConfig = STARE_ON, method: str = "stare") -> EntropyControl:
    return EntropyControl(rl_config(method, stare=stare))


def model_tokenizer(model):
    """The tokenizer saved beside a tiny model (the experience maker decodes ids into token classes)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.name_or_path)


def make_experiences(
    hooks, model, maker_cls, monkeypatch, temperature=0.8, logprobs=False, packing=False, **maker_kwargs
):
    """OpenRLHF's real make_experience_batch (split, forward, advantages) over 8 episodes in micro-batches of 3."""
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # OpenRLHF's `forward`; ours does not need it
    args = openrlhf_args(packing_samples=packing)
    group = LocalGroup(actor_rank(hooks, model, temperature, args), ranks=2)
    maker = maker_cls(
        group, None, None, None, FixedKLController(0.0), NS(args=args), model_tokenizer(model), **maker_kwargs
    )
    experiences = maker.make_experience_batch(rollout_samples(model.config.vocab_size, REWARDS, logprobs=logprobs))
    return experiences, maker, group


def padded(tensors):
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])


def test_stare_scales_openrlhfs_advantages_by_the_weights_of_the_whole_step(hooks, local_ray, tiny_model, monkeypatch):
    """Micro-batches of different widths (right-padded each), as two ranks' chunks; weights = one controller call
    on the concatenated batch (entropy computed directly from the model) times OpenRLHF's own advantages."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    plain, _, plain_group = make_experiences(hooks, tiny_model, RemoteExperienceMaker, monkeypatch)
    ctl = control()
    ours, maker, group = make_experiences(hooks, tiny_model, hooks.StareExperienceMaker, monkeypatch, control=ctl)
    assert [name for name, _ in group.calls] == ["forward_with_stats", "set_update_control"]
    assert group.calls[1][1]["step"] == 1 and group.calls[1][1]["config"].entropy_control.method == "stare"
    assert [name for name, _ in plain_group.calls] == ["forward"]
    assert len(ours) == 3 and len({e.action_mask.shape[1] for e in ours}) > 1
    assert ctl.step == 1 and ctl.stare.step == 1  # one call over the whole step

    mask = padded([e.action_mask for e in plain]).bool()
    advantages = padded([e.advantages for e in plain])
    log_probs = padded([e.action_log_probs for e in plain])
    entropies = []
    for e in plain:
        _, entropy, _ = direct_stats(tiny_model, e.sequences, e.attention_mask, e.action_mask, 0.8)
        entropies.append(entropy)
    expected, _ = StareController(STARE_ON)(-log_probs * mask, advantages, mask, padded(entropies))
    assert (expected[mask] > 1).any() and (expected[mask] < 1).any()  # both W and M applied somewhere
    row = 0
    for mine, theirs in zip(ours, plain, strict=True):
        b, t = theirs.action_mask.shape
        assert torch.equal(mine.action_log_probs, theirs.action_log_probs)
        torch.testing.assert_close(mine.advantages, theirs.advantages * expected[row : row + b, :t])
        row += b

    metrics = maker.pop_metrics()
    assert metrics["stare/gate"] == 1.0 and metrics["stare/w"] == 1.5 and metrics["stare/m"] == 0.6
    assert sum(metrics[f"theory/regime_{name}"] for name in REGIMES) == 1.0
    assert maker.pop_metrics() == {}


@pytest.mark.parametrize("method", ["forking_tokens", "low_prob_reweight"])
def test_the_other_advantage_methods_scale_openrlhfs_advantages_over_the_whole_step(
    hooks, local_ray, tiny_model, monkeypatch, method
):
    """The same hook point as STARE: OpenRLHF's advantages times step.control_step's weights of the whole step,
    computed here on the concatenated batch (entropy directly from the model)."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    from stare_agent.step import MicroBatch, control_step

    plain, _, _ = make_experiences(hooks, tiny_model, RemoteExperienceMaker, monkeypatch)
    ours, maker, _ = make_experiences(
        hooks, tiny_model, hooks.StareExperienceMaker, monkeypatch, control=control(method=method)
    )
    mask = padded([e.action_mask for e in plain]).bool()
    entropies = [direct_stats(tiny_model, e.sequences, e.attention_mask, e.action_mask, 0.8)[1] for e in plain]
    whole = MicroBatch(
        padded([e.action_log_probs for e in plain]), padded([e.advantages for e in plain]), mask,
        padded(entropies), torch.zeros(mask.shape),
    )  # fmt: skip
    (expected,), _ = control_step(control(method=method), [whole])
    assert (expected[mask] != 1).any() and (expected[~mask] == (0 if method == "forking_tokens" else 1)).all()
    row = 0
    for mine, theirs in zip(ours, plain, strict=True):
        b, t = theirs.action_mask.shape
        torch.testing.assert_close(mine.advantages, theirs.advantages * expected[row : row + b, :t])
        row += b
    assert 0 < maker.pop_metrics()["control/selected_share"] <= 1


def test_each_step_logs_the_engines_log_probs_against_the_trainers(hooks, local_ray, tiny_model, monkeypatch):
    """Over every action token of the step's micro-batches (widths differ), nothing outside the action mask."""
    ctl = control()
    ours, maker, _ = make_experiences(
        hooks, tiny_model, hooks.StareExperienceMaker, monkeypatch, logprobs=True, control=ctl
    )
    diffs = torch.cat([(e.rollout_log_probs - e.action_log_probs).abs()[e.action_mask.bool()] for e in ours])
    everywhere = torch.cat([(e.rollout_log_probs - e.action_log_probs).abs().flatten() for e in ours])
    assert diffs.numel() == sum(int(e.action_mask.sum()) for e in ours) and everywhere.max() > diffs.max()
    metrics = maker.pop_metrics()
    assert metrics["rollout_logprob_abs_diff"] == pytest.approx(float(diffs.mean()))
    assert metrics["rollout_logprob_abs_diff_max"] == pytest.approx(float(diffs.max()))
    assert "stare/gate" in metrics  # alongside the step's STARE metrics

    # an executor that returns no log-probs: no such metric (OpenRLHF's own executors, asked for none)
    _, maker, _ = make_experiences(hooks, tiny_model, hooks.StareExperienceMaker, monkeypatch, control=ctl)
    assert "rollout_logprob_abs_diff" not in maker.pop_metrics()


def same_experience(a, b) -> bool:
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif name == "info":
            if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
                return False
        elif x != y:
            return False
    return True


def test_with_stare_off_the_experiences_are_openrlhfs(hooks, local_ray, tiny_model, monkeypatch):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    plain, _, _ = make_experiences(hooks, tiny_model, RemoteExperienceMaker, monkeypatch)
    ctl = control(method="none")
    ours, maker, _ = make_experiences(hooks, tiny_model, hooks.StareExperienceMaker, monkeypatch, control=ctl)
    assert ctl.step == 1 and ctl.stare.step == 0
    assert all(same_experience(a, b) for a, b in zip(ours, plain, strict=True))
    metrics = maker.pop_metrics()
    assert 0 < metrics["stare/entropy_mean"] < math.log(tiny_model.config.vocab_size)
    assert "theory/lambda" in metrics
    before = [e.advantages for e in ours]
    maker.apply_control(ours, [(torch.zeros(e.action_mask.shape), torch.zeros(e.action_mask.shape)) for e in ours])
    assert all(e.advantages is b for e, b in zip(ours, before, strict=True))  # the same tensors, not a copy


def test_a_step_without_our_actor_fails_saying_to_install_the_hooks(hooks, monkeypatch):
    """OpenRLHF's make_experience_batch is replaced by one that never dispatches `forward_with_stats` (what happens
    when the actor group runs OpenRLHF's PolicyModelActor): the step stops instead of training without STARE."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    monkeypatch.setattr(RemoteExperienceMaker, "make_experience_batch", lambda self, samples: [object()])
    maker = hooks.StareExperienceMaker(
        None, None, None, None, FixedKLController(0.0), NS(args=openrlhf_args()), None,
        control=control(),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="hooks.install"):
        maker.make_experience_batch([])


@pytest.mark.parametrize("method", ["stare", "forking_tokens"])
def test_the_steps_weights_and_metrics_on_packed_rows_are_the_padded_ones(
    hooks, local_ray, tiny_model, monkeypatch, method
):
    """The whole experience step with --ds.packing_samples: OpenRLHF's log-probs, our H and S2, the method's
    selection and weights (hence the advantages) and the stare/, theory/ and mismatch metrics equal the padded
    step's."""
    results = {}
    for packing in (False, True):
        ctl = control(method=method)
        experiences, maker, _ = make_experiences(
            hooks, tiny_model, hooks.StareExperienceMaker, monkeypatch, logprobs=True, packing=packing, control=ctl
        )
        results[packing] = experiences, maker.pop_metrics()
    (padded, padded_metrics), (packed, packed_metrics) = results[False], results[True]
    for a, b in zip(packed, padded, strict=True):
        assert torch.equal(a.sequences, b.sequences) and torch.equal(a.action_mask, b.action_mask)
        torch.testing.assert_close(a.action_log_probs, b.action_log_probs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.advantages, b.advantages, rtol=1e-5, atol=1e-5)
    assert any((e.advantages != 0).any() for e in packed)
    assert packed_metrics.keys() == padded_metrics.keys() and "rollout_logprob_abs_diff" in packed_metrics
    for key, value in padded_metrics.items():
        assert packed_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True), key


# --- the loss: scaled advantages through OpenRLHF's PolicyLoss = our weighted policy_loss ------------------------


def test_weighted_advantages_through_openrlhfs_policy_loss_equal_our_weighted_loss(hooks):
    """Two data-parallel ranks, each with OpenRLHF's token-mean over the step's global token count x dp_size; the
    rank mean (what DeepSpeed's gradient all-reduce takes) equals our loss on the whole batch, gradients included."""
    from openrlhf.models.loss import PolicyLoss

    g = torch.Generator().manual_seed(0)
    rows, width, dual = 8, 30, 3.0
    mask = torch.rand(rows, width, generator=g) > 0.3
    old = -torch.rand(rows, width, generator=g) * 3
    new = old + torch.randn(rows, width, generator=g)  # ratios far from 1: both clip branches
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width).clone()
    weights = torch.where(torch.rand(rows, width, generator=g) < 0.3, 1.5, 1.0) * torch.where(
        torch.rand(rows, width, generator=g) < 0.2, 0.6, 1.0
    )
    ratio = (new - old).exp()
    assert ((ratio > 1.28) & (advantages > 0) & mask).any() and ((ratio < 0.8) & (advantages < 0) & mask).any()
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages)
    assert ((advantages < 0) & (surrogate < dual * advantages) & mask).sum() > 3  # dual-clip branch taken

    loss_fn = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual, token_level_loss=True)
    theirs_new = new.clone().requires_grad_(True)
    n_tokens, dp = mask.sum(), 2
    rank_losses = []
    for part in (slice(0, 3), slice(3, rows)):
        loss, *_ = loss_fn(
            theirs_new[part], old[part], (advantages * weights)[part], action_mask=mask[part],
            dp_size=dp, batch_num_tokens=n_tokens, global_batch_size=torch.tensor(float(rows)),
        )  # fmt: skip
        rank_losses.append(loss)
    theirs = sum(rank_losses) / dp
    theirs.backward()

    ours_new = new.clone().requires_grad_(True)
    ours, _ = policy_loss(ours_new, old, advantages, mask, eps_low=0.2, eps_high=0.28, dual_clip=dual, weights=weights)
    ours.backward()
    torch.testing.assert_close(theirs, ours)
    torch.testing.assert_close(theirs_new.grad, ours_new.grad)
    unweighted, _ = policy_loss(new, old, advantages, mask, eps_low=0.2, eps_high=0.28, dual_clip=dual)
    assert not torch.allclose(unweighted, ours)  # the weights matter


# --- the trainer ---------------------------------------------------------------------------------------------------


def make_trainer(hooks, group, ctl, args=None, tokenizer=None):
    """StarePPOTrainer over OpenRLHF's real BasePPOTrainer.__init__; PPOTrainer.__init__ itself (prompt datasets,
    tokenizer by name, the vLLM sample generator) is skipped: object.__new__ and the base initialiser."""
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    trainer = object.__new__(hooks.StarePPOTrainer)
    BasePPOTrainer.__init__(trainer, NS(args=args or openrlhf_args()), group, None, None, None, None, tokenizer)
    trainer.setup_stare(RLConfig(), ctl)  # what StarePPOTrainer.__init__ does after PPOTrainer.__init__ (skipped)
    return trainer


# --- the update: Clip-Cov, KL-Cov and the entropy bonus on the policy ranks (updates.py) ---------------------------


def method_tensors(seed=0, rows=4, width=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for r in range(rows):
        mask[r, 1 : width - r] = True
    mask[:, 4] = False  # a tool output
    old = -torch.rand(rows, width, generator=g) * 3
    logprobs = (old + torch.randn(rows, width, generator=g) * 0.3).requires_grad_()
    adv = torch.randn(rows, generator=g)[:, None].expand(rows, width) * mask
    return logprobs, old, adv, mask


@pytest.mark.parametrize("method", ["clip_cov", "kl_cov"])
def test_the_update_methods_loss_through_openrlhf_equals_the_local_loss(hooks, method):
    """MethodLoss in OpenRLHF's actor_loss_fn place, with OpenRLHF's global token normaliser (a micro-batch of a
    larger update), against the local backend's policy_loss with the same selection: value and gradient."""
    from openrlhf.models import PolicyLoss

    from stare_agent.entropy_control import ClipCovConfig, KLCovConfig, selection_loss_terms
    from stare_agent.loss import policy_loss

    logprobs, old, adv, mask = method_tensors()
    selected = torch.zeros_like(mask)
    selected[0, 2], selected[2, 6], selected[3, 1] = True, True, True
    config = rl_config(method, clip_cov=ClipCovConfig(), kl_cov=KLCovConfig(coef=2.5))
    state = hooks.updates.UpdateControl(EntropyControl(config), current=NS(info={}, stare_selected=selected))
    loss_fn = hooks.updates.MethodLoss(NS(update_control=state, trainer=NS()), PolicyLoss(0.2, 0.28))
    total = float(mask.sum()) + 17  # the update's action tokens on every rank
    got, clip_ratio, *_ = loss_fn(logprobs, old, adv, action_mask=mask.float(), dp_size=1, batch_num_tokens=total)
    terms = selection_loss_terms(method, selected, 2.5)
    weights = terms.pop("weights", None)
    ours, metrics = policy_loss(logprobs, old, adv, mask, eps_low=0.2, eps_high=0.28, weights=weights,
                                num_tokens=total, **terms)  # fmt: skip
    assert got.item() == pytest.approx(ours.item(), rel=1e-6)
    (g1,) = torch.autograd.grad(got, logprobs)
    (g2,) = torch.autograd.grad(ours, logprobs)
    torch.testing.assert_close(g1, g2)
    assert float(clip_ratio) == pytest.approx(float(metrics["policy/clip_frac"]))
    info = state.current.info
    assert float(info["control/selected_share"]) == pytest.approx(3 / float(mask.sum()))
    assert not any(key.startswith("_selected_") for key in info)  # the rank's trainer has no tokenizer here
    assert float(info["approx_kl"]) > 0 and 0 <= float(info["clip_frac_high"]) <= 1


@pytest.mark.parametrize("method", ["none", "stare", "clip_cov", "kl_cov"])
def test_masked_positions_change_neither_the_ranks_loss_nor_its_gradient(hooks, method):
    """MethodLoss, through OpenRLHF's PolicyLoss (STARE, none) and through ours (Clip-Cov, KL-Cov): inf, -inf and
    NaN at masked positions of the log-probs, the sampling log-probs and the advantages give the loss and gradient
    of the same batch with ordinary values there (OpenRLHF's PolicyLoss alone returns NaN)."""
    from openrlhf.models import PolicyLoss

    from stare_agent.entropy_control import ClipCovConfig, KLCovConfig

    logprobs, old, adv, mask = method_tensors(seed=2)
    selected = torch.zeros_like(mask)
    selected[0, 2], selected[2, 6] = True, True
    hostile = torch.tensor([float("inf"), float("-inf"), float("nan")])

    def poison(t, shift):
        out = t.detach().clone()
        out[~mask] = hostile[(torch.arange(int((~mask).sum())) + shift) % 3]
        return out

    results = []
    for dirty in (False, True):
        config = rl_config(method, clip_cov=ClipCovConfig(), kl_cov=KLCovConfig(coef=2.5))
        state = hooks.updates.UpdateControl(EntropyControl(config), current=NS(info={}, stare_selected=selected))
        loss_fn = hooks.updates.MethodLoss(NS(update_control=state, trainer=NS()), PolicyLoss(0.2, 0.28))
        leaf = (poison(logprobs, 0) if dirty else logprobs.detach().clone()).requires_grad_()
        args = (poison(old, 1), poison(adv, 2)) if dirty else (old, adv)
        loss, *_ = loss_fn(leaf, *args, action_mask=mask.float(), dp_size=1, batch_num_tokens=float(mask.sum()))
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    (clean, clean_grad), (got, grad) = results
    assert torch.isfinite(got) and torch.isfinite(grad).all()
    torch.testing.assert_close(got, clean)
    torch.testing.assert_close(grad, clean_grad)
    assert (grad[~mask] == 0).all() and (grad[mask] != 0).any()


def test_the_ranks_per_class_shares_become_the_steps_selected_share_by_class(hooks, tiny_model):
    """A rank's micro-batch logs each class's selected tokens and tokens as token means (updates.class_shares);
    after OpenRLHF averages them over the step, the trainer's ratio is the share of the class's tokens selected."""
    from stare_agent import protocol

    sequences, attention, action_mask = rollout_batch(tiny_model.config.vocab_size, rows=3)
    exp = NS(sequences=sequences, attention_mask=attention, action_mask=action_mask)
    classes = hooks.updates.experience_classes(model_tokenizer(tiny_model), exp)
    assert classes.shape == action_mask.shape
    assert set(classes[action_mask.bool()].tolist()) <= {protocol.REASONING, protocol.CODE, protocol.ANSWER}
    assert (classes[~action_mask.bool() & (attention[:, 1:] == 1)] != protocol.REASONING).all()
    selected = torch.zeros_like(action_mask, dtype=torch.bool)
    selected[0, 4], selected[1, 5] = True, True
    shares = hooks.updates.class_shares(selected & action_mask.bool(), action_mask.bool(), classes)
    status = {key: float(value) for key, value in shares.items()}
    out = hooks.class_shares_of(status)
    reasoning = action_mask.bool() & (classes == protocol.REASONING)
    expected = float((selected & reasoning).sum() / reasoning.sum())
    assert out["control/selected_share_reasoning"] == pytest.approx(expected) and expected > 0
    assert not any(key.startswith("_") for key in status)  # taken out of the status


def test_other_methods_keep_openrlhfs_loss_and_add_the_ratio_statistics(hooks):
    from openrlhf.models import PolicyLoss

    from stare_agent.loss import ratio_stats

    logprobs, old, adv, mask = method_tensors(seed=1)
    state = hooks.updates.UpdateControl(control(), current=NS(info={}))
    original = PolicyLoss(0.2, 0.28)
    got = hooks.updates.MethodLoss(NS(update_control=state), original)(logprobs, old, adv, action_mask=mask.float())
    theirs = original(logprobs, old, adv, action_mask=mask.float())
    assert got[0].item() == theirs[0].item() and float(got[1]) == float(theirs[1])
    stats = ratio_stats(logprobs.detach(), old, adv, mask, eps_low=0.2, eps_high=0.28)
    info = state.current.info
    assert float(info["clip_frac_high"]) == pytest.approx(float(stats["clip_high"] / stats["tokens"]))
    assert float(info["clip_frac_low"]) == pytest.approx(float(stats["clip_low"] / stats["tokens"]))
    assert float(info["ratio_abs_dev"]) == pytest.approx(float(stats["ratio_dev"] / stats["tokens"]))
    assert float(info["clip_frac_high"]) + float(info["clip_frac_low"]) > 0
    assert "control/selected_share" not in info


def test_each_update_selects_over_its_whole_window_from_the_current_policy(hooks, tiny_model):
    """Four micro-batches, two per optimizer update (OpenRLHF's windows): the first update selects from the
    experience's log-probs (the sampling policy), the second from a fresh forward of the rank's model; each
    window's selection is made over both its micro-batches (not each alone)."""
    from stare_agent.entropy_control import KLCovConfig
    from stare_agent.step import UpdatePart, update_selection

    rank = actor_rank(hooks, tiny_model, 0.8)
    config = rl_config("kl_cov", kl_cov=KLCovConfig(ratio=0.15))
    rank.set_update_control(config, step=3, alpha=0.0)
    experiences = []
    for seed in range(4):
        sequences, attention, action_mask = rollout_batch(tiny_model.config.vocab_size, rows=2, seed=seed)
        with torch.no_grad():
            current = rank.actor(sequences, action_mask, attention_mask=attention)
        noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(seed)) * action_mask
        advantages = torch.tensor([[1.0], [-0.5]]) * action_mask
        experiences.append(
            NS(sequences=sequences, attention_mask=attention, action_mask=action_mask, info={}, current=current,
               action_log_probs=current + noise, advantages=advantages)
        )  # fmt: skip
    hooks.updates._active["rank"] = rank
    try:
        out = [
            e for e, _ in hooks.updates.selecting_windows(iter(experiences), rank.strategy, 2, lambda e: e.action_mask)
        ]
    finally:
        hooks.updates.finish_fit()
    assert out == experiences and rank.update_control.update == 2

    def selection(window, update, source):
        parts = [UpdatePart(getattr(e, source), e.action_log_probs, e.advantages, e.action_mask) for e in window]
        return update_selection(EntropyControl(config), parts, update)

    first, second = experiences[:2], experiences[2:]
    for exp, sel in zip(first, selection(first, 0, "action_log_probs"), strict=True):
        assert torch.equal(exp.stare_selected, sel)
    for exp, sel in zip(second, selection(second, 1, "current"), strict=True):
        assert torch.equal(exp.stare_selected, sel)
    stale = torch.cat([s.flatten() for s in selection(second, 1, "action_log_probs")])
    assert not torch.equal(stale, torch.cat([e.stare_selected.flatten() for e in second]))  # the policy moved
    alone = update_selection(EntropyControl(config), [UpdatePart(second[0].current, second[0].action_log_probs,
                             second[0].advantages, second[0].action_mask)], 1)[0]  # fmt: skip
    assert not torch.equal(alone, second[0].stare_selected)  # the window, not the micro-batch


def test_with_token_budget_micro_batches_each_update_selects_over_its_micro_batches(hooks, tiny_model, monkeypatch):
    """train.dynamic_batch_enable: OpenRLHF's replay buffer (its real class, its dynamic fields set as
    setup_dynamic_batch makes them for one rank, which needs a process group) holds 5 micro-batches of 1-2 samples,
    the optimizer stepping after the 2nd and the 5th. Each micro-batch that training_step receives carries its slice
    of the selection made over exactly its update's micro-batches, from the current policy at the second update."""
    from openrlhf.models import PolicyLoss
    from openrlhf.trainer.ppo_utils.experience import (
        Experience,
        remove_padding_in_sequences,
        split_experience_batch,
    )
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer

    from stare_agent.entropy_control import KLCovConfig
    from stare_agent.step import UpdatePart, update_selection

    sequences, attention, action_mask = rollout_batch(tiny_model.config.vocab_size, rows=8)
    with torch.no_grad():
        current = actor_rank(hooks, tiny_model, 0.8).actor(sequences, action_mask, attention_mask=attention)
    noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(0)) * action_mask
    advantages = torch.tensor([[1.0], [-0.5]]).repeat(4, 1) * action_mask
    batch = Experience(sequences=sequences, attention_mask=attention, action_mask=action_mask,
                       action_log_probs=current + noise, advantages=advantages, info={})  # fmt: skip
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the buffer's target device, unused here
    buffer = NaiveReplayBuffer(1, packing_samples=True, dynamic_batch=True)
    buffer.items = remove_padding_in_sequences(split_experience_batch(batch))  # as the rank's `append` stores them
    buffer.dynamic_indices = [[0, 1], [2], [3, 4], [5], [6, 7]]
    buffer.dynamic_optimizer_step = [0, 1, 0, 0, 1]

    rank = actor_rank(hooks, tiny_model, 0.8, openrlhf_args(packing_samples=True))
    rank.strategy.args.train.dynamic_batch_enable = True
    rank.strategy.args.actor = NS(entropy_coef=None)
    seen = []

    def training_step(exp, kl_ctl, step, loss_batch_info=None):
        seen.append((step, exp.stare_selected))

    rank.trainer = NS(actor_loss_fn=PolicyLoss(0.2, 0.28), replay_buffer=buffer, training_step=training_step)
    config = rl_config("kl_cov", kl_cov=KLCovConfig(ratio=0.15))
    rank.set_update_control(config, step=3, alpha=0.0)
    strategy = hooks.updates._strategy_module.DeepspeedStrategy
    monkeypatch.setattr(strategy, "optimizer_step", strategy.optimizer_step)
    hooks.updates.prepare_fit(rank)
    try:
        for step in range(5):
            rank.trainer.training_step(buffer.collate_fn([buffer[step]]), 0.0, step)
    finally:
        hooks.updates.finish_fit()
    assert [step for step, _ in seen] == [0, 1, 2, 3, 4] and rank.update_control.update == 2

    def selection(micro_batches, update, policy):
        parts = []
        for indices in micro_batches:
            exp = buffer.collate_fn([[buffer.items[i] for i in indices]])
            width = exp.action_mask.shape[1]
            logp = torch.stack([policy[i, :width] for i in indices]) * exp.action_mask
            parts.append(UpdatePart(logp, exp.action_log_probs, exp.advantages, exp.action_mask))
        return update_selection(EntropyControl(config), parts, update)

    first = selection(buffer.dynamic_indices[:2], 0, current + noise)
    second = selection(buffer.dynamic_indices[2:], 1, current)
    for (_, got), expected in zip(seen, [*first, *second], strict=True):
        assert torch.equal(got, expected)
    split = [*selection(buffer.dynamic_indices[2:4], 1, current), *selection(buffer.dynamic_indices[4:], 2, current)]
    assert any(not torch.equal(got, other) for (_, got), other in zip(seen[2:], split, strict=True))


def test_fit_puts_the_steps_entropy_coefficient_and_our_loss_in_place(hooks, monkeypatch):
    from openrlhf.models import PolicyLoss

    from stare_agent.entropy_control import EntropyBonusConfig

    seen = []
    rank = object.__new__(hooks.StarePolicyModelActor)
    rank.strategy = NS(args=NS(actor=NS(entropy_coef=None), train=NS(dynamic_batch_enable=False)))
    rank.trainer = NS(actor_loss_fn=PolicyLoss(0.2, 0.28), training_step=lambda exp, *a, **k: seen.append(exp))
    strategy = hooks.updates._strategy_module.DeepspeedStrategy
    monkeypatch.setattr(strategy, "optimizer_step", strategy.optimizer_step)  # prepare_fit wraps it: undone after
    with pytest.raises(RuntimeError, match="set_update_control"):
        hooks.updates.prepare_fit(rank)
    bonus = rl_config("entropy_bonus", entropy_bonus=EntropyBonusConfig())
    for config, alpha, expected in ((bonus, 0.003, 0.003), (bonus, 0.0, None), (rl_config("stare"), 0.003, None)):
        rank.set_update_control(config, step=5, alpha=alpha)
        hooks.updates.prepare_fit(rank)
        assert rank.strategy.args.actor.entropy_coef == expected
    hooks.updates.finish_fit()
    assert isinstance(rank.trainer.actor_loss_fn, hooks.updates.MethodLoss)
    assert not isinstance(rank.trainer.actor_loss_fn.original, hooks.updates.MethodLoss)  # wrapped once
    rank.trainer.training_step("micro-batch", 0.0, 0)
    assert seen == ["micro-batch"] and rank.update_control.current == "micro-batch"
    assert strategy.optimizer_step.__wrapped__ is not strategy.optimizer_step  # the update check (nonfinite tests)


def test_openrlhfs_entropy_term_is_the_local_backends(hooks, tiny_model):
    """The entropy bonus in OpenRLHF is its training step's entropy term with our coefficient: its Actor's entropy at
    the action positions equals theory.token_entropy of softmax(logits / T), which the local loss averages."""
    from openrlhf.models import Actor

    from stare_agent.theory import token_entropy

    sequences, attention, action_mask = rollout_batch(tiny_model.config.vocab_size)
    actor = Actor(tiny_model, temperature=0.7)
    actor.packing_samples = False
    with torch.no_grad():
        _, output = actor(sequences, action_mask, attention_mask=attention, return_output=True, return_entropy=True)
        theirs = output.entropy[:, -action_mask.shape[1] :]
        positions = (attention.cumsum(-1) - 1).clamp_min(0)
        logits = tiny_model(input_ids=sequences, attention_mask=attention, position_ids=positions).logits
        ours = token_entropy(logits, temperature=0.7)[:, :-1]
    mask = action_mask.bool()
    torch.testing.assert_close(theirs[mask], ours[mask], rtol=1e-4, atol=1e-4)


def test_the_trainer_builds_the_controller_from_our_config_and_uses_our_maker(hooks, monkeypatch):
    """PPOTrainer.__init__ (datasets, tokenizer by name) is replaced by OpenRLHF's BasePPOTrainer.__init__."""
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    from stare_agent.backends.openrlhf.episodes import config_env
    from stare_agent.config import RLConfig

    config = RLConfig(stare=StareConfig(op="C2", w=1.3, m=0.7, w_mode="adaptive"))
    monkeypatch.setattr(hooks.ORIGINAL_TRAINER.__ray_actor_class__, "__init__", BasePPOTrainer.__init__)
    for key, value in config_env(config).items():
        monkeypatch.setenv(key, value)
    trainer = hooks.StarePPOTrainer(NS(args=openrlhf_args()), "actors", None, None, None, None, None)
    assert isinstance(trainer.experience_maker, hooks.StareExperienceMaker)
    assert trainer.experience_maker.control is trainer.control
    assert trainer.control.stare.config == config.stare and trainer.control.method == "stare"
    assert trainer.experience_maker.actor_model_group == "actors" and trainer.experience_maker.kl_ctl is trainer.kl_ctl


def test_train_step_reports_stare_and_theory_metrics_and_ships_the_weighted_advantages(
    hooks, local_ray, tiny_model, tiny_tokenizer, monkeypatch, tmp_path
):
    """OpenRLHF's real BasePPOTrainer.train_step; the ranks' DeepSpeed `fit` (GPU) is LocalGroup's canned status,
    and the rank's replay buffer (it moves data to CUDA) is a list that its real `append` fills. With a report
    every step, the tokens STARE reweighted are listed in the run folder."""
    import json

    rank = actor_rank(hooks, tiny_model, 0.8)
    rank.trainer = NS(replay_buffer=[])
    group = LocalGroup(rank, ranks=2, fit_status={"policy_loss": 0.5})
    args = openrlhf_args()
    args.ckpt.path = str(tmp_path / "checkpoints")
    trainer = make_trainer(hooks, group, control(), args=args, tokenizer=tiny_tokenizer)
    trainer.run_config.entropy_control.report_every = 1
    status, step = trainer.train_step(rollout_samples(tiny_model.config.vocab_size, REWARDS), 0)
    assert step == 1 and status["policy_loss"] == 0.5
    (report,) = [json.loads(line) for line in (tmp_path / "selected_tokens.jsonl").read_text().splitlines()]
    assert report["step"] == 1 and report["method"] == "stare" and report["selected"] > 0
    assert sum(n for _, _, n in report["tokens"]) == report["selected"] or len(report["tokens"]) == 50
    assert report["selected"] == round(status["control/selected_share"] * report["action_tokens"])
    assert status["stare/gate"] == 1.0 and status["stare/w"] == 1.5
    assert {"theory/lambda", "theory/critical_weight", "stare/frac_high_pos"} <= status.keys()
    assert all(isinstance(v, float) for k, v in status.items() if k.startswith(("stare/", "theory/")))
    appended = rank.trainer.replay_buffer
    assert len(appended) == 3
    raw = [e.returns for e in appended]  # group_norm: returns are the advantages before STARE
    assert any(not torch.equal(e.advantages, r) for e, r in zip(appended, raw, strict=True))


@pytest.fixture()
def gloo_process_group(monkeypatch):
    """torch.distributed on gloo with world size 1, for DeepSpeed on the CPU; destroyed afterwards."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()


def deepspeed_rank(hooks, tmp_path):
    """A rank holding a real DeepSpeed engine (ZeRO 0, CPU) and OpenRLHF's real DeepspeedStrategy."""
    import deepspeed
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    args = openrlhf_args()
    args.ds.param_dtype = "fp32"
    args.ckpt.path = str(tmp_path)
    args.ckpt.load_enable = True
    model = torch.nn.Linear(3, 2)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={"train_batch_size": 1, "zero_optimization": {"stage": 0}},
    )
    rank = object.__new__(hooks.StarePolicyModelActor)
    rank.strategy = DeepspeedStrategy(args=args)
    rank.actor = NS(model=engine)
    rank.disable_ds_ckpt, rank.save_hf_ckpt = False, False
    return rank, args


@pytest.mark.slow
def test_the_controller_state_rides_in_openrlhfs_deepspeed_checkpoint(
    hooks, local_ray, gloo_process_group, tmp_path, monkeypatch
):
    """Save: our save_logs_and_checkpoints -> OpenRLHF's -> PolicyModelActor.save_checkpoint -> DeepspeedStrategy.
    save_ckpt -> DeepSpeed; load: DeepspeedStrategy.load_ckpt (as init_model_from_pretrained does) -> our
    init_checkpoint_states. CUDA syncs OpenRLHF makes around it are no-ops here (barrier only)."""
    import os

    import openrlhf.trainer.ray.ppo_actor as actor_module
    import openrlhf.utils.deepspeed.deepspeed as strategy_module

    barrier_only = torch.distributed.barrier
    monkeypatch.setattr(strategy_module, "torch_dist_barrier_and_cuda_sync", barrier_only)
    monkeypatch.setattr(actor_module, "torch_dist_barrier_and_cuda_sync", barrier_only)

    from stare_agent.backends.openrlhf import resume

    tmp_path = tmp_path / "checkpoints"  # ckpt.path, as the launcher sets it: <run folder>/checkpoints
    rank, args = deepspeed_rank(hooks, tmp_path)
    saved = control(StareConfig(w_mode="adaptive"))
    saved.stare.load_state_dict({"w": 1.37, "m": 0.61, "w_star": 2.5, "last_gate": 1.0, "step": 12})
    saved.step = 12
    trainer = make_trainer(hooks, LocalGroup(rank), saved, args)
    trainer.keep_rate = 0.4  # the last trained batch's keep rate (up-front dispatch; RolloutBatch.keep_rate)
    client_states = {"episode": 0, "global_step": 12, "total_consumed_prompts": 24, "data_loader_state_dict": {}}
    trainer.save_logs_and_checkpoints(12, {"stare/gate": 1.0}, client_states)
    assert client_states[hooks.CHECKPOINT_KEY] == saved.state_dict()  # in place, for save_best_checkpoint too
    assert os.path.isdir(tmp_path / "_actor" / "global_step12")
    assert (tmp_path / "_actor" / "global_step12" / resume.COMPLETE).is_file()  # marked once every rank saved

    # The next save was cut short by a full disk: half its shards written, DeepSpeed's `latest` emptied.
    (tmp_path / "_actor" / "global_step13").mkdir()
    (tmp_path / "_actor" / "global_step13" / "mp_rank_00_model_states.pt").write_bytes(b"half")
    (tmp_path / "_actor" / "latest").write_text("")
    assert resume.prepare(tmp_path.parent).name == "global_step12"  # before the rerun starts Ray

    loader, _ = deepspeed_rank(hooks, tmp_path)
    _, loader.checkpoint_states = loader.strategy.load_ckpt(loader.actor.model, str(tmp_path / "_actor"))
    restored = control(StareConfig(w_mode="adaptive"))
    resumed = make_trainer(hooks, LocalGroup(loader), restored, args)
    resumed.samples_generator = NS(keep_rate=1.0, handed=0)
    states = resumed.init_checkpoint_states()
    assert restored.state_dict() == saved.state_dict()
    assert states["global_step"] == 12
    assert resumed.samples_generator.keep_rate == 0.4 and resumed.samples_generator.handed == 12


def test_without_a_checkpoint_the_controller_starts_fresh(hooks, local_ray, tmp_path):
    args = openrlhf_args()
    args.ckpt.path, args.ckpt.load_enable = str(tmp_path), True
    ctl = control(StareConfig())
    states = make_trainer(hooks, LocalGroup(None), ctl, args).init_checkpoint_states()
    assert states["global_step"] == 0 and ctl.step == 0 and ctl.stare.w == 1.1


def test_openrlhf_saves_keep_the_last_n_and_the_pinned_hugging_face_snapshots(hooks, local_ray, tmp_path, monkeypatch):
    """Our save_logs_and_checkpoints -> OpenRLHF's -> its PolicyModelActor.save_checkpoint with ckpt.save_hf (as
    launch.py sets it) at steps 1..5, keep_snapshots 2, step 2 pinned: exactly global_step{2,4,5}_hf remain. Stand-ins
    for what needs GPUs: the strategy's save_ckpt (DeepSpeed) writes the tag folder and `latest` as DeepSpeed does
    (its own rotation, ckpt.max_num, is OpenRLHF's and not ours), save_model (a ZeRO-3 gather) writes a config.json,
    and the CUDA sync is a no-op."""
    import openrlhf.trainer.ray.ppo_actor as actor_module

    monkeypatch.setattr(actor_module, "torch_dist_barrier_and_cuda_sync", lambda: None)

    def save_ckpt(model, save_dir, tag, max_num, max_mem, client_states, metric_value=None, metric_key=None):
        (tmp_path / "checkpoints" / "_actor" / tag).mkdir(parents=True)
        (tmp_path / "checkpoints" / "_actor" / "latest").write_text(tag)

    def save_model(model, tokenizer, output_dir):
        Path(output_dir).mkdir(parents=True)
        (Path(output_dir) / "config.json").write_text("{}")

    args = openrlhf_args()
    args.ckpt.path = str(tmp_path / "checkpoints")
    args.train.enable_ema = False
    rank = object.__new__(hooks.StarePolicyModelActor)
    rank.strategy = NS(args=args, save_ckpt=save_ckpt, save_model=save_model)
    rank.actor, rank.tokenizer, rank.disable_ds_ckpt, rank.save_hf_ckpt = NS(model="engine"), None, False, True
    trainer = make_trainer(hooks, LocalGroup(rank), control(), args)
    trainer.run_config = RLConfig(steps=5, save_every=1, keep_snapshots=2, pin_snapshots=[2])
    for step in range(1, 6):
        trainer.save_logs_and_checkpoints(step, {}, {"global_step": step})
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name != "_actor") == [
        "global_step2_hf", "global_step4_hf", "global_step5_hf",
    ]  # fmt: skip
    assert len(list((checkpoints / "_actor").iterdir())) == 6  # DeepSpeed's tags and `latest`: not ours to rotate


def test_an_actor_folder_without_a_loadable_checkpoint_starts_the_run_at_step_0(hooks, local_ray, tmp_path):
    """OpenRLHF reads `_actor/` existing as a checkpoint to load; when DeepSpeed found none in it (the first save
    was cut short) its ranks return an empty state and OpenRLHF's fit fails with KeyError 'episode'."""
    args = openrlhf_args()
    args.ckpt.path, args.ckpt.load_enable = str(tmp_path), True
    (tmp_path / "_actor" / "global_step1").mkdir(parents=True)
    rank = object.__new__(hooks.StarePolicyModelActor)
    rank.checkpoint_states = {}  # what init_model_from_pretrained keeps when DeepSpeed's load found nothing
    ctl = control(StareConfig())
    states = make_trainer(hooks, LocalGroup(rank), ctl, args).init_checkpoint_states()
    assert states["global_step"] == 0 and states["episode"] == 0 and ctl.step == 0


def test_tensorboard_shows_each_step_once_after_a_resume(hooks, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "tb" / "rl"
    crashed = SummaryWriter(log_dir=str(folder))
    for step in (1, 2, 3):  # the checkpoint was at step 1; steps 2 and 3 are trained again
        crashed.add_scalar("train/loss", 10.0 + step, step)
    crashed.flush()
    continued = hooks.continued_writer(crashed, 1)
    for step in (2, 3, 4):
        continued.add_scalar("train/loss", 20.0 + step, step)
    continued.close()
    events = EventAccumulator(str(folder))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert got == [(1, 11.0), (2, 22.0), (3, 23.0), (4, 24.0)]


# --- pinned OpenRLHF names and install() ---------------------------------------------------------------------------


def parameters(function) -> list[str]:
    """The parameter names, without the `_ray_trace_ctx` Ray adds to the signature of every actor method."""
    return [name for name in inspect.signature(function).parameters if name != "_ray_trace_ctx"]


def test_the_private_openrlhf_names_we_rely_on_are_unchanged(hooks):
    from openrlhf.models.loss import PolicyLoss
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    maker = RemoteExperienceMaker
    assert parameters(maker._dispatch_forward) == ["self", "group", "sync_condition", "kwargs"]
    assert parameters(maker._flatten_results) == ["self", "refs", "duplicate_factor"]
    assert parameters(maker.make_experience_batch) == ["self", "rollout_samples"]
    assert parameters(maker.__init__)[:8] == [
        "self", "actor_model_group", "critic_model_group", "reward_model_group", "initial_model_group",
        "kl_controller", "strategy", "tokenizer",
    ]  # fmt: skip
    # still the methods make_experience calls (so our overrides run), and the order of the step
    assert {"_dispatch_forward", "_flatten_results"} <= set(inspect.unwrap(maker.make_experience).__code__.co_names)
    step_calls = inspect.unwrap(maker.make_experience_batch).__code__.co_names
    assert {"make_experience", "compute_advantages_and_returns"} <= set(step_calls)
    assert parameters(BasePPOTrainer.save_logs_and_checkpoints) == [
        "self",
        "global_step",
        "logs_dict",
        "client_states",
    ]
    assert parameters(BasePPOTrainer.init_checkpoint_states) == ["self"]
    assert parameters(BasePPOTrainer.train_step) == ["self", "rollout_samples", "global_step"]
    assert "experience_maker" in BasePPOTrainer.train_step.__code__.co_names
    actor = hooks.ORIGINAL_ACTOR.__ray_actor_class__
    assert parameters(actor.forward) == [
        "self", "sequences", "action_mask", "attention_mask", "packed_seq_lens", "mm_train_inputs_list",
    ]  # fmt: skip
    assert parameters(hooks.StarePolicyModelActor.forward_with_stats) == parameters(actor.forward)
    assert parameters(PolicyLoss.forward) == [
        "self", "log_probs", "old_log_probs", "advantages", "action_mask", "rollout_log_probs", "dp_size",
        "batch_num_tokens", "global_batch_size",
    ]  # fmt: skip
    assert hooks.ORIGINAL_TRAINER.__ray_actor_class__.__name__ == "PPOTrainer"
    assert actor.__name__ == "PolicyModelActor"
    # updates.py, on the ranks: ppo_train groups its windows with the module's iter_grad_accum_global_norm and
    # trains each micro-batch with training_step, which calls actor_loss_fn and subtracts entropy_coef x entropy
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    assert "iter_grad_accum_global_norm" in ActorPPOTrainer.ppo_train.__code__.co_names
    assert parameters(hooks.updates.ORIGINAL_WINDOWS) == ["data_iter", "strategy", "accumulated_gradient", "mask_fn"]
    assert parameters(ActorPPOTrainer.training_step)[:2] == ["self", "experience"]
    assert {"actor_loss_fn", "entropy_coef"} <= set(ActorPPOTrainer.training_step.__code__.co_names)
    assert parameters(actor.fit) == ["self", "kl_ctl"]
    # upstream.checking_updates: the training step steps through the strategy, which steps the Actor's `model`
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    assert "optimizer_step" in ActorPPOTrainer.training_step.__code__.co_names
    assert {"model", "step"} <= set(inspect.unwrap(DeepspeedStrategy.optimizer_step).__code__.co_names)
    assert "skipped_steps" in DeepSpeedEngine.__init__.__code__.co_names
    assert callable(DeepSpeedZeroOptimizer_Stage3.has_overflow)  # what it finds: test_openrlhf_nonfinite.py


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # runpy: the CLI module was imported before
def test_install_puts_our_classes_where_train_ppo_ray_finds_them(hooks, monkeypatch):
    import argparse
    import runpy
    import sys

    import openrlhf.cli.train_ppo_ray as cli
    import openrlhf.trainer.ppo_trainer as trainer_module
    import openrlhf.trainer.ray as engines_package
    import openrlhf.trainer.ray.ppo_actor as actor_module

    for module, name in (
        (actor_module, "PolicyModelActor"),
        (trainer_module, "PPOTrainer"),
        (cli, "PolicyModelActor"),
        (engines_package, "create_vllm_engines"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    installed = hooks.install()
    assert hooks.install() == installed  # idempotent: the same wrapped classes
    actor_cls, trainer_cls = installed["PolicyModelActor"], installed["PPOTrainer"]
    assert actor_module.PolicyModelActor is actor_cls and cli.PolicyModelActor is actor_cls
    assert trainer_module.PPOTrainer is trainer_cls
    assert actor_cls.__ray_actor_class__ is hooks.StarePolicyModelActor
    assert trainer_cls.__ray_actor_class__ is hooks.StarePPOTrainer
    assert actor_cls._default_options == hooks.ORIGINAL_ACTOR._default_options == {"num_gpus": 1}
    assert trainer_cls._default_options == hooks.ORIGINAL_TRAINER._default_options

    # The engines OpenRLHF's CLI creates return the log-probs of the distribution sampled from, whatever
    # OpenRLHF's importance-sampling setting (it passes logprobs_mode None, positionally, when that is off).
    created = engines_package.create_vllm_engines
    assert getattr(created, "stare_processed_logprobs", False)
    hooks.install()
    assert engines_package.create_vllm_engines is created  # wrapped once
    signature = inspect.signature(created)
    seen_calls = []
    recorder = hooks._processed_logprobs(
        functools.wraps(inspect.unwrap(created))(lambda *a, **k: seen_calls.append(signature.bind(*a, **k)))
    )
    recorder(1, 1, "model", 0, False, True, True, 2048, None, 0.9, True, None, agent_func_path="x.py")
    assert seen_calls[0].arguments["logprobs_mode"] == "processed_logprobs"
    assert seen_calls[0].arguments["agent_func_path"] == "x.py" and seen_calls[0].arguments["max_model_len"] == 2048

    # The CLI run as __main__ (as the launcher runs it) binds our actor class; stopped at its parse_args.
    seen = {}

    class Stop(Exception):
        pass

    def intercept(self, *args, **kwargs):
        seen["globals"] = sys._getframe(1).f_globals
        raise Stop

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", intercept)
    with pytest.raises(Stop):
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    assert seen["globals"]["PolicyModelActor"] is actor_cls
    assert seen["globals"]["create_vllm_engines"] is created


# --- full batches: the sample generator inside OpenRLHF's own fit loop ---------------------------------------------


def scripted_episode(kind: str, sample: int):
    """An episode whose outcome the prompt's kind decides: varied = right on odd samples, after a tool call (a
    failed one on sample 2); flat = always wrong; broken = the sandbox failed; long = no room for a turn."""
    from stare_agent.agent import EpisodeResult, Turn

    if kind == "long":
        return EpisodeResult("p", [5, 6, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -1.0, -1.0], 2, [], None, None, "length")
    call = Turn("x", 2, code="print(1)", status="error" if sample == 2 else "ok", duration_ms=4.0 * sample)
    turns = [call, Turn("y", 1)] if kind == "varied" else [Turn("x", 2)]
    ids, mask = [5, 6, 7, 8, 9, 10][: 2 + 2 * len(turns)], [0, 0, 1, 1, 0, 1][: 2 + 2 * len(turns)]
    reward = None if kind == "broken" else float(kind == "varied" and sample % 2 == 1)
    finish = "sandbox_error" if kind == "broken" else "answer" if reward else ("eos", "tool_limit")[sample % 2]
    logprobs = [-1.0 * m for m in mask]
    return EpisodeResult("p", ids, mask, logprobs, 2, turns, None, reward, finish)


def scripted_response(kind: str, sample: int, prompt: str, label: str) -> dict:
    """What our executor returns (episodes.to_response) for `scripted_episode`."""
    from stare_agent.backends.openrlhf.episodes import to_response

    return to_response(scripted_episode(kind, sample), prompt=prompt, label=label)


class ScriptedEngine:
    """Stands in for OpenRLHF's vLLM engine actor (a real one runs end to end in test_openrlhf_e2e.py): its two
    remote methods the generator calls answer at once, through Ray's object store (`ray.put`), so OpenRLHF's
    `ray.wait` / `ray.get` on them run as with the real actor; `generate_responses` returns our executor's dicts."""

    def __init__(self, ray):
        def remote(method):
            return NS(remote=lambda *args, **kwargs: ray.put(method(*args, **kwargs)))

        self.get_num_unfinished_requests = remote(lambda: 0)
        self.generate_responses = remote(self._responses)

    @staticmethod
    def _responses(prompt, label, sampling_params, max_length, hf_tokenizer, num_samples, images):
        kind = prompt.split(":")[0]
        return [scripted_response(kind, i, prompt, label) for i in range(num_samples)]


class TimedEngine:
    """Stands in for OpenRLHF's vLLM engine actor where timing matters: a real async Ray actor whose
    `generate_responses` task answers our executor's dicts for the prompt (made here, in the test process) after
    `delay(prompt)` seconds, recording each prompt it started, finished, or had cancelled (asyncio.CancelledError,
    as Ray delivers `ray.cancel` to an async actor's task; vLLM's engine aborts the request there)."""

    def __init__(self, ray, delay):
        import asyncio

        @ray.remote(num_cpus=0)
        class Engine:
            def __init__(self):
                self.log = {"started": [], "finished": [], "cancelled": []}

            def get_num_unfinished_requests(self):
                return len(self.log["started"]) - len(self.log["finished"]) - len(self.log["cancelled"])

            async def generate_responses(self, prompt, seconds, responses):
                self.log["started"].append(prompt)
                try:
                    await asyncio.sleep(seconds)
                except asyncio.CancelledError:
                    self.log["cancelled"].append(prompt)
                    raise
                self.log["finished"].append(prompt)
                return responses

            def report(self):
                return self.log

        self.actor = Engine.remote()
        self.get_num_unfinished_requests = self.actor.get_num_unfinished_requests

        def generate(prompt, label, sampling_params, max_length, hf_tokenizer, num_samples, images):
            kind = prompt.split(":")[0]
            responses = [scripted_response(kind, i, prompt, label) for i in range(num_samples)]
            return self.actor.generate_responses.remote(prompt, delay(prompt), responses)

        self.generate_responses = NS(remote=generate)

    def report(self):
        import ray

        return ray.get(self.actor.report.remote())


def fit_run(
    hooks, ray, monkeypatch, kinds, *, steps=3, prompts_per_step=2, budget=0, resume_at=0, fraction=0.5, shuffle=True,
    engine=None, ranks=None, method="stare", **rollout_keys,
):  # fmt: skip
    """OpenRLHF's real PPOTrainer.fit over our trainer, with a StareSamplesGenerator over a real prompt loader and a
    scripted engine; the update itself (BasePPOTrainer.train_step: DeepSpeed ranks on a GPU) records its batch.
    With `ranks` (NS(group, tokenizer)) OpenRLHF's real train_step runs instead, over that stand-in actor group."""
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer
    from torchdata.stateful_dataloader import StatefulDataLoader  # the loader class OpenRLHF's strategy makes

    from stare_agent.config import RLConfig, RolloutConfig

    prompts = [f"{kind}: problem {i}" for i, kind in enumerate(kinds)]
    loader = StatefulDataLoader(
        prompts, batch_size=1, shuffle=shuffle, collate_fn=lambda b: (None, b, ["1"] * len(b), [None])
    )
    rollout = RolloutConfig(
        prompts_per_step=prompts_per_step, group_size=4, max_prompts_per_step=budget,
        max_sandbox_failure_fraction=fraction, audit_masks=False,  # scripted ids with no tokenizer: nothing to audit
        **rollout_keys,
    )  # fmt: skip
    config = RLConfig(rollout=rollout, steps=steps)
    args = openrlhf_args(n_samples=4)
    args.rollout.batch_size = prompts_per_step
    args.algo.dynamic_filtering_enable, args.algo.dynamic_filtering_range = True, [0.0, 1.0]
    args.train.num_episodes = 1
    args.eval = NS(steps=float("inf"))
    args.ckpt.save_steps = float("inf")
    strategy = NS(args=args)
    trained: list[list] = []

    def train_step(self, rollout_samples, global_step):
        trained.append(rollout_samples)
        return {"policy_loss": 0.0}, global_step + 1

    if ranks is None:
        monkeypatch.setattr(BasePPOTrainer, "train_step", train_step)
    monkeypatch.setattr(BasePPOTrainer, "broadcast_to_vllm", lambda self: None)  # the engine's weights: e2e test
    trainer = object.__new__(hooks.StarePPOTrainer)
    group, tokenizer = (None, None) if ranks is None else (ranks.group, ranks.tokenizer)
    BasePPOTrainer.__init__(trainer, strategy, group, None, None, None, None, tokenizer)
    trainer.prompts_dataloader, trainer.eval_dataloader, trainer.generate_kwargs = loader, None, {}
    trainer.setup_stare(config, control(StareConfig(), method=method))
    trainer.samples_generator = generator = hooks.StareSamplesGenerator(
        strategy=strategy, prompts_dataloader=loader, eval_dataloader=None, tokenizer=None,
        vllm_engines=[engine or ScriptedEngine(ray)], steps=steps, rollout=rollout,
    )  # fmt: skip
    logged: list[dict] = []
    monkeypatch.setattr(
        hooks.ORIGINAL_TRAINER.__ray_actor_class__,
        "save_logs_and_checkpoints",
        lambda self, step, logs=None, states=None: logged.append(dict(logs)),
    )
    states = {"episode": 0, "global_step": resume_at, "total_consumed_prompts": 0, "data_loader_state_dict": {}}
    monkeypatch.setattr(BasePPOTrainer, "init_checkpoint_states", lambda self: dict(states))
    hooks.ORIGINAL_TRAINER.__ray_actor_class__.fit(trainer)  # OpenRLHF's loop, as the trainer actor runs it
    return NS(trained=trained, logged=logged, report=trainer.end_report(), generator=generator, rollout=rollout)


def test_fit_trains_exactly_steps_full_batches_whatever_the_filter_rate(hooks, local_ray, monkeypatch):
    """Two runs of one config, filtered at different rates, make the same 3 updates of 2 full groups each, over
    several passes of a 6-prompt file; OpenRLHF's own loop would end after one pass with a partial batch."""
    consumed = {}
    for name, kinds in {"few": ["varied"] * 5 + ["flat"], "many": ["varied", "flat", "flat"] * 2}.items():
        run = fit_run(hooks, local_ray, monkeypatch, kinds)
        assert [len(batch) for batch in run.trained] == [8, 8, 8]  # 2 groups x 4 samples, 3 times
        for batch in run.trained:
            assert all(sample.prompts[0].startswith("varied") for sample in batch)
            assert all("finish_sandbox_error" not in sample.info for sample in batch)
        assert [row["rollout/groups_kept"] for row in run.logged] == [2.0, 2.0, 2.0]
        assert run.report == {"trained": 3, "steps": 3, "reason": ""}
        consumed[name] = sum(row["rollout/prompts_consumed"] for row in run.logged)
        assert consumed[name] == 6 + sum(row["rollout/groups_dropped_equal"] for row in run.logged)
    assert consumed["many"] > consumed["few"] and consumed["many"] >= 12  # two passes at least
    schedule = hooks.StarePPOTrainer.get_max_steps  # the LR schedule's length, in optimizer updates
    assert schedule(NS(run_config=NS(steps=3, optim=NS(updates_per_batch=1)))) == 3
    assert schedule(NS(run_config=NS(steps=3, optim=NS(updates_per_batch=4)))) == 12


def test_up_front_dispatch_fills_the_batch_and_stops_the_groups_still_generating(hooks, local_ray, monkeypatch):
    """rollout.max_dispatch_factor 3 from a keep rate of 1/2: the first step dispatches 4 prompts for its 2 groups;
    once 2 are kept the one still generating (a slow prompt) is cancelled on the engine, counted, and not waited
    for; the second step dispatches by the first step's keep rate (2 of 3 judged: 3 prompts). Prompts in file
    order; prompts 3 and 7 take 10 minutes: they never finish within the test."""
    kinds = ["varied", "flat", "varied", "varied", "varied", "flat", "varied", "flat"]
    slow = ("problem 3", "problem 7")
    engine = TimedEngine(local_ray, delay=lambda prompt: 600.0 if prompt.endswith(slow) else 0.05)
    run = fit_run(
        hooks, local_ray, monkeypatch, kinds, steps=2, shuffle=False, engine=engine,
        max_dispatch_factor=3.0, initial_keep_rate=0.5,
    )  # fmt: skip
    assert [len(batch) for batch in run.trained] == [8, 8]
    log = engine.report()
    prompts = [f"{kind}: problem {i}" for i, kind in enumerate(kinds)]
    first, second = run.logged
    assert (first["rollout/prompts_consumed"], first["rollout/groups_cancelled"]) == (4, 1)
    assert (first["rollout/groups_kept"], first["rollout/groups_dropped_equal"]) == (2, 1)
    # The second step dispatches 3 up front (prompts 4-6); whether prompt 5's drop comes back before prompt 6 has
    # finished decides whether prompt 7 goes out too (then it is cancelled: it cannot finish).
    assert log["started"][:7] == prompts[:7] and log["cancelled"][0] == prompts[3]
    again = log["started"][7:] == prompts[7:]
    assert log["cancelled"] == [prompts[3], *([prompts[7]] if again else [])]
    assert (second["rollout/prompts_consumed"], second["rollout/groups_cancelled"]) == (3 + again, int(again))
    assert second["rollout/groups_kept"] == 2 and second["rollout/groups_dropped_equal"] == 1
    assert run.generator.keep_rate == pytest.approx(2 / 3)
    for batch in run.trained:
        assert all(sample.prompts[0].startswith("varied") for sample in batch)


def test_without_dynamic_sampling_equal_groups_are_trained_and_sandbox_failures_still_dropped(
    hooks, local_ray, monkeypatch
):
    """rollout.dynamic_sampling false: a group of equal rewards is trained; a group with a sandbox failure is not
    (its episodes were never scored), and is refilled."""
    run = fit_run(hooks, local_ray, monkeypatch, ["flat", "broken", "varied"], steps=1, shuffle=False,
                  dynamic_sampling=False)  # fmt: skip
    [batch] = run.trained
    # in the order the groups finished, which two groups generated at once may swap
    assert sorted(sample.prompts[0].split(":")[0] for sample in batch) == ["flat"] * 4 + ["varied"] * 4
    logged = run.logged[0]
    assert (logged["rollout/groups_kept"], logged["rollout/groups_dropped_sandbox"]) == (2, 1)
    assert logged["rollout/groups_dropped_equal"] == 0 and logged["rollout/prompts_consumed"] == 3


def test_without_up_front_dispatch_each_dropped_group_is_replaced_by_one_prompt(hooks, local_ray, monkeypatch):
    """max_dispatch_factor 1 (the default): 2 prompts for 2 groups, then one new prompt per dropped group, as
    OpenRLHF's own generator does; nothing is cancelled."""
    kinds = ["varied", "flat", "flat", "varied", "varied", "varied"]
    engine = TimedEngine(local_ray, delay=lambda prompt: 0.05)
    run = fit_run(hooks, local_ray, monkeypatch, kinds, steps=1, shuffle=False, engine=engine)
    log = engine.report()
    assert log["started"] == [f"{kind}: problem {i}" for i, kind in enumerate(kinds)][:4] and not log["cancelled"]
    assert run.logged[0]["rollout/prompts_consumed"] == 4 and run.logged[0]["rollout/groups_dropped_equal"] == 2


def test_both_backends_log_the_same_rollout_metrics_for_the_same_episodes(hooks, local_ray, monkeypatch):
    """One step over the same prompts and episodes, through OpenRLHF's fit with our generator and through the
    local loop's rollouts: the same rollout/ names and values (docs/metrics.md). Both take the prompts in file
    order here, so that they consume the same ones."""
    import asyncio

    from stare_agent.backends.local import rl
    from stare_agent.config import RLConfig
    from stare_agent.data import Problem

    kinds = ["broken", "flat", "varied", "long", "varied", "flat"]
    run = fit_run(hooks, local_ray, monkeypatch, kinds, steps=1, shuffle=False)
    openrlhf = {key: value for key, value in run.logged[0].items() if key.startswith("rollout/")}

    async def run_batch(problems, **kwargs):  # the local loop's episodes: each problem's group in turn
        return [scripted_episode(p.problem.split(":")[0], i % run.rollout.group_size) for i, p in enumerate(problems)]

    monkeypatch.setattr(rl, "run_batch", run_batch)
    monkeypatch.setattr(rl, "stream_indices", lambda n, seed, start, count: list(range(start, start + count)))
    problems = [Problem(f"p{i}", f"{kind}: problem {i}", "1", "test") for i, kind in enumerate(kinds)]
    trainer = NS(
        config=RLConfig(rollout=run.rollout, steps=1), problems=problems, cursor=0, tokenizer=None, keep_rate=1.0
    )
    trainer.generator = None
    _, _, local = asyncio.run(rl.Trainer.rollouts(trainer, client=None))

    assert openrlhf == pytest.approx(local) and set(openrlhf) == set(local)
    assert local["rollout/prompts_consumed"] == 5 and local["rollout/groups_dropped_sandbox"] == 1
    assert local["rollout/episodes"] == 20 and local["rollout/reward"] == pytest.approx(4 / 12)  # 8 unscored
    assert local["rollout/tool_errors"] == pytest.approx(2 / 20) and local["rollout/finish_sandbox_error"] == 0.2


def test_a_step_that_cannot_fill_its_batch_ends_fit_without_training_it(hooks, local_ray, monkeypatch):
    run = fit_run(hooks, local_ray, monkeypatch, ["flat", "long", "flat", "varied"], prompts_per_step=2, budget=3)
    # each step draws at most 3 prompts; with 1 varied prompt in 4, some step keeps fewer than 2 groups
    assert all(len(batch) == 8 for batch in run.trained) and len(run.trained) < 3
    assert run.report["trained"] == len(run.trained)
    assert "consumed 3 prompts (rollout.max_prompts_per_step=3)" in run.report["reason"]
    last = run.generator.fill_metrics
    assert last["rollout/prompts_consumed"] == 3 and last["rollout/groups_kept"] < 2
    assert last["rollout/groups_dropped_prompt_too_long"] + last["rollout/groups_dropped_equal"] >= 2


def test_a_resumed_run_trains_only_the_steps_left(hooks, local_ray, monkeypatch):
    run = fit_run(hooks, local_ray, monkeypatch, ["varied"] * 4, steps=3, resume_at=2)
    assert len(run.trained) == 1 and run.report["trained"] == 3


def test_too_many_sandbox_failures_stop_fit_with_an_error(hooks, local_ray, monkeypatch):
    from stare_agent.batching import SandboxFailures

    with pytest.raises(SandboxFailures, match=r"failed in the sandbox, more than .*fraction=0.25"):
        fit_run(hooks, local_ray, monkeypatch, ["broken", "varied", "varied", "varied"], fraction=0.25, steps=4)
