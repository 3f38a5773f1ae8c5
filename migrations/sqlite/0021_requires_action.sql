-- A payment that waits for its customer (3-D Secure, issue 49): see
-- ../postgres/0021_requires_action.sql. The same columns, indexes and view;
-- the indexes keep SQLite's predicates (no `IS NOT NULL` term, as 0013 and
-- 0014 explain).
ALTER TABLE payments ADD COLUMN return_url TEXT;
ALTER TABLE payments ADD COLUMN next_action TEXT;
ALTER TABLE payments ADD COLUMN action_expires_at TEXT;
ALTER TABLE payments ADD COLUMN action_refreshed_at TEXT;

DROP INDEX payments_unsettled;
CREATE INDEX payments_unsettled ON payments (status, status_changed_at)
    WHERE status IN ('processing', 'requires_action', 'requires_reconciliation', 'needs_review', 'capturing', 'canceling');

DROP INDEX attempts_one_unresolved_per_intent;
CREATE UNIQUE INDEX attempts_one_unresolved_per_intent ON attempts (account_id, intent_id)
    WHERE state IN ('pending', 'unknown', 'reconciling', 'held', 'awaiting_customer');

DROP VIEW payment_event_objects;
CREATE VIEW payment_event_objects AS
SELECT p.id, p.account_id, p.event_seq, p.updated_at, json_object(
    'id', p.id, 'intent', p.intent, 'order_ref', p.order_ref, 'amount', p.amount,
    'currency', p.currency, 'capture_method', p.capture_method, 'status', p.status,
    'amount_captured', p.amount_captured, 'amount_refunded', p.amount_refunded,
    'provider_ref', p.provider_ref,
    'failure', CASE WHEN p.failure_code IS NULL THEN NULL
               ELSE json_object('code', p.failure_code, 'message', p.failure_message) END,
    'cancel_requested', json(CASE WHEN p.cancel_requested_at IS NULL THEN 'false' ELSE 'true' END),
    'description', p.description, 'metadata', json(p.metadata),
    'created_at', p.created_at, 'updated_at', p.updated_at,
    'return_url', p.return_url,
    'next_action', CASE WHEN p.status = 'requires_action' THEN json(p.next_action) END,
    'action_expires_at', CASE WHEN p.status = 'requires_action' THEN p.action_expires_at END
) AS data
FROM payments p;
