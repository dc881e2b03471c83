"""Helpers shared by the tests: Evolution fixtures, a recording handler, a live server, waiting."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from functools import cache
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from evolution_ingest.core.events import Event
from evolution_ingest.core.redaction import Redactor

FIXTURES = Path(__file__).parent.parent / "fixtures" / "evolution_events.json"
#: Evolution 2.4 forms: ``extra`` spread first, ``messaging-history.set``, X-Instance-* webhook headers.
FIXTURES_2_4 = FIXTURES.with_name("evolution_2_4_events.json")


@cache
def _load() -> tuple[dict[str, Any], ...]:
    return tuple(json.loads(FIXTURES.read_text(encoding="utf-8")))


def fixtures() -> list[dict[str, Any]]:
    """The 20 Evolution events, each with its webhook and RabbitMQ form (deep copies)."""
    return copy.deepcopy(list(_load()))


def fixtures_2_4() -> list[dict[str, Any]]:
    return copy.deepcopy(json.loads(FIXTURES_2_4.read_text(encoding="utf-8")))


def fixture(name: str) -> dict[str, Any]:
    for item in fixtures():
        if item["name"] == name:
            return item
    raise KeyError(name)


def variants(count: int, *, start: int = 0) -> list[dict[str, Any]]:
    """``count`` distinct events made from the fixtures: the same change on both forms of each,
    so that each variant is one new emission with equal identity on both channels."""
    items = fixtures()
    made = []
    for number in range(start, start + count):
        item = copy.deepcopy(items[number % len(items)])
        for form in ("webhook_body", "rabbitmq_body"):
            body = item[form]
            body["date_time"] = f"2026-02-01T10:00:00.{number:06d}Z"
            if isinstance(body["data"], dict):
                body["data"]["variant"] = number
                if isinstance(body["data"].get("key"), dict):  # a message is its id and content
                    body["data"]["key"]["id"] = f"{body['data']['key']['id']}-{number}"
            else:
                body["data"] = [*body["data"], {"variant": number}]
        item["name"] = f"{item['name']}#{number}"
        made.append(item)
    return made


def webhook_suffix(event: str) -> str:
    """The path suffix Evolution appends with "webhook by events" on (its own rule:
    dots and underscores become dashes): ``group-participants.update`` -> ``group-participants-update``."""
    return event.replace(".", "-").replace("_", "-").lower()


def stored_form(body: dict[str, Any]) -> dict[str, Any]:
    """A body as the inbox keeps it by default: its ``apikey`` redacted (see evolution_ingest.redaction)."""
    return Redactor().body(body)


def fixture_names() -> list[str]:
    return [item["name"] for item in _load()]


class Recorder:
    """A business-logic handler that records each call; it can be slow or fail on purpose."""

    def __init__(self, *, delay: float = 0.0, failures: int = 0) -> None:
        self.calls: Counter[str] = Counter()
        self.events: list[Event] = []
        self.delay = delay
        self.failures = failures
        self.started = asyncio.Event()
        self.changed = asyncio.Event()

    async def __call__(self, event: Event) -> None:
        self.started.set()
        if self.delay:
            await asyncio.sleep(self.delay)  # wait-ok: a deliberately slow handler
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError(f"handler failure on purpose ({self.failures} more)")
        self.calls[event.dedup_key] += 1
        self.events.append(event)
        self.changed.set()

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def doubled(self) -> list[str]:
        return [key for key, count in self.calls.items() if count > 1]


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]], within: float = 10.0, interval: float = 0.02
) -> bool:
    """Poll ``condition`` until true (True) or until ``within`` seconds passed (False)."""
    deadline = time.monotonic() + within
    while True:
        value = condition()
        if not isinstance(value, bool):
            value = await value
        if value:
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)  # wait-ok: the poll interval of a bounded wait


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]],
    within: float = 10.0,
    interval: float = 0.02,
    message: str = "condition",
) -> None:
    """Poll ``condition`` until true; fail the test after ``within`` seconds."""
    if not await eventually(condition, within, interval):
        raise AssertionError(f"timed out after {within}s waiting for {message}")


def plan_nodes(explained: str) -> Iterator[dict[str, Any]]:
    """Every node of an ``EXPLAIN (FORMAT JSON)`` plan, the top one first."""
    waiting = [json.loads(explained)[0]["Plan"]]
    while waiting:
        node = waiting.pop()
        yield node
        waiting.extend(reversed(node.get("Plans", [])))


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def dead_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    sock = free_socket()
    port: int = sock.getsockname()[1]
    sock.close()
    return port


@asynccontextmanager
async def running_server(app: ASGIApp) -> AsyncIterator[str]:
    """Serve ``app`` over real HTTP on an ephemeral loopback port; yield its base URL."""
    sock = free_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, http="httptools")
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]  # signals belong to pytest
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_until(lambda: server.started or task.done(), message="the server to start")
        if task.done():
            task.result()
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)
        sock.close()
