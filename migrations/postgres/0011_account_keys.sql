-- Every row keyed by its account (issue #15 item 7; ops/SCALING.md): the
-- tables that reached their account only through a parent (attempts
-- through payments, outbox and attempt_observations through attempts,
-- reconciliation_decisions and evidence_conflicts through payments) carry
-- `account_id` themselves, so a distributed PostgreSQL (Citus, account_id
-- as the distribution column) can co-locate every row of one account and
-- route each statement to one shard. The store writes it in every INSERT,
-- copied from the parent row by the statement itself; the rows already
-- there are backfilled the same way.
--
-- No foreign key to accounts: the parent's key already implies the account
-- (and SQLite cannot add a REFERENCES column with a non-NULL default).

ALTER TABLE attempts ADD COLUMN account_id UUID;
UPDATE attempts a SET account_id = p.account_id FROM payments p WHERE p.id = a.payment_id;
ALTER TABLE attempts ALTER COLUMN account_id SET NOT NULL;

ALTER TABLE outbox ADD COLUMN account_id UUID;
UPDATE outbox o SET account_id = a.account_id FROM attempts a WHERE a.id = o.attempt_id;
ALTER TABLE outbox ALTER COLUMN account_id SET NOT NULL;

ALTER TABLE attempt_observations ADD COLUMN account_id UUID;
UPDATE attempt_observations o SET account_id = a.account_id FROM attempts a WHERE a.id = o.attempt_id;
ALTER TABLE attempt_observations ALTER COLUMN account_id SET NOT NULL;

ALTER TABLE reconciliation_decisions ADD COLUMN account_id UUID;
UPDATE reconciliation_decisions d SET account_id = p.account_id FROM payments p WHERE p.id = d.payment_id;
ALTER TABLE reconciliation_decisions ALTER COLUMN account_id SET NOT NULL;

-- Evidence that matches nothing of cobro's names no payment, so no
-- account: NULL there, and only there.
ALTER TABLE evidence_conflicts ADD COLUMN account_id UUID;
UPDATE evidence_conflicts c SET account_id = p.account_id FROM payments p WHERE p.id = c.payment_id;

-- The one unresolved attempt per intent, keyed by account like the intent
-- itself (intents are unique per (account_id, name)). Intent ids are unique
-- on their own, so the rule is unchanged.
DROP INDEX attempts_one_unresolved_per_intent;
CREATE UNIQUE INDEX attempts_one_unresolved_per_intent ON attempts (account_id, intent_id)
    WHERE state IN ('pending', 'unknown', 'reconciling', 'held');
