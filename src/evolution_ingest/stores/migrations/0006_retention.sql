-- Retention: bodies live in a table partitioned by day, so that dropping a day of bodies is a
-- DROP TABLE instead of millions of deletes; the slim row (key and state) stays in an ordinary
-- table whose unique index on dedup_key keeps being the authority on duplicates for as long
-- as the row is kept (Postgres cannot enforce a unique dedup_key across partitions). See
-- docs/retention.md for the design and for the procedure on a populated inbox.
--
-- Every statement here changes the catalog only: no table is rewritten or scanned, so this
-- runs in well under a second on any size of inbox (it waits for the locks it needs, though:
-- stop the replicas of the previous version first, see docs/retention.md).

-- 1. The table becomes the inbox of keys and states. Its `payload` / `payload_text` columns
--    stay, for bodies saved before this migration (and bodies rescued from a dropped partition
--    because their event was not processed); new bodies go to evolution_ingest_bodies.
ALTER TABLE evolution_ingestion_events RENAME TO evolution_ingest_inbox;
ALTER TABLE evolution_ingest_inbox SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);

-- 2. Bodies, one partition per RETENTION_PARTITION_SECONDS (a day by default), created ahead of
--    time by the service; the default partition catches a body whose partition is missing.
-- No foreign key: its check would cost every save, and its cascade would probe every partition
-- for each row deleted; the service deletes a row's body itself (purge) or drops it with its
-- partition, and bodies never outlive rows (RETENTION_BODIES_SECONDS <= RETENTION_ROWS_SECONDS).
CREATE TABLE evolution_ingest_bodies (
    event_id     bigint      NOT NULL,
    -- The event row's received_at when the body was saved: the partition key.
    received_at  timestamptz NOT NULL,
    payload      jsonb       NOT NULL,
    payload_text text,
    PRIMARY KEY (event_id, received_at)
) PARTITION BY RANGE (received_at);
CREATE TABLE evolution_ingest_bodies_default PARTITION OF evolution_ingest_bodies DEFAULT;

-- 3. The contract: `evolution_ingestion_events` with every column it had, `payload` included,
--    for whoever reads the inbox with SQL. Writes go to the two tables above.
CREATE VIEW evolution_ingestion_events AS
SELECT i.id, i.dedup_key, i.event, i.instance, i.channel,
       CASE WHEN b.event_id IS NOT NULL THEN b.payload ELSE i.payload END AS payload,
       i.received_at, i.webhook_seen_at, i.rabbitmq_seen_at, i.processed_at, i.attempts,
       i.last_error, i.last_attempt_at, i.failed_at, i.claim_token, i.claimed_until,
       CASE WHEN b.event_id IS NOT NULL THEN b.payload_text ELSE i.payload_text END AS payload_text
  FROM evolution_ingest_inbox AS i
  LEFT JOIN evolution_ingest_bodies AS b ON b.event_id = i.id;

-- Since when bodies are partitioned: older rows may still hold theirs in the inbox table
-- (none when the inbox is empty: nothing for retention to empty then).
INSERT INTO evolution_ingest_meta (name, at) VALUES ('bodies_partitioned', now());
INSERT INTO evolution_ingest_meta (name, at)
SELECT 'legacy_bodies_cleared', now() WHERE NOT EXISTS (SELECT 1 FROM evolution_ingest_inbox);
