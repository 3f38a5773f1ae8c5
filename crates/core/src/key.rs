//! The `Idempotency-Key` header value.

use sha2::{Digest, Sha256};
use std::fmt;

/// A validated idempotency key: 1 to 255 visible ASCII characters (`%x21-7E`).
///
/// Both the bare form (`abc-123`, as Stripe clients send it) and the IETF
/// structured-field string form (`"abc-123"`) are accepted and mean the same
/// key. Deliberately no `Display`: a key must never reach a log line by
/// accident; log [`IdempotencyKey::hash`] instead.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the Idempotency-Key must be 1 to 255 visible ASCII characters")]
    Invalid,
}

impl IdempotencyKey {
    pub const MAX_LEN: usize = 255;

    pub fn parse(raw: &str) -> Result<Self, KeyError> {
        let visible = |s: &str| {
            !s.is_empty()
                && s.len() <= Self::MAX_LEN
                && s.bytes().all(|b| (0x21..=0x7e).contains(&b))
        };
        // sf-string: `"` + 1 to 255 visible characters without `"` or `\`
        // (escapes are not accepted because a key never needs them) + `"`.
        let quoted = raw
            .strip_prefix('"')
            .and_then(|rest| rest.strip_suffix('"'))
            .filter(|inner| visible(inner) && !inner.bytes().any(|b| b == b'"' || b == b'\\'));
        match quoted {
            Some(inner) => Ok(Self(inner.to_owned())),
            // Anything else is the bare form, which may contain (or start
            // with) `"` like any other visible character.
            None if visible(raw) => Ok(Self(raw.to_owned())),
            None => Err(KeyError::Invalid),
        }
    }

    /// The key as stored and compared (without structured-field quotes).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A short hash that is safe to log and to correlate on.
    pub fn hash(&self) -> KeyHash {
        KeyHash::of(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({})", self.hash())
    }
}

/// The first 12 hex digits of SHA-256 of a secret-ish value: enough to
/// correlate log lines, not enough to recover the value.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyHash([u8; 6]);

impl KeyHash {
    pub fn of(value: &str) -> Self {
        let digest = Sha256::digest(value.as_bytes());
        let mut out = [0u8; 6];
        out.copy_from_slice(&digest[..6]);
        Self(out)
    }
}

impl fmt::Display for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_and_quoted_forms_are_the_same_key() {
        let bare = IdempotencyKey::parse("8e03978e-40d5-43e8-bc93-6894a57f9324").expect("bare");
        let quoted =
            IdempotencyKey::parse("\"8e03978e-40d5-43e8-bc93-6894a57f9324\"").expect("quoted");
        assert_eq!(bare, quoted);
        assert_eq!(bare.as_str(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
    }

    #[test]
    fn length_bounds_are_1_to_255() {
        assert!(IdempotencyKey::parse(&"a".repeat(255)).is_ok());
        assert_eq!(
            IdempotencyKey::parse(&"a".repeat(256)),
            Err(KeyError::Invalid)
        );
        assert_eq!(IdempotencyKey::parse(""), Err(KeyError::Invalid));
        // 255 inside the quotes is the limit of the quoted form too.
        let quoted = format!("\"{}\"", "a".repeat(255));
        assert_eq!(
            IdempotencyKey::parse(&quoted)
                .expect("quoted")
                .as_str()
                .len(),
            255
        );
    }

    /// docs/http-api.md §3: any 1 to 255 visible characters are a bare key, so a
    /// `"` that does not make a structured-field string is just a character.
    #[test]
    fn bare_keys_may_contain_and_start_with_quotes() {
        for bare in [
            "\"unterminated",
            "\"a\"b\"",
            "\"\"",
            "\"",
            "a\"b",
            "\"x\\y\"",
        ] {
            let key = IdempotencyKey::parse(bare).expect(bare);
            assert_eq!(key.as_str(), bare);
        }
        assert_eq!(
            IdempotencyKey::parse("\"ab\"").expect("quoted").as_str(),
            "ab"
        );
    }

    #[test]
    fn spaces_controls_and_non_ascii_are_refused() {
        for bad in [
            "a b",
            "tab\there",
            "ñandú",
            "new\nline",
            "nul\0byte",
            "\"quoted with space\"",
        ] {
            assert_eq!(
                IdempotencyKey::parse(bad),
                Err(KeyError::Invalid),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn debug_output_shows_only_the_hash() {
        let key = IdempotencyKey::parse("super-secret-key").expect("valid");
        let shown = format!("{key:?}");
        assert!(!shown.contains("super-secret-key"));
        assert_eq!(key.hash().to_string().len(), 12);
    }
}
