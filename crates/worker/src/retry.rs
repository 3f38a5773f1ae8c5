//! When and whether to retry a send whose outcome was not definitive.

use chrono::{DateTime, Utc};
use rand::Rng;
use std::sync::Mutex;
use std::time::Duration;

/// Capped exponential backoff with full jitter: a uniformly random delay in
/// `[1 ms, min(cap, base * 2^sends)]`. Full jitter spreads a herd of retries
/// after an outage instead of re-synchronising it.
pub fn backoff(base: Duration, cap: Duration, sends: u32) -> Duration {
    let exp = base.saturating_mul(1u32.checked_shl(sends.min(20)).unwrap_or(u32::MAX));
    let ceiling = exp.min(cap).as_millis().max(1) as u64;
    // At least 1 ms: a retry is never due in the instant it was scheduled.
    Duration::from_millis(rand::rng().random_range(1..=ceiling))
}

/// A per-provider budget of retries (a token bucket shared by all of one
/// worker's tasks): it refills with time at `per_second` tokens, every
/// first send adds `ratio` more, every retry takes one, and it holds at most
/// `max`. During an outage retries stop multiplying the load (they wait for
/// a token instead of being dropped); once the provider recovers, the time
/// refill drains the backlog even if no new traffic arrives.
///
/// Written here rather than taken from `governor`: governor's GCRA has no
/// notion of tokens earned by other events (first sends), and this bucket
/// must run on cobro's injected clock so tests can move time.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    per_second: f64,
    max: f64,
    state: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    /// When the time refill was last counted; `None` until first used.
    at: Option<DateTime<Utc>>,
}

impl RetryBudget {
    /// Starts full (`max` tokens), so a quiet system can retry at once.
    pub fn new(ratio: f64, per_second: f64, max: f64) -> Self {
        Self {
            ratio,
            per_second: per_second.max(0.0),
            max: max.max(1.0),
            state: Mutex::new(Bucket {
                tokens: max.max(1.0),
                at: None,
            }),
        }
    }

    fn bucket(&self) -> std::sync::MutexGuard<'_, Bucket> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn refill(&self, bucket: &mut Bucket, now: DateTime<Utc>) {
        if let Some(at) = bucket.at {
            let elapsed = (now - at).num_milliseconds().max(0) as f64 / 1000.0;
            bucket.tokens = (bucket.tokens + elapsed * self.per_second).min(self.max);
        }
        bucket.at = Some(bucket.at.map_or(now, |at| at.max(now)));
    }

    pub fn on_first_send(&self) {
        let mut b = self.bucket();
        b.tokens = (b.tokens + self.ratio).min(self.max);
    }

    /// Takes one retry token at `now`; `false` means the retry must wait.
    pub fn try_retry(&self, now: DateTime<Utc>) -> bool {
        let mut b = self.bucket();
        self.refill(&mut b, now);
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// How long until the next token, at the time refill alone.
    pub fn next_token_in(&self) -> Duration {
        let b = self.bucket();
        if b.tokens >= 1.0 || self.per_second <= 0.0 {
            return Duration::ZERO;
        }
        Duration::from_secs_f64((1.0 - b.tokens) / self.per_second)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(5);
        for sends in 0..30 {
            let ceiling = (base * 2u32.saturating_pow(sends.min(20))).min(cap);
            for _ in 0..50 {
                let delay = backoff(base, cap, sends);
                assert!(
                    delay >= Duration::from_millis(1)
                        && delay <= ceiling.max(Duration::from_millis(1))
                );
            }
        }
    }

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).expect("instant")
    }

    #[test]
    fn the_budget_is_spent_by_retries_and_earned_by_first_sends() {
        let budget = RetryBudget::new(0.5, 0.0, 2.0);
        assert!(budget.try_retry(at(0)));
        assert!(budget.try_retry(at(0)));
        assert!(!budget.try_retry(at(0)), "spent");
        budget.on_first_send();
        assert!(!budget.try_retry(at(0)), "half a token is not a retry");
        budget.on_first_send();
        assert!(budget.try_retry(at(0)));
        for _ in 0..100 {
            budget.on_first_send();
        }
        let mut granted = 0;
        while budget.try_retry(at(0)) {
            granted += 1;
        }
        assert_eq!(granted, 2, "capped at max");
    }

    #[test]
    fn the_budget_refills_with_time_without_new_traffic() {
        // An outage spent it; nothing new arrives.
        let budget = RetryBudget::new(0.2, 2.0, 20.0);
        while budget.try_retry(at(0)) {}
        assert!(!budget.try_retry(at(0)));
        assert_eq!(budget.next_token_in(), Duration::from_millis(500));
        // One second later: two retries, not three.
        assert!(budget.try_retry(at(1)));
        assert!(budget.try_retry(at(1)));
        assert!(!budget.try_retry(at(1)));
        // A long quiet refills to the cap, never past it.
        let mut granted = 0;
        while budget.try_retry(at(3600)) {
            granted += 1;
        }
        assert_eq!(granted, 20);
        // A clock that steps back refills nothing.
        assert!(!budget.try_retry(at(10)));
    }
}
