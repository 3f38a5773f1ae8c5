-- Evidence and identity (provider-and-recovery.md section 7). The twin of
-- ../postgres/0004_evidence_and_identity.sql; see there for the why.

DROP INDEX attempts_one_unresolved_per_intent;
CREATE UNIQUE INDEX attempts_one_unresolved_per_intent ON attempts (intent_id)
    WHERE state IN ('pending', 'unknown', 'reconciling', 'held');

DROP INDEX attempts_uncertain;
CREATE INDEX attempts_uncertain ON attempts (state, last_send_at)
    WHERE state IN ('pending', 'unknown', 'reconciling');

ALTER TABLE payments ADD COLUMN review_reason TEXT;
-- The status a payment had when conflicting evidence stopped it (an
-- operator who finds the record right restores it).
ALTER TABLE payments ADD COLUMN review_from TEXT;

CREATE TABLE evidence_conflicts (
    id           TEXT PRIMARY KEY,
    payment_id   TEXT REFERENCES payments (id),
    refund_id    TEXT REFERENCES refunds (id),
    attempt_id   TEXT REFERENCES attempts (id),
    source       TEXT NOT NULL,
    kind         TEXT NOT NULL,
    detail       TEXT NOT NULL,
    evidence     TEXT NOT NULL,
    found_at     TEXT NOT NULL,
    resolved_at  TEXT
);
CREATE INDEX evidence_conflicts_open ON evidence_conflicts (found_at) WHERE resolved_at IS NULL;
CREATE INDEX evidence_conflicts_by_payment ON evidence_conflicts (payment_id);

CREATE TRIGGER attempts_refuse_blocked_insert BEFORE INSERT ON attempts
    FOR EACH ROW WHEN NEW.state = 'pending' AND (
        EXISTS (SELECT 1 FROM payments p WHERE p.id = NEW.payment_id
                  AND p.status IN ('requires_reconciliation', 'needs_review'))
        OR (NEW.refund_id IS NOT NULL AND EXISTS (SELECT 1 FROM refunds r WHERE r.id = NEW.refund_id
                  AND r.status IN ('requires_reconciliation', 'needs_review'))))
BEGIN
    SELECT RAISE(ABORT, 'cobro_send_blocked: the payment is under reconciliation or review');
END;

CREATE TRIGGER attempts_refuse_blocked_release BEFORE UPDATE OF state ON attempts
    FOR EACH ROW WHEN NEW.state = 'pending' AND OLD.state <> 'pending' AND (
        EXISTS (SELECT 1 FROM payments p WHERE p.id = NEW.payment_id
                  AND p.status IN ('requires_reconciliation', 'needs_review'))
        OR (NEW.refund_id IS NOT NULL AND EXISTS (SELECT 1 FROM refunds r WHERE r.id = NEW.refund_id
                  AND r.status IN ('requires_reconciliation', 'needs_review'))))
BEGIN
    SELECT RAISE(ABORT, 'cobro_send_blocked: the payment is under reconciliation or review');
END;
