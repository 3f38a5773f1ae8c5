-- Events to merchants (issue #18). The twin of ../postgres/0006_events.sql;
-- see there for the why. SQLite has one writer, so the triggers need no
-- locks; `written` is assigned in the trigger (max + 1) because only one
-- transaction writes at a time.

ALTER TABLE payments ADD COLUMN event_seq INTEGER NOT NULL DEFAULT 0;

CREATE TABLE events (
    id             TEXT PRIMARY KEY,
    account_id     TEXT NOT NULL REFERENCES accounts (id),
    written        INTEGER NOT NULL UNIQUE,
    feed_position  INTEGER UNIQUE,
    type           TEXT NOT NULL,
    object_type    TEXT NOT NULL CHECK (object_type IN ('payment', 'refund')),
    object_id      TEXT NOT NULL,
    payment_id     TEXT NOT NULL,
    sequence       INTEGER NOT NULL,
    data           TEXT NOT NULL,
    created_at     TEXT NOT NULL,
    UNIQUE (payment_id, sequence)
);
CREATE INDEX events_unsequenced ON events (written) WHERE feed_position IS NULL;
CREATE INDEX events_feed ON events (account_id, feed_position);
CREATE INDEX events_by_object ON events (object_id, sequence);

-- Times are stored as fixed-width UTC RFC 3339 text already: the
-- representation carries them as they are.
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
    'created_at', p.created_at, 'updated_at', p.updated_at
) AS data
FROM payments p;

CREATE VIEW refund_event_objects AS
SELECT r.id, r.account_id, r.payment_id, r.updated_at, json_object(
    'id', r.id, 'payment_id', r.payment_id, 'intent', r.intent, 'amount', r.amount,
    'reason', r.reason, 'status', r.status, 'provider_ref', r.provider_ref,
    'failure', CASE WHEN r.failure_code IS NULL THEN NULL
               ELSE json_object('code', r.failure_code, 'message', r.failure_message) END,
    'created_at', r.created_at, 'updated_at', r.updated_at
) AS data
FROM refunds r;

-- A random (v4) UUID as hyphenated text, for event ids.
CREATE VIEW cobro_random_uuid AS
SELECT lower(hex(randomblob(4))) || '-' || lower(hex(randomblob(2))) || '-4'
    || substr(lower(hex(randomblob(2))), 2) || '-'
    || substr('89ab', 1 + (abs(random()) % 4), 1) || substr(lower(hex(randomblob(2))), 2) || '-'
    || lower(hex(randomblob(6))) AS id;

CREATE TRIGGER payments_event_insert AFTER INSERT ON payments
BEGIN
    UPDATE payments SET event_seq = 1 WHERE id = NEW.id;
    INSERT INTO events (id, account_id, written, type, object_type, object_id, payment_id, sequence, data, created_at)
    SELECT (SELECT id FROM cobro_random_uuid), o.account_id,
           (SELECT COALESCE(MAX(written), 0) + 1 FROM events),
           'payment.created', 'payment', o.id, o.id, o.event_seq, o.data, o.updated_at
    FROM payment_event_objects o WHERE o.id = NEW.id;
END;

CREATE TRIGGER payments_event_update AFTER UPDATE OF status ON payments
WHEN NEW.status IS NOT OLD.status
BEGIN
    UPDATE payments SET event_seq = event_seq + 1 WHERE id = NEW.id;
    INSERT INTO events (id, account_id, written, type, object_type, object_id, payment_id, sequence, data, created_at)
    SELECT (SELECT id FROM cobro_random_uuid), o.account_id,
           (SELECT COALESCE(MAX(written), 0) + 1 FROM events),
           'payment.' || NEW.status, 'payment', o.id, o.id, o.event_seq, o.data, o.updated_at
    FROM payment_event_objects o WHERE o.id = NEW.id;
END;

CREATE TRIGGER refunds_event_insert AFTER INSERT ON refunds
BEGIN
    UPDATE payments SET event_seq = event_seq + 1 WHERE id = NEW.payment_id;
    INSERT INTO events (id, account_id, written, type, object_type, object_id, payment_id, sequence, data, created_at)
    SELECT (SELECT id FROM cobro_random_uuid), o.account_id,
           (SELECT COALESCE(MAX(written), 0) + 1 FROM events),
           'refund.created', 'refund', o.id, o.payment_id,
           (SELECT event_seq FROM payments WHERE id = NEW.payment_id), o.data, o.updated_at
    FROM refund_event_objects o WHERE o.id = NEW.id;
END;

CREATE TRIGGER refunds_event_update AFTER UPDATE OF status ON refunds
WHEN NEW.status IS NOT OLD.status
BEGIN
    UPDATE payments SET event_seq = event_seq + 1 WHERE id = NEW.payment_id;
    INSERT INTO events (id, account_id, written, type, object_type, object_id, payment_id, sequence, data, created_at)
    SELECT (SELECT id FROM cobro_random_uuid), o.account_id,
           (SELECT COALESCE(MAX(written), 0) + 1 FROM events),
           'refund.' || NEW.status, 'refund', o.id, o.payment_id,
           (SELECT event_seq FROM payments WHERE id = NEW.payment_id), o.data, o.updated_at
    FROM refund_event_objects o WHERE o.id = NEW.id;
END;

CREATE TRIGGER evidence_conflicts_event AFTER INSERT ON evidence_conflicts
WHEN NEW.payment_id IS NOT NULL
BEGIN
    UPDATE payments SET event_seq = event_seq + 1 WHERE id = NEW.payment_id;
    INSERT INTO events (id, account_id, written, type, object_type, object_id, payment_id, sequence, data, created_at)
    SELECT (SELECT id FROM cobro_random_uuid), o.account_id,
           (SELECT COALESCE(MAX(written), 0) + 1 FROM events),
           'payment.conflict_found', 'payment', o.id, o.id, o.event_seq, o.data, NEW.found_at
    FROM payment_event_objects o WHERE o.id = NEW.payment_id;
END;

CREATE TABLE event_endpoints (
    id                         TEXT PRIMARY KEY,
    account_id                 TEXT NOT NULL REFERENCES accounts (id),
    url                        TEXT NOT NULL,
    secret                     TEXT NOT NULL,
    previous_secret            TEXT,
    previous_secret_expires_at TEXT,
    event_types                TEXT NOT NULL,
    enabled                    INTEGER NOT NULL,
    disabled_reason            TEXT,
    failing_since              TEXT,
    created_at                 TEXT NOT NULL,
    updated_at                 TEXT NOT NULL
);
CREATE INDEX event_endpoints_by_account ON event_endpoints (account_id);

CREATE TABLE event_deliveries (
    event_id         TEXT NOT NULL REFERENCES events (id),
    endpoint_id      TEXT NOT NULL REFERENCES event_endpoints (id) ON DELETE CASCADE,
    account_id       TEXT NOT NULL REFERENCES accounts (id),
    state            TEXT NOT NULL CHECK (state IN ('pending', 'delivered', 'dead')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    due_at           TEXT NOT NULL,
    lease_owner      TEXT,
    lease_token      INTEGER NOT NULL DEFAULT 0,
    lease_expires_at TEXT,
    last_status      INTEGER,
    last_error       TEXT,
    first_attempt_at TEXT,
    delivered_at     TEXT,
    created_at       TEXT NOT NULL,
    updated_at       TEXT NOT NULL,
    PRIMARY KEY (event_id, endpoint_id)
);
CREATE INDEX event_deliveries_due ON event_deliveries (due_at) WHERE state = 'pending';
CREATE INDEX event_deliveries_dead ON event_deliveries (account_id) WHERE state = 'dead';
