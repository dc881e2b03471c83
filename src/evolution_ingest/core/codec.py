"""JSON as both channels carry it: read, written and stored the same way everywhere.

orjson is the fast path. Two things it refuses are valid JSON an Evolution body can
hold, so each has a narrow fallback to the standard library:

* a lone surrogate (``"\\ud83d"``): WhatsApp text cut in the middle of an emoji, which
  Node's ``JSON.stringify`` writes as an escape. Read and written by :mod:`json`, with
  orjson's number rules (integers beyond 64 bits become doubles, as in JavaScript), so a
  body gives the same values, and so the same dedup key, whichever way it was read;
* nothing else: a body nested deeper than :data:`MAX_DEPTH` levels (orjson's limit
  when writing) is refused with a clear reason, the same way on both channels.

Postgres cannot hold NUL (``\\u0000``) in ``text`` or ``jsonb``, nor a lone surrogate in
``jsonb``. :func:`for_storage` then keeps the exact JSON text (pure ASCII, escapes
intact) beside a ``jsonb`` copy in which those characters read U+FFFD:
:func:`from_storage` gives the original back. It does the same for a body holding a whole
double of 1e16 or more within 64 bits (``5.6e+16``): ``jsonb`` keeps a decimal and gives it back
as an integer.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson

#: Deepest nesting written (orjson's own limit); deeper bodies are refused.
MAX_DEPTH: Final = 254
#: Characters Postgres cannot store as text: NUL, and lone UTF-16 surrogates.
_UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")
_I64_MIN: Final = -(2**63)
_U64_MAX: Final = 2**64 - 1


class JsonRefused(ValueError):
    """A value that cannot be read or written as JSON here; ``reason`` says why (for a 4xx)."""

    def __init__(self, reason: str, *, code: str = "malformed_json") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


# --- reading -----------------------------------------------------------------------------


def loads(raw: bytes | str) -> Any:
    """Parse JSON; :class:`JsonRefused` with the parser's reason when it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
        # A lone surrogate can only arrive as an escape; any other error is final.
        if b"\\ud" not in data and b"\\uD" not in data:
            raise JsonRefused(f"malformed JSON: {exc}") from None
        return _loads_with_surrogates(data)


def _integer(text: str) -> int | float:
    value = int(text)
    if _I64_MIN <= value <= _U64_MAX:
        return value
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"number {text[:40]}... is beyond the range of a double") from None


def _double(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is beyond the range of a double")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads_with_surrogates(data: bytes) -> Any:
    try:
        text = data.decode("utf-8")
        return json.loads(text, parse_int=_integer, parse_float=_double, parse_constant=_constant)
    except UnicodeDecodeError as exc:
        raise JsonRefused(f"malformed JSON: not UTF-8 at byte {exc.start}") from None
    except RecursionError:
        raise JsonRefused(f"malformed JSON: nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:
        raise JsonRefused(f"malformed JSON: {exc}") from None


# --- writing -----------------------------------------------------------------------------


def depth(value: Any) -> int:
    """How deeply arrays and objects nest in ``value`` (a scalar is 0)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        level += 1
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            break
        stack.extend((child, level) for child in children)
    return deepest


def _dumps_slow(
    value: Any, *, sort_keys: bool, default: Callable[[Any], Any] | None, indent: bool = False
) -> bytes:
    if depth(value) > MAX_DEPTH:
        raise JsonRefused(f"nested more than {MAX_DEPTH} levels deep", code="too_deep")
    try:
        text = json.dumps(
            value,
            ensure_ascii=True,
            sort_keys=sort_keys,
            separators=(",", ": ") if indent else (",", ":"),
            indent=2 if indent else None,
            allow_nan=False,
            default=default,
        )
    except (TypeError, ValueError, RecursionError) as exc:
        raise JsonRefused(f"cannot be written as JSON: {exc}", code="unstorable") from None
    return text.encode("ascii")


def dumps(value: Any, *, default: Callable[[Any], Any] | None = None, indent: bool = False) -> bytes:
    """JSON bytes of ``value``; lone surrogates are written as escapes."""
    try:
        return orjson.dumps(value, default=default, option=orjson.OPT_INDENT_2 if indent else None)
    except orjson.JSONEncodeError:
        return _dumps_slow(value, sort_keys=False, default=default, indent=indent)


def canonical(value: Any) -> bytes:
    """One byte string per JSON value, whatever its key order or whitespace (identity hashing)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return _dumps_slow(value, sort_keys=True, default=None)


# --- storing -----------------------------------------------------------------------------


def label(text: str) -> str:
    """``text`` with the characters Postgres, Redis and Prometheus cannot take shown as U+FFFD."""
    return text if text.isascii() and "\x00" not in text else _UNSTORABLE.sub("\ufffd", text)


def scrub(value: Any) -> Any:
    """A copy of ``value`` in which every string (and key) is :func:`label`-ed."""
    if isinstance(value, str):
        return label(value)
    if isinstance(value, dict):
        return {label(k): scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class StoredJson:
    """A body as the inbox keeps it."""

    #: For the ``jsonb`` column: the body, with NUL and lone surrogates shown as U+FFFD.
    jsonb: str
    #: The exact JSON text, only when ``jsonb`` had to change characters (else None).
    exact: str | None = None


def for_storage(value: Any) -> StoredJson:
    """Serialize a body for the inbox; :class:`JsonRefused` if it cannot be written at all."""
    try:
        text = orjson.dumps(value)
    except orjson.JSONEncodeError:
        exact = _dumps_slow(value, sort_keys=False, default=None).decode("ascii")
        return StoredJson(orjson.dumps(scrub(value)).decode(), exact)
    if b"\\u0000" in text:  # a false hit (an escaped backslash before "u0000") only costs a copy
        return StoredJson(orjson.dumps(scrub(value)).decode(), text.decode())
    if _LARGE_EXPONENT.search(text) and _has_integral_double(value):  # a false hit costs a walk
        return StoredJson(text.decode(), text.decode())
    return StoredJson(text.decode())


#: A number written with an exponent of 16 or more (orjson writes doubles from 1e16 up so).
_LARGE_EXPONENT: Final = re.compile(rb"\de\+?(?:1[6-9]|[2-9]\d|\d{3})")


def _has_integral_double(value: Any) -> bool:
    """Whether ``value`` holds a double such as 5.6e16: whole, and within 64 bits, which jsonb
    (a decimal) gives back as the integer 56000000000000000 -- the exact text must be kept."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif (
            isinstance(item, float)
            and item.is_integer()
            and abs(item) >= 1e16
            and _I64_MIN <= item <= _U64_MAX
        ):
            return True
    return False


def from_storage(jsonb: Any, exact: str | None) -> Any:
    """The body as it was received, from what :func:`for_storage` made of it."""
    return jsonb if exact is None else loads(exact)
