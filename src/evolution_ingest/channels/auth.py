"""Who may call the webhook app: Evolution API (configurable) and our own forwards.

Evolution's calls are checked by the methods listed in
``EVOLUTION_INGEST_WEBHOOK_AUTH`` (any one passing is enough). Forwards from the
worker and the reconciler (``already_saved: true``) must carry the internal
secret. Every comparison of a secret is constant-time. A refusal returns its
reason, which is logged and counted but never includes the presented secret.
"""

from __future__ import annotations

import hmac
import warnings
from collections.abc import Mapping
from typing import Any, Final

import jwt
from jwt.warnings import InsecureKeyLengthWarning

from evolution_ingest.config import Settings, WebhookAuth
from evolution_ingest.stores.evolution import APIKEY_NULL

INTERNAL_SECRET_HEADER: Final = "x-internal-webhook-secret"  # noqa: S105 - a header name
#: On a forward: the inbox row's key, trusted because the secret authenticates the caller.
#: It keeps a forward tied to its row even if the stored copy differs from the original
#: (a NUL replaced for jsonb), and spares the webhook app the hashing.
DEDUP_KEY_HEADER: Final = "x-evolution-ingest-dedup-key"
#: On the webhook app's answer to a forward: the core's outcome (processed, duplicate, locked...).
OUTCOME_HEADER: Final = "x-evolution-ingest-outcome"
#: RFC 7518 asks HS256 keys for at least as many bytes as the hash has.
JWT_MIN_KEY_BYTES: Final = 32


def _same(presented: str | None, expected: str) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


class EvolutionAuth:
    """Checks calls from Evolution API against the configured methods."""

    def __init__(self, settings: Settings) -> None:
        self.methods = settings.auth_methods
        self._token = settings.webhook_token.get_secret_value() if settings.webhook_token else ""
        self._header = settings.webhook_token_header.lower()
        self._jwt_key = settings.webhook_jwt_key.get_secret_value() if settings.webhook_jwt_key else ""
        self._leeway = settings.webhook_jwt_leeway_seconds
        self._apikeys = [key.get_secret_value() for key in settings.webhook_apikeys]
        if self._jwt_key:
            # Said once, at start-up (see ``weak_jwt_key``), instead of by PyJWT on every call.
            warnings.filterwarnings("ignore", category=InsecureKeyLengthWarning)

    @property
    def weak_jwt_key(self) -> bool:
        """True when JWT auth is on with a key shorter than :data:`JWT_MIN_KEY_BYTES`."""
        return WebhookAuth.JWT in self.methods and len(self._jwt_key.encode()) < JWT_MIN_KEY_BYTES

    @property
    def enabled(self) -> bool:
        return bool(self.methods)

    def refusal(
        self,
        *,
        headers: Mapping[str, str],
        url_token: str | None,
        body: Mapping[str, Any],
    ) -> str | None:
        """``None`` when the call is authentic, else why it is refused."""
        if not self.methods:
            return None
        reasons = []
        for method in sorted(self.methods):
            reason = self._check(method, headers, url_token, body)
            if reason is None:
                return None
            reasons.append(reason)
        return "; ".join(reasons)

    def _check(
        self,
        method: WebhookAuth,
        headers: Mapping[str, str],
        url_token: str | None,
        body: Mapping[str, Any],
    ) -> str | None:
        if method is WebhookAuth.URL_TOKEN:
            if url_token is None:
                return "url_token: no token in the URL"
            return None if _same(url_token, self._token) else "url_token: wrong token"
        if method is WebhookAuth.HEADER:
            presented = headers.get(self._header)
            if presented is None:
                return f"header: no {self._header} header"
            return None if _same(presented, self._token) else f"header: wrong {self._header}"
        if method is WebhookAuth.JWT:
            return self._check_jwt(headers.get("authorization"))
        if method is WebhookAuth.APIKEY:
            apikey = body.get("apikey")
            if apikey is None and "apikey" in body:
                return f"apikey: {APIKEY_NULL}"
            if not isinstance(apikey, str):
                return "apikey: no apikey in the body"
            # Compare with every key so the time taken does not tell which one matched.
            matched = [_same(apikey, key) for key in self._apikeys]
            return None if any(matched) else "apikey: unknown apikey"
        return f"{method}: not a method"

    def _check_jwt(self, authorization: str | None) -> str | None:
        if authorization is None:
            return "jwt: no Authorization header"
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "jwt: Authorization is not 'Bearer <token>'"
        try:
            jwt.decode(
                token.strip(),
                self._jwt_key,
                algorithms=["HS256"],
                leeway=self._leeway,
                options={"require": ["exp", "iat"]},
            )
        except jwt.ExpiredSignatureError:
            return "jwt: expired beyond the allowed leeway"
        except jwt.InvalidTokenError as exc:
            return f"jwt: {type(exc).__name__}"
        return None


def internal_refusal(expected: str | None, presented: str | None) -> str | None:
    """``None`` when a forward carries the right internal secret, else why not."""
    if not expected:
        return "internal calls are disabled: EVOLUTION_INGEST_INTERNAL_SECRET is not set"
    if presented is None:
        return f"missing {INTERNAL_SECRET_HEADER} header"
    return None if _same(presented, expected) else f"wrong {INTERNAL_SECRET_HEADER}"
