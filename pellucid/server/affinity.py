"""Prefix affinity: which replica most likely holds a request's prompt prefix in its KV cache.

Each engine keeps the KV of finished requests and reuses it for prompts that start the same way
(the prefix cache). Behind a router of several engines that only pays if a request goes to the
engine that served its prefix: turn 2 of a chat to the engine that ran turn 1. The router sees
request bodies, not tokens, so the prefix is tracked as text: the body's tools and each message
(or the prompt) cut into chunks of at most CHUNK characters, each hashed together with all
before it, as the engine hashes its KV blocks. A replica "holds" the chunks of the requests it
was sent (up to `capacity` per replica, least recently used out first, roughly as the engine's
cache evicts).

    table = PrefixTable()
    ranks = table.rank(affinity_pieces(body), ["r1", "r2"], load={"r1": 3, "r2": 0})
    table.record("r1", affinity_pieces(body))
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping

CHUNK = 64  # characters at most a chunk: a system prompt of a few hundred is several
CAPACITY = 16384  # chunks remembered per replica (~1M characters of prompts)
IMBALANCE = 8  # requests: a replica this much busier than the idlest loses its affinity


def affinity_pieces(body: Mapping) -> list[str]:
    """The parts of a request body that become the prompt's start, in order: the tools, then
    each message (or the completion's prompt). Unknown shapes give []: no affinity."""
    tools = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
    messages = body.get("messages")
    if isinstance(messages, list):
        return tools + [_message_text(m) for m in messages if isinstance(m, Mapping)]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of prompts (texts or token lists): the first decides
    if prompt is None or prompt == []:
        return tools
    return tools + [prompt if isinstance(prompt, str) else json.dumps(prompt)]


def _message_text(m: Mapping) -> str:
    content = m.get("content")
    if isinstance(content, list):  # parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    calls = json.dumps(m.get("tool_calls"), sort_keys=True) if m.get("tool_calls") else ""
    return f"<{m.get('role')}>{content or ''}{calls}"


def chunk_hashes(pieces: list[str]) -> list[bytes]:
    """One hash per CHUNK characters of each piece (its last one shorter), each over everything
    before it: a prefix chain. A piece's end ends a chunk, so turn 1's messages hash the same
    inside turn 2, whose messages start with them."""
    hashes, h = [], b""
    for piece in pieces:
        for start in range(0, len(piece), CHUNK):
            h = hashlib.blake2b(h + piece[start : start + CHUNK].encode(), digest_size=16).digest()
            hashes.append(h)
    return hashes


class PrefixTable:
    def __init__(self, capacity: int = CAPACITY, imbalance: int = IMBALANCE):
        self.capacity, self.imbalance = capacity, imbalance
        self.held: dict[Hashable, OrderedDict[bytes, None]] = {}

    def matched(self, replica: Hashable, hashes: list[bytes]) -> int:
        """How many leading chunks `replica` holds."""
        held = self.held.get(replica, {})
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    def rank(
        self, pieces: list[str], replicas: Iterable[Hashable], load: Mapping[Hashable, int]
    ) -> list[list[Hashable]]:
        """Replicas in ranks, most preferred first: those holding the longest prefix (unless
        busier than the idlest by IMBALANCE), then the rest. The router takes the least loaded
        replica of the first rank that has room. No prefix held by a replica that is not too
        busy: those not too busy first, the rest after.

        The too busy go in a later rank, not beside the others, because Ray's router picks the
        least loaded of a rank among the replicas whose load it knows, and asks the others only
        if none has room: a replica it has not heard from lately (load unknown, here 0) would
        lose every request of a burst to one it knows (a CI run sent all 32 of a burst to one
        replica of two)."""
        replicas = list(replicas)
        hashes = chunk_hashes(pieces)
        idlest = min((load.get(r, 0) for r in replicas), default=0)
        fair = [r for r in replicas if load.get(r, 0) - idlest <= self.imbalance]
        best = max((self.matched(r, hashes) for r in fair), default=0)
        first = [r for r in fair if self.matched(r, hashes) == best]
        rest = [r for r in replicas if r not in first]
        return [first, rest] if rest else [first]

    def record(self, replica: Hashable, pieces: list[str]) -> None:
        """`replica` was sent this prompt: it holds its prefix now."""
        held = self.held.setdefault(replica, OrderedDict())
        for h in chunk_hashes(pieces):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        """Forget replicas that are gone (died, or scaled down): a new one starts empty."""
        alive = set(replicas)
        for r in [r for r in self.held if r not in alive]:
            del self.held[r]
