//! Which answers are retried, and how long to wait before the next try.
//!
//! Retried, always with the same key and body: connection errors and
//! timeouts (the request may or may not have been executed: only the key
//! makes the retry safe), 408, 409 (cobro's 409 means only "a request with
//! this key is in progress"), 429 and 5xx. Never retried: every other 4xx
//! (400, 401, 404, 413, 422...): the same request would get the same answer.

use rand::Rng;
use std::time::Duration;

/// What one answer's status means for the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The request's final answer: complete the intent with it.
    Final,
    /// Try again with the same key, after a backoff.
    Retry,
    /// Not retried and not final for the intent: 401 (configuration).
    Stop,
}

pub(crate) fn verdict(status: u16) -> Verdict {
    match status {
        401 => Verdict::Stop,
        408 | 409 | 429 | 500..=599 => Verdict::Retry,
        _ => Verdict::Final,
    }
}

/// Capped exponential backoff with jitter, honouring `Retry-After`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries in all, the first included (at least 1).
    pub max_attempts: u32,
    /// The backoff ceiling of the first retry; doubled on each retry.
    pub base: Duration,
    /// The largest backoff ceiling.
    pub cap: Duration,
    /// The longest `Retry-After` honoured; a longer one ends the retries
    /// (the intent stays pending) rather than blocking the caller.
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 8,
            base: Duration::from_millis(100),
            cap: Duration::from_secs(5),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// No retries: one try, then the caller decides.
    pub fn never() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// The ceiling before retry `retry` (1 for the first retry):
    /// `min(cap, base * 2^(retry-1))`.
    fn ceiling(&self, retry: u32) -> Duration {
        let factor = 2u32.saturating_pow(retry.saturating_sub(1));
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// How long to wait before retry `retry`, or `None` when the server's
    /// `Retry-After` is longer than the policy allows. "Equal jitter": half
    /// the ceiling plus a random part of the other half, so retries of many
    /// clients spread out but never come back at once. A `Retry-After` is a
    /// floor: never sooner than the server asked.
    pub fn delay(&self, retry: u32, retry_after: Option<Duration>) -> Option<Duration> {
        let ceiling = self.ceiling(retry);
        let half = ceiling / 2;
        let spread = u64::try_from((ceiling - half).as_millis()).unwrap_or(u64::MAX);
        let backoff = half + Duration::from_millis(rand::rng().random_range(0..=spread));
        match retry_after {
            Some(asked) if asked > self.max_retry_after => None,
            Some(asked) => Some(backoff.max(asked)),
            None => Some(backoff),
        }
    }
}

/// `Retry-After` as delta-seconds (the form cobro sends). An HTTP date is
/// read as absent: the backoff applies.
pub(crate) fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_in_progress_rate_limits_timeouts_and_server_errors_are_retried() {
        for status in [408, 409, 429, 500, 502, 503, 504] {
            assert_eq!(verdict(status), Verdict::Retry, "{status}");
        }
        for status in [200, 201, 202, 400, 404, 405, 413, 422] {
            assert_eq!(verdict(status), Verdict::Final, "{status}");
        }
        assert_eq!(verdict(401), Verdict::Stop);
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_with_jitter_inside_its_upper_half() {
        let policy = RetryPolicy {
            base: Duration::from_millis(100),
            cap: Duration::from_millis(1000),
            ..RetryPolicy::default()
        };
        for (retry, ceiling) in [
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 800),
            (5, 1000),
            (30, 1000),
        ] {
            for _ in 0..200 {
                let delay = policy.delay(retry, None).expect("a delay");
                let ms = delay.as_millis();
                assert!(
                    ms >= ceiling / 2 && ms <= ceiling,
                    "retry {retry}: {ms} ms outside [{}, {ceiling}]",
                    ceiling / 2
                );
            }
        }
    }

    #[test]
    fn retry_after_is_a_floor_and_one_longer_than_allowed_ends_the_retries() {
        let policy = RetryPolicy::default();
        let delay = policy
            .delay(1, Some(Duration::from_secs(2)))
            .expect("a delay");
        assert!(delay >= Duration::from_secs(2), "{delay:?}");
        assert_eq!(policy.delay(1, Some(Duration::from_secs(61))), None);
    }

    #[test]
    fn retry_after_reads_seconds_and_ignores_dates() {
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(reqwest::header::RETRY_AFTER, "1".parse().expect("value"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(1)));
        headers.insert(
            reqwest::header::RETRY_AFTER,
            "Wed, 21 Oct 2015 07:28:00 GMT".parse().expect("value"),
        );
        assert_eq!(retry_after(&headers), None);
    }
}
