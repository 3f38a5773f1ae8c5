//! `cobro payments list|show|resolve`, with their arguments. They talk to
//! the database directly (and to the provider for a verified `resolve`), as
//! operators do during an incident. Every one prints a table for humans or,
//! with `--json`, one JSON document.

use crate::database::{self, SchemaPolicy};
use crate::output::{JsonFlag, instant, or_dash, say, say_json};
use crate::reconcile::parse_payment;
use crate::settings::{
    GlobalSettings, KeyWindowSettings, ProviderSettings, ReconcileSettings, parse_duration,
};
use anyhow::{Context, bail};
use chrono::{DateTime, SecondsFormat, Utc};
use clap::{Subcommand, ValueEnum};
use cobro_core::{Clock, PaymentStatus, SystemClock};
use cobro_reconciler::{ManualOutcome, ManualResolution, Reconciler};
use cobro_store::Store;
use comfy_table::Table;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Subcommand)]
pub enum PaymentsCommand {
    /// Payments longest in their status first, with their age (and the
    /// open conflicts). Default: the unsettled ones.
    List {
        /// `unsettled` (the default: every status someone must act on),
        /// `all`, or a status such as `needs_review` or `captured`
        /// (repeatable).
        #[arg(long, value_name = "STATUS")]
        status: Vec<String>,
        /// Only payments created since then: a duration ago (`1h`, `7d`)
        /// or an RFC 3339 instant (`2026-12-01T09:00:00Z`).
        #[arg(long, value_name = "WHEN", value_parser = parse_when)]
        since: Option<When>,
        /// Only payments created before then (same forms as --since).
        #[arg(long, value_name = "WHEN", value_parser = parse_when)]
        until: Option<When>,
        /// Only payments in their status for longer than this.
        #[arg(long, value_parser = parse_duration)]
        older_than: Option<Duration>,
        /// At most this many payments.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// One payment: state, attempts, late answers kept (observations),
    /// conflicts and the audit trail.
    Show {
        id: String,
        #[command(flatten)]
        output: JsonFlag,
    },
    /// Resolve a payment or a refund in `needs_review` by hand (audited).
    /// Names the attempt it resolves (`payments show` lists them, refund
    /// attempts too); refused while any attempt of the payment may be in
    /// flight. The verdict is checked at the provider first, with the
    /// reconciler's own evidence: "no money moved" needs a consistent read
    /// that proves it, a success needs the attempt's object in that state.
    Resolve(Box<ResolveArgs>),
}

/// The arguments of `cobro payments resolve`.
#[derive(clap::Args, Debug)]
pub struct ResolveArgs {
    id: String,
    /// The attempt resolved.
    #[arg(long, value_name = "ATTEMPT_ID")]
    attempt: String,
    #[arg(long, value_enum)]
    outcome: OutcomeArg,
    /// The provider's charge id (required for authorized/captured; a
    /// refund's id for a refund resolved `captured`, i.e. succeeded).
    /// It must be what the provider shows for this attempt (its
    /// reference, metadata, amount, currency and capture mode), unless
    /// `--unverified`.
    #[arg(long)]
    provider_ref: Option<String>,
    /// Do not check the verdict at the provider (it is unreachable, or
    /// the operator knows what it cannot show): the operator vouches
    /// for it, and the audit trail says it was not verified.
    #[arg(long)]
    unverified: bool,
    /// Why: written to the audit trail.
    #[arg(long)]
    reason: String,
    /// Who: defaults to $USER.
    #[arg(long, env = "USER", default_value = "unknown")]
    operator: String,
    /// Do not ask for confirmation.
    #[arg(long)]
    yes: bool,
    #[command(flatten)]
    output: JsonFlag,
    #[command(flatten)]
    provider: ProviderSettings,
    #[command(flatten)]
    key_window: KeyWindowSettings,
    #[command(flatten)]
    reconcile: ReconcileSettings,
}

/// A point in time on the command line: so long ago, or an instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    Ago(Duration),
    At(DateTime<Utc>),
}

impl When {
    pub(crate) fn resolve(self, now: DateTime<Utc>) -> anyhow::Result<DateTime<Utc>> {
        match self {
            When::At(t) => Ok(t),
            When::Ago(d) => chrono::Duration::from_std(d)
                .ok()
                .and_then(|d| now.checked_sub_signed(d))
                .with_context(|| format!("{d:?} ago is out of range")),
        }
    }
}

pub(crate) fn parse_when(text: &str) -> Result<When, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text.trim()) {
        return Ok(When::At(t.with_timezone(&Utc)));
    }
    parse_duration(text)
        .map(When::Ago)
        .map_err(|e| format!("{e}; or an RFC 3339 instant such as 2026-12-01T09:00:00Z"))
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum OutcomeArg {
    Authorized,
    Captured,
    Declined,
    Failed,
    Canceled,
}

impl OutcomeArg {
    fn as_str(self) -> &'static str {
        match self {
            OutcomeArg::Authorized => "authorized",
            OutcomeArg::Captured => "captured",
            OutcomeArg::Declined => "declined",
            OutcomeArg::Failed => "failed",
            OutcomeArg::Canceled => "canceled",
        }
    }
}

/// `cobro payments ...`.
pub async fn run(global: &GlobalSettings, command: PaymentsCommand) -> anyhow::Result<()> {
    let (store, _) = database::open(global, SchemaPolicy::Require).await?;
    let result = match command {
        PaymentsCommand::List {
            status,
            since,
            until,
            older_than,
            limit,
            output,
        } => {
            let filter = ListFilter {
                status,
                since,
                until,
                older_than,
                limit,
            };
            list(&store, filter, output).await
        }
        PaymentsCommand::Show { id, output } => show(&store, &id, output).await,
        PaymentsCommand::Resolve(args) => resolve(&store, *args).await,
    };
    store.close().await;
    result
}

/// The filters of `cobro payments list`.
struct ListFilter {
    status: Vec<String>,
    since: Option<When>,
    until: Option<When>,
    older_than: Option<Duration>,
    limit: u32,
}

/// The statuses `--status` names: `None` for `all`.
fn statuses(given: &[String]) -> anyhow::Result<Option<Vec<PaymentStatus>>> {
    if given.is_empty() || given.iter().any(|s| s == "unsettled") {
        let mut states = PaymentStatus::UNSETTLED.to_vec();
        states.extend(checked(given.iter().filter(|s| *s != "unsettled"))?);
        return Ok(Some(states));
    }
    if given.iter().any(|s| s == "all") {
        return Ok(None);
    }
    checked(given.iter()).map(Some)
}

fn checked<'a>(names: impl Iterator<Item = &'a String>) -> anyhow::Result<Vec<PaymentStatus>> {
    names
        .map(|s| {
            PaymentStatus::parse(s).with_context(|| {
                let known: Vec<_> = PaymentStatus::ALL.iter().map(|s| s.as_str()).collect();
                format!(
                    "unknown payment status `{s}`: use all, unsettled or one of {}",
                    known.join(", ")
                )
            })
        })
        .collect()
}

/// A duration as on-call reads it: `3d04h`, `2h05m`, `4m07s`, `12s`.
fn age(d: chrono::Duration) -> String {
    let s = d.num_seconds().max(0);
    let (days, hours, minutes, seconds) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    match (days, hours, minutes) {
        (0, 0, 0) => format!("{seconds}s"),
        (0, 0, _) => format!("{minutes}m{seconds:02}s"),
        (0, _, _) => format!("{hours}h{minutes:02}m"),
        _ => format!("{days}d{hours:02}h"),
    }
}

/// An amount in minor units, as the API takes it, with its currency.
fn amount(minor: i64, currency: &cobro_core::Currency) -> String {
    format!("{minor} {currency}")
}

async fn list(store: &Store, filter: ListFilter, output: JsonFlag) -> anyhow::Result<()> {
    let now = SystemClock.now();
    let states = statuses(&filter.status)?;
    let in_status_before = filter
        .older_than
        .map(|d| When::Ago(d).resolve(now))
        .transpose()?;
    let query = cobro_store::reconcile::OperatorQuery {
        statuses: states.as_deref(),
        created_from: filter.since.map(|w| w.resolve(now)).transpose()?,
        created_until: filter.until.map(|w| w.resolve(now)).transpose()?,
        in_status_before,
        limit: filter.limit,
    };
    let rows = store.payments_any_account(&query).await?;
    let truncated = rows.len() == filter.limit as usize;
    let conflicts = store.open_conflicts_any_account(1000).await?;
    let which = states.as_ref().map_or_else(
        || "all".to_owned(),
        |s| s.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "),
    );
    if output.json {
        let list: Vec<_> = rows
            .iter()
            .map(|p| {
                serde_json::json!({
                    "id": p.id.to_string(), "account_id": p.account_id.to_string(),
                    "order_ref": p.order_ref, "intent": p.intent, "status": p.status,
                    "amount": p.amount, "currency": p.currency, "provider_ref": p.provider_ref,
                    "created_at": instant(p.created_at.0),
                    "in_status_since": instant(p.status_changed_at.0),
                    "age_seconds": (now - p.status_changed_at.0).num_seconds(),
                    "review_reason": p.review_reason,
                })
            })
            .collect();
        let open: Vec<_> = conflicts.iter().map(conflict_json).collect();
        return say_json(&serde_json::json!({
            "statuses": states, "truncated": truncated,
            "payments": list, "open_conflicts": open,
        }));
    }
    let mut table = Table::new();
    table.set_header([
        "id",
        "intent",
        "status",
        "amount",
        "provider ref",
        "created",
        "in status for",
    ]);
    for p in &rows {
        table.add_row([
            p.id.to_string(),
            p.intent.clone(),
            p.status.to_string(),
            amount(p.amount, &p.currency),
            or_dash(p.provider_ref.as_deref()),
            instant(p.created_at.0),
            age(now - p.status_changed_at.0),
        ]);
    }
    if !rows.is_empty() {
        say(table)?;
    }
    say(format_args!(
        "{} payment(s) with status {which}",
        rows.len()
    ))?;
    if truncated {
        say(format_args!(
            "limit of {} reached: more may match (narrow with --since/--status, or raise --limit)",
            filter.limit
        ))?;
    }
    if states.is_some() && filter.status.is_empty() {
        say("(the unsettled ones; --status all lists every payment)")?;
    }
    if !conflicts.is_empty() {
        say(conflicts_table(&conflicts))?;
        say(format_args!(
            "{} open conflict(s): provider evidence cobro kept but did not adopt",
            conflicts.len()
        ))?;
    }
    Ok(())
}

fn conflicts_table(conflicts: &[cobro_store::conflicts::ConflictRow]) -> Table {
    let mut table = Table::new();
    table.set_header(["found", "payment", "kind", "source", "detail", "resolved"]);
    for c in conflicts {
        table.add_row([
            instant(c.found_at.0),
            or_dash(c.payment_id),
            c.kind.to_string(),
            c.source.clone(),
            c.detail.clone(),
            or_dash(c.resolved_at.map(|t| instant(t.0))),
        ]);
    }
    table
}

fn conflict_json(c: &cobro_store::conflicts::ConflictRow) -> serde_json::Value {
    serde_json::json!({
        "id": c.id.0.to_string(),
        "payment_id": c.payment_id.map(|p| p.to_string()),
        "attempt_id": c.attempt_id.map(|a| a.to_string()),
        "kind": c.kind, "source": c.source, "detail": c.detail,
        "evidence": serde_json::from_str::<serde_json::Value>(&c.evidence).unwrap_or(serde_json::Value::Null),
        "found_at": c.found_at.0.to_rfc3339_opts(SecondsFormat::Secs, true),
        "resolved_at": c.resolved_at.map(|t| t.0.to_rfc3339_opts(SecondsFormat::Secs, true)),
    })
}

async fn show(store: &Store, id: &str, output: JsonFlag) -> anyhow::Result<()> {
    let id = parse_payment(id)?;
    let Some(p) = store.payment_any_account(id).await? else {
        bail!("no payment {id}");
    };
    let attempts = store.attempts_of_payment_any_account(id).await?;
    let decisions = store.decisions_of_payment_any_account(id).await?;
    let conflicts = store.conflicts_of_payment_any_account(id).await?;
    let mut observations = Vec::new();
    for a in &attempts {
        for (token, outcome, detail) in store.observations_of_attempt_any_account(a.id).await? {
            observations.push((a.id, token, outcome, detail));
        }
    }
    let time = |t: &cobro_store::DbTime| t.0.to_rfc3339_opts(SecondsFormat::Millis, true);
    if output.json {
        return say_json(&serde_json::json!({
            "id": p.id.to_string(), "account_id": p.account_id.to_string(),
            "order_ref": p.order_ref, "intent": p.intent,
            "status": p.status, "amount": p.amount, "currency": p.currency,
            "capture_method": p.capture_method,
            "amount_captured": p.amount_captured, "amount_refunded": p.amount_refunded,
            "provider_ref": p.provider_ref, "failure_code": p.failure_code,
            // NULL (older than 0010): the default provider.
            "provider": p.provider,
            "failure_message": p.failure_message,
            "cancel_requested": p.cancel_requested_at.is_some(),
            "review_reason": p.review_reason,
            "conflicts": conflicts.iter().map(conflict_json).collect::<Vec<_>>(),
            "created_at": time(&p.created_at),
            "in_status_since": time(&p.status_changed_at),
            // The provider key is an operator's tool during an incident (to
            // look the attempt up at the provider); the merchant API never shows it.
            "attempts": attempts.iter().map(|a| serde_json::json!({
                "id": a.id.to_string(), "operation": a.operation, "reference": a.reference,
                "provider_key": a.provider_key, "state": a.state, "sends": a.send_count,
                "first_send_at": a.first_send_at.as_ref().map(time), "last_send_at": a.last_send_at.as_ref().map(time),
                "provider_ref": a.provider_ref, "last_error": a.last_error,
                "provider": a.provider, "provider_request_id": a.provider_request_id,
                "provider_replayed": a.provider_replayed,
            })).collect::<Vec<_>>(),
            "late_answers_kept": observations.iter().map(|(attempt, token, outcome, detail)| serde_json::json!({
                "attempt_id": attempt.to_string(), "lease_token": token, "outcome": outcome, "detail": detail,
            })).collect::<Vec<_>>(),
            "audit": decisions.iter().map(|d| serde_json::json!({
                "at": time(&d.decided_at), "actor": d.actor, "decision": d.decision,
                "before": d.state_before, "after": d.state_after, "reason": d.reason,
                "provider_said": serde_json::from_str::<serde_json::Value>(&d.provider_said).unwrap_or_default(),
            })).collect::<Vec<_>>(),
        }));
    }
    let rows: [(&str, String); 11] = [
        ("payment", p.id.to_string()),
        ("intent", p.intent.clone()),
        (
            "status",
            format!("{} since {}", p.status, time(&p.status_changed_at)),
        ),
        (
            "amount",
            format!(
                "{} ({} capture)",
                amount(p.amount, &p.currency),
                p.capture_method
            ),
        ),
        (
            "captured / refunded",
            format!("{} / {}", p.amount_captured, p.amount_refunded),
        ),
        ("provider", provider_name(p.provider.as_deref())),
        ("provider ref", or_dash(p.provider_ref.as_deref())),
        (
            "failure",
            or_dash(p.failure_code.as_deref().map(|c| match &p.failure_message {
                Some(m) => format!("{c}: {m}"),
                None => c.to_owned(),
            })),
        ),
        (
            "cancel requested",
            or_dash(p.cancel_requested_at.as_ref().map(time)),
        ),
        ("review reason", or_dash(p.review_reason.as_deref())),
        ("created", time(&p.created_at)),
    ];
    for (name, value) in rows {
        say(format_args!("{name:>20}  {value}"))?;
    }
    let mut table = Table::new();
    table.set_header([
        "attempt",
        "operation",
        "state",
        "sends",
        "last send",
        "provider",
        "provider ref",
        "provider key",
        "request id",
        "last error",
    ]);
    for a in &attempts {
        table.add_row([
            a.id.to_string(),
            a.operation.to_string(),
            a.state.to_string(),
            a.send_count.to_string(),
            or_dash(a.last_send_at.as_ref().map(time)),
            provider_name(a.provider.as_deref()),
            or_dash(a.provider_ref.as_deref()),
            a.provider_key.clone(),
            match (&a.provider_request_id, a.provider_replayed) {
                (Some(id), true) => format!("{id} (replayed)"),
                (id, _) => or_dash(id.as_deref()),
            },
            or_dash(a.last_error.as_deref()),
        ]);
    }
    say(format_args!("\nattempts ({})", attempts.len()))?;
    say(table)?;
    if !observations.is_empty() {
        let mut late = Table::new();
        late.set_header(["attempt", "lease token", "outcome", "detail"]);
        for (attempt, token, outcome, detail) in &observations {
            late.add_row([
                attempt.to_string(),
                token.to_string(),
                outcome.clone(),
                detail.clone(),
            ]);
        }
        say(format_args!("\nlate answers kept ({})", observations.len()))?;
        say(late)?;
    }
    if !conflicts.is_empty() {
        say(format_args!("\nconflicts ({})", conflicts.len()))?;
        say(conflicts_table(&conflicts))?;
    }
    let mut audit = Table::new();
    audit.set_header(["at", "actor", "decision", "before -> after", "reason"]);
    for d in &decisions {
        // A manual verdict also names the OS user and host that ran it,
        // and whether the provider was asked.
        let said = serde_json::from_str::<serde_json::Value>(&d.provider_said).unwrap_or_default();
        let actor = match (said["invoked_by"].as_str(), said["verified"].as_bool()) {
            (Some(by), Some(verified)) => format!(
                "{} (ran as {by}; {})",
                d.actor,
                if verified { "verified" } else { "NOT verified" }
            ),
            _ => d.actor.clone(),
        };
        audit.add_row([
            time(&d.decided_at),
            actor,
            d.decision.to_string(),
            format!("{} -> {}", d.state_before, d.state_after),
            or_dash(d.reason.as_deref()),
        ]);
    }
    say(format_args!("\naudit trail ({})", decisions.len()))?;
    say(audit)
}

/// A row's provider as shown: NULL (a row older than migration 0010, or an
/// account that names none) is the default provider.
pub(crate) fn provider_name(provider: Option<&str>) -> String {
    provider.map_or_else(|| "(default)".to_owned(), str::to_owned)
}

/// Checks the verdict at the provider the named attempt was sent to, with
/// the reconciler's evidence path ([`Reconciler::check_verdict`]): what the
/// provider showed, for the audit trail.
async fn check_at_provider(
    store: &Store,
    checks: &ResolveArgs,
    resolution: &ManualResolution,
) -> anyhow::Result<String> {
    let attempts = store
        .attempts_of_payment_any_account(resolution.payment)
        .await?;
    let named = attempts
        .iter()
        .find(|a| a.id == resolution.attempt)
        .with_context(|| {
            format!(
                "attempt {} is not an attempt of payment {}",
                resolution.attempt, resolution.payment
            )
        })?;
    let registry = crate::provider::Registry::load(
        &checks.provider,
        Some(&checks.key_window),
        Some(&checks.reconcile),
    )?;
    let handle = crate::provider::connect(registry, false)
        .await
        .context("checking the verdict needs the provider (or --unverified)")?;
    let spec = handle.registry.of_row(named.provider.as_deref())?;
    let client = handle.client_of_row(named.provider.as_deref())?;
    let reconciler = Reconciler::new(
        store.clone(),
        Arc::new(client.clone()),
        Arc::new(SystemClock),
        checks.reconcile.config(
            spec,
            handle.registry.scope(spec),
            format!("operator:{}", resolution.operator),
        ),
    );
    Ok(reconciler.check_verdict(resolution).await?)
}

async fn resolve(store: &Store, r: ResolveArgs) -> anyhow::Result<()> {
    let id = parse_payment(&r.id)?;
    let attempt: cobro_core::AttemptId = r
        .attempt
        .parse()
        .with_context(|| format!("`{}` is not an attempt id", r.attempt))?;
    if r.reason.trim().is_empty() {
        bail!("--reason must say why");
    }
    let (outcome, provider_ref) = (r.outcome, r.provider_ref.clone());
    let mut resolution = ManualResolution {
        payment: id,
        attempt,
        outcome: match outcome {
            OutcomeArg::Authorized => ManualOutcome::Authorized,
            OutcomeArg::Captured => ManualOutcome::Captured,
            OutcomeArg::Declined => ManualOutcome::Declined,
            OutcomeArg::Failed => ManualOutcome::Failed,
            OutcomeArg::Canceled => ManualOutcome::Canceled,
        },
        provider_ref: provider_ref.clone(),
        operator: r.operator.clone(),
        reason: r.reason.clone(),
        invoked_by: cobro_reconciler::invoked_by(),
        verified: None,
    };
    if r.unverified {
        eprintln!("cobro: --unverified: the verdict is not checked at the provider");
        resolution.reason = format!("{} [not verified at the provider]", resolution.reason);
    } else {
        resolution.verified = Some(check_at_provider(store, &r, &resolution).await?);
    }
    if !r.yes {
        eprint!(
            "resolve attempt {attempt} of payment {id} as {} (provider ref {})? [y/N] ",
            outcome.as_str(),
            or_dash(provider_ref.as_deref())
        );
        let mut answer = String::new();
        std::io::stdin()
            .read_line(&mut answer)
            .context("could not read the confirmation")?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            bail!("not confirmed; nothing changed");
        }
    }
    let after = cobro_reconciler::resolve_by_hand(store, &resolution, SystemClock.now())
        .await
        .context("could not resolve the payment")?;
    if r.output.json {
        return say_json(&serde_json::json!({
            "payment_id": id.to_string(), "attempt_id": attempt.to_string(),
            "outcome": outcome.as_str(), "provider_ref": resolution.provider_ref,
            "status": after.to_string(),
        }));
    }
    say(format_args!("payment {id} resolved: {after}"))
}
