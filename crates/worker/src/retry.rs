//! When and whether to retry a send whose outcome was not definitive.

use rand::Rng;
use std::sync::Mutex;
use std::time::Duration;

/// Capped exponential backoff with full jitter: a uniformly random delay in
/// `[0, min(cap, base * 2^sends))`. Full jitter spreads a herd of retries
/// after an outage instead of re-synchronising it.
pub fn backoff(base: Duration, cap: Duration, sends: u32) -> Duration {
    let exp = base.saturating_mul(1u32.checked_shl(sends.min(20)).unwrap_or(u32::MAX));
    let ceiling = exp.min(cap).as_millis().max(1) as u64;
    Duration::from_millis(rand::rng().random_range(0..ceiling))
}

/// A per-provider budget of retries as a share of first sends (a token
/// bucket): every first send adds `ratio` tokens, every retry takes one.
/// During an outage retries stop multiplying the load; they wait for the
/// budget instead of being dropped.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    max: f64,
    tokens: Mutex<f64>,
}

impl RetryBudget {
    /// `floor` tokens are there from the start (and the bucket holds at most
    /// `floor` plus what first sends add, capped at `max`), so a quiet
    /// system can still retry.
    pub fn new(ratio: f64, floor: f64, max: f64) -> Self {
        Self {
            ratio,
            max: max.max(floor),
            tokens: Mutex::new(floor),
        }
    }

    pub fn on_first_send(&self) {
        let mut t = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        *t = (*t + self.ratio).min(self.max);
    }

    /// Takes one retry token; `false` means the retry must wait.
    pub fn try_retry(&self) -> bool {
        let mut t = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        if *t >= 1.0 {
            *t -= 1.0;
            true
        } else {
            false
        }
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
                assert!(backoff(base, cap, sends) < ceiling.max(Duration::from_millis(1)));
            }
        }
    }

    #[test]
    fn the_budget_allows_retries_only_as_a_share_of_first_sends() {
        let budget = RetryBudget::new(0.5, 2.0, 10.0);
        assert!(budget.try_retry());
        assert!(budget.try_retry());
        assert!(!budget.try_retry(), "the floor is spent");
        budget.on_first_send();
        assert!(!budget.try_retry(), "half a token is not a retry");
        budget.on_first_send();
        assert!(budget.try_retry());
        for _ in 0..100 {
            budget.on_first_send();
        }
        let mut granted = 0;
        while budget.try_retry() {
            granted += 1;
        }
        assert_eq!(granted, 10, "capped at max");
    }
}
