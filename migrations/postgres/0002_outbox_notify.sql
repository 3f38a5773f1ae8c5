-- Wakes workers (LISTEN cobro_outbox) when provider work is enqueued, with
-- no extra statement on the request's hot path: the trigger fires inside
-- the same transaction and PostgreSQL delivers the notification at commit
-- (and never for a transaction that rolled back). One notification per
-- statement, and identical payloads in one transaction are folded.
CREATE FUNCTION cobro_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('cobro_outbox', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION cobro_outbox_notify();
