//! Events to merchants, for operators: the dispatcher that `serve` and
//! `cobro worker` run (unless `--no-dispatcher`), and `cobro events`
//! (`list`, `resend <id> | --dead`, `endpoints add|list|remove|rotate|enable`).
//!
//! Several dispatchers (one per process) share the deliveries safely: each
//! claims with a lease and a fencing token, like the outbox worker.

use crate::admin::resolve_account;
use crate::database::{self, SchemaPolicy};
use crate::output::{say, say_json};
use crate::settings::{DispatcherSettings, EndpointPolicySettings, GlobalSettings};
use anyhow::Context;
use clap::Subcommand;
use cobro_core::{Clock, EndpointId, EventId, SystemClock};
use cobro_store::Store;
use cobro_worker::{Dispatcher, DispatcherConfig};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Starts the dispatcher loop as a task, unless `--no-dispatcher`; it stops
/// when `shutdown` turns true (an interrupted POST is sent again later:
/// at least once).
///
/// `development`: the process runs on the embedded demo database, whose
/// endpoints may also be plain http on this machine
/// (`EndpointPolicySettings::policy`).
pub fn spawn_dispatcher(
    store: &Store,
    clock: &Arc<dyn Clock>,
    settings: &DispatcherSettings,
    development: bool,
    shutdown: watch::Receiver<bool>,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    if settings.no_dispatcher {
        tracing::warn!("no event dispatcher in this process (--no-dispatcher)");
        return Ok(None);
    }
    let config = DispatcherConfig {
        request_timeout: settings.events_timeout,
        // Longer than any POST, so a live dispatcher never loses its lease
        // mid-call; short enough that a dead one's deliveries resume soon.
        lease: (settings.events_timeout * 2).max(settings.events_timeout + Duration::from_secs(1)),
        retry_period: settings.events_retry_period,
        disable_after: settings.events_retry_period,
        poll_interval: settings.events_poll,
        backoff_base: settings.events_backoff_base,
        backoff_cap: settings.events_backoff_cap,
        egress: settings.endpoints.policy(development),
        ..Default::default()
    };
    let dispatcher = Dispatcher::new(store.clone(), Arc::clone(clock), config)
        .context("could not build the event dispatcher's HTTP client")?;
    Ok(Some(tokio::spawn(Arc::new(dispatcher).run(shutdown))))
}

#[derive(Debug, Subcommand)]
pub enum EventsCommand {
    /// Events in feed order (all accounts, or one), after a position.
    List {
        #[arg(long, value_name = "NAME_OR_ID")]
        account: Option<String>,
        /// Only events after this position.
        #[arg(long, default_value_t = 0)]
        after: i64,
        #[arg(long, default_value_t = 50)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
    /// Send an event again to its account's endpoints (deliveries start
    /// over, with a fresh retry period), or every dead delivery (`--dead`).
    Resend {
        /// The event id.
        #[arg(required_unless_present = "dead", conflicts_with = "dead")]
        event: Option<String>,
        /// Replay every dead delivery (of `--account`, or all).
        #[arg(long)]
        dead: bool,
        #[arg(long, value_name = "NAME_OR_ID")]
        account: Option<String>,
        /// One JSON document on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Manage the endpoints events are pushed to.
    #[command(subcommand)]
    Endpoints(EndpointsCommand),
}

#[derive(Debug, Subcommand)]
pub enum EndpointsCommand {
    /// Add an endpoint; prints its id and its signing secret (ONCE).
    Add {
        #[arg(long, value_name = "NAME_OR_ID")]
        account: String,
        #[arg(long)]
        url: String,
        /// Event types to send (repeatable); default all.
        #[arg(long = "type", value_name = "TYPE")]
        types: Vec<String>,
        /// One JSON document on stdout.
        #[arg(long)]
        json: bool,
        /// The rule the URL must pass: the same settings as the
        /// dispatcher's, so an endpoint added here is one it delivers to.
        #[command(flatten)]
        policy: EndpointPolicySettings,
    },
    /// Endpoints (all accounts, or one), without secrets.
    List {
        #[arg(long, value_name = "NAME_OR_ID")]
        account: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Remove an endpoint and its pending deliveries.
    Remove {
        id: String,
        /// One JSON document on stdout.
        #[arg(long)]
        json: bool,
    },
    /// A new secret; the previous one also signs for 24 h. Prints it ONCE.
    Rotate {
        id: String,
        /// One JSON document on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Enable an endpoint that was disabled for failing.
    Enable {
        id: String,
        /// One JSON document on stdout.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `cobro events ...`.
pub async fn run(global: &GlobalSettings, command: EventsCommand) -> anyhow::Result<()> {
    let (store, target) = database::open(global, SchemaPolicy::Require).await?;
    let development = target.embedded_file().is_some();
    let now = SystemClock.now();
    let account = async |name: &Option<String>| -> anyhow::Result<Option<cobro_core::AccountId>> {
        Ok(match name {
            Some(name) => Some(resolve_account(&store, name).await?),
            None => None,
        })
    };
    match command {
        EventsCommand::List {
            account: name,
            after,
            limit,
            json,
        } => {
            store.sequence_events(now).await?;
            let rows = match account(&name).await? {
                Some(account) => {
                    let filter = cobro_store::events::EventFilter {
                        after,
                        limit,
                        ..Default::default()
                    };
                    store.events_for_account(account, &filter).await?
                }
                None => store.events_any_account(after, limit).await?,
            };
            if json {
                let next_after = rows
                    .last()
                    .and_then(|row| row.feed_position)
                    .unwrap_or(after);
                let events: Vec<_> = rows.iter().map(|row| row.to_json()).collect();
                say_json(&serde_json::json!({"events": events, "next_after": next_after}))?;
            } else {
                for row in rows {
                    say(format_args!(
                        "{position}\t{id}\t{kind}\t{object}\tseq {seq}\t{at}",
                        position = row.feed_position.unwrap_or(0),
                        id = row.id,
                        kind = row.event_type,
                        object = row.object_id.0,
                        seq = row.sequence,
                        at = row.created_at.0.to_rfc3339(),
                    ))?;
                }
            }
        }
        EventsCommand::Resend {
            event,
            dead,
            account: name,
            json,
        } => {
            let account = account(&name).await?;
            if dead {
                let n = store.replay_dead_deliveries(account, now).await?;
                if json {
                    say_json(&serde_json::json!({"dead_deliveries_queued": n}))?;
                } else {
                    say(format_args!("{n} dead deliveries queued again"))?;
                }
            } else {
                let id: EventId = event
                    .as_deref()
                    .unwrap_or_default()
                    .parse()
                    .context("not an event id")?;
                let n = store
                    .resend_event(account, id, now)
                    .await?
                    .with_context(|| format!("no event {id}"))?;
                if json {
                    say_json(
                        &serde_json::json!({"event_id": id.to_string(), "deliveries_queued": n}),
                    )?;
                } else {
                    say(format_args!("{n} deliveries of {id} queued"))?;
                }
            }
        }
        EventsCommand::Endpoints(command) => endpoints(&store, command, development, now).await?,
    }
    store.close().await;
    Ok(())
}

async fn endpoints(
    store: &Store,
    command: EndpointsCommand,
    development: bool,
    now: chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<()> {
    let parse = |id: &str| id.parse::<EndpointId>().context("not an endpoint id");
    match command {
        EndpointsCommand::Add {
            account,
            url,
            types,
            json,
            policy,
        } => {
            let account = resolve_account(store, &account).await?;
            let known = cobro_api::events::event_types();
            if let Some(unknown) = types.iter().find(|t| !known.contains(t)) {
                anyhow::bail!("unknown event type `{unknown}`");
            }
            // The API's own rule (crates/api/src/events.rs).
            anyhow::ensure!(
                cobro_api::events::endpoint_url_ok(&url),
                "the URL must be http:// or https:// with a host name or IPv4 address (no IPv6 literal, user, query or fragment)"
            );
            // The API's egress rule, with this process's settings.
            if let Err(reason) =
                cobro_api::events::check_endpoint_url(&policy.policy(development), &url).await
            {
                anyhow::bail!(
                    "the endpoint URL is not allowed: {reason} (COBRO_EVENTS_ALLOW_HTTP and COBRO_EVENTS_ALLOW say what else may be reached)"
                );
            }
            let secret = cobro_api::events::new_secret();
            let row = store
                .create_endpoint(account, &url, &secret, &types, now)
                .await?;
            if json {
                let mut shown = endpoint_json(&row);
                shown["secret"] = serde_json::json!(secret);
                say_json(&shown)?;
            } else {
                say(format_args!("{}\t{secret}", row.id))?;
            }
        }
        EndpointsCommand::List { account, json } => {
            let account = match account {
                Some(name) => Some(resolve_account(store, &name).await?),
                None => None,
            };
            let rows = store.list_endpoints(account).await?;
            if json {
                let endpoints: Vec<_> = rows.iter().map(endpoint_json).collect();
                say_json(&serde_json::json!({ "endpoints": endpoints }))?;
            } else {
                for row in rows {
                    say(format_args!(
                        "{}\t{}\t{}\t{}\t{}",
                        row.id,
                        row.url,
                        row.event_types,
                        if row.enabled { "enabled" } else { "disabled" },
                        row.disabled_reason.as_deref().unwrap_or_default(),
                    ))?;
                }
            }
        }
        EndpointsCommand::Remove { id, json } => {
            let id = parse(&id)?;
            anyhow::ensure!(store.delete_endpoint(None, id).await?, "no endpoint {id}");
            if json {
                say_json(&serde_json::json!({"id": id.to_string(), "removed": true}))?;
            } else {
                say(format_args!("removed {id}"))?;
            }
        }
        EndpointsCommand::Rotate { id, json } => {
            let id = parse(&id)?;
            let secret = cobro_api::events::new_secret();
            let overlap = chrono::Duration::from_std(cobro_api::events::ROTATION_OVERLAP)?;
            store
                .rotate_endpoint_secret(None, id, &secret, now + overlap, now)
                .await?
                .with_context(|| format!("no endpoint {id}"))?;
            if json {
                say_json(&serde_json::json!({
                    "id": id.to_string(),
                    "secret": secret,
                    "previous_secret_valid_until": crate::output::instant(now + overlap),
                }))?;
            } else {
                say(format_args!("{id}\t{secret}"))?;
            }
        }
        EndpointsCommand::Enable { id, json } => {
            let id = parse(&id)?;
            anyhow::ensure!(
                store.enable_endpoint(None, id, now).await?,
                "no endpoint {id}"
            );
            if json {
                say_json(&serde_json::json!({"id": id.to_string(), "enabled": true}))?;
            } else {
                say(format_args!("enabled {id}"))?;
            }
        }
    }
    Ok(())
}

/// An endpoint as `--json` shows it: never its secret.
fn endpoint_json(row: &cobro_store::events::EndpointRow) -> serde_json::Value {
    serde_json::json!({
        "id": row.id.to_string(),
        "account_id": row.account_id.to_string(),
        "url": row.url,
        "event_types": row.types(),
        "enabled": row.enabled,
        "disabled_reason": row.disabled_reason,
    })
}
