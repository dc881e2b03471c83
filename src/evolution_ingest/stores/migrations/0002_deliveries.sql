-- One row per (event, destination) of the built-in routes: what was delivered, what failed.
-- A retry of the event re-sends only the destinations that are not 'delivered' or 'permanent'.
CREATE TABLE evolution_ingest_deliveries (
    event_id     bigint      NOT NULL REFERENCES evolution_ingestion_events (id) ON DELETE CASCADE,
    -- "<route>" or "<route>#<n>" for a route's n-th destination, "<route>!alert" for its alert webhook.
    destination  text        NOT NULL,
    status       text        NOT NULL,
    http_status  integer,
    attempts     integer     NOT NULL DEFAULT 1,
    last_error   text,
    delivered_at timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_id, destination),
    CONSTRAINT evolution_ingest_deliveries_status_check CHECK (status IN ('delivered', 'failed', 'permanent'))
);

-- status: what is failing or given up on, per destination.
CREATE INDEX evolution_ingest_deliveries_problems_idx
    ON evolution_ingest_deliveries (destination, status)
    WHERE status <> 'delivered';
