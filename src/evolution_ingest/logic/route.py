"""What a route is, and which events it matches.

Matching is pure: :meth:`Route.matches` looks only at the event and at what the
caller knows about the instance (``was_connected``). The file that holds the routes
is read by :mod:`evolution_ingest.logic.routes_file`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from evolution_ingest.core.events import Event
from evolution_ingest.core.identity import MESSAGE_EVENTS, normalize_event_name

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,79}$"


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str | dict) else value


GlobList = Annotated[list[str], BeforeValidator(_as_list)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Condition(Strict):
    """A test on one dotted path into ``data``; a bare value means ``equals``, a list means ``in``."""

    equals: Any = None
    in_: list[Any] | None = Field(default=None, alias="in")
    regex: str | None = None
    exists: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, list):
            return {"in": value}
        return value if isinstance(value, dict) else {"equals": value}

    @property
    def has_equals(self) -> bool:
        # ``equals: null`` is a real test, so "given" is not "not None".
        return "equals" in self.model_fields_set

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return value

    @model_validator(mode="after")
    def _one_test(self) -> Condition:
        if not (self.has_equals or self.in_ is not None or self.regex is not None or self.exists is not None):
            raise ValueError("give a value, or one of: equals, in, regex, exists")
        return self

    def test(self, found: bool, value: Any) -> bool:
        if self.exists is not None and found != self.exists:
            return False
        if self.has_equals and not (found and value == self.equals):
            return False
        if self.in_ is not None and not (found and value in self.in_):
            return False
        return self.regex is None or (
            found and isinstance(value, str | int | float) and re.search(self.regex, str(value)) is not None
        )


class Match(Strict):
    """Every condition given must hold; an omitted one matches anything."""

    events: GlobList = Field(default_factory=lambda: ["*"])
    instances: GlobList = Field(default_factory=lambda: ["*"])
    from_me: bool | None = None
    chat: Literal["group", "direct"] | None = None
    message_type: GlobList | None = None
    sender: GlobList | None = None
    #: The instance had been connected (a ``connection.update`` with state ``open`` seen before).
    was_connected: bool | None = None
    data: dict[str, Condition] = Field(default_factory=dict)

    @field_validator("events")
    @classmethod
    def _event_names(cls, value: list[str]) -> list[str]:
        return [
            pattern if any(c in pattern for c in "*?[") else normalize_event_name(pattern)
            for pattern in value
        ]


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL")
    return value


class Destination(Strict):
    url: Annotated[str, BeforeValidator(str)]
    method: Literal["POST", "PUT", "PATCH"] = "POST"
    headers: dict[str, str] = Field(default_factory=dict)
    timeout_seconds: float = Field(default=10.0, gt=0)
    #: Send the instance apikey along with the event (it is removed by default).
    include_apikey: bool = False

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        return _url(value)


Sink = Literal["log", "webhook"]
_LOG_ONLY: list[Sink] = ["log"]


class Alert(Strict):
    #: ``{instance}``, ``{event}``, ``{date_time}``, ``{data.state}``... (missing fields show as ``?``).
    message: str = Field(min_length=1)
    cooldown_seconds: float = Field(default=300.0, ge=0)
    sinks: list[Sink] = Field(default_factory=_LOG_ONLY.copy, min_length=1)
    webhook_url: str | None = None
    timeout_seconds: float = Field(default=10.0, gt=0)

    @field_validator("webhook_url")
    @classmethod
    def _webhook(cls, value: str | None) -> str | None:
        return None if value is None else _url(value)


class Route(Strict):
    name: str = Field(pattern=_NAME)
    match: Match = Field(default_factory=Match)
    forward: Annotated[list[Destination], BeforeValidator(_as_list)] = Field(default_factory=list)
    #: Stop here: routes after this one are not looked at for a matching event.
    drop: bool = False
    alert: Alert | None = None

    @model_validator(mode="after")
    def _has_an_action(self) -> Route:
        if not (self.forward or self.drop or self.alert):
            raise ValueError("give at least one action: forward, drop or alert")
        return self

    def destination_key(self, index: int) -> str:
        return self.name if index == 0 else f"{self.name}#{index + 1}"

    def matches(self, event: Event, *, was_connected: Callable[[], bool] | None = None) -> bool:
        m = self.match
        if not any(fnmatch.fnmatchcase(event.event, p) for p in m.events):
            return False
        if not any(fnmatch.fnmatchcase(event.instance, p) for p in m.instances):
            return False
        facts = MessageFacts.of(event)
        if m.from_me is not None and facts.from_me is not m.from_me:
            return False
        if m.chat is not None and facts.chat != m.chat:
            return False
        if m.message_type is not None and not _any_glob(m.message_type, [facts.message_type]):
            return False
        if m.sender is not None and not _any_glob(m.sender, facts.senders):
            return False
        for path, condition in m.data.items():
            found, value = lookup(event.data, path)
            if not condition.test(found, value):
                return False
        return m.was_connected is None or (was_connected is not None and was_connected() is m.was_connected)


class MessageFacts:
    """What message filters look at, read from Evolution's shapes (``key`` object or flat).

    Only message events have them; for any other event a message filter does not match.
    """

    __slots__ = ("chat", "from_me", "message_type", "senders")

    def __init__(
        self, from_me: bool | None, chat: str | None, message_type: str | None, senders: list[str]
    ) -> None:
        self.from_me = from_me
        self.chat = chat
        self.message_type = message_type
        self.senders = senders

    @classmethod
    def of(cls, event: Event) -> MessageFacts:
        data = event.data
        if event.event not in MESSAGE_EVENTS or not isinstance(data, dict):
            return cls(None, None, None, [])
        key = data["key"] if isinstance(data.get("key"), dict) else data
        from_me = key.get("fromMe") if isinstance(key.get("fromMe"), bool) else None
        remote = key.get("remoteJid") if isinstance(key.get("remoteJid"), str) else None
        chat = None
        if remote:
            chat = (
                "group"
                if remote.endswith("@g.us")
                else "direct"
                if remote.endswith(("@s.whatsapp.net", "@lid"))
                else None
            )
        if from_me:
            candidates = [event.payload.get("sender")]
        elif chat == "group":
            candidates = [key.get("participant"), key.get("participantAlt")]
        else:
            candidates = [remote, key.get("remoteJidAlt")]
        message_type = data.get("messageType") if isinstance(data.get("messageType"), str) else None
        return cls(from_me, chat, message_type, [c for c in candidates if isinstance(c, str)])


def _any_glob(patterns: list[str], values: Sequence[str | None]) -> bool:
    return any(v is not None and fnmatch.fnmatchcase(v, p) for p in patterns for v in values)


def lookup(data: Any, path: str) -> tuple[bool, Any]:
    """``key.remoteJid`` or ``participants.0`` into ``data``: (found, value)."""
    current = data
    for part in path.split("."):
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        else:
            return False, None
    return True, current


# --- loading -------------------------------------------------------------------------------
