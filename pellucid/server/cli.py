"""`pellucid serve`'s options and what runs it: one engine in this process (serve.py), or N
replicas on Ray Serve (replicas.py), built alike from `ServeOptions` (launch.py)."""

from __future__ import annotations

import argparse
import os
import sys


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Everything but the model's options (the top-level CLI adds those, as for every command)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 (default: $PELLUCID_API_KEY, else no key)",
    )
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument(
        "--sampling-defaults",
        choices=("model", "openai"),
        default="model",
        help="for settings a request leaves out: the model's recommended sampling (its file's, "
        "else its card's; default) or OpenAI's (temperature 1, top_p 1; replies that must be "
        "tool calls keep frequency_penalty 0.5)",
    )
    p.add_argument(
        "--no-speculative",
        action="store_true",
        help="never guess tokens ahead (speculative decoding from the reply's own n-grams is on "
        "by default, where it pays; a request's `speculative: true` cannot turn it back on)",
    )
    add_limit_args(p)
    add_replica_args(p)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """What the server takes on, keeps and waits for (EngineConfig and ServerLimits)."""
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded at once")
    p.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        help="sequences queued behind those; more get HTTP 429 with Retry-After "
        "(0: refuse as soon as the batch is full, which keeps the time to "
        "first token of accepted requests low under overload)",
    )
    p.add_argument(
        "--max-tokens-in-flight",
        type=int,
        help="prompt + max_tokens summed over the sequences held; more get 429 (default: no bound)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=300.0,
        help="seconds a request may wait before its first step; then 503 (0: forever)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds that requests in flight get to finish",
    )
    p.add_argument(
        "--prefix-cache-mib",
        type=int,
        default=256,
        help="KV of finished requests kept for prompts that share a prefix",
    )


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """Serving from several engines at once, as a Ray Serve application (server/replicas.py)."""
    p.add_argument(
        "--replicas",
        type=int,
        help="serve from N engines behind Ray Serve's router, each with its own threads "
        "(needs pellucid[cluster]; default: one engine in this process, no Ray)",
    )
    p.add_argument(
        "--ray-address",
        help="join this Ray cluster (its head's HEAD:6379, or auto for one started on this "
        "machine by `ray start`) instead of starting one here",
    )
    p.add_argument(
        "--routing",
        choices=("prefix", "random"),
        default="prefix",
        help="with replicas: send a request to the replica that served its longest prompt "
        "prefix, unless that one is much busier (default), or Ray Serve's own pick of two",
    )


def run_serve(args: argparse.Namespace) -> int:
    # imported when the command runs, as the other commands do theirs
    from pellucid.config import EngineConfig
    from pellucid.server.launch import ServeOptions, build_app
    from pellucid.server.limits import ServerLimits

    opts = ServeOptions(
        model=args.model,
        dtype=args.dtype,
        compile=args.compile,
        max_model_len=args.max_model_len,
        engine=EngineConfig(
            max_num_seqs=args.max_num_seqs,
            prefix_cache_bytes=args.prefix_cache_mib << 20,
            speculative=not args.no_speculative,
        ),
        limits=ServerLimits(
            max_waiting=args.max_waiting,
            max_tokens_in_flight=args.max_tokens_in_flight,
            queue_timeout_s=args.queue_timeout or None,
            shutdown_timeout_s=args.shutdown_timeout,
        ),
        api_key=args.api_key or os.environ.get("PELLUCID_API_KEY"),
        sampling_defaults=args.sampling_defaults,
    )
    if args.replicas is not None or args.ray_address is not None:
        from pellucid.server.replicas import ReplicaOptions, serve_replicas

        cluster = ReplicaOptions(args.replicas or 1, args.ray_address, args.routing)
        return serve_replicas(opts, cluster, args.host, args.port)

    from pellucid.server.serve import serve

    app, name = build_app(opts)
    sampling = app.state.pellucid.llm.sampling_defaults
    defaults = ", ".join(f"{k} {v}" for k, v in sampling.items()) or "OpenAI's"
    print(
        f"Serving {name} at http://{args.host}:{args.port}/v1"
        f"{' (API key required)' if opts.api_key else ''}; sampling a request leaves out: {defaults}",
        file=sys.stderr,
    )
    serve(app, args.host, args.port)
    return 0
