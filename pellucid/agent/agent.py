"""Agent: the tool loop. Question -> the model picks tool calls -> they run -> results go back ->
... -> final answer, in a bounded number of turns, with every step recorded.

    agent = Agent(LLM(), builtin_tools(["calculator", "search"]))
    run = agent.run("What is 17*23, and who wrote Hamlet?")
    print(run.answer); render_run(run, Console())

Every call the model writes is valid (a grammar constrains it to the tools' schemas). The first
turn must call tools (tool_choice "required"): a small model otherwise answers from memory. Later
turns may call more or answer (tool_choice "auto"); the last allowed turn must answer ("none").
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from pellucid.agent.examples import example_messages
from pellucid.agent.grounding import grounded
from pellucid.agent.records import AgentRun, ModelTurn, ToolRun
from pellucid.agent.tools import Tool, ToolError
from pellucid.engine import SamplingParams
from pellucid.llm import LLM
from pellucid.structured import ToolCall

GROUNDED = {"search": ("query",)}
SYSTEM_PROMPT = (
    "You are a helpful assistant. Use the tools to find the facts, then answer from "
    "the tool results in one sentence."
)


class Agent:
    def __init__(
        self,
        llm: LLM,
        tools: list[Tool],
        *,
        max_turns: int = 4,
        tool_timeout_s: float = 30.0,
        system_prompt: str = SYSTEM_PROMPT,
        params: SamplingParams | None = None,
        grounded: dict[str, tuple[str, ...]] | None = None,
    ):
        if not tools:
            raise ValueError("an agent needs at least one tool")
        if max_turns < 2:
            raise ValueError("max_turns must be at least 2: one to call tools, one to answer")
        self.llm = llm
        self.tools = {t.name: t for t in tools}
        self.max_turns = max_turns
        self.tool_timeout_s = tool_timeout_s
        self.system_prompt = system_prompt
        self.params = params or SamplingParams(temperature=0.0, max_tokens=160)
        # tool -> string arguments made only of the question's words (see grounding.py)
        self.grounded = GROUNDED if grounded is None else grounded
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pellucid-tool")

    def run(self, question: str) -> AgentRun:
        """Answer `question`, calling tools as the model decides; returns the answer and trace."""
        shown = example_messages(self.tools)  # worked examples of the loop, as earlier turns
        messages = [
            {"role": "system", "content": self.system_prompt},
            *shown,
            {"role": "user", "content": question},
        ]
        run = AgentRun(question=question, tools=list(self.tools), examples=len(shown))
        start = time.perf_counter()
        for number in range(self.max_turns):
            choice = self._tool_choice(number)
            turn = self._model_turn(number, messages, choice, question)
            run.turns.append(turn)
            if not turn.calls:
                run.answer = turn.text.strip()
                break
            messages.append(
                {
                    "role": "assistant",
                    "content": turn.text_outside_calls,
                    "tool_calls": [c.openai() for c in turn.calls],
                }
            )
            for call in turn.calls:
                result = self._execute(call)
                turn.tool_runs.append(result)
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "name": call.name,
                        "content": result.output,
                    }
                )
        run.total_s = time.perf_counter() - start
        return run

    def _tool_choice(self, number: int) -> str:
        if number == 0:
            return "required"
        return "none" if number == self.max_turns - 1 else "auto"

    def _model_turn(
        self, number: int, messages: list[dict], choice: str, question: str
    ) -> ModelTurn:
        schemas = [
            grounded(t.openai_schema(), self.grounded.get(t.name, ()), question)
            for t in self.tools.values()
        ]
        # several calls a turn, whatever the template: a question that needs two tools gets
        # both at once (the example turns show how: agent/examples.py)
        out = self.llm.chat(
            messages, self.params, tools=schemas, tool_choice=choice, parallel_tool_calls=True
        )
        tok = self.llm.tokenizer
        return ModelTurn(
            number=number,
            tool_choice=choice,
            prompt=tok.decode(out.prompt_token_ids),
            prompt_tokens=len(out.prompt_token_ids),
            text=out.text,
            pieces=[tok.id_to_piece(i) for i in out.token_ids],
            forced=out.forced or [False] * len(out.token_ids),
            calls=out.tool_calls,
            prefill_s=out.timings.prefill_s,
            decode_s=out.timings.decode_s,
            finish_reason=out.finish_reason,
        )

    def _execute(self, call: ToolCall) -> ToolRun:
        """Run one call with a time limit; any failure becomes an observation the model reads."""
        start = time.perf_counter()
        tool = self.tools.get(call.name)
        if tool is None:
            output, ok = f"error: there is no tool named {call.name!r}", False
        else:
            future = self._pool.submit(tool, call.arguments)
            try:
                output, ok = future.result(timeout=self.tool_timeout_s), True
            except FutureTimeout:
                output, ok = (
                    f"error: {call.name} did not finish in {self.tool_timeout_s:g} s",
                    False,
                )
            except ToolError as e:
                output, ok = f"error: {e}", False
        return ToolRun(call.name, call.arguments, output, ok, time.perf_counter() - start)
