-- Every row keyed by its account. The twin of ../postgres/0011_account_keys.sql;
-- see there for the why.
--
-- SQLite adds a NOT NULL column only with a default: '' stands for "not
-- backfilled" for the instant between the ADD and the UPDATE below, and no
-- statement of cobro's ever writes it (the store names the account in every
-- INSERT; on PostgreSQL a forgotten one fails NOT NULL).

ALTER TABLE attempts ADD COLUMN account_id TEXT NOT NULL DEFAULT '';
UPDATE attempts SET account_id = (SELECT p.account_id FROM payments p WHERE p.id = attempts.payment_id);

ALTER TABLE outbox ADD COLUMN account_id TEXT NOT NULL DEFAULT '';
UPDATE outbox SET account_id = (SELECT a.account_id FROM attempts a WHERE a.id = outbox.attempt_id);

ALTER TABLE attempt_observations ADD COLUMN account_id TEXT NOT NULL DEFAULT '';
UPDATE attempt_observations SET account_id =
    (SELECT a.account_id FROM attempts a WHERE a.id = attempt_observations.attempt_id);

ALTER TABLE reconciliation_decisions ADD COLUMN account_id TEXT NOT NULL DEFAULT '';
UPDATE reconciliation_decisions SET account_id =
    (SELECT p.account_id FROM payments p WHERE p.id = reconciliation_decisions.payment_id);

ALTER TABLE evidence_conflicts ADD COLUMN account_id TEXT;
UPDATE evidence_conflicts SET account_id =
    (SELECT p.account_id FROM payments p WHERE p.id = evidence_conflicts.payment_id);

DROP INDEX attempts_one_unresolved_per_intent;
CREATE UNIQUE INDEX attempts_one_unresolved_per_intent ON attempts (account_id, intent_id)
    WHERE state IN ('pending', 'unknown', 'reconciling', 'held');
