//! The Standard Webhooks signature (<https://www.standardwebhooks.com/>),
//! which cobro sends alongside its own `Cobro-Signature` so that merchants
//! can verify events with any of the specification's libraries.
//!
//! Three headers: `webhook-id` (the event id, the same on every
//! redelivery), `webhook-timestamp` (unix seconds of the send) and
//! `webhook-signature`: space-separated `v1,<base64 HMAC-SHA256(key,
//! "{id}.{timestamp}.{body}")>`, one per valid secret (two while a secret
//! is being rotated).
//!
//! The key: the specification writes a secret as `whsec_` followed by the
//! key in base64. cobro's endpoint secrets are `whsec_` followed by 64
//! hexadecimal digits, and hexadecimal digits are base64 characters, so the
//! secret as cobro shows it IS a Standard Webhooks secret: its key is the
//! base64 decoding of those 64 characters (48 bytes), and a library given
//! the secret unchanged computes the same signature. A secret that is not
//! of that form (none is generated) is used as its own bytes.

use crate::signature::SignatureError;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

pub const ID_HEADER: &str = "webhook-id";
pub const TIMESTAMP_HEADER: &str = "webhook-timestamp";
pub const SIGNATURE_HEADER: &str = "webhook-signature";

/// The HMAC key of a secret, as the specification reads it.
pub fn key(secret: &str) -> Vec<u8> {
    secret
        .strip_prefix("whsec_")
        .and_then(|encoded| STANDARD.decode(encoded).ok())
        .unwrap_or_else(|| secret.as_bytes().to_vec())
}

fn mac(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> Hmac<Sha256> {
    let mut mac = match <Hmac<Sha256> as KeyInit>::new_from_slice(key) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC-SHA256 takes keys of any length"),
    };
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The `webhook-signature` value for `body` with `id` sent at `timestamp`,
/// signed with every secret in `secrets` (the current one first).
pub fn sign(secrets: &[&str], id: &str, timestamp: i64, body: &[u8]) -> String {
    secrets
        .iter()
        .map(|secret| {
            let digest = mac(&key(secret), id, timestamp, body)
                .finalize()
                .into_bytes();
            format!("v1,{}", STANDARD.encode(digest))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Checks the three headers for `body` against any of `secrets`, as the
/// specification's verifiers do: the timestamp within `tolerance_secs` of
/// `now` either way, and some `v1` signature matching some secret
/// (compared in constant time). Other versions are ignored.
pub fn verify(
    id: &str,
    timestamp: &str,
    signature: &str,
    body: &[u8],
    secrets: &[&str],
    now: i64,
    tolerance_secs: u64,
) -> Result<(), SignatureError> {
    let timestamp: i64 = timestamp
        .trim()
        .parse()
        .map_err(|_| SignatureError::NoTimestamp)?;
    let candidates: Vec<Vec<u8>> = signature
        .split(' ')
        .filter_map(|entry| entry.split_once(','))
        .filter(|(version, _)| *version == "v1")
        .filter_map(|(_, encoded)| STANDARD.decode(encoded).ok())
        .collect();
    crate::signature::judge(
        timestamp,
        now,
        tolerance_secs,
        secrets,
        &candidates,
        |secret| mac(&key(secret), id, timestamp, body),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The specification's own example (its reference libraries test it).
    #[test]
    fn the_specifications_example_signs_and_verifies() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let (id, ts, body) = (
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1_614_265_330,
            br#"{"test": 2432232314}"#,
        );
        let header = sign(&[secret], id, ts, body);
        assert_eq!(header, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        assert_eq!(
            verify(id, "1614265330", &header, body, &[secret], ts, 300),
            Ok(())
        );
        assert_eq!(
            verify(id, "1614265330", &header, b"{}", &[secret], ts, 300),
            Err(SignatureError::NoMatch)
        );
        assert_eq!(
            verify("msg_other", "1614265330", &header, body, &[secret], ts, 300),
            Err(SignatureError::NoMatch)
        );
        assert_eq!(
            verify(id, "1614265330", &header, body, &[secret], ts + 301, 300),
            Err(SignatureError::OutsideTolerance)
        );
    }

    #[test]
    fn a_cobro_secret_is_a_whsec_secret_and_both_rotation_secrets_sign() {
        let new = "whsec_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        assert_eq!(key(new).len(), 48, "64 base64 characters are 48 bytes");
        let old = "not-base64!";
        assert_eq!(key(old), old.as_bytes());
        let header = sign(&[new, old], "e-1", 10, b"x");
        assert_eq!(header.split(' ').count(), 2);
        assert_eq!(verify("e-1", "10", &header, b"x", &[old], 10, 5), Ok(()));
        assert_eq!(verify("e-1", "10", &header, b"x", &[new], 10, 5), Ok(()));
        assert_eq!(
            verify("e-1", "ten", &header, b"x", &[new], 10, 5),
            Err(SignatureError::NoTimestamp)
        );
    }
}
