"""Secrets out of every body the service keeps, shows or forwards.

Evolution puts secrets in three fields of its bodies, never in ``data``:

* ``destination`` — the webhook URL, so with ``url_token`` auth the token
  (``.../api/internal/webhook/t/<token>``), and whatever a user put in its query or
  user-info;
* ``apikey`` — the instance's token (``null`` unless Evolution exposes it);
* ``api_key`` — Evolution's global API key, in the bodies of its errors webhook.

The stored body (and so ``Event.payload``, ``inspect``, the dashboard and route
deliveries) has them replaced by ``[redacted]``; keeping ``apikey`` is an explicit
opt-in (``EVOLUTION_INGEST_KEEP_APIKEY``). Identity never looks at these fields, so
redaction does not change a dedup key. ``data`` is never touched: a message text that
happens to contain a token-like string is the user's, not a secret of the service.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final
from urllib.parse import SplitResult, urlsplit, urlunsplit

REDACTED: Final = "[redacted]"
#: The token segment of this service's webhook path, wherever a proxy mounts it.
_TOKEN_PATH: Final = re.compile(r"(/api/internal/webhook/t/)[^/?#]+")
# For refused bodies that are not JSON: the same fields, found in the text.
_TEXT_FIELD: Final = re.compile(rb'("(?:apikey|api_key)"\s*:\s*)"(?:[^"\\]|\\.)*"')
_TEXT_DESTINATION: Final = re.compile(rb'("destination"\s*:\s*")((?:[^"\\]|\\.)*)"')
_TEXT_TOKEN_PATH: Final = re.compile(rb"(/api/internal/webhook/t/)[^/?#\"\s\\]+")


def _netloc(parts: SplitResult) -> str:
    if parts.password is None:
        return parts.netloc
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.username or ''}:{REDACTED}@{host}"


def _query(query: str) -> str:
    pairs = [pair.partition("=") for pair in query.split("&") if pair]
    return "&".join(f"{name}={REDACTED}" if sep else name for name, sep, _ in pairs)


class Redactor:
    """Removes the secrets of an Evolution body; built once from the settings."""

    def __init__(self, *, secrets: Iterable[str] = (), keep_apikey: bool = False) -> None:
        #: Secrets of this service (webhook token, JWT key, internal secret) looked for in URLs.
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
        self._keep_apikey = keep_apikey
        #: Redacted destinations: every body of an instance carries the same one.
        self._destinations: dict[str, str] = {}

    def url(self, url: str) -> str:
        """A URL without its token segment, query values, password or fragment."""
        for secret in self._secrets:
            url = url.replace(secret, REDACTED)
        url = _TOKEN_PATH.sub(rf"\g<1>{REDACTED}", url)
        if "?" not in url and "@" not in url and "#" not in url:
            return url
        try:
            parts = urlsplit(url)
            netloc = _netloc(parts)
        except ValueError:  # not a URL Python can split: keep nothing after the path
            return url.split("?", 1)[0].split("#", 1)[0]
        return urlunsplit((parts.scheme, netloc, parts.path, _query(parts.query), ""))

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with its secrets replaced (a copy when something changed)."""
        changes: dict[str, Any] = {}
        destination = body.get("destination")
        if isinstance(destination, str):
            clean = self._destinations.get(destination)
            if clean is None:
                if len(self._destinations) >= 1024:  # bounded, whatever callers send
                    self._destinations.clear()
                clean = self._destinations[destination] = self.url(destination)
            if clean != destination:
                changes["destination"] = clean
        elif destination is not None:
            changes["destination"] = REDACTED
        if not self._keep_apikey and body.get("apikey") is not None:
            changes["apikey"] = REDACTED
        if body.get("api_key") is not None:
            changes["api_key"] = REDACTED
        return {**body, **changes} if changes else body

    def text(self, raw: bytes) -> bytes:
        """The same secrets out of a body that could not be parsed (a refusal's copy)."""
        for secret in self._secrets:
            raw = raw.replace(secret.encode("utf-8", "surrogatepass"), REDACTED.encode())
        raw = _TEXT_FIELD.sub(rb'\g<1>"' + REDACTED.encode() + b'"', raw)
        raw = _TEXT_DESTINATION.sub(
            lambda m: m[1] + self.url(m[2].decode("utf-8", "replace")).encode() + b'"', raw
        )
        return _TEXT_TOKEN_PATH.sub(rb"\g<1>" + REDACTED.encode(), raw)
