-- Deliveries in each payment's order (issue #48, item 5). The SQLite twin
-- is ../sqlite/0017_deliveries_in_payment_order.sql.
--
-- An endpoint receives one payment's events in `sequence` order: the claim
-- (store/events.rs `claim_deliveries`) takes a delivery only when no
-- delivery of the same payment to the same endpoint with a lower sequence
-- is still `pending` (waiting, retrying or in flight). Every dispatcher
-- process runs that same claim on the one database, so the order holds
-- across processes, and other payments' deliveries are not held back.
--
-- The payment and the sequence are copied onto the delivery (written by
-- every INSERT of the store, from the event) so the check is one probe of
-- the index below instead of a join with `events` per pending delivery.
-- They stay NULL-able only because ALTER TABLE cannot add a NOT NULL
-- column without a default on SQLite; the backfill below leaves no NULL.
--
-- The index's predicate carries `sequence IS NOT NULL` (always true after
-- the backfill), which only the claim's ordering probe implies
-- (`p.sequence < d.sequence`): a fenced update of one delivery by key that
-- names `state = 'pending'` can never be planned as a scan of this index
-- (the reason of 0013_queue_indexes_off_lookups).
ALTER TABLE event_deliveries ADD COLUMN payment_id UUID;
ALTER TABLE event_deliveries ADD COLUMN sequence BIGINT;

UPDATE event_deliveries d SET payment_id = e.payment_id, sequence = e.sequence
FROM events e WHERE e.id = d.event_id;

CREATE INDEX event_deliveries_payment_order
    ON event_deliveries (endpoint_id, payment_id, sequence)
    WHERE state = 'pending' AND sequence IS NOT NULL;
