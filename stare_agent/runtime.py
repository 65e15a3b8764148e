"""What every command's process needs whichever backend runs it: the sandbox client a run's episodes use, torch's
CPU thread count, and the error a non-finite update stops a run with. Both backends and the CLI take these from here
(backends never import each other).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from stare_agent.config import RunConfig, SandboxConfig


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
    return InProcessClient(PoolSettings(pool_size=config.pool_size, max_kernels=max_kernels))


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
