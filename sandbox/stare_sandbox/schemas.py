"""The wire contract of the sandbox service: request and response bodies.

`status` separates the user's code failing (`error`, `timeout`, `memory`) from the service failing
(`sandbox_error`: the kernel died, could not start, ...). Clients retry only the latter kind of
failure, and only at the transport level (connection errors, 429, 503).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

DRAINING_HEADER = "X-Sandbox-Draining"
"""Set on the 503 a draining server answers new work with: the client marks the server draining, not overloaded."""

Status = Literal["ok", "error", "timeout", "memory", "sandbox_error"]


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(description="Python source to run.", examples=["print(1 + 1)"])
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="Wall-clock limit for this call in seconds; the server's default and maximum apply.",
        examples=[10.0],
    )


class ErrorInfo(BaseModel):
    name: str = Field(description="Exception class name, e.g. ZeroDivisionError, or KernelDied / Timeout.")
    message: str = Field(description="The exception's message.")
    traceback: str = Field(default="", description="Plain-text traceback (no terminal colour codes).")


class RunResult(BaseModel):
    status: Status = Field(description="ok | error | timeout | memory (the code failed) | sandbox_error (we failed).")
    stdout: str = Field(default="", description="Standard output, then the value of a final expression, if any.")
    stderr: str = Field(default="", description="Standard error.")
    error: ErrorInfo | None = Field(default=None, description="Set for every status except ok.")
    truncated: bool = Field(default=False, description="stdout or stderr was cut to the output cap (head + tail).")
    duration_ms: float = Field(description="Time spent running this call, queueing excluded.")
    timeout_s: float | None = Field(
        default=None, description="The wall-clock limit this call ran under (the request's, or the server's default)."
    )
    timeout_capped: bool = Field(
        default=False, description="The request asked for more than the server's max_timeout_s, which applied instead."
    )
    _files: dict[str, str] = PrivateAttr(default_factory=dict)
    """Files a /run_code driver fetched ({path: base64}, kernel.Kernel.execute); not part of this response."""
    _exit_status: int | None = PrivateAttr(default=None)
    """For sandbox_error: the exit status of a kernel process that ended under the code (-N for signal N)."""
    _never_ran: bool = PrivateAttr(default=False)
    """For sandbox_error: the code certainly never started (no worker began it), so a stateless call may run it again
    (sessions.run_stateless)."""


class SessionCreated(BaseModel):
    session_id: str


class ErrorResponse(BaseModel):
    detail: str = Field(description="What was wrong with the request, or why it cannot be served now.")


# SandboxFusion's `POST /run_code` (github.com/bytedance/SandboxFusion, sandbox/server/sandbox_api.py and
# sandbox/runners/types.py), the call verl's sandbox_fusion utils and ReTool tools make. Field names, defaults
# and statuses follow SandboxFusion; docs/sandbox.md says which fields this sandbox honours and which it refuses.
# Unknown fields are ignored, as SandboxFusion's own model does, so newer clients keep working.


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    code: str = Field(description="Python source, run like `python main.py`.", examples=['print("hello")'])
    language: Literal["python", "python3"] = Field(
        description="Only Python runs here; SandboxFusion's other languages get 422.", examples=["python"]
    )
    compile_timeout: float = Field(default=10, description="Accepted and ignored: Python is not compiled.")
    run_timeout: float | None = Field(
        default=None,
        gt=0,
        description="Wall-clock limit in seconds; absent = the server's default; capped at the server's maximum.",
        examples=[10],
    )
    memory_limit_MB: int = Field(  # noqa: N815 - SandboxFusion's field name
        default=-1,
        description="If > 0, the run may grow the interpreter's address space by at most this many MiB (a soft "
        "RLIMIT_AS for the run; an allocation beyond it raises MemoryError); the server's own limits apply too.",
    )
    stdin: str | None = Field(
        default=None, description="The code's standard input (file descriptor 0: input(), sys.stdin, open(0))."
    )
    files: dict[str, str | None] = Field(
        default_factory=dict,
        description="Relative path -> base64 content, written into the working directory before the run; "
        "entries with null content are skipped.",
    )
    fetch_files: list[str] = Field(
        default_factory=list,
        description="Paths (relative to the working directory, or absolute) of files to return after the run, "
        "base64 in the response's `files`; a path that is not a regular file is left out.",
    )

    @field_validator("files")
    @classmethod
    def _files_are_relative_and_base64(cls, files: dict[str, str | None]) -> dict[str, str | None]:
        for path, content in files.items():
            parts = PurePosixPath(path).parts
            if not parts or path.startswith("/") or ".." in parts or path.endswith("/") or "\0" in path:
                raise ValueError(
                    f"files: {path!r} must be a relative path to a file inside the working directory (no '..')"
                )
            if content is not None:
                try:
                    base64.b64decode(content, validate=True)
                except binascii.Error as exc:
                    raise ValueError(f"files[{path!r}] is not valid base64: {exc}") from None
        return files

    @field_validator("fetch_files")
    @classmethod
    def _fetch_paths_are_paths(cls, fetch_files: list[str]) -> list[str]:
        for path in fetch_files:
            if not path or "\0" in path:
                raise ValueError(f"fetch_files: {path!r} is not a file path")
        return fetch_files


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"] = Field(
        description="Finished: the program ended (see return_code); TimeLimitExceeded: stopped at run_timeout; "
        "Error: the sandbox failed to run it."
    )
    execution_time: float | None = Field(default=None, description="Seconds the run took, queueing excluded.")
    return_code: int | None = Field(
        default=None,
        description="Exit status as `python main.py` gives it (0, 1 for an uncaught exception, "
        "sys.exit's code); null unless Finished.",
    )
    stdout: str | None = Field(default=None, description="Standard output (head and tail kept past the cap).")
    stderr: str | None = Field(default=None, description="Standard error, with the traceback of an uncaught error.")


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"] = Field(
        description="Success: return code 0; Failed: the code failed (non-zero return code or time limit); "
        "SandboxError: the sandbox failed, the code's outcome is unknown."
    )
    message: str = Field(default="", description="Why the sandbox failed, or a note such as a capped run_timeout.")
    compile_result: CommandRunResult | None = Field(default=None, description="Always null: Python is not compiled.")
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = Field(default=None, description="Always null here (SandboxFusion's pod name).")
    files: dict[str, str] = Field(
        default_factory=dict, description="The request's fetch_files that were regular files after the run: base64."
    )
