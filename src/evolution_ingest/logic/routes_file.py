"""The routes file: which events go where, which are dropped, which raise an alert.

YAML (``.yaml``/``.yml``) or TOML (``.toml``), path in ``EVOLUTION_INGEST_ROUTES_FILE``,
read and checked once at start-up. ``${NAME}`` (or ``${NAME:-default}``) in any
string is replaced by the environment variable, so secrets stay out of the file.
A mistake stops start-up with a message naming the route and the field. What a
route matches is in :mod:`evolution_ingest.logic.route`.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from evolution_ingest.config import ENV_PREFIX, ConfigError, Settings
from evolution_ingest.logic.route import Alert, Route, Strict

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class RoutesFile(Strict):
    routes: list[Route] = Field(min_length=1)
    #: Used by alerts that list the ``webhook`` sink without a ``webhook_url`` of their own.
    alert_webhook_url: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> RoutesFile:
        seen: set[str] = set()
        for route in self.routes:
            if route.name in seen:
                raise ValueError(f"route name {route.name!r} is used twice")
            seen.add(route.name)
            alert = route.alert
            if alert and "webhook" in alert.sinks and not (alert.webhook_url or self.alert_webhook_url):
                raise ValueError(f"route {route.name!r}: alert.sinks has 'webhook' but no webhook_url is set")
        return self

    def alert_url(self, alert: Alert) -> str | None:
        return alert.webhook_url or self.alert_webhook_url


def _substitute(value: Any, path: list[Any], errors: list[tuple[list[Any], str]]) -> Any:
    if isinstance(value, str):

        def replace(match: re.Match[str]) -> str:
            name, default = match[1], match[2]
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            errors.append((path, f"environment variable {name} is not set"))
            return ""

        return _ENV_REF.sub(replace, value)
    if isinstance(value, dict):
        return {k: _substitute(v, [*path, k], errors) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, [*path, i], errors) for i, v in enumerate(value)]
    return value


def _where(raw: Any, loc: list[Any]) -> str:
    """``route 'crm' (#2), field forward.url`` from a location like ['routes', 1, 'forward', 'url']."""
    if len(loc) >= 2 and loc[0] == "routes" and isinstance(loc[1], int):
        routes = raw.get("routes") if isinstance(raw, dict) else None
        name = None
        if isinstance(routes, list) and loc[1] < len(routes) and isinstance(routes[loc[1]], dict):
            name = routes[loc[1]].get("name")
        field = ".".join(str(part) for part in loc[2:]) or "(the route itself)"
        return (
            f"route {name!r} (#{loc[1] + 1}), field {field}"
            if name
            else f"route #{loc[1] + 1}, field {field}"
        )
    return "field " + (".".join(str(part) for part in loc) or "(top level)")


def configured_routes(settings: Settings) -> RoutesFile | None:
    """The routes file of the settings, read and checked (``ConfigError`` names the route and field)."""
    routes = load_routes(settings.routes_file) if settings.routes_file else None
    if routes is not None and not settings.keep_apikey:
        keeping = [r.name for r in routes.routes if any(d.include_apikey for d in r.forward)]
        if keeping:
            raise ConfigError(
                f"{ENV_PREFIX}ROUTES_FILE: route(s) {', '.join(keeping)} set include_apikey, but the "
                f"apikey is not kept: set {ENV_PREFIX}KEEP_APIKEY=true to store and forward it"
            )
    return routes


def load_routes(path: Path) -> RoutesFile:
    """Read and check a routes file; :class:`ConfigError` says which route and field is wrong."""
    setting = f"{ENV_PREFIX}ROUTES_FILE ({path})"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read it: {exc.strerror}") from None
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"{setting}: not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {exc}"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{setting}: the file must hold a mapping with a 'routes' list")
    errors: list[tuple[list[Any], str]] = []
    substituted = _substitute(raw, [], errors)
    if errors:
        raise ConfigError(f"{setting}: " + "; ".join(f"{_where(raw, loc)}: {msg}" for loc, msg in errors))
    try:
        return RoutesFile.model_validate(substituted)
    except ValidationError as exc:
        lines = []
        for error in exc.errors(include_url=False):
            message = error["msg"].removeprefix("Value error, ")
            lines.append(f"{_where(raw, list(error['loc']))}: {message}")
        raise ConfigError(f"{setting}:\n  " + "\n  ".join(lines)) from None
