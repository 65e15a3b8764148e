"""Everything of OpenRLHF that the backend relies on by name, in one place, with the checks that pin it.

The backend is written against OpenRLHF 0.11.2 (`scripts/install_gpu.sh` installs it with the versions it pins).
Its training CLIs build their argument parsers under `if __name__ == "__main__":`, so the parser is captured by
running the module as `__main__` with `ArgumentParser.parse_args` intercepted: nothing is trained, and the flags we
pass are checked by OpenRLHF's own parser, defaults and choices included.

On a machine without the GPU stack (a laptop, CI), `flash_attn` and `vllm` are missing and OpenRLHF's CLI
modules fail to import. For the parser capture only (`--dry-run`, tests), `import_openrlhf` then puts
minimal stand-ins for exactly the names OpenRLHF imports from them into `sys.modules` while importing, and
removes them afterwards, so the rest of the process still sees that vLLM is absent. Training on a GPU uses the
real packages. The one piece of them that works here is flash_attn's padding helpers (plain tensor indexing), so
that OpenRLHF's packed forward (`--ds.packing_samples`) runs on a CPU too: tests check the STARE entropy pass on
packed rows through it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import runpy
import sys
import types
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

VERSION = "0.11.2"
RL_CLI = "openrlhf.cli.train_ppo_ray"
SFT_CLI = "openrlhf.cli.train_sft"


class OpenRLHFMissing(RuntimeError):
    """openrlhf is not installed, or not the version this backend is written against."""


def check_installed() -> str:
    """The installed openrlhf version; OpenRLHFMissing naming what to install otherwise."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("openrlhf")
    except PackageNotFoundError:
        raise OpenRLHFMissing(
            f"backend openrlhf needs openrlhf=={VERSION}: scripts/install_gpu.sh on a GPU machine, or "
            f"pip install openrlhf=={VERSION} --no-deps plus its import dependencies for a dry run on CPU "
            "(docs/dev/openrlhf_cpu.md)"
        ) from None
    if found != VERSION:
        raise OpenRLHFMissing(f"backend openrlhf is written against openrlhf=={VERSION}; found {found}")
    return found


# flash_attn.bert_padding's helpers, which OpenRLHF's packed forward calls (models/ring_attn_utils.py): plain torch
# indexing, no kernel, so they work on any device. Same contract as flash-attn 2.8's: `unpad_input` keeps the
# positions where the (batch, length) mask is set, in row-major order, and `pad_input` puts them back.


def index_first_axis(values: Any, indices: Any) -> Any:
    """values[indices] along the first axis."""
    return values[indices]


def unpad_input(hidden: Any, attention_mask: Any, unused_mask: Any = None) -> tuple[Any, Any, Any, int, Any]:
    """(batch, length, ...) -> (kept, ...) at the positions where attention_mask is set, with their flat indices,
    the cumulative sequence lengths (batch + 1, int32), the longest sequence and each sequence's length."""
    import torch

    mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    kept = hidden.reshape(-1, *hidden.shape[2:])[indices]
    return kept, indices, cu_seqlens, int(lengths.max()), attention_mask.sum(dim=-1, dtype=torch.int32)


def pad_input(kept: Any, indices: Any, batch: int, length: int) -> Any:
    """The inverse of unpad_input: (kept, ...) -> (batch, length, ...), zeros where nothing was kept."""
    import torch

    out = torch.zeros(batch * length, *kept.shape[1:], dtype=kept.dtype, device=kept.device)
    out[indices] = kept
    return out.reshape(batch, length, *kept.shape[1:])


def _rearrange(*args: Any, **kwargs: Any) -> Any:
    import einops  # an OpenRLHF dependency, imported when OpenRLHF calls it

    return einops.rearrange(*args, **kwargs)


def _stand_ins() -> dict[str, types.ModuleType]:
    """Modules with the names OpenRLHF 0.11.2 imports from flash_attn and vllm at module level, nothing more: the
    padding helpers work (above), every other name raises when called."""

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("flash_attn / vllm are not installed here: this stand-in only lets OpenRLHF import")

    def module(name: str, package: bool = False, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
        if package:
            m.__path__ = []
        m.__dict__.update(attrs)
        return m

    class SamplingParams:
        def __init__(self, **kwargs: Any):
            self.__dict__.update(kwargs)

    flash = module("flash_attn", package=True)
    padding = module(
        "flash_attn.bert_padding",
        index_first_axis=index_first_axis,
        pad_input=pad_input,
        rearrange=_rearrange,
        unpad_input=unpad_input,
    )
    utils = module("flash_attn.utils", package=True)
    distributed = module("flash_attn.utils.distributed", all_gather=unavailable)
    vllm = module("vllm", package=True, SamplingParams=SamplingParams)
    inputs = module("vllm.inputs", TokensPrompt=dict)
    vllm_utils = module("vllm.utils", random_uuid=lambda: uuid.uuid4().hex)
    return {m.__name__: m for m in (flash, padding, utils, distributed, vllm, inputs, vllm_utils)}


@contextlib.contextmanager
def _importable() -> Iterator[None]:
    missing = {top for top in ("flash_attn", "vllm") if top not in sys.modules and not importlib.util.find_spec(top)}
    stand_ins = _stand_ins()
    inserted = [name for name in stand_ins if name.split(".")[0] in missing]
    for name in inserted:
        sys.modules[name] = stand_ins[name]
    try:
        yield
    finally:
        for name in inserted:
            sys.modules.pop(name, None)


def checking_updates(optimizer_step: Callable[..., Any], actor_class: type, where: Callable[[Any], str]) -> Any:
    """OpenRLHF's `DeepspeedStrategy.optimizer_step` (which RL and SFT ranks call after each micro-batch's backward),
    stopping the run with runtime.NonFiniteGradient at an optimizer update whose gradients are NaN or infinite, as
    the local backend does. Under bf16 DeepSpeed 0.19.6 does not stop: ZeRO-1/2 (and stage 0) skip such an update
    without a word, so a run would go on with its updates skipped; ZeRO-3 checks only under fp16 and applies it, so
    the weights become NaN while the logged gradient norm stays finite (each group's NaN norm is replaced by -1).
    So, at an update: under ZeRO-3, DeepSpeed's own overflow check of the partitioned gradients runs first (all-
    reduced over the data-parallel ranks, so every rank stops alike) and the update is not made; otherwise a skip is
    caught after the step. Under fp16 nothing is checked: its loss scaler skips updates by design while it lowers
    the scale, and stops the run itself at the minimum scale. `where(engine)`, taken before the step, starts the
    message ("rl step 12")."""
    from stare_agent.runtime import NonFiniteGradient

    original = getattr(optimizer_step, "__wrapped__", optimizer_step)  # installing twice wraps once

    def stop(label: str) -> NoReturn:
        raise NonFiniteGradient(
            f"{label}: the gradients of an optimizer update were not finite (NaN or inf); it was not "
            "applied, so the weights and the latest checkpoint are those before it (a lower optim.lr, or "
            "optim.max_grad_norm, may help)"
        )

    @functools.wraps(original)
    def optimizer_step_checked(self: Any, optimizer: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        engine = model.model if isinstance(model, actor_class) else model  # as the original finds it
        if not (engine.bfloat16_enabled() and engine.is_gradient_accumulation_boundary()):
            return original(self, optimizer, model, *args, **kwargs)
        label = where(engine)
        if engine.zero_optimization_stage() == 3 and engine.optimizer.has_overflow():
            stop(label)
        skipped = int(engine.skipped_steps)
        result = original(self, optimizer, model, *args, **kwargs)
        if int(engine.skipped_steps) > skipped:
            stop(label)
        return result

    return optimizer_step_checked


def import_openrlhf(name: str) -> types.ModuleType:
    """Import an openrlhf module, with stand-ins for flash_attn and vllm where they are not installed."""
    check_installed()
    with _importable():
        return importlib.import_module(name)


class _Captured(Exception):
    pass


def capture_parser(cli: str) -> argparse.ArgumentParser:
    """The argument parser OpenRLHF's CLI module `cli` builds under __main__, without running anything else."""
    check_installed()
    import_openrlhf(cli)  # its imports, once, with stand-ins where needed

    def intercept(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = intercept  # type: ignore[method-assign]
    try:
        with _importable(), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules after import"
            runpy.run_module(cli, run_name="__main__")
    except _Captured as captured:
        return captured.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{cli} finished without calling parse_args: OpenRLHF changed (written for {VERSION})")


def option_names(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Flag name without the leading dashes (as our YAML writes it) -> its argparse action."""
    return {opt[2:]: action for action in parser._actions for opt in action.option_strings if opt.startswith("--")}
