-- The view finds a row's body by its partition key too. A body is saved with its row's
-- received_at (and retention moves and drops bodies by that pair), so the pair names the
-- body, and a read of many rows (the reconciler's pages, replay's) then visits only the
-- partition that holds each body instead of probing every partition for the event id: with
-- hourly partitions (a short RETENTION_PARTITION_SECONDS), one probe a row instead of some
-- hundreds.
-- The columns are the same, in the same order: a catalog change only.
CREATE OR REPLACE VIEW evolution_ingestion_events AS
SELECT i.id, i.dedup_key, i.event, i.instance, i.channel,
       CASE WHEN b.event_id IS NOT NULL THEN b.payload ELSE i.payload END AS payload,
       i.received_at, i.webhook_seen_at, i.rabbitmq_seen_at, i.processed_at, i.attempts,
       i.last_error, i.last_attempt_at, i.failed_at, i.claim_token, i.claimed_until,
       CASE WHEN b.event_id IS NOT NULL THEN b.payload_text ELSE i.payload_text END AS payload_text
  FROM evolution_ingest_inbox AS i
  LEFT JOIN evolution_ingest_bodies AS b ON b.event_id = i.id AND b.received_at = i.received_at;
