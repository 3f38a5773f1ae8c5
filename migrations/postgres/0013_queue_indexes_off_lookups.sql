-- The queue indexes stay out of the look-ups by key.
--
-- A statement that finds its row by key and also names a queue state (the
-- worker's fenced `UPDATE outbox ... WHERE id = $1 AND lease_token = $2 AND
-- state = 'pending'`, `UPDATE attempts ... WHERE id = $1 AND state IN
-- ('pending', 'unknown')`) implied the predicate of these partial indexes,
-- so PostgreSQL could plan it as a scan of the whole index with a filter on
-- the key. It did whenever the statistics were taken with the queue empty:
-- the index then looks like one empty page, cheaper than the primary key.
-- A plan cached on a pooled connection (sqlx prepares every statement) kept
-- that choice, and once a backlog built up, every look-up read every queued
-- row: about 700 rows and 1 500 buffers per send mark with 700 payments
-- waiting, so the worker slowed down exactly when it fell behind
-- (ops/bench/README.md, "The queue indexes and the worker's plans").
--
-- Each index keeps its columns and rows, and its predicate gains a term
-- that is always true (the column is NOT NULL) and that only the queries
-- meant to use the index state or imply: the outbox and event-delivery
-- claims (`due_at <= $2` implies `due_at IS NOT NULL`), the metrics' outbox
-- depth (which writes it out), the reconciler's sweep and the metrics'
-- unknown attempts (which repeat `attempts_uncertain`'s predicate word for
-- word). `attempts_one_unresolved_per_intent` is there for its uniqueness;
-- no query reads through it. SQLite keeps its indexes (its 0013 is a
-- no-op: ../sqlite/0013_queue_indexes_off_lookups.sql says why).
-- A look-up by key alone can no longer prove the predicate, so the primary
-- key is its only index (store_conformance::
-- postgres_a_look_up_by_key_is_never_planned_as_a_scan_of_the_queue).
DROP INDEX outbox_due;
CREATE INDEX outbox_due ON outbox (due_at)
    WHERE state = 'pending' AND due_at IS NOT NULL;

DROP INDEX attempts_uncertain;
CREATE INDEX attempts_uncertain ON attempts (state, last_send_at)
    WHERE state IN ('pending', 'unknown', 'reconciling') AND created_at IS NOT NULL;

DROP INDEX attempts_one_unresolved_per_intent;
CREATE UNIQUE INDEX attempts_one_unresolved_per_intent ON attempts (account_id, intent_id)
    WHERE state IN ('pending', 'unknown', 'reconciling', 'held') AND intent_id IS NOT NULL;

DROP INDEX event_deliveries_due;
CREATE INDEX event_deliveries_due ON event_deliveries (due_at)
    WHERE state = 'pending' AND due_at IS NOT NULL;
