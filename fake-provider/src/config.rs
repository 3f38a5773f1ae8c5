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
    /// Which API's events the target receives: the fake's own (`Fake-Signature`)
    /// or Stripe's (`Stripe-Signature`). Kept apart from [`WebhookTarget`] so a
    /// target set later keeps the dialect the provider was started with.
    pub webhook_dialect: WebhookDialect,
    /// First retry delay of a failed webhook delivery; doubles per attempt up
    /// to [`WEBHOOK_RETRY_CAP`].
    pub webhook_retry_base: Duration,
    /// How many events are delivered at once. Events with the same
    /// reference always share one lane and arrive in order; 1 (the default)
    /// sends every event in order, each after the one before it is answered.
    /// A real provider sends many at once: a receiver that must keep up with
    /// hundreds of effects per second needs more than one.
    pub webhook_concurrency: usize,
    /// The virtual clock's time at start (`None`: real time). A test whose
    /// client runs on a manual clock starts the provider at the same
    /// instant, so that creation times the provider reports and send times
    /// the client records are comparable, as they are between real hosts.
    pub clock_start: Option<chrono::DateTime<chrono::Utc>>,
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
            webhook_dialect: WebhookDialect::Fake,
            webhook_retry_base: Duration::from_millis(50),
            webhook_concurrency: 1,
            clock_start: None,
        }
    }
}

/// The receiver of webhook events and the secret that signs them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookTarget {
    /// Absolute URL the events are POSTed to.
    pub url: String,
    /// HMAC-SHA256 key of the signature header (`Fake-Signature` or
    /// `Stripe-Signature`, by [`WebhookDialect`]).
    pub secret: String,
}

/// The shape of webhook events: which API the receiver speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WebhookDialect {
    /// The fake's events (`charge.authorized`, ... with a per-charge
    /// `sequence`), signed in `Fake-Signature`; one per engine effect,
    /// whichever API made it.
    #[default]
    Fake,
    /// Stripe's events (`payment_intent.succeeded`, ... an `event` object
    /// with `data.object`), signed in `Stripe-Signature`; only for what was
    /// made through the Stripe dialect.
    Stripe,
}

impl WebhookDialect {
    /// The wire name: `fake` or `stripe`.
    pub fn as_str(self) -> &'static str {
        match self {
            WebhookDialect::Fake => "fake",
            WebhookDialect::Stripe => "stripe",
        }
    }
}

impl std::str::FromStr for WebhookDialect {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "fake" => Ok(WebhookDialect::Fake),
            "stripe" => Ok(WebhookDialect::Stripe),
            other => Err(format!(
                "unknown webhook dialect {other:?} (fake or stripe)"
            )),
        }
    }
}

impl std::fmt::Display for WebhookDialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
