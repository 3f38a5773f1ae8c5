-- The outbox and settled notifications leave the transactions they signal:
-- cobro sends them itself after the commit (cobro_store's `Doorbells`), at
-- most one per channel at a time per process. Sent by these triggers, they
-- made every new payment's and every settle's COMMIT take PostgreSQL's
-- database-wide notify lock until its commit record was flushed, which
-- serialised those commits (no group commit with synchronous_commit on).
-- The channels and their meaning are unchanged: LISTEN cobro_outbox and
-- cobro_payment_settled as before.
DROP TRIGGER IF EXISTS outbox_notify ON outbox;
DROP FUNCTION IF EXISTS cobro_outbox_notify();
DROP TRIGGER IF EXISTS payment_settled_notify ON payments;
DROP FUNCTION IF EXISTS cobro_payment_settled_notify();
