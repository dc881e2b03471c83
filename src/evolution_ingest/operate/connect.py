"""``connect``: set every Evolution instance's webhook and RabbitMQ events to match this service.

Each instance's settings are read through Evolution's REST API, compared with what this
service's settings call for, and set only where they differ (running it twice changes
nothing). What lives in Evolution's environment — its global webhook, RabbitMQ's global mode,
exposing the ``apikey`` — cannot be set over REST: ``connect`` prints the exact lines to add.
Secrets (the webhook token, JWT key, RabbitMQ password) are never printed: placeholders name
the setting that holds each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

from evolution_ingest.config import RabbitMode, Settings, WebhookAuth
from evolution_ingest.core.redaction import REDACTED, Redactor
from evolution_ingest.stores.counters import Counters
from evolution_ingest.stores.evolution import (
    SOURCE_HEADER,
    EvolutionApi,
    EvolutionError,
    env_name,
    event_of,
    setting_name,
)

WEBHOOK_MODES: Final = ("instance", "global")


@dataclass(slots=True)
class Change:
    field: str
    current: Any
    desired: Any


@dataclass(slots=True)
class Setting:
    """One instance's webhook or RabbitMQ settings: what differs, and what was done about it."""

    desired: dict[str, Any] | None
    changes: list[Change] = field(default_factory=list)
    #: unchanged, set, would set, left alone (why), failed (why)
    action: str = "unchanged"


@dataclass(slots=True)
class InstancePlan:
    name: str
    state: str | None
    webhook: Setting
    rabbitmq: Setting
    delivered: dict[str, bool] = field(default_factory=lambda: {"webhook": False, "rabbitmq": False})


@dataclass(slots=True)
class ConnectReport:
    instances: list[InstancePlan] = field(default_factory=list)
    #: Lines to add to Evolution's environment (what REST cannot set).
    environment: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Instances named with ``--instance`` that Evolution does not have.
    missing: list[str] = field(default_factory=list)
    waited_seconds: float | None = None

    @property
    def failed(self) -> bool:
        failed = any(s.action.startswith("failed") for p in self.instances for s in (p.webhook, p.rabbitmq))
        return failed or bool(self.missing)


class Connector:
    def __init__(self, api: EvolutionApi, settings: Settings, *, webhook_mode: str = "instance") -> None:
        self._api = api
        self._settings = settings
        self._webhook_mode = webhook_mode
        self._redact = Redactor(secrets=settings.own_secrets)
        self._events = list(dict.fromkeys(settings.rabbitmq_events))

    # --- what this service calls for -----------------------------------------------------------
    def settable_events(self) -> list[str]:
        return sorted({name for e in self._events if (name := setting_name(e))})

    def webhook_url(self, *, shown: bool = False) -> str:
        base = self._settings.public_webhook_url
        if WebhookAuth.URL_TOKEN not in self._settings.auth_methods or self._settings.webhook_token is None:
            return base
        token = (
            "<EVOLUTION_INGEST_WEBHOOK_TOKEN>" if shown else self._settings.webhook_token.get_secret_value()
        )
        return f"{base}/t/{token}"

    def desired_webhook(self) -> dict[str, Any]:
        settings = self._settings
        headers = {SOURCE_HEADER: "instance"}
        if WebhookAuth.HEADER in settings.auth_methods and settings.webhook_token is not None:
            headers[settings.webhook_token_header] = settings.webhook_token.get_secret_value()
        if WebhookAuth.JWT in settings.auth_methods and settings.webhook_jwt_key is not None:
            headers["jwt_key"] = settings.webhook_jwt_key.get_secret_value()
        return {
            "enabled": True,
            "url": self.webhook_url(),
            "headers": headers,
            "byEvents": False,
            "base64": settings.webhook_base64,
            "events": self.settable_events(),
        }

    def _points_here(self, url: Any) -> bool:
        return isinstance(url, str) and url.startswith(self._settings.public_webhook_url)

    def desired_for(self, name: str, current_webhook: dict[str, Any] | None) -> tuple[Setting, Setting]:
        if self._webhook_mode == "instance":
            webhook = Setting(self.desired_webhook())
        elif (
            current_webhook
            and current_webhook.get("enabled")
            and self._points_here(current_webhook.get("url"))
        ):
            # The global webhook delivers here: an instance webhook here too would double every event.
            webhook = Setting({"enabled": False, "url": current_webhook["url"], "events": []})
        else:
            webhook = Setting(None, action="left alone (the global webhook delivers its events)")
        settings = self._settings
        listed = name in settings.rabbitmq_instances
        if settings.rabbitmq_mode is RabbitMode.GLOBAL or (
            settings.rabbitmq_mode is RabbitMode.OWN and not listed
        ):
            # Per-instance queues would have no consumer and grow: the global exchange carries every event.
            rabbitmq = Setting({"enabled": False, "events": []})
        elif listed:
            rabbitmq = Setting({"enabled": True, "events": self.settable_events()})
        else:
            rabbitmq = Setting(
                None, action="left alone (add it to EVOLUTION_INGEST_RABBITMQ_INSTANCES to consume it)"
            )
        return webhook, rabbitmq

    # --- reading, comparing, setting ----------------------------------------------------------
    def _shown(self, name: str, value: Any) -> Any:
        if name == "url" and isinstance(value, str):
            return self._redact.url(value)
        if name == "headers" and isinstance(value, dict):
            return {k: v if k == SOURCE_HEADER else REDACTED for k, v in value.items()}
        return value

    def _compare(self, setting: Setting, current: dict[str, Any] | None, keys: dict[str, str]) -> None:
        if setting.desired is None:
            return
        current = current or {}
        for name, stored in keys.items():
            if name not in setting.desired:
                continue
            want, have = setting.desired[name], current.get(stored)
            if name == "events":
                want, have = sorted(want), sorted(have or [])
                if not setting.desired.get("enabled") and not have:
                    continue  # disabled either way
            if name == "headers":
                have = have or {}
            if isinstance(want, bool):  # Evolution's default for an unset flag is false
                have = bool(have)
            if want != have:
                setting.changes.append(Change(name, self._shown(name, have), self._shown(name, want)))

    async def plan(self, only: list[str] | None = None) -> ConnectReport:
        report = ConnectReport(environment=self.environment_lines(), notes=self.notes())
        instances = await self._api.instances()
        names = [str(i.get("name")) for i in instances if i.get("name")]
        states = {str(i.get("name")): i.get("connectionStatus") for i in instances}
        report.missing = sorted(set(only or []) - set(names))
        for name in sorted(n for n in names if not only or n in only):
            current_webhook = await self._api.webhook(name)
            current_rabbitmq = await self._api.rabbitmq(name)
            webhook, rabbitmq = self.desired_for(name, current_webhook)
            self._compare(
                webhook, current_webhook,
                {"enabled": "enabled", "url": "url", "headers": "headers", "byEvents": "webhookByEvents",
                 "base64": "webhookBase64", "events": "events"},
            )  # fmt: skip
            self._compare(rabbitmq, current_rabbitmq, {"enabled": "enabled", "events": "events"})
            for setting in (webhook, rabbitmq):
                if setting.changes:
                    setting.action = "would set"
            plan = InstancePlan(name, states.get(name), webhook, rabbitmq)
            if rabbitmq.desired is None:  # not consumed here: no RabbitMQ delivery to wait for
                del plan.delivered["rabbitmq"]
            report.instances.append(plan)
        return report

    async def apply(self, report: ConnectReport) -> None:
        for plan in report.instances:
            for kind, setting in (("webhook", plan.webhook), ("rabbitmq", plan.rabbitmq)):
                if not setting.changes or setting.desired is None:
                    continue
                try:
                    if kind == "webhook":
                        await self._api.set_webhook(plan.name, setting.desired)
                    else:
                        await self._api.set_rabbitmq(plan.name, setting.desired)
                except EvolutionError as exc:
                    setting.action = f"failed: {exc.message}"
                else:
                    setting.action = "set"

    async def wait(
        self, report: ConnectReport, counters: Counters, *, since: float, within: float,
        progress: Callable[[int, int], None],
    ) -> None:  # fmt: skip
        """Until each connected instance has delivered on both channels since ``since`` (bounded)."""
        waiting = [p for p in report.instances if p.state == "open"]
        started = time.monotonic()
        while True:
            seen = await counters.read_last_seen()
            for plan in waiting:
                for channel in ("webhook", "rabbitmq"):
                    plan.delivered[channel] = seen.get(plan.name, {}).get(channel, 0.0) >= since
            done = sum(all(p.delivered.values()) for p in waiting)
            progress(done, len(waiting))
            if done == len(waiting) or time.monotonic() - started >= within:
                break
            await asyncio.sleep(1.0)
        report.waited_seconds = round(time.monotonic() - started, 1)

    # --- what only Evolution's environment can do ---------------------------------------------
    def _rabbitmq_uri(self) -> str:
        parts = urlsplit(self._settings.rabbitmq_url)
        if parts.password is None:
            return self._settings.rabbitmq_url
        netloc = f"{parts.username}:<password>@{parts.netloc.rpartition('@')[2]}"
        return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))

    def environment_lines(self) -> list[str]:
        settings = self._settings
        lines: list[str] = []
        if self._webhook_mode == "global":
            lines += ["WEBHOOK_GLOBAL_ENABLED=true", f"WEBHOOK_GLOBAL_URL={self.webhook_url(shown=True)}",
                      "WEBHOOK_GLOBAL_WEBHOOK_BY_EVENTS=false"]  # fmt: skip
            lines += [f"WEBHOOK_EVENTS_{env_name(e)}=true" for e in self._events]
        lines += ["RABBITMQ_ENABLED=true", f"RABBITMQ_URI={self._rabbitmq_uri()}"]
        if settings.rabbitmq_mode is RabbitMode.GLOBAL:
            lines += [f"RABBITMQ_EXCHANGE_NAME={settings.rabbitmq_exchange}", "RABBITMQ_GLOBAL_ENABLED=true"]
            lines.append(
                f"RABBITMQ_PREFIX_KEY={settings.rabbitmq_prefix}"
                if settings.rabbitmq_prefix
                else "# RABBITMQ_PREFIX_KEY unset"
            )
            lines += [f"RABBITMQ_EVENTS_{env_name(e)}=true" for e in self._events]
        else:
            lines.append("RABBITMQ_GLOBAL_ENABLED=false")
        if WebhookAuth.APIKEY in settings.auth_methods:
            lines.append("AUTHENTICATION_EXPOSE_IN_FETCH_INSTANCES=true")
        return lines

    def notes(self) -> list[str]:
        methods = self._settings.auth_methods
        notes = []
        if self._webhook_mode == "global" and WebhookAuth.URL_TOKEN not in methods and methods:
            notes.append(
                "the global webhook sends no headers: add url_token to EVOLUTION_INGEST_WEBHOOK_AUTH"
            )
        if methods == {WebhookAuth.APIKEY}:
            notes.append(
                "apikey auth passes only with AUTHENTICATION_EXPOSE_IN_FETCH_INSTANCES=true in Evolution's "
                "environment: by default Evolution sends apikey null and every call is refused"
            )
        if not methods:
            notes.append(
                "webhook auth is off (EVOLUTION_INGEST_WEBHOOK_AUTH): anyone who reaches the port can inject events"
            )
        skipped = [e for e in self._events if setting_name(e) is None]
        if skipped:
            notes.append(f"instance settings cannot subscribe to: {', '.join(skipped)}")
        if "groups.update" in self._events:
            notes.append(
                f"Evolution never delivers {event_of('GROUP_UPDATE')} (it subscribes GROUP_UPDATE but emits "
                "GROUPS_UPDATE): group subject and description changes reach no channel"
            )
        return notes


def _change(change: Change) -> dict[str, Any]:
    return {"field": change.field, "current": change.current, "desired": change.desired}


def report_data(report: ConnectReport) -> dict[str, Any]:
    """JSON-ready (``--json``): secrets are already out of every value."""
    return {
        "instances": [
            {
                "name": p.name,
                "state": p.state,
                "webhook": {"action": p.webhook.action, "changes": [_change(c) for c in p.webhook.changes]},
                "rabbitmq": {
                    "action": p.rabbitmq.action,
                    "changes": [_change(c) for c in p.rabbitmq.changes],
                },
                "delivered": p.delivered,
            }
            for p in report.instances
        ],
        "evolution_environment": report.environment,
        "notes": report.notes,
        "missing_instances": report.missing,
        "waited_seconds": report.waited_seconds,
    }
