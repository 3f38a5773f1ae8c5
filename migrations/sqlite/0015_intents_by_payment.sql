-- The intents of a payment, by index (see
-- ../postgres/0015_intents_by_payment.sql): without it, every capture,
-- cancel and refund read the whole intents table to number its intent.
CREATE INDEX IF NOT EXISTS intents_by_payment ON intents (payment_id, operation);
