-- The indexes of the unsettled stay out of the look-ups by key: PostgreSQL
-- only (see ../postgres/0014_unsettled_indexes_off_lookups.sql). A no-op
-- here, kept for numbering, for the reasons of 0013: SQLite plans a look-up
-- by key through the key. The schemas differ by that term only
-- (tests/schema_parity.rs, EXCEPTIONS).
SELECT 1;
