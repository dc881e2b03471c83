"""The dedup key: one per Evolution emission, whichever channel or retry carries it."""

from __future__ import annotations

import copy
import random
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evolution_ingest.core.identity import (
    MESSAGE_EVENTS,
    SINGLE_MESSAGE_EVENTS,
    InvalidEvent,
    canonical_json,
    dedup_key,
    legacy_dedup_key,
    message_identity,
    normalize_event_name,
    parse_envelope,
)
from tests.support import fixture, fixture_names, fixtures, webhook_suffix


def key_of(body: dict[str, Any]) -> str:
    return parse_envelope(body).dedup_key


def shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [shuffled(v, rng) for v in value]
    return value


@pytest.mark.parametrize("name", fixture_names())
def test_webhook_and_rabbitmq_forms_of_a_fixture_share_one_key(name: str) -> None:
    item = fixture(name)
    assert key_of(item["webhook_body"]) == key_of(item["rabbitmq_body"])


@pytest.mark.parametrize("name", fixture_names())
def test_instance_and_global_webhook_and_retries_share_one_key(name: str) -> None:
    item = fixture(name)
    instance_webhook = item["webhook_body"]
    global_webhook = {**instance_webhook, "destination": item["webhook_post_url_when_byEvents"]}
    retry = shuffled(instance_webhook, random.Random(7))
    forwarded = {**item["rabbitmq_body"], "already_saved": True}
    keys = {key_of(body) for body in (instance_webhook, global_webhook, retry, forwarded)}
    assert len(keys) == 1


def test_every_fixture_but_the_reemission_has_its_own_key() -> None:
    keys = {item["name"]: key_of(item["webhook_body"]) for item in fixtures()}
    reemitted = keys.pop("messages_upsert_text_incoming_REEMITTED")
    assert len(set(keys.values())) == len(keys)
    assert reemitted == keys["messages_upsert_text_incoming"]


def test_a_reemitted_message_with_a_new_date_time_is_the_same_event() -> None:
    original = fixture("messages_upsert_text_incoming")["webhook_body"]
    again = fixture("messages_upsert_text_incoming_REEMITTED")["rabbitmq_body"]
    assert original["date_time"] != again["date_time"]
    assert key_of(original) == key_of(again)


def test_the_same_connection_state_emitted_twice_is_two_events() -> None:
    first = fixture("connection_update_open")["webhook_body"]
    later = {**first, "date_time": "2025-11-04T12:00:00.000Z"}
    assert key_of(first) != key_of(later)


def test_a_participant_added_removed_and_added_again_is_three_events() -> None:
    added = fixture("group_participants_update_add")["webhook_body"]
    removed = copy.deepcopy(added)
    removed["data"]["action"] = "remove"
    removed["date_time"] = "2025-11-04T11:29:00.000Z"
    added_again = {**added, "date_time": "2025-11-04T11:30:00.000Z"}
    assert len({key_of(added), key_of(removed), key_of(added_again)}) == 3


def test_a_message_whose_content_changed_keeps_no_key_of_its_earlier_version() -> None:
    placeholder = fixture("messages_upsert_text_incoming")["webhook_body"]
    decrypted = copy.deepcopy(placeholder)
    decrypted["data"]["message"]["conversation"] = "Oi! Vocês abrem no domingo?"
    assert key_of(placeholder) != key_of(decrypted)


def test_one_message_is_one_event_whatever_its_delivery_state_or_media_transport() -> None:
    body = fixture("messages_upsert_image_incoming_with_base64")["webhook_body"]
    assert "base64" in body["data"]["message"]
    stored = copy.deepcopy(body)  # as Evolution stores it: no base64, another status, no pushName
    del stored["data"]["message"]["base64"]
    stored["data"]["status"] = "READ"
    stored["data"]["pushName"] = None
    stored["data"]["contextInfo"] = None
    assert key_of(stored) == key_of(body)


def test_the_message_id_direction_and_event_are_part_of_a_message_identity() -> None:
    body = fixture("messages_upsert_text_incoming")["webhook_body"]
    other_id, mine, sent = (copy.deepcopy(body) for _ in range(3))
    other_id["data"]["key"]["id"] = "ANOTHER0000000000000000000000000"
    mine["data"]["key"]["fromMe"] = True
    sent["event"] = "send.message"
    assert len({key_of(b) for b in (body, other_id, mine, sent)}) == 4


def test_the_version_1_key_of_a_message_is_kept_for_copies_saved_before_the_upgrade() -> None:
    # Pinned: what version 1 computed for these fixtures (their whole data).
    for name, v1 in (
        ("messages_upsert_text_incoming", "21e29b0c3bc8bf2670f2a3563a9718f1a4b9dee0e8bc2f7d136b12674b65d031"),
        ("send_message_text_via_api", "4c9d67dd65179ac30e6b00de6d89acd5ddff3fb71b2b98704a1f3c1dc54c8c1a"),
    ):
        body = fixture(name)["webhook_body"]
        assert legacy_dedup_key(body["event"], body["instance"], body["data"], body["date_time"]) == v1
        assert key_of(body) != v1
    call = fixture("call_offer")["webhook_body"]  # every other event keeps its key of version 1
    assert legacy_dedup_key(call["event"], call["instance"], call["data"], call["date_time"]) == key_of(call)


def test_transport_fields_never_change_the_key() -> None:
    body = fixture("call_offer")["webhook_body"]
    variants = [
        {**body, "destination": "https://elsewhere.example.test/hook"},
        {**body, "sender": "5511000000000@s.whatsapp.net"},
        {**body, "server_url": "https://evo2.example.test"},
        {**body, "apikey": "ANOTHER-FAKE-TOKEN"},
        {**body, "already_saved": True},
        {k: v for k, v in body.items() if k not in {"destination", "sender", "apikey"}},
    ]
    assert {key_of(v) for v in variants} == {key_of(body)}


def test_history_chunk_extras_do_not_change_the_key() -> None:
    body = fixture("messages_set_history_chunk")["rabbitmq_body"]
    assert key_of(body) == key_of({k: v for k, v in body.items() if k not in {"isLatest", "progress"}})


def test_instance_and_event_are_part_of_the_identity() -> None:
    body = fixture("presence_update_composing")["webhook_body"]
    assert key_of(body) != key_of({**body, "instance": "acme-support"})
    assert key_of(body) != key_of({**body, "event": "chats.update"})


def test_event_names_in_enum_form_are_normalized() -> None:
    assert normalize_event_name("MESSAGES_UPSERT") == "messages.upsert"
    assert normalize_event_name("GROUP_PARTICIPANTS_UPDATE") == "group-participants.update"
    assert normalize_event_name("Connection.Update") == "connection.update"
    body = fixture("group_participants_update_add")["webhook_body"]
    assert key_of(body) == key_of({**body, "event": "GROUP_PARTICIPANTS_UPDATE"})


def test_webhook_suffixes_match_evolution() -> None:
    for item in fixtures():
        assert "/" + webhook_suffix(item["event"]) == item["webhook_path_suffix"]


def test_the_stored_body_drops_service_fields_only() -> None:
    body = {**fixture("qrcode_updated")["rabbitmq_body"], "already_saved": True}
    envelope = parse_envelope(body)
    assert "already_saved" not in envelope.body
    assert envelope.body == fixture("qrcode_updated")["rabbitmq_body"]


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ([1, 2], "must be a JSON object"),
        ("event", "must be a JSON object"),
        ({"instance": "a", "data": {}}, "missing field 'event'"),
        ({"event": "call", "data": {}}, "missing field 'instance'"),
        ({"event": "call", "instance": "a"}, "missing field 'data'"),
        ({"event": 5, "instance": "a", "data": {}}, "'event' must be a non-empty string"),
        ({"event": "", "instance": "a", "data": {}}, "'event' must be a non-empty string"),
        ({"event": "call", "instance": ["a"], "data": {}}, "'instance' must be a non-empty string"),
        ({"event": "call", "instance": "a", "data": {}, "date_time": 17}, "'date_time' must be a string"),
        ({"event": "call", "instance": "a", "data": _nested(300)}, "nested more than 254 levels"),
    ],
)
def test_a_body_that_is_not_an_evolution_event_is_refused_with_a_reason(body: Any, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=reason):
        parse_envelope(body)


# --- properties ---------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars | st.floats(allow_nan=False, allow_infinity=False),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
event_names = st.sampled_from([*sorted(MESSAGE_EVENTS), "connection.update", "presence.update", "call"])
date_times = st.datetimes().map(lambda d: d.isoformat(timespec="milliseconds") + "Z")


@settings(max_examples=300)
@given(
    event=event_names,
    instance=st.text(min_size=1, max_size=12).filter(str.strip),
    data=json_values,
    date_time=date_times,
    seed=st.integers(0, 2**32),
)
def test_key_order_and_channel_do_not_change_the_key(
    event: str, instance: str, data: Any, date_time: str, seed: int
) -> None:
    webhook = {
        "event": event,
        "instance": instance,
        "data": data,
        "destination": "https://x.test",
        "date_time": date_time,
        "sender": "s",
        "server_url": "u",
        "apikey": "k",
    }
    rabbitmq = shuffled({k: v for k, v in webhook.items() if k != "destination"}, random.Random(seed))
    assert key_of(webhook) == key_of(rabbitmq)


@settings(max_examples=300)
@given(event=event_names, data=json_values, first=date_times, second=date_times)
def test_date_time_separates_emissions_except_for_message_events(
    event: str, data: Any, first: str, second: str
) -> None:
    same = dedup_key(event, "i", data, first) == dedup_key(event, "i", data, second)
    if event in MESSAGE_EVENTS or first == second:
        assert same
    else:
        assert not same


@settings(max_examples=300)
@given(event=event_names, a=json_values, b=json_values)
def test_different_content_gives_different_keys(event: str, a: Any, b: Any) -> None:
    ident_a, ident_b = message_identity(event, "i", a) or a, message_identity(event, "i", b) or b
    if canonical_json(ident_a) != canonical_json(ident_b):
        assert dedup_key(event, "i", a, "t") != dedup_key(event, "i", b, "t")


@settings(max_examples=300)
@given(
    event=st.sampled_from(sorted(SINGLE_MESSAGE_EVENTS)),
    message_id=st.text(min_size=1, max_size=32),
    from_me=st.booleans(),
    content=json_values,
    other=st.dictionaries(
        st.sampled_from(["status", "pushName", "contextInfo", "messageTimestamp", "source"]), json_values
    ),
)
def test_a_message_is_identified_by_its_id_direction_and_content_only(
    event: str, message_id: str, from_me: bool, content: Any, other: dict[str, Any]
) -> None:
    bare = {"key": {"id": message_id, "fromMe": from_me}, "message": content}
    assert dedup_key(event, "i", {**bare, **other}, "t1") == dedup_key(event, "i", bare, "t2")
    changed = {**bare, "message": {"changed": content}}
    assert dedup_key(event, "i", changed, "t") != dedup_key(event, "i", bare, "t")


@given(event=event_names, data=json_values)
def test_the_key_is_sha256_hex(event: str, data: Any) -> None:
    key = dedup_key(event, "i", data, None)
    assert re.fullmatch(r"[0-9a-f]{64}", key), key
