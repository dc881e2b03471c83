"""The benchmark's load generator: what it measures must be the server's time, not its own."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from bench.harness import free_port, post_all


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback endpoint that answers 200, or drops the connection for a body of ``b"drop"``.

    For ``b"slow"`` it answers after 20 ms (16 connections then carry at most 800 a second, so a
    faster open-loop sender falls behind its schedule). For ``b"count"`` it notes how many
    finished tasks the process still holds (after a full collection: what every later full pass
    would have to scan); it lets the loop run for 50 ms first, since a task that has just finished
    is let go by a callback of the loop's next turn."""
    held: list[int] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if body == b"drop":
            assert request.transport is not None
            request.transport.close()
        if body == b"slow":
            await asyncio.sleep(0.02)  # wait-ok: a slow server is what this endpoint stands for
        if body == b"count":
            await asyncio.sleep(0.05)  # wait-ok: the turns in which just-finished tasks are let go
            gc.collect()
            held.append(sum(1 for o in gc.get_objects() if isinstance(o, asyncio.Task) and o.done()))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/", held
    finally:
        await runner.cleanup()


async def test_open_loop_lets_each_request_go_once_answered(server: tuple[str, list[int]]) -> None:
    url, held = server
    result = await post_all(url, [b"{}"] * 1_500 + [b"count"] * 5, concurrency=16, max_seconds=60, rate=3_000)
    assert result.statuses == {200: 1_505}
    assert len(held) == 5
    # A run that kept every finished task would hold about 1,500 of them by its end.
    assert max(held) < 100, held
    assert gc.get_freeze_count() == 0  # nothing left frozen afterwards


async def test_open_loop_lets_go_of_a_backlog_it_fell_behind_on(server: tuple[str, list[int]]) -> None:
    """A sender behind its schedule has most of the run still queued when the last request is
    sent; each of those must be let go once answered too, not kept until the run's end."""
    url, held = server
    result = await post_all(
        url, [b"slow"] * 1_200 + [b"count"] * 5, concurrency=16, max_seconds=60, rate=3_000
    )
    assert result.statuses == {200: 1_205}
    # The schedule took 0.4 s; 1,200 slow answers take at least 1.5 s: a backlog did form.
    assert result.seconds > 1.2, result.seconds
    assert len(held) == 5
    assert max(held) < 100, held


async def test_open_loop_still_reports_a_failed_request(server: tuple[str, list[int]]) -> None:
    url, _ = server
    with pytest.raises(Exception):  # noqa: B017, PT011 - aiohttp's own error for a dropped connection
        await post_all(
            url, [b"{}"] * 50 + [b"drop"] + [b"{}"] * 50, concurrency=8, max_seconds=30, rate=2_000
        )
    assert gc.get_freeze_count() == 0
