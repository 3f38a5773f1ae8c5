-- Optional token expiry (`cobro tokens create --expires-in 30d`) and a
-- displayable prefix. NULL: the
-- token never expires. The API's lookup refuses a token at or past its
-- expiry, as it refuses a revoked one. The SQLite twin is
-- ../sqlite/0007_token_expiry.sql. (0006 is taken by another change.)
ALTER TABLE api_tokens ADD COLUMN expires_at TIMESTAMPTZ;
-- The token's first characters (`cobro_` and 8 hex digits: 32 of its 256
-- bits), so `cobro tokens list` can show which token a row is without
-- showing the token. Empty for tokens made before.
ALTER TABLE api_tokens ADD COLUMN prefix TEXT NOT NULL DEFAULT '';
