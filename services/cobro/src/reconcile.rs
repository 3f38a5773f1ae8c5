//! `cobro reconcile`, with its arguments: asks the provider about every
//! uncertain attempt, as the scheduled reconciler does, and prints the
//! verdicts (a table for humans or, with `--json`, one JSON document).

use crate::database::{self, SchemaPolicy};
use crate::output::{say, say_json};
use crate::settings::{
    GlobalSettings, KeyWindowSettings, ProviderSettings, ReconcileSettings, parse_duration,
};
use anyhow::{Context, bail};
use clap::Args;
use cobro_core::{PaymentId, SystemClock};
use cobro_reconciler::{Reconciler, Scope, Summary};
use comfy_table::Table;
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct ReconcileArgs {
    /// Only this payment.
    #[arg(long, value_name = "ID", conflicts_with = "all")]
    pub payment: Option<String>,
    /// Every candidate, page by page (the default; says so explicitly in
    /// scripts).
    #[arg(long)]
    pub all: bool,
    /// Stop after this many candidates (exit 3 if some were left).
    #[arg(long, value_name = "N", conflicts_with = "all")]
    pub max: Option<usize>,
    /// Only attempts last sent longer ago than this (e.g. `10m`).
    #[arg(long, value_parser = parse_duration)]
    pub older_than: Option<Duration>,
    /// Decide and show, but write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Machine-readable output on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub provider: ProviderSettings,
    /// The key window bounds the replay of an attempt's own key, the
    /// ladder's last rung: this command sends too.
    #[command(flatten)]
    pub key_window: KeyWindowSettings,
    #[command(flatten)]
    pub settings: ReconcileSettings,
}

/// `cobro reconcile`'s exit status when something is still unresolved
/// (0: nothing left; 1: an error; 2: a usage error).
pub const EXIT_UNRESOLVED: u8 = 3;

pub(crate) fn parse_payment(id: &str) -> anyhow::Result<PaymentId> {
    id.parse()
        .with_context(|| format!("`{id}` is not a payment id"))
}

/// `cobro reconcile`. Exit status: 0 when nothing is left unresolved, 3
/// ([`Unresolved`]) when something is (still unknown, in review, a
/// conflict, or candidates left past `--max`), 1 on an error, including a
/// candidate whose examination failed.
pub async fn run(global: &GlobalSettings, args: &ReconcileArgs) -> anyhow::Result<()> {
    let settings = &args.settings;
    let registry =
        crate::provider::Registry::load(&args.provider, Some(&args.key_window), Some(settings))?;
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let handle = crate::provider::connect(registry, false).await?;
    let actor = format!(
        "operator:{}",
        std::env::var("USER").unwrap_or_else(|_| "cli".into())
    );
    let scope = Scope {
        payment: args.payment.as_deref().map(parse_payment).transpose()?,
        older_than: args.older_than,
        max: args.max,
    };
    let bar = (!args.json && std::io::stderr().is_terminal()).then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} attempts {elapsed}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    let progress = |done: usize, total: usize| {
        if let Some(bar) = &bar {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        }
    };
    // One run per provider, each asking its provider about the attempts
    // sent to it; shown as one summary. `--max` bounds each run.
    let mut summary: Option<Summary> = None;
    for (spec, client) in &handle.clients {
        let reconciler = Reconciler::new(
            store.clone(),
            Arc::new(client.clone()),
            Arc::new(SystemClock),
            settings.config(spec, handle.registry.scope(spec), actor.clone()),
        );
        let run = reconciler
            .run(&scope, args.dry_run, "cli", &progress)
            .await
            .with_context(|| format!("the reconciliation run of `{}` failed", spec.name))?;
        match &mut summary {
            Some(all) => all.absorb(run),
            None => summary = Some(run),
        }
    }
    let summary = summary.context("no provider is configured")?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    store.close().await;
    if args.json {
        say_json(&serde_json::to_value(&summary)?)?;
    } else {
        print_summary(&summary)?;
    }
    if summary.errors > 0 {
        bail!(
            "{} candidate(s) could not be examined (see the log); run again",
            summary.errors
        );
    }
    if summary.unresolved() > 0 || summary.truncated {
        return Err(Unresolved(summary.unresolved()).into());
    }
    Ok(())
}

/// Returned when a run leaves attempts unresolved: `main` maps it to exit
/// [`EXIT_UNRESOLVED`].
#[derive(Debug, thiserror::Error)]
#[error("{0} attempt(s) still unresolved (unknown, in review or in conflict), or candidates left")]
pub struct Unresolved(pub usize);

fn print_summary(s: &Summary) -> anyhow::Result<()> {
    let mut items = Table::new();
    items.set_header(["payment", "reference", "operation", "verdict", "applied"]);
    for item in &s.items {
        let verdict = serde_json::to_value(&item.verdict)?;
        let mut text = verdict["verdict"].as_str().unwrap_or("?").to_owned();
        if let Some(extra) = verdict
            .get("outcome")
            .or_else(|| verdict.get("reason"))
            .or_else(|| verdict.get("detail"))
            .or_else(|| verdict.get("error"))
            .and_then(|v| v.as_str())
        {
            text.push_str(": ");
            text.push_str(extra);
        }
        items.add_row([
            item.payment_id.clone(),
            item.reference.clone(),
            item.operation.clone(),
            text,
            item.applied.to_string(),
        ]);
    }
    if !s.items.is_empty() {
        say(items)?;
    }
    let mut totals = Table::new();
    totals.set_header([
        "examined",
        "resolved",
        "retried (new key)",
        "failed (no effect)",
        "still unknown",
        "escalated",
        "conflicts",
        "already settled",
        "errors",
    ]);
    let resolved = s
        .resolved
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ");
    totals.add_row([
        s.examined.to_string(),
        if resolved.is_empty() {
            "0".into()
        } else {
            resolved
        },
        s.retried.to_string(),
        s.failed_no_effect.to_string(),
        s.still_unknown.to_string(),
        s.escalated.to_string(),
        s.conflicts.to_string(),
        s.already_settled.to_string(),
        s.errors.to_string(),
    ]);
    say(totals)?;
    if s.dry_run {
        say("dry run: nothing was written")?;
    }
    Ok(())
}
