//! The process's metrics, recorded with the `metrics` crate and rendered for
//! Prometheus by `GET /metrics`. Names follow Prometheus conventions (base
//! units, `_total` counters, `_seconds` durations); every label has a small,
//! fixed set of values (route templates, never raw paths; outcome classes,
//! never messages) and nothing secret is ever a label.
//!
//! These are per process (counters start at zero when it starts). What the
//! database knows (unsettled payments, the outbox, unknown attempts, open
//! conflicts) is read at scrape time by the API, not here.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use std::time::Duration;

pub const HTTP_REQUESTS: &str = "cobro_http_requests_total";
pub const HTTP_DURATION: &str = "cobro_http_request_duration_seconds";
pub const PROVIDER_CALLS: &str = "cobro_provider_calls_total";
pub const PROVIDER_DURATION: &str = "cobro_provider_call_duration_seconds";
pub const LEASES_LOST: &str = "cobro_worker_leases_lost_total";
pub const RETRIES: &str = "cobro_worker_retries_total";
pub const RETRY_BUDGET_EXHAUSTED: &str = "cobro_worker_retry_budget_exhausted_total";
pub const HANDED_OVER: &str = "cobro_worker_handed_to_reconciler_total";
pub const RECONCILE_VERDICTS: &str = "cobro_reconcile_verdicts_total";
pub const KEY_REUSED: &str = "cobro_idempotency_key_reused_total";
pub const IN_PROGRESS: &str = "cobro_idempotency_in_progress_total";
pub const REDUNDANT_EFFECTS: &str = "cobro_redundant_effects_total";
pub const EVIDENCE_CONFLICTS: &str = "cobro_evidence_conflicts_total";
pub const WEBHOOK_EVENTS: &str = "cobro_webhook_events_total";
pub const HTTP_CONNECTIONS_CLOSED: &str = "cobro_http_connections_closed_total";
pub const CLOCK_GAP: &str = "cobro_clock_gap_seconds";
pub const TRACE_PARENTS_LOST: &str = "cobro_trace_parents_lost_total";
pub const SPANS_ENDED: &str = "cobro_trace_spans_ended_total";
pub const SPANS_EXPORTED: &str = "cobro_trace_spans_exported_total";
pub const BOOKS_OBJECTS: &str = "cobro_books_objects_total";
pub const BOOKS_RUNS: &str = "cobro_books_runs_total";
pub const BOOKS_UNMATCHED: &str = "cobro_books_last_run_unmatched";
pub const CIRCUIT_STATE: &str = "cobro_provider_circuit_state";
pub const ROUTING_FAILOVERS: &str = "cobro_routing_failovers_total";
pub const ROUTING_DECISIONS: &str = "cobro_routing_decisions_total";

/// Every metric this module records (a counter appears on `/metrics` only
/// once it was first incremented).
pub const ALL: [&str; 25] = [
    HTTP_REQUESTS,
    HTTP_DURATION,
    PROVIDER_CALLS,
    PROVIDER_DURATION,
    LEASES_LOST,
    RETRIES,
    RETRY_BUDGET_EXHAUSTED,
    HANDED_OVER,
    RECONCILE_VERDICTS,
    KEY_REUSED,
    IN_PROGRESS,
    REDUNDANT_EFFECTS,
    EVIDENCE_CONFLICTS,
    WEBHOOK_EVENTS,
    HTTP_CONNECTIONS_CLOSED,
    CLOCK_GAP,
    TRACE_PARENTS_LOST,
    SPANS_ENDED,
    SPANS_EXPORTED,
    BOOKS_OBJECTS,
    BOOKS_RUNS,
    BOOKS_UNMATCHED,
    CIRCUIT_STATE,
    ROUTING_FAILOVERS,
    ROUTING_DECISIONS,
];

/// Latency buckets (seconds) for requests and provider calls: a provider's
/// 10 s timeout must land in a bucket of its own.
const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the Prometheus recorder for this process (once; later calls do
/// nothing). Until it is installed every recording below is a no-op.
pub fn install() -> Result<(), String> {
    if HANDLE.get().is_some() {
        return Ok(());
    }
    let builder = [HTTP_DURATION, PROVIDER_DURATION]
        .into_iter()
        .try_fold(PrometheusBuilder::new(), |b, name| {
            b.set_buckets_for_metric(Matcher::Full(name.to_owned()), &LATENCY_BUCKETS)
        })
        .map_err(|e| e.to_string())?;
    let handle = builder.install_recorder().map_err(|e| e.to_string())?;
    describe();
    let _ = HANDLE.set(handle);
    Ok(())
}

/// The process's metrics in the Prometheus text format (empty when the
/// recorder is not installed, as in tests that build the router alone).
pub fn render() -> String {
    match HANDLE.get() {
        Some(handle) => {
            handle.run_upkeep();
            handle.render()
        }
        None => String::new(),
    }
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        HTTP_REQUESTS,
        "HTTP requests answered, by route template, method and status."
    );
    describe_histogram!(
        HTTP_DURATION,
        Unit::Seconds,
        "HTTP request latency, by route template and method."
    );
    describe_counter!(
        PROVIDER_CALLS,
        "Provider calls, by provider, operation and outcome class (succeeded, declined, failed, not_sent, unknown; queries: found, not_found, error)."
    );
    describe_histogram!(
        PROVIDER_DURATION,
        Unit::Seconds,
        "Provider call latency, by provider and operation."
    );
    describe_counter!(
        LEASES_LOST,
        "Outbox rows whose lease this worker lost before recording (another owner took over)."
    );
    describe_counter!(
        RETRIES,
        "Sends of an attempt after its first (same provider key), by operation."
    );
    describe_counter!(
        RETRY_BUDGET_EXHAUSTED,
        "Retries deferred because the retry budget was spent."
    );
    describe_counter!(
        HANDED_OVER,
        "Attempts the worker handed to the reconciler (key window closing, or never provably settled)."
    );
    describe_counter!(
        RECONCILE_VERDICTS,
        "Reconciler verdicts on examined attempts, by verdict."
    );
    describe_counter!(
        KEY_REUSED,
        "Requests refused with 422 idempotency-key-reused (same key, different request)."
    );
    describe_counter!(
        IN_PROGRESS,
        "Requests answered 409 in progress (same key still executing)."
    );
    describe_counter!(
        REDUNDANT_EFFECTS,
        "Proofs of an outcome already recorded (a webhook or answer that proved nothing new), by source."
    );
    describe_counter!(
        EVIDENCE_CONFLICTS,
        "Evidence kept as a conflict instead of adopted, by kind and source."
    );
    describe_counter!(
        WEBHOOK_EVENTS,
        "Webhook events received, by provider and outcome."
    );
    describe_gauge!(
        CLOCK_GAP,
        Unit::Seconds,
        "This host's clock less the database's, as the reconciler last measured it; past half the clock skew allowance it proves no absence."
    );
    describe_counter!(
        TRACE_PARENTS_LOST,
        "Spans that did not take their remote parent (a client's traceparent: site http; an outbox row's stored context: site outbox), by reason (not_recorded, already_started, span_disabled); each started a trace of its own."
    );
    describe_counter!(
        SPANS_ENDED,
        "Spans handed to the batch span processor (only when traces are exported)."
    );
    describe_counter!(
        SPANS_EXPORTED,
        "Spans the OTLP exporter sent, by result (ok, failed: lost). Ended less exported is the spans queued plus those dropped by a full queue (OTEL_BSP_MAX_QUEUE_SIZE)."
    );
    describe_counter!(
        BOOKS_OBJECTS,
        "Provider objects and cobro attempts a books run classed, by provider and class (matched, orphan, foreign, drifted, missing)."
    );
    describe_counter!(
        BOOKS_RUNS,
        "Books runs, by provider and result (finished; failed: a list that failed proves nothing)."
    );
    describe_gauge!(
        CIRCUIT_STATE,
        "Each provider's circuit as this process last read it: 0 closed, 1 half-open (its cool-down passed: routed to again, the next call decides), 2 open (routing skips it)."
    );
    describe_counter!(
        ROUTING_FAILOVERS,
        "Payments moved to the next provider of their route, by provider left, provider taken and proof (soft_decline, not_sent, circuit_open, no_effect)."
    );
    describe_counter!(
        ROUTING_DECISIONS,
        "New payments routed, by the provider of their first attempt."
    );
    describe_gauge!(
        BOOKS_UNMATCHED,
        "Objects and attempts the last finished books run of this process left unmatched (orphans, drifted, missing), by provider."
    );
}

/// What a proof's or a conflict's source is, without its instance
/// (`reconciler:4242` is `reconciler`): labels stay a fixed set.
pub fn source_label(name: &str) -> &'static str {
    match name.split(':').next().unwrap_or_default() {
        "worker" => "worker",
        "reconciler" => "reconciler",
        "books" => "books",
        "webhook" => "webhook",
        "operator" => "operator",
        _ => "other",
    }
}

pub fn http_request(route: &str, method: &str, status: u16, elapsed: Duration) {
    metrics::counter!(HTTP_REQUESTS, "route" => route.to_owned(), "method" => method.to_owned(), "status" => status.to_string()).increment(1);
    metrics::histogram!(HTTP_DURATION, "route" => route.to_owned(), "method" => method.to_owned())
        .record(elapsed.as_secs_f64());
}

pub fn provider_call(
    provider: &str,
    operation: &'static str,
    outcome: &'static str,
    elapsed: Duration,
) {
    metrics::counter!(PROVIDER_CALLS, "provider" => provider.to_owned(), "operation" => operation, "outcome" => outcome).increment(1);
    metrics::histogram!(PROVIDER_DURATION, "provider" => provider.to_owned(), "operation" => operation).record(elapsed.as_secs_f64());
}

/// This host's clock less the database's, as the reconciler last measured
/// it (seconds; alert CobroClockOffDatabase).
pub fn clock_gap(seconds: f64) {
    metrics::gauge!(CLOCK_GAP).set(seconds);
}

pub fn lease_lost() {
    metrics::counter!(LEASES_LOST).increment(1);
}

pub fn retry(operation: &str) {
    metrics::counter!(RETRIES, "operation" => operation.to_owned()).increment(1);
}

pub fn retry_budget_exhausted() {
    metrics::counter!(RETRY_BUDGET_EXHAUSTED).increment(1);
}

pub fn handed_over() {
    metrics::counter!(HANDED_OVER).increment(1);
}

pub fn reconcile_verdict(verdict: &'static str) {
    metrics::counter!(RECONCILE_VERDICTS, "verdict" => verdict).increment(1);
}

pub fn key_reused() {
    metrics::counter!(KEY_REUSED).increment(1);
}

pub fn in_progress() {
    metrics::counter!(IN_PROGRESS).increment(1);
}

pub fn redundant_effect(source: &str) {
    metrics::counter!(REDUNDANT_EFFECTS, "source" => source_label(source)).increment(1);
}

pub fn evidence_conflict(kind: &'static str, source: &str) {
    metrics::counter!(EVIDENCE_CONFLICTS, "kind" => kind, "source" => source_label(source))
        .increment(1);
}

pub fn webhook_event(provider: &str, outcome: &'static str) {
    metrics::counter!(WEBHOOK_EVENTS, "provider" => provider.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// Objects and attempts a books run classed (`class`: matched, orphan,
/// foreign, drifted, missing), per provider (docs/books.md).
pub fn books_classed(provider: &str, class: &'static str, count: u64) {
    metrics::counter!(BOOKS_OBJECTS, "provider" => provider.to_owned(), "class" => class)
        .increment(count);
}

/// A books run ended (`result`: `finished` or `failed`); when it finished,
/// how many objects and attempts it left unmatched (everything but
/// matched and foreign), which the alert CobroBooksUnmatched reads.
pub fn books_run(provider: &str, result: &'static str, unmatched: Option<u64>) {
    metrics::counter!(BOOKS_RUNS, "provider" => provider.to_owned(), "result" => result)
        .increment(1);
    if let Some(unmatched) = unmatched {
        metrics::gauge!(BOOKS_UNMATCHED, "provider" => provider.to_owned()).set(unmatched as f64);
    }
}

/// A remote parent that a span did not take
/// (`cobro_telemetry::attach_parent`).
pub fn trace_parent_lost(site: &'static str, reason: &'static str) {
    metrics::counter!(TRACE_PARENTS_LOST, "site" => site, "reason" => reason).increment(1);
}

/// A span handed to the batch span processor.
pub fn span_ended() {
    metrics::counter!(SPANS_ENDED).increment(1);
}

/// `count` spans the exporter sent (`ok`) or failed to send (`failed`).
pub fn spans_exported(result: &'static str, count: u64) {
    metrics::counter!(SPANS_EXPORTED, "result" => result).increment(count);
}

/// A connection the server closed on its own: `refused` (over the
/// connection cap), `idle_timeout`, `header_timeout` or `shutdown`.
pub fn connection_closed(reason: &'static str) {
    metrics::counter!(HTTP_CONNECTIONS_CLOSED, "reason" => reason).increment(1);
}

/// A provider's circuit as read (`state`: 0 closed, 1 half-open, 2 open;
/// alert CobroProviderCircuitOpen).
pub fn circuit_state(provider: &str, state: u8) {
    metrics::gauge!(CIRCUIT_STATE, "provider" => provider.to_owned()).set(f64::from(state));
}

/// A payment moved from `from` to `to` on `proof` (docs/routing.md).
pub fn routing_failover(from: &str, to: &str, proof: &'static str) {
    metrics::counter!(ROUTING_FAILOVERS, "from" => from.to_owned(), "to" => to.to_owned(), "proof" => proof)
        .increment(1);
}

/// A new payment routed to `provider`.
pub fn routing_decision(provider: &str) {
    metrics::counter!(ROUTING_DECISIONS, "provider" => provider.to_owned()).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_lose_their_instance() {
        assert_eq!(source_label("reconciler:4242"), "reconciler");
        assert_eq!(source_label("webhook:fake"), "webhook");
        assert_eq!(source_label("operator:ana"), "operator");
        assert_eq!(source_label("worker"), "worker");
        assert_eq!(source_label("???"), "other");
    }
}
