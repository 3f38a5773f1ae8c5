//! What callers sent as W3C trace context: every provider API request's
//! `traceparent` (and `tracestate`, and the `Stripe-Version` it pinned),
//! with what identifies it, so a test can
//! check that a caller's trace reached the provider. A real provider would
//! log it; the fake keeps the last [`KEPT`] requests in memory.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::state::Shared;

/// How many requests are remembered (oldest forgotten first).
pub const KEPT: usize = 10_000;

/// One provider API request as received.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SeenRequest {
    pub method: String,
    /// The path, without the query string.
    pub path: String,
    /// The `Idempotency-Key` header (mutations), as the ledger records it.
    pub idempotency_key: Option<String>,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// The `Stripe-Version` header a Stripe-dialect request pinned (the
    /// answer is rendered in [`crate::STRIPE_API_VERSION`] whatever it says).
    #[serde(default)]
    pub stripe_version: Option<String>,
    /// Virtual time of receipt.
    pub received: DateTime<Utc>,
}

/// Records the request before it is served (faults included: a request the
/// provider then drops was still received).
pub(crate) async fn record(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    let seen = seen(&request, shared.clock.now());
    {
        let mut requests = shared.requests();
        if requests.len() == KEPT {
            requests.pop_front();
        }
        requests.push_back(seen);
    }
    next.run(request).await
}

fn seen(request: &Request, received: DateTime<Utc>) -> SeenRequest {
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    SeenRequest {
        method: request.method().to_string(),
        path: request.uri().path().to_owned(),
        idempotency_key: header("idempotency-key"),
        traceparent: header("traceparent"),
        tracestate: header("tracestate"),
        stripe_version: header("stripe-version"),
        received,
    }
}

pub(crate) type Requests = VecDeque<SeenRequest>;
