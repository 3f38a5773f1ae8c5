-- Wakes `GET /v1/payments/{id}?wait=N` long polls in every API process
-- (LISTEN cobro_payment_settled) when a payment leaves `processing`, which
-- is the only transition a long poll waits for. Only that transition
-- notifies, once per payment: PostgreSQL 15 serialises the commits of
-- transactions that sent a NOTIFY, so notifying on every write would cost
-- every commit. The notification is delivered at commit, never for a
-- transaction that rolled back.
CREATE FUNCTION cobro_payment_settled_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('cobro_payment_settled', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER payment_settled_notify AFTER UPDATE OF status ON payments
    FOR EACH ROW WHEN (OLD.status = 'processing' AND NEW.status <> 'processing')
    EXECUTE FUNCTION cobro_payment_settled_notify();
