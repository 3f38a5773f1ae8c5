-- A refund's business identity, unique per payment (see
-- ../postgres/0016_refund_reference.sql).
ALTER TABLE refunds ADD COLUMN reference TEXT;
CREATE UNIQUE INDEX refunds_one_per_reference ON refunds (account_id, payment_id, reference)
    WHERE reference IS NOT NULL;

-- Events carry the reference like the API's view of the refund.
DROP VIEW IF EXISTS refund_event_objects;
CREATE VIEW refund_event_objects AS
SELECT r.id, r.account_id, r.payment_id, r.updated_at, json_object(
    'id', r.id, 'payment_id', r.payment_id, 'intent', r.intent, 'amount', r.amount,
    'reason', r.reason, 'status', r.status, 'provider_ref', r.provider_ref,
    'failure', CASE WHEN r.failure_code IS NULL THEN NULL
               ELSE json_object('code', r.failure_code, 'message', r.failure_message) END,
    'created_at', r.created_at, 'updated_at', r.updated_at,
    'reference', r.reference
) AS data
FROM refunds r;
