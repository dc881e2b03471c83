"""Mutated Evolution bodies for the fuzz tests: structural (fields removed, replaced, nested) and
byte-level (truncation, invalid UTF-8, lone surrogates, deep nesting, huge numbers, duplicate keys).

Every case is reproducible from its seed; ``Case.name`` says which mutation made it.
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tests.support import fixtures

ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1.5, -0.0, 2**53 + 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, 1e308,
    5e-324, "", " ", "\u0000", "a\u0000b", "\ud800", "\udfff", "x\ud83d", "\ud83d\ude00", "😀" * 500,
    "é" * 3, "\u202e\u2066", "\ufeff", "a" * 70_000, [], {}, [None], {"": ""}, {"\u0000": 1},
    {"\ud800": "key"}, {"$where": "1"}, "null", "[]", "{}", "Robert'); DROP TABLE students;--",
    "../../etc/passwd", "%s%n", "\\u0000", "<script>alert(1)</script>",
]  # fmt: skip
ENVELOPE = ("event", "instance", "data", "date_time", "destination", "sender", "server_url", "apikey")


@dataclass(frozen=True)
class Case:
    name: str
    body: bytes
    routing_key: str


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, (*prefix, index))


def _set(root: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = root
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = value
    return root


def _get(root: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        root = root[part]
    return root


def _nest(value: Any, levels: int, rng: random.Random) -> Any:
    for _ in range(levels):
        value = [value] if rng.random() < 0.5 else {"n": value}
    return value


_SURROGATE = re.compile("[\ud800-\udfff]")


def node_json(value: Any) -> bytes:
    """JSON as Node's ``JSON.stringify`` writes it: UTF-8, with lone surrogates as escapes."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return _SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", text).encode()


# --- structural ----------------------------------------------------------------------------


def remove_field(body: dict[str, Any], rng: random.Random) -> tuple[str, Any]:
    path = rng.choice(list(_paths(body))[1:])
    parent = _get(body, path[:-1])
    if isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent.pop(path[-1])
    return f"remove {'.'.join(map(str, path))}", body


def replace_field(body: dict[str, Any], rng: random.Random) -> tuple[str, Any]:
    top = rng.random() < 0.5
    path = (rng.choice(ENVELOPE),) if top else rng.choice(list(_paths(body))[1:])
    value = copy.deepcopy(rng.choice(ODD_VALUES))
    if top and path[0] not in body:
        body[path[0]] = value
    else:
        _set(body, path, value)
    return f"replace {'.'.join(map(str, path))} by {type(value).__name__}", body


def nest_field(body: dict[str, Any], rng: random.Random) -> tuple[str, Any]:
    path = rng.choice(list(_paths(body))[1:])
    levels = rng.choice([1, 2, 10, 100, 252, 253, 254, 255, 300])
    _set(body, path, _nest(_get(body, path), levels, rng))
    return f"nest {'.'.join(map(str, path))} {levels} deep", body


def add_extra(body: dict[str, Any], rng: random.Random) -> tuple[str, Any]:
    name = rng.choice(["already_saved", "isLatest", "progress", "extra", "\u0000", "", "data ", "api_key"])
    body[name] = copy.deepcopy(rng.choice(ODD_VALUES))
    return f"add {name!r}", body


STRUCTURAL: list[Callable[[dict[str, Any], random.Random], tuple[str, Any]]] = [
    remove_field, replace_field, replace_field, replace_field, nest_field, add_extra,
]  # fmt: skip


# --- byte-level ----------------------------------------------------------------------------


def truncate(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    at = rng.randrange(0, len(raw))
    return f"truncate at {at}", raw[:at]


def invalid_utf8(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    junk = rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xc0\xaf"])
    at = rng.randrange(0, len(raw))
    return f"invalid UTF-8 {junk!r} at {at}", raw[:at] + junk + raw[at:]


def lone_surrogate(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    """A lone surrogate escape inside a JSON string (valid JSON, which orjson refuses)."""
    escape = rng.choice([b"\\ud800", b"\\udfff", b"\\uD83D", b"\\ude00x", b"\\ud83d\\ud83d"])
    quotes = [i for i, byte in enumerate(raw) if byte == ord('"')]
    at = rng.choice(quotes) + 1
    return f"surrogate {escape!r} at {at}", raw[:at] + escape + raw[at:]


def deep_nesting(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    levels = rng.choice([200, 254, 255, 600, 1100, 50_000])
    nested = b"[" * levels + b"0" + b"]" * levels
    return f"data nested {levels} deep", raw.replace(b'"data":', b'"data":' + nested + b',"was":', 1)


def huge_number(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    number = rng.choice([b"1e400", b"-1e400", b"1e-400", b"123456789012345678901234567890", b"-0", b"1" * 5000,
                         b"18446744073709551616", b"9" * 400 + b".5", b"0.0000000000000000000000001"])  # fmt: skip
    return f"number {number[:20]!r}", raw.replace(b'"data":', b'"n":' + number + b',"data":', 1)


def duplicate_keys(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    field = rng.choice(
        [b'"event":"call"', b'"instance":"other"', b'"data":null', b'"data":{}', b'"apikey":1']
    )
    return f"duplicate {field!r}", b"{" + field + b"," + raw[1:]


def random_bytes(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    out = bytearray(raw)
    for _ in range(rng.randint(1, 8)):
        at = rng.randrange(0, len(out))
        if rng.random() < 0.5:
            out[at] = rng.randrange(256)
        else:
            del out[at]
    return "random bytes", bytes(out)


def odd_framing(raw: bytes, rng: random.Random) -> tuple[str, bytes]:
    frame = rng.choice(
        [(b"\xef\xbb\xbf", b""), (b"", b"garbage"), (b"  \n", b"\n  "), (b"[", b"]"), (b"", b"}")]
    )
    return f"framing {frame!r}", frame[0] + raw + frame[1]


BYTE_LEVEL: list[Callable[[bytes, random.Random], tuple[str, bytes]]] = [
    truncate, invalid_utf8, lone_surrogate, lone_surrogate, deep_nesting, huge_number, duplicate_keys,
    random_bytes, odd_framing,
]  # fmt: skip


def cases(count: int, seed: int, form: str = "webhook_body") -> list[Case]:
    """``count`` mutated bodies (half structural, half byte-level), reproducible from ``seed``."""
    rng = random.Random(seed)
    items = fixtures()
    made = []
    for number in range(count):
        item = rng.choice(items)
        body = copy.deepcopy(item[form])
        # A distinct emission, so that mutations that keep the event valid store a new event.
        body["date_time"] = f"2026-01-01T00:00:{number % 60:02d}.{number:06d}Z"
        if isinstance(body.get("data"), dict):
            body["data"]["fuzz"] = f"{seed}-{number}"
        if number % 2 == 0:
            name, mutated = rng.choice(STRUCTURAL)(body, rng)
            raw = node_json(mutated)
        else:
            name, raw = rng.choice(BYTE_LEVEL)(node_json(body), rng)
        made.append(Case(f"#{number} {item['name']}: {name}", raw, item["routing_key"]))
    return made
