//! API tokens: `cobro_` followed by 32 random bytes in hex (256 bits from
//! a CSPRNG). The secret is shown once; the store keeps only its SHA-256
//! (lowercase hex of the whole token text, prefix included), which is the
//! lookup key the API hashes a presented bearer token to.
//!
//! A fast hash is enough here: with 256 bits of entropy there is nothing to
//! brute-force, and a slow password hash per request would only cost latency.

use chrono::{DateTime, Utc};
use cobro_core::{AccountId, TokenId};
use cobro_store::Store;
use rand::RngCore;

/// The visible prefix: lets secret scanners and humans recognise a token.
pub const TOKEN_PREFIX: &str = "cobro_";

/// How many characters of a token `tokens list` shows: the prefix and 8
/// hex digits (32 of its 256 bits), enough to tell tokens apart, far too
/// few to guess the rest.
pub const DISPLAY_LEN: usize = TOKEN_PREFIX.len() + 8;

/// A freshly generated token: the secret to show once, and what to store.
pub struct NewToken {
    /// The bearer token; never logged, never stored.
    pub secret: String,
    /// SHA-256 of `secret`, lowercase hex; what the store keeps.
    pub hash: String,
}

impl NewToken {
    pub fn generate() -> Self {
        let mut bytes = [0u8; 32];
        // ThreadRng is a CSPRNG seeded from the OS.
        rand::rng().fill_bytes(&mut bytes);
        let secret = format!("{TOKEN_PREFIX}{}", hex::encode(bytes));
        let hash = token_hash(&secret);
        Self { secret, hash }
    }
}

/// The stored form of a token: the same function the API hashes a
/// presented bearer token with.
pub use cobro_api::token_hash;

/// A token just stored: its id (for `tokens list` and `tokens revoke`) and
/// the secret to show once.
pub struct Issued {
    pub id: TokenId,
    pub secret: String,
}

/// Generates a token for `account` (refused from `expires_at` on, if set),
/// stores its hash, returns its id and secret.
pub async fn issue(
    store: &Store,
    account: AccountId,
    label: &str,
    now: DateTime<Utc>,
    expires_at: Option<DateTime<Utc>>,
) -> cobro_store::Result<Issued> {
    let token = NewToken::generate();
    let row = cobro_store::accounts::NewTokenRow {
        label,
        token_hash: &token.hash,
        prefix: &token.secret[..DISPLAY_LEN],
        expires_at,
    };
    let id = store.create_token_expiring(account, &row, now).await?;
    tracing::info!(token_id = %id, account_id = %account, label, "API token created");
    Ok(Issued {
        id,
        secret: token.secret,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_prefixed_high_entropy_and_stored_only_as_their_hash() {
        let a = NewToken::generate();
        let b = NewToken::generate();
        assert!(a.secret.starts_with(TOKEN_PREFIX));
        assert_eq!(a.secret.len(), TOKEN_PREFIX.len() + 64);
        assert_ne!(a.secret, b.secret);
        assert_eq!(a.hash, token_hash(&a.secret));
        assert_eq!(a.hash.len(), 64);
        assert!(!a.hash.contains(&a.secret[TOKEN_PREFIX.len()..]));
    }

    #[test]
    fn the_hash_is_sha256_hex_of_the_whole_token() {
        // SHA-256("abc"), FIPS 180-2 test vector.
        assert_eq!(
            token_hash("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
