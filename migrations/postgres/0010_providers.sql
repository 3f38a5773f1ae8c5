-- Each account uses a provider, and every payment and attempt records the
-- provider it goes to, so recovery always asks the provider that got the
-- call (issue 13). Names are those of the providers file
-- (COBRO_PROVIDERS_FILE), or `fake`, the single provider the environment
-- defines without one. The SQLite twin is ../sqlite/0010_providers.sql.
--
-- NULL means "the default provider" everywhere: an account that names
-- none follows the configured default. Rows that predate this migration
-- keep NULL, read as the default at the time it runs: until now there was
-- one provider, the default, so that is the provider they were sent to.
-- Keep `default_provider` on that provider while such rows are unsettled.
ALTER TABLE accounts ADD COLUMN provider TEXT;
-- Fixed in the transaction that creates the payment: the account's
-- provider, else the default of the process that created it.
ALTER TABLE payments ADD COLUMN provider TEXT;
-- Copied from the payment when the attempt is inserted, so a capture, void,
-- refund or retry goes where its payment went.
ALTER TABLE attempts ADD COLUMN provider TEXT;
-- What the provider said about the call (Stripe's `Request-Id` and
-- `Idempotent-Replayed`), written with the outcome.
ALTER TABLE attempts ADD COLUMN provider_request_id TEXT;
ALTER TABLE attempts ADD COLUMN provider_replayed BOOLEAN NOT NULL DEFAULT FALSE;
