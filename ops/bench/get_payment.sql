-- pgbench: GET /v1/payments/{id} as cobro runs it: one statement, the
-- payment joined with its attempts (autocommit), no transaction
-- (ops/bench.sh; every variable comes from -D).
--
-- The account extractor sends nothing: the token is in the API's token
-- cache (see replay.sql).
--
-- payments.rs Store::payment_with_attempts_for_account. Until 2026-12-04 it
-- was two statements (the payment, then its attempts) on one connection.
SELECT p.id, p.account_id, p.order_ref, p.intent, p.amount, p.currency, p.capture_method, p.payment_method, p.description, p.metadata, p.status, p.amount_captured, p.amount_refund_reserved, p.amount_refunded, p.provider_ref, p.provider_sequence, p.failure_code, p.failure_message, p.cancel_requested_at, p.status_changed_at, p.created_at, p.updated_at, p.review_reason, p.review_from, p.provider, a.id AS a_id, a.intent_id AS a_intent_id, a.payment_id AS a_payment_id, a.refund_id AS a_refund_id, a.operation AS a_operation, a.provider_key AS a_provider_key, a.reference AS a_reference, a.state AS a_state, a.send_count AS a_send_count, a.first_send_at AS a_first_send_at, a.last_send_at AS a_last_send_at, a.provider_ref AS a_provider_ref, a.last_error AS a_last_error, a.created_at AS a_created_at, a.updated_at AS a_updated_at, a.provider AS a_provider, a.provider_request_id AS a_provider_request_id, a.provider_replayed AS a_provider_replayed FROM payments p JOIN attempts a ON a.payment_id = p.id WHERE p.id = :payment_id AND p.account_id = :account_id ORDER BY a.created_at, a.id;
