"""A local HTTP destination for routes: records what it receives, answers what it is told to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: Any
    #: What the destination answered.
    status: int


class Destination:
    """Answers ``statuses`` in order (then ``default``); every request is kept in ``received``."""

    def __init__(self, statuses: list[int] | None = None, default: int = 200) -> None:
        self.statuses = list(statuses or [])
        self.default = default
        self.received: list[Received] = []
        self.app = Starlette(routes=[Route("/{path:path}", self._receive, methods=["POST", "PUT", "PATCH"])])

    async def _receive(self, request: Request) -> Response:
        status = self.statuses.pop(0) if self.statuses else self.default
        body = orjson.loads(await request.body())
        self.received.append(Received(request.url.path, dict(request.headers), body, status))
        return Response(orjson.dumps({"ok": status < 300}), status, media_type="application/json")

    @property
    def accepted(self) -> list[Received]:
        """The requests it answered with a 2xx."""
        return [r for r in self.received if 200 <= r.status < 300]
