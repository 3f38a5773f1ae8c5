-- pgbench: POST /v1/payments as cobro runs it, statement for statement
-- (ops/bench.sh; variables come from -D and from the \gset below).
--
-- 1. The account extractor sends nothing (the token is in the API's token
--    cache, see replay.sql). cobro generates the request's ids, key and
--    order ref in process; pgbench cannot make a uuid or a string, so one
--    statement that reads no table makes them (\gset): the one round trip
--    here that cobro does not pay (statements.sh counts it apart). The
--    account is -D :account_id. (lease_end and charge are for worker.sql,
--    when this file is the first half of e2e.sql.)
\set amount random(100, 99999)
-- pgbench-only: makes in one round trip what cobro makes in process.
SELECT gen_random_uuid() AS payment_id, gen_random_uuid() AS intent_id,
       gen_random_uuid() AS outbox_id,
       gen_random_uuid()::text AS provider_key, md5(random()::text) AS idem_key,
       o.order_ref, o.order_ref || ':' || 'authorize-v1' AS intent,
       o.order_ref || ':' || 'authorize-v1/' || o.attempt_id AS reference, o.attempt_id, clock_timestamp() AS ts,
       clock_timestamp() + interval '30 seconds' AS lease_end, 'ch_' || md5(random()::text) AS charge
  FROM (SELECT 'pgb-' || md5(random()::text) AS order_ref, gen_random_uuid() AS attempt_id) o \gset
-- 2. keyed::begin: sqlx pool.begin() sends BEGIN on its own.
BEGIN;
-- 3. idempotency.rs reserve_key on PostgreSQL (the key is new: the INSERT
--    makes the row; the read beside it finds nothing), one statement.
WITH ins AS (INSERT INTO idempotency_records (account_id, operation, idempotency_key, fingerprint, state, status_code, response_body, resource_type, resource_id, created_at) VALUES (:account_id, :operation, :idem_key, :fingerprint, 'completed', 0, :empty, :resource_type, :payment_id, :ts) ON CONFLICT (account_id, operation, idempotency_key) DO NOTHING RETURNING 1) SELECT EXISTS (SELECT 1 FROM ins) AS reserved, r.* FROM (SELECT 1) AS one LEFT JOIN (SELECT fingerprint, status_code, response_body, resource_type, resource_id, created_at FROM idempotency_records WHERE account_id = :account_id AND operation = :operation AND idempotency_key = :idem_key) AS r ON true;
-- 4. payments.rs next_intent_sequence (authorize).
SELECT COUNT(*) FROM payments WHERE account_id = :account_id AND order_ref = :order_ref;
-- 5. payments.rs insert_payment.
INSERT INTO payments (id, account_id, order_ref, intent, amount, currency, capture_method, payment_method, description, metadata, status, status_changed_at, created_at, updated_at, provider) VALUES (:payment_id, :account_id, :order_ref, :intent, :amount, :currency, :capture_method, :payment_method, :description, :metadata, 'processing', :ts, :ts, :ts, COALESCE((SELECT provider FROM accounts WHERE id = :account_id), :provider)) RETURNING id, account_id, order_ref, intent, amount, currency, capture_method, payment_method, description, metadata, status, amount_captured, amount_refund_reserved, amount_refunded, provider_ref, provider_sequence, failure_code, failure_message, cancel_requested_at, status_changed_at, created_at, updated_at, review_reason, review_from, provider;
-- 6. payments.rs open_intent on PostgreSQL: the intent, its attempt and its
--    outbox row in one data-modifying CTE (no NOTIFY since migration 0012:
--    cobro's doorbell sends one after the commit, outside this transaction,
--    coalesced across commits; the script sends none).
WITH i AS (INSERT INTO intents (id, account_id, payment_id, refund_id, operation, name, created_at) VALUES (:intent_id, :account_id, :payment_id, NULL, :operation, :intent, :ts) RETURNING id), a AS (INSERT INTO attempts (id, intent_id, payment_id, refund_id, operation, provider_key, reference, state, created_at, updated_at, account_id, provider) SELECT :attempt_id, i.id, :payment_id, NULL, :operation, :provider_key, :reference, 'pending', :ts, :ts, :account_id, (SELECT provider FROM payments WHERE id = :payment_id) FROM i RETURNING *), o AS (INSERT INTO outbox (id, attempt_id, state, due_at, created_at, updated_at, traceparent, tracestate, account_id) SELECT :outbox_id, a.id, 'pending', :ts, :ts, :ts, NULL, NULL, :account_id FROM a) SELECT a.id, a.intent_id, a.payment_id, a.refund_id, a.operation, a.provider_key, a.reference, a.state, a.send_count, a.first_send_at, a.last_send_at, a.provider_ref, a.last_error, a.created_at, a.updated_at, a.provider, a.provider_request_id, a.provider_replayed FROM a;
-- 7. idempotency.rs complete_key: the stored 201 body (a real one, -D body).
UPDATE idempotency_records SET status_code = :status_code, response_body = :body WHERE account_id = :account_id AND operation = :operation AND idempotency_key = :idem_key;
-- 8. keyed::commit.
COMMIT;
