"""The statements of the inbox (:mod:`evolution_ingest.stores.inbox`), and its tables' names."""

from __future__ import annotations

from typing import Final

from evolution_ingest.core.events import Channel

#: Keys and states: the unique index on dedup_key is the authority on duplicates.
TABLE: Final = "evolution_ingest_inbox"
#: Bodies, partitioned by received_at (see stores/retention.py).
BODIES: Final = "evolution_ingest_bodies"
#: The view of both, with the columns of the stable table interface (``payload`` included).
VIEW: Final = "evolution_ingestion_events"
_CLAIMABLE = "(e.processed_at IS NULL AND (e.claimed_until IS NULL OR e.claimed_until < now()))"

# Every batch locks its rows in dedup_key order, whatever the statement: two batches
# touching the same rows then always queue up behind each other instead of deadlocking.
# The locked rows are a MATERIALIZED set joined on id: seen through a subquery, the join would
# carry the table's statistics on id, and planning it (every execution is planned) would look
# up the primary key's real lowest and highest values, stepping over the entry of every row
# deleted since the last vacuum (after a purge of a million, 2 ms more per statement).

# ``xmax = 0``: the row was inserted by this statement (not updated), so its body is new.
SAVE = f"""
WITH saved AS (
    INSERT INTO {TABLE} AS e
        (dedup_key, event, instance, channel, webhook_seen_at, rabbitmq_seen_at, claim_token, claimed_until)
    SELECT u.key, u.event, u.instance, u.channel,
           CASE WHEN u.channel = 'WEBHOOK' THEN now() END,
           CASE WHEN u.channel = 'RABBITMQ' THEN now() END,
           u.token,
           CASE WHEN u.token IS NOT NULL THEN now() + make_interval(secs => u.lease) END
    FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $7::uuid[], $8::float8[])
         AS u(key, event, instance, channel, token, lease)
    ON CONFLICT (dedup_key) DO UPDATE SET
        webhook_seen_at  = COALESCE(e.webhook_seen_at, EXCLUDED.webhook_seen_at),
        rabbitmq_seen_at = COALESCE(e.rabbitmq_seen_at, EXCLUDED.rabbitmq_seen_at),
        claim_token   = CASE WHEN EXCLUDED.claim_token IS NOT NULL AND {_CLAIMABLE}
                             THEN EXCLUDED.claim_token ELSE e.claim_token END,
        claimed_until = CASE WHEN EXCLUDED.claim_token IS NOT NULL AND {_CLAIMABLE}
                             THEN EXCLUDED.claimed_until ELSE e.claimed_until END
    RETURNING dedup_key, id, channel, received_at, attempts, processed_at IS NOT NULL AS processed,
              claim_token, xmax = 0 AS inserted
), bodies AS (
    INSERT INTO {BODIES} (event_id, received_at, payload, payload_text)
    SELECT s.id, s.received_at, b.payload::jsonb, b.payload_text
    FROM saved AS s
    JOIN unnest($1::text[], $5::text[], $6::text[]) AS b(key, payload, payload_text) ON b.key = s.dedup_key
    WHERE s.inserted
)
SELECT dedup_key, id, channel, received_at, attempts, processed, claim_token FROM saved
"""

CLAIM_SAVED = f"""
WITH wanted AS (
    SELECT * FROM unnest($1::text[], $2::uuid[], $3::float8[]) AS u(key, token, lease)
), locked AS MATERIALIZED (
    SELECT e.id FROM {TABLE} AS e JOIN wanted ON e.dedup_key = wanted.key
    ORDER BY e.dedup_key FOR UPDATE OF e
)
UPDATE {TABLE} AS e SET
    claim_token   = CASE WHEN {_CLAIMABLE} THEN wanted.token ELSE e.claim_token END,
    claimed_until = CASE WHEN {_CLAIMABLE} THEN now() + make_interval(secs => wanted.lease)
                         ELSE e.claimed_until END
FROM locked, wanted
WHERE e.id = locked.id AND e.dedup_key = wanted.key
RETURNING e.dedup_key, e.id, e.channel, e.received_at, e.attempts,
          e.processed_at IS NOT NULL AS processed, e.claim_token
"""

MARK_PROCESSED = f"""
WITH locked AS MATERIALIZED (
    SELECT id FROM {TABLE} WHERE id = ANY($1::bigint[]) AND processed_at IS NULL
    ORDER BY dedup_key FOR UPDATE
)
UPDATE {TABLE} AS e SET processed_at = now(), attempts = e.attempts + 1, last_attempt_at = now(),
                        claim_token = NULL, claimed_until = NULL
FROM locked
WHERE e.id = locked.id
RETURNING e.id, e.received_at
"""

# The media an Evolution body carries in base64 (WEBHOOK_BASE64 / RabbitMQ with base64 on),
# removed once business logic ran when RETENTION_STRIP_MEDIA is on. A body kept as exact text
# (odd characters, ``payload_text``) is left whole. The span of the batch's received_at ($2, $3)
# names the partitions that can hold its bodies, so that Postgres visits those alone.
STRIP_MEDIA = f"""
UPDATE {BODIES} SET payload = payload #- '{{data,message,base64}}'
WHERE event_id = ANY($1::bigint[]) AND received_at BETWEEN $2 AND $3
  AND payload_text IS NULL AND payload->'data'->'message' ? 'base64'
RETURNING event_id
"""

SEEN = {
    channel: f"""
WITH locked AS MATERIALIZED (
    SELECT id FROM {TABLE} WHERE dedup_key = ANY($1::text[]) AND {column} IS NULL
    ORDER BY dedup_key FOR UPDATE
)
UPDATE {TABLE} AS e SET {column} = COALESCE(e.{column}, now())
FROM locked
WHERE e.id = locked.id
"""
    for channel, column in ((Channel.WEBHOOK, "webhook_seen_at"), (Channel.RABBITMQ, "rabbitmq_seen_at"))
}

RENEW = f"""
UPDATE {TABLE} SET claimed_until = now() + make_interval(secs => $3)
WHERE id = $1 AND claim_token = $2 AND processed_at IS NULL
"""

NOTE_ERROR = f"""
UPDATE {TABLE} SET last_error = $2 WHERE id = $1 AND processed_at IS NULL
"""

GIVE_UP = f"""
UPDATE {TABLE} SET failed_at = now()
WHERE id = $1 AND processed_at IS NULL AND failed_at IS NULL AND attempts >= $2
"""

RECORD_FAILURE = f"""
UPDATE {TABLE} SET attempts = attempts + 1, last_error = $2, last_attempt_at = now(),
    claim_token   = CASE WHEN claim_token = $3 THEN NULL ELSE claim_token END,
    claimed_until = CASE WHEN claim_token = $3 THEN NULL ELSE claimed_until END
WHERE id = $1 AND processed_at IS NULL
"""
