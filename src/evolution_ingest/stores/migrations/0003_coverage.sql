-- Coverage (which channels delivered the recent events, per instance) and the dashboard's list
-- of recent failures read the last hour of rows by time.
CREATE INDEX evolution_ingestion_events_received_idx
    ON evolution_ingestion_events (received_at);

CREATE INDEX evolution_ingestion_events_errors_idx
    ON evolution_ingestion_events (last_attempt_at)
    WHERE last_error IS NOT NULL;
