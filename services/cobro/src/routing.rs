//! `cobro routing`: an account's routing rules (show, set from a file,
//! clear, history) and each provider's circuit and health
//! (docs/routing.md). Rules are checked against the providers file before
//! they are stored, and at every start of `serve` and `worker`.

use crate::admin::resolve_account;
use crate::database::{self, SchemaPolicy};
use crate::output::{JsonFlag, instant, or_dash, say, say_json};
use crate::provider::Registry;
use crate::settings::{GlobalSettings, ProvidersFile};
use anyhow::{Context, bail};
use clap::Subcommand;
use cobro_core::routing::RuleSet;
use cobro_core::{Clock, SystemClock};
use cobro_store::Store;
use comfy_table::Table;
use serde_json::{Value, json};
use std::path::PathBuf;

#[derive(Debug, Subcommand)]
pub enum RoutingCommand {
    /// Show an account's rules (or that it has none) and its version.
    Show {
        /// The account, by name or id.
        #[arg(value_name = "NAME_OR_ID")]
        account: String,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// Replace an account's rules with a JSON file's (docs/routing.md),
    /// after checking them against the providers file; nothing changes
    /// when they are invalid. `-` reads standard input.
    Set {
        #[arg(value_name = "NAME_OR_ID")]
        account: String,
        #[arg(long, value_name = "FILE")]
        file: PathBuf,
        #[command(flatten)]
        providers: ProvidersFile,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// Remove an account's rules: its payments follow the default chain.
    Clear {
        #[arg(value_name = "NAME_OR_ID")]
        account: String,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// Every change of an account's rules: version, who, when, what.
    History {
        #[arg(value_name = "NAME_OR_ID")]
        account: String,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// Each provider's circuit (closed, open, half-open) and its calls in
    /// the breaker's window, every process's together.
    Circuits {
        #[command(flatten)]
        providers: ProvidersFile,
        #[command(flatten)]
        output: JsonFlag,
    },
}

/// The operator behind a change, for the audit row.
fn actor() -> String {
    let user = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
    format!("operator:{user}")
}

/// Refuses to start when an account's stored rules name a provider the
/// providers file no longer defines (or no longer parse): a payment of
/// that account could not be routed; or when a payment that may still
/// move has such a provider left on its route.
pub async fn check_stored_rules(store: &Store, registry: &Registry) -> anyhow::Result<()> {
    for (account, rules) in store.all_routing_rules().await? {
        RuleSet::parse(&rules, &|p| registry.has(p)).map_err(|e| {
            anyhow::anyhow!(
                "the routing rules of account {account} do not fit the providers file: {e}; \
                 fix them with `cobro routing set` or `cobro routing clear`"
            )
        })?;
    }
    // A payment that may still move must find every provider left on its
    // chain, or its next attempt would wait for a worker that never comes.
    for (payment, at, route) in store.movable_routes().await? {
        let Some(route) = cobro_core::routing::Route::from_json(&route) else {
            bail!("payment {payment} has a route cobro cannot read");
        };
        let from = at
            .as_deref()
            .and_then(|p| route.chain.iter().position(|c| c == p))
            .unwrap_or(0);
        if let Some(missing) = route.chain[from..].iter().find(|p| !registry.has(p)) {
            bail!(
                "payment {payment} may still move to provider {missing:?}, which the \
                 providers file no longer defines: keep it until the payment is settled \
                 (`cobro payments show {payment}`)"
            );
        }
    }
    Ok(())
}

pub async fn run(global: &GlobalSettings, command: RoutingCommand) -> anyhow::Result<()> {
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let done = match command {
        RoutingCommand::Show { account, output } => show(&store, &account, output).await,
        RoutingCommand::Set {
            account,
            file,
            providers,
            output,
        } => set(&store, &account, &file, &providers, output).await,
        RoutingCommand::Clear { account, output } => {
            let id = resolve_account(&store, &account).await?;
            let version = store
                .set_routing_rules(id, None, &actor(), SystemClock.now())
                .await?;
            if output.json {
                say_json(&json!({"account": id.to_string(), "rules": null, "version": version}))
            } else {
                say(format_args!(
                    "account {account}: rules removed (version {version}); its payments follow the default chain"
                ))
            }
        }
        RoutingCommand::History { account, output } => {
            let id = resolve_account(&store, &account).await?;
            let changes = store.routing_changes(id).await?;
            if output.json {
                let rows: Vec<Value> = changes
                    .iter()
                    .map(|(version, rules, actor, at)| {
                        json!({
                            "version": version,
                            "rules": rules.as_deref().and_then(|r| serde_json::from_str::<Value>(r).ok()),
                            "actor": actor,
                            "at": instant(at.0),
                        })
                    })
                    .collect();
                say_json(&json!({"account": id.to_string(), "changes": rows}))
            } else {
                let mut table = Table::new();
                table.set_header(["version", "at", "actor", "rules"]);
                for (version, rules, actor, at) in &changes {
                    table.add_row([
                        version.to_string(),
                        instant(at.0),
                        actor.clone(),
                        or_dash(rules.as_deref()),
                    ]);
                }
                say(table)
            }
        }
        RoutingCommand::Circuits { providers, output } => {
            circuits(&store, &providers, output).await
        }
    };
    store.close().await;
    done
}

async fn show(store: &Store, account: &str, output: JsonFlag) -> anyhow::Result<()> {
    let id = resolve_account(store, account).await?;
    let profile = store.routing_profile(id).await?;
    let (rules, version) = match &profile.rules {
        Some((text, version)) => (
            Some(serde_json::from_str::<Value>(text).context("stored rules")?),
            *version,
        ),
        None => (None, 0),
    };
    if output.json {
        return say_json(&json!({
            "account": id.to_string(),
            "provider": profile.provider,
            "rules": rules,
            "version": version,
        }));
    }
    match rules {
        Some(rules) => say(format_args!(
            "account {account}, rules version {version}:\n{}",
            serde_json::to_string_pretty(&rules)?
        )),
        None => say(format_args!(
            "account {account} has no rules: its payments go to {}",
            profile
                .provider
                .map_or("the default chain".to_owned(), |p| format!("provider {p}"))
        )),
    }
}

async fn set(
    store: &Store,
    account: &str,
    file: &PathBuf,
    providers: &ProvidersFile,
    output: JsonFlag,
) -> anyhow::Result<()> {
    let text = if file.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("could not read standard input")?
    } else {
        std::fs::read_to_string(file)
            .with_context(|| format!("could not read {}", file.display()))?
    };
    let names = crate::provider::provider_names(providers.providers_file.as_deref())?;
    let set = match RuleSet::parse(&text, &|p| names.iter().any(|n| n == p)) {
        Ok(set) => set,
        Err(e) => bail!("the rules are invalid, nothing changed: {e}"),
    };
    let id = resolve_account(store, account).await?;
    let canonical = serde_json::to_string(&set)?;
    let version = store
        .set_routing_rules(id, Some(&canonical), &actor(), SystemClock.now())
        .await?;
    if output.json {
        return say_json(&json!({
            "account": id.to_string(),
            "rules": serde_json::from_str::<Value>(&canonical)?,
            "version": version,
        }));
    }
    say(format_args!(
        "account {account}: {} rules set (version {version}); new payments follow them within seconds",
        set.rules.len()
    ))
}

async fn circuits(
    store: &Store,
    providers: &ProvidersFile,
    output: JsonFlag,
) -> anyhow::Result<()> {
    let names = crate::provider::provider_names(providers.providers_file.as_deref())?;
    let breaker = match &providers.providers_file {
        Some(path) => Registry::read(path)?.routing().breaker.clone(),
        None => cobro_settle::routing::BreakerPolicy::default(),
    };
    let clock: std::sync::Arc<dyn Clock> = std::sync::Arc::new(SystemClock);
    let now = clock.now();
    let book = cobro_settle::routing::Circuits::new(store.clone(), clock, breaker.clone());
    let rows = store.circuits().await?;
    let mut report = Vec::new();
    for name in &names {
        let state = book.state(name).await;
        let from = now - chrono::Duration::from_std(breaker.window)?;
        let window = store.provider_window(name, from.timestamp()).await?;
        let row = rows.iter().find(|r| &r.provider == name);
        report.push(json!({
            "provider": name,
            "state": state.as_str(),
            "opened_at": row.and_then(|r| r.opened_at).map(|t| instant(t.0)),
            "reason": row.and_then(|r| r.reason.clone()),
            "calls": window.calls,
            "errors": window.errors,
            "mean_latency_ms": if window.calls > 0 { window.latency_ms / window.calls } else { 0 },
        }));
    }
    if output.json {
        return say_json(&json!({"window_seconds": breaker.window.as_secs(), "providers": report}));
    }
    let mut table = Table::new();
    table.set_header([
        "provider", "circuit", "calls", "errors", "mean ms", "opened", "why",
    ]);
    for r in &report {
        let text = |k: &str| match &r[k] {
            Value::String(s) => s.clone(),
            Value::Null => "-".into(),
            v => v.to_string(),
        };
        table.add_row([
            text("provider"),
            text("state"),
            text("calls"),
            text("errors"),
            text("mean_latency_ms"),
            text("opened_at"),
            text("reason"),
        ]);
    }
    say(table)
}
