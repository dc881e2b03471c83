"""Write deploy/grafana/evolution-ingest.json, a Grafana dashboard on the metrics `/metrics` serves.

Run it after changing a panel; a test fails when the file and this script differ, and another
scrapes a real `/metrics` to check that every metric (and label) a panel queries exists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent.parent / "deploy" / "grafana" / "evolution-ingest.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"

# (title, kind, unit, [(expr, legend)], width); a str is a row.
LAYOUT: list[Any] = [
    "Intake",
    ("Copies received per second, by channel", "timeseries", "ops",
     [(f"sum by (channel) (rate(evolution_ingest_events_received_total[{RATE}]))", "{{channel}}")], 8),
    ("Processed and failed per second", "timeseries", "ops",
     [(f"sum(rate(evolution_ingest_events_processed_total[{RATE}]))", "processed"),
      (f"sum(rate(evolution_ingest_events_failed_total[{RATE}]))", "failed")], 8),
    ("Copies skipped (the other channel's duplicates, locks)", "timeseries", "ops",
     [(f"sum by (reason) (rate(evolution_ingest_events_skipped_total[{RATE}]))", "{{reason}}")], 8),
    ("Answered 503 / retried: Postgres unreachable", "timeseries", "ops",
     [(f"sum by (channel) (rate(evolution_ingest_events_unavailable_total[{RATE}]))", "{{channel}}")], 8),
    ("Webhook calls by Evolution's webhook (instance, global)", "timeseries", "ops",
     [(f'sum by (name) (rate(evolution_ingest_counter_total{{name=~"webhook:via:.*"}}[{RATE}]))', "{{name}}")], 8),
    ("Refused bodies in the last hour, by code", "timeseries", "short",
     [("sum by (source, code) (increase(evolution_ingest_refusals_total[1h]))", "{{source}} {{code}}")], 8),
    "Inbox",
    ("Pending", "stat", "short", [("max(evolution_ingest_inbox_pending)", "pending")], 6),
    ("Stuck (older than RECONCILE_AFTER_SECONDS)", "stat", "short",
     [("max(evolution_ingest_inbox_stuck)", "stuck")], 6),
    ("Failed (given up)", "stat", "short", [("max(evolution_ingest_inbox_failed)", "failed")], 6),
    ("Oldest pending", "stat", "s", [("max(evolution_ingest_inbox_oldest_pending_age_seconds)", "age")], 6),
    ("Inbox on disk: rows, bodies, deliveries", "timeseries", "bytes",
     [("max by (part) (evolution_ingest_inbox_bytes)", "{{part}}")], 12),
    ("Retention: rows deleted, bodies dropped and kept, errors (per hour)", "timeseries", "short",
     [('sum by (name) (increase(evolution_ingest_counter_total{name=~"retention:(rows_deleted|bodies_dropped|bodies_rescued|errors)"}[1h]))', "{{name}}")], 12),
    "Latency",
    ("Webhook answer p50 / p99", "timeseries", "s",
     [(f"histogram_quantile({q}, sum by (le) (rate(evolution_ingest_webhook_seconds_bucket[{RATE}])))", f"p{int(q * 100)}")
      for q in (0.5, 0.99)], 8),
    ("Business logic p50 / p99", "timeseries", "s",
     [(f"histogram_quantile({q}, sum by (le) (rate(evolution_ingest_handler_seconds_bucket[{RATE}])))", f"p{int(q * 100)}")
      for q in (0.5, 0.99)], 8),
    ("Evolution's date_time to processed, p50 / p99", "timeseries", "s",
     [(f"histogram_quantile({q}, sum by (le) (rate(evolution_ingest_end_to_end_seconds_bucket[{RATE}])))", f"p{int(q * 100)}")
      for q in (0.5, 0.99)], 8),
    ("Event-loop lag p50 / p99 (how late the service's processes wake)", "timeseries", "s",
     [(f"histogram_quantile({q}, sum by (le) (rate(evolution_ingest_event_loop_lag_seconds_bucket[{RATE}])))", f"p{int(q * 100)}")
      for q in (0.5, 0.99)], 12),
    ("Event-loop stalls over 100 ms, last 5 minutes", "timeseries", "short",
     [('sum(increase(evolution_ingest_counter_total{name="loop:stalls"}[5m]))', "stalls")], 12),
    "RabbitMQ",
    ("Queue depth", "timeseries", "short",
     [("max by (queue, role) (evolution_ingest_queue_messages)", "{{role}} {{queue}}")], 8),
    ("Consumers on Evolution's queues (0: nobody reads them)", "timeseries", "short",
     [('min by (queue) (evolution_ingest_queue_consumers{role="evolution"})', "{{queue}}")], 8),
    ("Retries per tier and parked, last 5 minutes", "timeseries", "short",
     [("sum by (tier) (increase(evolution_ingest_retries_total[5m]))", "tier {{tier}}"),
      ("sum(increase(evolution_ingest_parked_total[5m]))", "parked")], 8),
    ("Forwards to the webhook app, by result", "timeseries", "ops",
     [(f"sum by (source, result) (rate(evolution_ingest_forwards_total[{RATE}]))", "{{source}} {{result}}")], 12),
    ("Reconciler: stuck events recovered, last hour", "timeseries", "short",
     [("sum(increase(evolution_ingest_reconciler_recoveries_total[1h]))", "recovered"),
      ("sum(increase(evolution_ingest_reconciler_passes_total[1h]))", "passes")], 12),
    "Channels per instance",
    ("Seconds since each channel last delivered", "timeseries", "s",
     [("max by (instance, channel) (evolution_ingest_channel_last_delivery_age_seconds)", "{{instance}} {{channel}}")], 12),
    ("Gap alerts raised (one channel silent, the other delivering)", "timeseries", "short",
     [("max by (instance, channel) (evolution_ingest_channel_gap)", "{{instance}} {{channel}}")], 12),
    ("Instances connected (1: open)", "timeseries", "short",
     [("max by (instance) (evolution_ingest_instance_up)", "{{instance}}")], 8),
    ("Instance uptime over 24 h", "timeseries", "percentunit",
     [('max by (instance) (evolution_ingest_instance_uptime_ratio{window="24h"})', "{{instance}}")], 8),
    ("Instance alerts raised (logged out, away)", "timeseries", "short",
     [("max by (instance) (evolution_ingest_instance_alert)", "{{instance}}")], 8),
    ("Backfill: stored messages read, already received, ingested (per hour)", "timeseries", "short",
     [('sum by (name) (increase(evolution_ingest_counter_total{name=~"backfill:(records|already_received)"}[1h]))', "{{name}}"),
      ('sum(increase(evolution_ingest_events_received_total{channel="backfill"}[1h]))', "backfill:received")], 12),
    ("Backfill runs and errors (per hour)", "timeseries", "short",
     [('sum by (name) (increase(evolution_ingest_counter_total{name=~"backfill:(runs|errors|silent_instances)"}[1h]))', "{{name}}")], 12),
    ("Stores answering (postgres, redis, rabbitmq)", "timeseries", "short",
     [("min by (store) (evolution_ingest_store_up)", "{{store}}")], 24),
]  # fmt: skip


def _panel(
    number: int, item: tuple[str, str, str, list[tuple[str, str]], int], x: int, y: int
) -> dict[str, Any]:
    title, kind, unit, queries, width = item
    height = 5 if kind == "stat" else 8
    panel: dict[str, Any] = {
        "id": number,
        "type": kind,
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": height, "w": width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(queries)
        ],
    }
    if kind == "stat":
        panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"}
    return panel


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    x = y = row_height = 0
    for item in LAYOUT:
        number = len(panels) + 1
        if isinstance(item, str):
            y += row_height
            x, row_height = 0, 0
            panels.append({"id": number, "type": "row", "title": item, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
            y += 1
            continue
        if x + item[4] > 24:
            x, y, row_height = 0, y + row_height, 0
        panel = _panel(number, item, x, y)
        panels.append(panel)
        x += item[4]
        row_height = max(row_height, panel["gridPos"]["h"])
    return {
        "title": "evolution-ingest",
        "uid": "evolution-ingest",
        "description": "Both channels of Evolution API into one inbox: intake, inbox, latency, RabbitMQ, channels.",
        "tags": ["evolution-api", "whatsapp", "evolution-ingest"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "panels": panels,
    }


def rendered() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(rendered(), encoding="utf-8")
    sys.stdout.write(f"wrote {OUT}\n")
