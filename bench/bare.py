"""The ceiling of the HTTP part: an endpoint that only parses the JSON body, on the same stack."""

from __future__ import annotations

import sys

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


async def parse_only(request: Request) -> Response:
    body = orjson.loads(await request.body())
    return Response(orjson.dumps({"status": "ok", "keys": len(body)}), media_type="application/json")


async def healthz(_: Request) -> Response:
    return Response(b"{}", media_type="application/json")


app = Starlette(routes=[Route("/bare", parse_only, methods=["POST"]), Route("/healthz", healthz)])

if __name__ == "__main__":
    uvicorn.run(
        app, host="127.0.0.1", port=int(sys.argv[1]), http="httptools", loop="uvloop",
        access_log=False, log_level="warning",
    )  # fmt: skip
