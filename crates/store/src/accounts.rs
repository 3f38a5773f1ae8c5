//! Accounts (merchants) and their API tokens.

use crate::{DbId, DbTime, Result, Store, on_pool};
use chrono::{DateTime, Utc};
use cobro_core::{AccountId, TokenId};

#[derive(Clone, Debug, sqlx::FromRow)]
pub struct AccountRow {
    pub id: DbId,
    pub name: String,
    pub created_at: DbTime,
}

impl Store {
    pub async fn create_account(&self, name: &str, now: DateTime<Utc>) -> Result<AccountId> {
        let id = AccountId::new();
        let sql = "INSERT INTO accounts (id, name, created_at) VALUES ($1, $2, $3)";
        on_pool!(self, pool => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(name)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(id)
    }

    pub async fn list_accounts(&self) -> Result<Vec<AccountRow>> {
        let sql = "SELECT id, name, created_at FROM accounts ORDER BY created_at";
        Ok(on_pool!(self, pool => sqlx::query_as(sql).fetch_all(pool).await?))
    }

    pub async fn find_account_by_name(&self, name: &str) -> Result<Option<AccountId>> {
        let sql = "SELECT id FROM accounts WHERE name = $1 ORDER BY created_at LIMIT 1";
        let found: Option<DbId> =
            on_pool!(self, pool => sqlx::query_scalar(sql).bind(name).fetch_optional(pool).await?);
        Ok(found.map(|id| AccountId::from_uuid(id.0)))
    }

    /// Stores a token by its hash only; the caller shows the secret once.
    pub async fn create_token(
        &self,
        account: AccountId,
        label: &str,
        token_hash: &str,
        now: DateTime<Utc>,
    ) -> Result<TokenId> {
        let id = TokenId::new();
        let sql = "INSERT INTO api_tokens (id, account_id, token_hash, label, created_at) \
                   VALUES ($1, $2, $3, $4, $5)";
        on_pool!(self, pool => sqlx::query(sql)
            .bind(DbId::from(id))
            .bind(DbId::from(account))
            .bind(token_hash)
            .bind(label)
            .bind(DbTime(now))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(id)
    }

    /// The account a live token belongs to: one indexed lookup by hash.
    pub async fn account_for_token(&self, token_hash: &str) -> Result<Option<AccountId>> {
        let sql = "SELECT account_id FROM api_tokens WHERE token_hash = $1 AND revoked_at IS NULL";
        let found: Option<DbId> = on_pool!(self, pool => sqlx::query_scalar(sql)
            .bind(token_hash)
            .fetch_optional(pool)
            .await?);
        Ok(found.map(|id| AccountId::from_uuid(id.0)))
    }
}
