-- Account names are unique: `cobro tokens create --account NAME` must never
-- be ambiguous. Until now `cobro accounts create` refused a taken name by
-- looking first, which two concurrent commands could both pass; the index
-- is now the rule and the command maps its violation to the same refusal.
-- The SQLite twin is ../sqlite/0008_unique_account_names.sql.
--
-- A database that already holds two accounts with one name is not changed:
-- this migration fails naming them, and runs once they are renamed.
DO $$
DECLARE
    duplicates TEXT;
BEGIN
    SELECT string_agg(format('%L (%s accounts)', name, n), ', ' ORDER BY name)
      INTO duplicates
      FROM (SELECT name, COUNT(*) AS n FROM accounts GROUP BY name HAVING COUNT(*) > 1) d;
    IF duplicates IS NOT NULL THEN
        RAISE EXCEPTION 'cobro 0008: account names must be unique, and these are shared: %; '
            'rename all but one of each (UPDATE accounts SET name = ... WHERE id = ...), '
            'then run cobro migrate again', duplicates;
    END IF;
END
$$;

CREATE UNIQUE INDEX accounts_name_key ON accounts (name);
