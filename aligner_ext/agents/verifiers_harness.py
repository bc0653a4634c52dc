"""The harness our verifiers environments run under (verifiers_environment.py): verifiers' own chat
program, the `null` harness's tool-calling loop, run in this process.

verifiers 0.4.0 runs a harness's program as a PEP 723 script through `uv` in the agent's runtime (a
download of uv and of the script's packages on first use). Its chat program is verifiers' own modules
(`harnesses/utils`: `mcp`, `compaction`, `core`) bundled into one source (`CHAT_PROGRAM_SOURCE`); here
that source is executed once in a namespace of its own and its loop (`run_chat_loop`) awaited in this
process, with the interpreter's packages (verifiers' requirements). Everything else is the `null`
harness's: the system prompt, the MCP tool servers, the tool gate, the model calls through the
rollout's interception endpoint. verifiers loads it by its module name (`__all__`)."""

from __future__ import annotations

import argparse
from contextlib import AsyncExitStack
from typing import Any

import httpx
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.null.harness import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import ProgramResult

__all__ = ["InProcessChat"]

PROGRAM: dict[str, Any] = {"__name__": "verifiers_chat_program"}  # not __main__: its entry point stays inert
exec(compile(CHAT_PROGRAM_SOURCE, "verifiers_chat_program", "exec"), PROGRAM)  # noqa: S102 - verifiers' own source


class InProcessChat(NullHarness):
    """The `null` harness with its program run in this process (module docstring)."""

    async def setup(self, runtime: Any) -> None:
        """Nothing to install: the program's packages are this interpreter's."""

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any, tool_interception_url: str | None = None) -> ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(message) for message in prompt or ()]  # as launch_chat_program writes them
        args = argparse.Namespace(tool_interception_url=tool_interception_url or "", api_key=secret, bash=False,
                                  edit=False, search=False, serper_key="")
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        async with AsyncExitStack() as stack:
            tool_client = None
            if tool_interception_url:
                tool_client = await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)))
            tools, dispatch, servers = [], {}, {}
            if mcp_urls:
                config = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                         for name, url in mcp_urls.items()}}
                tools, dispatch, servers = await PROGRAM["connect_mcp"](config, stack, set())
            compactor = PROGRAM["Compactor"](client, ctx.model, tools, False, None)
            compactor.note_good(messages)
            await PROGRAM["run_chat_loop"](args, compactor, messages, dispatch, servers, tool_client)
        return ProgramResult(0, "", "")
