"""A refusal is never silent: kept (bounded), listed, shown, counted, and replayed after a fix."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import asyncpg
import jwt
import orjson
import pytest

from evolution_ingest.config import Settings
from evolution_ingest.core.identity import parse_envelope
from evolution_ingest.stores.refusals import Refusal, ReplayFilters
from tests.conftest import OpenRuntime, serving
from tests.support import Recorder, fixture, free_socket, wait_until
from tests.test_admin import cli, cli_json
from tests.test_cli import env_for, healthy, running

TOKEN = "fake-url-token-for-refusal-tests"


async def post(http: aiohttp.ClientSession, url: str, raw: bytes) -> tuple[int, dict[str, object]]:
    async with http.post(url, data=raw) as resp:
        return resp.status, orjson.loads(await resp.read())


async def test_refused_bodies_are_kept_newest_first_listed_shown_and_counted(
    open_runtime: OpenRuntime, http: aiohttp.ClientSession, db: asyncpg.Connection, settings: Settings
) -> None:
    bodies = [
        b"{not json",
        b"[1]",
        b'{"event": "call"}',
        b'{"event": 5, "instance": "a", "data": 1}',
        b"\xff",
    ]
    async with open_runtime(refusals_keep=3) as runtime, serving(runtime) as url:
        answers = [await post(http, url, raw) for raw in bodies]
        await runtime.counters.flush()
        counted = await runtime.counters.read(["refusals:recorded", "refusals:dropped"])
    assert [status for status, _ in answers] == [400] * 5
    kept = await db.fetch("SELECT id, code, body FROM evolution_ingest_refusals ORDER BY id")
    assert [r["id"] for r in kept] == [answer["refusal_id"] for _, answer in answers[-3:]]  # the oldest went
    assert [bytes(r["body"]) for r in kept] == bodies[-3:]
    assert counted == {"refusals:recorded": 5, "refusals:dropped": 2}
    env = env_for(settings.model_copy(update={"refusals_keep": 3}))
    status = await cli_json(env, "status")
    assert status["refusals"]["summary"]["kept"] == 3
    assert [row["code"] for row in status["refusals"]["recent"]] == [
        "malformed_json",
        "not_an_event",
        "not_an_event",
    ]
    human = await cli(env, "status")
    assert f"refusal:{kept[-1]['id']}" in human.stdout
    shown = await cli_json(env, "inspect", f"refusal:{kept[-1]['id']}")
    assert (shown["refusal"]["body"], shown["refusal"]["body_hex"]) == (None, "ff")
    shown = await cli_json(env, "inspect", f"refusal:{kept[0]['id']}")
    assert shown["refusal"]["body"] == '{"event": "call"}'
    assert shown["refusal"]["reason"] == "missing field 'instance'"
    missing = await cli(env, "inspect", "refusal:1")
    assert missing.returncode == 1
    assert "no refusal '1' is kept" in missing.stderr


async def test_replay_refused_runs_a_body_refused_before_the_fix_once_and_leaves_the_rest(
    open_runtime: OpenRuntime, recorder: Recorder, http: aiohttp.ClientSession, settings: Settings
) -> None:
    """Evolution's token was wrong for a while (401, which it does not retry): after the fix,
    ``replay --refused --include-unauthorized`` runs what was refused, once."""
    event = fixture("messages_upsert_group_text")["webhook_body"]
    auth = {"webhook_auth": ["url_token"], "webhook_token": TOKEN}
    async with open_runtime(**auth) as runtime, serving(runtime) as url:
        assert (await post(http, url + "/t/an-old-token", orjson.dumps(event)))[0] == 401
        assert (await post(http, url + f"/t/{TOKEN}", b'{"event": "call", "data": {'))[0] == 400
        env = env_for(runtime.settings, FORWARD_URL=url)
        plain = await cli_json(env, "replay", "--no-failed", "--no-parked", "--refused")
        assert plain["refused_outcomes"] == {"still refused": 1}  # unauthorized ones only when asked
        assert recorder.total == 0
        dry = await cli_json(
            env, "replay", "--no-failed", "--no-parked", "--refused", "--code", "unauthorized", "--dry-run"
        )
        assert dry["refused_outcomes"] == {"would be re-submitted": 1}
        assert recorder.total == 0
        done = await cli_json(
            env, "replay", "--no-failed", "--no-parked", "--refused", "--include-unauthorized"
        )
        assert done["refused_outcomes"] == {"processed": 1}
        again = await cli_json(
            env, "replay", "--no-failed", "--no-parked", "--refused", "--include-unauthorized"
        )
        human = await cli(env, "inspect", "refusal:1")
    assert "refused_bodies" not in again  # each refusal is replayed once
    assert recorder.calls == {parse_envelope(event).dedup_key: 1}
    assert "processed" in human.stdout


async def test_replay_filters_pick_refusals_by_code_source_and_time(
    open_runtime: OpenRuntime, db: asyncpg.Connection
) -> None:
    """Each filter of ``replay --refused`` narrows the set; unauthorized bodies only when asked."""
    kinds = [
        ("webhook", "malformed_json"),
        ("rabbitmq", "not_an_event"),
        ("webhook", "unauthorized"),
        ("rabbitmq", "malformed_json"),
    ]
    async with open_runtime() as runtime:
        ids = [
            await runtime.refusals.record(Refusal(source=source, code=code, reason="test", body=b"{"))
            for source, code in kinds
        ]
        await db.execute(
            "UPDATE evolution_ingest_refusals SET received_at = now() - interval '1 hour' WHERE id = ANY($1)",
            ids[:2],
        )
        half_an_hour_ago = datetime.now(UTC) - timedelta(minutes=30)

        async def picked(**filters: Any) -> list[int]:
            return [row[0] for row in await runtime.refusals.to_replay(ReplayFilters(**filters), 10)]

        assert await picked() == [ids[0], ids[1], ids[3]]
        assert await picked(source="rabbitmq") == [ids[1], ids[3]]
        assert await picked(since=half_an_hour_ago) == [ids[3]]
        assert await picked(until=half_an_hour_ago) == [ids[0], ids[1]]
        assert await picked(source="webhook", since=half_an_hour_ago, unauthorized=True) == [ids[2]]
        assert await picked(codes=("unauthorized",)) == [ids[2]]
        assert await picked(codes=("malformed_json",), source="rabbitmq", until=half_an_hour_ago) == []


@pytest.mark.filterwarnings("ignore::jwt.warnings.InsecureKeyLengthWarning")  # this test's own tokens
async def test_a_short_jwt_key_is_one_structured_warning_and_every_log_line_stays_json(
    settings: Settings, http: aiohttp.ClientSession
) -> None:
    key = "short-key"  # 9 bytes: PyJWT warns on every decode with a key under 32 bytes
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = env_for(settings, PORT=str(port), WEBHOOK_AUTH="jwt", WEBHOOK_JWT_KEY=key, LOG_FORMAT="json")
    async with running(env, "serve") as proc:
        await wait_until(lambda: healthy(http, port), within=20, message="serve to answer")
        for _ in range(3):
            token = jwt.encode({"iat": int(time.time()), "exp": int(time.time()) + 600}, key, "HS256")
            status, _ = await post_with(http, f"http://127.0.0.1:{port}/api/internal/webhook", token)
            assert status == 200
        proc.terminate()
        assert proc.stderr is not None
        output = (await proc.stderr.read()).decode()
        await proc.wait()
    lines = [line for line in output.splitlines() if line.strip()]
    parsed = [orjson.loads(line) for line in lines]  # every line one JSON object
    weak = [entry for entry in parsed if "shorter than 32 bytes" in entry.get("event", "")]
    assert len(weak) == 1
    assert weak[0]["level"] == "warning"
    assert "InsecureKeyLengthWarning" not in output
    assert key not in output


async def post_with(http: aiohttp.ClientSession, url: str, token: str) -> tuple[int, bytes]:
    body = {**fixture("call_offer")["webhook_body"], "date_time": str(time.time())}
    async with http.post(url, data=orjson.dumps(body), headers={"authorization": f"Bearer {token}"}) as resp:
        return resp.status, await resp.read()
