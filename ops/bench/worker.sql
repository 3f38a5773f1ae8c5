-- pgbench: the worker's statements for one payment, from its claim to its
-- settle, as crates/worker worker.rs runs them against a provider that
-- captures at once. Not a script alone: ops/bench.sh and statements.sh run
-- new_payment.sql followed by this file as e2e.sql, "the whole SQL of one
-- payment" (issue 15, item 2). Variables: -D, new_payment.sql's \gset, and
-- the \gset of the claim below (prefixes c_, p_).
--
-- 1. outbox.rs claim_due_for on PostgreSQL: lease the oldest due row and
--    read it with its attempt, in one statement (LIMIT 1: one payment per
--    transaction here; cobro's worker claims up to its free slots at once,
--    so under load its claims cost less per payment than this). The
--    claim's "now" is the transaction's :ts, as the worker's is its clock:
--    a row another client claimed has its due_at at its lease's end, so it
--    is not due and nobody claims it twice (with 'infinity' here, a row
--    could be claimed again and settled by another client before its first
--    claimer read it). ops/bench.sh gives the database a standing backlog
--    (E2E_BACKLOG pending payments), so every claim finds a row.
--    pgbench gives each :provider its own parameter, so the first needs a
--    type (::text): cobro's one $5 gets it from `a.provider = $5`.
-- mirrors: WITH due AS MATERIALIZED (SELECT id FROM outbox WHERE state = 'pending' AND due_at <= ? AND EXISTS (SELECT 1 FROM attempts a WHERE a.id = outbox.attempt_id AND (? IS NULL OR a.provider = ? OR (a.provider IS NULL AND ?))) ORDER BY due_at LIMIT ? FOR UPDATE SKIP LOCKED), leased AS (UPDATE outbox o SET lease_owner = ?, lease_token = o.lease_token + 1, lease_expires_at = ?, due_at = ?, updated_at = ? FROM due WHERE o.id = due.id RETURNING o.id, o.lease_token, o.lease_expires_at, o.traceparent, o.tracestate, o.attempt_id) SELECT l.id AS outbox_id, l.lease_token, l.lease_expires_at, l.traceparent, l.tracestate, a.id, a.intent_id, a.payment_id, a.refund_id, a.operation, a.provider_key, a.reference, a.state, a.send_count, a.first_send_at, a.last_send_at, a.provider_ref, a.last_error, a.created_at, a.updated_at, a.provider, a.provider_request_id, a.provider_replayed FROM leased l JOIN attempts a ON a.id = l.attempt_id
WITH due AS MATERIALIZED (SELECT id FROM outbox WHERE state = 'pending' AND due_at <= :ts AND EXISTS (SELECT 1 FROM attempts a WHERE a.id = outbox.attempt_id AND (:provider::text IS NULL OR a.provider = :provider OR (a.provider IS NULL AND :provider_default))) ORDER BY due_at LIMIT :one FOR UPDATE SKIP LOCKED), leased AS (UPDATE outbox o SET lease_owner = :owner, lease_token = o.lease_token + 1, lease_expires_at = :lease_end, due_at = :lease_end, updated_at = :ts FROM due WHERE o.id = due.id RETURNING o.id, o.lease_token, o.lease_expires_at, o.traceparent, o.tracestate, o.attempt_id) SELECT l.id AS outbox_id, l.lease_token, l.lease_expires_at, l.traceparent, l.tracestate, a.id, a.intent_id, a.payment_id, a.refund_id, a.operation, a.provider_key, a.reference, a.state, a.send_count, a.first_send_at, a.last_send_at, a.provider_ref, a.last_error, a.created_at, a.updated_at, a.provider, a.provider_request_id, a.provider_replayed FROM leased l JOIN attempts a ON a.id = l.attempt_id \gset c_
-- 2. worker.rs prepare: payments.rs payment_any_account.
SELECT id, account_id, order_ref, intent, amount, currency, capture_method, payment_method, description, metadata, status, amount_captured, amount_refund_reserved, amount_refunded, provider_ref, provider_sequence, failure_code, failure_message, cancel_requested_at, status_changed_at, created_at, updated_at, review_reason, review_from, provider FROM payments WHERE id = :c_payment_id \gset p_
-- 3. outbox.rs record_send: the fenced send mark (autocommit).
UPDATE attempts SET send_count = send_count + 1, first_send_at = COALESCE(first_send_at, :ts), last_send_at = :ts, updated_at = :ts WHERE id = :c_id AND state IN ('pending', 'unknown') AND EXISTS (SELECT 1 FROM outbox o WHERE o.attempt_id = :c_id AND o.id = :c_outbox_id AND o.lease_token = :c_lease_token AND o.state = 'pending') AND COALESCE((SELECT p.status FROM payments p WHERE p.id = attempts.payment_id FOR SHARE), '') NOT IN ('requires_reconciliation', 'needs_review') AND COALESCE((SELECT r.status FROM refunds r WHERE r.id = attempts.refund_id FOR SHARE), '') NOT IN ('requires_reconciliation', 'needs_review');
-- (the provider call: no SQL)
-- 4. worker.rs record: one transaction fenced by the claim's token.
BEGIN;
-- 5. outbox.rs finish_outbox.
UPDATE outbox SET state = 'done', lease_owner = NULL, lease_expires_at = NULL, updated_at = :ts WHERE id = :c_outbox_id AND lease_token = :c_lease_token AND state = 'pending';
-- 6. settle.rs apply_proof: the payment's lock ...
SELECT id, account_id, order_ref, intent, amount, currency, capture_method, payment_method, description, metadata, status, amount_captured, amount_refund_reserved, amount_refunded, provider_ref, provider_sequence, failure_code, failure_message, cancel_requested_at, status_changed_at, created_at, updated_at, review_reason, review_from, provider FROM payments WHERE id = :c_payment_id FOR UPDATE;
-- 7. ... the attempt's outcome (the charge id the provider answered) ...
UPDATE attempts SET state = :succeeded, provider_ref = COALESCE(:charge, provider_ref), last_error = COALESCE(NULL, last_error), updated_at = :ts WHERE id = :c_id AND state IN ('pending', 'unknown', 'reconciling');
-- 8. ... the payment's new status (its trigger writes the payment's event; the settled NOTIFY is cobro's doorbell after the commit since migration 0012) ...
UPDATE payments SET status = :captured, provider_ref = COALESCE(:charge, provider_ref), amount_captured = COALESCE(:p_amount, amount_captured), failure_code = NULL, failure_message = NULL, status_changed_at = :ts, updated_at = :ts, review_reason = CASE WHEN :captured = 'needs_review' THEN review_reason END WHERE id = :c_payment_id AND status = :processing RETURNING id, account_id, order_ref, intent, amount, currency, capture_method, payment_method, description, metadata, status, amount_captured, amount_refund_reserved, amount_refunded, provider_ref, provider_sequence, failure_code, failure_message, cancel_requested_at, status_changed_at, created_at, updated_at, review_reason, review_from, provider;
-- 9. ... and the attempts held back behind this one.
SELECT id, intent_id, payment_id, refund_id, operation, provider_key, reference, state, send_count, first_send_at, last_send_at, provider_ref, last_error, created_at, updated_at, provider, provider_request_id, provider_replayed FROM attempts WHERE payment_id = :c_payment_id AND state = 'held' ORDER BY created_at, id;
COMMIT;
