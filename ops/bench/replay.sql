-- pgbench: a replayed POST /v1/payments (the key is already completed), as
-- cobro runs it (ops/bench.sh; every variable comes from -D).
--
-- The account extractor sends nothing: a steady client's token is in the
-- API's token cache (cobro_api::tokens, at most COBRO_TOKEN_CACHE_TTL old),
-- so one lookup per token every 2 s, not one per request. cobro draws the
-- payment id the reservation would create in process; its INSERT conflicts,
-- so here a fixed id (:payment_id) and time (:ts) do the same work.
--
-- 1. keyed::begin: sqlx pool.begin() sends BEGIN on its own.
BEGIN;
-- 2. idempotency.rs reserve_key on PostgreSQL: the INSERT (which conflicts
--    with the committed record: no row) and the read of that record, one
--    statement.
WITH ins AS (INSERT INTO idempotency_records (account_id, operation, idempotency_key, fingerprint, state, status_code, response_body, resource_type, resource_id, created_at) VALUES (:account_id, :operation, :replay_key, :fingerprint, 'completed', 0, :empty, :resource_type, :payment_id, :ts) ON CONFLICT (account_id, operation, idempotency_key) DO NOTHING RETURNING 1) SELECT EXISTS (SELECT 1 FROM ins) AS reserved, r.* FROM (SELECT 1) AS one LEFT JOIN (SELECT fingerprint, status_code, response_body, resource_type, resource_id, created_at FROM idempotency_records WHERE account_id = :account_id AND operation = :operation AND idempotency_key = :replay_key) AS r ON true;
-- 3. keyed::begin rolls the transaction back before answering.
ROLLBACK;
