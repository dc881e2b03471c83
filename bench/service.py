"""The service under load: its processes on their own schema, Redis prefix and queues; the publisher; the traces."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import orjson

from bench.events import unique_event
from bench.harness import (
    DATABASE_URL,
    RABBITMQ_URL,
    Isolation,
    cli,
    free_port,
    post_all,
    process,
    wait_http,
)
from bench.measure import Traced, percentile, status_mb
from evolution_ingest.config import Settings
from evolution_ingest.core.identity import EVENT_NAMES, parse_envelope
from evolution_ingest.stores.queues import QueueReads

EVENTS = sorted(
    {
        "messages.upsert",
        "send.message",
        "messages.update",
        "messages.delete",
        "messages.set",
        "connection.update",
        "qrcode.updated",
        "contacts.upsert",
        "presence.update",
        "groups.upsert",
        "group-participants.update",
        "call",
    }
)
assert set(EVENTS) <= set(EVENT_NAMES.values())


# --- the service ---------------------------------------------------------------------------


@dataclass
class Running:
    urls: list[str]
    pids: list[int]
    iso: Isolation

    def rss(self) -> str:
        return " + ".join(f"{status_mb(pid, 'VmHWM'):.0f}" for pid in self.pids)


def service_env(iso: Isolation, **extra: str) -> dict[str, str]:
    env = iso.env(
        HANDLERS="bench.handlers:trace",
        RABBITMQ_EXCHANGE=f"bench-{iso.run_id}",
        RABBITMQ_PREFIX=f"bench{iso.run_id}",
        RABBITMQ_SERVICE_PREFIX=f"bench-{iso.run_id}",
        RABBITMQ_EVENTS=",".join(EVENTS),
        RECONCILE_INTERVAL_SECONDS="30",
        **extra,
    )
    env["BENCH_TRACE_DIR"] = str(iso.trace_dir)
    env["PYTHONPATH"] = str(Path(__file__).parent.parent)
    return env


@asynccontextmanager
async def running(
    iso: Isolation,
    layout: str,
    replicas: int = 1,
    *,
    warm: bool = True,
    settings: Mapping[str, str] | None = None,
) -> AsyncIterator[Running]:
    """``up`` (one process) or ``split`` (serve, worker and reconcile apart), ``replicas`` of each;
    ``settings``: more service settings (``{"RETENTION_ENABLED": "false"}``)."""
    settings = settings or {}
    ports = [free_port() for _ in range(replicas)]
    async with AsyncExitStack() as stack:
        procs = []
        if layout == "up":
            procs.append(
                await stack.enter_async_context(
                    process(cli("up"), service_env(iso, PORT=str(ports[0]), **settings), "up")
                )
            )
        else:
            migrate = await asyncio.create_subprocess_exec(
                *cli("migrate"), env=service_env(iso), stderr=subprocess.DEVNULL
            )
            await migrate.wait()
            for port in ports:
                url = f"http://127.0.0.1:{port}/api/internal/webhook"
                env = service_env(iso, PORT=str(port), FORWARD_URL=url, **settings)
                for command in ("serve", "worker", "reconcile"):
                    procs.append(await stack.enter_async_context(process(cli(command), env, command)))
        for port in ports:
            await wait_http(f"http://127.0.0.1:{port}/healthz")
        await wait_consumers(iso, replicas)
        urls = [f"http://127.0.0.1:{p}/api/internal/webhook" for p in ports]
        if warm:
            await warm_up(iso, urls)
        yield Running(urls, [p.pid for p in procs], iso)


async def warm_up(iso: Isolation, urls: list[str], count: int = 400) -> None:
    """Open connections and fill caches with events of their own, then forget their traces."""
    bodies = [orjson.dumps(unique_event(10**9 + n, "warm-up")[0]) for n in range(count)]
    await post_all(urls, bodies, 64, 60)
    await wait_traced(iso, count, 30)
    for path in iso.trace_dir.glob("trace-*.txt"):
        path.write_text("", encoding="ascii")


async def wait_consumers(iso: Isolation, expected: int, within: float = 60) -> None:
    """Wait until the worker(s) consume every queue (a restart of the broker is not expected here)."""
    deadline = time.monotonic() + within
    connection = await aio_pika.connect(RABBITMQ_URL)
    async with connection:
        while time.monotonic() < deadline:
            channel = await connection.channel()
            try:
                counts = [
                    (
                        await channel.declare_queue(f"bench{iso.run_id}.{e}", passive=True)
                    ).declaration_result.consumer_count
                    for e in EVENTS
                ]
                if all((c or 0) >= expected for c in counts):
                    return
            except aio_pika.exceptions.ChannelClosed:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError("the worker did not start consuming")


@asynccontextmanager
async def publisher(iso: Isolation, start: int, count: int, rate: float = 0.0) -> AsyncIterator[Any]:
    """A publisher process, ready (messages prepared); ``await go()`` publishes and returns the send times."""
    times = iso.trace_dir / f"published-{start}.txt"
    args = [RABBITMQ_URL, f"bench-{iso.run_id}", f"bench{iso.run_id}", str(start), str(count), str(times)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.publisher", *args, "--rate", str(rate), env=service_env(iso),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None
    assert proc.stdout is not None
    ready = (await asyncio.wait_for(proc.stdout.readline(), 300)).split()
    assert ready[0] == b"ready"
    preparing = float(ready[1])

    async def go() -> Path:
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        await asyncio.wait_for(proc.wait(), 600)
        return times

    go.preparing_cpu = preparing  # type: ignore[attr-defined]  # the CPU spent preparing, read by the caller
    try:
        yield go
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def publish(iso: Isolation, start: int, count: int) -> Path:
    async with publisher(iso, start, count) as go:
        return await go()  # type: ignore[no-any-return]  # go returns the trace path


def read_times(path: Path, keys: Sequence[str]) -> dict[str, float]:
    sent = {}
    for line in path.read_text(encoding="ascii").splitlines():
        index, _, at = line.partition(" ")
        sent[keys[int(index)]] = float(at)
    return sent


async def wait_traced(iso: Isolation, expected: int, within: float) -> None:
    deadline = time.monotonic() + within
    while iso.traced() < expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # late doubles would show up here


def workload(start: int, count: int) -> tuple[list[bytes], list[str]]:
    bodies, keys = [], []
    for n in range(start, start + count):
        webhook, _, _ = unique_event(n)
        bodies.append(orjson.dumps(webhook))
        keys.append(parse_envelope(webhook).dedup_key)
    return bodies, keys


def e2e(traced: Traced, sent: dict[str, float]) -> tuple[float, float]:
    values = traced.latencies_ms(sent)
    return percentile(values, 50), percentile(values, 99)


async def where_lost(iso: Isolation, keys: Sequence[str], bodies: Sequence[bytes], traced: Traced) -> str:
    """Where the events the trace never saw are: their event, their inbox row, the queues' depths.

    Nothing may be lost; when the count says otherwise, this is what tells a loss in the service
    (a row saved and never processed, a message parked or left unsettled) from a publish the
    broker never took (no row at all: the publisher, like Evolution, sends without confirms).
    """
    missing = [(key, body) for key, body in zip(keys, bodies, strict=True) if key not in traced.runs]
    if not missing:
        return ""
    conn = await asyncpg.connect(DATABASE_URL, server_settings={"search_path": iso.schema})
    try:
        rows = {
            r["dedup_key"]: dict(r)
            for r in await conn.fetch(
                "SELECT dedup_key, channel, received_at, processed_at, attempts, last_error, claimed_until, "
                "failed_at FROM evolution_ingest_inbox WHERE dedup_key = ANY($1)",
                [key for key, _ in missing],
            )
        }
    finally:
        await conn.close()
    env = service_env(iso)
    settings = Settings.from_env(**{
        name.removeprefix("EVOLUTION_INGEST_").lower(): value for name, value in env.items()
        if name.startswith("EVOLUTION_INGEST_") and name != "EVOLUTION_INGEST_HANDLERS"
    })  # fmt: skip
    reads = QueueReads(settings)
    try:
        queues = await reads.status()
    finally:
        await reads.close()
    busy = {name: state for name, state in _flat_queues(queues).items() if state.get("messages")}
    found = "; ".join(
        f"{orjson.loads(body)['event']} {key[:12]}: "
        + (f"row {rows[key]}" if key in rows else "no row (never received by either channel)")
        for key, body in missing[:5]
    )
    return f"{len(missing)} lost: {found}; queues holding messages: {busy or 'none'}."


def _flat_queues(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    flat: dict[str, dict[str, Any]] = {}
    for key in ("retry_tiers", "evolution_queues"):
        flat.update(status.get(key, {}))
    for key in ("lock_busy", "ready", "parking"):
        flat[key] = status.get(key, {})
    return flat
