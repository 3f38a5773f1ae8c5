//! Accounts (merchants) and their API tokens.

use crate::{DbId, DbTime, Result, Store, on_pool, on_write_pool};
use chrono::{DateTime, Utc};
use cobro_core::{AccountId, TokenId};

/// A token as an operator sees it: everything but its hash.
#[derive(Clone, Debug, sqlx::FromRow)]
pub struct TokenRow {
    pub id: TokenId,
    pub account_id: AccountId,
    pub account_name: String,
    pub label: String,
    /// The token's first characters (empty for tokens made before 0007).
    pub prefix: String,
    pub created_at: DbTime,
    /// `None`: never expires.
    pub expires_at: Option<DbTime>,
    pub revoked_at: Option<DbTime>,
}

/// A token about to be stored: never its secret.
/// A token that is live now ([`crate::Store::live_token`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveToken {
    pub account: AccountId,
    /// `None`: it never expires.
    pub expires_at: Option<DateTime<Utc>>,
}

#[derive(Clone, Copy, Debug)]
pub struct NewTokenRow<'a> {
    /// What it is for, e.g. `checkout-prod`.
    pub label: &'a str,
    /// SHA-256 of the token, lowercase hex: the lookup key.
    pub token_hash: &'a str,
    /// Its first characters, for display (a few of its 256 bits).
    pub prefix: &'a str,
    /// Refused from then on; `None`: never expires.
    pub expires_at: Option<DateTime<Utc>>,
}

#[derive(Clone, Debug, sqlx::FromRow)]
pub struct AccountRow {
    pub id: AccountId,
    pub name: String,
    pub created_at: DbTime,
    /// The provider its new payments go to; `None`: the default provider.
    pub provider: Option<String>,
}

impl Store {
    /// A new account. A name already taken is refused by the unique index
    /// `accounts_name_key`: `StoreError::UniqueViolation`.
    pub async fn create_account(&self, name: &str, now: DateTime<Utc>) -> Result<AccountId> {
        self.create_account_with_provider(name, None, now).await
    }

    /// A new account whose payments go to `provider` (`None`: the default
    /// provider, whichever it is when each payment is created). The name
    /// is the caller's to check against the configured providers.
    pub async fn create_account_with_provider(
        &self,
        name: &str,
        provider: Option<&str>,
        now: DateTime<Utc>,
    ) -> Result<AccountId> {
        let id = AccountId::new();
        let sql = "INSERT INTO accounts (id, name, created_at, provider) VALUES ($1, $2, $3, $4)";
        on_write_pool!(self, pool => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(name)
            .bind(DbTime(now))
            .bind(provider)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(id)
    }

    pub async fn list_accounts(&self) -> Result<Vec<AccountRow>> {
        let sql = "SELECT id, name, created_at, provider FROM accounts ORDER BY created_at";
        Ok(on_pool!(self, pool => sqlx::query_as(sql).fetch_all(pool).await?))
    }

    pub async fn find_account_by_name(&self, name: &str) -> Result<Option<AccountId>> {
        let sql = "SELECT id FROM accounts WHERE name = $1";
        let found: Option<DbId> =
            on_pool!(self, pool => sqlx::query_scalar(sql).bind(name).fetch_optional(pool).await?);
        Ok(found.map(|id| AccountId::from_uuid(id.0)))
    }

    /// Stores a token by its hash only; the caller shows the secret once.
    /// It never expires (see [`Store::create_token_expiring`]).
    pub async fn create_token(
        &self,
        account: AccountId,
        label: &str,
        token_hash: &str,
        now: DateTime<Utc>,
    ) -> Result<TokenId> {
        let token = NewTokenRow {
            label,
            token_hash,
            prefix: "",
            expires_at: None,
        };
        self.create_token_expiring(account, &token, now).await
    }

    /// Stores a token by its hash only, refused by the lookup from
    /// `token.expires_at` on (`None`: never).
    pub async fn create_token_expiring(
        &self,
        account: AccountId,
        token: &NewTokenRow<'_>,
        now: DateTime<Utc>,
    ) -> Result<TokenId> {
        let id = TokenId::new();
        let sql = "INSERT INTO api_tokens (id, account_id, token_hash, label, prefix, created_at, expires_at) \
                   VALUES ($1, $2, $3, $4, $5, $6, $7)";
        on_write_pool!(self, pool => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(DbId::from(account))
            .bind(token.token_hash)
            .bind(token.label)
            .bind(token.prefix)
            .bind(DbTime(now))
            .bind(token.expires_at.map(DbTime))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(id)
    }

    /// The account a token belongs to if it is live at `now`: not revoked
    /// and not expired (a token expires AT `expires_at`). One indexed
    /// lookup by hash.
    pub async fn account_for_token_at(
        &self,
        token_hash: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<AccountId>> {
        Ok(self
            .live_token(token_hash, now)
            .await?
            .map(|live| live.account))
    }

    /// A token live at `now` (not revoked, not expired): its account and
    /// when it expires, so a caller that keeps it for a while still stops
    /// at the expiry exactly. One indexed lookup by hash.
    pub async fn live_token(
        &self,
        token_hash: &str,
        now: DateTime<Utc>,
    ) -> Result<Option<LiveToken>> {
        let sql = "SELECT account_id, expires_at FROM api_tokens WHERE token_hash = $1 \
                   AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > $2)";
        let found: Option<(DbId, Option<DbTime>)> = on_pool!(self, pool => sqlx::query_as(sql)
            .bind(token_hash)
            .bind(DbTime(now))
            .fetch_optional(pool)
            .await?);
        Ok(found.map(|(account, expires_at)| LiveToken {
            account: AccountId::from_uuid(account.0),
            expires_at: expires_at.map(|t| t.0),
        }))
    }

    /// Every token (of `account`, or of all accounts), oldest first; never
    /// the hash, which is as good as the token for a lookup.
    pub async fn list_tokens(&self, account: Option<AccountId>) -> Result<Vec<TokenRow>> {
        let sql = "SELECT t.id, t.account_id, a.name AS account_name, t.label, t.prefix, t.created_at, \
                   t.expires_at, t.revoked_at FROM api_tokens t JOIN accounts a ON a.id = t.account_id \
                   WHERE ($1 IS NULL OR t.account_id = $1) ORDER BY t.created_at, t.id";
        Ok(on_pool!(self, pool => sqlx::query_as(sql)
            .bind(account.map(DbId::from))
            .fetch_all(pool)
            .await?))
    }

    /// Revokes a token from `now` on. `false` when no such token is live
    /// (unknown, or already revoked: the first revocation time is kept).
    pub async fn revoke_token(&self, id: TokenId, now: DateTime<Utc>) -> Result<bool> {
        let sql = "UPDATE api_tokens SET revoked_at = $2 WHERE id = $1 AND revoked_at IS NULL";
        let changed = on_write_pool!(self, pool => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(changed == 1)
    }

    /// The token stored under `token_hash`, live or not (an operator
    /// revoking a leaked token has its text, not its id).
    pub async fn token_id_by_hash(&self, token_hash: &str) -> Result<Option<TokenId>> {
        let sql = "SELECT id FROM api_tokens WHERE token_hash = $1";
        let found: Option<DbId> = on_pool!(self, pool => sqlx::query_scalar(sql)
            .bind(token_hash)
            .fetch_optional(pool)
            .await?);
        Ok(found.map(|id| TokenId::from_uuid(id.0)))
    }
}
