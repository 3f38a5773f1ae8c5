//! Signed HTTP bodies: `t=<unix seconds>,v1=<hex HMAC-SHA256(secret,
//! "<t>.<raw body>")>[,v1=...]`.
//!
//! One implementation for the three places that need it: cobro verifies
//! its providers' webhooks with it (`Fake-Signature`), signs its own events
//! to merchants with it (`Cobro-Signature`), and merchants verify those
//! with it (`cobro-client`). During a secret rotation the signer sends one
//! `v1` per valid secret and the verifier accepts any that matches.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Why a signature was refused. Never carries the header or a secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("no timestamp in the signature")]
    NoTimestamp,
    #[error("the signature's timestamp is outside the tolerance")]
    OutsideTolerance,
    #[error("no signature matches")]
    NoMatch,
}

impl SignatureError {
    /// A short stable reason, for logs and metrics.
    pub fn reason(self) -> &'static str {
        match self {
            SignatureError::NoTimestamp => "no timestamp",
            SignatureError::OutsideTolerance => "timestamp outside the tolerance",
            SignatureError::NoMatch => "no signature matches",
        }
    }
}

fn mac(secret: &[u8], timestamp: i64, body: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length: this cannot fail.
    let mut mac = match <Hmac<Sha256> as KeyInit>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC-SHA256 takes keys of any length"),
    };
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The header value for `body` sent at `timestamp`, signed with every
/// secret in `secrets` (the current one first).
pub fn sign(secrets: &[&str], timestamp: i64, body: &[u8]) -> String {
    let mut header = format!("t={timestamp}");
    for secret in secrets {
        let digest = mac(secret.as_bytes(), timestamp, body)
            .finalize()
            .into_bytes();
        header.push_str(",v1=");
        header.push_str(&hex::encode(digest));
    }
    header
}

/// Checks `header` for `body` against any of `secrets`: the timestamp must
/// be within `tolerance_secs` of `now` (either way, so an old capture
/// cannot be replayed), and some `v1` value must match some secret,
/// compared in constant time. Unknown schemes (a future `v2`) are ignored.
pub fn verify(
    header: &str,
    body: &[u8],
    secrets: &[&str],
    now: i64,
    tolerance_secs: u64,
) -> Result<(), SignatureError> {
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", t)) => timestamp = t.parse::<i64>().ok(),
            Some(("v1", v1)) => signatures.push(v1),
            _ => {}
        }
    }
    let timestamp = timestamp.ok_or(SignatureError::NoTimestamp)?;
    if now.abs_diff(timestamp) > tolerance_secs {
        return Err(SignatureError::OutsideTolerance);
    }
    let matched = secrets.iter().any(|secret| {
        let expected = mac(secret.as_bytes(), timestamp, body);
        signatures.iter().any(|candidate| {
            hex::decode(candidate).is_ok_and(|bytes| expected.clone().verify_slice(&bytes).is_ok())
        })
    });
    if matched {
        Ok(())
    } else {
        Err(SignatureError::NoMatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_signed_with_two_secrets_verifies_with_either() {
        let header = sign(&["new", "old"], 1_000, b"{}");
        assert_eq!(verify(&header, b"{}", &["old"], 1_000, 300), Ok(()));
        assert_eq!(verify(&header, b"{}", &["new"], 1_100, 300), Ok(()));
        assert_eq!(
            verify(&header, b"{}", &["other"], 1_000, 300),
            Err(SignatureError::NoMatch)
        );
        assert_eq!(
            verify(&header, b"{ }", &["new"], 1_000, 300),
            Err(SignatureError::NoMatch)
        );
    }

    #[test]
    fn a_stale_or_undated_signature_is_refused() {
        let header = sign(&["s"], 1_000, b"x");
        assert_eq!(
            verify(&header, b"x", &["s"], 1_301, 300),
            Err(SignatureError::OutsideTolerance)
        );
        assert_eq!(
            verify("v1=00", b"x", &["s"], 1_000, 300),
            Err(SignatureError::NoTimestamp)
        );
        assert_eq!(
            verify("t=1000,v1=zz", b"x", &["s"], 1_000, 300),
            Err(SignatureError::NoMatch)
        );
    }
}
