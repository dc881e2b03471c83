"""Running components together: clean stops, and a failure of one stops all with status 1."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.routing import Route

from evolution_ingest.channels.http import healthz
from evolution_ingest.config import Settings
from evolution_ingest.lifecycle import run_components, webhook_component
from tests.support import free_socket


async def waits_for_stop(stop: asyncio.Event) -> None:
    await stop.wait()


async def test_a_signal_stops_every_component_and_the_status_is_zero() -> None:
    asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
    assert await run_components({"a": waits_for_stop, "b": waits_for_stop}) == 0


async def test_a_failing_component_stops_the_others_and_the_status_is_one() -> None:
    stopped = asyncio.Event()

    async def good(stop: asyncio.Event) -> None:
        await stop.wait()
        stopped.set()

    async def bad(stop: asyncio.Event) -> None:
        raise RuntimeError("boom")

    assert await run_components({"good": good, "bad": bad}) == 1
    assert stopped.is_set()


async def test_a_component_that_returns_on_its_own_is_a_failure() -> None:
    async def quits(stop: asyncio.Event) -> None:
        return None

    assert await run_components({"quits": quits, "stays": waits_for_stop}) == 1


async def test_a_component_ignoring_stop_is_cancelled_after_the_grace_period() -> None:
    async def stubborn(stop: asyncio.Event) -> None:
        await asyncio.Event().wait()

    asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGINT)
    assert await run_components({"stubborn": stubborn}, grace_seconds=0.2) == 1


async def test_a_webhook_app_that_cannot_bind_its_port_fails_instead_of_exiting(
    make_settings: Callable[..., Settings],
) -> None:
    taken = free_socket()
    taken.listen()
    try:
        settings = make_settings(port=taken.getsockname()[1])
        app = Starlette(routes=[Route("/healthz", healthz)])
        assert await run_components({"webhook": webhook_component(app, settings)}) == 1
    finally:
        taken.close()
