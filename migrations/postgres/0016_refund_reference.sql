-- A refund's business identity: the merchant's own reference for it,
-- unique per payment. An Idempotency-Key protects a retry for as long as
-- its record (and then its tombstone) lives; a client that retries a
-- refund after that, or under a new key, would refund twice. With a
-- reference, the second refund is refused (409 refund-reference-exists)
-- whenever it comes. Optional: a refund without one keeps today's rules.
ALTER TABLE refunds ADD COLUMN reference TEXT;
CREATE UNIQUE INDEX refunds_one_per_reference ON refunds (account_id, payment_id, reference)
    WHERE reference IS NOT NULL;
