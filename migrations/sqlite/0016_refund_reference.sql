-- A refund's business identity, unique per payment (see
-- ../postgres/0016_refund_reference.sql).
ALTER TABLE refunds ADD COLUMN reference TEXT;
CREATE UNIQUE INDEX refunds_one_per_reference ON refunds (account_id, payment_id, reference)
    WHERE reference IS NOT NULL;
