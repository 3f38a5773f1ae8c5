//! Virtual time: real time plus an offset that only ever grows.
//!
//! Key retention, search lag and event timestamps read this clock, so a test
//! can expire a 24 h idempotency key by moving the clock instead of waiting.
//! Real delays (latency faults, webhook backoff) deliberately stay in real
//! time: they exist to exercise a client's timeouts.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

/// Shared virtual clock; the offset is an atomic so reading the time on the
/// hot path takes no lock.
#[derive(Debug, Default)]
pub(crate) struct VirtualClock {
    /// Nanoseconds added to the real clock (i64 nanoseconds cover ~292 years).
    offset_nanos: AtomicI64,
}

impl VirtualClock {
    /// A clock that reads `start` now (real time when `None`), and moves on
    /// with real time from there.
    pub(crate) fn starting_at(start: Option<DateTime<Utc>>) -> Self {
        let offset = start.map_or(0, |start| {
            (start - Utc::now())
                .num_nanoseconds()
                .unwrap_or(i64::MIN / 2)
        });
        Self {
            offset_nanos: AtomicI64::new(offset),
        }
    }

    pub(crate) fn now(&self) -> DateTime<Utc> {
        Utc::now() + TimeDelta::nanoseconds(self.offset_nanos.load(Ordering::Relaxed))
    }

    pub(crate) fn advance(&self, by: Duration) -> DateTime<Utc> {
        let nanos = i64::try_from(by.as_nanos()).unwrap_or(i64::MAX);
        let previous = self.offset_nanos.fetch_add(nanos, Ordering::Relaxed);
        // Saturate rather than wrap: a wrapped offset would send time backwards.
        if previous.checked_add(nanos).is_none() {
            self.offset_nanos.store(i64::MAX, Ordering::Relaxed);
        }
        self.now()
    }
}

/// Converts a std duration to chrono's, saturating instead of failing.
pub(crate) fn delta(d: Duration) -> TimeDelta {
    TimeDelta::from_std(d).unwrap_or(TimeDelta::MAX)
}
