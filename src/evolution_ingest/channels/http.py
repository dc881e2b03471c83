"""The HTTP side of the webhook app: the ASGI app, its routes, and its JSON answers.

The webhook route carries all the traffic: :class:`IngestApp` takes it before Starlette's
router and middleware (saving their cost on every event) and hands it to
:class:`~evolution_ingest.channels.webhook.WebhookApp`; anything else (other paths,
other methods, the operator's endpoints) is Starlette's.

Routes (Evolution's "webhook by events" appends ``/<event-suffix>``)::

    POST /api/internal/webhook[/<event-suffix>]
    POST /api/internal/webhook/t/<token>[/<event-suffix>]    (token in the URL)
    GET  /healthz                  (the process is alive)
    GET  /readyz, /metrics, /dashboard   (see evolution_ingest.operate.dashboard)
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from evolution_ingest.channels.answers import JsonAnswer
from evolution_ingest.channels.auth import JWT_MIN_KEY_BYTES, EvolutionAuth
from evolution_ingest.channels.webhook import WEBHOOK_PATH, WebhookApp
from evolution_ingest.config import Settings
from evolution_ingest.core.ingestion import Ingestion
from evolution_ingest.stores.refusals import RefusalLog

log = structlog.get_logger(__name__)


async def healthz(_: Request) -> JsonAnswer:
    return JsonAnswer(200, {"status": "ok"})


class IngestApp:
    """The ASGI app: webhook calls go straight to :class:`WebhookApp`, the rest to Starlette.

    The webhook route carries all the traffic; taking it before Starlette's router
    and middleware saves their cost on every event (``receive`` answers every error
    itself). Anything else — other paths, other methods — is Starlette's.
    """

    def __init__(self, webhook: WebhookApp, rest: Starlette) -> None:
        self._webhook = webhook
        self.rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            params = webhook_path_params(scope["path"])
            if params is not None:
                scope["path_params"] = params
                response = await self._webhook.receive(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.rest(scope, receive, send)


def webhook_path_params(path: str) -> dict[str, str] | None:
    """``/api/internal/webhook[/t/<token>][/<suffix>]`` -> its parameters; None for another path."""
    if not path.startswith(WEBHOOK_PATH):
        return None
    rest = path[len(WEBHOOK_PATH) :].strip("/")
    if not rest:
        return {}
    parts = rest.split("/")
    if parts[0] == "t" and len(parts) in {2, 3} and parts[1]:
        return {"token": parts[1], **({"suffix": parts[2]} if len(parts) == 3 else {})}
    return {"suffix": parts[0]} if len(parts) == 1 else None


def create_app(
    ingestion: Ingestion,
    settings: Settings,
    refusals: RefusalLog,
    operator_routes: Sequence[BaseRoute] = (),
) -> IngestApp:
    """The ASGI app; ``ingestion`` (and its connections) belong to the caller.

    ``operator_routes``: ``/metrics``, ``/readyz`` and ``/dashboard`` (see :mod:`evolution_ingest.operate.dashboard`).
    """
    webhook = WebhookApp(ingestion, settings, refusals)
    auth = EvolutionAuth(settings)
    if auth.weak_jwt_key:
        log.warning(
            "EVOLUTION_INGEST_WEBHOOK_JWT_KEY is shorter than 32 bytes: HS256 tokens signed with it are "
            "easier to forge; use a longer jwt_key on both sides",
            minimum_bytes=JWT_MIN_KEY_BYTES,
        )
    if not auth.enabled:
        log.warning(
            "webhook authentication is off: anyone who can reach this port can inject events; "
            "set EVOLUTION_INGEST_WEBHOOK_AUTH (url_token, header, jwt or apikey)"
        )
    if not settings.internal_secret:
        log.warning("EVOLUTION_INGEST_INTERNAL_SECRET is not set: forwards (already_saved) are refused")
    routes = [
        # Only reached by non-POST requests (POSTs are taken by IngestApp): a 405 with Allow.
        Route(WEBHOOK_PATH, webhook.receive, methods=["POST"]),
        Route(WEBHOOK_PATH + "/{rest:path}", webhook.receive, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        *operator_routes,
    ]
    return IngestApp(webhook, Starlette(routes=routes))
