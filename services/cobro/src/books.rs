//! `cobro books`: the provider's ledger matched against cobro's record
//! (docs/books.md), on demand over a window, and what an operator does
//! with what it finds (`orphans`, `acknowledge`, `runs`).

use crate::database::{self, SchemaPolicy};
use crate::output::{JsonFlag, or_dash, say, say_json};
use crate::payments::{When, parse_when};
use crate::provider::{ProviderHandle, ProviderSpec};
use crate::settings::{GlobalSettings, ProviderSettings, ReconcileSettings};
use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use cobro_core::{Clock, SystemClock};
use cobro_provider::Connector;
use cobro_reconciler::books::{Adopted, Books, BooksReport};
use cobro_store::{DbId, Store};
use comfy_table::Table;
use std::sync::Arc;

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BooksArgs {
    #[command(subcommand)]
    pub command: Option<BooksCommand>,
    #[command(flatten)]
    pub run: RunArgs,
}

/// A run over a window, on demand.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The window's start: the provider's objects created from here (an
    /// RFC 3339 instant, or so long ago: `2h`).
    #[arg(long, value_parser = parse_when)]
    pub from: Option<When>,
    /// The window's end (default: now).
    #[arg(long, value_parser = parse_when)]
    pub to: Option<When>,
    /// Only this provider (default: every configured one).
    #[arg(long = "only-provider", value_name = "NAME")]
    pub only: Option<String>,
    /// Class and show, but write nothing (no orphan, no move, no conflict,
    /// no run row).
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub output: JsonFlag,
    #[command(flatten)]
    pub provider: ProviderSettings,
    #[command(flatten)]
    pub settings: ReconcileSettings,
}

#[derive(Debug, Subcommand)]
pub enum BooksCommand {
    /// Orphans: objects at the provider that carry cobro's metadata but no
    /// attempt of cobro's (open ones unless --all).
    Orphans {
        #[arg(long)]
        all: bool,
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// Acknowledge an open orphan (audited: who, why, when): the books
    /// then count its object as matched to this record.
    Acknowledge {
        /// The orphan's id (`cobro books orphans`).
        id: String,
        /// Why: kept with the orphan.
        #[arg(long)]
        reason: String,
        /// Who: defaults to $USER.
        #[arg(long, env = "USER", default_value = "unknown")]
        operator: String,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// Adopt an open charge orphan (audited): its payment is recorded
    /// again as the provider shows it now (read by id first; its metadata
    /// must say what the orphan says), with its refund orphans that
    /// succeeded. The merchant (or an operator through the API) then
    /// captures, voids or refunds it through the outbox like any payment.
    /// Refused, writing nothing, when the order already has an active
    /// payment (a second charge: refund it at the provider, then
    /// acknowledge).
    Adopt(Box<AdoptArgs>),
    /// The latest runs with their windows and counts.
    Runs {
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
        #[command(flatten)]
        output: JsonFlag,
    },
}

/// The arguments of `cobro books adopt`.
#[derive(Debug, Args)]
pub struct AdoptArgs {
    /// The orphan's id (`cobro books orphans`): a charge.
    pub id: String,
    /// Why: kept with the orphan and the decision.
    #[arg(long)]
    pub reason: String,
    /// Who: defaults to $USER.
    #[arg(long, env = "USER", default_value = "unknown")]
    pub operator: String,
    #[command(flatten)]
    pub output: JsonFlag,
    #[command(flatten)]
    pub provider: ProviderSettings,
    #[command(flatten)]
    pub settings: ReconcileSettings,
}

/// Returned when a run leaves objects or attempts unmatched (orphans,
/// drift, missing): `main` maps it to exit 3, like `cobro reconcile`.
#[derive(Debug, thiserror::Error)]
#[error("{0} object(s) or attempt(s) not matched (orphan, drifted or missing)")]
pub struct Unmatched(pub u64);

pub async fn run(global: &GlobalSettings, args: BooksArgs) -> anyhow::Result<()> {
    let Some(command) = args.command else {
        return run_window(global, &args.run).await;
    };
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let result = match command {
        BooksCommand::Orphans { all, limit, output } => orphans(&store, all, limit, output).await,
        BooksCommand::Acknowledge {
            id,
            reason,
            operator,
            output,
        } => acknowledge(&store, &id, &reason, &operator, output).await,
        BooksCommand::Runs { limit, output } => runs(&store, limit, output).await,
        BooksCommand::Adopt(args) => adopt(&store, *args).await,
    };
    store.close().await;
    result
}

async fn run_window(global: &GlobalSettings, args: &RunArgs) -> anyhow::Result<()> {
    let now = SystemClock.now();
    let from = args
        .from
        .context("--from is required (or a subcommand: orphans, acknowledge, runs)")?
        .resolve(now)?
        .timestamp();
    let to = args.to.map_or(Ok(now), |to| to.resolve(now))?.timestamp();
    if from > to {
        bail!("--from is after --to");
    }
    let registry = crate::provider::Registry::load(&args.provider, None, Some(&args.settings))?;
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let handle = crate::provider::connect(registry, false).await?;
    let actor = format!(
        "operator:{}",
        std::env::var("USER").unwrap_or_else(|_| "cli".into())
    );
    let mut reports = Vec::new();
    for (spec, client) in &handle.clients {
        if args.only.as_deref().is_some_and(|only| only != spec.name) {
            continue;
        }
        let books = books_of(&store, &handle, (spec, client), &args.settings, &actor);
        let report = books
            .run((from, to), args.dry_run, "cli")
            .await
            .with_context(|| format!("the books run of `{}` failed", spec.name))?;
        reports.push(report);
    }
    store.close().await;
    if reports.is_empty() {
        bail!("no such provider configured");
    }
    if args.output.json {
        say_json(&serde_json::json!({ "runs": reports }))?;
    } else {
        for report in &reports {
            print_report(report)?;
        }
    }
    let unmatched: u64 = reports.iter().map(|r| r.counts.unmatched()).sum();
    if unmatched > 0 {
        return Err(Unmatched(unmatched).into());
    }
    Ok(())
}

/// The books of one configured provider, run by `actor` from the CLI.
fn books_of(
    store: &Store,
    handle: &ProviderHandle,
    (spec, client): (&ProviderSpec, &Connector),
    settings: &ReconcileSettings,
    actor: &str,
) -> Books<Connector> {
    let scope = handle.registry.scope(spec);
    let config = settings.books.config(spec, &scope, actor.to_owned());
    Books::new(
        store.clone(),
        Arc::new(client.clone()),
        Arc::new(SystemClock),
        config,
    )
}

fn print_report(r: &BooksReport) -> anyhow::Result<()> {
    say(format!(
        "books of {}: objects created {} to {} ({}){}",
        r.provider,
        instant(r.window.0),
        instant(r.window.1),
        r.run_id.as_deref().unwrap_or("not recorded"),
        if r.dry_run {
            ", dry run: nothing written"
        } else {
            ""
        }
    ))?;
    if !r.findings.is_empty() {
        let mut table = Table::new();
        table.set_header([
            "class", "kind", "object", "payment", "amount", "status", "detail", "action",
        ]);
        for f in &r.findings {
            table.add_row([
                f.class.as_str().to_owned(),
                f.kind.to_owned(),
                or_dash(f.object.as_deref()),
                or_dash(f.payment.as_deref()),
                match (f.amount, &f.currency) {
                    (Some(a), Some(c)) => format!("{a} {c}"),
                    (Some(a), None) => a.to_string(),
                    _ => "-".into(),
                },
                or_dash(f.status.as_deref()),
                f.detail.clone(),
                f.action.clone(),
            ]);
        }
        say(table)?;
    }
    let c = r.counts;
    let mut totals = Table::new();
    totals.set_header([
        "objects", "matched", "orphan", "foreign", "drifted", "missing",
    ]);
    totals.add_row([
        c.objects, c.matched, c.orphan, c.foreign, c.drifted, c.missing,
    ]);
    say(totals)
}

fn instant(seconds: i64) -> String {
    chrono::DateTime::from_timestamp(seconds, 0)
        .map_or_else(|| seconds.to_string(), crate::output::instant)
}

async fn orphans(store: &Store, all: bool, limit: u32, output: JsonFlag) -> anyhow::Result<()> {
    let rows = store.orphans(all, limit).await?;
    if output.json {
        let rows: Vec<_> = rows
            .iter()
            .map(|o| {
                serde_json::json!({
                    "id": o.id.0.to_string(),
                    "provider": o.provider,
                    "object": o.object_id,
                    "kind": o.kind,
                    "account": o.account_id,
                    "payment": o.payment_id,
                    "intent": o.intent,
                    "attempt": o.attempt_id,
                    "reference": o.reference,
                    "charge": o.charge,
                    "amount": o.amount,
                    "amount_captured": o.amount_captured,
                    "currency": o.currency,
                    "status": o.status,
                    "found_at": crate::output::instant(o.found_at.0),
                    "state": o.state,
                    "resolved_by": o.resolved_by,
                    "reason": o.reason,
                    "resolved_at": o.resolved_at.map(|t| crate::output::instant(t.0)),
                })
            })
            .collect();
        return say_json(&serde_json::json!({ "orphans": rows }));
    }
    let mut table = Table::new();
    table.set_header([
        "id", "provider", "object", "kind", "account", "payment", "attempt", "amount", "status",
        "state",
    ]);
    for o in &rows {
        table.add_row([
            o.id.0.to_string(),
            o.provider.clone(),
            o.object_id.clone(),
            o.kind.clone(),
            or_dash(o.account_id.as_deref()),
            or_dash(o.payment_id.as_deref()),
            or_dash(o.attempt_id.as_deref()),
            match (o.amount, &o.currency) {
                (Some(a), Some(c)) => format!("{a} {c}"),
                _ => "-".into(),
            },
            o.status.clone(),
            o.state.clone(),
        ]);
    }
    say(table)
}

async fn acknowledge(
    store: &Store,
    id: &str,
    reason: &str,
    operator: &str,
    output: JsonFlag,
) -> anyhow::Result<()> {
    let id: uuid::Uuid = id
        .parse()
        .with_context(|| format!("`{id}` is not an orphan id"))?;
    if reason.trim().is_empty() {
        bail!("--reason must say why");
    }
    let actor = format!("operator:{operator}");
    if !store
        .acknowledge_orphan(DbId(id), &actor, reason, SystemClock.now())
        .await?
    {
        bail!("no open orphan {id} (unknown, or already resolved)");
    }
    tracing::info!(orphan = %id, actor, "orphan acknowledged");
    if output.json {
        say_json(&serde_json::json!({ "id": id.to_string(), "state": "acknowledged" }))
    } else {
        say(format!("orphan {id} acknowledged by {actor}"))
    }
}

async fn adopt(store: &Store, args: AdoptArgs) -> anyhow::Result<()> {
    let id: uuid::Uuid = args
        .id
        .parse()
        .with_context(|| format!("`{}` is not an orphan id", args.id))?;
    if args.reason.trim().is_empty() {
        bail!("--reason must say why");
    }
    let registry = crate::provider::Registry::load(&args.provider, None, Some(&args.settings))?;
    let orphan = store
        .orphan(DbId(id))
        .await?
        .with_context(|| format!("no orphan {id}"))?;
    let handle = crate::provider::connect(registry, false).await?;
    let (spec, client) = handle
        .clients
        .iter()
        .find(|(spec, _)| spec.name == orphan.provider)
        .with_context(|| {
            format!(
                "orphan {id} is provider `{}`'s, which is not configured here",
                orphan.provider
            )
        })?;
    let actor = format!("operator:{}", args.operator);
    let books = books_of(store, &handle, (spec, client), &args.settings, &actor);
    let adopted = books.adopt(DbId(id), &actor, &args.reason).await?;
    if args.output.json {
        say_json(&serde_json::to_value(&adopted)?)?;
    } else {
        say_adopted(&adopted)?;
    }
    if !adopted.refunds_not_adopted.is_empty() {
        return Err(Unmatched(adopted.refunds_not_adopted.len() as u64).into());
    }
    Ok(())
}

fn say_adopted(adopted: &Adopted) -> anyhow::Result<()> {
    for (refund, why) in &adopted.refunds_not_adopted {
        say(format!(
            "refund {refund} not adopted (its orphan stays open): {why}"
        ))?;
    }
    say(format!(
        "orphan {} adopted: payment {} of account {} (order {}) is {}, charge {}{}",
        adopted.orphan,
        adopted.payment,
        adopted.account,
        adopted.order_ref,
        adopted.status,
        adopted.charge,
        if adopted.refunds.is_empty() {
            String::new()
        } else {
            format!(", with refunds {}", adopted.refunds.join(", "))
        }
    ))?;
    say(
        "run the books again over the window the orphan was found in: refunds of this charge \
         made at the provider without cobro's metadata are recorded then",
    )
}

async fn runs(store: &Store, limit: u32, output: JsonFlag) -> anyhow::Result<()> {
    let rows = store.books_runs(limit).await?;
    if output.json {
        let rows: Vec<_> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "id": r.id.0.to_string(),
                    "provider": r.provider,
                    "trigger": r.trigger,
                    "actor": r.actor,
                    "window": [r.window_from, r.window_to],
                    "started_at": crate::output::instant(r.started_at.0),
                    "finished_at": r.finished_at.map(|t| crate::output::instant(t.0)),
                    "objects": r.objects,
                    "matched": r.matched,
                    "orphan": r.orphans,
                    "foreign": r.foreign_objects,
                    "drifted": r.drifted,
                    "missing": r.missing,
                    "error": r.error,
                })
            })
            .collect();
        return say_json(&serde_json::json!({ "runs": rows }));
    }
    let mut table = Table::new();
    table.set_header([
        "started", "provider", "trigger", "from", "to", "objects", "matched", "orphan", "foreign",
        "drifted", "missing", "error",
    ]);
    for r in &rows {
        table.add_row([
            crate::output::instant(r.started_at.0),
            r.provider.clone(),
            r.trigger.clone(),
            instant(r.window_from),
            instant(r.window_to),
            r.objects.to_string(),
            r.matched.to_string(),
            r.orphans.to_string(),
            r.foreign_objects.to_string(),
            r.drifted.to_string(),
            r.missing.to_string(),
            or_dash(r.error.as_deref()),
        ]);
    }
    say(table)
}
