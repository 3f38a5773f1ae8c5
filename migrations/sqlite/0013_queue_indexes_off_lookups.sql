-- The queue indexes stay out of the look-ups by key. The twin of
-- ../postgres/0013_queue_indexes_off_lookups.sql; see there for the why
-- (the same predicates on both keep the schemas equal: schema_parity).
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
