//! The operator commands: `migrate`, `accounts`, `tokens`, `purge`, with
//! their arguments. Each opens the store, does one thing, prints its result
//! on stdout (a table or line for humans, one JSON document with `--json`)
//! and exits. Only `migrate` changes the schema; the others require it to be
//! current.

use crate::database::{self, SchemaPolicy};
use crate::output::{JsonFlag, instant, or_dash, say, say_json};
use crate::settings::{DEFAULT_PURGE_BATCH, GlobalSettings, RetentionSettings, parse_duration};
use crate::token;
use anyhow::{Context, bail};
use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use cobro_core::{AccountId, Clock, SystemClock, TokenId};
use cobro_store::Store;
use cobro_store::accounts::TokenRow;
use comfy_table::Table;
use serde_json::json;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub output: JsonFlag,
}

#[derive(Debug, Subcommand)]
pub enum AccountsCommand {
    /// Create an account; prints its id on stdout.
    Create {
        /// The account's unique name, e.g. `acme`.
        #[arg(long)]
        name: String,
        /// The provider its payments go to, by its name in the providers
        /// file (`fake` without one). Unset: the default provider,
        /// whichever it is when each payment is created.
        #[arg(long, value_name = "NAME")]
        provider: Option<String>,
        #[command(flatten)]
        providers: crate::settings::ProvidersFile,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// List accounts: id, name, creation time, provider.
    List {
        #[command(flatten)]
        output: JsonFlag,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Create an API token; prints it ONCE on stdout (only its hash is stored).
    Create {
        /// The account, by name or id.
        #[arg(long, value_name = "NAME_OR_ID")]
        account: String,
        /// What the token is for, e.g. `checkout-prod`.
        #[arg(long, default_value = "")]
        label: String,
        /// Refused by the API from this long after now on (e.g. `30d`, `12h`).
        /// Unset: never expires (revoke it with `tokens revoke`).
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        expires_in: Option<Duration>,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// List tokens (never their secret or hash): id, prefix (`cobro_` and
    /// 8 hex digits), account, label, created, expires, revoked, and whether
    /// the API accepts it now.
    List {
        /// Only this account's, by name or id.
        #[arg(long, value_name = "NAME_OR_ID")]
        account: Option<String>,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// Revoke a token at once: the API refuses it from the next request on.
    /// Takes the id (`tokens list`) or the token text itself (a leaked one).
    /// Revoking a revoked token changes nothing and succeeds.
    Revoke {
        #[arg(value_name = "ID_OR_TOKEN")]
        token: String,
        #[command(flatten)]
        output: JsonFlag,
    },
}

#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Rows per batch; batches repeat until one comes back short.
    #[arg(long, default_value_t = DEFAULT_PURGE_BATCH, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: u32,

    /// Count what would be compacted and deleted now; change nothing.
    #[arg(long)]
    pub dry_run: bool,

    #[command(flatten)]
    pub retention: RetentionSettings,

    #[command(flatten)]
    pub output: JsonFlag,
}

/// `cobro migrate`: prints `schema at version N`.
pub async fn migrate(global: &GlobalSettings, args: &MigrateArgs) -> anyhow::Result<()> {
    let (store, target) = database::open(global, SchemaPolicy::Migrate).await?;
    let version = store
        .schema_version()
        .await
        .context("could not read the schema version")?;
    let backend = store.backend();
    store.close().await;
    if args.output.json {
        return say_json(&json!({
            "schema_version": version,
            "backend": format!("{backend:?}").to_lowercase(),
            "database": target.redacted(),
        }));
    }
    say(format_args!("schema at version {version}"))
}

/// `cobro accounts ...`.
pub async fn accounts(global: &GlobalSettings, command: AccountsCommand) -> anyhow::Result<()> {
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let result = match command {
        AccountsCommand::Create {
            name,
            provider,
            providers,
            output,
        } => {
            let provider = match provider {
                Some(provider) => {
                    let known =
                        crate::provider::provider_names(providers.providers_file.as_deref())?;
                    if !known.contains(&provider) {
                        bail!(
                            "no provider is named `{provider}` (configured: {}; see COBRO_PROVIDERS_FILE)",
                            known.join(", ")
                        );
                    }
                    Some(provider)
                }
                None => None,
            };
            create_account(&store, &name, provider.as_deref(), output).await
        }
        AccountsCommand::List { output } => list_accounts(&store, output).await,
    };
    store.close().await;
    result
}

/// Prints the new account's id. Names are unique so that `tokens create
/// --account NAME` is never ambiguous.
async fn create_account(
    store: &Store,
    name: &str,
    provider: Option<&str>,
    output: JsonFlag,
) -> anyhow::Result<()> {
    let name = name.trim();
    if name.is_empty() {
        bail!("an account name must not be empty");
    }
    let now = SystemClock.now();
    // The unique index on accounts.name (migration 0008) decides, so two
    // concurrent creates cannot both succeed.
    let id = match store
        .create_account_with_provider(name, provider, now)
        .await
    {
        Ok(id) => id,
        Err(cobro_store::StoreError::UniqueViolation { .. }) => {
            let existing = store
                .find_account_by_name(name)
                .await?
                .context("the account name is taken, yet no account has it")?;
            bail!("an account named `{name}` already exists: {existing}");
        }
        Err(e) => return Err(e.into()),
    };
    if output.json {
        return say_json(
            &json!({"id": id.to_string(), "name": name, "created_at": instant(now), "provider": provider}),
        );
    }
    eprintln!("created account `{name}`");
    say(id)
}

/// One account per line, tab-separated (a header first).
async fn list_accounts(store: &Store, output: JsonFlag) -> anyhow::Result<()> {
    let accounts = store.list_accounts().await?;
    if output.json {
        let list: Vec<_> = accounts
            .iter()
            .map(|a| json!({"id": a.id.to_string(), "name": a.name, "created_at": instant(a.created_at.0), "provider": a.provider}))
            .collect();
        return say_json(&json!({ "accounts": list }));
    }
    say("id\tname\tcreated_at\tprovider")?;
    for account in accounts {
        say(format_args!(
            "{}\t{}\t{}\t{}",
            account.id,
            account.name,
            instant(account.created_at.0),
            crate::payments::provider_name(account.provider.as_deref())
        ))?;
    }
    Ok(())
}

/// `cobro tokens ...`.
pub async fn tokens(global: &GlobalSettings, command: TokensCommand) -> anyhow::Result<()> {
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let now = SystemClock.now();
    let result = match command {
        TokensCommand::Create {
            account,
            label,
            expires_in,
            output,
        } => create_token(&store, &account, &label, expires_in, now, output).await,
        TokensCommand::List { account, output } => {
            list_tokens(&store, account.as_deref(), now, output).await
        }
        TokensCommand::Revoke { token, output } => revoke_token(&store, &token, now, output).await,
    };
    store.close().await;
    result
}

/// Prints the token alone on stdout, once; the store keeps only its hash.
async fn create_token(
    store: &Store,
    account: &str,
    label: &str,
    expires_in: Option<Duration>,
    now: DateTime<Utc>,
    output: JsonFlag,
) -> anyhow::Result<()> {
    let account_id = resolve_account(store, account).await?;
    let expires_at = expires_in
        .map(|d| {
            chrono::Duration::from_std(d)
                .ok()
                .and_then(|d| now.checked_add_signed(d))
                .with_context(|| format!("--expires-in {d:?} is out of range"))
        })
        .transpose()?;
    let issued = token::issue(store, account_id, label, now, expires_at).await?;
    if output.json {
        return say_json(&json!({
            "id": issued.id.to_string(),
            "account_id": account_id.to_string(),
            "label": label,
            "token": issued.secret,
            "created_at": instant(now),
            "expires_at": expires_at.map(instant),
        }));
    }
    let until = expires_at.map_or_else(
        || "never expires".to_owned(),
        |t| format!("expires {}", instant(t)),
    );
    eprintln!(
        "token {} for account {account_id} ({until}): shown once, store it now (only its hash is kept)",
        issued.id
    );
    say(issued.secret)
}

/// Whether the API accepts the token at `now`.
fn token_state(t: &TokenRow, now: DateTime<Utc>) -> &'static str {
    if t.revoked_at.is_some() {
        "revoked"
    } else if t.expires_at.is_some_and(|e| e.0 <= now) {
        "expired"
    } else {
        "live"
    }
}

fn token_json(t: &TokenRow, now: DateTime<Utc>) -> serde_json::Value {
    json!({
        "id": t.id.to_string(),
        "account_id": t.account_id.to_string(),
        "account": t.account_name,
        "label": t.label,
        "prefix": t.prefix,
        "created_at": instant(t.created_at.0),
        "expires_at": t.expires_at.map(|e| instant(e.0)),
        "revoked_at": t.revoked_at.map(|e| instant(e.0)),
        "state": token_state(t, now),
    })
}

/// A table of tokens: never a secret, never a hash.
async fn list_tokens(
    store: &Store,
    account: Option<&str>,
    now: DateTime<Utc>,
    output: JsonFlag,
) -> anyhow::Result<()> {
    let account = match account {
        Some(name_or_id) => Some(resolve_account(store, name_or_id).await?),
        None => None,
    };
    let tokens = store.list_tokens(account).await?;
    if output.json {
        let list: Vec<_> = tokens.iter().map(|t| token_json(t, now)).collect();
        return say_json(&json!({ "tokens": list }));
    }
    let mut table = Table::new();
    table.set_header([
        "id", "account", "label", "created", "expires", "revoked", "state",
    ]);
    for t in &tokens {
        table.add_row([
            t.id.to_string(),
            or_dash((!t.prefix.is_empty()).then(|| format!("{}...", t.prefix))),
            t.account_name.clone(),
            t.label.clone(),
            instant(t.created_at.0),
            or_dash(t.expires_at.map(|e| instant(e.0))),
            or_dash(t.revoked_at.map(|e| instant(e.0))),
            token_state(t, now).to_owned(),
        ]);
    }
    say(table)?;
    say(format_args!("{} token(s)", tokens.len()))
}

/// Revokes by id, or by the token text (hashed, never printed).
async fn revoke_token(
    store: &Store,
    id_or_token: &str,
    now: DateTime<Utc>,
    output: JsonFlag,
) -> anyhow::Result<()> {
    let id = match id_or_token.parse::<TokenId>() {
        Ok(id) => id,
        Err(_) => store
            .token_id_by_hash(&token::token_hash(id_or_token.trim()))
            .await?
            .context("no such token: give a token id (`cobro tokens list`) or the token itself")?,
    };
    let newly = store.revoke_token(id, now).await?;
    let row = store
        .list_tokens(None)
        .await?
        .into_iter()
        .find(|t| t.id == id)
        .with_context(|| format!("no token {id} (`cobro tokens list` lists them)"))?;
    if output.json {
        let mut view = token_json(&row, now);
        view["already_revoked"] = json!(!newly);
        return say_json(&view);
    }
    let at = or_dash(row.revoked_at.map(|t| instant(t.0)));
    if newly {
        say(format_args!(
            "token {id} revoked at {at}: the API refuses it from now on"
        ))
    } else {
        say(format_args!(
            "token {id} was already revoked at {at}; nothing changed"
        ))
    }
}

/// An account by id (if `name_or_id` is a UUID) or by name.
pub(crate) async fn resolve_account(store: &Store, name_or_id: &str) -> anyhow::Result<AccountId> {
    if let Ok(id) = name_or_id.parse::<AccountId>() {
        // The store has no lookup by id; an admin command can afford the scan.
        let accounts = store.list_accounts().await?;
        if accounts.iter().any(|a| a.id == id) {
            return Ok(id);
        }
    }
    store
        .find_account_by_name(name_or_id)
        .await?
        .with_context(|| format!("no account named or with id `{name_or_id}`"))
}

/// `cobro purge [--batch N] [--dry-run]`: prints what it removed (or would).
pub async fn purge(global: &GlobalSettings, args: &PurgeArgs) -> anyhow::Result<()> {
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let now = SystemClock.now();
    let report = if args.dry_run {
        store.purge_count(&args.retention.retention(), now).await
    } else {
        store
            .purge(&args.retention.retention(), now, args.batch)
            .await
    };
    store.close().await;
    let report = report.context("the purge failed")?;
    if args.output.json {
        return say_json(&json!({
            "dry_run": args.dry_run,
            "compacted": report.compacted,
            "tombstones_deleted": report.tombstones_deleted,
            "webhook_events_deleted": report.webhook_events_deleted,
        }));
    }
    if args.dry_run {
        say(format_args!(
            "dry run, nothing changed: would have {report}"
        ))
    } else {
        say(report)
    }
}
