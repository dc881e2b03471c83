"""The built-in business logic: routes from ``EVOLUTION_INGEST_ROUTES_FILE``.

For each event, routes are looked at in file order. Every matching route's
forwards and alert are collected; a matching route with ``drop`` stops the look
(routes after it are not considered). Then each destination gets the event once:
what was delivered (or refused for good) on an earlier try is not sent again.
If a destination failed in a way worth retrying, the router raises, so the
event is retried like any failed business logic (Evolution's retry, the RabbitMQ
tiers, the reconciler) — and only the failed destinations are sent to again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from redis.asyncio import Redis

from evolution_ingest.core.events import Event
from evolution_ingest.logic.alerts import ConnectionMemory, Cooldowns, chat_message, render
from evolution_ingest.logic.courier import Courier
from evolution_ingest.logic.route import Destination, Route
from evolution_ingest.logic.routes_file import RoutesFile
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.deliveries import DeliveryLog, DeliveryResult, DeliveryStatus

log = structlog.get_logger(__name__)


class DeliveryFailed(Exception):
    """Some destinations failed; the event is retried, for those only."""


class Router:
    """A business-logic handler (``await router(event)``) built from a routes file."""

    def __init__(
        self,
        routes: RoutesFile,
        *,
        deliveries: DeliveryLog,
        redis: Redis,
        counters: Counters,
        key_prefix: str,
    ) -> None:
        self._routes = routes
        self._deliveries = deliveries
        self._courier = Courier()
        self._cooldowns = Cooldowns(redis, key_prefix)
        self._connections = ConnectionMemory(redis, key_prefix)
        self._counters = counters
        self._needs_connection_state = any(r.match.was_connected is not None for r in routes.routes)

    @property
    def deliveries(self) -> DeliveryLog:
        return self._deliveries

    async def close(self) -> None:
        await self._courier.close()

    async def __call__(self, event: Event) -> None:
        connected = (
            await self._connections.was_connected(event.instance) if self._needs_connection_state else False
        )
        forwards: list[tuple[str, Route, Destination]] = []
        alerting: list[Route] = []
        for route in self._routes.routes:
            if not route.matches(event, was_connected=lambda: connected):
                continue
            forwards += [(route.destination_key(i), route, d) for i, d in enumerate(route.forward)]
            if route.alert is not None:
                alerting.append(route)
            if route.drop:
                self._counters.incr(f"route:{route.name}:dropped")
                break
        await self._connections.note(event)
        if not forwards and not alerting:
            return
        settled = await self._deliveries.settled(event.id)
        results = await asyncio.gather(
            *(
                self._forward(key, route, destination, event)
                for key, route, destination in forwards
                if key not in settled
            )
        )
        for route in alerting:
            if (outcome := await self._alert(route, event, settled)) is not None:
                results.append(outcome)
        await self._deliveries.record(event.id, results)
        failed = [r for r in results if r.status is DeliveryStatus.FAILED]
        if failed:
            raise DeliveryFailed("; ".join(f"{r.destination}: {r.error}" for r in failed))

    async def _forward(
        self, key: str, route: Route, destination: Destination, event: Event
    ) -> DeliveryResult:
        body: dict[str, Any] = dict(event.payload)
        if not destination.include_apikey:
            body.pop("apikey", None)
        headers = {
            "idempotency-key": event.dedup_key,
            "x-evolution-event": event.event,
            "x-evolution-instance": event.instance,
            **destination.headers,
        }
        result = await self._courier.send(
            key,
            destination.url,
            body,
            method=destination.method,
            headers=headers,
            timeout_seconds=destination.timeout_seconds,
        )
        counter = {
            DeliveryStatus.DELIVERED: "forwarded",
            DeliveryStatus.FAILED: "failed",
            DeliveryStatus.PERMANENT: "permanent",
        }[result.status]
        self._counters.incr(f"route:{route.name}:{counter}")
        if result.status is DeliveryStatus.PERMANENT:
            log.error(
                "destination refused the event for good", route=route.name, destination=key,
                dedup_key=event.dedup_key, error=result.error,
            )  # fmt: skip
        elif result.status is DeliveryStatus.FAILED:
            log.warning(
                "delivery failed; it will be retried", route=route.name, destination=key, error=result.error
            )
        return result

    async def _alert(self, route: Route, event: Event, settled: set[str]) -> DeliveryResult | None:
        alert = route.alert
        assert alert is not None
        key = f"{route.name}!alert"
        if key in settled:
            return None
        if not await self._cooldowns.begin(route.name, event.instance, alert.cooldown_seconds):
            self._counters.incr(f"alert:{route.name}:suppressed")
            return None
        text = render(alert.message, event)
        if "log" in alert.sinks:
            log.warning("alert", route=route.name, instance=event.instance, message=text)
        result = DeliveryResult(key, DeliveryStatus.DELIVERED)
        url = self._routes.alert_url(alert)
        if "webhook" in alert.sinks and url:
            result = await self._courier.send(
                key, url, chat_message(text), timeout_seconds=alert.timeout_seconds
            )
        if result.status is DeliveryStatus.DELIVERED:
            self._counters.incr(f"alert:{route.name}:sent")
        else:
            self._counters.incr(f"alert:{route.name}:failed")
            await self._cooldowns.cancel(route.name, event.instance)
            log.warning("alert not delivered", route=route.name, error=result.error)
        return result
