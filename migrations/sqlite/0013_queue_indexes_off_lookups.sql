-- The queue indexes stay out of the look-ups by key: PostgreSQL only (see
-- ../postgres/0013_queue_indexes_off_lookups.sql). A no-op here, kept for
-- numbering. SQLite plans the worker's look-ups by key through the key,
-- statistics or not, and with the extra term it scanned the outbox for the
-- metrics' depth although the query stated the term (SQLite 3.46, sqlx's;
-- store_conformance::sqlite_the_queue_queries_search_their_partial_indexes
-- checks both). The schemas differ by that term only (tests/schema_parity.rs,
-- EXCEPTIONS).
SELECT 1;
