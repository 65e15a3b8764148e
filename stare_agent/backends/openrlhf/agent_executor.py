"""The file handed to OpenRLHF as `--train.agent_func_path`: our ReTool agent as its agent executor.

OpenRLHF 0.11.2 loads this file by path in every vLLM engine actor (`trainer/ray/vllm_engine.py`,
`_load_agent_executor`) and builds `AgentExecutor()` with no arguments; the config comes from
$STARE_AGENT_RL_CONFIG (see episodes.py, where all of the executor's logic lives so that it imports and is
tested without OpenRLHF). This file only adds OpenRLHF's base class, which OpenRLHF checks with issubclass.
Imports are absolute: OpenRLHF runs the file as a module named "agent_module", outside any package.
"""

from __future__ import annotations

from openrlhf.utils.agent import AgentExecutorBase

from stare_agent.backends.openrlhf.episodes import ReToolExecutor


class AgentExecutor(ReToolExecutor, AgentExecutorBase):
    """ReToolExecutor.execute implements AgentExecutorBase.execute (same keyword names: OpenRLHF calls by keyword).

    Built when the engine actor starts, before its vLLM engine: it runs one sandbox call there (check_sandbox), so a
    sandbox that cannot work on this node stops the run at start with one line, not at the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.check_sandbox()
