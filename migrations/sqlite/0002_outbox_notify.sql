-- Kept in step with ../postgres/0002_outbox_notify.sql. SQLite has no
-- LISTEN/NOTIFY: with the embedded database the API and the worker share a
-- process and the API signals the worker in memory after each commit.
SELECT 1;
