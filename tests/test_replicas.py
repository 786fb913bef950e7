"""`pellucid serve --replicas N`: prefix affinity, the in-process HTTP call, merged metrics, and
two replicas on a local Ray instance through the official openai client (server/replicas.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pellucid.config import EngineConfig
from pellucid.errors import PellucidError
from pellucid.server import create_app, replicas
from pellucid.server.affinity import CHUNK, PrefixTable, affinity_pieces
from pellucid.server.asgi_call import HTTPCall, ResponseHead, call_app
from pellucid.server.launch import ServeOptions
from pellucid.server.limits import ServerLimits
from pellucid.server.metrics import merge_replicas
from pellucid.server.replicas import ReplicaOptions
from tests.helpers import KEY, MODEL

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 4
QUESTIONS = [f"What is {a} plus {b}?" for a in range(4) for b in range(8)]  # 32 chats


# --- prefix affinity, without Ray ----------------------------------------------------------------


def chat_body(*turns: str, system: str = SYSTEM) -> dict:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages}


def test_a_conversation_goes_back_to_the_replica_that_served_its_last_turn() -> None:
    table = PrefixTable()
    table.record("b", affinity_pieces(chat_body("What is 0 plus 1?")))
    table.record("a", affinity_pieces(chat_body("What is 0 plus 2?")))
    second = affinity_pieces(chat_body("What is 0 plus 1?", "1.", "And times two?"))
    # both hold the system prompt and "What is 0 plus"; only b holds the whole first turn
    assert table.rank(second, ["a", "b"], load={}) == [["b"], ["a"]]


def test_no_prefix_held_leaves_the_choice_to_load_and_a_busy_replica_loses_its_affinity() -> None:
    table = PrefixTable(imbalance=4)
    pieces = affinity_pieces(chat_body("A question"))
    assert table.rank(pieces, ["a", "b"], load={}) == [["a", "b"]]  # nobody holds it
    table.record("a", pieces)
    assert table.rank(pieces, ["a", "b"], load={"a": 4, "b": 0}) == [["a"], ["b"]]
    assert table.rank(pieces, ["a", "b"], load={"a": 5, "b": 0}) == [["b"], ["a"]]  # too busy
    # b's load unknown to the router (None, here absent): counted 0, so a is too busy
    assert table.rank(pieces, ["a", "b"], load={"a": 9}) == [["b"], ["a"]]
    table.keep_only(["b"])  # a died: a new replica starts with nothing
    assert table.rank(pieces, ["b", "c"], load={}) == [["b", "c"]]


def test_the_table_forgets_the_least_recently_sent_prefixes_first() -> None:
    table = PrefixTable(capacity=4)
    old, new = ["x" * (4 * CHUNK)], ["y" * (4 * CHUNK)]
    table.record("a", old)
    table.record("a", new)
    assert table.rank(old, ["a", "b"], load={}) == [["a", "b"]]
    assert table.rank(new, ["a", "b"], load={}) == [["a"], ["b"]]


def test_affinity_pieces_follow_the_prompt_order_of_every_body_shape() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_tools = affinity_pieces({**chat_body("hi"), "tools": tools})
    assert with_tools == [json.dumps(tools, sort_keys=True), *affinity_pieces(chat_body("hi"))]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert affinity_pieces(parts) == ["<user>hello"]
    assert affinity_pieces({"prompt": ["first", "second"]}) == ["first"]
    assert affinity_pieces({"prompt": [1, 2, 3]}) == ["[1, 2, 3]"]
    assert affinity_pieces({"nothing": 1}) == []


def test_merged_metrics_keep_every_replica_apart() -> None:
    def exposition(hits: int) -> str:
        registry = CollectorRegistry()
        Counter("pellucid:prefix_cache_hits", "Hits.", ["model_name"], registry=registry).labels(
            model_name="m"
        ).inc(hits)
        return generate_latest(registry).decode()

    merged = merge_replicas([exposition(3), exposition(5)]).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    hits = families["pellucid:prefix_cache_hits"].samples
    assert {s.labels["replica"]: s.value for s in hits if s.name.endswith("_total")} == {
        "0": 3.0,
        "1": 5.0,
    }
    assert merged.count("# TYPE pellucid:prefix_cache_hits_total counter") == 1


# --- one request through the app, in process -------------------------------------------------


def test_call_app_streams_what_the_server_would_send_and_a_reader_that_stops_aborts(tiny) -> None:
    app = create_app(tiny, model_name="tiny")
    state = app.state.pellucid
    state.engine.start()
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0}

    async def run(stream: bool, pieces: int | None = None) -> list:
        call = HTTPCall(
            "POST",
            "/v1/completions",
            headers=((b"content-type", b"application/json"),),
            body=json.dumps(
                {**body, "stream": stream, "max_tokens": 200 if pieces else 4}
            ).encode(),
        )
        got = []
        answer = call_app(app, call)
        async for piece in answer:
            got.append(piece)
            if pieces is not None and len(got) == pieces:
                await answer.aclose()  # the client went away
                break
        return got

    try:
        head, whole = asyncio.run(run(stream=False))
        assert (
            isinstance(head, ResponseHead)
            and head.status == 200
            and json.loads(whole)["choices"][0]["text"]
        )
        head, *events = asyncio.run(run(stream=True))
        assert head.status == 200 and events[-1] == b"data: [DONE]\n\n"
        asyncio.run(run(stream=True, pieces=3))
        deadline = time.monotonic() + 10
        while state.engine.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state.engine.in_flight == 0  # the 200-token request was aborted, not left running
    finally:
        state.engine.stop()


def test_without_ray_or_its_cluster_the_error_says_what_to_do(monkeypatch) -> None:
    monkeypatch.setattr(replicas, "ray", None)
    with pytest.raises(PellucidError, match=r"pip install 'pellucid\[cluster\]'"):
        replicas.serve_replicas(ServeOptions(), ReplicaOptions(2), "127.0.0.1", 0)
    with pytest.raises(ValueError, match="--replicas must be 1 or more"):
        ReplicaOptions(0)
    with pytest.raises(PellucidError, match=r"could not reach the Ray cluster at 127.0.0.1:1"):
        replicas.start_ray("127.0.0.1:1")  # nothing listens on port 1


# --- two replicas on a local Ray instance ----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """SmolLM2 (float32, as the single-process `server`) on two replicas, half the cores each."""
    ray = pytest.importorskip("ray")
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False)  # as many CPUs as the machine has
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    opts = ServeOptions(model=MODEL, dtype="float32", api_key=KEY)
    serve.run(replicas.application(opts, ReplicaOptions(2)), name=replicas.APP, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def chats(url: str, bodies: list[dict], **extra) -> list[str]:
    """Every body sent at once as a streaming chat; the replies' texts, in order."""

    async def one(client: openai.AsyncOpenAI, body: dict) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=body["messages"], stream=True, **extra
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, b) for b in bodies))

    return asyncio.run(run())


def engine_counts(url: str) -> dict[str, dict[str, float]]:
    """Each replica's prefix-cache and generation counters, from the merged /metrics."""
    counts: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name.endswith("_total") and "replica" in s.labels:
                counts.setdefault(s.labels["replica"], {})[s.name] = s.value
    return counts


@pytest.mark.slow
def test_two_replicas_give_one_engines_greedy_replies_to_32_streaming_chats(
    cluster: str, server
) -> None:
    """Chats that share no prefix, so that the router spreads them by load: with a shared
    system prompt they would go to the replica that holds it until it is IMBALANCE requests
    busier than the other, which requests arriving slower than it answers (a busy machine)
    never make it (a `make test` run sent all 32 to one replica). Short prompts: each is
    pre-filled twice in float32, by the replicas and by the single engine."""
    bodies = [chat_body(q, system=f"Chat {i}.") for i, q in enumerate(QUESTIONS)]
    greedy = {"temperature": 0, "max_tokens": 12}
    assert chats(cluster, bodies, **greedy) == chats(server.url, bodies, **greedy)
    generated = [c["pellucid:generation_tokens_total"] for c in engine_counts(cluster).values()]
    assert len(generated) == 2 and min(generated) > 0  # both replicas worked


@pytest.mark.slow
def test_tool_calls_traces_and_errors_come_back_as_from_one_engine(cluster: str, server) -> None:
    from tests.test_server_tools import ASK, CALC, WEATHER

    bodies = [
        {  # a required call, its trace of sampling stages asked too
            "model": MODEL,
            "messages": ASK,
            "tools": [WEATHER, CALC],
            "tool_choice": "required",
            "temperature": 0,
            "max_tokens": 60,
            "trace": True,
        },
        {"model": MODEL, "messages": ASK, "max_tokens": 0},  # refused: 400
        {"model": "no-such-model", "messages": ASK},  # 404
    ]

    def answers(url: str) -> list[tuple[int, dict]]:
        headers = {"Authorization": f"Bearer {KEY}"}
        replies = [
            httpx.post(url + "/v1/chat/completions", json=b, headers=headers, timeout=300)
            for b in bodies
        ]
        return [(r.status_code, r.json()) for r in replies]

    (status, one), *refusals = answers(cluster)
    (status_single, single), *refusals_single = answers(server.url)
    assert status == status_single == 200
    calls, calls_single = (
        [c["function"] for c in r["choices"][0]["message"]["tool_calls"]] for r in (one, single)
    )
    assert calls and calls == calls_single  # the same calls (their ids are drawn afresh)
    trace, trace_single = (r["pellucid"]["traces"]["0"]["steps"] for r in (one, single))
    assert [s["token"]["id"] for s in trace] == [s["token"]["id"] for s in trace_single]
    assert [(code, r["error"]["message"]) for code, r in refusals] == [
        (code, r["error"]["message"]) for code, r in refusals_single
    ]
    assert [code for code, _ in refusals] == [400, 404]


def hit_rate(counts_before: dict, counts_after: dict) -> float:
    def total(counts: dict, name: str) -> float:
        return sum(c[f"pellucid:prefix_cache_{name}_total"] for c in counts.values())

    hits = total(counts_after, "hits") - total(counts_before, "hits")
    return hits / (total(counts_after, "queries") - total(counts_before, "queries"))


@pytest.mark.slow
def test_prefix_affinity_keeps_the_single_engine_hit_rate_of_follow_up_turns(
    cluster: str, server
) -> None:
    """Eight two-turn chats that share a system prompt (a new one, so no earlier test's KV
    counts): turn 2 finds turn 1's KV only on the replica that ran turn 1. Measured once the
    system prompt has been seen (one chat before), as on a server that has been running: in the
    first burst, requests routed before the first one's routing was recorded compute the system
    prompt on each replica once (the CI run that measured from cold read 0.82 vs 0.93)."""
    system = f"Session {uuid.uuid4()}. " + SYSTEM
    firsts = [chat_body(q, system=system) for q in QUESTIONS[:8]]
    greedy = {"temperature": 0, "max_tokens": 8}

    def two_turns(url: str, counts) -> float:
        chats(url, [chat_body("Hello!", system=system)], **greedy)  # the system prompt seen
        before = counts()
        replies = chats(url, firsts, **greedy)
        seconds = [
            chat_body(q, r, "And times two?", system=system)
            for q, r in zip(QUESTIONS[:8], replies, strict=True)
        ]
        chats(url, seconds, **greedy)
        return hit_rate(before, counts())

    def single_counts() -> dict:
        stats = server.state.engine.stats
        return {
            "0": {
                "pellucid:prefix_cache_hits_total": stats.prefix_cache_hits,
                "pellucid:prefix_cache_queries_total": stats.prefix_cache_queries,
            }
        }

    single = two_turns(server.url, single_counts)
    spread = two_turns(cluster, lambda: engine_counts(cluster))
    assert single > 0.4 and spread >= 0.9 * single, (spread, single)


@pytest.mark.slow
def test_a_replica_killed_mid_run_loses_no_request_silently_and_is_replaced(cluster: str) -> None:
    """Four streams and four whole answers on the replica that is killed: each stream ends whole
    or with a clean error, each whole answer is retried on the other replica and completes."""
    import ray

    async def one(client: openai.AsyncOpenAI, question: str, stream: bool) -> str:
        messages = chat_body(question)["messages"]
        try:
            if not stream:
                reply = await client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=96
                )
                return "done" if reply.choices[0].finish_reason else "cut"
            finish = None
            async for chunk in await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=96, stream=True
            ):
                finish = chunk.choices[0].finish_reason if chunk.choices else finish
            return "done" if finish else "cut"
        except openai.APIError:
            return "error"

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=cluster + "/v1", api_key=KEY, max_retries=0, timeout=120
        ) as client:
            tasks = [
                asyncio.create_task(one(client, q, stream=i % 2 == 0))
                for i, q in enumerate(QUESTIONS[:8])
            ]
            busiest = await under_way(cluster)
            name = f"SERVE_REPLICA::{replicas.APP}#EngineReplica#{busiest['replica']}"
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)

    outcomes = asyncio.run(run())
    streams, whole = outcomes[0::2], outcomes[1::2]
    assert set(streams) <= {"done", "error"} and whole == ["done"] * 4, outcomes
    deadline = time.monotonic() + 120
    while sum(r["running"] for r in replica_states(cluster)) < 2:
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(1)
    assert chats(cluster, [chat_body("Hello again")], max_tokens=4)[0]


async def under_way(url: str) -> dict:
    """The busiest replica, once the streams are under way there."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busiest = max(replica_states(url), key=lambda r: r["in_flight"], default=None)
        if busiest is not None and busiest["in_flight"] > 0:
            await asyncio.sleep(1)  # some tokens out: the kill lands mid-stream
            return busiest
        await asyncio.sleep(0.2)
    raise AssertionError("no replica took the streams")


def replica_states(url: str) -> list[dict]:
    """/health's replicas: each one's id, whether its engine runs, and its requests in flight."""
    try:
        return httpx.get(url + "/health", timeout=10).json().get("replicas", [])
    except (httpx.HTTPError, ValueError):
        return []


@pytest.mark.slow
def test_when_every_replica_and_the_router_queue_are_full_the_answer_is_429(cluster: str) -> None:
    """One replica holding one sequence and queueing none, the router queueing one more: of six
    requests at once some are answered, the rest get 429 with Retry-After, as from one engine.
    (Last in the module: it takes the cluster's place.)"""
    from ray import serve

    serve.delete(replicas.APP)
    # the default path: its replica loads and answers in a fraction of float32's time
    opts = ServeOptions(
        model=MODEL,
        api_key=KEY,
        engine=EngineConfig(max_num_seqs=1),
        limits=ServerLimits(max_waiting=0),
    )
    serve.run(replicas.application(opts, ReplicaOptions(1)), name="small", route_prefix="/")

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": MODEL, "messages": chat_body("Tell me a story")["messages"]}
            return await asyncio.gather(
                *(
                    client.post(
                        cluster + "/v1/chat/completions",
                        json={**body, "max_tokens": 32},
                        headers={"Authorization": f"Bearer {KEY}"},
                    )
                    for _ in range(6)
                )
            )

    replies = asyncio.run(run())
    codes = sorted(r.status_code for r in replies)
    assert codes[0] == 200 and codes[-1] == 429, codes
    refused = [r for r in replies if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" for r in refused)
    assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
