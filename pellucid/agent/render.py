"""The terminal view of an agent run, step by step as it happened: for each model turn, what the
grammar allowed, the reply with forced tokens dimmed and free choices bold, the calls and what
each tool returned, and how long each part took."""

from __future__ import annotations

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pellucid.agent.records import AgentRun, ModelTurn

CHOICES = {
    "required": "must call a tool: the grammar forces a <tool_call> block",
    "auto": "may answer or call: a grammar switches on only if it opens <tool_call>",
    "none": "must answer: no tools offered",
}


def render_run(run: AgentRun, console: Console, *, show_prompt: bool = False) -> None:
    console.rule(f"[bold]pellucid agent[/] · tools: {', '.join(run.tools)}")
    console.print(Text.assemble(("question  ", "bold"), run.question))
    if run.examples:
        console.print(f"[dim]{run.examples} messages of worked examples precede the question[/]")
    for turn in run.turns:
        _turn(turn, console, show_prompt)
    console.print()
    answer = run.answer if run.answer is not None else "(no answer: the turns ran out)"
    console.print(Panel(answer, title="final answer", border_style="green"))
    model_s = sum(t.prefill_s + t.decode_s for t in run.turns)
    tool_s = sum(r.seconds for t in run.turns for r in t.tool_runs)
    console.print(
        f"[dim]{len(run.turns)} model turns, {model_s:.2f} s in the model, "
        f"{tool_s:.2f} s in tools, {run.total_s:.2f} s in all[/]"
    )


def _turn(turn: ModelTurn, console: Console, show_prompt: bool) -> None:
    console.print()
    console.rule(
        f"[bold cyan]turn {turn.number + 1}[/] · tool_choice={turn.tool_choice}", align="left"
    )
    console.print(f"[dim]{CHOICES.get(turn.tool_choice, '')}[/]")
    if show_prompt:
        console.print(Panel(Text(turn.prompt), title=f"prompt ({turn.prompt_tokens} tokens)"))
    console.print(
        f"prompt {turn.prompt_tokens} tokens, pre-fill {turn.prefill_s * 1000:.0f} ms; "
        f"reply {len(turn.pieces)} tokens in {turn.decode_s * 1000:.0f} ms, "
        f"{turn.forced_count} forced by the grammar, "
        f"{len(turn.pieces) - turn.forced_count} chosen by the model"
    )
    console.print(Panel(_reply(turn), title="model reply (dim = forced, bold = chosen)"))
    if turn.tool_runs:
        console.print(_tool_table(turn))


def _reply(turn: ModelTurn) -> Text:
    text = Text()
    for piece, forced in zip(turn.pieces, turn.forced):
        text.append(piece, style="dim" if forced else "bold")
    return text


def _tool_table(turn: ModelTurn) -> Table:
    table = Table(title="tool calls", title_justify="left")
    for column in ("tool", "arguments", "result", "ms"):
        table.add_column(column, overflow="fold")
    for run in turn.tool_runs:
        result = run.output if len(run.output) <= 300 else run.output[:300] + " …"
        table.add_row(
            run.name,
            run.arguments,
            Text(result, style="" if run.ok else "red"),
            f"{run.seconds * 1000:.0f}",
        )
    return table
