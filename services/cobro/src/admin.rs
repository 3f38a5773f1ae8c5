//! The operator commands: `migrate`, `accounts`, `tokens`, `purge`. Each
//! opens the store, does one thing, prints its result on stdout and exits.
//! Only `migrate` changes the schema; the others require it to be current.

use crate::database::{self, SchemaPolicy};
use crate::output::say;
use crate::settings::{GlobalSettings, RetentionSettings};
use crate::{purge, token};
use anyhow::{Context, bail};
use chrono::SecondsFormat;
use cobro_core::{AccountId, Clock, SystemClock};
use cobro_store::Store;

/// `cobro migrate`: prints `schema at version N`.
pub async fn migrate(global: &GlobalSettings) -> anyhow::Result<()> {
    let (store, _) = database::open(global, SchemaPolicy::Migrate).await?;
    let version = store
        .schema_version()
        .await
        .context("could not read the schema version")?;
    store.close().await;
    say(format_args!("schema at version {version}"))
}

/// `cobro accounts create --name NAME`: prints the new account's id. Names
/// are unique so that `tokens create --account NAME` is never ambiguous.
pub async fn create_account(global: &GlobalSettings, name: &str) -> anyhow::Result<()> {
    let name = name.trim();
    if name.is_empty() {
        bail!("an account name must not be empty");
    }
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    if let Some(existing) = store.find_account_by_name(name).await? {
        bail!("an account named `{name}` already exists: {existing}");
    }
    let id = store.create_account(name, SystemClock.now()).await?;
    store.close().await;
    eprintln!("created account `{name}`");
    say(id)
}

/// `cobro accounts list`: one account per line, tab-separated.
pub async fn list_accounts(global: &GlobalSettings) -> anyhow::Result<()> {
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let accounts = store.list_accounts().await?;
    store.close().await;
    say("id\tname\tcreated_at")?;
    for account in accounts {
        let created = account
            .created_at
            .0
            .to_rfc3339_opts(SecondsFormat::Secs, true);
        say(format_args!(
            "{}\t{}\t{created}",
            account.id.0, account.name
        ))?;
    }
    Ok(())
}

/// `cobro tokens create --account NAME_OR_ID [--label L]`: prints the token
/// alone on stdout, once; the store keeps only its hash.
pub async fn create_token(
    global: &GlobalSettings,
    account: &str,
    label: &str,
) -> anyhow::Result<()> {
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let account_id = resolve_account(&store, account).await?;
    let secret = token::issue(&store, account_id, label, SystemClock.now()).await?;
    store.close().await;
    eprintln!("token for account {account_id}: shown once, store it now (only its hash is kept)");
    say(secret)
}

/// An account by id (if `name_or_id` is a UUID) or by name.
pub(crate) async fn resolve_account(store: &Store, name_or_id: &str) -> anyhow::Result<AccountId> {
    if let Ok(id) = name_or_id.parse::<AccountId>() {
        // The store has no lookup by id; an admin command can afford the scan.
        let accounts = store.list_accounts().await?;
        if accounts.iter().any(|a| a.id.0 == id.as_uuid()) {
            return Ok(id);
        }
    }
    store
        .find_account_by_name(name_or_id)
        .await?
        .with_context(|| format!("no account named or with id `{name_or_id}`"))
}

/// `cobro purge [--batch N]`: prints what it removed.
pub async fn purge(
    global: &GlobalSettings,
    retention: &RetentionSettings,
    batch: u32,
) -> anyhow::Result<()> {
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let report = purge::run(&store, retention, SystemClock.now(), batch).await?;
    store.close().await;
    say(report)
}
