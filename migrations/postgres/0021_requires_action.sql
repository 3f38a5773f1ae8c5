-- A payment that waits for its customer (3-D Secure, issue 49). The SQLite
-- twin is ../sqlite/0021_requires_action.sql.
--
-- `payments.status` gains `requires_action` and `attempts.state` gains
-- `awaiting_customer` (an authorisation the provider answered with an
-- action for the customer: answered, never resent, no outbox row).
--
-- - `return_url`: where the provider sends the customer back, given by the
--   merchant on create (part of the request fingerprint);
-- - `next_action`: what the merchant's front end does (JSON text, as the API
--   shows it), set in the same statement that moves the payment to
--   `requires_action`, so the event the trigger writes carries it;
-- - `action_expires_at`: when an abandoned payment is canceled;
-- - `action_refreshed_at`: the last time a GET asked the provider about it
--   (one refresh per payment per interval: GET is no provider-call
--   amplifier).
ALTER TABLE payments ADD COLUMN return_url TEXT;
ALTER TABLE payments ADD COLUMN next_action TEXT;
ALTER TABLE payments ADD COLUMN action_expires_at TIMESTAMPTZ;
ALTER TABLE payments ADD COLUMN action_refreshed_at TIMESTAMPTZ;

-- `requires_action` is unsettled: the reconciler reads it by its provider id.
DROP INDEX payments_unsettled;
CREATE INDEX payments_unsettled ON payments (status, status_changed_at)
    WHERE status IN ('processing', 'requires_action', 'requires_reconciliation', 'needs_review', 'capturing', 'canceling')
      AND status_changed_at IS NOT NULL;

-- An attempt awaiting its customer is its intent's one unresolved attempt.
DROP INDEX attempts_one_unresolved_per_intent;
CREATE UNIQUE INDEX attempts_one_unresolved_per_intent ON attempts (account_id, intent_id)
    WHERE state IN ('pending', 'unknown', 'reconciling', 'held', 'awaiting_customer') AND intent_id IS NOT NULL;

-- Events carry the action while the payment waits for it.
CREATE OR REPLACE VIEW payment_event_objects AS
SELECT p.id, p.account_id, p.event_seq, p.updated_at, jsonb_build_object(
    'id', p.id, 'intent', p.intent, 'order_ref', p.order_ref, 'amount', p.amount,
    'currency', p.currency, 'capture_method', p.capture_method, 'status', p.status,
    'amount_captured', p.amount_captured, 'amount_refunded', p.amount_refunded,
    'provider_ref', p.provider_ref,
    'failure', CASE WHEN p.failure_code IS NULL THEN NULL
               ELSE jsonb_build_object('code', p.failure_code, 'message', p.failure_message) END,
    'cancel_requested', p.cancel_requested_at IS NOT NULL,
    'description', p.description, 'metadata', p.metadata::jsonb,
    'created_at', cobro_json_time(p.created_at), 'updated_at', cobro_json_time(p.updated_at),
    'return_url', p.return_url,
    'next_action', CASE WHEN p.status = 'requires_action' THEN p.next_action::jsonb END,
    'action_expires_at', CASE WHEN p.status = 'requires_action' THEN cobro_json_time(p.action_expires_at) END
)::text AS data
FROM payments p;
