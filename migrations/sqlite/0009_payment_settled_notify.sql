-- Kept in step with ../postgres/0009_payment_settled_notify.sql. SQLite has
-- no LISTEN/NOTIFY: with the embedded database every writer shares the
-- API's process, and the store wakes long polls in memory after each commit
-- that moved a payment.
SELECT 1;
