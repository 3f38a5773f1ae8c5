//! A per-account rate limit in front of every authenticated endpoint,
//! governor's GCRA (a token bucket: `burst` at once, refilled at
//! `per_second`) keyed by account, driven by cobro's injected clock.
//!
//! A refused request is answered 429 `rate-limited` with `Retry-After` before
//! anything else happens, so it is never stored against an idempotency key
//! and the client may retry the same request with the same key. The bucket
//! lives in this process: with several `serve` processes behind a load
//! balancer each enforces its share (state the limit per process).

use cobro_core::{AccountId, Clock};
use governor::Quota;
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::HashMapStateStore;
use std::hash::Hash;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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

/// cobro's injected [`Clock`] as governor's clock, so a test that moves the
/// clock moves the buckets (no sleep). Its instants are the time since the
/// Unix epoch; a clock set before it reads as the epoch.
#[derive(Clone)]
struct InjectedClock(Arc<dyn Clock>);

impl governor::clock::Clock for InjectedClock {
    type Instant = Duration;

    fn now(&self) -> Duration {
        let nanos = self.0.now().timestamp_nanos_opt().unwrap_or(i64::MAX);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(0))
    }
}

type Keyed<K> =
    governor::RateLimiter<K, HashMapStateStore<K>, InjectedClock, NoOpMiddleware<Duration>>;

/// How many decisions pass between two removals of the keys whose bucket
/// is full again (as good as absent): the map holds at most the keys seen
/// within one refill of the burst, plus this many.
const PRUNE_EVERY: u64 = 4096;

/// One bucket per key: accounts for requests, providers for webhooks
/// whose signature failed.
pub struct RateLimiter<K: Hash + Eq + Clone = AccountId> {
    /// `None`: off.
    limiter: Option<Keyed<K>>,
    decisions: AtomicU64,
}

impl<K: Hash + Eq + Clone> RateLimiter<K> {
    pub fn new(limit: RateLimit, clock: Arc<dyn Clock>) -> Self {
        let limiter = NonZeroU32::new(limit.per_second).map(|per_second| {
            let burst = NonZeroU32::new(limit.burst).unwrap_or(NonZeroU32::MIN);
            let quota = Quota::per_second(per_second).allow_burst(burst);
            governor::RateLimiter::new(quota, HashMapStateStore::default(), InjectedClock(clock))
        });
        Self {
            limiter,
            decisions: AtomicU64::new(0),
        }
    }

    /// Takes one token for `key` now; `false`: over the limit.
    pub fn allow(&self, key: K) -> bool {
        let Some(limiter) = &self.limiter else {
            return true;
        };
        let allowed = limiter.check_key(&key).is_ok();
        if self.decisions.fetch_add(1, Ordering::Relaxed) % PRUNE_EVERY == PRUNE_EVERY - 1 {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
        allowed
    }

    /// Keys with a bucket in memory (those not full again since the last
    /// pruning).
    pub fn len(&self) -> usize {
        self.limiter.as_ref().map_or(0, |l| l.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<K: Hash + Eq + Clone> std::fmt::Debug for RateLimiter<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter")
            .field("on", &self.limiter.is_some())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{DateTime, TimeZone, Utc};
    use std::sync::Mutex;

    /// A clock the test moves.
    struct Manual(Mutex<DateTime<Utc>>);

    impl Clock for Manual {
        fn now(&self) -> DateTime<Utc> {
            *self.0.lock().expect("clock")
        }
    }

    fn at_noon() -> Arc<Manual> {
        let t0 = Utc
            .with_ymd_and_hms(2026, 11, 30, 12, 0, 0)
            .single()
            .expect("t0");
        Arc::new(Manual(Mutex::new(t0)))
    }

    fn advance(clock: &Manual, by: chrono::Duration) {
        *clock.0.lock().expect("clock") += by;
    }

    #[test]
    fn a_burst_is_allowed_then_the_rate_refills_per_account() {
        let clock = at_noon();
        let limiter = RateLimiter::new(
            RateLimit {
                per_second: 2,
                burst: 3,
            },
            clock.clone(),
        );
        let (a, b) = (AccountId::new(), AccountId::new());
        assert!((0..3).all(|_| limiter.allow(a)));
        assert!(!limiter.allow(a), "the burst is spent");
        assert!(limiter.allow(b), "another account has its own bucket");
        advance(&clock, chrono::Duration::milliseconds(500));
        assert!(limiter.allow(a), "half a second refills one token at 2/s");
        assert!(!limiter.allow(a));
    }

    #[test]
    fn zero_turns_the_limiter_off() {
        let limiter = RateLimiter::new(
            RateLimit {
                per_second: 0,
                burst: 0,
            },
            at_noon(),
        );
        assert!((0..10_000).all(|_| limiter.allow(AccountId::new())));
    }

    #[test]
    fn buckets_that_are_full_again_are_forgotten() {
        let clock = at_noon();
        let limiter = RateLimiter::new(
            RateLimit {
                per_second: 10,
                burst: 10,
            },
            clock.clone(),
        );
        for _ in 0..PRUNE_EVERY - 1 {
            limiter.allow(AccountId::new());
        }
        assert_eq!(limiter.len() as u64, PRUNE_EVERY - 1);
        // One refill of the burst later every bucket is full again: the
        // next pruning (this decision) keeps only the one just used.
        advance(&clock, chrono::Duration::seconds(1));
        assert!(limiter.allow(AccountId::new()));
        assert!(limiter.len() <= 1, "{} buckets kept", limiter.len());
    }

    #[test]
    fn a_clock_that_goes_back_refills_nothing() {
        let clock = at_noon();
        let limiter = RateLimiter::new(
            RateLimit {
                per_second: 1,
                burst: 1,
            },
            clock.clone(),
        );
        let a = AccountId::new();
        assert!(limiter.allow(a));
        advance(&clock, chrono::Duration::seconds(-30));
        assert!(!limiter.allow(a));
    }
}
