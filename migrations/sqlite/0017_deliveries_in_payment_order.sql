-- Deliveries in each payment's order (see
-- ../postgres/0017_deliveries_in_payment_order.sql): the claim takes a
-- delivery only when no earlier delivery of the same payment to the same
-- endpoint is still pending; the payment and sequence are copied onto the
-- delivery so that check is one index probe.
ALTER TABLE event_deliveries ADD COLUMN payment_id TEXT;
ALTER TABLE event_deliveries ADD COLUMN sequence INTEGER;

UPDATE event_deliveries SET
    payment_id = (SELECT e.payment_id FROM events e WHERE e.id = event_deliveries.event_id),
    sequence = (SELECT e.sequence FROM events e WHERE e.id = event_deliveries.event_id);

CREATE INDEX event_deliveries_payment_order
    ON event_deliveries (endpoint_id, payment_id, sequence)
    WHERE state = 'pending' AND sequence IS NOT NULL;
