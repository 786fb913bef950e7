"""The agent loop on the default model: tool selection, calls, results, answer, and its trace."""

from __future__ import annotations

import json
import time

import pytest

from pellucid import LLM
from pellucid.agent.agent import Agent
from pellucid.agent.grounding import grounded
from pellucid.agent.tools import calculator, make_search_tool, tool
from pellucid.cli import main

QUESTION = "What is 17*23, and who wrote Hamlet?"


@pytest.fixture(scope="module")
def hamlet_run(smollm2: LLM):
    return Agent(smollm2, [calculator, make_search_tool(k=1, sentences=2)]).run(QUESTION)


def test_agent_uses_two_tools_and_answers(hamlet_run) -> None:
    first = hamlet_run.turns[0]
    assert first.tool_choice == "required"
    runs = {r.name: r for t in hamlet_run.turns for r in t.tool_runs}
    assert set(runs) == {"calculator", "search"}
    assert runs["calculator"].output == "17*23 = 391" and runs["calculator"].ok
    assert "Shakespeare" in runs["search"].output  # the Hamlet lead came back
    assert "391" in hamlet_run.answer and "Shakespeare" in hamlet_run.answer


def test_agent_trace_records_each_step(hamlet_run) -> None:
    first = hamlet_run.turns[0]
    assert QUESTION in first.prompt and first.prompt_tokens > 0
    assert len(first.pieces) == len(first.forced) and 0 < first.forced_count < len(first.pieces)
    assert first.prefill_s > 0 and first.decode_s > 0
    later = hamlet_run.turns[1]
    assert "17*23 = 391" in later.prompt  # the tool result was in what the model saw next
    json.dumps(hamlet_run.to_dict())  # the trace serializes


def test_search_arguments_are_grounded_in_the_question() -> None:
    schema = grounded(make_search_tool().openai_schema(), ("query",), QUESTION)
    pattern = schema["function"]["parameters"]["properties"]["query"]["pattern"]
    assert "Hamlet" in pattern and "wrote" in pattern and "17" not in pattern
    assert "What" not in pattern


def test_tool_timeouts_become_observations(smollm2: LLM) -> None:
    @tool
    def lookup(name: str) -> str:
        """Look a name up in a very slow directory.

        Args:
            name: The name to look up.
        """
        time.sleep(2)
        return "found"

    run = Agent(smollm2, [lookup], tool_timeout_s=0.2, max_turns=2).run("Look up Ada.")
    first = run.turns[0].tool_runs
    assert first and all(
        not r.ok and r.output == "error: lookup did not finish in 0.2 s" for r in first
    )
    assert run.turns[-1].tool_choice == "none"  # the last turn must answer
    assert "did not finish" in run.turns[-1].prompt  # the model read the error


@pytest.mark.slow  # `pellucid agent` in its own process, loading SmolLM2
def test_agent_cli_prints_the_steps(tmp_path, capsys) -> None:
    trace = tmp_path / "run.json"
    code = main(["agent", QUESTION, "--tools", "calculator,search", "--json", str(trace)])
    out = capsys.readouterr().out
    assert code == 0
    assert "turn 1" in out and "tool calls" in out and "final answer" in out
    saved = json.loads(trace.read_text())
    assert saved["question"] == QUESTION and saved["turns"][0]["tool_runs"]
