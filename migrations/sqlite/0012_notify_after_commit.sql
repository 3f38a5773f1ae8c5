-- PostgreSQL only (its notify triggers are dropped: cobro notifies after
-- the commit). SQLite has no NOTIFY; kept so both stores share one version.
SELECT 1;
