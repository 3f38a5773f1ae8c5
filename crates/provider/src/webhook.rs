//! A provider's webhooks on the wire: how a delivery is signed and what an
//! event says. Each provider has its own [`WebhookScheme`]; the HTTP
//! endpoint (`cobro-api`) picks the scheme configured for the
//! `{provider}` of `/v1/webhooks/{provider}`, and what an event proves is
//! applied by `cobro-settle`, the same for every provider.

use crate::ProviderObject;
use reqwest::header::HeaderMap;
use serde_json::{Map, Value};
use std::fmt;
use std::time::Duration;

/// A provider's webhook signing secret. Its `Debug` never shows the value,
/// so settings can be logged.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(String);

impl WebhookSecret {
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into())
    }

    /// The secret itself, to verify with or to hand to whoever signs (the
    /// embedded fake provider); never for logs.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WebhookSecret(***)")
    }
}

/// What an event says happened, in cobro's terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Authorized,
    Captured,
    Declined,
    Voided,
    RefundSucceeded,
    /// A refund failed or was canceled at the provider: nothing was
    /// refunded (what it proves is read from the refund's status).
    RefundFailed,
    /// A type cobro does not act on; stored as `unmatched`.
    Other,
}

impl EventKind {
    /// About a charge (ordered by the charge's event sequence), as opposed
    /// to a refund or an event cobro ignores.
    pub fn is_charge(self) -> bool {
        !matches!(
            self,
            EventKind::RefundSucceeded | EventKind::RefundFailed | EventKind::Other
        )
    }
}

/// The fields of an event cobro uses; the rest is kept in the raw payload.
#[derive(Clone, Debug)]
pub struct ProviderEvent {
    /// The provider's event id: a redelivery carries the same one.
    pub id: String,
    /// The provider's own type name, as sent (for the record and logs).
    pub type_name: String,
    pub kind: EventKind,
    /// The provider's per-charge counter: "never backwards" compares it.
    /// A provider that has none (Stripe) derives it from the object's
    /// state order and the event's time (`StripeWebhooks`).
    pub sequence: i64,
    /// The merchant reference cobro sent (`{intent}/{attempt id}`).
    pub reference: String,
    /// The charge or refund the event carries, as the provider reports it.
    pub object: ProviderObject,
}

/// One field of an event that is missing, mistyped or unstorable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldProblem {
    pub field: String,
    pub message: String,
}

impl FieldProblem {
    pub(crate) fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// How one provider signs its deliveries and shapes its events.
pub trait WebhookScheme: Send + Sync + 'static {
    /// Checks the delivery's signature against `secrets` (any one that
    /// verifies is enough), with the timestamp within `tolerance` of `now`
    /// (unix seconds). `Err`: why not, for a log line that shows neither
    /// the header nor a secret.
    fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        secrets: &[&str],
        now: i64,
        tolerance: Duration,
    ) -> Result<(), &'static str>;

    /// Parses a verified body, naming every field that is wrong. Nothing
    /// with U+0000 passes (it cannot be stored or logged).
    fn parse(&self, body: &[u8]) -> Result<ProviderEvent, Vec<FieldProblem>>;
}

/// Checks the one `name` header of a delivery, in the `t=<unix
/// seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<raw body>")>` scheme the fake
/// provider and Stripe share (`cobro_core::signature`).
pub(crate) fn verify_signature_header(
    headers: &HeaderMap,
    name: &str,
    body: &[u8],
    secrets: &[&str],
    now: i64,
    tolerance: Duration,
) -> Result<(), &'static str> {
    let mut values = headers.get_all(name).iter();
    let header = match (values.next(), values.next()) {
        (Some(one), None) => one.to_str().map_err(|_| "header not ASCII")?,
        (None, _) => return Err("header missing"),
        _ => return Err("more than one header"),
    };
    cobro_core::signature::verify(header, body, secrets, now, tolerance.as_secs())
        .map_err(|e| e.reason())
}

/// A delivery's body as the JSON object every scheme's events are: UTF-8,
/// an object, and no U+0000 anywhere (a clear 400 rather than a 500 the
/// provider would redeliver forever: such text cannot be stored).
pub(crate) fn json_object(body: &[u8]) -> Result<Map<String, Value>, Vec<FieldProblem>> {
    let invalid = |message: String| vec![FieldProblem::new("body", message)];
    let text = std::str::from_utf8(body).map_err(|_| invalid("is not UTF-8".to_owned()))?;
    let root: Map<String, Value> = match serde_json::from_str(text) {
        Ok(Value::Object(map)) => map,
        Ok(_) => return Err(invalid("must be a JSON object".to_owned())),
        Err(e) => return Err(invalid(format!("is not valid JSON (line {})", e.line()))),
    };
    if let Some(field) = cobro_core::text::unstorable_text(&root) {
        return Err(vec![FieldProblem::new(
            field,
            "must not contain U+0000 (NUL)",
        )]);
    }
    Ok(root)
}

/// The fake provider's scheme: `Fake-Signature: t=<unix seconds>,v1=<hex
/// HMAC-SHA256(secret, "<t>.<raw body>")>` (one or more `v1`, as while a
/// secret rotates), and events `{id, type, sequence, data: charge|refund}`
/// with types `charge.authorized|captured|declined|voided` and
/// `refund.succeeded`.
#[derive(Clone, Copy, Debug, Default)]
pub struct FakeWebhooks;

impl FakeWebhooks {
    /// The signature header's name.
    pub const SIGNATURE_HEADER: &'static str = "fake-signature";

    fn kind(type_name: &str) -> EventKind {
        match type_name {
            "charge.authorized" => EventKind::Authorized,
            "charge.captured" => EventKind::Captured,
            "charge.declined" => EventKind::Declined,
            "charge.voided" => EventKind::Voided,
            "refund.succeeded" => EventKind::RefundSucceeded,
            "refund.failed" => EventKind::RefundFailed,
            _ => EventKind::Other,
        }
    }
}

impl WebhookScheme for FakeWebhooks {
    fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        secrets: &[&str],
        now: i64,
        tolerance: Duration,
    ) -> Result<(), &'static str> {
        verify_signature_header(
            headers,
            Self::SIGNATURE_HEADER,
            body,
            secrets,
            now,
            tolerance,
        )
    }

    fn parse(&self, body: &[u8]) -> Result<ProviderEvent, Vec<FieldProblem>> {
        let root = json_object(body)?;
        let mut errors = Vec::new();
        let mut string = |map: &Map<String, Value>, prefix: &str, name: &str, required: bool| {
            match map.get(name) {
                Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
                None | Some(Value::Null) if !required => None,
                _ => {
                    errors.push(FieldProblem::new(
                        format!("{prefix}{name}"),
                        "must be a non-empty string",
                    ));
                    None
                }
            }
        };
        let id = string(&root, "", "id", true);
        let type_name = string(&root, "", "type", true);
        let data = match root.get("data") {
            Some(Value::Object(data)) => data.clone(),
            _ => Map::new(),
        };
        let object_id = string(&data, "data.", "id", true);
        let reference = string(&data, "data.", "reference", true);
        let kind = type_name.as_deref().map(Self::kind);
        let _charge = string(
            &data,
            "data.",
            "charge",
            kind == Some(EventKind::RefundSucceeded),
        );
        let object = serde_json::from_value::<ProviderObject>(Value::Object(data));
        if object.is_err() {
            errors.push(FieldProblem::new("data", "must be a charge or a refund"));
        }
        let sequence = root.get("sequence").and_then(Value::as_i64);
        if sequence.is_none_or(|s| s < 0) {
            errors.push(FieldProblem::new(
                "sequence",
                "must be a non-negative integer",
            ));
        }
        if !matches!(root.get("data"), Some(Value::Object(_))) {
            errors.push(FieldProblem::new("data", "must be an object"));
        }
        match (id, type_name, kind, sequence, object_id, reference, object) {
            (
                Some(id),
                Some(type_name),
                Some(kind),
                Some(sequence),
                Some(_),
                Some(reference),
                Ok(object),
            ) if errors.is_empty() => Ok(ProviderEvent {
                id,
                type_name,
                kind,
                sequence,
                reference,
                object,
            }),
            _ => Err(errors),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    const NOW: i64 = 1_800_000_000;
    const BODY: &[u8] = br#"{"id":"evt_1"}"#;

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            FakeWebhooks::SIGNATURE_HEADER,
            HeaderValue::from_str(value).expect("ascii"),
        );
        h
    }

    fn check(value: &str) -> Result<(), &'static str> {
        FakeWebhooks.verify(
            &headers(value),
            BODY,
            &["whsec_x"],
            NOW,
            Duration::from_secs(300),
        )
    }

    fn sign(secret: &str, t: i64, body: &[u8]) -> String {
        cobro_core::signature::sign(&[secret], t, body)
    }

    #[test]
    fn a_signature_made_with_the_secret_within_the_tolerance_verifies() {
        let t = NOW - 299;
        assert!(check(&sign("whsec_x", t, BODY)).is_ok());
        // A rotating provider may send several v1 values.
        let both = format!("{},v1=00", sign("whsec_x", t, BODY));
        assert!(check(&both).is_ok());
    }

    #[test]
    fn wrong_secret_old_or_future_timestamp_and_garbage_are_refused() {
        for bad in [
            sign("whsec_other", NOW, BODY),
            sign("whsec_x", NOW - 301, BODY),
            sign("whsec_x", NOW + 301, BODY),
            sign("whsec_x", NOW, b"{}"),
            format!("t={NOW}"),
            "v1=abcd".to_owned(),
            "garbage".to_owned(),
            format!("t={NOW},v1=zz"),
        ] {
            assert!(check(&bad).is_err(), "{bad}");
        }
        let none = FakeWebhooks.verify(
            &HeaderMap::new(),
            BODY,
            &["whsec_x"],
            NOW,
            Duration::from_secs(300),
        );
        assert_eq!(none, Err("header missing"));
        let mut twice = headers(&sign("whsec_x", NOW, BODY));
        twice.append(
            FakeWebhooks::SIGNATURE_HEADER,
            HeaderValue::from_str(&sign("whsec_x", NOW, BODY)).expect("ascii"),
        );
        let twice = FakeWebhooks.verify(&twice, BODY, &["whsec_x"], NOW, Duration::from_secs(300));
        assert_eq!(twice, Err("more than one header"));
    }

    #[test]
    fn the_secret_never_shows_in_debug_output() {
        assert!(!format!("{:?}", WebhookSecret::new("whsec_hunter2")).contains("hunter2"));
    }

    #[test]
    fn events_without_their_fields_are_refused_with_every_field_named() {
        let errors = FakeWebhooks
            .parse(br#"{"type":"refund.succeeded","data":{}}"#)
            .expect_err("refused");
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        for field in ["id", "sequence", "data.id", "data.reference", "data.charge"] {
            assert!(fields.contains(&field), "{field} in {fields:?}");
        }
        assert!(FakeWebhooks.parse(b"not json").is_err());
        assert!(FakeWebhooks.parse(b"[1]").is_err());
        let nul = FakeWebhooks
            .parse(b"{\"id\":\"evt\\u0000\"}")
            .expect_err("refused");
        assert_eq!(nul[0].field, "id");
    }

    #[test]
    fn a_charge_event_parses() {
        let body = br#"{"id":"evt_1","type":"charge.captured","created":"2026-11-30T10:00:00Z","sequence":2,
            "data":{"id":"ch_1","object":"charge","amount":1999,"currency":"EUR","reference":"o-1:authorize-v1","status":"captured"}}"#;
        let event = FakeWebhooks.parse(body).expect("parses");
        assert_eq!(event.kind, EventKind::Captured);
        assert_eq!(event.type_name, "charge.captured");
        assert_eq!(event.sequence, 2);
        assert_eq!(event.object.id, "ch_1");
        assert_eq!(event.object.amount, Some(1999));
        assert_eq!(event.object.currency.as_deref(), Some("EUR"));
    }
}
