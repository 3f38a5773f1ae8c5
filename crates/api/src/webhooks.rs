//! `POST /v1/webhooks/{provider}`: the HTTP side of provider events
//! (docs/recovery.md §4). What is per provider (the
//! signature and the event's shape) is the provider's
//! [`WebhookScheme`](cobro_provider::WebhookScheme); what an event proves is
//! applied by [`cobro_settle::deliver`], the same for every provider. This
//! module only:
//! - finds the receiver configured for `{provider}` (any other is 404);
//! - reads the body under its own limit (64 KiB; the rest of the API keeps
//!   16 KiB);
//! - refuses a failed signature (400, logged, within a per-provider budget;
//!   past it 429, unlogged) and a malformed event (400 naming every field);
//!   nothing is stored for either;
//! - answers 200 with the outcome only after the delivery committed (a
//!   store that is busy or down answers 503, and the provider redelivers).

use crate::AppState;
use crate::error::{ApiError, FieldError};
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use cobro_provider::{WebhookScheme, WebhookSecret};
use serde_json::{Value, json};
use std::sync::Arc;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The largest webhook body accepted: provider events carry a whole charge
/// or refund, so more room than a merchant request.
pub const WEBHOOK_BODY_LIMIT: usize = 64 * 1024;

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

/// How one configured provider's webhooks are received.
#[derive(Clone)]
pub struct WebhookReceiver {
    /// The provider's signature and event format.
    pub scheme: Arc<dyn WebhookScheme>,
    /// The signing secret.
    pub secret: WebhookSecret,
    /// The previous secret while the secret is rotated: a delivery signed
    /// with either is accepted, so a rotation refuses nothing
    /// (ops/RUNBOOK.md).
    pub previous: Option<WebhookSecret>,
}

impl WebhookReceiver {
    /// The fake provider's scheme (`Fake-Signature`) with `secret`.
    pub fn fake(secret: WebhookSecret) -> Self {
        Self {
            scheme: Arc::new(cobro_provider::FakeWebhooks),
            secret,
            previous: None,
        }
    }

    /// Stripe's scheme (`Stripe-Signature`, Stripe's events) with the
    /// endpoint's signing secret (`whsec_...`): the receiver for
    /// `/v1/webhooks/stripe`, whether Stripe, the fake's Stripe dialect
    /// or localstripe delivers.
    pub fn stripe(secret: WebhookSecret) -> Self {
        Self {
            scheme: Arc::new(cobro_provider::StripeWebhooks),
            secret,
            previous: None,
        }
    }
}

impl std::fmt::Debug for WebhookReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookReceiver")
            .field("secret", &self.secret)
            .field("previous", &self.previous)
            .finish_non_exhaustive()
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
    let receiver = state
        .settings
        .webhooks
        .get(&provider)
        .ok_or(ApiError::NotFound)?;
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
    let mut secrets = vec![receiver.secret.expose()];
    secrets.extend(receiver.previous.as_ref().map(WebhookSecret::expose));
    let verified = receiver.scheme.verify(
        &headers,
        &body,
        &secrets,
        now.timestamp(),
        state.settings.webhook_tolerance,
    );
    if let Err(reason) = verified {
        if !state.webhook_refusals.allow(provider.clone()) {
            cobro_telemetry::metrics::webhook_event(&provider, "signature_rate_limited");
            return Err(ApiError::RateLimited);
        }
        cobro_telemetry::metrics::webhook_event(&provider, "signature_invalid");
        // The header and the secret are never logged.
        tracing::warn!(%provider, reason, "webhook signature refused");
        return Err(ApiError::WebhookSignatureInvalid);
    }
    let event = receiver.scheme.parse(&body).map_err(|problems| {
        ApiError::Validation(
            problems
                .into_iter()
                .map(|p| FieldError::new(p.field, p.message))
                .collect(),
        )
    })?;
    // Stored as received: a scheme that let a non-UTF-8 body through must
    // not leave an empty payload on record.
    let payload = std::str::from_utf8(&body)
        .map_err(|_| ApiError::Validation(vec![FieldError::new("body", "is not UTF-8")]))?;
    let span = tracing::info_span!(
        "webhook.receive",
        provider = %provider,
        event_id = %event.id,
        event_type = %event.type_name,
        payment_id = tracing::field::Empty,
        attempt_id = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    // The default provider's route also answers for attempts recorded
    // before providers were named (and for every attempt when no default
    // is configured: a single provider).
    let scope = cobro_store::ProviderScope {
        is_default: state
            .settings
            .default_provider
            .as_deref()
            .is_none_or(|default| default == provider),
        name: provider.clone(),
    };
    let outcome = tracing::Instrument::instrument(
        cobro_settle::deliver(&state.store, &scope, &event, payload, now),
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
