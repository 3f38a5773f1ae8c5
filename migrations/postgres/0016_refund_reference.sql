-- A refund's business identity: the merchant's own reference for it,
-- unique per payment. An Idempotency-Key protects a retry for as long as
-- its record (and then its tombstone) lives; a client that retries a
-- refund after that, or under a new key, would refund twice. With a
-- reference, the second refund is refused (409 refund-reference-exists)
-- whenever it comes. Optional: a refund without one keeps today's rules.
ALTER TABLE refunds ADD COLUMN reference TEXT;
CREATE UNIQUE INDEX refunds_one_per_reference ON refunds (account_id, payment_id, reference)
    WHERE reference IS NOT NULL;

-- Events carry the reference like the API's view of the refund.
CREATE OR REPLACE VIEW refund_event_objects AS
SELECT r.id, r.account_id, r.payment_id, r.updated_at, jsonb_build_object(
    'id', r.id, 'payment_id', r.payment_id, 'intent', r.intent, 'amount', r.amount,
    'reason', r.reason, 'status', r.status, 'provider_ref', r.provider_ref,
    'failure', CASE WHEN r.failure_code IS NULL THEN NULL
               ELSE jsonb_build_object('code', r.failure_code, 'message', r.failure_message) END,
    'created_at', cobro_json_time(r.created_at), 'updated_at', cobro_json_time(r.updated_at),
    'reference', r.reference
)::text AS data
FROM refunds r;
