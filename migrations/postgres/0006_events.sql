-- Events to merchants (issue #18). The SQLite twin is ../sqlite/0006_events.sql.
--
-- Every status change of a payment or refund, and every piece of
-- conflicting evidence kept about a payment, writes one `events` row IN THE
-- SAME STATEMENT, by trigger: whatever code path changes a status, the
-- schema writes its event, and a change that rolls back takes its event
-- with it. No event without its change, no change without its event.
--
-- `sequence` is the payment's own counter (`payments.event_seq`), bumped
-- under the payment's row lock: strictly increasing per payment, shared by
-- the payment's refunds. `feed_position` is the account-visible cursor of
-- `GET /v1/events`; it is NULL until the sequencer (store/events.rs)
-- assigns it to committed rows, one sequencer at a time, so positions
-- become visible in increasing order with no gap (a bigserial assigned at
-- INSERT can commit out of order and be skipped by a reader forever).

ALTER TABLE payments ADD COLUMN event_seq BIGINT NOT NULL DEFAULT 0;

CREATE TABLE events (
    id             UUID PRIMARY KEY,
    account_id     UUID NOT NULL REFERENCES accounts (id),
    -- Insertion order, for the sequencer only (it can commit out of order).
    written        BIGSERIAL NOT NULL,
    feed_position  BIGINT UNIQUE,
    type           TEXT NOT NULL,
    object_type    TEXT NOT NULL CHECK (object_type IN ('payment', 'refund')),
    object_id      UUID NOT NULL,
    payment_id     UUID NOT NULL,
    sequence       BIGINT NOT NULL,
    -- The object's public representation after the change (JSON text).
    data           TEXT NOT NULL,
    created_at     TIMESTAMPTZ NOT NULL,
    UNIQUE (payment_id, sequence)
);
CREATE INDEX events_unsequenced ON events (written) WHERE feed_position IS NULL;
CREATE INDEX events_feed ON events (account_id, feed_position);
CREATE INDEX events_by_object ON events (object_id, sequence);

-- The public representation of a payment (the API's `Payment` without
-- `attempts`) and of a refund, as the events carry them.
CREATE FUNCTION cobro_json_time(t TIMESTAMPTZ) RETURNS TEXT LANGUAGE sql IMMUTABLE AS $$
    SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
$$;

CREATE VIEW payment_event_objects AS
SELECT p.id, p.account_id, p.event_seq, p.updated_at, jsonb_build_object(
    'id', p.id, 'intent', p.intent, 'order_ref', p.order_ref, 'amount', p.amount,
    'currency', p.currency, 'capture_method', p.capture_method, 'status', p.status,
    'amount_captured', p.amount_captured, 'amount_refunded', p.amount_refunded,
    'provider_ref', p.provider_ref,
    'failure', CASE WHEN p.failure_code IS NULL THEN NULL
               ELSE jsonb_build_object('code', p.failure_code, 'message', p.failure_message) END,
    'cancel_requested', p.cancel_requested_at IS NOT NULL,
    'description', p.description, 'metadata', p.metadata::jsonb,
    'created_at', cobro_json_time(p.created_at), 'updated_at', cobro_json_time(p.updated_at)
)::text AS data
FROM payments p;

CREATE VIEW refund_event_objects AS
SELECT r.id, r.account_id, r.payment_id, r.updated_at, jsonb_build_object(
    'id', r.id, 'payment_id', r.payment_id, 'intent', r.intent, 'amount', r.amount,
    'reason', r.reason, 'status', r.status, 'provider_ref', r.provider_ref,
    'failure', CASE WHEN r.failure_code IS NULL THEN NULL
               ELSE jsonb_build_object('code', r.failure_code, 'message', r.failure_message) END,
    'created_at', cobro_json_time(r.created_at), 'updated_at', cobro_json_time(r.updated_at)
)::text AS data
FROM refunds r;

-- Payments: the sequence is bumped in the changing row itself (BEFORE),
-- the event is written from the row as committed (AFTER).
CREATE FUNCTION cobro_payment_event_seq() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.event_seq := 1;
    ELSIF NEW.status IS DISTINCT FROM OLD.status THEN
        NEW.event_seq := OLD.event_seq + 1;
    END IF;
    RETURN NEW;
END;
$$;

CREATE FUNCTION cobro_payment_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.status IS NOT DISTINCT FROM OLD.status THEN
        RETURN NULL;
    END IF;
    INSERT INTO events (id, account_id, type, object_type, object_id, payment_id, sequence, data, created_at)
    SELECT gen_random_uuid(), o.account_id,
           CASE WHEN TG_OP = 'INSERT' THEN 'payment.created' ELSE 'payment.' || NEW.status END,
           'payment', o.id, o.id, o.event_seq, o.data, o.updated_at
    FROM payment_event_objects o WHERE o.id = NEW.id;
    RETURN NULL;
END;
$$;

CREATE TRIGGER payments_event_seq BEFORE INSERT OR UPDATE OF status ON payments
    FOR EACH ROW EXECUTE FUNCTION cobro_payment_event_seq();
CREATE TRIGGER payments_event AFTER INSERT OR UPDATE OF status ON payments
    FOR EACH ROW EXECUTE FUNCTION cobro_payment_event();

-- Refunds share their payment's sequence: the bump takes the payment's row
-- lock, so a payment's events are written one transaction at a time.
CREATE FUNCTION cobro_refund_event() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    seq BIGINT;
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.status IS NOT DISTINCT FROM OLD.status THEN
        RETURN NULL;
    END IF;
    UPDATE payments SET event_seq = event_seq + 1 WHERE id = NEW.payment_id
        RETURNING event_seq INTO seq;
    INSERT INTO events (id, account_id, type, object_type, object_id, payment_id, sequence, data, created_at)
    SELECT gen_random_uuid(), o.account_id,
           CASE WHEN TG_OP = 'INSERT' THEN 'refund.created' ELSE 'refund.' || NEW.status END,
           'refund', o.id, o.payment_id, seq, o.data, o.updated_at
    FROM refund_event_objects o WHERE o.id = NEW.id;
    RETURN NULL;
END;
$$;

CREATE TRIGGER refunds_event AFTER INSERT OR UPDATE OF status ON refunds
    FOR EACH ROW EXECUTE FUNCTION cobro_refund_event();

-- Conflicting evidence kept about a payment: `payment.conflict_found` with
-- the payment as it is (the status change to needs_review, if any, has its
-- own event).
CREATE FUNCTION cobro_conflict_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE payments SET event_seq = event_seq + 1 WHERE id = NEW.payment_id;
    INSERT INTO events (id, account_id, type, object_type, object_id, payment_id, sequence, data, created_at)
    SELECT gen_random_uuid(), o.account_id, 'payment.conflict_found', 'payment', o.id, o.id,
           o.event_seq, o.data, NEW.found_at
    FROM payment_event_objects o WHERE o.id = NEW.payment_id;
    RETURN NULL;
END;
$$;

CREATE TRIGGER evidence_conflicts_event AFTER INSERT ON evidence_conflicts
    FOR EACH ROW WHEN (NEW.payment_id IS NOT NULL) EXECUTE FUNCTION cobro_conflict_event();

-- Where events go: per account, one or more endpoints. The secret signs
-- (it must be readable, unlike API tokens); `previous_secret` still signs
-- until `previous_secret_expires_at` (rotation: receivers accept either).
CREATE TABLE event_endpoints (
    id                         UUID PRIMARY KEY,
    account_id                 UUID NOT NULL REFERENCES accounts (id),
    url                        TEXT NOT NULL,
    secret                     TEXT NOT NULL,
    previous_secret            TEXT,
    previous_secret_expires_at TIMESTAMPTZ,
    -- '*' or a comma-separated list of event types.
    event_types                TEXT NOT NULL,
    enabled                    BOOLEAN NOT NULL,
    disabled_reason            TEXT,
    -- The first failure since the last success (NULL while healthy).
    failing_since              TIMESTAMPTZ,
    created_at                 TIMESTAMPTZ NOT NULL,
    updated_at                 TIMESTAMPTZ NOT NULL
);
CREATE INDEX event_endpoints_by_account ON event_endpoints (account_id);

-- One event to one endpoint. `due_at` is both the schedule and the lease
-- (as in `outbox`); `lease_token` is the fencing token.
CREATE TABLE event_deliveries (
    event_id         UUID NOT NULL REFERENCES events (id),
    endpoint_id      UUID NOT NULL REFERENCES event_endpoints (id) ON DELETE CASCADE,
    account_id       UUID NOT NULL REFERENCES accounts (id),
    state            TEXT NOT NULL CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    due_at           TIMESTAMPTZ NOT NULL,
    lease_owner      TEXT,
    lease_token      BIGINT NOT NULL DEFAULT 0,
    lease_expires_at TIMESTAMPTZ,
    last_status      INTEGER,
    last_error       TEXT,
    -- The retry period runs from the first attempt (reset by a resend).
    first_attempt_at TIMESTAMPTZ,
    delivered_at     TIMESTAMPTZ,
    created_at       TIMESTAMPTZ NOT NULL,
    updated_at       TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (event_id, endpoint_id)
);
CREATE INDEX event_deliveries_due ON event_deliveries (due_at) WHERE state = 'pending';
CREATE INDEX event_deliveries_dead ON event_deliveries (account_id) WHERE state = 'dead';
