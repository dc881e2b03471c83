"""JSON read, written and stored the same way on both channels, whatever characters it holds."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evolution_ingest.core import codec
from evolution_ingest.core.redaction import REDACTED, Redactor
from tests.support.fuzz import node_json

_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@given(_JSON)
def test_what_node_writes_reads_back_as_the_same_value(value: Any) -> None:
    assert codec.loads(node_json(value)) == value


@given(_JSON)
def test_a_stored_body_gives_the_received_one_back(value: Any) -> None:
    stored = codec.for_storage({"data": value})
    assert "\\u0000" not in stored.jsonb  # what jsonb refuses never reaches it
    assert codec.from_storage(codec.loads(stored.jsonb), stored.exact) == {"data": value}


@pytest.mark.parametrize("number", [5.632245580526235e16, -1e16, 1.8e19])
async def test_a_whole_double_of_1e16_and_up_is_a_double_again_after_jsonb(db: Any, number: float) -> None:
    # jsonb keeps a decimal: 5.632245580526235e+16 comes out as 56322455805262350, an integer.
    stored = codec.for_storage({"data": [number, 1.5, "e+16"]})
    through = await db.fetchval("SELECT $1::text::jsonb::text", stored.jsonb)
    back = codec.from_storage(codec.loads(through), stored.exact)
    assert back == {"data": [number, 1.5, "e+16"]}
    assert type(back["data"][0]) is float
    assert codec.for_storage({"data": [2.5e19, 9.9e15, 1.2e286, "5e+16"]}).exact is None  # no text kept


@given(st.dictionaries(_TEXT, _JSON, max_size=6))
def test_the_canonical_form_ignores_key_order(value: dict[str, Any]) -> None:
    assert codec.canonical(dict(reversed(list(value.items())))) == codec.canonical(value)


def test_a_lone_surrogate_is_read_with_the_numbers_orjson_gives() -> None:
    raw = b'{"t":"\\ud83d","big":18446744073709551616,"u64":18446744073709551615,"f":1.5}'
    assert codec.loads(raw) == {"t": "\ud83d", "big": 1.8446744073709552e19, "u64": 2**64 - 1, "f": 1.5}
    # The same numbers without the surrogate (orjson's path) give the same values, so the same key.
    assert codec.loads(raw.replace(b"\\ud83d", b"x"))["big"] == codec.loads(raw)["big"]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"a": NaN, "t": "\\ud800"}', "NaN is not JSON"),
        (b'{"a": 1e400, "t": "\\ud800"}', "beyond the range of a double"),
        (b'{"t": "\\ud800", "b": "\xff"}', "not UTF-8"),
        (b'{"t": "\\ud800"', "malformed JSON"),
        (b"[" * 2000 + b'"\\ud800"' + b"]" * 2000, "malformed JSON"),
    ],
)
def test_the_surrogate_path_refuses_what_orjson_refuses(raw: bytes, reason: str) -> None:
    with pytest.raises(codec.JsonRefused, match=reason):
        codec.loads(raw)


def test_nesting_past_the_limit_is_refused_as_too_deep() -> None:
    value: Any = "\ud800"
    for _ in range(codec.MAX_DEPTH + 1):
        value = [value]
    with pytest.raises(codec.JsonRefused) as refused:
        codec.for_storage(value)
    assert refused.value.code == "too_deep"


@pytest.mark.parametrize(
    ("url", "clean"),
    [
        ("http://svc:8080/api/internal/webhook/t/SECRET/messages-upsert", f"http://svc:8080/api/internal/webhook/t/{REDACTED}/messages-upsert"),
        ("https://proxy/x/api/internal/webhook/t/SECRET", f"https://proxy/x/api/internal/webhook/t/{REDACTED}"),
        ("http://svc/api/internal/webhook?token=SECRET&by=1", f"http://svc/api/internal/webhook?token={REDACTED}&by={REDACTED}"),
        ("http://user:pass@svc/hook#frag", f"http://user:{REDACTED}@svc/hook"),
        ("http://svc/hooks/known-service-secret/x", f"http://svc/hooks/{REDACTED}/x"),
        ("https://hooks.example.test/evolution", "https://hooks.example.test/evolution"),
    ],
)  # fmt: skip
def test_destination_urls_lose_their_secrets(url: str, clean: str) -> None:
    assert Redactor(secrets=["known-service-secret"]).url(url) == clean


def test_apikey_and_api_key_are_redacted_and_data_never_is() -> None:
    body = {
        "apikey": "instance-token",
        "api_key": "global-key",
        "data": {"apikey": "user text", "t": "/t/abc?x=1"},
    }
    assert Redactor().body(body) == {**body, "apikey": REDACTED, "api_key": REDACTED}
    assert Redactor(keep_apikey=True).body(body)["apikey"] == "instance-token"
    assert Redactor().body({"apikey": None, "data": 1}) == {"apikey": None, "data": 1}


def test_a_body_that_does_not_parse_loses_the_same_secrets_in_its_text() -> None:
    raw = (
        b'{"apikey": "instance-token", "destination": "http://h/api/internal/webhook/t/TOKEN?token=T2", '
        b'"data": {"url": "https://mmg.whatsapp.net/x?oh=keep"}, "oops'
    )
    clean = Redactor(secrets=["T2"]).text(raw)
    assert b"instance-token" not in clean
    assert b"TOKEN" not in clean
    assert b"T2" not in clean
    assert b"oh=keep" in clean  # data is the user's, never changed
