-- pgbench: GET /v1/payments/{id} as cobro runs it: three statements, each
-- on the pool (autocommit), no transaction (ops/bench.sh).
--
-- 1. Account extractor: accounts.rs account_for_token_at.
SELECT account_id FROM api_tokens WHERE token_hash = :token_hash AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > :now) \gset
-- 2. payments.rs Store::payment.
SELECT id, account_id, order_ref, intent, amount, currency, capture_method, payment_method, description, metadata, status, amount_captured, amount_refund_reserved, amount_refunded, provider_ref, provider_sequence, failure_code, failure_message, cancel_requested_at, status_changed_at, created_at, updated_at, review_reason, review_from, provider FROM payments WHERE id = :payment_id AND account_id = :account_id;
-- 3. payments.rs Store::attempts_for_payment.
SELECT id, intent_id, payment_id, refund_id, operation, provider_key, reference, state, send_count, first_send_at, last_send_at, provider_ref, last_error, created_at, updated_at, provider, provider_request_id, provider_replayed FROM attempts WHERE payment_id = :payment_id AND EXISTS (SELECT 1 FROM payments p WHERE p.id = :payment_id AND p.account_id = :account_id) ORDER BY created_at, id;
