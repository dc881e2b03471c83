"""Authentication of Evolution's calls: one setting away, every refusal counted and logged."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import jwt
import orjson
import pytest
from structlog.testing import capture_logs

from evolution_ingest.config import ConfigError, Settings
from tests.conftest import OpenRuntime, serving
from tests.support import Recorder, fixture

TOKEN = "fake-url-token-for-tests"
JWT_KEY = "fake-jwt-key-for-tests-0123456789abcdef"


def refused(answer: tuple[int, dict[str, Any]]) -> tuple[int, str]:
    """(status, reason) of a refusal, which is kept (it has an id) as unauthorized."""
    status, body = answer
    assert body["code"] == "unauthorized"
    assert isinstance(body["refusal_id"], int)
    return status, body["error"]


async def call(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    async with http.post(url, data=orjson.dumps(body), headers=headers or {}) as resp:
        return resp.status, orjson.loads(await resp.read())


def evolution_jwt(key: str, issued_ago: float) -> str:
    """A token as Evolution signs it: HS256, iat, exp = iat + 10 minutes."""
    iat = int(time.time() - issued_ago)
    return jwt.encode({"iat": iat, "exp": iat + 600, "app": "evolution", "action": "webhook"}, key, "HS256")


async def test_url_token_in_the_path_or_the_query_is_accepted_and_a_wrong_one_refused(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    async with (
        open_runtime(webhook_auth=["url_token"], webhook_token=TOKEN) as runtime,
        serving(runtime) as url,
    ):
        events = [fixture(n)["webhook_body"] for n in ("call_offer", "groups_upsert", "qrcode_updated")]
        assert (await call(http, f"{url}/t/{TOKEN}", events[0]))[0] == 200
        assert (await call(http, f"{url}/t/{TOKEN}/groups-upsert", events[1]))[0] == 200
        assert (await call(http, f"{url}?token={TOKEN}", events[2]))[0] == 200
        with capture_logs() as logs:
            wrong = await call(
                http, f"{url}/t/not-the-token", fixture("presence_update_composing")["webhook_body"]
            )
            missing = await call(http, url, fixture("presence_update_composing")["webhook_body"])
        await runtime.counters.flush()
        unauthorized = await runtime.counters.read(["webhook:unauthorized"])
    assert refused(wrong) == (401, "url_token: wrong token")
    assert refused(missing) == (401, "url_token: no token in the URL")
    assert recorder.total == 3
    assert unauthorized == {"webhook:unauthorized": 2}
    refusals = [entry for entry in logs if entry["event"] == "call refused"]
    assert [entry["log_level"] for entry in refusals] == ["warning", "warning"]
    assert all(
        TOKEN not in str(entry) and "not-the-token" not in str(entry.get("reason")) for entry in refusals
    )


async def test_a_static_header_token_is_checked(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    body = fixture("call_offer")["webhook_body"]
    async with open_runtime(webhook_auth=["header"], webhook_token=TOKEN) as runtime, serving(runtime) as url:
        assert (await call(http, url, body, {"x-webhook-token": "nope"}))[0] == 401
        assert (await call(http, url, body))[0] == 401
        assert (await call(http, url, body, {"X-Webhook-Token": TOKEN}))[0] == 200
    assert recorder.total == 1


async def test_evolution_jwt_is_accepted_for_the_whole_retry_window(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    body = fixture("connection_update_close_logged_out")["webhook_body"]
    async with (
        open_runtime(webhook_auth=["jwt"], webhook_jwt_key=JWT_KEY) as runtime,
        serving(runtime) as url,
    ):
        fresh = await call(http, url, body, {"Authorization": f"Bearer {evolution_jwt(JWT_KEY, 0)}"})
        # Evolution's 10th retry, ~20 minutes on, still carries the token signed for the first try.
        retry = await call(http, url, body, {"Authorization": f"Bearer {evolution_jwt(JWT_KEY, 20 * 60)}"})
        stale = await call(http, url, body, {"Authorization": f"Bearer {evolution_jwt(JWT_KEY, 3600)}"})
        forged = await call(
            http,
            url,
            body,
            {"Authorization": f"Bearer {evolution_jwt('a-forged-key-that-is-long-enough-for-hs256', 0)}"},
        )
        garbage = await call(http, url, body, {"Authorization": "Bearer not.a.jwt"})
        basic = await call(http, url, body, {"Authorization": "Basic Zm9vOmJhcg=="})
    assert fresh == (200, {"status": "processed", "dedup_key": fresh[1]["dedup_key"]})
    assert retry[1]["reason"] == "duplicate"
    assert refused(stale) == (401, "jwt: expired beyond the allowed leeway")
    assert refused(forged) == (401, "jwt: InvalidSignatureError")
    assert garbage[0] == 401
    assert refused(basic) == (401, "jwt: Authorization is not 'Bearer <token>'")
    assert recorder.total == 1


async def test_the_instance_apikey_in_the_body_is_checked_against_the_list(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    body = fixture("call_offer")["webhook_body"]
    assert body["apikey"] == "TEST-INSTANCE-TOKEN-0000"
    async with (
        open_runtime(
            webhook_auth=["apikey"], webhook_apikeys=["OTHER-FAKE", "TEST-INSTANCE-TOKEN-0000"]
        ) as runtime,
        serving(runtime) as url,
    ):
        assert (await call(http, url, {**body, "apikey": "UNKNOWN"}))[0] == 401
        assert (await call(http, url, {k: v for k, v in body.items() if k != "apikey"}))[0] == 401
        assert (await call(http, url, body))[0] == 200
    assert recorder.total == 1


async def test_any_of_several_methods_is_enough(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, recorder: Recorder
) -> None:
    async with (
        open_runtime(
            webhook_auth=["url_token", "jwt"], webhook_token=TOKEN, webhook_jwt_key=JWT_KEY
        ) as runtime,
        serving(runtime) as url,
    ):
        by_url = await call(http, f"{url}/t/{TOKEN}", fixture("call_offer")["webhook_body"])
        by_jwt = await call(
            http,
            url,
            fixture("groups_upsert")["webhook_body"],
            {"Authorization": f"Bearer {evolution_jwt(JWT_KEY, 5)}"},
        )
        neither = await call(http, url, fixture("qrcode_updated")["webhook_body"])
    assert (by_url[0], by_jwt[0], neither[0]) == (200, 200, 401)
    assert neither[1]["error"] == "jwt: no Authorization header; url_token: no token in the URL"


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [
        ({"webhook_auth": "url_token"}, "EVOLUTION_INGEST_WEBHOOK_TOKEN"),
        ({"webhook_auth": "jwt"}, "EVOLUTION_INGEST_WEBHOOK_JWT_KEY"),
        ({"webhook_auth": "apikey"}, "EVOLUTION_INGEST_WEBHOOK_APIKEYS"),
        ({"webhook_auth": "basic"}, "EVOLUTION_INGEST_WEBHOOK_AUTH"),
        ({"webhook_auth": "none,jwt", "webhook_jwt_key": "k"}, "EVOLUTION_INGEST_WEBHOOK_AUTH"),
    ],
)
def test_an_auth_method_without_its_secret_stops_start_up_naming_the_variable(
    overrides: dict[str, str], variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in overrides.items():
        monkeypatch.setenv(f"EVOLUTION_INGEST_{name.upper()}", value)
    with pytest.raises(ConfigError, match=variable):
        Settings.from_env(_env_file=None)
