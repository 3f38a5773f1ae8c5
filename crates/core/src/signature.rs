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

/// The shortest signing secret cobro accepts, in bytes: for a provider's
/// webhooks (`COBRO_WEBHOOK_SECRET`, the providers file) and for event
/// endpoints. HMAC takes a key of any length, so nothing else stops an
/// empty or placeholder secret (`x`, `secret`, `changeme`), with which
/// anyone could sign. 16 bytes is 128 bits when random; providers give out
/// far longer ones (Stripe's `whsec_` and 32 characters), and cobro
/// generates 70-byte endpoint secrets.
pub const MIN_SECRET_BYTES: usize = 16;

/// Why a signing secret is refused. Never carries the secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WeakSecret {
    #[error("is empty")]
    Empty,
    #[error("is {len} bytes long; a signing secret needs at least {MIN_SECRET_BYTES}")]
    TooShort { len: usize },
}

/// Whether `secret` is long enough to sign with ([`MIN_SECRET_BYTES`]).
/// Surrounding whitespace does not count.
pub fn check_secret_length(secret: &str) -> Result<(), WeakSecret> {
    match secret.trim().len() {
        0 => Err(WeakSecret::Empty),
        len if len < MIN_SECRET_BYTES => Err(WeakSecret::TooShort { len }),
        _ => Ok(()),
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
    let candidates: Vec<Vec<u8>> = signatures
        .iter()
        .filter_map(|candidate| hex::decode(candidate).ok())
        .collect();
    judge(
        timestamp,
        now,
        tolerance_secs,
        secrets,
        &candidates,
        |secret| mac(secret.as_bytes(), timestamp, body),
    )
}

/// The verdict of both schemes (this one and `standard_webhooks`): the
/// timestamp within `tolerance_secs` of `now` either way, then some
/// candidate equal to some secret's MAC, compared in constant time.
pub(crate) fn judge(
    timestamp: i64,
    now: i64,
    tolerance_secs: u64,
    secrets: &[&str],
    candidates: &[Vec<u8>],
    mac_of: impl Fn(&str) -> Hmac<Sha256>,
) -> Result<(), SignatureError> {
    if now.abs_diff(timestamp) > tolerance_secs {
        return Err(SignatureError::OutsideTolerance);
    }
    let matched = secrets.iter().any(|secret| {
        let expected = mac_of(secret);
        candidates
            .iter()
            .any(|candidate| expected.clone().verify_slice(candidate).is_ok())
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
    fn empty_and_short_secrets_are_refused_and_stripe_style_ones_accepted() {
        assert_eq!(check_secret_length(""), Err(WeakSecret::Empty));
        assert_eq!(check_secret_length("   "), Err(WeakSecret::Empty));
        assert_eq!(
            check_secret_length("whsec_x"),
            Err(WeakSecret::TooShort { len: 7 })
        );
        assert_eq!(
            check_secret_length(" 0123456789abcde "),
            Err(WeakSecret::TooShort { len: 15 })
        );
        assert_eq!(check_secret_length("0123456789abcdef"), Ok(()));
        // The shape of a Stripe webhook signing secret.
        assert_eq!(
            check_secret_length("whsec_2f5b1c8d9e0a4b7c6d3e1f0a9b8c7d6e"),
            Ok(())
        );
        let shown = WeakSecret::TooShort { len: 3 }.to_string();
        assert!(shown.contains('3') && shown.contains("16"), "{shown}");
    }

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
