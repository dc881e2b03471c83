"""The transport ceiling's wait for the receiver's copies: it ends with all of them, or with a stall."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from bench import ceilings
from bench.harness import free_port


@pytest.fixture
async def receiver() -> AsyncIterator[Callable[[int, int], Awaitable[str]]]:
    """A loopback stand-in for the bare receiver's ``/consumed``: its count grows by ``step`` a
    call up to ``stop``, and then stays there."""
    runners: list[web.AppRunner] = []

    async def start(stop: int, step: int) -> str:
        state = {"consumed": 0}

        async def consumed(_: web.Request) -> web.Response:
            state["consumed"] = min(stop, state["consumed"] + step)
            return web.json_response({"consumed": state["consumed"]})

        app = web.Application()
        app.router.add_get("/consumed", consumed)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_the_wait_ends_once_every_copy_is_in(receiver: Callable[[int, int], Awaitable[str]]) -> None:
    base = await receiver(500, 100)
    assert await ceilings._copies_received(base, 500) == 500


async def test_a_receiver_that_stops_getting_copies_ends_the_wait_with_what_it_got(
    receiver: Callable[[int, int], Awaitable[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ceilings, "_STALLED_SECONDS", 0.3)
    base = await receiver(300, 100)
    started = time.monotonic()
    assert await ceilings._copies_received(base, 500) == 300
    assert time.monotonic() - started < 5, "the wait did not end at the stall"
