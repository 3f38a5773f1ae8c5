//! `POST /v1/webhooks/{provider}`: provider events, verified, deduplicated
//! and applied at most once, never moving a payment backwards
//! (provider-and-recovery.md section 4).
//!
//! Layout:
//! - [`routes`]: the route and its own body limit (64 KiB; the rest of the
//!   API keeps 16 KiB).
//! - `verify`: the `Fake-Signature` check (HMAC-SHA256 over `"<t>.<raw
//!   body>"`, constant-time compare, timestamp within the tolerance of the
//!   injected clock). Nothing is stored for a request that fails it.
//! - `parse`: the event's fields; a malformed event is a 400 and is not
//!   stored either.
//! - `receive` / `process`: one transaction per delivery. The event id is
//!   inserted first under its unique key (a redelivery finds it and changes
//!   nothing), the event is matched to the one attempt its reference names
//!   and must `cobro_worker::fit` it (identity, amount, currency, capture
//!   mode); what it proves goes through `cobro_worker::apply_proof` (the one
//!   code path the worker and the reconciler use too) with an audit row, and
//!   the outcome is stored with the event. What fits nothing, or
//!   contradicts the record, is kept as a conflict. The 200 is sent only after the commit, so a
//!   lost acknowledgement costs a harmless redelivery.
//!
//! Ordering: `sequence` is the provider's per-charge counter. A charge event
//! is applied only when it is newer than `payments.provider_sequence`, which
//! it then raises (compare-and-set); an older one is stored as
//! `ignored_stale`. Refund events are not gated by it: a refund only ever
//! adds to what is refunded, and the refund attempt's own state is the gate.

use crate::AppState;
use crate::error::{ApiError, FieldError};
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use chrono::{DateTime, Utc};
use cobro_core::{AttemptId, AttemptState, Operation, PaymentId, RefundId};
use cobro_provider::ProviderObject;
use cobro_store::audit::NewDecision;
use cobro_store::conflicts::ConflictKind;
use cobro_store::webhooks::{NewWebhookEvent, WebhookOutcome};
use cobro_store::{AttemptRow, PaymentRow, StoreError, WriteTx};
use cobro_worker::evidence::proof_from;
use cobro_worker::{Applied, Fit, Source, apply_proof, fit, stop_the_line};
use serde_json::{Map, Value, json};
use std::fmt;
use std::time::Duration;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The largest webhook body accepted: provider events carry a whole charge
/// or refund, so more room than a merchant request.
pub const WEBHOOK_BODY_LIMIT: usize = 64 * 1024;

/// `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>`.
pub const SIGNATURE_HEADER: &str = "fake-signature";

/// Deliveries with a failed signature answered 400 (and logged) per
/// provider, per process: 5 per second, bursts of 20. Past it they are
/// answered 429 `rate-limited` and not logged (the
/// `cobro_webhook_events_total{outcome="signature_invalid"|"signature_rate_limited"}`
/// counters still count every one). A validly signed delivery never
/// consults it, so a flood of forgeries does not delay the provider's.
pub const REFUSED_SIGNATURE_BUDGET: crate::rate_limit::RateLimit = crate::rate_limit::RateLimit {
    per_second: 5,
    burst: 20,
};

/// How often a delivery is re-run after losing a race with a newer event
/// for the same charge; each re-run starts from scratch and finds the event
/// stale, so one is enough in practice.
const RACE_RETRIES: usize = 3;

/// A provider's webhook signing secret. Its `Debug` never shows the value,
/// so settings can be logged.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(String);

impl WebhookSecret {
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into())
    }

    /// The secret itself, to hand to whoever signs (the embedded fake
    /// provider); never for logs.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WebhookSecret(***)")
    }
}

pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(receive))
        // Inner to the router-wide 16 KiB limit, so it wins for this route.
        .layer(DefaultBodyLimit::max(WEBHOOK_BODY_LIMIT))
}

crate::openapi::refusals!(
    /// What `receive` refuses: no token, no key; the signature and the body.
    WebhookRefusals = [
        NotFound,
        BodyTooLarge,
        WebhookSignatureInvalid,
        Validation,
        RateLimited,
        RequestTimeout,
        Unavailable,
        Internal,
    ]
);

/// Receive a provider event
///
/// For the payment provider, not for merchants: no bearer token and no
/// `Idempotency-Key`; the `Fake-Signature` header authenticates the
/// request (`t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw
/// body>")>`, compared in constant time; a timestamp more than the
/// tolerance, 300 s by default, from the server's clock is refused).
/// The event id is the deduplication key: the event, its effect and its
/// outcome commit in one transaction and only then is 200 answered; a
/// redelivery answers 200 `duplicate_delivery` and changes nothing. A
/// charge event older than what is recorded for its charge (by
/// `sequence`) is stored as `ignored_stale` and never moves a payment
/// backwards.
#[utoipa::path(
    post,
    path = "/v1/webhooks/{provider}",
    operation_id = "receiveWebhook",
    tag = "webhooks",
    params(
        ("provider" = String, Path, description = "The provider's name as configured (`fake`); any other answers 404."),
        ("Fake-Signature" = String, Header, description = "`t=<unix seconds>,v1=<hex HMAC-SHA256(secret, \"<t>.<raw body>\")>`; several `v1` values may be sent."),
    ),
    request_body(content = crate::openapi::schemas::WebhookEvent, content_type = "application/json",
        description = "At most 64 KiB, signed as received (the raw bytes)."),
    responses(
        (status = 200, description = "Stored (and applied where it proves something new), or a redelivery of an event already stored.",
            body = crate::openapi::schemas::WebhookReceipt),
        WebhookRefusals,
    ),
)]
async fn receive(
    State(state): State<AppState>,
    Path(provider): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    // Unknown provider first: nothing about the request matters then.
    let secret = state
        .settings
        .webhook_secrets
        .get(&provider)
        .ok_or(ApiError::NotFound)?;
    let mut secrets = vec![secret];
    secrets.extend(state.settings.webhook_previous_secrets.get(&provider));
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::BodyTooLarge {
                limit: WEBHOOK_BODY_LIMIT,
            }
        } else {
            ApiError::Validation(vec![FieldError::new("body", "the body could not be read")])
        }
    })?;
    let now = state.clock.now();
    if let Err(reason) = verify(
        &headers,
        &body,
        &secrets,
        now,
        state.settings.webhook_tolerance,
    ) {
        if !state.webhook_refusals.allow(provider.clone()) {
            cobro_telemetry::metrics::webhook_event(&provider, "signature_rate_limited");
            return Err(ApiError::RateLimited);
        }
        cobro_telemetry::metrics::webhook_event(&provider, "signature_invalid");
        // The header and the secret are never logged.
        tracing::warn!(%provider, reason, "webhook signature refused");
        return Err(ApiError::WebhookSignatureInvalid);
    }
    let (event, payload) = parse(&body)?;
    let span = tracing::info_span!(
        "webhook.receive",
        provider = %provider,
        event_id = %event.id,
        event_type = %event.kind,
        payment_id = tracing::field::Empty,
        attempt_id = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let outcome = tracing::Instrument::instrument(
        deliver(&state, &provider, &event, payload, now),
        span.clone(),
    )
    .await?;
    span.record("outcome", outcome);
    cobro_telemetry::metrics::webhook_event(&provider, outcome);
    tracing::info!(parent: &span, outcome, "webhook event received");
    Ok((
        StatusCode::OK,
        Json(json!({"event_id": event.id, "outcome": outcome})),
    ))
}

/// Checks the signature header against `secrets` (any one that verifies
/// is enough); `Err`: why not, for the log line.
fn verify(
    headers: &HeaderMap,
    body: &[u8],
    secrets: &[&WebhookSecret],
    now: DateTime<Utc>,
    tolerance: Duration,
) -> Result<(), &'static str> {
    let mut values = headers.get_all(SIGNATURE_HEADER).iter();
    let header = match (values.next(), values.next()) {
        (Some(one), None) => one.to_str().map_err(|_| "header not ASCII")?,
        (None, _) => return Err("header missing"),
        _ => return Err("more than one header"),
    };
    // Several v1 values are allowed (a provider rotating its secret signs
    // with both); any one that verifies is enough, in constant time.
    cobro_core::signature::verify(
        header,
        body,
        &secrets.iter().map(|s| s.expose()).collect::<Vec<_>>(),
        now.timestamp(),
        tolerance.as_secs(),
    )
    .map_err(|e| e.reason())
}

/// What an event says happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Authorized,
    Captured,
    Declined,
    Voided,
    RefundSucceeded,
    /// A type cobro does not act on; stored as `unmatched`.
    Other,
}

impl Kind {
    fn parse(raw: &str) -> Self {
        match raw {
            "charge.authorized" => Kind::Authorized,
            "charge.captured" => Kind::Captured,
            "charge.declined" => Kind::Declined,
            "charge.voided" => Kind::Voided,
            "refund.succeeded" => Kind::RefundSucceeded,
            _ => Kind::Other,
        }
    }

    fn is_charge(self) -> bool {
        !matches!(self, Kind::RefundSucceeded | Kind::Other)
    }
}

/// The fields of an event cobro uses; the rest is kept in the raw payload.
#[derive(Clone, Debug)]
struct Event {
    id: String,
    kind: String,
    sequence: i64,
    /// `data.reference`: the intent name cobro sent.
    reference: String,
    /// The charge or refund the event carries, as the provider reports it.
    object: ProviderObject,
}

impl Event {
    fn kind(&self) -> Kind {
        Kind::parse(&self.kind)
    }
}

/// Parses the body, collecting every missing or mistyped field.
fn parse(body: &[u8]) -> Result<(Event, &str), ApiError> {
    let invalid = |message: String| ApiError::Validation(vec![FieldError::new("body", message)]);
    let text = std::str::from_utf8(body).map_err(|_| invalid("is not UTF-8".to_owned()))?;
    let root: Map<String, Value> = match serde_json::from_str(text) {
        Ok(Value::Object(map)) => map,
        Ok(_) => return Err(invalid("must be a JSON object".to_owned())),
        Err(e) => return Err(invalid(format!("is not valid JSON (line {})", e.line()))),
    };
    // Nothing with a NUL is stored or logged (PostgreSQL cannot store it):
    // a clear 400 rather than a 500 the provider would redeliver forever.
    if let Some(field) = crate::extract::unstorable_text(&root) {
        return Err(ApiError::Validation(vec![FieldError::new(
            field,
            "must not contain U+0000 (NUL)",
        )]));
    }
    let mut errors = Vec::new();
    let mut string =
        |map: &Map<String, Value>, prefix: &str, name: &str, required: bool| match map.get(name) {
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            None | Some(Value::Null) if !required => None,
            _ => {
                errors.push(FieldError::new(
                    format!("{prefix}{name}"),
                    "must be a non-empty string",
                ));
                None
            }
        };
    let id = string(&root, "", "id", true);
    let kind = string(&root, "", "type", true);
    let data = match root.get("data") {
        Some(Value::Object(data)) => data.clone(),
        _ => Map::new(),
    };
    let object_id = string(&data, "data.", "id", true);
    let reference = string(&data, "data.", "reference", true);
    let is_refund = kind.as_deref().map(Kind::parse) == Some(Kind::RefundSucceeded);
    let _charge = string(&data, "data.", "charge", is_refund);
    let object = serde_json::from_value::<ProviderObject>(Value::Object(data.clone()));
    if object.is_err() {
        errors.push(FieldError::new("data", "must be a charge or a refund"));
    }
    let sequence = root.get("sequence").and_then(Value::as_i64);
    if sequence.is_none_or(|s| s < 0) {
        errors.push(FieldError::new(
            "sequence",
            "must be a non-negative integer",
        ));
    }
    if !matches!(root.get("data"), Some(Value::Object(_))) {
        errors.push(FieldError::new("data", "must be an object"));
    }
    match (id, kind, sequence, object_id, reference, object) {
        (Some(id), Some(kind), Some(sequence), Some(_), Some(reference), Ok(object))
            if errors.is_empty() =>
        {
            Ok((
                Event {
                    id,
                    kind,
                    sequence,
                    reference,
                    object,
                },
                text,
            ))
        }
        _ => Err(ApiError::Validation(errors)),
    }
}

/// Runs one delivery to its committed outcome. A race lost to a newer event
/// of the same charge rolls everything back and starts again.
async fn deliver(
    state: &AppState,
    provider: &str,
    event: &Event,
    payload: &str,
    now: DateTime<Utc>,
) -> Result<&'static str, ApiError> {
    let receipt = NewWebhookEvent {
        provider,
        event_id: &event.id,
        event_type: &event.kind,
        sequence: event.sequence,
        payload,
    };
    for _ in 0..RACE_RETRIES {
        let mut tx = state.store.begin().await?;
        if !tx.insert_webhook_event(&receipt, now).await? {
            tx.rollback().await?;
            return Ok("duplicate_delivery");
        }
        match process(&mut tx, provider, event, payload, now).await? {
            Processed::Done(outcome, payment) => {
                tx.record_webhook_outcome(provider, &event.id, outcome, payment)
                    .await?;
                tx.commit().await?;
                return Ok(outcome.as_str());
            }
            Processed::Raced => {
                tx.rollback().await?;
                tracing::info!("a newer event of the same charge committed first; re-running");
            }
        }
    }
    // Still racing: let the provider redeliver later rather than guess.
    Err(ApiError::Unavailable(None))
}

enum Processed {
    Done(WebhookOutcome, Option<PaymentId>),
    /// A concurrent event raised the charge's sequence past this one after
    /// it was read: this transaction must not commit.
    Raced,
}

/// Matches the event to the one attempt it is about and applies what it
/// proves, inside `tx`. The event's reference is unique to one attempt
/// (`{intent}/{attempt id}`); what the event carries must also fit that
/// attempt (`cobro_worker::fit`: identity, amount, currency, capture
/// mode). Evidence that names nothing of cobro's, or contradicts what is
/// recorded, is kept as a conflict and never adopted.
async fn process(
    tx: &mut WriteTx,
    provider: &str,
    event: &Event,
    payload: &str,
    now: DateTime<Utc>,
) -> Result<Processed, StoreError> {
    let kind = event.kind();
    let actor = format!("webhook:{provider}");
    let source = Source {
        name: &actor,
        said: payload,
    };
    if kind == Kind::Other {
        return Ok(Processed::Done(WebhookOutcome::Unmatched, None));
    }
    let named = tx.attempts_by_reference(&event.reference).await?;
    let [named] = named.as_slice() else {
        // Nothing of cobro's (or, for attempts made before references were
        // unique, several accounts' attempts): reported, never guessed from.
        let detail = format!(
            "event {} ({}) names {} attempts of cobro's",
            event.id,
            event.kind,
            named.len()
        );
        stop_the_line(
            tx,
            None,
            None,
            ConflictKind::Unmatched,
            &detail,
            &source,
            now,
        )
        .await?;
        return Ok(Processed::Done(WebhookOutcome::Unmatched, None));
    };
    let payment_id = PaymentId::from_uuid(named.payment_id.0);
    // The event arrives in the provider's trace (or none): a link leads to
    // the trace of the request that made the attempt it is about.
    let span = tracing::Span::current();
    span.record("payment_id", tracing::field::display(payment_id));
    span.record("attempt_id", tracing::field::display(named.id.0));
    if cobro_telemetry::tracing_active() {
        let (traceparent, tracestate) = tx
            .trace_context_of(AttemptId::from_uuid(named.id.0))
            .await?;
        cobro_telemetry::link_to_stored(&span, traceparent.as_deref(), tracestate.as_deref());
    }
    let done = |outcome| Ok(Processed::Done(outcome, Some(payment_id)));
    let payment = tx
        .payment_by_id(payment_id)
        .await?
        .ok_or_else(|| StoreError::Corrupt("attempt without payment".into()))?;
    if kind.is_charge() && event.sequence <= payment.provider_sequence {
        return done(WebhookOutcome::IgnoredStale);
    }
    let attempt = target_attempt(tx, named, &payment, kind).await?;
    let operation = Operation::parse(&attempt.operation)
        .ok_or_else(|| StoreError::Corrupt(format!("operation {}", attempt.operation)))?;
    let refund = match attempt.refund_id {
        Some(r) => tx.refund_by_id(RefundId::from_uuid(r.0)).await?,
        None => None,
    };
    let outcome = match fit(
        operation,
        &attempt,
        &payment,
        refund.as_ref(),
        &event.object,
    ) {
        Fit::Ours => match proof_from(operation, &event.object) {
            None => WebhookOutcome::Unmatched,
            Some(proof) => match apply_proof(tx, &attempt, &proof, &source, now).await? {
                Applied::AlreadySettled => WebhookOutcome::DuplicateEffect,
                Applied::Conflict { .. } => WebhookOutcome::Conflict,
                Applied::Settled { before, after } => {
                    let decision = NewDecision {
                        run_id: None,
                        payment: payment_id,
                        refund: attempt.refund_id.map(|r| RefundId::from_uuid(r.0)),
                        attempt: Some(AttemptId::from_uuid(attempt.id.0)),
                        state_before: before,
                        state_after: after,
                        provider_said: payload.to_owned(),
                        decision: proof.decision().to_owned(),
                        actor: actor.clone(),
                        reason: Some(format!(
                            "event {} ({}, sequence {})",
                            event.id, event.kind, event.sequence
                        )),
                    };
                    tx.record_decision(&decision, now).await?;
                    WebhookOutcome::Applied
                }
            },
        },
        Fit::Mismatch(why) => {
            stop_the_line(
                tx,
                Some(&attempt),
                Some(payment_id),
                ConflictKind::Mismatch,
                &why,
                &source,
                now,
            )
            .await?;
            WebhookOutcome::Conflict
        }
        Fit::NotOurs(why) => {
            let detail = format!("event {} does not fit its attempt: {why}", event.id);
            stop_the_line(
                tx,
                None,
                None,
                ConflictKind::Unmatched,
                &detail,
                &source,
                now,
            )
            .await?;
            WebhookOutcome::Unmatched
        }
    };
    // What is recorded about the charge now goes at least this far (an
    // effect already recorded by the worker counts too).
    let raised = tx
        .raise_provider_sequence(payment_id, event.sequence)
        .await?;
    if kind.is_charge() && !raised && outcome == WebhookOutcome::Applied {
        return Ok(Processed::Raced);
    }
    done(outcome)
}

/// The attempt a charge or refund event is about. The reference names the
/// attempt that created the object (the authorisation of a charge, the
/// refund of a refund); a capture or a void of that charge is the
/// payment's unresolved capture or cancel attempt, once the authorisation
/// is settled.
async fn target_attempt(
    tx: &mut WriteTx,
    named: &AttemptRow,
    payment: &PaymentRow,
    kind: Kind,
) -> Result<AttemptRow, StoreError> {
    let authorisation_open = AttemptState::parse(&named.state).is_some_and(|s| s.is_unresolved());
    if named.operation != Operation::Authorize.as_str() || authorisation_open {
        return Ok(named.clone());
    }
    let payment_id = PaymentId::from_uuid(payment.id.0);
    let follow_ups: &[Operation] = match kind {
        Kind::Captured => &[Operation::Capture, Operation::Cancel],
        Kind::Voided => &[Operation::Cancel, Operation::Capture],
        _ => &[],
    };
    for &operation in follow_ups {
        if let Some(attempt) = tx.attempt_for_event(payment_id, operation, None).await?
            && AttemptState::parse(&attempt.state).is_some_and(|s| s.is_unresolved())
            && attempt.state != AttemptState::Held.as_str()
        {
            return Ok(attempt);
        }
    }
    Ok(named.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn sign(secret: &str, t: i64, body: &[u8]) -> String {
        cobro_core::signature::sign(&[secret], t, body)
    }

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            SIGNATURE_HEADER,
            HeaderValue::from_str(value).expect("ascii"),
        );
        h
    }

    const BODY: &[u8] = br#"{"id":"evt_1"}"#;

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).expect("instant")
    }

    fn check(value: &str) -> Result<(), &'static str> {
        verify(
            &headers(value),
            BODY,
            &[&WebhookSecret::new("whsec_x")],
            now(),
            Duration::from_secs(300),
        )
    }

    #[test]
    fn a_signature_made_with_the_secret_within_the_tolerance_verifies() {
        let t = now().timestamp() - 299;
        assert!(check(&sign("whsec_x", t, BODY)).is_ok());
        // A rotating provider may send several v1 values.
        let both = format!("{},v1=00", sign("whsec_x", t, BODY));
        assert!(check(&both).is_ok());
    }

    #[test]
    fn wrong_secret_old_or_future_timestamp_and_garbage_are_refused() {
        let t = now().timestamp();
        for bad in [
            sign("whsec_other", t, BODY),
            sign("whsec_x", t - 301, BODY),
            sign("whsec_x", t + 301, BODY),
            sign("whsec_x", t, b"{}"),
            format!("t={t}"),
            "v1=abcd".to_owned(),
            "garbage".to_owned(),
            format!("t={t},v1=zz"),
        ] {
            assert!(check(&bad).is_err(), "{bad}");
        }
        assert_eq!(
            verify(
                &HeaderMap::new(),
                BODY,
                &[&WebhookSecret::new("whsec_x")],
                now(),
                Duration::from_secs(300)
            ),
            Err("header missing")
        );
    }

    #[test]
    fn the_secret_never_shows_in_debug_output() {
        assert!(!format!("{:?}", WebhookSecret::new("whsec_hunter2")).contains("hunter2"));
    }

    #[test]
    fn events_without_their_fields_are_refused_with_every_field_named() {
        let Err(ApiError::Validation(errors)) = parse(br#"{"type":"refund.succeeded","data":{}}"#)
        else {
            panic!("refused");
        };
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        for field in ["id", "sequence", "data.id", "data.reference", "data.charge"] {
            assert!(fields.contains(&field), "{field} in {fields:?}");
        }
        assert!(parse(b"not json").is_err());
        assert!(parse(b"[1]").is_err());
    }

    #[test]
    fn a_charge_event_parses() {
        let body = br#"{"id":"evt_1","type":"charge.captured","created":"2026-11-30T10:00:00Z","sequence":2,
            "data":{"id":"ch_1","object":"charge","amount":1999,"currency":"EUR","reference":"o-1:authorize-v1","status":"captured"}}"#;
        let (event, _) = parse(body).expect("parses");
        assert_eq!(event.kind(), Kind::Captured);
        assert_eq!(event.sequence, 2);
        assert_eq!(event.object.id, "ch_1");
        assert_eq!(event.object.amount, Some(1999));
        assert_eq!(event.object.currency.as_deref(), Some("EUR"));
    }
}
