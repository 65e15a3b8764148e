"""The wire contract of the sandbox service: request and response bodies.

`status` separates the user's code failing (`error`, `timeout`, `memory`) from the service failing
(`sandbox_error`: the kernel died, could not start, ...). Clients retry only the latter kind of
failure, and only at the transport level (connection errors, 429, 503).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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


class SessionCreated(BaseModel):
    session_id: str


class ErrorResponse(BaseModel):
    detail: str = Field(description="What was wrong with the request, or why it cannot be served now.")
