"""`pellucid agent`: answer a question with tools, showing each step. For example:

pellucid agent "What is 17*23, and who wrote Hamlet?" --tools calculator,search
pellucid agent "How many words are in 'to be or not'?" --mcp "python -m pellucid.agent.tools.mcp_example_server"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
from pathlib import Path

from rich.console import Console

from pellucid import catalog


def add_agent_command(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("agent", help="answer a question by calling tools, step by step")
    p.add_argument("question")
    p.add_argument(
        "--tools",
        default="calculator,search",
        help="built-in tools, comma-separated: calculator, search, http, python "
        "(default calculator,search)",
    )
    p.add_argument("--search-folder", help="search these .txt/.md files instead of Wikipedia")
    p.add_argument(
        "--mcp",
        action="append",
        default=[],
        help="also use the tools of this MCP server command (stdio); repeatable",
    )
    p.add_argument(
        "--model", help=f"model name, GGUF file or HF folder (default {catalog.DEFAULT_MODEL})"
    )
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--tool-timeout", type=float, default=30.0, help="seconds per tool call")
    p.add_argument("--show-prompt", action="store_true", help="print each turn's whole prompt")
    p.add_argument("--json", metavar="FILE", help="also save the run's trace as JSON")
    p.set_defaults(run=run_agent)


def run_agent(args: argparse.Namespace) -> int:
    from pellucid.agent.agent import Agent
    from pellucid.agent.render import render_run
    from pellucid.agent.tools import MCPConnection, builtin_tools, make_search_tool
    from pellucid.llm import LLM

    names = [n.strip() for n in args.tools.split(",") if n.strip()]
    tools = builtin_tools([n for n in names if n != "search"])
    if "search" in names:
        tools.append(make_search_tool(args.search_folder, k=1, sentences=2))
    with contextlib.ExitStack() as stack:
        for command in args.mcp:
            tools += stack.enter_context(MCPConnection(shlex.split(command))).tools
        agent = Agent(
            LLM(args.model), tools, max_turns=args.max_turns, tool_timeout_s=args.tool_timeout
        )
        run = agent.run(args.question)
    render_run(run, Console(), show_prompt=args.show_prompt)
    if args.json:
        Path(args.json).write_text(json.dumps(run.to_dict(), indent=2, ensure_ascii=False))
    return 0 if run.answer is not None else 2
