"""`pellucid serve --replicas N`: the OpenAI server as a Ray Serve application of N engines.

    pellucid serve --replicas 2                        # a local Ray instance, started here
    pellucid serve --replicas 4 --ray-address auto     # join a cluster (`ray start --head` ...)

    client ──HTTP──▶ Ray Serve proxy ──▶ Ingress ──handle──▶ EngineReplica × N
                                          │  PrefixAffinityRouter picks the replica
                                          └─ /metrics, /health: asked of every replica

Small models scale out as data-parallel replicas, each one whole engine (the same app as
`pellucid serve` alone, run in-process by asgi_call.py) with its share of the CPU's threads. The
ingress forwards each HTTP request whole; the router sends it to the replica that served its
longest prompt prefix (affinity.py), or the least loaded. A replica whose engine thread stopped
fails Ray Serve's health check and is replaced. A request whose replica dies before any of its
answer was sent is retried on another; a stream cut after that ends with an error event and
[DONE], so no client waits on a dead replica.
"""

# No `from __future__ import annotations`: Ray Serve's ingress hands FastAPI the methods'
# annotations as they are, and a string "Request" would be read as a query parameter.
import asyncio
import json
import os
import random
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pellucid.errors import PellucidError
from pellucid.server import responses as R
from pellucid.server.affinity import PrefixTable, affinity_pieces
from pellucid.server.asgi_call import HTTPCall, ResponseHead, call_app
from pellucid.server.errors import APIError, error_body
from pellucid.server.launch import ServeOptions, build_app
from pellucid.server.metrics import merge_replicas

try:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.exceptions import BackPressureError
    from ray.serve.handle import DeploymentHandle
    from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica
except ImportError:  # pellucid[cluster] not installed: serve_replicas says how to get it
    ray = None

APP = "pellucid"
RETRIES = 2  # other replicas tried when one dies before answering
REPLICA_GONE = (
    "the replica serving this request stopped before it finished (Ray Serve replaces it): "
    "send the request again"
)


@dataclass(frozen=True)
class ReplicaOptions:
    replicas: int = 2
    ray_address: str | None = None  # None: start a Ray instance in this process
    routing: str = "prefix"  # or "random": Ray Serve's power of two choices

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be 1 or more, got {self.replicas}")


def serve_replicas(opts: ServeOptions, cluster: ReplicaOptions, host: str, port: int) -> int:
    """Start (or join) Ray, deploy the ingress and N engine replicas, serve until Ctrl-C/SIGTERM."""
    if ray is None:
        raise PellucidError(
            "serving replicas needs Ray Serve: pip install 'pellucid[cluster]' "
            "(or 'ray[serve]==2.60.0'), or leave out --replicas to serve from one process"
        )
    start_ray(cluster.ray_address)
    # after Ray's start, whose core worker installs its own handler (a crash report)
    signal.signal(signal.SIGTERM, _interrupt)  # a stop that was asked for, as Ctrl-C
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(opts, cluster), name=APP, route_prefix="/")
        print(
            f"Serving at http://{host}:{port}/v1 from {cluster.replicas} replica(s) on Ray "
            f"Serve (routing: {cluster.routing}); Ctrl-C stops them",
            file=sys.stderr,
        )
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP)
        if cluster.ray_address is None:
            ray.shutdown()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def start_ray(address: str | None) -> None:
    """Join the cluster at `address` ("auto": the one started on this machine), else start one."""
    if address not in (None, "auto") and not _reachable(address):
        raise PellucidError(_unreachable(address, "nothing answers there"))
    try:
        ray.init(address=address, namespace=APP, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, SystemExit) as e:  # Ray exits the process when its GCS never answers
        raise PellucidError(_unreachable(address, str(e) or "it did not answer")) from e


def _reachable(address: str, timeout: float = 5.0) -> bool:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError):
        return False
    return True


def _unreachable(address: str | None, why: str) -> str:
    return (
        f"could not reach the Ray cluster at {address} ({why}): start one with `ray start "
        "--head` on its first machine and `ray start --address HEAD:6379` on the others, or "
        "leave out --ray-address to start one here"
    )


def application(opts: ServeOptions, cluster: ReplicaOptions) -> Any:
    """The Ray Serve application: the ingress bound to N engine replicas."""
    import torch

    cpus = os.cpu_count() or 1
    # The threads torch would take here (the physical cores, or OMP_NUM_THREADS where set),
    # shared: replicas of more threads than that between them oversubscribe the cores, and
    # every parallel region's barrier then waits on a thread another process has descheduled.
    threads = max(1, torch.get_num_threads() // cluster.replicas)
    # More replicas than cores here: each asks a share of a core, so that they all start
    share = (
        cpus / cluster.replicas if cluster.replicas > cpus and not cluster.ray_address else threads
    )
    router = (
        RequestRouterConfig(request_router_class=PrefixAffinityRouter)
        if cluster.routing == "prefix"
        else RequestRouterConfig()
    )
    engines = EngineReplica.options(
        num_replicas=cluster.replicas,
        ray_actor_options={"num_cpus": share},
        # a replica takes what its engine holds and queues; past that the ingress's router
        # queues a few more, and then answers 429 as one engine would (Ingress.forward)
        max_ongoing_requests=opts.engine.max_num_seqs + opts.limits.max_waiting,
        max_queued_requests=max(1, opts.limits.max_waiting),
        request_router_config=router,
        health_check_period_s=2,
        health_check_timeout_s=30,
    )
    return Ingress.bind(engines.bind(opts, threads), opts.limits.retry_after_s)


# The deployments below are pickled as they are defined (Ray Serve ships them to their
# processes), so everything they use is defined above them.
_REPLICA_DIED = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) if ray else ()


async def _next_or_none(answer: AsyncIterator[Any]) -> bytes | None:
    try:
        return await answer.__anext__()
    except StopAsyncIteration:
        return None


async def _relay(answer: Any, first: bytes | None) -> AsyncIterator[bytes]:
    """A stream's pieces; if its replica dies midway, an error event and [DONE] end it."""
    try:
        if first:
            yield first
        async for piece in answer:
            yield piece
    except _REPLICA_DIED:
        gone = error_body(REPLICA_GONE, "server_error", code="replica_unavailable")
        yield (R.sse(gone) + R.SSE_DONE).encode()
    finally:  # ended, or the client went away: the replica's work stops too
        answer.cancel()


def _json(body: bytes) -> dict:
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        return {}  # the replica's app answers a malformed body with its 400
    return parsed if isinstance(parsed, dict) else {}


def _headers(head: ResponseHead) -> dict[str, str]:
    # content-length is worked out again by the response; the rest passes as the replica set it
    return {k.decode(): v.decode() for k, v in head.headers if k.lower() != b"content-length"}


def _response(head: ResponseHead, body: bytes) -> Response:
    return Response(body, status_code=head.status, headers=_headers(head))


if ray is not None:

    class PrefixAffinityRouter(FIFOMixin, RequestRouter):
        """Ray Serve's router, choosing by prompt prefix (affinity.PrefixTable) and load."""

        def initialize_state(self, **kwargs: Any) -> None:
            self.table = PrefixTable(**kwargs)

        async def choose_replicas(
            self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
        ) -> list[list[RunningReplica]]:
            by_id = {r.replica_id: r for r in candidate_replicas}
            pieces = pending_request.kwargs.get("affinity", []) if pending_request else []
            lengths = self.replica_queue_len_cache
            load = {i: lengths.get(i) or 0 for i in by_id}
            ranks = [[by_id[i] for i in rank] for rank in self.table.rank(pieces, by_id, load)]
            # Ray takes the least loaded of a rank, the first listed among equals: shuffled, as
            # its own router samples, so that requests arriving one at a time at idle replicas
            # (equal loads, each answered before the next comes) do not all go to the first
            for rank in ranks:
                random.shuffle(rank)
            return ranks

        def on_request_routed(
            self, pending_request: PendingRequest, replica_id: Any, result: Any
        ) -> None:
            self.table.record(replica_id, pending_request.kwargs.get("affinity", []))

        def update_replicas(self, replicas: list[RunningReplica]) -> None:
            super().update_replicas(replicas)
            self.table.keep_only(r.replica_id for r in replicas)

    @serve.deployment(ray_actor_options={"num_cpus": 1})
    class EngineReplica:
        """One engine and the app of `pellucid serve`, answering forwarded HTTP requests."""

        def __init__(self, opts: ServeOptions, threads: int):
            import torch

            torch.set_num_threads(threads)
            self.app, _ = build_app(opts)
            self.state = self.app.state.pellucid
            self.state.engine.start()  # the app's lifespan would; here nobody runs it

        async def call(
            self, call: HTTPCall, affinity: list[str] | None = None
        ) -> AsyncIterator[Any]:
            async for piece in call_app(self.app, call):
                yield piece

        def metrics(self) -> str:
            return self.state.metrics.exposition().decode()

        def status(self) -> dict[str, Any]:
            """For the ingress's /health: this replica, whether it runs, how busy it is."""
            return {
                "replica": serve.get_replica_context().replica_id.unique_id,
                "running": self.state.engine.is_running,
                "in_flight": self.state.engine.in_flight,
            }

        def check_health(self) -> None:
            """Ray Serve's probe: a replica whose engine thread died is replaced."""
            if not self.state.engine.is_running:
                raise RuntimeError("the engine thread is not running")

        def __del__(self) -> None:
            if hasattr(self, "state"):
                self.state.engine.stop()

    # no docs routes of its own: /docs and /openapi.json are forwarded to the replicas' app
    ingress_app = FastAPI(
        title="pellucid replicas", openapi_url=None, docs_url=None, redoc_url=None
    )

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    @serve.ingress(ingress_app)
    class Ingress:
        """Forwards each HTTP request whole to one engine replica; asks them all for metrics."""

        def __init__(self, engines: DeploymentHandle, retry_after_s: int):
            self.engines, self.retry_after_s = engines, retry_after_s

        @ingress_app.get("/metrics")
        async def metrics(self) -> Response:
            texts = await self.engines.broadcast("metrics").results_async()
            return Response(merge_replicas(texts), media_type="text/plain; version=0.0.4")

        @ingress_app.get("/health")
        async def health(self) -> JSONResponse:
            replicas = await self.engines.broadcast("status").results_async()
            if not any(r["running"] for r in replicas):
                return APIError(503, "no replica is running", kind="server_error").response()
            return JSONResponse({"status": "ok", "replicas": replicas})

        @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def forward(self, request: Request) -> Response:
            call = HTTPCall(
                request.method,
                request.url.path,
                request.url.query.encode(),
                tuple(request.headers.raw),
                await request.body(),
            )
            body = _json(call.body)
            affinity = affinity_pieces(body)
            for _ in range(RETRIES + 1):
                answer = self.engines.options(stream=True).call.remote(call, affinity=affinity)
                try:  # the head and the first piece: a replica that dies before then is retried
                    head, first = await answer.__anext__(), await _next_or_none(answer)
                    if body.get("stream") is not True:  # a whole answer: retried until whole
                        rest = [piece async for piece in answer]
                        return _response(head, b"".join([first or b"", *rest]))
                except _REPLICA_DIED:
                    answer.cancel()
                    continue
                except BackPressureError:  # every replica full, and the queue before them
                    full = "every replica is full, and the queue before them too: retry later"
                    return APIError(
                        429,
                        full,
                        kind="requests",
                        code="rate_limit_exceeded",
                        retry_after=self.retry_after_s,
                    ).response()
                except asyncio.CancelledError:  # the client went away
                    answer.cancel()
                    raise
                return StreamingResponse(
                    _relay(answer, first),
                    status_code=head.status,
                    headers=_headers(head),
                )
            return APIError(
                503, REPLICA_GONE, kind="server_error", code="replica_unavailable"
            ).response()
