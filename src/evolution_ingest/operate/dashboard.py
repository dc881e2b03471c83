"""The operator's endpoints of the webhook app: ``/metrics``, ``/readyz`` and ``/dashboard``.

``/dashboard`` is off unless ``EVOLUTION_INGEST_DASHBOARD_TOKEN`` is set; it then asks for
that token as the password of HTTP basic auth (any user name), or as a Bearer token.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import time
from importlib import resources
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Route

from evolution_ingest.config import Settings
from evolution_ingest.core import codec
from evolution_ingest.operate.cached import Cached
from evolution_ingest.operate.coverage import CHANNELS, coverage, raised_gaps
from evolution_ingest.operate.errors import STORE_ERRORS
from evolution_ingest.operate.metrics import Metrics
from evolution_ingest.operate.readiness import Readiness
from evolution_ingest.operate.views import (
    backfill_section,
    counter_section,
    inspect,
    instances_section,
    refusal_section,
)
from evolution_ingest.stores import Stores


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        codec.dumps(payload, default=str, indent=True),
        status,
        headers,
        media_type="application/json",
    )


class DashboardAuth:
    """The token as a basic-auth password (any user) or a Bearer token, compared in constant time."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def allows(self, request: Request) -> bool:
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        given = b""
        if scheme.lower() == "bearer":
            given = credentials.strip().encode()
        elif scheme.lower() == "basic":
            try:
                given = base64.b64decode(credentials.strip(), validate=True).partition(b":")[2]
            except (binascii.Error, ValueError):
                return False
        return bool(given) and hmac.compare_digest(given, self._token)


_CHALLENGE: Final = {"WWW-Authenticate": 'Basic realm="evolution-ingest dashboard", charset="UTF-8"'}


class Operator:
    """What the endpoints read: the process's stores, through short caches."""

    def __init__(self, stores: Stores, settings: Settings) -> None:
        self._stores = stores
        self._counters = stores.counters
        self._settings = settings
        self.metrics = Metrics(stores, settings)
        self.readiness = Readiness(stores, settings)
        self._auth = (
            DashboardAuth(settings.dashboard_token.get_secret_value()) if settings.dashboard_token else None
        )
        self._data = Cached(self._read_dashboard, settings.metrics_cache_seconds)

    def endpoints(self) -> list[BaseRoute]:
        return [
            Route("/metrics", self.get_metrics, methods=["GET"]),
            Route("/readyz", self.get_readyz, methods=["GET"]),
            Route("/dashboard", self.get_dashboard, methods=["GET"]),
            Route("/dashboard/data", self.get_dashboard_data, methods=["GET"]),
            Route("/dashboard/events/{ref}", self.get_event, methods=["GET"]),
            Route("/dashboard/refusals/{refusal_id:int}", self.get_refusal, methods=["GET"]),
        ]

    async def get_metrics(self, _: Request) -> Response:
        body, content_type = await self.metrics.exposition()
        return Response(body, headers={"content-type": content_type})

    async def get_readyz(self, _: Request) -> Response:
        report = await self.readiness.report()
        return _json(report, 200 if report["ready"] else 503)

    def _refusal(self, request: Request) -> Response | None:
        if self._auth is None:
            return _json({"error": "the dashboard is off; set EVOLUTION_INGEST_DASHBOARD_TOKEN"}, 404)
        if not self._auth.allows(request):
            return _json({"error": "the dashboard token is required"}, 401, _CHALLENGE)
        return None

    async def get_dashboard(self, request: Request) -> Response:
        if refusal := self._refusal(request):
            return refusal
        page = (
            resources.files("evolution_ingest.operate").joinpath("dashboard.html").read_text(encoding="utf-8")
        )
        return HTMLResponse(page, headers={"cache-control": "no-store"})

    async def get_dashboard_data(self, request: Request) -> Response:
        if refusal := self._refusal(request):
            return refusal
        return _json(await self._data.get(), headers={"cache-control": "no-store"})

    async def get_event(self, request: Request) -> Response:
        if refusal := self._refusal(request):
            return refusal
        try:
            return _json(await inspect(self._stores, request.path_params["ref"]))
        except LookupError as exc:
            return _json({"error": str(exc)}, 404)
        except ValueError as exc:
            return _json({"error": str(exc)}, 400)

    async def get_refusal(self, request: Request) -> Response:
        if refusal := self._refusal(request):
            return refusal
        found = await self._stores.refusals.get(request.path_params["refusal_id"])
        if found is None:
            return _json({"error": "no such refusal (kept ones only)"}, 404)
        return _json(found)

    async def _read_dashboard(self) -> dict[str, Any]:
        data: dict[str, Any] = {"at": time.time(), "readiness": await self.readiness.report()}
        try:
            data["counters"] = await self._counters.read()
            data["rates"] = {ch: await self._counters.read_rates(ch) for ch in CHANNELS}
            data["gaps"] = await raised_gaps(self._stores.redis, self._settings)
        except STORE_ERRORS as exc:  # shown on the page: it must work when Redis is down
            data["redis_error"] = f"{type(exc).__name__}: {exc}"
        data["coverage"] = await coverage(self._stores, self._settings)
        data["gap_after_seconds"] = self._settings.gap_alert_after_seconds
        data["inbox"], data["rabbitmq"] = await self.metrics.stores()
        data["refusals"] = await refusal_section(self._stores.refusals)
        data["instances"] = await instances_section(self._stores, self._settings)
        data["backfill"] = await backfill_section(
            self._stores, await counter_section(self._stores.counters), self._settings
        )
        try:
            data["failures"] = await self._stores.reads.recent_failures()
        except STORE_ERRORS as exc:  # shown on the page
            data["postgres_error"] = f"{type(exc).__name__}: {exc}"
        return data
