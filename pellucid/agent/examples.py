"""Worked examples of the tool loop, shown to the model as earlier turns of the conversation.

A 135M model cannot infer from a tool list alone when to call what; complete episodes
(question -> calls -> results -> answer) show it the pattern, and the answers show it how to
answer from a result: copy the fact the question asks for. An example is used only when the
agent has every tool it calls, so the model never sees a tool it cannot use.
"""

from __future__ import annotations

import json
from collections.abc import Container

# (tools it needs, the episode: user question, calls in one turn, their results, final answer)
EXAMPLES = [
    (
        {"calculator", "search"},
        "What is 6+9, and what is the capital of France?",
        [("calculator", {"expression": "6+9"}), ("search", {"query": "France"})],
        [
            "6+9 = 15",
            (
                "[1] France: France is a country in Western Europe whose capital and "
                "largest city is Paris."
            ),
        ],
        "6+9 = 15, and the capital of France is Paris.",
    ),
    (  # a "who" question: the answer names the person the result names
        {"calculator", "search"},
        "What is 8*7, and who painted the Mona Lisa?",
        [("calculator", {"expression": "8*7"}), ("search", {"query": "Mona Lisa"})],
        [
            "8*7 = 56",
            (
                "[1] Mona Lisa: The Mona Lisa is a half-length portrait painting by "
                "Italian artist Leonardo da Vinci."
            ),
        ],
        "8*7 = 56, and the Mona Lisa was painted by Leonardo da Vinci.",
    ),
]


def example_messages(tools: Container[str]) -> list[dict]:
    """The chat messages of every example whose tools the agent has."""
    messages: list[dict] = []
    for needs, question, calls, results, answer in EXAMPLES:
        if not all(name in tools for name in needs):
            continue
        ids = [f"example_{len(messages)}_{i}" for i in range(len(calls))]
        messages.append({"role": "user", "content": question})
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": i,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                    for i, (name, args) in zip(ids, calls)
                ],
            }
        )
        messages += [
            {"role": "tool", "tool_call_id": i, "content": r} for i, r in zip(ids, results)
        ]
        messages.append({"role": "assistant", "content": answer})
    return messages
