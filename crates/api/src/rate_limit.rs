//! A per-account token bucket in front of every authenticated endpoint.
//!
//! A refused request is answered 429 `rate-limited` with `Retry-After` before
//! anything else happens, so it is never stored against an idempotency key
//! and the client may retry the same request with the same key. The bucket
//! lives in this process: with several `serve` processes behind a load
//! balancer each enforces its share (state the limit per process).

use chrono::{DateTime, Utc};
use cobro_core::AccountId;
use std::collections::HashMap;
use std::sync::Mutex;

/// Requests per second per account, with a burst. `per_second == 0` turns
/// the limiter off.
#[derive(Clone, Copy, Debug)]
pub struct RateLimit {
    pub per_second: u32,
    pub burst: u32,
}

impl Default for RateLimit {
    fn default() -> Self {
        Self {
            per_second: 200,
            burst: 400,
        }
    }
}

/// One bucket per key: accounts for requests, providers for webhooks
/// whose signature failed.
#[derive(Debug)]
pub struct RateLimiter<K = AccountId> {
    limit: RateLimit,
    buckets: Mutex<HashMap<K, (f64, DateTime<Utc>)>>,
}

impl<K: std::hash::Hash + Eq> RateLimiter<K> {
    pub fn new(limit: RateLimit) -> Self {
        Self {
            limit,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token for `account` at `now`; `false`: over the limit.
    pub fn allow(&self, account: K, now: DateTime<Utc>) -> bool {
        if self.limit.per_second == 0 {
            return true;
        }
        let burst = f64::from(self.limit.burst.max(1));
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let (tokens, last) = buckets.entry(account).or_insert((burst, now));
        let elapsed = (now - *last).num_microseconds().unwrap_or(i64::MAX).max(0) as f64 / 1e6;
        *tokens = (*tokens + elapsed * f64::from(self.limit.per_second)).min(burst);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn a_burst_is_allowed_then_the_rate_refills_per_account() {
        let t0 = Utc
            .with_ymd_and_hms(2026, 11, 30, 12, 0, 0)
            .single()
            .expect("t0");
        let limiter = RateLimiter::new(RateLimit {
            per_second: 2,
            burst: 3,
        });
        let (a, b) = (AccountId::new(), AccountId::new());
        assert!((0..3).all(|_| limiter.allow(a, t0)));
        assert!(!limiter.allow(a, t0), "the burst is spent");
        assert!(limiter.allow(b, t0), "another account has its own bucket");
        let later = t0 + chrono::Duration::milliseconds(500);
        assert!(
            limiter.allow(a, later),
            "half a second refills one token at 2/s"
        );
        assert!(!limiter.allow(a, later));
    }

    #[test]
    fn zero_turns_the_limiter_off() {
        let limiter = RateLimiter::new(RateLimit {
            per_second: 0,
            burst: 0,
        });
        let now = Utc::now();
        assert!((0..10_000).all(|_| limiter.allow(AccountId::new(), now)));
    }
}
