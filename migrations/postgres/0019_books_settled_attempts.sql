-- The books' side of cobro (0018) named the operations by their verbs,
-- but attempts record them by their stored names (`payment.authorize`,
-- `refund.create`): the index covered no row, and the books' query, which
-- used the same words, found no successful attempt, so no run could ever
-- report one "missing". The index again, on the names attempts hold.
DROP INDEX attempts_settled_by_send;
CREATE INDEX attempts_settled_by_send ON attempts (first_send_at, id)
    WHERE state = 'succeeded' AND operation IN ('payment.authorize', 'refund.create');
