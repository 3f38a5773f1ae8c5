-- The reconciler reaches the attempts of refunds waiting too long through
-- refunds_unsettled -> attempts.refund_id; without this index that join
-- would scan every attempt.
CREATE INDEX attempts_by_refund ON attempts (refund_id) WHERE refund_id IS NOT NULL;
