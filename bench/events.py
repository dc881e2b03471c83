"""Realistic event bodies with unique identities, built from the Evolution fixtures."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures" / "evolution_events.json"
_BASE = datetime(2025, 11, 4, 11, 0, tzinfo=UTC)


@cache
def _fixtures() -> tuple[dict[str, Any], ...]:
    items = json.loads(FIXTURES.read_text(encoding="utf-8"))
    # The re-emission is a duplicate by design; a unique stream leaves it out.
    return tuple(item for item in items if not item["name"].endswith("_REEMITTED"))


def _tag(data: Any, suffix: str) -> None:
    """Make the natural id of an event's data unique (message key id, call id, ...)."""
    target = data[0] if isinstance(data, list) and data else data
    if not isinstance(target, dict):
        return
    key = target.get("key")
    if isinstance(key, dict) and "id" in key:
        key["id"] = f"{key['id']}-{suffix}"
    for field in ("keyId", "id"):
        if isinstance(target.get(field), str):
            target[field] = f"{target[field]}-{suffix}"
            return


def unique_event(n: int, instance: str = "acme-sales") -> tuple[dict[str, Any], dict[str, Any], str]:
    """The ``n``-th unique event: (webhook body, RabbitMQ body, routing key)."""
    items = _fixtures()
    item = items[n % len(items)]
    stamp = (_BASE + timedelta(milliseconds=n)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    webhook = copy.deepcopy(item["webhook_body"])
    _tag(webhook["data"], f"b{n}")
    webhook["instance"] = instance
    webhook["date_time"] = stamp
    rabbitmq = {k: v for k, v in webhook.items() if k != "destination"}
    return webhook, rabbitmq, item["routing_key"]
