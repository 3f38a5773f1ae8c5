-- Routing across providers (issue 51): see ../postgres/0023_routing.sql.
-- The same tables, columns, indexes and view.
CREATE TABLE routing_rules (
    account_id  TEXT PRIMARY KEY REFERENCES accounts (id),
    rules       TEXT NOT NULL,
    version     INTEGER NOT NULL,
    updated_by  TEXT NOT NULL,
    updated_at  TEXT NOT NULL
);

CREATE TABLE routing_changes (
    id          TEXT PRIMARY KEY,
    account_id  TEXT NOT NULL REFERENCES accounts (id),
    version     INTEGER NOT NULL,
    rules       TEXT,
    actor       TEXT NOT NULL,
    at          TEXT NOT NULL
);
CREATE INDEX routing_changes_by_account ON routing_changes (account_id, at);

ALTER TABLE payments ADD COLUMN route TEXT;

ALTER TABLE attempts ADD COLUMN sends_not_left INTEGER NOT NULL DEFAULT 0;

CREATE UNIQUE INDEX attempts_one_success_per_intent ON attempts (account_id, intent_id)
    WHERE state = 'succeeded' AND intent_id IS NOT NULL;

CREATE TABLE provider_health (
    provider    TEXT NOT NULL,
    bucket      INTEGER NOT NULL,
    owner       TEXT NOT NULL,
    calls       INTEGER NOT NULL,
    errors      INTEGER NOT NULL,
    latency_ms  INTEGER NOT NULL,
    PRIMARY KEY (provider, bucket, owner)
);

CREATE TABLE provider_circuits (
    provider    TEXT PRIMARY KEY,
    state       TEXT NOT NULL CHECK (state IN ('closed', 'open')),
    opened_at   TEXT,
    closed_at   TEXT,
    reason      TEXT,
    updated_at  TEXT NOT NULL
);

DROP VIEW payment_event_objects;
CREATE VIEW payment_event_objects AS
SELECT p.id, p.account_id, p.event_seq, p.updated_at, json_object(
    'id', p.id, 'intent', p.intent, 'order_ref', p.order_ref, 'amount', p.amount,
    'currency', p.currency, 'capture_method', p.capture_method, 'status', p.status,
    'amount_captured', p.amount_captured, 'amount_refunded', p.amount_refunded,
    'provider_ref', p.provider_ref,
    'failure', CASE WHEN p.failure_code IS NULL THEN NULL
               ELSE json_object('code', p.failure_code, 'message', p.failure_message) END,
    'cancel_requested', json(CASE WHEN p.cancel_requested_at IS NULL THEN 'false' ELSE 'true' END),
    'description', p.description, 'metadata', json(p.metadata),
    'created_at', p.created_at, 'updated_at', p.updated_at,
    'return_url', p.return_url,
    'next_action', CASE WHEN p.status = 'requires_action' THEN json(p.next_action) END,
    'action_expires_at', CASE WHEN p.status = 'requires_action' THEN p.action_expires_at END,
    'provider', p.provider,
    'routing', json(p.route)
) AS data
FROM payments p;

CREATE TRIGGER payments_rerouted AFTER UPDATE OF provider ON payments
WHEN OLD.provider IS NOT NULL AND NEW.provider IS NOT OLD.provider
BEGIN
    UPDATE payments SET event_seq = event_seq + 1 WHERE id = NEW.id;
    INSERT INTO events (id, account_id, written, type, object_type, object_id, payment_id, sequence, data, created_at)
    SELECT (SELECT id FROM cobro_random_uuid), o.account_id,
           (SELECT COALESCE(MAX(written), 0) + 1 FROM events),
           'payment.rerouted', 'payment', o.id, o.id, o.event_seq, o.data, o.updated_at
    FROM payment_event_objects o WHERE o.id = NEW.id;
END;
