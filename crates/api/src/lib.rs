#![doc = include_str!("../README.md")]
#![doc = include_str!("../docs/api.md")]

pub mod error;
pub mod events;
pub mod extract;
mod health;
mod keyed;
mod openapi;
mod payments;
pub mod rate_limit;
pub mod routing;
pub mod server;
mod tokens;
pub mod views;
mod webhooks;

pub use error::ApiError;
pub use extract::token_hash;
pub use health::metrics_router;
pub use webhooks::{REFUSED_SIGNATURE_BUDGET, WebhookReceiver};

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request};
use axum::http::{HeaderName, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::Response;
use cobro_core::Clock;
use cobro_store::Store;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use utoipa_axum::router::OpenApiRouter;

/// Settings of the HTTP API that are not the store's.
#[derive(Clone, Debug)]
pub struct ApiSettings {
    /// How long full idempotency records are kept before compaction.
    pub idempotency_retention: Duration,
    /// How long tombstones are kept after that.
    pub tombstone_retention: Duration,
    /// Each provider whose webhooks are accepted, by the `{provider}` of
    /// `/v1/webhooks/{provider}`: its scheme and secrets. Any other
    /// provider is 404.
    pub webhooks: std::collections::BTreeMap<String, WebhookReceiver>,
    /// How far a webhook signature's timestamp may be from now (either
    /// way) before it is refused as a possible replay.
    pub webhook_tolerance: Duration,
    /// Requests per second (and burst) per account, per process.
    pub rate_limit: rate_limit::RateLimit,
    /// How long a live token is remembered in process after it was read
    /// (zero: never). A token revoked in the database stops working within
    /// this bound; one that expires stops at its expiry exactly.
    pub token_cache_ttl: Duration,
    /// From the end of a request's headers to its answer, body included;
    /// then 408 `request-timeout`. The handler itself is not cut short (it
    /// runs in its own task), so a request that began executing finishes
    /// and its answer is stored against its key.
    pub request_timeout: Duration,
    /// How often a `?wait=` long poll re-reads when no notification came:
    /// only a fallback, for a PostgreSQL listener that is down or
    /// reconnecting (`Store::payment_moves`).
    pub long_poll_fallback: Duration,
    /// Test-only (`COBRO_TEST_HOLD`): hold matching keyed requests forever
    /// at one point of their commit. `None` everywhere but in crash tests.
    pub test_hold: Option<TestHold>,
    /// The provider a new payment goes to when its account names none,
    /// written on the payment in the transaction that creates it. `None`:
    /// the payment names no provider (NULL, read as whichever provider is
    /// the default).
    pub default_provider: Option<String>,
    /// Where event endpoints may point (`cobro_core::egress`): checked
    /// when one is registered. The default is production's: `https://`
    /// to public addresses only. The dispatcher checks the same rule again
    /// at every connection.
    pub event_endpoints: cobro_core::egress::EgressPolicy,
    /// What new payments are routed across (docs/routing.md).
    pub routing: routing::RoutingSettings,
    /// When a provider's circuit opens, shared with the workers.
    pub breaker: cobro_settle::routing::BreakerPolicy,
}

/// A test-only pause of keyed requests, for the process-level tests of
/// docs/recovery.md §6 that kill the server at an exact
/// point: scenario 4 (before the commit: the transaction is open, the key
/// reserved and the payment written) and scenario 5 (after the commit,
/// before the answer is sent). Only requests whose `Idempotency-Key`
/// starts with `key_prefix` are held, and a held request never answers:
/// the test SIGKILLs the process. Set with
/// `COBRO_TEST_HOLD=before-commit:<prefix>` or `after-commit:<prefix>`;
/// never in production.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestHold {
    pub point: HoldPoint,
    pub key_prefix: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldPoint {
    BeforeCommit,
    AfterCommit,
}

impl std::str::FromStr for TestHold {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (point, key_prefix) = text
            .split_once(':')
            .ok_or("expected before-commit:<key prefix> or after-commit:<key prefix>")?;
        let point = match point {
            "before-commit" => HoldPoint::BeforeCommit,
            "after-commit" => HoldPoint::AfterCommit,
            other => return Err(format!("unknown hold point {other:?}")),
        };
        if key_prefix.is_empty() {
            return Err("the key prefix is empty (it would hold every request)".into());
        }
        Ok(Self {
            point,
            key_prefix: key_prefix.to_owned(),
        })
    }
}

impl TestHold {
    /// Never returns when `hold` is set for this point and key; says so
    /// on stderr first (the test waits for that line, then kills).
    pub(crate) async fn at(hold: Option<&TestHold>, point: HoldPoint, key: &str) {
        if hold.is_some_and(|h| h.point == point && key.starts_with(&h.key_prefix)) {
            tracing::warn!(
                ?point,
                "COBRO_TEST_HOLD: holding this request until the process dies"
            );
            std::future::pending::<()>().await;
        }
    }
}

impl Default for ApiSettings {
    fn default() -> Self {
        Self {
            idempotency_retention: Duration::from_secs(24 * 3600),
            tombstone_retention: Duration::from_secs(30 * 24 * 3600),
            webhooks: std::collections::BTreeMap::new(),
            webhook_tolerance: Duration::from_secs(300),
            rate_limit: rate_limit::RateLimit::default(),
            token_cache_ttl: Duration::from_secs(2),
            request_timeout: Duration::from_secs(45),
            long_poll_fallback: Duration::from_secs(1),
            test_hold: None,
            default_provider: None,
            event_endpoints: cobro_core::egress::EgressPolicy::default(),
            routing: routing::RoutingSettings {
                rules_ttl: Duration::from_secs(2),
                ..Default::default()
            },
            breaker: cobro_settle::routing::BreakerPolicy::default(),
        }
    }
}

/// What every handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub clock: Arc<dyn Clock>,
    pub settings: Arc<ApiSettings>,
    /// Signalled after every commit that enqueued provider work, so an
    /// in-process worker wakes without polling.
    pub work_available: Arc<Notify>,
    pub rate_limiter: Arc<rate_limit::RateLimiter>,
    /// Live tokens read recently (`ApiSettings::token_cache_ttl`).
    pub tokens: Arc<tokens::TokenCache>,
    /// Webhook deliveries whose signature failed, per provider: over this
    /// budget they are answered 429 unlogged, so an unsigned flood costs
    /// neither log volume nor more than an HMAC each.
    pub webhook_refusals: Arc<rate_limit::RateLimiter<String>>,
    /// Routes new payments across providers.
    pub routing: Arc<routing::Router>,
}

impl AppState {
    pub fn new(store: Store, clock: Arc<dyn Clock>, settings: ApiSettings) -> Self {
        Self {
            store: store.clone(),
            rate_limiter: Arc::new(rate_limit::RateLimiter::new(
                settings.rate_limit,
                Arc::clone(&clock),
            )),
            webhook_refusals: Arc::new(rate_limit::RateLimiter::new(
                webhooks::REFUSED_SIGNATURE_BUDGET,
                Arc::clone(&clock),
            )),
            tokens: Arc::new(tokens::TokenCache::new(settings.token_cache_ttl)),
            routing: Arc::new(routing::Router::new(
                settings.routing.clone(),
                Arc::new(cobro_settle::routing::Circuits::new(
                    store.clone(),
                    Arc::clone(&clock),
                    settings.breaker.clone(),
                )),
            )),
            clock,
            settings: Arc::new(settings),
            work_available: Arc::new(Notify::new()),
        }
    }
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The whole HTTP API. The caller adds nothing but a listener: request ids,
/// the request span, the body limit and the key echo are layered here, so
/// tests driving the router with `oneshot` see exactly what clients see.
pub fn router(state: AppState) -> Router {
    let (routes, document) = routes_and_document();
    routes
        .layer(axum::Extension(openapi::Served(document)))
        .layer(DefaultBodyLimit::max(extract::BODY_LIMIT))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state.settings),
            request_context,
        ))
        .layer(PropagateRequestIdLayer::new(REQUEST_ID))
        .layer(SetRequestIdLayer::new(REQUEST_ID, NewRequestId))
        // tower-http keeps any `X-Request-Id` a client sent; cobro keeps
        // only a sane one, so the others are dropped first and replaced.
        .layer(middleware::map_request(drop_unusable_request_id))
        .with_state(state)
}

/// The routes and their OpenAPI document, built once per process: the
/// document is the same for every router, and building it is the costly
/// part of [`router`] (a tenth of a second in a debug build, paid by every
/// test app).
fn routes_and_document() -> (Router<AppState>, Arc<utoipa::openapi::OpenApi>) {
    static BUILT: std::sync::OnceLock<(Router<AppState>, Arc<utoipa::openapi::OpenApi>)> =
        std::sync::OnceLock::new();
    let (routes, document) = BUILT.get_or_init(|| {
        let (routes, document) = api().split_for_parts();
        (routes, Arc::new(openapi::complete(document)))
    });
    (routes.clone(), Arc::clone(document))
}

/// A client's `X-Request-Id` is kept when it is 1 to 128 visible ASCII
/// characters (it goes into logs, spans and problem bodies); any other is
/// removed here, so [`SetRequestIdLayer`] gives the request a new one.
async fn drop_unusable_request_id(mut request: Request) -> Request {
    let usable = request
        .headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic())
        });
    if !usable {
        request.headers_mut().remove(&REQUEST_ID);
    }
    request
}

/// A new request id: a UUID (v7, so ids sort by time).
#[derive(Clone, Copy)]
struct NewRequestId;

impl MakeRequestId for NewRequestId {
    fn make_request_id<B>(&mut self, _: &axum::http::Request<B>) -> Option<RequestId> {
        HeaderValue::from_str(&uuid::Uuid::now_v7().to_string())
            .ok()
            .map(RequestId::new)
    }
}

/// Every route of the API with its documentation: each is registered
/// through `routes!` from the `#[utoipa::path]` on its handler, so the
/// router and `/openapi.json` cannot disagree.
fn api() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::base())
        .merge(payments::routes())
        .merge(openapi::routes())
        .merge(health::routes())
        .merge(webhooks::routes())
        .merge(events::routes())
        .merge(routing::routes())
}

/// Gives every request a span that carries its id (set by
/// [`SetRequestIdLayer`]; never headers, bodies or keys: only a hash of the
/// key is recorded, by the extractor), runs its handler in a task of its
/// own under the request timeout, records its metrics, and echoes the
/// `Idempotency-Key` on every answer to a keyed POST.
///
/// Not tower-http's `TraceLayer` and `TimeoutLayer`: the timeout must answer
/// 408 `request-timeout` (problem+json, `Connection: close`) while the
/// handler keeps running in its task to commit its answer, where
/// `TimeoutLayer` drops (cancels) the handler; and the span must wrap that
/// task and record the final status of either answer, with the metrics
/// labelled by route template, which `TraceLayer`'s callbacks could only
/// do by re-implementing this function piecewise.
async fn request_context(
    axum::extract::State(settings): axum::extract::State<Arc<ApiSettings>>,
    request: Request,
    next: Next,
) -> Response {
    // Always there, usable (`drop_unusable_request_id`, `SetRequestIdLayer`).
    let request_id = request
        .extensions()
        .get::<RequestId>()
        .and_then(|id| id.header_value().to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    let echo_key = (request.method() == Method::POST)
        .then(|| {
            // Only a valid key is echoed: an invalid one may be anything
            // (200 KB, control bytes) and goes back to no one.
            let mut values = request.headers().get_all(&IDEMPOTENCY_KEY).iter();
            match (values.next(), values.next()) {
                (Some(one), None) => one
                    .to_str()
                    .is_ok_and(|raw| cobro_core::IdempotencyKey::parse(raw).is_ok())
                    .then(|| one.clone()),
                _ => None,
            }
        })
        .flatten();
    // The route template (`/v1/payments/{id}`), never the raw path: a
    // stable span name and label, whatever ids the path carries. A path no
    // route matched is `unmatched`.
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_owned();
    let method = request.method().clone();
    let span = tracing::info_span!(
        "http.request",
        otel.kind = "server",
        http.request.method = %method,
        http.route = %route,
        http.response.status_code = tracing::field::Empty,
        request_id = %request_id,
        account_id = tracing::field::Empty,
        idempotency_key_hash = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
    );
    // The client's W3C traceparent/tracestate, if it sent them, make this
    // span a child of its own (set before the span is first entered); a
    // parent that did not take is counted and logged, never silent.
    let parent = cobro_telemetry::extract_http(request.headers());
    if opentelemetry::trace::TraceContextExt::has_active_span(&parent) {
        cobro_telemetry::attach_parent(&span, parent, "http");
    }
    let started = std::time::Instant::now();
    tracing::debug!(parent: &span, "request started");
    let handler = tracing::Instrument::instrument(
        error::REQUEST_ID.scope(request_id.clone(), next.run(request)),
        span.clone(),
    );
    // The handler runs in a task of its own: a client that disconnects
    // drops this future, never the handler's transaction half-way (a
    // cancelled BEGIN or COMMIT can leave a pooled connection inside a
    // transaction, a known sqlx 0.8 hazard). Every request runs to its end.
    // The timeout bounds the answer, not the handler: a body that never
    // arrives gets a 408 and its connection closed, while a handler that
    // already began its transaction still commits (its answer is stored
    // against the key, for the client's retry).
    let answer = tokio::time::timeout(settings.request_timeout, tokio::spawn(handler));
    let mut response = match answer.await {
        Ok(Ok(response)) => response,
        Ok(Err(join)) => {
            tracing::error!(parent: &span, error = %join, "request handler panicked");
            axum::response::IntoResponse::into_response(error::ApiError::internal(join))
        }
        Err(_elapsed) => {
            let mut response =
                axum::response::IntoResponse::into_response(error::ApiError::RequestTimeout {
                    limit: settings.request_timeout,
                });
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                HeaderValue::from_static("close"),
            );
            response
        }
    };
    let status = response.status().as_u16();
    let elapsed = started.elapsed();
    span.record("http.response.status_code", status);
    if response.status().is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    cobro_telemetry::metrics::http_request(&route, method.as_str(), status, elapsed);
    tracing::info!(parent: &span, status, elapsed_ms = elapsed.as_millis() as u64, "request served");
    // `X-Request-Id` is echoed by `PropagateRequestIdLayer`.
    if let Some(key) = echo_key {
        response.headers_mut().insert(IDEMPOTENCY_KEY, key);
    }
    response
}

#[cfg(test)]
mod test_hold_tests {
    use super::{HoldPoint, TestHold};

    #[test]
    fn a_test_hold_names_its_point_and_a_non_empty_key_prefix() {
        assert_eq!(
            "after-commit:crash-".parse::<TestHold>(),
            Ok(TestHold {
                point: HoldPoint::AfterCommit,
                key_prefix: "crash-".into()
            })
        );
        assert_eq!(
            "before-commit:k:1"
                .parse::<TestHold>()
                .map(|h| h.key_prefix),
            Ok("k:1".to_owned())
        );
        for refused in ["after-commit:", "after-commit", "during-commit:k", ""] {
            assert!(refused.parse::<TestHold>().is_err(), "{refused:?}");
        }
    }
}
