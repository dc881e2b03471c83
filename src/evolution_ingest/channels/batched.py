"""Batched forwards: many saved events in one request to the webhook app, answered as each ends.

A forward costs both processes an HTTP request and its answer whatever the event; under
load most of a forward's cost is that, not the event. The forwarder therefore sends the
forwards made in one turn of its event loop together, on the same URL as a single forward
(``POST /api/internal/webhook``, the internal secret in its header), with the content type
:data:`FORWARDS_TYPE`. The body holds one line per event::

    <dedup key, 64 hex characters> <the body of a single forward, compact JSON>\\n

Compact JSON never holds a raw line break (one in a string is escaped), so a line is an
event. The webhook app runs every entry as if it had come alone, at once, and answers
``200`` with :data:`BATCH_HEADER`, then streams one JSON line per entry as soon as it has
ended, in whatever order they end (a slow handler holds back only its own entry)::

    {"i": <the entry's line number, from 0>, "status": <the HTTP status a single forward
     would have had>, "outcome": <its x-evolution-ingest-outcome, or null>, "answer": <its body>}

So each entry's answer is read exactly as the answer to a single forward.
"""

from __future__ import annotations

from typing import Any, Final

from evolution_ingest.core import codec

#: The content type of a batch of forwards (on the request).
FORWARDS_TYPE: Final = "application/x-evolution-ingest-forwards"
#: On the answer to a batch: the webhook app took it as a batch (an older one would not).
BATCH_HEADER: Final = "x-evolution-ingest-batch"
#: The content type of the answer: one JSON object per line.
ANSWERS_TYPE: Final = "application/x-ndjson"
_KEY_LENGTH: Final = 64


def forward_line(dedup_key: str, payload: bytes) -> bytes:
    """One entry of a batch: the event's key and its forward body (compact JSON)."""
    return b"%s %s\n" % (dedup_key.encode("ascii"), payload)


def parse_forwards(raw: bytes) -> list[tuple[str | None, bytes]]:
    """The entries of a batch: ``(key, body)``, or ``(None, line)`` for a line that is not one."""
    entries: list[tuple[str | None, bytes]] = []
    for line in raw.split(b"\n"):
        if not line:
            continue
        if len(line) > _KEY_LENGTH + 1 and line[_KEY_LENGTH] == 0x20:
            entries.append((line[:_KEY_LENGTH].decode("latin-1"), line[_KEY_LENGTH + 1 :]))
        else:
            entries.append((None, line))
    return entries


def answer_line(index: int, status: int, outcome: str | None, answer: bytes) -> bytes:
    """One line of the answer to a batch (``answer``: the JSON body a single forward would get)."""
    said = codec.dumps(outcome) if outcome is not None else b"null"
    return b'{"i":%d,"status":%d,"outcome":%s,"answer":%s}\n' % (index, status, said, answer)


def read_answer_line(line: bytes) -> tuple[int, int, str | None, Any] | None:
    """``(index, status, outcome, answer)`` of one line of the answer; None if it is not one."""
    try:
        item = codec.loads(line)
    except codec.JsonRefused:
        return None
    if not isinstance(item, dict):
        return None
    index, status, outcome = item.get("i"), item.get("status"), item.get("outcome")
    if not isinstance(index, int) or not isinstance(status, int):
        return None
    return index, status, outcome if isinstance(outcome, str) else None, item.get("answer")
