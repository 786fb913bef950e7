"""What an agent run records: each model turn (its prompt, tokens forced by the grammar or chosen
freely, the calls it made, timings) and each tool run (input, output, time). Plain dataclasses,
so a run can be rendered in the terminal or saved as JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pellucid.structured import ToolCall, parse_tool_calls


@dataclass(slots=True)
class ToolRun:
    name: str
    arguments: str  # JSON, as the model wrote it
    output: str  # what the model reads back: the result, or "error: ..."
    ok: bool
    seconds: float


@dataclass(slots=True)
class ModelTurn:
    number: int
    tool_choice: str  # "required" | "auto" | "none": what the grammar allowed this turn
    prompt: str  # the whole prompt the model saw, chat template and all
    prompt_tokens: int
    text: str  # the model's reply
    pieces: list[str]  # the reply's tokens
    forced: list[bool]  # per token: the grammar allowed only this one
    calls: list[ToolCall]
    prefill_s: float
    decode_s: float
    finish_reason: str | None
    tool_runs: list[ToolRun] = field(default_factory=list)

    @property
    def text_outside_calls(self) -> str:
        return parse_tool_calls(self.text).content

    @property
    def forced_count(self) -> int:
        return sum(self.forced)


@dataclass(slots=True)
class AgentRun:
    question: str
    tools: list[str]
    examples: int  # messages of worked examples put before the question
    turns: list[ModelTurn] = field(default_factory=list)
    answer: str | None = None  # None: the turns ran out before an answer
    total_s: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
