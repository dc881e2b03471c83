"""Running components (webhook app, worker, reconciler) together and stopping them cleanly.

A component is ``async def run(stop: asyncio.Event) -> None``: it works until
``stop`` is set, then finishes what it has in flight and returns. SIGTERM and
SIGINT set ``stop``; a second signal cancels what is still running. If a
component ends on its own (it crashed, or its server could not start), the
others are stopped too and the exit status is 1, so that a supervisor (systemd,
Kubernetes) restarts the whole service instead of running it half.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import structlog
import uvicorn
from starlette.types import ASGIApp

from evolution_ingest.config import Settings

log = structlog.get_logger(__name__)

Component = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


async def run_components(components: Mapping[str, Component], *, grace_seconds: float = 60.0) -> int:
    """Run until a signal or a failure; return the process exit status."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    tasks: dict[asyncio.Task[None], str] = {
        asyncio.create_task(component(stop), name=name): name for name, component in components.items()
    }

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second signal: cancelling what is still running", signal=sig.name)
            for task in tasks:
                task.cancel()
        else:
            log.info("stopping", signal=sig.name)
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    failed = False
    try:
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        done = {task for task in tasks if task.done()}
        for task in done:
            failed |= _ended_badly(task, tasks[task], stop)
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=grace_seconds)
        for task in pending:
            log.error("component did not stop in time; cancelling it", component=tasks[task])
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for task, name in tasks.items():
            if task not in done:
                failed |= _ended_badly(task, name, stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 1 if failed else 0


def _ended_badly(task: asyncio.Task[None], name: str, stop: asyncio.Event) -> bool:
    if task.cancelled():
        return True
    exc = task.exception()
    if exc is not None:
        log.error("component failed", component=name, exc_info=exc)
        return True
    if not stop.is_set():
        log.error("component stopped on its own", component=name)
        return True
    return False


def webhook_component(app: ASGIApp, settings: Settings) -> Component:
    """The webhook app under uvicorn, stopped (gracefully) when ``stop`` is set."""

    async def run(stop: asyncio.Event) -> None:
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            http="httptools",
            lifespan="off",
            access_log=False,
            log_config=None,
            proxy_headers=False,
            server_header=False,
            date_header=False,
            timeout_graceful_shutdown=int(settings.shutdown_timeout_seconds),
        )
        server = uvicorn.Server(config)
        # Signals belong to run_components; uvicorn would re-raise them after its shutdown.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # replacing uvicorn's signal capture is the point
        serving = asyncio.create_task(_serve(server))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        stopping.cancel()
        await serving
        log.info("webhook app stopped")

    return run


async def _serve(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn exits the process when it cannot bind; make it a failure
        raise RuntimeError("the webhook app could not start (see the error above)") from exc
    if not server.started:
        raise RuntimeError("the webhook app could not start (see the error above)")
