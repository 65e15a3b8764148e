"""What every command's process needs whichever backend runs it: the sandbox client a run's episodes use and the
check that the sandbox holds them, torch's CPU thread count, and the error a non-finite update stops a run with. Both
backends and the CLI take these from here (backends never import each other).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
from typing import Any

import torch

from stare_agent.config import ConfigError, RunConfig, SandboxConfig

log = logging.getLogger(__name__)


def make_client(config: SandboxConfig, concurrent_episodes: int = 0) -> Any:
    """The sandbox client: the service(s) at config.urls or config.url, else kernels in this process (call
    `start()` first).

    In-process, max_kernels is raised to at least concurrent_episodes + pool_size: in stateful mode every
    live episode holds a kernel, and running out would turn into sandbox errors.
    """
    servers = config.urls or ([config.url] if config.url else [])
    if servers:
        from stare_sandbox.client import AsyncSandboxClient

        return AsyncSandboxClient(servers, config.token or os.environ.get("SANDBOX_TOKEN"))
    from stare_sandbox.inprocess import InProcessClient
    from stare_sandbox.pool import PoolSettings

    max_kernels = max(config.max_kernels, concurrent_episodes + config.pool_size)
    # Not root (a Ray job's user): namespaces or nothing. Process isolation would run policy code as the job's user,
    # able to write the run folder and signal its processes, under an RLIMIT_NPROC that counts all the user's threads.
    isolation = "auto" if os.geteuid() == 0 else "namespaces"
    return InProcessClient(PoolSettings(pool_size=config.pool_size, max_kernels=max_kernels, isolation=isolation))


def sandbox_where(config: SandboxConfig) -> str:
    """Where a run's tool calls go, for the messages that name it: the servers' URLs, or in-process kernels."""
    return ", ".join(config.urls) or config.url or f"in-process kernels (uid {os.geteuid()})"


class SandboxBroken(RuntimeError):
    """The sandbox a run would use cannot run a tool call (check_sandbox): the run stops before its first step."""


def check_sandbox(config: SandboxConfig, concurrent_episodes: int = 0, counted_by: str = "") -> None:
    """Start the run's sandbox as its episodes will (start_client: capacity included) and run one call, `print(6 * 7)`;
    SandboxBroken or ConfigError, in one line, when that does not answer 42. Blocking, a few seconds; runs in a
    thread of its own, so it may be called where an event loop runs (OpenRLHF builds the executor in one). In-process
    kernels it started are closed again: the episodes' client starts its own in the loop that uses it."""
    where = sandbox_where(config)
    outcome: list[BaseException | None] = [None]

    async def once() -> None:
        client = make_client(dataclasses.replace(config, pool_size=min(config.pool_size, 1)))
        try:
            await start_client(client, config, concurrent_episodes, counted_by)
            result = await client.execute("print(6 * 7)", None, timeout_s=60)
        finally:
            await client.close()
        if result.status != "ok" or result.stdout.strip() != "42":
            raise SandboxBroken(
                f"the sandbox ({where}) answered print(6 * 7) with {result.status} {result.stdout.strip()[:200]!r} "
                f"{result.stderr.strip()[-300:]!r}"
            )

    def run() -> None:
        try:
            asyncio.run(once())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            outcome[0] = exc

    thread = threading.Thread(target=run, name="sandbox-check")
    thread.start()
    thread.join()
    exc = outcome[0]
    if exc is None:
        return
    if isinstance(exc, (ConfigError, SandboxBroken)):
        raise exc
    hint = ""
    if not (config.url or config.urls) and os.geteuid() != 0:
        hint = (
            ". As a user that is not root the built-in sandbox needs unprivileged user namespaces; where the host "
            "forbids them, run the sandbox service (`stare-agent sandbox serve` as root, or its container: "
            "docs/sandbox.md) and set sandbox.url"
        )
    host = socket.gethostname()
    raise SandboxBroken(f"the sandbox ({where}) cannot run a tool call on {host}: {exc}{hint}") from exc


async def start_client(client: Any, config: SandboxConfig, concurrent_episodes: int, counted_by: str) -> Any:
    """`await client.start()` on make_client's client; then, with sandbox services (config.url or urls), refuse
    (`check_capacity`) a run whose stateful episodes at once exceed what the servers hold. In-process kernels need no
    check: make_client sized their pool from the same count. `counted_by` names the keys that make the count."""
    await client.start()
    if config.url or config.urls:
        health = await client.health()
        servers = health["servers"] if "servers" in health else [{"url": config.url or config.urls[0], **health}]
        check_capacity(servers, concurrent_episodes, counted_by)
    return client


def check_capacity(servers: list[dict[str, Any]], concurrent_episodes: int, counted_by: str) -> None:
    """ConfigError, naming the numbers and what to change, when `concurrent_episodes` do not fit the sandbox
    `servers` (each one's /healthz with its `url`, as a client's health() lists them; status "down": no answer).

    A stateful episode holds a session from its first tool call to its end, and a session holds a kernel, so a server
    holds min(max_sessions, max_kernels) episodes at once (its /healthz `capacity`), summed over the servers that
    answered. Beyond that a new session waits (queue_wait_s for a kernel per try) and is refused with 503 once the
    client's retries are spent: the episode ends in sandbox_error, and so does its group.
    """
    up = [server for server in servers if server.get("status") == "ok"]
    unknown = [server["url"] for server in up if "capacity" not in server]
    if unknown:  # a server from before /healthz reported it: say so rather than refuse a run that may fit
        log.warning("cannot check the sandbox's capacity: %s does not report it on /healthz", ", ".join(unknown))
        return
    holds = sum(min(server["capacity"]["sessions"], server["capacity"]["kernels"]) for server in up)
    if concurrent_episodes <= holds:
        return
    each = "; ".join(
        f"{server['url']} max_sessions {server['capacity']['sessions']}, max_kernels {server['capacity']['kernels']}"
        for server in up
    )
    sessions, kernels = (sum(server["capacity"][key] for server in up) for key in ("sessions", "kernels"))
    raise ConfigError(
        f"{counted_by} = {concurrent_episodes} stateful episodes may be in flight at once, each holding a sandbox "
        f"session (and the session a kernel) from its first tool call to its end, but the sandbox servers that "
        f"answered ({len(up)} of {len(servers)}) hold {holds} at once, the smaller of max_sessions and max_kernels "
        f"per server ({each}; summed: {sessions} sessions, {kernels} kernels). The episodes beyond would wait for a "
        f"session and end in sandbox_error. Lower {counted_by}, or raise the servers' --max-sessions and "
        "--max-kernels (kernels >= sessions + --pool-size: docs/sandbox.md, Sizing), or add servers to sandbox.urls"
    )


def set_threads(run: RunConfig) -> None:
    """torch's intra-op CPU threads from run.threads (0 = leave torch's default); call before any model runs.

    Once per process (the quickstart's stages share it). The inter-op pool is left alone: eager training and
    generation do not use it, and setting it after first use raises.
    """
    if run.threads:
        torch.set_num_threads(run.threads)


class NonFiniteGradient(RuntimeError):
    """An update's gradients were NaN or infinite, so the run stops (exit code 6). Nothing of that update was
    applied: the weights and the optimizer state are those before it, and the latest checkpoint is from before it.
    The local backend checks the gradient norm before it steps (common.clip_and_step); in the openrlhf backend each
    rank checks every bf16 update around DeepSpeed's step (upstream.checking_updates)."""
