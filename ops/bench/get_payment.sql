-- pgbench: GET /v1/payments/{id} as cobro runs it: two statements on one
-- pooled connection (autocommit), no transaction (ops/bench.sh; every
-- variable comes from -D).
--
-- The account extractor sends nothing: the token is in the API's token
-- cache (see replay.sql).
--
-- 1. payments.rs Store::payment_with_attempts_for_account: the payment ...
SELECT id, account_id, order_ref, intent, amount, currency, capture_method, payment_method, description, metadata, status, amount_captured, amount_refund_reserved, amount_refunded, provider_ref, provider_sequence, failure_code, failure_message, cancel_requested_at, status_changed_at, created_at, updated_at, review_reason, review_from, provider FROM payments WHERE id = :payment_id AND account_id = :account_id;
-- 2. ... and its attempts, on the same connection.
SELECT id, intent_id, payment_id, refund_id, operation, provider_key, reference, state, send_count, first_send_at, last_send_at, provider_ref, last_error, created_at, updated_at, provider, provider_request_id, provider_replayed FROM attempts WHERE payment_id = :payment_id AND EXISTS (SELECT 1 FROM payments p WHERE p.id = :payment_id AND p.account_id = :account_id) ORDER BY created_at, id;
