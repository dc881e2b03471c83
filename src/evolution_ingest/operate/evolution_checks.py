"""``check``, Evolution's side: set-ups that look right and still lose or repeat events.

* Evolution queues with no consumer: Evolution declares and binds a queue for every event it
  publishes (``<prefix>.<event>`` on its exchange, ``<instance>.<event>`` on an instance's); one
  this service does not consume (another prefix, another mode, an event not consumed) grows
  forever. Found by probing the names Evolution would give them (AMQP cannot list queues).
* Bindings this service expects that are missing: AMQP cannot list bindings either, so they are
  inferred — an exchange or a queue that does not exist has no binding; the worker and
  ``topology`` declare both, and the queue with its binding.
* Instance settings that differ from what ``connect`` would set (with ``EVOLUTION_URL``).
* Double webhooks: an instance's events arriving through its instance webhook and the global one.
* A webhook auth method that cannot pass with Evolution's settings (lately refused calls say why).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Final

import aio_pika
from aio_pika.abc import AbstractConnection

from evolution_ingest.config import RabbitMode, Settings, WebhookAuth
from evolution_ingest.core.identity import EMITTED_EVENTS
from evolution_ingest.core.stored import as_evolution_time
from evolution_ingest.operate.connect import Connector
from evolution_ingest.operate.errors import STORE_ERRORS
from evolution_ingest.stores import Stores
from evolution_ingest.stores.evolution import APIKEY_NULL, EvolutionApi, EvolutionError, env_name
from evolution_ingest.stores.queues import BROKER_ERRORS, Topology, evolution_queue, queue_states

Add = Callable[[str, str, str], None]

#: Deliveries and refusals this recent say how Evolution is set up now.
RECENT_SECONDS: Final = 3600.0
#: Per-instance queues are probed for at most this many instances.
MAX_PROBED_INSTANCES: Final = 100
#: Prefixes Evolution's queues may have besides this service's: none, and Evolution's example one.
_OTHER_PREFIXES: Final = ("", "evolution")


async def check(stores: Stores, settings: Settings, add: Add) -> None:
    seen: dict[str, dict[str, float]] = {}
    paths: dict[str, dict[str, float]] = {}
    with contextlib.suppress(*STORE_ERRORS):
        seen = await stores.counters.read_last_seen()
        paths = await stores.counters.read_webhook_paths()
    now = time.time()
    recent = {
        instance: {path for path, at in called.items() if now - at < RECENT_SECONDS}
        for instance, called in paths.items()
    }
    instances = {name for name in seen if name}
    if settings.evolution_url and settings.evolution_api_key:
        api = EvolutionApi(
            settings.evolution_url,
            settings.evolution_api_key.get_secret_value(),
            timeout=settings.evolution_timeout_seconds,
        )
        try:
            states = await _compare_with_connect(api, settings, recent, add)
            instances |= set(states)
            await _stored_messages(api, stores, [n for n, state in states.items() if state == "open"], add)
        finally:
            await api.close()
    await _queues(settings, sorted(instances), add)
    _double_webhooks(recent, add)
    await _auth(stores, settings, add)


async def _compare_with_connect(
    api: EvolutionApi, settings: Settings, recent: dict[str, set[str]], add: Add
) -> dict[str, str | None]:
    """Instances whose settings differ from what ``connect`` would set; returns each one's state."""
    mode = "global" if any("global" in paths for paths in recent.values()) else "instance"
    try:
        report = await Connector(api, settings, webhook_mode=mode).plan()
    except EvolutionError as exc:
        add("evolution api", "fail", f"{api.url}: {exc.message} (connect, this check and backfill need it)")
        return {}
    add("evolution api", "ok", f"{api.url}: {len(report.instances)} instance(s)")
    differing = [
        f"{plan.name} ({kind}: {', '.join(c.field for c in setting.changes)})"
        for plan in report.instances
        for kind, setting in (("webhook", plan.webhook), ("rabbitmq", plan.rabbitmq))
        if setting.changes
    ]
    if differing:
        how = " --webhook global" if mode == "global" else ""
        add(
            "evolution instances",
            "warn",
            f"{len(differing)} setting(s) differ from what this service expects: {some(differing)}; "
            f"fix: `evolution-ingest connect{how}` (`--dry-run` shows each change)",
        )
    else:
        add(
            "evolution instances",
            "ok",
            f"webhook and RabbitMQ settings as `connect` sets them ({mode} webhook)",
        )
    return {plan.name: plan.state for plan in report.instances}


async def _stored_messages(api: EvolutionApi, stores: Stores, connected: list[str], add: Add) -> None:
    """Does Evolution store messages (DATABASE_SAVE_DATA_NEW_MESSAGE)? Backfill reads nothing else."""
    until = datetime.now(UTC)
    since = until - timedelta(days=1)
    where = {"messageTimestamp": {"gte": as_evolution_time(since), "lte": as_evolution_time(until)}}
    silent = []
    for name in connected[:3]:
        try:
            answer = await api.find_messages(name, {"where": where, "page": 1, "offset": 1})
            received = await stores.backfills.received_messages(name, since)
        except (EvolutionError, *STORE_ERRORS) as exc:
            add("backfill", "fail", f"cannot read {name}'s stored messages: {getattr(exc, 'message', exc)}")
            return
        total = (
            (answer.get("messages") or {}).get("total", 0) if isinstance(answer.get("messages"), dict) else 0
        )
        if total:
            add(
                "backfill",
                "ok",
                f"Evolution stores messages ({total} of {name} in the last 24 h): backfill reads them",
            )
            return
        if received:
            silent.append(name)
    if silent:
        add(
            "backfill",
            "warn",
            f"Evolution stored no message of {some(silent)} in the last 24 h though it delivered some: "
            "nothing to backfill from; fix: DATABASE_SAVE_DATA_NEW_MESSAGE=true on Evolution's side",
        )


def _candidates(settings: Settings, instances: list[str]) -> dict[str, str]:
    """Queues Evolution may have declared that this service does not consume -> what the fix is."""
    topology = Topology(settings)
    consumed = set(topology.source_queues)
    events = set(settings.rabbitmq_events)
    found: dict[str, str] = {}
    for event in EMITTED_EVENTS:
        for prefix in dict.fromkeys((settings.rabbitmq_prefix, *_OTHER_PREFIXES)):
            name = evolution_queue(prefix, event)
            if name in consumed:
                continue
            if topology.mode is RabbitMode.OWN:
                found[name] = (
                    "in own mode nobody consumes Evolution's queues: cap them with a policy (docs/rabbitmq.md) "
                    "or use RABBITMQ_MODE global"
                )
            elif prefix != settings.rabbitmq_prefix:
                found[name] = (
                    f"Evolution's RABBITMQ_PREFIX_KEY is {prefix or 'unset'!r} but this service consumes "
                    f"{settings.rabbitmq_prefix or 'unprefixed'!r} queues: set RABBITMQ_PREFIX_KEY="
                    f"{settings.rabbitmq_prefix} on Evolution's side (or EVOLUTION_INGEST_RABBITMQ_PREFIX={prefix}), "
                    "then delete the old queue"
                )
            elif event not in events:
                found[name] = (
                    f"Evolution publishes {event} but this service does not consume it: add it to "
                    f"EVOLUTION_INGEST_RABBITMQ_EVENTS, or set RABBITMQ_EVENTS_{env_name(event)}=false on Evolution's side"
                )
        for instance in instances[:MAX_PROBED_INSTANCES]:
            name = f"{instance}.{event}"
            if name in consumed:
                continue
            if topology.mode is RabbitMode.INSTANCE:
                found[name] = (
                    f"instance {instance} publishes to its own exchange but is not in "
                    "EVOLUTION_INGEST_RABBITMQ_INSTANCES: add it, or turn its RabbitMQ events off"
                )
            else:
                found[name] = (
                    f"instance {instance} has its own RabbitMQ events on, whose queues nobody consumes in "
                    f"{topology.mode.value} mode: `evolution-ingest connect` turns them off"
                )
    return found


async def _exchanges_missing(connection: AbstractConnection, names: list[str]) -> list[str]:
    missing = []
    for name in names:
        channel = await connection.channel()
        try:
            await channel.declare_exchange(name, passive=True)
        except aio_pika.exceptions.ChannelClosed:  # NOT_FOUND closes the channel
            missing.append(name)
            continue
        with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
            await channel.close()
    return missing


async def _queues(settings: Settings, instances: list[str], add: Add) -> None:
    topology = Topology(settings)
    candidates = _candidates(settings, instances)
    try:
        connection = await aio_pika.connect(settings.rabbitmq_url, timeout=10)
    except STORE_ERRORS:
        return  # the rabbitmq check already says so
    try:
        states = await queue_states(connection, list(candidates))
        exchanges = await _exchanges_missing(connection, topology.exchanges)
        ours = await queue_states(connection, topology.source_queues)
    except STORE_ERRORS as exc:
        add("evolution queues", "fail", f"{type(exc).__name__}: {exc}")
        return
    finally:
        with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
            await connection.close()
    stray = {name: state for name, state in states.items() if state["exists"] and not state["consumers"]}
    for fix in dict.fromkeys(candidates[name] for name in stray):
        names = [name for name in stray if candidates[name] == fix]
        waiting = sum(int(stray[name]["messages"] or 0) for name in names)
        add(
            "unconsumed evolution queues",
            "fail" if waiting else "warn",
            f"{len(names)} bound with no consumer, {waiting} message(s) waiting ({some(names)}); fix: {fix}",
        )
    if not stray:
        add("unconsumed evolution queues", "ok", f"none among {len(candidates)} names Evolution could use")
    missing = [b for b in topology.sources if b.exchange in exchanges or not ours[b.queue]["exists"]]
    if missing:
        shown = [f"{b.queue} <- {b.exchange} [{b.routing_key}]" for b in missing]
        add(
            "bindings",
            "fail",
            f"{len(missing)} missing ({some(shown, 3)}): what Evolution publishes there now reaches no queue of "
            "this service; fix: `evolution-ingest topology` (and run it before Evolution starts)",
        )
    else:
        add("bindings", "ok", f"{len(topology.sources)} expected: exchanges and queues declared")


def _double_webhooks(recent: dict[str, set[str]], add: Add) -> None:
    doubled = sorted(instance for instance, paths in recent.items() if len(paths) == 2)
    if doubled:
        add(
            "double webhooks",
            "warn",
            f"{len(doubled)} instance(s) deliver through their instance webhook and the global one "
            f"({some(doubled)}): every event arrives twice by webhook (handled as a duplicate, twice the load); "
            "fix: `evolution-ingest connect --webhook global` (turns the instance webhooks off) or "
            "WEBHOOK_GLOBAL_ENABLED=false on Evolution's side",
        )


def _kind(reason: str, methods: frozenset[WebhookAuth]) -> str:
    if WebhookAuth.URL_TOKEN not in methods and (
        "no Authorization header" in reason or " header: no " in f" {reason}"
    ):
        return "headless"
    return "null" if APIKEY_NULL in reason else "other"


async def _auth(stores: Stores, settings: Settings, add: Add) -> None:
    methods = settings.auth_methods
    try:
        reasons = await stores.refusals.unauthorized_reasons(RECENT_SECONDS)
    except STORE_ERRORS:
        reasons = {}
    kinds: dict[str, list[str]] = {"headless": [], "null": [], "other": []}
    for reason in reasons:
        kinds[_kind(reason, methods)].append(reason)
    null, headless, other = (sum(reasons[r] for r in kinds[k]) for k in ("null", "headless", "other"))
    if null:
        add(
            "webhook auth vs evolution",
            "fail",
            f"{null} call(s) refused in the last hour: Evolution sends apikey null; fix: "
            "AUTHENTICATION_EXPOSE_IN_FETCH_INSTANCES=true on Evolution's side, or url_token auth",
        )
    elif methods == {WebhookAuth.APIKEY}:
        add(
            "webhook auth vs evolution",
            "warn",
            "apikey auth passes only with AUTHENTICATION_EXPOSE_IN_FETCH_INSTANCES=true on Evolution's side "
            "(by default Evolution sends apikey null)",
        )
    if headless:
        add(
            "webhook auth vs evolution",
            "fail",
            f"{headless} call(s) refused in the last hour for a missing header (the global webhook sends none); "
            "fix: add url_token to EVOLUTION_INGEST_WEBHOOK_AUTH and put the token in WEBHOOK_GLOBAL_URL "
            "(`evolution-ingest connect --webhook global --dry-run` prints the line)",
        )
    if other:
        add(
            "webhook auth vs evolution",
            "warn",
            f"{other} call(s) refused in the last hour: {some(kinds['other'], 2)}",
        )
    if not reasons and methods and methods != {WebhookAuth.APIKEY}:
        add("webhook auth vs evolution", "ok", "no call refused as unauthorized in the last hour")


def some(names: list[str], shown: int = 4) -> str:
    listed = ", ".join(names[:shown])
    return f"{listed} and {len(names) - shown} more" if len(names) > shown else listed
