-- Routing across providers (issue 51, docs/routing.md). The SQLite twin is
-- ../sqlite/0023_routing.sql.

-- An account's routing rules: the rule set as JSON text (its format is
-- cobro_core::routing::RuleSet), validated against the providers file when
-- it is set and when cobro starts. `version` counts changes; every change
-- is also an audit row (`routing_changes`).
CREATE TABLE routing_rules (
    account_id  UUID PRIMARY KEY REFERENCES accounts (id),
    rules       TEXT NOT NULL,
    version     BIGINT NOT NULL,
    updated_by  TEXT NOT NULL,
    updated_at  TIMESTAMPTZ NOT NULL
);

-- Who changed an account's rules, when, from what to what.
CREATE TABLE routing_changes (
    id          UUID PRIMARY KEY,
    account_id  UUID NOT NULL REFERENCES accounts (id),
    version     BIGINT NOT NULL,
    rules       TEXT,
    actor       TEXT NOT NULL,
    at          TIMESTAMPTZ NOT NULL
);
CREATE INDEX routing_changes_by_account ON routing_changes (account_id, at);

-- The routing decision of a payment (JSON text: the rule, the chain of
-- providers it may go to in order, why, and every move along the chain
-- with its proof). `payments.provider` stays the provider its current
-- attempt goes to, and the one that holds its charge once it has one.
ALTER TABLE payments ADD COLUMN route TEXT;

-- Sends of an attempt proven never to have left (the provider's
-- `NotSent`): an attempt whose every send is counted here has provably
-- had no effect, so it may move to the next provider without a query.
ALTER TABLE attempts ADD COLUMN sends_not_left INTEGER NOT NULL DEFAULT 0;

-- At most one attempt of an intent ever takes effect, whichever provider
-- it went to: the schema's last word, beside one unresolved attempt per
-- intent.
CREATE UNIQUE INDEX attempts_one_success_per_intent ON attempts (account_id, intent_id)
    WHERE state = 'succeeded' AND intent_id IS NOT NULL;

-- Provider health, shared by every cobro process: one row per provider,
-- time bucket (unix seconds / bucket width) and process, so processes
-- never write the same row; a window is the sum of its buckets.
CREATE TABLE provider_health (
    provider    TEXT NOT NULL,
    bucket      BIGINT NOT NULL,
    owner       TEXT NOT NULL,
    calls       BIGINT NOT NULL,
    errors      BIGINT NOT NULL,
    latency_ms  BIGINT NOT NULL,
    PRIMARY KEY (provider, bucket, owner)
);

-- Each provider's circuit breaker: `closed` (routed to), `open` since
-- `opened_at` (skipped by routing; half-open once its cool-down has
-- passed). `closed_at` starts the window the next opening counts.
CREATE TABLE provider_circuits (
    provider    TEXT PRIMARY KEY,
    state       TEXT NOT NULL CHECK (state IN ('closed', 'open')),
    opened_at   TIMESTAMPTZ,
    closed_at   TIMESTAMPTZ,
    reason      TEXT,
    updated_at  TIMESTAMPTZ NOT NULL
);

-- Events say which provider, and how the payment was routed.
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
    'action_expires_at', CASE WHEN p.status = 'requires_action' THEN cobro_json_time(p.action_expires_at) END,
    'provider', p.provider,
    'routing', p.route::jsonb
)::text AS data
FROM payments p;

-- A payment that moves to the next provider of its route says so:
-- `payment.rerouted`, with the payment (its provider and route) as it is
-- now, in the payment's own sequence, as `payment.conflict_found` does.
CREATE FUNCTION cobro_payment_rerouted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE payments SET event_seq = event_seq + 1 WHERE id = NEW.id;
    INSERT INTO events (id, account_id, type, object_type, object_id, payment_id, sequence, data, created_at)
    SELECT gen_random_uuid(), o.account_id, 'payment.rerouted', 'payment', o.id, o.id,
           o.event_seq, o.data, o.updated_at
    FROM payment_event_objects o WHERE o.id = NEW.id;
    RETURN NULL;
END;
$$;

CREATE TRIGGER payments_rerouted AFTER UPDATE OF provider ON payments
    FOR EACH ROW WHEN (OLD.provider IS NOT NULL AND NEW.provider IS DISTINCT FROM OLD.provider)
    EXECUTE FUNCTION cobro_payment_rerouted();
