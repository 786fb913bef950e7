"""Soak: `pellucid serve` under steady load for minutes, then overload, then SIGTERM under load.

Clients are the official `openai` client (async, no retries of its own), each streaming one chat
completion after another with a new prompt every time. Phases:
  unloaded  one client alone: the time to first token (TTFT) the others are compared with
  soak      --clients for --minutes: requests, failures, p50/p99 latency and TTFT, RSS over time
  overload  --overload-clients at once: replies vs fast 429/503 (clients wait Retry-After, as
            well-behaved ones do), TTFT of the accepted, RSS
  sigterm   --clients streaming 4x as long, then SIGTERM: how each in-flight stream ended (it
            finished, or got an error event; a dropped connection is a failure), the exit code
RSS of the server process is sampled all along and plotted next to the JSON result.

    .venv/bin/python benchmarks/soak.py [--clients 32] [--minutes 10] [--overload-clients 256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).parent))  # run as a script from anywhere

from common import RESULTS, save
from serve import pellucid_server, percentile

TOPICS = ["the sea", "bread", "the moon", "trains", "bees", "maps", "rain", "chess", "glass"]


@dataclass
class Phase:
    name: str
    ttft: list[float] = field(default_factory=list)  # of completed requests
    latency: list[float] = field(default_factory=list)
    rejected: dict[int, int] = field(default_factory=dict)  # HTTP status -> count
    reject_s: list[float] = field(default_factory=list)  # how long a refusal took
    failures: list[str] = field(default_factory=list)
    ended: dict[str, int] = field(default_factory=dict)  # sigterm: how in-flight streams ended
    # The clients share this machine with the server: what they took of it, and over how long
    client_cpu_s: float = 0.0
    wall_s: float = 0.0

    def summary(self) -> dict[str, object]:
        out: dict[str, object] = {
            "requests": len(self.latency),
            "failures": len(self.failures),
            "failure_examples": self.failures[:5],
            "wall_s": self.wall_s,
            "client_cpu_s": self.client_cpu_s,
        }
        for name, values in (
            ("ttft_s", self.ttft),
            ("latency_s", self.latency),
            ("reject_s", self.reject_s),
        ):
            if values:
                out[name] = {
                    "p50": percentile(values, 50),
                    "p99": percentile(values, 99),
                    "max": max(values),
                }
        if self.rejected:
            out["rejected"] = self.rejected
        if self.ended:
            out["ended"] = self.ended
        return out


class Load:
    """Clients against one server; the server's RSS sampled meanwhile."""

    def __init__(self, url: str, pid: int, args: argparse.Namespace):
        self.url, self.pid, self.args = url, pid, args
        self.client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="-", max_retries=0, timeout=600
        )
        self.start = time.perf_counter()
        self.rss: list[tuple[float, float, str]] = []  # (seconds since start, MiB, phase)
        self.phase = "start"
        self.count = 0

    async def sample_rss(self) -> None:
        while True:
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
            except OSError:
                return  # the server has exited
            if "VmRSS:" not in status:
                return  # exited, not yet reaped
            mib = int(status.split("VmRSS:")[1].split()[0]) / 1024
            self.rss.append((time.perf_counter() - self.start, mib, self.phase))
            await asyncio.sleep(self.args.sample_s)

    async def run(self, phase: Phase, clients: int, seconds: float) -> Phase:
        self.phase = phase.name
        start, cpu = time.perf_counter(), time.process_time()
        stop_at = start + seconds
        await asyncio.gather(*(self.loop(phase, stop_at) for _ in range(clients)))
        phase.wall_s = time.perf_counter() - start
        phase.client_cpu_s = time.process_time() - cpu
        print(f"{phase.name}: {phase.summary()}", file=sys.stderr)
        return phase

    async def loop(self, phase: Phase, stop_at: float) -> None:
        while time.perf_counter() < stop_at:
            ended, detail = await self.one(phase, self.args.max_tokens)
            if ended not in ("finished", "rejected"):
                phase.failures.append(f"{ended}: {detail}")

    async def one(self, phase: Phase, max_tokens: int) -> tuple[str, str]:
        """One streamed chat: how it ended (finished, rejected, failed, error_event, dropped)."""
        self.count += 1
        messages = [
            {
                "role": "user",
                "content": f"Write about {TOPICS[self.count % len(TOPICS)]} (request {self.count}).",
            }
        ]
        start = time.perf_counter()
        first = None
        try:
            stream = await self.client.chat.completions.create(
                model=self.args.model, messages=messages, max_tokens=max_tokens, stream=True
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
        except openai.APIStatusError as e:
            if e.status_code not in (429, 503):
                return "failed", f"{e.status_code}: {e.message}"
            phase.rejected[e.status_code] = phase.rejected.get(e.status_code, 0) + 1
            phase.reject_s.append(time.perf_counter() - start)
            await asyncio.sleep(float(e.response.headers.get("retry-after", 1)))
            return "rejected", e.message
        except (openai.APIConnectionError, httpx.TransportError) as e:
            return "dropped", f"{type(e).__name__}: {e}"
        except openai.APIError as e:  # an error event in the stream
            return "error_event", e.message
        now = time.perf_counter()
        phase.latency.append(now - start)
        phase.ttft.append((first or now) - start)
        return "finished", ""

    async def sigterm(self, pid: int, clients: int, after_s: float) -> Phase:
        """Long streams in flight, then SIGTERM: how each ended (dropped ones are failures)."""
        phase = Phase("sigterm")
        self.phase = phase.name

        async def stream() -> None:
            ended, detail = await self.one(phase, 4 * self.args.max_tokens)
            phase.ended[ended] = phase.ended.get(ended, 0) + 1
            if ended in ("dropped", "failed"):
                phase.failures.append(f"{ended}: {detail}")

        start, cpu = time.perf_counter(), time.process_time()
        tasks = [asyncio.create_task(stream()) for _ in range(clients)]
        await asyncio.sleep(after_s)
        os.kill(pid, signal.SIGTERM)
        await asyncio.gather(*tasks)
        phase.wall_s, phase.client_cpu_s = time.perf_counter() - start, time.process_time() - cpu
        return phase


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--overload-clients", type=int, default=256)
    ap.add_argument("--overload-minutes", type=float, default=2)
    ap.add_argument("--max-tokens", type=int, default=128, help="per request (EOS honoured)")
    ap.add_argument("--unloaded-s", type=float, default=90, help="one client alone, seconds")
    ap.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling interval")
    ap.add_argument("--server-args", default="", help="more `pellucid serve` options, quoted")
    args = ap.parse_args()
    with pellucid_server(args.model, args.dtype, args.server_args.split()) as (url, proc):
        result, load = asyncio.run(soak(url, proc.pid, args))
        exit_code = proc.wait(timeout=120)
    result["sigterm"]["exit_code"] = exit_code
    result["rss_check"] = rss_check(load.rss)
    plot = RESULTS / f"{time.strftime('%Y-%m-%d')}-soak-{args.model}.png"
    plot_rss(load.rss, plot)
    report(result)
    save(
        "soak",
        {
            "model": args.model,
            "dtype": args.dtype,
            "server_args": args.server_args,
            "workload": f"{args.clients} streaming clients for {args.minutes} min, then "
            f"{args.overload_clients} for {args.overload_minutes} min, {args.max_tokens} "
            "max tokens per request, a new prompt each time; openai client, no retries",
            "plot": plot.name,
            **result,
            "rss_mib": [(round(t, 1), round(m, 1), p) for t, m, p in load.rss],
        },
    )


async def soak(url: str, pid: int, args: argparse.Namespace) -> tuple[dict, Load]:
    load = Load(url, pid, args)
    sampler = asyncio.create_task(load.sample_rss())
    await load.one(Phase("warm-up"), args.max_tokens)  # the first request pays for cold caches
    unloaded = await load.run(Phase("unloaded"), 1, args.unloaded_s)
    soaked = await load.run(Phase("soak"), args.clients, args.minutes * 60)
    overload = await load.run(Phase("overload"), args.overload_clients, args.overload_minutes * 60)
    stopped = await load.sigterm(pid, args.clients, after_s=5)
    await sampler
    result = {p.name: p.summary() for p in (unloaded, soaked, overload, stopped)}
    base = percentile(unloaded.ttft, 99)
    if overload.ttft:
        result["overload"]["ttft_p99_vs_unloaded"] = percentile(overload.ttft, 99) / base
        result["overload"]["ttft_p99_vs_soak"] = percentile(overload.ttft, 99) / percentile(
            soaked.ttft, 99
        )
    return result, load


def rss_check(rss: list[tuple[float, float, str]]) -> dict[str, float]:
    """Mean RSS of the soak's second minute and of its last minute (the issue's check: within
    10%), and the peak under overload."""
    soak = [(t, m) for t, m, p in rss if p == "soak"]
    t0, t1 = soak[0][0], soak[-1][0]
    second = [m for t, m in soak if 60 <= t - t0 < 120]
    last = [m for t, m in soak if t > t1 - 60]
    out = {"overload_peak_mib": max((m for _, m, p in rss if p == "overload"), default=0.0)}
    if second and t1 - t0 >= 180:  # otherwise the two minutes overlap or do not exist
        out |= {
            "second_minute_mib": statistics.mean(second),
            "last_minute_mib": statistics.mean(last),
            "last_over_second": statistics.mean(last) / statistics.mean(second),
        }
    return out


def plot_rss(rss: list[tuple[float, float, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for phase in dict.fromkeys(p for *_, p in rss):
        points = [(t / 60, m) for t, m, p in rss if p == phase]
        ax.plot(*zip(*points), label=phase)
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(result: dict) -> None:
    for name in ("unloaded", "soak", "overload", "sigterm"):
        r = result[name]
        ttft = r.get("ttft_s", {})
        print(
            f"{name:9s} requests {r['requests']:5d}  failures {r['failures']:3d}  "
            f"client CPU {r['client_cpu_s'] / max(r['wall_s'], 1e-9):4.0%}  "
            f"TTFT p50 {ttft.get('p50', 0) * 1000:7.0f} ms  p99 {ttft.get('p99', 0) * 1000:7.0f}"
            f" ms  rejected {r.get('rejected', {})}  ended {r.get('ended', {})}"
        )
    c = result["rss_check"]
    if "last_over_second" in c:
        print(
            f"RSS: second minute {c['second_minute_mib']:.0f} MiB, last minute "
            f"{c['last_minute_mib']:.0f} MiB ({c['last_over_second']:.3f}x)"
        )
    print(
        f"RSS peak under overload {c['overload_peak_mib']:.0f} MiB; exit code after SIGTERM "
        f"{result['sigterm']['exit_code']}"
    )


if __name__ == "__main__":
    main()
