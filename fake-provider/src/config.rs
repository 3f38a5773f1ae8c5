//! Start-up configuration of a fake provider.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How a fake provider behaves from the moment it starts.
#[derive(Clone, Debug)]
pub struct Config {
    /// How long (in virtual time) an idempotency key is remembered after its
    /// first use. After that the same key creates a new charge, which is the
    /// hazard cobro's reconciler exists for.
    pub retention: Duration,
    /// Seed of the one RNG that draws fault probabilities and ids, so a chaos
    /// run with the same seed and request order replays identically.
    pub seed: u64,
    /// Serve the `/__admin` control API. Off by default: a production-like
    /// configuration must not let callers rewrite time or inject faults.
    pub admin: bool,
    /// Where events are POSTed; `None` emits no events at all.
    pub webhook: Option<WebhookTarget>,
    /// First retry delay of a failed webhook delivery; doubles per attempt up
    /// to [`WEBHOOK_RETRY_CAP`].
    pub webhook_retry_base: Duration,
}

/// Upper bound of the webhook retry backoff: long enough to show backoff,
/// short enough that tests waiting on redelivery finish quickly.
pub const WEBHOOK_RETRY_CAP: Duration = Duration::from_secs(2);

impl Default for Config {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(24 * 60 * 60),
            seed: 0,
            admin: false,
            webhook: None,
            webhook_retry_base: Duration::from_millis(50),
        }
    }
}

/// The receiver of webhook events and the secret that signs them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookTarget {
    /// Absolute URL the events are POSTed to.
    pub url: String,
    /// HMAC-SHA256 key of the `Fake-Signature` header.
    pub secret: String,
}
