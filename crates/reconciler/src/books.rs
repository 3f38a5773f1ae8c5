//! The books: cobro's record matched against the provider's own ledger
//! (docs/books.md: what they are, how to run and read them).
//!
//! The reconciler asks about what cobro knows it sent. The books ask the
//! other way round: every object the provider holds under cobro's
//! credentials, created in a window, is listed (the consistent list by
//! creation time, charges then refunds, page by page to the end) and
//! matched one-to-one against cobro's attempts, first by cobro's metadata
//! (`cobro_attempt` names the attempt), then by identity (reference,
//! account, payment, amount, currency, capture mode: [`cobro_settle::fit`])
//! and status. Each object ends in exactly one [`Class`]; so does each
//! successful attempt of the window that no object matched (`missing`).
//!
//! Layout:
//! - [`Books::run`] lists and classes one window, applies what a class
//!   does (unless a dry run), writes the run's row and its report;
//! - [`Books::run_due`] is the scheduled, incremental run: from the
//!   provider's checkpoint minus an overlap (clock skew, late objects) to
//!   now minus the settle delay, then the checkpoint moves forward;
//! - what drift and missing do is in `cobro_settle::books`, the one settle
//!   path webhooks use too.
//!
//! Memory is bounded by a page: what a run listed, which "missing" needs,
//! is written to `books_listed` a page (100 objects) at a time and read
//! back by the missing check's query (a dry run, which writes nothing,
//! holds those ids in memory instead); the attempts side is read from the
//! database by the window, a page at a time, through the
//! `attempts_settled_by_send` index.

mod adopt;
pub use adopt::{AdoptError, Adopted};

use chrono::{DateTime, TimeZone, Utc};
use cobro_core::{AttemptState, Clock, PaymentStatus, RefundStatus};
use cobro_provider::{LedgerKind, Provider, ProviderObject, ProviderStatus, Window, metadata};
use cobro_settle::books::{
    Drift, adopt_outside_refund, apply_drift, fail_outside_refund, raise_missing,
};
use cobro_settle::{Fit, fit};
use cobro_store::books::{BooksCounts, NewBooksRun, NewOrphan};
use cobro_store::{AttemptRow, DbId, PaymentRow, RefundRow, Store, StoreError};
use serde::Serialize;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

/// What the books know of one provider.
#[derive(Clone, Debug)]
pub struct BooksConfig {
    /// The provider's name (the providers file's), as attempts record it.
    pub provider: String,
    /// Whether it is the default provider (attempts that name none are its).
    pub is_default: bool,
    /// The clock difference allowed between hosts and the provider.
    pub clock_skew: Duration,
    /// How long a send may still reach the provider.
    pub request_timeout: Duration,
    /// How far before its checkpoint a scheduled run starts reading again:
    /// objects the provider dated before the last window's end but listed
    /// only later (its clock behind cobro's, a request still executing).
    pub overlap: Duration,
    /// A scheduled window ends this long before now, so an object being
    /// created is listed by the next run, never half-seen.
    pub settle_delay: Duration,
    /// How far back the first scheduled run (no checkpoint yet) reads.
    pub first_window: Duration,
    /// `books:<pid>` or `operator:<name>`.
    pub actor: String,
}

/// The one class each object and each attempt of a window ends in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// The provider's object and cobro's attempt agree (or an orphan an
    /// operator acknowledged).
    Matched,
    /// cobro's metadata, but no attempt of cobro's it fits.
    Orphan,
    /// No cobro metadata: made in the provider's dashboard or by another
    /// system. Reported, never acted on.
    Foreign,
    /// cobro's object, but its status or amounts differ from cobro's record.
    Drifted,
    /// A success cobro holds that the provider's ledger does not have.
    Missing,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Matched => "matched",
            Class::Orphan => "orphan",
            Class::Foreign => "foreign",
            Class::Drifted => "drifted",
            Class::Missing => "missing",
        }
    }
}

/// One object or attempt that did not simply match (matched ones are only
/// counted, so the report stays the size of what needs reading).
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub class: Class,
    /// `charge`, `refund`, or `attempt` (a missing one).
    pub kind: &'static str,
    /// The provider's id of the object (or what the attempt recorded).
    pub object: Option<String>,
    pub account: Option<String>,
    pub payment: Option<String>,
    pub attempt: Option<String>,
    pub amount: Option<i64>,
    pub currency: Option<String>,
    pub status: Option<String>,
    /// What differs, in a sentence.
    pub detail: String,
    /// What the run did about it (`recorded`, `applied: provider_voided`,
    /// `conflict`, `none (dry run)`...).
    pub action: String,
}

/// What one run saw and did.
#[derive(Clone, Debug, Serialize)]
pub struct BooksReport {
    /// `None` for a dry run (which writes nothing, not even its run).
    pub run_id: Option<String>,
    pub provider: String,
    pub trigger: String,
    pub dry_run: bool,
    /// The provider's creation times listed, unix seconds, both included.
    pub window: (i64, i64),
    pub counts: Counts,
    /// Attempts whose whole send window lies inside the listed window:
    /// only those can be `missing` (their first send, from and to).
    pub missing_checked: (String, String),
    pub findings: Vec<Finding>,
}

/// The counts of a run, by class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub objects: u64,
    pub matched: u64,
    pub orphan: u64,
    pub foreign: u64,
    pub drifted: u64,
    pub missing: u64,
}

impl Counts {
    fn add(&mut self, class: Class) {
        match class {
            Class::Matched => self.matched += 1,
            Class::Orphan => self.orphan += 1,
            Class::Foreign => self.foreign += 1,
            Class::Drifted => self.drifted += 1,
            Class::Missing => self.missing += 1,
        }
    }

    /// What needs a person: orphans, drift and missing (foreign objects
    /// are reported, not acted on).
    pub fn unmatched(&self) -> u64 {
        self.orphan + self.drifted + self.missing
    }

    fn stored(&self) -> BooksCounts {
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        BooksCounts {
            objects: n(self.objects),
            matched: n(self.matched),
            orphans: n(self.orphan),
            foreign: n(self.foreign),
            drifted: n(self.drifted),
            missing: n(self.missing),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BooksError {
    /// A page of the ledger could not be read (after its rereads): the run
    /// proves nothing and moves no checkpoint.
    #[error("the provider's ledger could not be listed: {0}")]
    List(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the window is empty or inverted: {0} to {1}")]
    Window(i64, i64),
}

/// Attempts read per page on the attempts side.
const ATTEMPT_PAGE: u32 = 500;

/// A books runner for one provider.
pub struct Books<P: Provider> {
    store: Store,
    provider: Arc<P>,
    clock: Arc<dyn Clock>,
    config: BooksConfig,
}

impl<P: Provider> Books<P> {
    pub fn new(store: Store, provider: Arc<P>, clock: Arc<dyn Clock>, config: BooksConfig) -> Self {
        Self {
            store,
            provider,
            clock,
            config,
        }
    }

    /// The scheduled run: from the checkpoint minus the overlap (or the
    /// first window back from now) to now minus the settle delay; the
    /// checkpoint moves to the window's end once the run finished.
    pub async fn run_due(&self, trigger: &str) -> Result<Option<BooksReport>, BooksError> {
        let now = self.clock.now().timestamp();
        let to = now - secs(self.config.settle_delay);
        let from = match self.store.books_checkpoint(&self.config.provider).await? {
            Some(listed_to) => listed_to - secs(self.config.overlap),
            None => to - secs(self.config.first_window),
        };
        if from >= to {
            return Ok(None);
        }
        let report = self.run((from, to), false, trigger).await?;
        self.store
            .advance_books_checkpoint(&self.config.provider, to, self.clock.now())
            .await?;
        Ok(Some(report))
    }

    /// Lists every object created in `window` (unix seconds, both
    /// included), classes it and each successful attempt of the window,
    /// and (unless `dry_run`) applies what each class does and writes the
    /// run with its counts and report.
    pub async fn run(
        &self,
        window: (i64, i64),
        dry_run: bool,
        trigger: &str,
    ) -> Result<BooksReport, BooksError> {
        let (from, to) = window;
        if from > to {
            return Err(BooksError::Window(from, to));
        }
        let provider = self.config.provider.clone();
        let run_id = if dry_run {
            None
        } else {
            let run = NewBooksRun {
                provider: &provider,
                trigger,
                actor: &self.config.actor,
                dry_run,
                window,
            };
            Some(self.store.start_books_run(&run, self.clock.now()).await?)
        };
        let mut pass = Pass {
            books: self,
            run: run_id,
            dry_run,
            counts: Counts::default(),
            findings: Vec::new(),
            // A real run writes what it listed to the database, a page at
            // a time; a dry run writes nothing, so it holds the ids.
            seen: match run_id {
                Some(run) => Seen::Listed(run),
                None => Seen::Memory(HashSet::new()),
            },
        };
        let outcome = pass.list_and_class(window).await;
        let (inner_from, inner_to) = self.inner_window(window);
        let outcome = match outcome {
            Ok(()) => pass.missing(inner_from, inner_to).await,
            Err(e) => Err(e),
        };
        let report = BooksReport {
            run_id: run_id.map(|id| id.0.to_string()),
            provider: provider.clone(),
            trigger: trigger.to_owned(),
            dry_run,
            window,
            counts: pass.counts,
            missing_checked: (inner_from.to_rfc3339(), inner_to.to_rfc3339()),
            findings: std::mem::take(&mut pass.findings),
        };
        let error = outcome.as_ref().err().map(ToString::to_string);
        if let Some(id) = run_id {
            // A week: far longer than any run lasts, so a live run never
            // loses what it listed.
            let stale = self.clock.now() - chrono::Duration::days(7);
            if let Err(e) = self.store.books_forget_listed(id, stale).await {
                tracing::warn!(error = %e, "books: what the run listed could not be forgotten; the next run does it");
            }
            let json = serde_json::to_string(&report).unwrap_or_else(|_| "{}".into());
            self.store
                .finish_books_run(
                    id,
                    &report.counts.stored(),
                    &json,
                    error.as_deref(),
                    self.clock.now(),
                )
                .await?;
        }
        for class in [
            Class::Matched,
            Class::Orphan,
            Class::Foreign,
            Class::Drifted,
            Class::Missing,
        ] {
            let n = match class {
                Class::Matched => report.counts.matched,
                Class::Orphan => report.counts.orphan,
                Class::Foreign => report.counts.foreign,
                Class::Drifted => report.counts.drifted,
                Class::Missing => report.counts.missing,
            };
            cobro_telemetry::metrics::books_classed(&provider, class.as_str(), n);
        }
        match outcome {
            Ok(()) => {
                cobro_telemetry::metrics::books_run(
                    &provider,
                    "finished",
                    Some(report.counts.unmatched()),
                );
                tracing::info!(
                    provider,
                    from,
                    to,
                    objects = report.counts.objects,
                    unmatched = report.counts.unmatched(),
                    dry_run,
                    "books run finished"
                );
                Ok(report)
            }
            Err(e) => {
                cobro_telemetry::metrics::books_run(&provider, "failed", None);
                Err(e)
            }
        }
    }

    /// The first sends whose attempts can be called missing: those whose
    /// whole send window (first send minus the skew to last send plus the
    /// request timeout plus the skew) lies inside the listed window. The
    /// last-send bound is checked per attempt.
    fn inner_window(&self, (from, to): (i64, i64)) -> (DateTime<Utc>, DateTime<Utc>) {
        let skew = secs(self.config.clock_skew);
        (at(from + skew + 1), at(to - secs(self.send_reach())))
    }

    /// How long after an attempt's last recorded send its object may still
    /// be created at the provider: a send is at most two requests (a Stripe
    /// refund reads its PaymentIntent before it posts), each bounded by the
    /// request timeout, plus the clock skew between the hosts.
    fn send_reach(&self) -> Duration {
        2 * self.config.request_timeout + self.config.clock_skew
    }
}

/// One run's state: counts, findings, and the provider ids listed.
struct Pass<'b, P: Provider> {
    books: &'b Books<P>,
    run: Option<DbId>,
    dry_run: bool,
    counts: Counts,
    findings: Vec<Finding>,
    seen: Seen,
}

/// What a run listed: the provider ids its window holds, which "missing"
/// needs. In the database (`books_listed`) for a real run, so its memory
/// stays one page whatever the window; in memory for a dry run, which
/// writes nothing.
enum Seen {
    Listed(DbId),
    Memory(HashSet<String>),
}

impl<P: Provider> Pass<'_, P> {
    async fn list_and_class(&mut self, (from, to): (i64, i64)) -> Result<(), BooksError> {
        let window = Window { from, to: Some(to) };
        for kind in [LedgerKind::Charges, LedgerKind::Refunds] {
            let mut after: Option<String> = None;
            loop {
                let page = self
                    .books
                    .provider
                    .ledger_page(kind, window, after.as_deref())
                    .await
                    .map_err(|e| BooksError::List(e.0))?;
                // A page boundary that moved under a concurrent create may
                // show an object twice: it is classed once.
                let new: HashSet<String> = match &mut self.seen {
                    Seen::Listed(run) => {
                        let ids: Vec<&str> = page.objects.iter().map(|o| o.id.as_str()).collect();
                        let store = &self.books.store;
                        store.books_listed(*run, &ids).await?.into_iter().collect()
                    }
                    Seen::Memory(seen) => page
                        .objects
                        .iter()
                        .filter(|o| seen.insert(o.id.clone()))
                        .map(|o| o.id.clone())
                        .collect(),
                };
                for object in &page.objects {
                    if !new.contains(&object.id) {
                        continue;
                    }
                    self.counts.objects += 1;
                    let (class, finding) = self.class(kind, object).await?;
                    self.counts.add(class);
                    if let Some(finding) = finding {
                        self.findings.push(finding);
                    }
                }
                match page.next {
                    Some(next) => after = Some(next),
                    None => break,
                }
            }
        }
        Ok(())
    }

    /// The class of one listed object, and what was done about it.
    async fn class(
        &self,
        kind: LedgerKind,
        object: &ProviderObject,
    ) -> Result<(Class, Option<Finding>), BooksError> {
        let store = &self.books.store;
        let finding = |class: Class, detail: String, action: String| Finding {
            class,
            kind: kind.as_str(),
            object: Some(object.id.clone()),
            account: object.metadata.get(metadata::ACCOUNT).cloned(),
            payment: object.metadata.get(metadata::PAYMENT).cloned(),
            attempt: object.metadata.get(metadata::ATTEMPT).cloned(),
            amount: object.amount,
            currency: object.currency.clone(),
            status: Some(object.status.to_string()),
            detail,
            action,
        };
        let Some(attempt_meta) = object.metadata.get(metadata::ATTEMPT) else {
            if !carries_cobro_metadata(object) {
                return self.without_metadata(kind, object, finding).await;
            }
            return self
                .orphan(
                    kind,
                    object,
                    "cobro metadata without an attempt id",
                    finding,
                )
                .await;
        };
        let attempt = match attempt_meta.parse::<uuid::Uuid>() {
            Ok(id) => store.attempt_any_account(DbId(id)).await?,
            Err(_) => None,
        };
        let Some(attempt) = attempt else {
            return self
                .orphan(kind, object, "no attempt of cobro's has this id", finding)
                .await;
        };
        let Some(payment) = store.payment_any_account(payment_of(&attempt)).await? else {
            return self
                .orphan(kind, object, "the attempt's payment is gone", finding)
                .await;
        };
        let refund = match attempt.refund_id {
            Some(r) => store.refund_any_account(r).await?,
            None => None,
        };
        let operation_fits = match kind {
            LedgerKind::Charges => attempt.operation == cobro_core::Operation::Authorize,
            LedgerKind::Refunds => attempt.operation == cobro_core::Operation::Refund,
        };
        let fitted = if operation_fits {
            fit(
                attempt.operation,
                &attempt,
                &payment,
                refund.as_ref(),
                object,
            )
        } else {
            Fit::NotOurs(format!("the attempt is a {}", attempt.operation.as_str()))
        };
        let why = match fitted {
            Fit::NotOurs(why) => {
                return self.orphan(kind, object, &why, finding).await;
            }
            Fit::Mismatch(why) => why,
            Fit::Ours => match agrees(&attempt, &payment, refund.as_ref(), object) {
                Agreement::Yes => return Ok((Class::Matched, None)),
                Agreement::Unresolved => {
                    let detail = format!(
                        "the attempt is still {}; the reconciler decides it",
                        attempt.state.as_str()
                    );
                    return Ok((
                        Class::Drifted,
                        Some(finding(Class::Drifted, detail, "none".into())),
                    ));
                }
                Agreement::No(why) => why,
            },
        };
        let action = if self.dry_run {
            "none (dry run)".to_owned()
        } else {
            let said = serde_json::to_string(object).unwrap_or_default();
            let attempt_id = attempt.id;
            let actor = &self.books.config.actor;
            let now = self.books.clock.now();
            action(apply_drift(store, attempt_id, object, &why, actor, &said, now).await?)
        };
        Ok((Class::Drifted, Some(finding(Class::Drifted, why, action))))
    }

    /// An object with no cobro metadata: a refund of a charge cobro holds
    /// was made at the provider without cobro (drift, recorded as a refund
    /// once); anything else is foreign.
    async fn without_metadata(
        &self,
        kind: LedgerKind,
        object: &ProviderObject,
        finding: impl Fn(Class, String, String) -> Finding,
    ) -> Result<(Class, Option<Finding>), BooksError> {
        let store = &self.books.store;
        let payment = match (kind, object.charge.as_deref()) {
            (LedgerKind::Refunds, Some(charge)) => {
                store.payment_by_charge_any_account(charge).await?
            }
            _ => None,
        };
        let Some(payment) = payment.filter(|p| self.sent_here(p.provider.as_deref())) else {
            let detail = "no cobro metadata: made outside cobro".to_owned();
            return Ok((
                Class::Foreign,
                Some(finding(Class::Foreign, detail, "none (reported)".into())),
            ));
        };
        if let Some(recorded) = store.refund_by_provider_ref_any_account(&object.id).await? {
            // Recorded by an earlier run: cobro's record agrees, unless the
            // provider failed the refund since (no webhook can say so: it
            // carries no reference of cobro's).
            // Failed only as a refund of this payment's charge: a refund
            // id another provider also used is not this one.
            let failed_since = recorded.payment_id == payment.id
                && recorded.status == RefundStatus::Succeeded
                && matches!(
                    object.status,
                    ProviderStatus::Failed | ProviderStatus::Canceled
                );
            if !failed_since {
                return Ok((Class::Matched, None));
            }
            let detail = format!(
                "refund {} of payment {}, made at the provider outside cobro and recorded \
                 succeeded, is {} there now",
                object.id, payment.id, object.status
            );
            let action = if self.dry_run {
                "none (dry run)".to_owned()
            } else {
                let said = serde_json::to_string(object).unwrap_or_default();
                let (actor, now) = (&self.books.config.actor, self.books.clock.now());
                action(fail_outside_refund(store, &recorded, object, actor, &said, now).await?)
            };
            let mut found = finding(Class::Drifted, detail, action);
            found.payment = Some(payment.id.to_string());
            found.account = Some(payment.account_id.to_string());
            return Ok((Class::Drifted, Some(found)));
        }
        let detail = format!(
            "a refund of payment {}'s charge made at the provider outside cobro",
            payment.id
        );
        let action = if self.dry_run {
            "none (dry run)".to_owned()
        } else {
            let said = serde_json::to_string(object).unwrap_or_default();
            let payment_id = payment.id;
            let (actor, now) = (&self.books.config.actor, self.books.clock.now());
            action(adopt_outside_refund(store, payment_id, object, actor, &said, now).await?)
        };
        let mut found = finding(Class::Drifted, detail, action);
        found.payment = Some(payment.id.to_string());
        found.account = Some(payment.account_id.to_string());
        Ok((Class::Drifted, Some(found)))
    }

    /// An object carrying cobro's metadata that no attempt of cobro's
    /// fits: kept in `books_orphans` (once), unless an operator already
    /// acknowledged it, which makes it matched to that record (one the
    /// operator adopted must fit its adopted attempt instead: here it is
    /// drifted).
    async fn orphan(
        &self,
        kind: LedgerKind,
        object: &ProviderObject,
        why: &str,
        finding: impl Fn(Class, String, String) -> Finding,
    ) -> Result<(Class, Option<Finding>), BooksError> {
        let store = &self.books.store;
        let provider = &self.books.config.provider;
        let kept = store.orphan_of_object(provider, &object.id).await?;
        if let Some(resolved) = kept.as_ref().filter(|o| o.state != "open") {
            // Adopted, yet no attempt of cobro's fits it: the adopted
            // record is wrong (or was changed since), which an operator
            // must see; an acknowledged orphan is matched to its record.
            if let Some(payment) = &resolved.adopted_payment {
                let detail =
                    format!("adopted into payment {payment}, whose record does not fit it: {why}");
                let action = "none: an operator decides".to_owned();
                return Ok((
                    Class::Drifted,
                    Some(finding(Class::Drifted, detail, action)),
                ));
            }
            return Ok((Class::Matched, None));
        }
        let action = match (self.run, &kept) {
            (_, Some(_)) => "already recorded".to_owned(),
            (None, None) => "none (dry run)".to_owned(),
            (Some(run), None) => {
                let said = serde_json::to_string(object).unwrap_or_default();
                let meta = |key: &str| object.metadata.get(key).map(String::as_str);
                let orphan = NewOrphan {
                    provider,
                    object_id: &object.id,
                    kind: kind.as_str(),
                    account_id: meta(metadata::ACCOUNT),
                    payment_id: meta(metadata::PAYMENT),
                    intent: meta(metadata::INTENT),
                    attempt_id: meta(metadata::ATTEMPT),
                    reference: object
                        .reference
                        .as_deref()
                        .or_else(|| meta(metadata::REFERENCE)),
                    charge: object.charge.as_deref(),
                    amount: object.amount,
                    amount_captured: object.amount_captured,
                    currency: object.currency.as_deref(),
                    status: object.status.as_str(),
                    provider_said: &said,
                    run,
                };
                if store.record_orphan(&orphan, self.books.clock.now()).await? {
                    tracing::error!(
                        provider = provider.as_str(),
                        object = object.id.as_str(),
                        kind = kind.as_str(),
                        "books: an object carries cobro's metadata but no attempt of cobro's"
                    );
                    "recorded".to_owned()
                } else {
                    "already recorded".to_owned()
                }
            }
        };
        Ok((
            Class::Orphan,
            Some(finding(Class::Orphan, why.to_owned(), action)),
        ))
    }

    /// Whether the provider holds `object` after all, read by itself: a
    /// request the provider held in its queue and let through later (inside
    /// its key retention, which its contract allows) made the object then,
    /// dated after the listed window, and the attempt adopted it. A charge
    /// is read by its id, a refund in the consistent list of its charge's
    /// refunds (the reconciler's own reads). A read that fails shows
    /// nothing, and the
    /// list's word stands: a critical finding an operator checks is better
    /// than a missing success nobody sees.
    async fn made_later(
        &self,
        attempt: &cobro_store::AttemptRow,
        object: &str,
    ) -> Result<bool, BooksError> {
        let provider = &self.books.provider;
        let found = match attempt.operation {
            cobro_core::Operation::Refund => {
                let payment = self
                    .books
                    .store
                    .payment_any_account(attempt.payment_id)
                    .await?;
                match payment.and_then(|p| p.provider_ref) {
                    Some(charge) => provider
                        .list_refunds(&attempt.reference, &charge)
                        .await
                        .map(|refunds| refunds.into_iter().any(|r| r.id == object)),
                    None => Ok(false),
                }
            }
            _ => provider
                .get_charge(object)
                .await
                .map(|charge| charge.is_some_and(|c| c.id == object)),
        };
        Ok(found.unwrap_or_else(|e| {
            tracing::warn!(object, error = %e, "books: reading a missing object by itself failed");
            false
        }))
    }

    /// Each successful authorisation and refund sent to this provider whose
    /// whole send window lies inside the listed window, and whose object
    /// the listing did not show, is missing (critical: a conflict).
    async fn missing(&mut self, from: DateTime<Utc>, to: DateTime<Utc>) -> Result<(), BooksError> {
        if from >= to {
            return Ok(());
        }
        let config = &self.books.config;
        let store = &self.books.store;
        let reach =
            chrono::Duration::from_std(self.books.send_reach()).unwrap_or(chrono::Duration::MAX);
        let listed_to = to + reach;
        let mut after = None;
        loop {
            let page = store
                .settled_attempts_sent_within(
                    &config.provider,
                    config.is_default,
                    (from, to),
                    after,
                    ATTEMPT_PAGE,
                    match self.seen {
                        Seen::Listed(run) => Some(run),
                        Seen::Memory(_) => None,
                    },
                )
                .await?;
            let Some(last) = page.last() else { break };
            after = last
                .first_send_at
                .map(|t| (t.0, cobro_store::DbId::from(last.id)));
            for attempt in &page {
                let ends_inside = attempt
                    .last_send_at
                    .is_some_and(|last| last.0 + reach <= listed_to);
                let Some(object) = attempt.provider_ref.as_deref() else {
                    continue;
                };
                let listed = match &self.seen {
                    // The query left out what the run listed.
                    Seen::Listed(_) => false,
                    Seen::Memory(seen) => seen.contains(object),
                };
                if !ends_inside || listed || self.made_later(attempt, object).await? {
                    continue;
                }
                self.counts.add(Class::Missing);
                let detail = format!(
                    "cobro recorded {} ({} {}) succeeded, and the provider's ledger does not \
                     have it in a window that covers its sends",
                    object,
                    attempt.operation.as_str(),
                    attempt.reference
                );
                let action = if self.dry_run {
                    "none (dry run)".to_owned()
                } else {
                    let id = attempt.id;
                    let now = self.books.clock.now();
                    action(raise_missing(store, id, &detail, &config.actor, now).await?)
                };
                self.findings.push(Finding {
                    class: Class::Missing,
                    kind: "attempt",
                    object: Some(object.to_owned()),
                    account: None,
                    payment: Some(attempt.payment_id.to_string()),
                    attempt: Some(attempt.id.to_string()),
                    amount: None,
                    currency: None,
                    status: Some(attempt.state.as_str().to_owned()),
                    detail,
                    action,
                });
            }
            if page.len() < ATTEMPT_PAGE as usize {
                break;
            }
        }
        Ok(())
    }

    /// Whether a payment recorded as sent to `sent_to` is this provider's.
    fn sent_here(&self, sent_to: Option<&str>) -> bool {
        match sent_to {
            Some(name) => name == self.books.config.provider,
            None => self.books.config.is_default,
        }
    }
}

/// What the report says a run did about a finding.
fn action(drift: Drift) -> String {
    match drift {
        Drift::Applied(decision) => format!("applied: {}", decision.as_str()),
        Drift::AlreadyRecorded => "already recorded".into(),
        Drift::Conflict(_) => "conflict raised".into(),
        Drift::ConflictKept => "conflict already open".into(),
    }
}

/// Whether the object carries any of cobro's metadata keys.
fn carries_cobro_metadata(object: &ProviderObject) -> bool {
    object.metadata.keys().any(|k| k.starts_with("cobro_"))
}

fn payment_of(attempt: &AttemptRow) -> cobro_core::PaymentId {
    attempt.payment_id
}

/// How cobro's record of an attempt compares with its object.
enum Agreement {
    Yes,
    /// The attempt is not settled: the reconciler decides it, not the books.
    Unresolved,
    No(String),
}

/// Whether cobro's record of `attempt` (its payment, its refund) says what
/// the provider's `object` says: status, charge and captured amount.
fn agrees(
    attempt: &AttemptRow,
    payment: &PaymentRow,
    refund: Option<&RefundRow>,
    object: &ProviderObject,
) -> Agreement {
    use PaymentStatus as P;
    use ProviderStatus as S;
    if attempt.state == AttemptState::AwaitingCustomer {
        // Waiting for its customer (3-D Secure) is a state cobro knows:
        // the provider holds the object unconfirmed, or (after cobro's
        // cancel at the expiry) canceled with nothing taken. Anything else
        // is for the reconciler's read or a webhook to apply.
        let nothing_taken = object.amount_captured.unwrap_or(0) == 0;
        let agrees = match (&object.status, payment.status) {
            (S::RequiresAction, P::RequiresAction | P::Canceling) => true,
            (S::Voided | S::Canceled | S::Declined, P::Canceled | P::Declined | P::Failed) => {
                nothing_taken
            }
            _ => false,
        };
        if agrees {
            return Agreement::Yes;
        }
    }
    if attempt.state.is_unresolved() || attempt.state == AttemptState::Held {
        return Agreement::Unresolved;
    }
    let differs = |what: String| Agreement::No(what);
    if attempt.operation == cobro_core::Operation::Refund {
        let Some(refund) = refund else {
            return differs("the refund attempt has no refund".into());
        };
        return match (&object.status, refund.status, attempt.state) {
            (S::Succeeded, RefundStatus::Succeeded, AttemptState::Succeeded) => Agreement::Yes,
            (S::Failed | S::Canceled, RefundStatus::Failed, _) => Agreement::Yes,
            (status, recorded, _) => differs(format!(
                "the provider's refund is {status}, cobro's {}",
                recorded.as_str()
            )),
        };
    }
    if attempt.state != AttemptState::Succeeded {
        // No money moved, as cobro recorded: a decline, or an object
        // cobro itself cancelled without capturing anything (a Stripe
        // PaymentIntent left for the customer is failed and cancelled).
        let nothing_taken = object.amount_captured.unwrap_or(0) == 0;
        return match object.status {
            // Declined but still open for another confirmation, after its
            // customer was given the client secret: it may still charge.
            S::Declined if object.confirmable && payment.next_action.is_some() => differs(format!(
                "{} is declined but still open for another confirmation, and its client \
                 secret was given out: cancel it at the provider",
                object.id
            )),
            S::Declined => Agreement::Yes,
            S::Voided | S::Canceled if attempt.state.recorded_no_money() && nothing_taken => {
                Agreement::Yes
            }
            ref status => differs(format!(
                "the provider's charge is {status}, cobro recorded the attempt {}",
                attempt.state.as_str()
            )),
        };
    }
    if payment.provider_ref.as_deref() != Some(object.id.as_str()) {
        return differs(format!(
            "the payment adopted {:?}, not {}",
            payment.provider_ref, object.id
        ));
    }
    let status_agrees = match object.status {
        S::Captured => matches!(
            payment.status,
            P::Captured | P::PartiallyRefunded | P::Refunded
        ),
        S::Authorized => matches!(payment.status, P::Authorized | P::Capturing | P::Canceling),
        S::Voided => matches!(payment.status, P::Canceled | P::Canceling),
        _ => false,
    };
    if !status_agrees {
        return differs(format!(
            "the provider's charge is {}, the payment {}",
            object.status,
            payment.status.as_str()
        ));
    }
    match object.amount_captured {
        Some(captured) if object.status == S::Captured && captured != payment.amount_captured => {
            differs(format!(
                "the provider captured {captured}, cobro recorded {}",
                payment.amount_captured
            ))
        }
        _ => Agreement::Yes,
    }
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

fn at(seconds: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(seconds, 0)
        .single()
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}
