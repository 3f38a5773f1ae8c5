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

/// Parses `500ms`, `30s`, `15m`, `24h`, `7d` (or bare seconds) for the CLI.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?}: expected a number and a unit"))?;
    let seconds = |factor: u64| Duration::from_secs(number.saturating_mul(factor));
    match unit {
        "ms" => Ok(Duration::from_millis(number)),
        "" | "s" => Ok(seconds(1)),
        "m" => Ok(seconds(60)),
        "h" => Ok(seconds(3600)),
        "d" => Ok(seconds(86_400)),
        _ => Err(format!("{text:?}: unit must be ms, s, m, h or d")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_every_unit() {
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("90m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("h").is_err());
        assert!(parse_duration("3w").is_err());
    }
}
