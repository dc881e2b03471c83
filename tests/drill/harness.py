"""The fault drill's pieces: the service as separate processes, Evolution as a sender, the count."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import orjson
from bench.events import unique_event

from evolution_ingest.config import Settings
from evolution_ingest.core.identity import parse_envelope
from tests.conftest import RABBITMQ_URL
from tests.support import eventually, free_socket, wait_until
from tests.support.evolution import consumer_count
from tests.test_cli import env_for, healthy

#: Evolution's webhook retry, shortened: 5 s, 10 s, 20 s ... become 0.2 s, 0.5 s, 1 s ...
WEBHOOK_RETRY_DELAYS = (0.2, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0)
#: Statuses Evolution does not retry.
FINAL = {400, 401, 403, 404, 422}


class Deployment:
    """``serve``, ``worker`` and ``reconcile`` as separate processes, each one killable and restartable."""

    def __init__(self, settings: Settings, trace_dir: Path, **extra: str) -> None:
        sock = free_socket()
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}/api/internal/webhook"
        self.settings = settings
        drill = {k: v for k, v in extra.items() if k.startswith("DRILL_")}  # the handler's, not settings
        service = {k: v for k, v in extra.items() if not k.startswith("DRILL_")}
        self.env = env_for(settings, PORT=str(self.port), FORWARD_URL=self.url, **service)
        self.env.update(drill)
        self.env["DRILL_TRACE_DIR"] = str(trace_dir)
        self.env["PYTHONPATH"] = os.getcwd()
        self.env["EVOLUTION_INGEST_LOG_LEVEL"] = os.environ.get("DRILL_LOG_LEVEL", "WARNING")
        self.env["EVOLUTION_INGEST_LOG_FORMAT"] = "json"
        self.trace_dir = trace_dir
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.starts = 0

    async def start(self, component: str) -> None:
        """Start ``component``; its log goes to ``log-<component>-<n>.jsonl`` beside the traces."""
        self.starts += 1
        log_path = self.trace_dir / f"log-{component}-{self.port}-{self.starts}.jsonl"
        with log_path.open("wb") as log_file:  # the child keeps its own descriptor
            self.procs[component] = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "evolution_ingest",
                component,
                env=self.env,
                stderr=log_file,
            )
        if component == "serve":
            async with aiohttp.ClientSession() as http:
                await wait_until(lambda: healthy(http, self.port), within=30, message="the webhook app")
        if component == "worker":
            queue = f"{self.settings.rabbitmq_prefix}.messages.upsert"
            await wait_until(lambda: _consumed(queue), within=30, message="the worker to consume")

    def kill(self, component: str) -> None:
        self.procs[component].send_signal(signal.SIGKILL)

    async def restart(self, component: str) -> None:
        await self.procs[component].wait()
        await self.start(component)

    async def stop(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _consumed(queue: str) -> bool:
    return await consumer_count(RABBITMQ_URL, queue) >= 1


@asynccontextmanager
async def deployed(settings: Settings, trace_dir: Path, **extra: str) -> AsyncIterator[Deployment]:
    async with replicas(settings, trace_dir, 1, **extra) as (deployment,):
        yield deployment


@asynccontextmanager
async def replicas(
    settings: Settings, trace_dir: Path, count: int, **extra: str
) -> AsyncIterator[list[Deployment]]:
    """``count`` replicas of each component on the same stores, each worker forwarding to its webhook app."""
    deployments = [Deployment(settings, trace_dir, **extra) for _ in range(count)]
    try:
        for deployment in deployments:
            for component in ("serve", "worker", "reconcile"):
                await deployment.start(component)
        yield deployments
    finally:
        for deployment in deployments:
            await deployment.stop()


@dataclass
class Evolution:
    """Sends each event as Evolution does: a webhook retried on failure, and a RabbitMQ publish
    that is dropped when the broker cannot be reached (Evolution's publisher drops while disconnected)."""

    #: One URL, or several used in turn (a load balancer in front of replicas).
    webhook_url: str | list[str]
    rabbitmq_url: str
    exchange: str
    prefix: str
    webhook_timeout: float = 10.0
    http: aiohttp.ClientSession | None = None
    connection: Any = None
    channel: Any = None
    declared: set[str] = field(default_factory=set)
    dropped_publishes: int = 0
    webhook_gave_up: int = 0
    webhook_retries: int = 0
    #: DATABASE_SAVE_DATA_NEW_MESSAGE: each message sent is also stored here (then only messages are sent).
    store: Callable[[dict[str, Any]], Any] | None = None
    #: Both channels down for the instance: nothing reaches the service (a message is still stored).
    down: bool = False
    missed: int = 0

    async def __aenter__(self) -> Evolution:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.webhook_timeout))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.http is not None
        await self.http.close()
        if self.connection is not None:
            with contextlib.suppress(Exception):
                await self.connection.close()

    async def send(self, n: int) -> str:
        webhook, rabbit, event = (
            unique_event(n, "drill") if self.store is None else unique_message(n, "drill")
        )
        if self.store is not None:
            self.store(webhook["data"])
        if self.down:
            self.missed += 1
            return parse_envelope(webhook).dedup_key
        urls = [self.webhook_url] if isinstance(self.webhook_url, str) else self.webhook_url
        await asyncio.gather(self._webhook(webhook, urls[n % len(urls)]), self._publish(rabbit, event))
        return parse_envelope(webhook).dedup_key

    async def _webhook(self, body: dict[str, Any], url: str) -> None:
        assert self.http is not None
        data = orjson.dumps(body)
        for attempt, delay in enumerate((0.0, *WEBHOOK_RETRY_DELAYS)):
            await asyncio.sleep(delay)  # wait-ok: Evolution's own pause between retries
            if attempt:
                self.webhook_retries += 1
            try:
                async with self.http.post(url, data=data) as resp:
                    await resp.read()
                    if resp.status < 300 or resp.status in FINAL:
                        return
            except (aiohttp.ClientError, TimeoutError):
                continue
        self.webhook_gave_up += 1

    async def _publish(self, body: dict[str, Any], event: str) -> None:
        try:
            if self.channel is None or self.channel.is_closed:
                self.connection = await aio_pika.connect(self.rabbitmq_url, timeout=1)
                self.channel = await self.connection.channel(publisher_confirms=False)
                self.declared.clear()
            exchange = await self.channel.declare_exchange(
                self.exchange, aio_pika.ExchangeType.TOPIC, durable=True
            )
            if event not in self.declared:
                queue = await self.channel.declare_queue(
                    f"{self.prefix}.{event}", durable=True, arguments={"x-queue-type": "quorum"}
                )
                await queue.bind(exchange, routing_key=event)
                self.declared.add(event)
            await exchange.publish(aio_pika.Message(body=orjson.dumps(body)), routing_key=event)
        except (aio_pika.exceptions.AMQPException, OSError, TimeoutError, RuntimeError):
            self.dropped_publishes += 1
            self.channel = None


def unique_message(n: int, instance: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The ``n``-th unique incoming message, sent now (so that a backfill window holds it)."""
    webhook, _, event = unique_event(0, instance)  # the first fixture: an incoming text message
    webhook = copy.deepcopy(webhook)
    webhook["data"]["key"]["id"] = f"DRILL{n:027d}"
    webhook["data"]["messageTimestamp"] = int(time.time())
    return webhook, {k: v for k, v in webhook.items() if k != "destination"}, event


@dataclass
class Count:
    sent: int
    completed: dict[str, int]
    keys: list[str]
    #: Everything came to rest: nothing was left that could run an event again.
    settled: bool = True

    @property
    def lost(self) -> int:
        return sum(1 for key in self.keys if key not in self.completed)

    @property
    def doubled(self) -> int:
        return sum(1 for key in self.keys if self.completed.get(key, 0) > 1)


def _traces(trace_dir: Path) -> Iterator[tuple[int, str, str]]:
    """(pid, what, dedup key) of every trace line: ``start``, ``done`` or ``fail``."""
    for path in trace_dir.glob("trace-*.txt"):
        pid = int(path.stem.removeprefix("trace-"))
        for line in path.read_text(encoding="ascii").splitlines():
            what, key, _ = line.split(" ", 2)
            yield pid, what, key


def completions(trace_dir: Path) -> dict[str, int]:
    """How many times the business logic of each event completed."""
    counted: dict[str, int] = {}
    for _, what, key in _traces(trace_dir):
        if what == "done":
            counted[key] = counted.get(key, 0) + 1
    return counted


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def in_flight(trace_dir: Path) -> int:
    """Runs of the business logic started and not ended, in processes still alive."""
    open_runs: dict[tuple[int, str], int] = {}
    for pid, what, key in _traces(trace_dir):
        open_runs[pid, key] = open_runs.get((pid, key), 0) + (1 if what == "start" else -1)
    return sum(runs for (pid, _), runs in open_runs.items() if runs > 0 and _alive(pid))


async def send_all(evolution: Evolution, start: int, count: int, rate: float) -> list[str]:
    """``count`` events, ``rate`` per second, each sent concurrently on both channels."""
    began = time.monotonic()
    tasks = []
    for i in range(count):
        delay = began + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # wait-ok: pacing the load so that faults land mid-stream
        tasks.append(asyncio.create_task(evolution.send(start + i)))
    return list(await asyncio.gather(*tasks))


async def settle(
    trace_dir: Path, keys: list[str], within: float, quiet: Callable[[], Awaitable[bool]]
) -> Count:
    """Wait until every event completed and nothing is left that could run one again — no run of
    the logic in flight, and ``quiet``: no unprocessed row, no message in a queue. A double would
    have completed by then. Not reached within ``within``: the count says how many are lost."""
    wanted = set(keys)

    async def at_rest() -> bool:
        return wanted <= completions(trace_dir).keys() and in_flight(trace_dir) == 0 and await quiet()

    settled = await eventually(at_rest, within=within, interval=0.2)
    return Count(len(keys), completions(trace_dir), keys, settled)
