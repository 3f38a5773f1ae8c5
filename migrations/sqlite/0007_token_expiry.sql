-- Optional token expiry (`cobro tokens create --expires-in 30d`). NULL: the
-- token never expires. The API's lookup refuses a token at or past its
-- expiry, as it refuses a revoked one. The PostgreSQL twin is
-- ../postgres/0007_token_expiry.sql. (0006 is taken by another change.)
ALTER TABLE api_tokens ADD COLUMN expires_at TEXT;
