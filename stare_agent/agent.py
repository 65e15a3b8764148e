"""One multi-turn episode of the tool agent, over an abstract generator and a sandbox client.

The model writes; when a turn ends in a tool call the code runs in the sandbox and the rendered
output is appended (protocol.observation); this repeats until the model answers, stops, or a
budget is hit. Two drivers share one episode state machine (`_Episode`):

- `run_episode`: one episode over an async `generate(ids, max_new_tokens) -> Sample` (a server or
  an async engine that batches concurrent requests itself);
- `run_batch`: lock-step for backends that generate a whole batch at once (Hugging Face
  `generate`): every live episode generates one turn together, then all of that turn's tool calls
  run concurrently, so a turn costs the slowest call rather than the sum.

Sequences are concatenations of id segments: sampled ids exactly as generated, observation ids
tokenized alone (DESIGN section 4). A sandbox that keeps failing after retries ends the episode
with `finish_reason == "sandbox_error"` and `reward is None`: it is not the model's fault and
must not be scored as a wrong answer.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from stare_agent import protocol
from stare_agent.data import Problem
from stare_agent.reward import extract_answer, score
from stare_sandbox.client import SandboxUnavailable, SessionNotFound
from stare_sandbox.schemas import RunResult, Status

GenerationEnd = Literal["stop", "eos", "length"]
"""Why one generation call ended: a stop string, the EOS token, or max_new_tokens."""
FinishReason = Literal["answer", "eos", "length", "tool_limit", "sandbox_error", "invalid_token"]
"""invalid_token: the model sampled an id its tokenizer cannot decode (a row of the output layer beyond the
vocabulary, as Qwen2.5-7B's 152,064 logits have over 151,669 ids); the ids are kept, the reward is 0."""
ToolMode = Literal["stateful", "stateless"]


@dataclass(frozen=True)
class Sample:
    """What a generator returns for one turn."""

    token_ids: list[int]
    """Sampled ids exactly as generated (the last one may hold a stop string followed by more text)."""
    logprobs: list[float]
    """Log-probability of each sampled id under the sampling policy."""
    finish_reason: GenerationEnd
    versions: list[int] | None = None
    """The policy version (optimizer steps in the engine's weights) that sampled each id; None when the engine does
    not say (then the episode records NO_VERSION for them)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} log-probs")
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.versions)} policy versions")


NO_VERSION = -1
"""The policy version recorded for an id no policy sampled (prompt, observation) or whose version is unknown."""


def span_versions(completion: Any) -> list[int] | None:
    """Each output id's policy version from a vLLM CompletionOutput's `weight_versions` spans ([start, end) of
    output-token indexes, labelled with the version string the engine was given; vLLM >= 0.32 stamps them in the
    engine core, so a request that ran across a weight update has two or more spans). None when the output has
    none or a label is not a version number (an engine never told one: vLLM's label is then "default")."""
    spans = getattr(completion, "weight_versions", None)
    if not spans:
        return None
    versions = [NO_VERSION] * len(completion.token_ids)
    for span in spans:
        if not str(span.version).isdigit():
            return None
        versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
    if NO_VERSION in versions:
        raise RuntimeError(f"vLLM's weight-version spans {spans} do not cover the {len(versions)} output ids")
    return versions


def completion_sample(completion: Any) -> Sample:
    """A Sample from one vLLM CompletionOutput (both backends' engines): its ids as generated, each id's log-prob
    (the request must have asked for the sampled token's), the mapped finish. Finish: "stop" with a string
    stop_reason is a stop string; "stop" otherwise is EOS (None) or an EOS id of the generation config (an int);
    "length" is the token cap. Any other reason ("abort") is an engine error.
    """
    token_ids = list(completion.token_ids)
    entries = completion.logprobs
    if entries is None or len(entries) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(entries or [])} log-prob entries for {len(token_ids)} ids")
    logprobs = [float(entry[token].logprob) for token, entry in zip(token_ids, entries, strict=True)]
    finish: GenerationEnd
    if completion.finish_reason == "length":
        finish = "length"
    elif completion.finish_reason == "stop":
        finish = "stop" if isinstance(completion.stop_reason, str) else "eos"
    else:
        raise RuntimeError(f"vLLM ended a request with finish_reason {completion.finish_reason!r}")
    return Sample(token_ids, logprobs, finish, span_versions(completion))


class Generate(Protocol):
    async def __call__(self, ids: list[int], max_new_tokens: int) -> Sample: ...


GenerateBatch = Callable[[list[list[int]], list[int]], "list[Sample] | Awaitable[list[Sample]]"]
"""(batch of id lists, max new tokens for each) -> one Sample each; may be sync or async."""


Scorer = Callable[[str, Problem], float]
"""Scores an episode from the model's own text (its turns, tool output excluded) and its problem: 1.0 or 0.0."""


def score_problem(model_text: str, problem: Problem) -> float:
    """The default Scorer: the final answer of `model_text` against the problem's gold answer (and unit)."""
    return score(model_text, problem.answer, problem.unit)


class ToolClient(Protocol):
    """What the agent needs from a sandbox client (AsyncSandboxClient and InProcessClient both fit)."""

    async def create_session(self) -> str: ...
    async def execute(self, code: str, session_id: str | None = None, timeout_s: float | None = None) -> RunResult: ...
    async def close_session(self, session_id: str) -> None: ...


@dataclass
class AgentConfig:
    max_tool_calls: int = 4
    """Tool calls allowed per episode; a further call ends the episode with finish_reason tool_limit."""
    max_total_tokens: int = 4096
    """Prompt plus response (sampled and observation tokens) of one episode; reaching it ends it (length)."""
    tool_mode: ToolMode = "stateful"
    """stateful: one sandbox session per episode, variables persist; stateless: a fresh state every call."""
    tool_timeout_s: float = 10.0
    """Wall-clock limit of one tool call."""
    output_max_chars: int = 1024
    """Tool output shown to the model is cut to this many characters (head + marker + tail)."""
    sandbox_retries: int = 2
    """Retries of a call the sandbox failed (not the code); afterwards the episode ends with sandbox_error."""
    retry_backoff_s: float = 0.5
    """First retry delay; doubles each retry."""
    system_prompt: str | None = protocol.SYSTEM_PROMPT
    """System message of the prompt; None = the problem alone as the user message."""

    def __post_init__(self) -> None:
        if self.tool_mode not in ("stateful", "stateless"):
            raise ValueError(f"tool_mode must be one of stateful, stateless; got {self.tool_mode!r}")
        if self.max_tool_calls < 0 or self.max_total_tokens < 1 or self.sandbox_retries < 0:
            raise ValueError("max_tool_calls and sandbox_retries must be >= 0 and max_total_tokens >= 1")
        if self.tool_timeout_s <= 0 or self.output_max_chars < 0 or self.retry_backoff_s < 0:
            raise ValueError("tool_timeout_s must be > 0, output_max_chars and retry_backoff_s >= 0")


@dataclass(frozen=True)
class Turn:
    """One model turn and, if it called the tool, the call."""

    text: str
    """The turn's sampled tokens, decoded."""
    sampled_tokens: int
    code: str | None = None
    """The code it ran, or None when the turn made no call (or the call was over the limit)."""
    status: Status | None = None
    output: str | None = None
    """Tool output as shown to the model (before the interpreter tags)."""
    duration_ms: float = 0.0
    """Sandbox run time of the call (retries included)."""
    observation_tokens: int = 0
    """Observation ids appended after this turn (0 when the budget left no room)."""


@dataclass
class EpisodeResult:
    problem_id: str
    token_ids: list[int]
    """Prompt then response: sampled segments and observation segments, concatenated."""
    action_mask: list[int]
    """Same length as token_ids; 1 = sampled by the policy, 0 = prompt or observation (tags included)."""
    logprobs: list[float]
    """Same length as token_ids; rollout log-prob of each sampled id, 0.0 where action_mask is 0."""
    prompt_len: int
    turns: list[Turn]
    answer: str | None
    """The last \\boxed{} (or <answer>) of the model's own text; observations are not searched."""
    reward: float | None
    """1.0 or 0.0; None when finish_reason is sandbox_error (not scoreable, drop the group), and when the episode
    ran without a scorer (its caller scores it)."""
    finish_reason: FinishReason
    sandbox_error: str | None = None
    """Why the sandbox failed, when it did."""
    response_text: str = ""
    """The response (after the prompt) decoded, observations included: for logs and transcripts."""
    versions: list[int] = field(default_factory=list)
    """Same length as token_ids (empty for a result built by hand): the policy version that sampled each id,
    NO_VERSION where action_mask is 0 or the engine did not say. Partial rollouts mix versions within a turn."""

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prompt_too_long(self) -> bool:
        """The episode ended before its first turn: the prompt left no room for a response under the budget."""
        return not self.turns

    @property
    def tool_calls(self) -> int:
        return sum(turn.code is not None for turn in self.turns)

    @property
    def tool_errors(self) -> int:
        """Calls whose code failed (error, timeout); a sandbox failure is not the model's and is counted apart."""
        return sum(turn.status not in (None, "ok", "sandbox_error") for turn in self.turns)


class _SandboxFailed(Exception):
    pass


class _Tools:
    """The sandbox side of one episode: lazy session, retries, replay after a lost session."""

    def __init__(self, client: ToolClient, config: AgentConfig):
        self.client = client
        self.config = config
        self.session: str | None = None
        self.history: list[str] = []  # code run so far in the stateful session, replayed if it is lost

    async def run(self, code: str) -> RunResult:
        """The call's result, or _SandboxFailed once the retries are spent.

        A stateful session whose kernel died or vanished cannot just be retried: its variables are
        gone. The retry opens a new session and replays the earlier calls (their output discarded)
        before running this one, so the model sees what it would have seen.
        """
        failure = ""
        for attempt in range(self.config.sandbox_retries + 1):
            if attempt:
                await asyncio.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
            try:
                if self.config.tool_mode == "stateless":
                    result = await self.client.execute(code, None, self.config.tool_timeout_s)
                else:
                    if self.session is None:
                        self.session = await self.client.create_session()
                        await self._replay()
                    result = await self.client.execute(code, self.session, self.config.tool_timeout_s)
                if result.status != "sandbox_error":
                    self.history.append(code)
                    return result
                failure = f"{result.error.name}: {result.error.message}" if result.error else "sandbox_error"
            except (SandboxUnavailable, SessionNotFound, _SandboxFailed) as exc:
                failure = f"{type(exc).__name__}: {exc}"
            await self.close()  # a stateful retry starts from a new session
        raise _SandboxFailed(failure)

    async def _replay(self) -> None:
        for code in self.history:
            result = await self.client.execute(code, self.session, self.config.tool_timeout_s)
            if result.status == "sandbox_error":
                raise _SandboxFailed(f"replaying the session failed: {result.error}")

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            try:
                await self.client.close_session(session)
            except SandboxUnavailable:
                pass  # the server will expire it; nothing else can be done here


class _Episode:
    """State of one episode; the drivers feed it samples and tool results."""

    def __init__(self, problem: Problem, tokenizer: Any, config: AgentConfig, scorer: Scorer | None):
        self.problem = problem
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.config = config
        messages = protocol.prompt_messages(problem.problem, config.system_prompt)
        self.ids = protocol.encode_prompt(tokenizer, messages)
        self.prompt_len = len(self.ids)
        self.mask = [0] * self.prompt_len  # (T,); 1 = sampled by the policy
        self.logprobs = [0.0] * self.prompt_len
        self.versions = [NO_VERSION] * self.prompt_len
        self.turns: list[Turn] = []
        self.model_text: list[str] = []
        self.finish: FinishReason | None = None if self.budget_left() > 0 else "length"
        self.sandbox_error: str | None = None
        self.calls = 0
        self.pending: str | None = None  # code of the call this turn made, until its result arrives
        self.decodable = len(tokenizer)  # ids 0 ... decodable - 1 have text; decode() drops any other silently

    def budget_left(self) -> int:
        return self.config.max_total_tokens - len(self.ids)

    def add_sample(self, sample: Sample) -> str | None:
        """Record a turn; returns the code to run, or None if the episode is over."""
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        self.ids += sample.token_ids
        self.mask += [1] * len(sample.token_ids)
        self.logprobs += sample.logprobs
        self.versions += sample.versions if sample.versions is not None else [NO_VERSION] * len(sample.token_ids)
        self.model_text.append(text)
        code = protocol.parse_tool_call(text)
        turn = Turn(text=text, sampled_tokens=len(sample.token_ids))
        if any(not 0 <= token < self.decodable for token in sample.token_ids):
            self.turns.append(turn)  # the turn's text lacks those ids; the ids stay as sampled, to be trained on
            self.finish = "invalid_token"
            return None
        if code is None:
            self.turns.append(turn)
            if sample.finish_reason == "length" or self.budget_left() <= 0:
                self.finish = "length"
            else:
                self.finish = "answer" if extract_answer("".join(self.model_text)) is not None else "eos"
            return None
        self.turns.append(turn)
        if self.calls >= self.config.max_tool_calls:
            self.finish = "tool_limit"  # the call over the limit is recorded as text, never run
            return None
        if self.budget_left() <= 0:
            self.finish = "length"
            return None
        self.calls += 1
        self.pending = code
        return code

    def add_tool_result(self, result: RunResult | _SandboxFailed) -> None:
        code, self.pending = self.pending, None
        last = self.turns.pop()
        if isinstance(result, _SandboxFailed):
            self.turns.append(Turn(last.text, last.sampled_tokens, code, "sandbox_error", None))
            self.finish, self.sandbox_error = "sandbox_error", str(result)
            return
        output = protocol.tool_output(result, self.config.output_max_chars)
        obs = protocol.encode_segment(self.tokenizer, protocol.observation(output))
        # The observation must leave room for at least one more sampled token; otherwise the episode
        # ends here and the sequence never exceeds max_total_tokens.
        fits = len(obs) < self.budget_left()
        self.turns.append(
            Turn(
                last.text,
                last.sampled_tokens,
                code,
                result.status,
                output,
                result.duration_ms,
                len(obs) if fits else 0,
            )
        )
        if not fits:
            self.finish = "length"
            return
        self.ids += obs
        self.mask += [0] * len(obs)
        self.logprobs += [0.0] * len(obs)
        self.versions += [NO_VERSION] * len(obs)

    def result(self) -> EpisodeResult:
        assert self.finish is not None, "episode still running"
        answer = extract_answer("".join(self.model_text))
        reward = None
        if self.finish == "invalid_token" and self.scorer is not None:
            reward = 0.0  # text with ids missing is not the model's answer
        elif self.finish != "sandbox_error" and self.scorer is not None:
            reward = self.scorer("".join(self.model_text), self.problem)
        return EpisodeResult(
            problem_id=self.problem.id,
            token_ids=self.ids,
            action_mask=self.mask,
            logprobs=self.logprobs,
            prompt_len=self.prompt_len,
            turns=self.turns,
            answer=answer,
            reward=reward,
            finish_reason=self.finish,
            sandbox_error=self.sandbox_error,
            response_text=self.tokenizer.decode(self.ids[self.prompt_len :], skip_special_tokens=False),
            versions=self.versions,
        )


async def _run_tool(tools: _Tools, code: str) -> RunResult | _SandboxFailed:
    started = time.perf_counter()
    try:
        result = await tools.run(code)
    except _SandboxFailed as exc:
        return exc
    # duration covers retries and replays, which is the time the episode waited
    return result.model_copy(update={"duration_ms": (time.perf_counter() - started) * 1000})


async def _close_all(tools: Sequence[_Tools]) -> None:
    # Shielded so that cancelling the episode still closes its sessions (kernels are not leaked).
    await asyncio.shield(asyncio.gather(*(t.close() for t in tools), return_exceptions=True))


async def run_episode(
    problem: Problem,
    *,
    tokenizer: Any,
    generate: Generate,
    client: ToolClient,
    config: AgentConfig | None = None,
    scorer: Scorer | None = score_problem,
) -> EpisodeResult:
    """One episode: generate, run tool calls, append observations, until the model finishes or a budget ends it.

    `scorer` sets the reward at the end, on the caller's thread; None leaves it unset for the caller to score.
    """
    config = config or AgentConfig()
    episode = _Episode(problem, tokenizer, config, scorer)
    tools = _Tools(client, config)
    try:
        while episode.finish is None:
            code = episode.add_sample(await generate(list(episode.ids), episode.budget_left()))
            if code is not None:
                episode.add_tool_result(await _run_tool(tools, code))
    finally:
        await _close_all([tools])
    return episode.result()


async def run_batch(
    problems: Sequence[Problem],
    *,
    tokenizer: Any,
    generate_batch: GenerateBatch,
    client: ToolClient,
    config: AgentConfig | None = None,
    scorer: Scorer | None = score_problem,
) -> list[EpisodeResult]:
    """Episodes in lock step: one batched generation per turn, then the turn's tool calls concurrently.

    For n rollouts of a prompt, pass the problem n times. Results come back in the order of `problems`.
    In stateful mode each episode holds a sandbox session from its first call to its end, so the
    sandbox must allow as many sessions as episodes that call the tool.
    """
    config = config or AgentConfig()
    episodes = [_Episode(problem, tokenizer, config, scorer) for problem in problems]
    tools = [_Tools(client, config) for _ in episodes]
    try:
        while live := [i for i, e in enumerate(episodes) if e.finish is None]:
            samples = generate_batch([list(episodes[i].ids) for i in live], [episodes[i].budget_left() for i in live])
            if inspect.isawaitable(samples):
                samples = await samples
            if len(samples) != len(live):
                raise ValueError(f"generate_batch returned {len(samples)} samples for {len(live)} inputs")
            calls = {}
            for i, sample in zip(live, samples, strict=True):
                code = episodes[i].add_sample(sample)
                if code is not None:
                    calls[i] = _run_tool(tools[i], code)
            results = await asyncio.gather(*calls.values())
            for i, result in zip(calls, results, strict=True):
                episodes[i].add_tool_result(result)
    finally:
        await _close_all(tools)
    return [episode.result() for episode in episodes]
