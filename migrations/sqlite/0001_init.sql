-- cobro schema v1 (SQLite). The PostgreSQL twin is ../postgres/0001_init.sql;
-- keep them in step (see ../README.md).

CREATE TABLE accounts (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    created_at  TEXT NOT NULL
);

-- Tokens are high-entropy secrets: a SHA-256 is the right lookup key (a slow
-- password hash per request would buy nothing).
CREATE TABLE api_tokens (
    id          TEXT PRIMARY KEY,
    account_id  TEXT NOT NULL REFERENCES accounts (id),
    token_hash  TEXT NOT NULL UNIQUE,
    label       TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    revoked_at  TEXT
);

-- One row per (account, operation, key). Inserted and completed in the same
-- transaction as the business rows, so a concurrent request with the same
-- key waits on the primary key until that transaction ends.
CREATE TABLE idempotency_records (
    account_id      TEXT NOT NULL REFERENCES accounts (id),
    operation       TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    fingerprint     TEXT NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('completed', 'tombstone')),
    status_code     INTEGER NOT NULL,
    response_body   BLOB,               -- NULL once compacted to a tombstone
    resource_type   TEXT NOT NULL CHECK (resource_type IN ('payment', 'refund')),
    resource_id     TEXT NOT NULL,
    created_at      TEXT NOT NULL,
    PRIMARY KEY (account_id, operation, idempotency_key),
    CHECK ((state = 'completed') = (response_body IS NOT NULL))
);
CREATE INDEX idempotency_records_purge ON idempotency_records (state, created_at);

CREATE TABLE payments (
    id                     TEXT PRIMARY KEY,
    account_id             TEXT NOT NULL REFERENCES accounts (id),
    order_ref              TEXT NOT NULL,
    intent                 TEXT NOT NULL,
    amount                 INTEGER NOT NULL CHECK (amount > 0),
    currency               TEXT NOT NULL,
    capture_method         TEXT NOT NULL CHECK (capture_method IN ('automatic', 'manual')),
    payment_method         TEXT NOT NULL,
    description            TEXT,
    metadata               TEXT NOT NULL DEFAULT '{}',
    status                 TEXT NOT NULL,
    amount_captured        INTEGER NOT NULL DEFAULT 0,
    -- Sum of refunds that are not failed (processing or succeeded). Refund
    -- creation raises it with a conditional UPDATE, so concurrent refunds
    -- serialise on this row and can never exceed the captured amount.
    amount_refund_reserved INTEGER NOT NULL DEFAULT 0,
    amount_refunded        INTEGER NOT NULL DEFAULT 0,
    provider_ref           TEXT,
    -- Highest provider event sequence applied: older events never move the
    -- payment backwards.
    provider_sequence      INTEGER NOT NULL DEFAULT 0,
    failure_code           TEXT,
    failure_message        TEXT,
    cancel_requested_at    TEXT,
    status_changed_at      TEXT NOT NULL,
    created_at             TEXT NOT NULL,
    updated_at             TEXT NOT NULL,
    CHECK (amount_refund_reserved <= amount_captured),
    CHECK (amount_refunded <= amount_refund_reserved)
);
-- At most one payment per order that is not a terminal failure (section 7).
CREATE UNIQUE INDEX payments_one_active_per_order ON payments (account_id, order_ref)
    WHERE status NOT IN ('declined', 'failed', 'canceled');
CREATE INDEX payments_by_account ON payments (account_id, id DESC);
CREATE INDEX payments_by_order ON payments (account_id, order_ref, id DESC);
-- The reconciler's and the CLI's view: its size follows the uncertain
-- payments, not the table.
CREATE INDEX payments_unsettled ON payments (status, status_changed_at)
    WHERE status IN ('processing', 'requires_reconciliation', 'needs_review', 'capturing', 'canceling');

CREATE TABLE refunds (
    id                TEXT PRIMARY KEY,
    account_id        TEXT NOT NULL REFERENCES accounts (id),
    payment_id        TEXT NOT NULL REFERENCES payments (id),
    intent            TEXT NOT NULL,
    amount            INTEGER NOT NULL CHECK (amount > 0),
    reason            TEXT,
    status            TEXT NOT NULL,
    provider_ref      TEXT,
    failure_code      TEXT,
    failure_message   TEXT,
    status_changed_at TEXT NOT NULL,
    created_at        TEXT NOT NULL,
    updated_at        TEXT NOT NULL
);
CREATE INDEX refunds_by_payment ON refunds (payment_id, id);
CREATE INDEX refunds_unsettled ON refunds (status, status_changed_at)
    WHERE status IN ('processing', 'requires_reconciliation', 'needs_review');

-- One intended mutation, named {order_ref}:{verb}-v{n}.
CREATE TABLE intents (
    id          TEXT PRIMARY KEY,
    account_id  TEXT NOT NULL REFERENCES accounts (id),
    payment_id  TEXT NOT NULL REFERENCES payments (id),
    refund_id   TEXT REFERENCES refunds (id),
    operation   TEXT NOT NULL,
    name        TEXT NOT NULL,
    created_at  TEXT NOT NULL,
    UNIQUE (account_id, name)
);

-- One provider call series under one provider idempotency key, generated and
-- stored here before the first send.
CREATE TABLE attempts (
    id             TEXT PRIMARY KEY,
    intent_id      TEXT NOT NULL REFERENCES intents (id),
    payment_id     TEXT NOT NULL REFERENCES payments (id),
    refund_id      TEXT REFERENCES refunds (id),
    operation      TEXT NOT NULL,
    provider_key   TEXT NOT NULL UNIQUE,
    reference      TEXT NOT NULL,
    state          TEXT NOT NULL,
    send_count     INTEGER NOT NULL DEFAULT 0,
    first_send_at  TEXT,
    last_send_at   TEXT,
    provider_ref   TEXT,
    last_error     TEXT,
    created_at     TEXT NOT NULL,
    updated_at     TEXT NOT NULL
);
-- A second attempt for an intent can exist only once the first is resolved
-- (proven to have had no effect, or settled).
CREATE UNIQUE INDEX attempts_one_unresolved_per_intent ON attempts (intent_id)
    WHERE state IN ('pending', 'unknown', 'reconciling');
CREATE INDEX attempts_by_payment ON attempts (payment_id, created_at);
CREATE INDEX attempts_by_reference ON attempts (reference);
CREATE INDEX attempts_uncertain ON attempts (state, last_send_at)
    WHERE state IN ('unknown', 'reconciling');

-- Work for the outbox worker. `due_at` is both the schedule and the lease:
-- a claim pushes it to the lease expiry, so a row whose worker died becomes
-- due again by itself. `lease_token` is the fencing token.
CREATE TABLE outbox (
    id               TEXT PRIMARY KEY,
    attempt_id       TEXT NOT NULL UNIQUE REFERENCES attempts (id),
    state            TEXT NOT NULL CHECK (state IN ('pending', 'done')),
    due_at           TEXT NOT NULL,
    lease_owner      TEXT,
    lease_token      INTEGER NOT NULL DEFAULT 0,
    lease_expires_at TEXT,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL
);
CREATE INDEX outbox_due ON outbox (due_at) WHERE state = 'pending';

-- What a stale lease owner learned after it lost its lease: kept for the
-- reconciler, never applied blindly.
CREATE TABLE attempt_observations (
    id           TEXT PRIMARY KEY,
    attempt_id   TEXT NOT NULL REFERENCES attempts (id),
    lease_token  INTEGER NOT NULL,
    outcome      TEXT NOT NULL,
    detail       TEXT NOT NULL,
    observed_at  TEXT NOT NULL
);
CREATE INDEX attempt_observations_by_attempt ON attempt_observations (attempt_id);

CREATE TABLE webhook_events (
    provider      TEXT NOT NULL,
    event_id      TEXT NOT NULL,
    event_type    TEXT NOT NULL,
    sequence      INTEGER NOT NULL,
    payment_id    TEXT,
    outcome       TEXT NOT NULL,
    payload       TEXT NOT NULL,
    received_at   TEXT NOT NULL,
    PRIMARY KEY (provider, event_id)
);
CREATE INDEX webhook_events_purge ON webhook_events (received_at);

CREATE TABLE reconciliation_runs (
    id           TEXT PRIMARY KEY,
    trigger      TEXT NOT NULL,
    actor        TEXT NOT NULL,
    dry_run      INTEGER NOT NULL,
    started_at   TEXT NOT NULL,
    finished_at  TEXT,
    summary      TEXT
);

-- The audit trail: every decision about an uncertain outcome, automatic or
-- by hand.
CREATE TABLE reconciliation_decisions (
    id             TEXT PRIMARY KEY,
    run_id         TEXT REFERENCES reconciliation_runs (id),
    payment_id     TEXT NOT NULL REFERENCES payments (id),
    refund_id      TEXT REFERENCES refunds (id),
    attempt_id     TEXT REFERENCES attempts (id),
    state_before   TEXT NOT NULL,
    state_after    TEXT NOT NULL,
    provider_said  TEXT NOT NULL,
    decision       TEXT NOT NULL,
    actor          TEXT NOT NULL,
    reason         TEXT,
    decided_at     TEXT NOT NULL
);
CREATE INDEX reconciliation_decisions_by_payment ON reconciliation_decisions (payment_id, decided_at);
