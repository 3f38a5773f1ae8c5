-- Account names are unique: `cobro tokens create --account NAME` must never
-- be ambiguous. Until now `cobro accounts create` refused a taken name by
-- looking first, which two concurrent commands could both pass; the index
-- is now the rule and the command maps its violation to the same refusal.
-- The PostgreSQL twin is ../postgres/0008_unique_account_names.sql.
--
-- A database that already holds two accounts with one name is not changed:
-- this migration fails with the message below (SQLite's RAISE takes only a
-- literal, so it cannot list the names; the query in it does), and runs
-- once they are renamed.
CREATE TEMP TABLE cobro_0008_duplicate_names (name TEXT);
CREATE TEMP TRIGGER cobro_0008_refuse BEFORE INSERT ON cobro_0008_duplicate_names
BEGIN
    SELECT RAISE(ABORT, 'cobro 0008: account names must be unique, and some are shared (SELECT name FROM accounts GROUP BY name HAVING COUNT(*) > 1): rename all but one of each, then run cobro migrate again');
END;
INSERT INTO cobro_0008_duplicate_names
    SELECT name FROM accounts GROUP BY name HAVING COUNT(*) > 1;
DROP TABLE cobro_0008_duplicate_names;

CREATE UNIQUE INDEX accounts_name_key ON accounts (name);
