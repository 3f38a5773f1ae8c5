-- Same as postgres/0005. The W3C trace context (traceparent, tracestate) of whatever enqueued each
-- outbox row: the client's request, or the reconciler's decision. Written in
-- the same INSERT as the row, read back by the claim, so the worker's
-- processing of the row lands in the same trace as the request that asked
-- for it. NULL when tracing was off or the row predates this migration.
ALTER TABLE outbox ADD COLUMN traceparent TEXT;
ALTER TABLE outbox ADD COLUMN tracestate TEXT;
