-- pgbench: a replayed POST /v1/payments (the key is already completed), as
-- cobro runs it (ops/bench.sh; variables come from -D and the \gset below).
--
-- 1. Account extractor: accounts.rs account_for_token_at. cobro draws a fresh
--    payment id and reads its clock in process; the lookup returns them here.
-- mirrors: SELECT account_id FROM api_tokens WHERE token_hash = ? AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > ?)
SELECT account_id, gen_random_uuid() AS payment_id, clock_timestamp() AS ts
  FROM api_tokens
 WHERE token_hash = :token_hash AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > :now) \gset
-- 2. keyed::begin: BEGIN, then idempotency.rs reserve_key, whose INSERT
--    conflicts with the committed record (0 rows) ...
BEGIN;
INSERT INTO idempotency_records (account_id, operation, idempotency_key, fingerprint, state, status_code, response_body, resource_type, resource_id, created_at) VALUES (:account_id, :operation, :replay_key, :fingerprint, 'completed', 0, :empty, :resource_type, :payment_id, :ts) ON CONFLICT (account_id, operation, idempotency_key) DO NOTHING;
-- 3. ... so it reads the stored record (SELECT_RECORD) ...
SELECT fingerprint, status_code, response_body, resource_type, resource_id, created_at FROM idempotency_records WHERE account_id = :account_id AND operation = :operation AND idempotency_key = :replay_key;
-- 4. ... and keyed::begin rolls the transaction back before answering.
ROLLBACK;
