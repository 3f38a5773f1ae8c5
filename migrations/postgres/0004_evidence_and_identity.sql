-- Evidence and identity (provider-and-recovery.md section 7).

-- A cancel asked for while the authorisation is unknown is an attempt of
-- its own in state `held` (no outbox row until released). It counts as the
-- cancel intent's one unresolved attempt.
DROP INDEX attempts_one_unresolved_per_intent;
CREATE UNIQUE INDEX attempts_one_unresolved_per_intent ON attempts (intent_id)
    WHERE state IN ('pending', 'unknown', 'reconciling', 'held');

-- The reconciler also examines attempts sent and never recorded (a worker
-- killed after the call): `pending` with a last send.
DROP INDEX attempts_uncertain;
CREATE INDEX attempts_uncertain ON attempts (state, last_send_at)
    WHERE state IN ('pending', 'unknown', 'reconciling');

-- Why a payment is in needs_review (the reconciler's horizon, or evidence
-- that contradicts what cobro recorded).
ALTER TABLE payments ADD COLUMN review_reason TEXT;
-- The status a payment had when conflicting evidence stopped it (an
-- operator who finds the record right restores it).
ALTER TABLE payments ADD COLUMN review_from TEXT;

-- Provider evidence that cobro did not adopt: it contradicts a recorded
-- outcome, does not match the attempt it names, or matches nothing of
-- cobro's. Kept for operators (`cobro payments list`, metrics); never
-- guessed from.
CREATE TABLE evidence_conflicts (
    id           UUID PRIMARY KEY,
    payment_id   UUID REFERENCES payments (id),
    refund_id    UUID REFERENCES refunds (id),
    attempt_id   UUID REFERENCES attempts (id),
    source       TEXT NOT NULL,
    kind         TEXT NOT NULL,
    detail       TEXT NOT NULL,
    evidence     TEXT NOT NULL,
    found_at     TIMESTAMPTZ NOT NULL,
    resolved_at  TIMESTAMPTZ
);
CREATE INDEX evidence_conflicts_open ON evidence_conflicts (found_at) WHERE resolved_at IS NULL;
CREATE INDEX evidence_conflicts_by_payment ON evidence_conflicts (payment_id);

-- requires_reconciliation and needs_review block every new send for the
-- payment (and for a refund in those states), whatever the code above does:
-- no attempt may become sendable (`pending`) while they hold. The worker's
-- fenced "sent" mark checks the same before every call (store/outbox.rs).
CREATE FUNCTION cobro_refuse_blocked_send() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM payments p WHERE p.id = NEW.payment_id
                 AND p.status IN ('requires_reconciliation', 'needs_review'))
       OR (NEW.refund_id IS NOT NULL AND EXISTS (SELECT 1 FROM refunds r WHERE r.id = NEW.refund_id
                 AND r.status IN ('requires_reconciliation', 'needs_review'))) THEN
        RAISE EXCEPTION 'cobro_send_blocked: payment % is under reconciliation or review', NEW.payment_id
            USING ERRCODE = 'CB001';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER attempts_refuse_blocked_insert BEFORE INSERT ON attempts
    FOR EACH ROW WHEN (NEW.state = 'pending') EXECUTE FUNCTION cobro_refuse_blocked_send();
CREATE TRIGGER attempts_refuse_blocked_release BEFORE UPDATE OF state ON attempts
    FOR EACH ROW WHEN (NEW.state = 'pending' AND OLD.state <> 'pending')
    EXECUTE FUNCTION cobro_refuse_blocked_send();
