#![doc = include_str!("../README.md")]

mod health;

use axum::Router;
use cobro_core::Clock;
use cobro_store::Store;
use std::sync::Arc;
use std::time::Duration;

/// Settings of the HTTP API that are not the store's.
#[derive(Clone, Debug)]
pub struct ApiSettings {
    /// How long full idempotency records are kept before compaction.
    pub idempotency_retention: Duration,
    /// How long tombstones are kept after that.
    pub tombstone_retention: Duration,
}

impl Default for ApiSettings {
    fn default() -> Self {
        Self {
            idempotency_retention: Duration::from_secs(24 * 3600),
            tombstone_retention: Duration::from_secs(30 * 24 * 3600),
        }
    }
}

/// What every handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub clock: Arc<dyn Clock>,
    pub settings: Arc<ApiSettings>,
}

impl AppState {
    pub fn new(store: Store, clock: Arc<dyn Clock>, settings: ApiSettings) -> Self {
        Self {
            store,
            clock,
            settings: Arc::new(settings),
        }
    }
}

/// The whole HTTP API. The caller adds nothing but a listener: request ids,
/// tracing, body limits and timeouts are layered here so tests driving the
/// router with `oneshot` see exactly what clients see.
pub fn router(state: AppState) -> Router {
    Router::new().merge(health::routes()).with_state(state)
}
