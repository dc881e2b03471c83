"""The statements of retention (:mod:`evolution_ingest.stores.retention`)."""

from __future__ import annotations

from typing import Final

from evolution_ingest.stores.deliveries import DELIVERIES
from evolution_ingest.stores.inbox_sql import BODIES, TABLE

#: Ids of the rows whose body must survive: not processed (pending, or given up on).
UNFINISHED: Final = (
    f"(SELECT id FROM {TABLE} WHERE processed_at IS NULL AND failed_at IS NULL "
    f"UNION ALL SELECT id FROM {TABLE} WHERE failed_at IS NOT NULL AND processed_at IS NULL)"
)

#: ``$3``: the age in seconds. Processed that long ago (so also received that long ago).
OLD: Final = "i.processed_at IS NOT NULL AND i.processed_at < now() - make_interval(secs => $3)"

#: One step of a walk in id order: ``$1`` the last id seen, ``$2`` the batch size. The batch is
#: the next ``$2`` ids, so its rows are exactly those of ids in ``($1, last]``: every action reads
#: them by that range of the primary key (``IN_SPAN``), never by a join with the batch, which the
#: planner may turn into a scan of the whole inbox once it is large (each step must cost what it
#: removes, not the table's size). Bodies are found by their key, ``(event_id, received_at)``, so
#: that only the partition holding one is searched.
WALK: Final = f"""
WITH batch AS MATERIALIZED (SELECT id, received_at FROM {TABLE} WHERE id > $1 ORDER BY id LIMIT $2),
span AS MATERIALIZED (SELECT max(id) AS last, max(received_at) AS newest FROM batch),
{{action}}
SELECT (SELECT last FROM span) AS last_id, (SELECT newest FROM span) AS newest,
       (SELECT count(*) FROM done) AS done
"""
IN_SPAN: Final = "i.id > $1 AND i.id <= (SELECT last FROM span)"

DELETE_ROWS: Final = WALK.format(
    action=f"""done AS (DELETE FROM {TABLE} AS i WHERE {IN_SPAN} AND {OLD} RETURNING i.id, i.received_at),
bodies AS (DELETE FROM {BODIES} AS b USING done
            WHERE b.event_id = done.id AND b.received_at = done.received_at)"""
)

EMPTY_LEGACY: Final = f"""done AS (UPDATE {TABLE} AS i SET payload = NULL, payload_text = NULL
         WHERE {IN_SPAN} AND i.payload IS NOT NULL AND {OLD} RETURNING i.id)"""

#: Bodies kept in the row (saved before partitioning, or rescued) only; partitions are dropped.
EMPTY_LEGACY_BODIES: Final = WALK.format(action=EMPTY_LEGACY)

#: Both kinds (``purge --payload-only``, whose age need not match a partition's end).
EMPTY_BODIES: Final = WALK.format(
    action=f"""old AS MATERIALIZED (SELECT i.id, i.received_at FROM {TABLE} AS i WHERE {IN_SPAN} AND {OLD}),
legacy AS (UPDATE {TABLE} AS i SET payload = NULL, payload_text = NULL
            WHERE {IN_SPAN} AND i.payload IS NOT NULL AND {OLD} RETURNING i.id),
partitioned AS (DELETE FROM {BODIES} AS b USING old
                 WHERE b.event_id = old.id AND b.received_at = old.received_at RETURNING b.event_id),
done AS (SELECT id FROM legacy UNION SELECT event_id FROM partitioned)"""
)

RESCUE: Final = f"""
UPDATE {TABLE} AS i SET payload = b.payload, payload_text = b.payload_text
  FROM {UNFINISHED} AS u JOIN "{{partition}}" AS b ON b.event_id = u.id
 WHERE i.id = u.id
"""

SIZES: Final = f"""
SELECT pg_total_relation_size(to_regclass('{TABLE}')) AS rows_bytes,
       COALESCE((SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits
                  WHERE inhparent = to_regclass('{BODIES}')), 0)::bigint AS bodies_bytes,
       pg_total_relation_size(to_regclass('{DELIVERIES}')) AS deliveries_bytes,
       (SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass('{BODIES}')) AS partitions,
       (SELECT received_at FROM {TABLE} ORDER BY id LIMIT 1) AS oldest,
       now() AS now
"""
