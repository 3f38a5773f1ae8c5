-- The indexes of the unsettled stay out of the look-ups by key, as 0013
-- did for the queue indexes.
--
-- `payments_unsettled`, `refunds_unsettled` and `evidence_conflicts_open`
-- are partial on the states a payment, a refund or a conflict leaves.
-- Statements that find their row by key and name such a state implied
-- their predicate: the settle's compare-and-set (`UPDATE payments ... WHERE
-- id = $1 AND status = $2`, with $2 'processing') in every custom plan, and
-- `... AND status = 'needs_review'` or `resolved_at IS NULL` in every plan.
-- With statistics taken while few rows were unsettled, PostgreSQL planned
-- them as a scan of every row in that state with a filter on the key (a
-- settle read every payment still processing: the whole backlog under
-- load). store_conformance::
-- postgres_a_look_up_by_key_is_never_planned_as_a_scan_of_the_unsettled
-- found nine such plans before this migration.
--
-- Each index keeps its columns and rows; its predicate gains a term that is
-- always true (the column is NOT NULL) and that only the queries meant to
-- use the index state or imply: the reconciler's sweep (`status_changed_at
-- < $1` implies it), the metrics' unsettled counts, the operators' payment
-- list by status, the open conflicts' list and counts, and the check for a
-- finding already open (which has no better index). SQLite keeps its
-- indexes (its 0014 is a no-op, as its 0013).
--
-- Each CREATE INDEX blocks writes to its table while it reads it (seconds
-- per million payments; migrations/README.md).
DROP INDEX payments_unsettled;
CREATE INDEX payments_unsettled ON payments (status, status_changed_at)
    WHERE status IN ('processing', 'requires_reconciliation', 'needs_review', 'capturing', 'canceling')
      AND status_changed_at IS NOT NULL;

DROP INDEX refunds_unsettled;
CREATE INDEX refunds_unsettled ON refunds (status, status_changed_at)
    WHERE status IN ('processing', 'requires_reconciliation', 'needs_review')
      AND status_changed_at IS NOT NULL;

DROP INDEX evidence_conflicts_open;
CREATE INDEX evidence_conflicts_open ON evidence_conflicts (found_at)
    WHERE resolved_at IS NULL AND found_at IS NOT NULL;
