//! Live tokens, remembered for a short while so that a request does not
//! spend a pool checkout and a round trip on its token every time.
//!
//! Only live tokens are kept (an unknown or dead token is asked of the
//! database every time, so guessing fills nothing), under their SHA-256,
//! never their text. An entry is trusted for at most [`TokenCache::ttl`] after
//! it was read, by the API's clock: a token revoked in the database (by
//! `cobro tokens revoke`, in another process) stops working within that
//! bound (`ApiSettings::token_cache_ttl`). A token's own expiry is kept with it and holds to the instant.

use chrono::{DateTime, Utc};
use cobro_core::AccountId;
use cobro_store::accounts::LiveToken;
use std::time::Duration;

/// How many live tokens are remembered at most (least recently used go
/// first); each entry is about 150 bytes.
const CAPACITY: usize = 10_000;

#[derive(Clone, Copy)]
struct Entry {
    token: LiveToken,
    read_at: DateTime<Utc>,
}

/// Token hash → its account, for at most `ttl`.
pub struct TokenCache {
    entries: quick_cache::sync::Cache<String, Entry>,
    ttl: Duration,
}

impl TokenCache {
    /// `ttl` zero: nothing is remembered, every request reads its token.
    pub fn new(ttl: Duration) -> Self {
        Self {
            entries: quick_cache::sync::Cache::new(CAPACITY),
            ttl,
        }
    }

    /// The longest a revoked token may still be accepted.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The account of a token remembered as live and still trusted at `now`.
    pub fn get(&self, token_hash: &str, now: DateTime<Utc>) -> Option<AccountId> {
        let entry = self.entries.get(token_hash)?;
        let fresh = now
            .signed_duration_since(entry.read_at)
            .to_std()
            .is_ok_and(|age| age < self.ttl);
        let unexpired = entry.token.expires_at.is_none_or(|at| at > now);
        if fresh && unexpired {
            Some(entry.token.account)
        } else {
            self.entries.remove(token_hash);
            None
        }
    }

    /// Remembers a token the database just said was live at `read_at`.
    pub fn put(&self, token_hash: &str, token: LiveToken, read_at: DateTime<Utc>) {
        if !self.ttl.is_zero() {
            self.entries
                .insert(token_hash.to_owned(), Entry { token, read_at });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeDelta;

    fn live(expires_at: Option<DateTime<Utc>>) -> LiveToken {
        LiveToken {
            account: AccountId::new(),
            expires_at,
        }
    }

    #[test]
    fn an_entry_is_trusted_for_less_than_the_ttl_and_never_past_its_expiry() {
        let cache = TokenCache::new(Duration::from_secs(2));
        let t0 = Utc::now();
        let forever = live(None);
        cache.put("forever", forever, t0);
        assert_eq!(cache.get("forever", t0), Some(forever.account));
        let just_before = t0 + TimeDelta::milliseconds(1999);
        assert_eq!(cache.get("forever", just_before), Some(forever.account));
        assert_eq!(cache.get("forever", t0 + TimeDelta::seconds(2)), None);
        // Gone once stale: a later lookup asks the database again.
        assert_eq!(cache.get("forever", t0), None);

        let expiring = live(Some(t0 + TimeDelta::milliseconds(500)));
        cache.put("expiring", expiring, t0);
        assert_eq!(
            cache.get("expiring", t0 + TimeDelta::milliseconds(499)),
            Some(expiring.account)
        );
        assert_eq!(
            cache.get("expiring", t0 + TimeDelta::milliseconds(500)),
            None
        );
        // A clock that went backwards does not extend an entry's trust.
        cache.put("forever", forever, t0);
        assert_eq!(cache.get("forever", t0 - TimeDelta::seconds(1)), None);
    }

    #[test]
    fn a_zero_ttl_remembers_nothing() {
        let cache = TokenCache::new(Duration::ZERO);
        let t0 = Utc::now();
        cache.put("t", live(None), t0);
        assert_eq!(cache.get("t", t0), None);
    }
}
