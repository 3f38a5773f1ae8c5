//! Every Stripe answer classified (issue 13, item 2; the table of
//! docs/recovery.md §2, Classification): [`TABLE`] is read top to bottom
//! and the first row that matches decides. Each row names the integration
//! test (`tests/stripe.rs`) that drives it through a real HTTP exchange
//! with Stripe's own bodies and headers, and a unit test below pins it;
//! the crate README shows the same table (a test keeps the three in step).
//!
//! Only `NotSent` and `Unknown` are retried, and only with the same key;
//! `Unknown` never lets anyone charge with a new key.

use super::objects::{PaymentIntent, Refund, StripeError};
use crate::{Outcome, ProviderObject};

/// The operation a send was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Authorize,
    Capture,
    Void,
    Refund,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Authorize => "authorize",
            Op::Capture => "capture",
            Op::Void => "void",
            Op::Refund => "refund",
        }
    }

    fn is_follow_up(self) -> bool {
        self != Op::Authorize
    }
}

/// What came back from one send, as the table reads it.
// One per send, moved once into the outcome: boxing the answer buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Heard {
    /// No connection was made (refused, DNS, TLS): not a byte was sent.
    NotConnected(String),
    /// Sent, and no whole answer came back (timeout, reset or close after
    /// the request was written, the body lost after the status).
    NoAnswer(String),
    Answer(Answer),
}

/// An HTTP answer.
#[derive(Clone, Debug)]
pub struct Answer {
    pub status: u16,
    /// `Stripe-Should-Retry`, when sent.
    pub should_retry: Option<bool>,
    pub body: Body,
}

/// The body, read as what Stripe sends for that status.
#[derive(Clone, Debug)]
pub enum Body {
    PaymentIntent(PaymentIntent),
    Refund(Refund),
    Error(StripeError),
    /// Not what Stripe sends (empty, a proxy's HTML, cut short, another
    /// object than asked for).
    Malformed,
}

/// The class of a row: which [`Outcome`] it builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Succeeded,
    Declined,
    Failed,
    NotSent,
    Unknown,
}

impl Class {
    /// The [`Outcome`] variant it builds.
    pub fn name(self) -> &'static str {
        match self {
            Class::Succeeded => "Succeeded",
            Class::Declined => "Declined",
            Class::Failed => "Failed",
            Class::NotSent => "NotSent",
            Class::Unknown => "Unknown",
        }
    }
}

/// The failure code of a call Stripe refused for cobro's credentials
/// (401, 403): nothing executed.
pub const CREDENTIALS_REFUSED: &str = "provider_credentials_refused";

/// One row of the table.
pub struct Row {
    /// Stable name: in the outcome's reason, the span and the README.
    pub id: &'static str,
    /// The answer it matches, in words.
    pub when: &'static str,
    pub class: Class,
    pub why: &'static str,
    /// The integration test (`tests/stripe.rs`) that proves it.
    pub test: &'static str,
    matches: fn(Op, &Heard) -> bool,
}

impl Row {
    /// The row as the crate README shows it.
    pub fn markdown(&self) -> String {
        format!(
            "| `{}` | {} | {} | {} | `{}` |",
            self.id,
            self.when,
            self.class.name(),
            self.why,
            self.test
        )
    }
}

impl std::fmt::Debug for Row {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.id)
    }
}

// The predicates, one per row, in table order.

fn answer(heard: &Heard) -> Option<&Answer> {
    match heard {
        Heard::Answer(a) => Some(a),
        _ => None,
    }
}

fn ok(heard: &Heard) -> Option<&Body> {
    answer(heard)
        .filter(|a| (200..300).contains(&a.status))
        .map(|a| &a.body)
}

/// A refused request's error, with its status.
fn refused(heard: &Heard) -> Option<(u16, &StripeError, Option<bool>)> {
    let a = answer(heard).filter(|a| !(200..300).contains(&a.status))?;
    match &a.body {
        Body::Error(e) => Some((a.status, e, a.should_retry)),
        _ => None,
    }
}

fn status_of(heard: &Heard) -> Option<u16> {
    answer(heard).map(|a| a.status)
}

fn not_connected(_: Op, heard: &Heard) -> bool {
    matches!(heard, Heard::NotConnected(_))
}

fn no_answer(_: Op, heard: &Heard) -> bool {
    matches!(heard, Heard::NoAnswer(_))
}

fn proven(op: Op, heard: &Heard) -> bool {
    match (op, ok(heard)) {
        (Op::Authorize, Some(Body::PaymentIntent(pi))) => {
            matches!(pi.status.as_str(), "requires_capture" | "succeeded")
        }
        (Op::Capture, Some(Body::PaymentIntent(pi))) => pi.status == "succeeded",
        (Op::Void, Some(Body::PaymentIntent(pi))) => pi.status == "canceled",
        (Op::Refund, Some(Body::Refund(r))) => r.status.as_deref() == Some("succeeded"),
        _ => false,
    }
}

fn authorize_declined_2xx(op: Op, heard: &Heard) -> bool {
    matches!((op, ok(heard)), (Op::Authorize, Some(Body::PaymentIntent(pi)))
        if pi.status == "requires_payment_method" && pi.last_payment_error.is_some())
}

fn authorize_requires_action(op: Op, heard: &Heard) -> bool {
    matches!((op, ok(heard)), (Op::Authorize, Some(Body::PaymentIntent(pi)))
        if pi.status == "requires_action")
}

fn authorize_needs_customer(op: Op, heard: &Heard) -> bool {
    matches!((op, ok(heard)), (Op::Authorize, Some(Body::PaymentIntent(pi)))
        if matches!(pi.status.as_str(), "requires_confirmation" | "requires_payment_method"))
}

fn authorize_in_progress_2xx(op: Op, heard: &Heard) -> bool {
    matches!((op, ok(heard)), (Op::Authorize, Some(Body::PaymentIntent(pi)))
        if pi.status == "processing")
}

fn refund_refused_2xx(op: Op, heard: &Heard) -> bool {
    matches!((op, ok(heard)), (Op::Refund, Some(Body::Refund(r)))
        if matches!(r.status.as_deref(), Some("failed" | "canceled")))
}

fn not_yet(op: Op, heard: &Heard) -> bool {
    matches!(
        (op, ok(heard)),
        (
            Op::Authorize | Op::Capture | Op::Void,
            Some(Body::PaymentIntent(_))
        ) | (Op::Refund, Some(Body::Refund(_)))
    )
}

fn malformed_2xx(_: Op, heard: &Heard) -> bool {
    ok(heard).is_some()
}

fn idempotency_mismatch(_: Op, heard: &Heard) -> bool {
    refused(heard).is_some_and(|(_, e, _)| e.is("idempotency_error"))
}

fn key_in_use(_: Op, heard: &Heard) -> bool {
    status_of(heard) == Some(409)
        || refused(heard).is_some_and(|(_, e, _)| e.has_code("idempotency_key_in_use"))
}

fn lock_timeout(_: Op, heard: &Heard) -> bool {
    refused(heard).is_some_and(|(s, e, _)| s == 429 && e.has_code("lock_timeout"))
}

fn rate_limited(_: Op, heard: &Heard) -> bool {
    status_of(heard) == Some(429)
}

fn rate_limited_400(_: Op, heard: &Heard) -> bool {
    refused(heard).is_some_and(|(s, e, _)| s == 400 && e.has_code("rate_limit"))
}

fn unauthenticated(_: Op, heard: &Heard) -> bool {
    matches!(status_of(heard), Some(401 | 403))
}

fn object_unknown_to_key(op: Op, heard: &Heard) -> bool {
    op.is_follow_up()
        && refused(heard).is_some_and(|(s, e, _)| {
            e.is("invalid_request_error")
                && ((s == 404 && e.has_code("resource_missing")) || e.has_code("livemode_mismatch"))
        })
}

/// A 4xx refusal of the kind the rows below call definitive.
fn refusal(heard: &Heard) -> Option<(&StripeError, Option<bool>)> {
    refused(heard)
        .filter(|(s, e, _)| match e.kind.as_deref() {
            Some("card_error") => (400..500).contains(s),
            Some("invalid_request_error") => matches!(s, 400 | 402 | 404),
            _ => false,
        })
        .map(|(_, e, retry)| (e, retry))
}

fn refusal_stripe_says_retry(_: Op, heard: &Heard) -> bool {
    refusal(heard).is_some_and(|(_, retry)| retry == Some(true))
}

fn card_error_on_authorize(op: Op, heard: &Heard) -> bool {
    op == Op::Authorize && refusal(heard).is_some_and(|(e, _)| e.is("card_error"))
}

fn card_error_on_follow_up(op: Op, heard: &Heard) -> bool {
    op.is_follow_up() && refusal(heard).is_some_and(|(e, _)| e.is("card_error"))
}

fn invalid_request(_: Op, heard: &Heard) -> bool {
    refusal(heard).is_some_and(|(e, _)| e.is("invalid_request_error"))
}

fn server_side(heard: &Heard) -> Option<Option<bool>> {
    let a = answer(heard)?;
    let api_error = matches!(&a.body, Body::Error(e) if e.is("api_error"));
    (a.status >= 500 || a.status == 424 || api_error).then_some(a.should_retry)
}

fn server_error_replayed(_: Op, heard: &Heard) -> bool {
    server_side(heard) == Some(Some(false))
}

fn server_error(_: Op, heard: &Heard) -> bool {
    server_side(heard).is_some()
}

fn malformed_error(_: Op, heard: &Heard) -> bool {
    answer(heard).is_some_and(|a| a.status >= 400 && matches!(a.body, Body::Malformed))
}

fn anything(_: Op, _: &Heard) -> bool {
    true
}

/// The row of an authorisation left waiting for a confirmation or a
/// payment method cobro never gives, whose PaymentIntent the connector
/// then cancels.
pub const NEEDS_CUSTOMER: &str = "authorize_needs_customer";

/// The table. First match wins; the last row matches everything.
pub const TABLE: &[Row] = &[
    Row {
        id: "not_connected",
        when: "connection refused, DNS or TLS failure (or a request that could not even be built)",
        class: Class::NotSent,
        why: "no byte of the request reached Stripe; the same attempt is sent again with the same key",
        test: "a_refused_connection_is_not_sent",
        matches: not_connected,
    },
    Row {
        id: "no_answer",
        when: "timeout, reset or close after the request was written; body lost after the status",
        class: Class::Unknown,
        why: "Stripe may have executed it; only the same key (or the reconciler) can tell",
        test: "a_timeout_after_sending_is_unknown",
        matches: no_answer,
    },
    Row {
        id: "proven",
        when: "2xx with the object in the state the operation proves: authorize `requires_capture` or `succeeded`, capture `succeeded`, void `canceled`, refund `succeeded`",
        class: Class::Succeeded,
        why: "the effect happened (`fit` still checks it is this attempt's: metadata, amount, currency, capture method)",
        test: "a_manual_authorisation_is_sent_as_stripe_documents_it",
        matches: proven,
    },
    Row {
        id: "authorize_declined_2xx",
        when: "authorize 2xx, `requires_payment_method` with `last_payment_error`",
        class: Class::Declined,
        why: "the confirmation failed on the card side (Stripe usually says so with a 402 `card_error`); nothing was charged",
        test: "an_authorisation_answered_declined_with_2xx_is_declined",
        matches: authorize_declined_2xx,
    },
    Row {
        id: "authorize_requires_action",
        when: "authorize 2xx, `requires_action`",
        class: Class::Succeeded,
        why: "the card asks its holder to authenticate (3-D Secure): passed up with the object and its `next_action`; cobro records the payment `requires_action` (not unknown: never resent, never a new key) and it ends by proof (a webhook, the reconciler's read, the merchant's GET) or by its expiry",
        test: "an_authorisation_that_needs_the_customer_waits_for_them",
        matches: authorize_requires_action,
    },
    Row {
        id: NEEDS_CUSTOMER,
        when: "authorize 2xx, `requires_confirmation` or `requires_payment_method` without an error",
        class: Class::Failed,
        why: "cobro confirms in the same request and never confirms later: nothing was charged, no funds are held, and nothing will be; the connector then cancels the PaymentIntent, best effort, under the derived key `<key>:cancel`",
        test: "an_authorisation_that_needs_the_customer_failed",
        matches: authorize_needs_customer,
    },
    Row {
        id: "authorize_in_progress_2xx",
        when: "authorize 2xx, `processing`",
        class: Class::Succeeded,
        why: "the PaymentIntent was made and its outcome is not final: passed up with the object, which cobro judges in progress (never absence) and hands to the reconciler at once, since a resend under the same key would replay this same answer for as long as the key lives",
        test: "a_processing_payment_intent_is_passed_up_in_progress",
        matches: authorize_in_progress_2xx,
    },
    Row {
        id: "refund_refused_2xx",
        when: "refund 2xx with status `failed` or `canceled`",
        class: Class::Failed,
        why: "the refund says nothing was refunded",
        test: "a_refund_answered_failed_failed",
        matches: refund_refused_2xx,
    },
    Row {
        id: "not_yet",
        when: "any other 2xx object: `processing`, a refund `pending` or `requires_action`, a capture not `succeeded`, a void not `canceled`, a status cobro does not know",
        class: Class::Unknown,
        why: "the effect has not happened yet, or not provably: the webhook or the reconciler's GET or listing settles it",
        test: "a_refund_answered_pending_is_unknown",
        matches: not_yet,
    },
    Row {
        id: "malformed_2xx",
        when: "2xx whose body is not the object asked for",
        class: Class::Unknown,
        why: "a success cobro cannot read proves nothing",
        test: "a_malformed_success_is_unknown",
        matches: malformed_2xx,
    },
    Row {
        id: "idempotency_mismatch",
        when: "`idempotency_error` (400: the key was used with other parameters)",
        class: Class::Unknown,
        why: "a cobro bug: its keys are never reused for another request, and the first use may have had an effect; alarmed (error log, `outcome=\"idempotency_error\"` metric), never resent under a new key",
        test: "an_idempotency_error_is_unknown_and_alarmed",
        matches: idempotency_mismatch,
    },
    Row {
        id: "key_in_use",
        when: "409 (`idempotency_key_in_use`)",
        class: Class::Unknown,
        why: "a request with this key is still executing at Stripe; retry with the same key",
        test: "a_key_in_use_is_unknown",
        matches: key_in_use,
    },
    Row {
        id: "lock_timeout",
        when: "429 `lock_timeout`",
        class: Class::Unknown,
        why: "the object was locked by another request or a Stripe process; Stripe's libraries retry it, but Stripe does not document that nothing executed, so cobro does not claim it",
        test: "a_lock_timeout_is_unknown",
        matches: lock_timeout,
    },
    Row {
        id: "rate_limited",
        when: "429 (any other: `rate_limit`)",
        class: Class::NotSent,
        why: "Stripe's rate limiters run before its idempotency layer: nothing executed, nothing was saved under the key",
        test: "a_rate_limited_request_is_not_sent",
        matches: rate_limited,
    },
    Row {
        id: "rate_limited_400",
        when: "400 with code `rate_limit` (whatever its type)",
        class: Class::NotSent,
        why: "Stripe's older answer to rate limiting, which its libraries still read as a 429 (stripe-python: \"rate limits were previously coded as 400's with code 'rate_limit'\"): the same limiter, before the idempotency layer, so nothing executed; above `invalid_request`, which would call it definitive",
        test: "a_legacy_400_rate_limit_is_not_sent",
        matches: rate_limited_400,
    },
    Row {
        id: "unauthenticated",
        when: "401, 403",
        class: Class::Failed,
        why: "Stripe authenticates the key and checks its permissions before any endpoint executes, so nothing happened; final (code `provider_credentials_refused`) rather than retried for the whole key window under a key that stays refused until someone fixes it: the order is free at once, and the `credentials_refused` outcome pages (CobroProviderCredentialsRefused)",
        test: "an_unauthenticated_request_fails_having_done_nothing",
        matches: unauthenticated,
    },
    Row {
        id: "object_unknown_to_key",
        when: "capture, void or refund answered 404 `resource_missing` (or `livemode_mismatch`)",
        class: Class::Unknown,
        why: "cobro got that PaymentIntent from Stripe; not finding it means the key is another account's or mode's, which proves nothing about the PaymentIntent",
        test: "a_capture_of_a_payment_intent_stripe_cannot_find_is_unknown",
        matches: object_unknown_to_key,
    },
    Row {
        id: "refusal_stripe_says_retry",
        when: "a refusal below with `Stripe-Should-Retry: true`",
        class: Class::Unknown,
        why: "Stripe says a retry may succeed: the refusal is not definitive",
        test: "a_refusal_stripe_says_to_retry_is_unknown",
        matches: refusal_stripe_says_retry,
    },
    Row {
        id: "card_error_on_authorize",
        when: "authorize 4xx `card_error` (402 with `decline_code`)",
        class: Class::Declined,
        why: "the issuer or Stripe's risk checks refused the card; the PaymentIntent waits for another payment method, which cobro never gives: nothing was charged",
        test: "a_card_error_on_authorize_is_declined",
        matches: card_error_on_authorize,
    },
    Row {
        id: "card_error_on_follow_up",
        when: "capture, void or refund 4xx `card_error`",
        class: Class::Failed,
        why: "a refusal of that operation by the card side; the PaymentIntent sent with it says where the charge is",
        test: "a_card_error_on_capture_failed",
        matches: card_error_on_follow_up,
    },
    Row {
        id: "invalid_request",
        when: "400, 402 or 404 `invalid_request_error` (invalid parameter, `payment_intent_unexpected_state`, `charge_expired_for_capture`, `amount_too_large`, `charge_already_refunded`, an unknown payment method, ...)",
        class: Class::Failed,
        why: "Stripe refused the request itself: nothing executed and nothing was charged (a 400 under the same key replays); the PaymentIntent sent with it is the truth of the charge",
        test: "a_capture_of_a_canceled_payment_intent_failed_with_it",
        matches: invalid_request,
    },
    Row {
        id: "server_error_replayed",
        when: "5xx, 424 or `api_error` with `Stripe-Should-Retry: false`",
        class: Class::Unknown,
        why: "indeterminate, and a resend under the key only replays it (`CallInfo.should_retry`): the reconciler decides",
        test: "a_replayed_server_error_is_unknown_and_says_not_to_retry",
        matches: server_error_replayed,
    },
    Row {
        id: "server_error",
        when: "5xx, 424 or `api_error`",
        class: Class::Unknown,
        why: "Stripe's docs: treat a 500 as indeterminate (it may be rolled forward); retry with the same key",
        test: "a_server_error_is_unknown",
        matches: server_error,
    },
    Row {
        id: "malformed_error",
        when: "any other 4xx or 5xx whose body is not Stripe's error",
        class: Class::Unknown,
        why: "not Stripe's answer (a proxy, a cut body): proves nothing",
        test: "a_refusal_cobro_cannot_read_is_unknown",
        matches: malformed_error,
    },
    Row {
        id: "unexpected",
        when: "anything else (3xx, another 4xx, an error type cobro does not know)",
        class: Class::Unknown,
        why: "no proof either way",
        test: "an_unexpected_status_is_unknown",
        matches: anything,
    },
];

/// The row that decides `heard` for `op`.
pub fn row_for(op: Op, heard: &Heard) -> &'static Row {
    TABLE
        .iter()
        .find(|row| (row.matches)(op, heard))
        .unwrap_or(&TABLE[TABLE.len() - 1])
}

/// The outcome `row` builds from `heard`. `scrub` removes what must never
/// reach a log (the idempotency key, which some of Stripe's messages
/// quote). NotSent and Unknown reasons start with the row's id and name
/// Stripe's request id, so a log line leads to Stripe's log of it.
pub fn outcome(
    row: &Row,
    heard: Heard,
    request_id: Option<&str>,
    scrub: &dyn Fn(&str) -> String,
) -> Outcome {
    let request = request_id
        .map(|id| format!(" (request {id})"))
        .unwrap_or_default();
    let said = |heard: &Heard| match heard {
        Heard::NotConnected(why) | Heard::NoAnswer(why) => why.clone(),
        Heard::Answer(a) => match &a.body {
            Body::Error(e) => format!(
                "Stripe answered {} {}/{}",
                a.status,
                e.kind.as_deref().unwrap_or("-"),
                e.code.as_deref().unwrap_or("-")
            ),
            Body::PaymentIntent(pi) => {
                format!("Stripe answered {} with {} {}", a.status, pi.id, pi.status)
            }
            Body::Refund(r) => format!(
                "Stripe answered {} with {} {}",
                a.status,
                r.id,
                r.status.as_deref().unwrap_or("null")
            ),
            Body::Malformed => {
                format!("Stripe answered {} with a body cobro cannot read", a.status)
            }
        },
    };
    let reason = |heard: &Heard| scrub(&format!("{}: {}{request}", row.id, said(heard)));
    match row.class {
        Class::NotSent if matches!(heard, Heard::NotConnected(_)) => {
            Outcome::NotConnected(reason(&heard))
        }
        Class::NotSent => Outcome::NotSent(reason(&heard)),
        Class::Unknown => Outcome::Unknown(reason(&heard)),
        Class::Succeeded => match object_of(heard) {
            Some(object) => Outcome::Succeeded(object),
            None => Outcome::Unknown(format!("{}: no object to adopt{request}", row.id)),
        },
        // Stripe's message names (part of) the key: cobro's own code and
        // reason instead.
        Class::Failed if row.id == "unauthenticated" => Outcome::Failed {
            code: CREDENTIALS_REFUSED.to_owned(),
            message: reason(&heard),
            object: None,
        },
        Class::Declined | Class::Failed => {
            let (code, message, object) = refusal_parts(row, heard);
            let message = scrub(&message);
            if row.class == Class::Declined {
                Outcome::Declined {
                    code,
                    message,
                    object,
                }
            } else {
                Outcome::Failed {
                    code,
                    message,
                    object,
                }
            }
        }
    }
}

fn object_of(heard: Heard) -> Option<ProviderObject> {
    match heard {
        Heard::Answer(Answer {
            body: Body::PaymentIntent(pi),
            ..
        }) => Some(pi.into_object()),
        Heard::Answer(Answer {
            body: Body::Refund(r),
            ..
        }) => Some(r.into_object()),
        Heard::Answer(Answer {
            body: Body::Error(e),
            ..
        }) => e.payment_intent.map(|pi| pi.into_object()),
        _ => None,
    }
}

/// Code, message and object of a decline or failure. A decline's code is
/// the issuer's `decline_code` when there is one (`insufficient_funds`),
/// else Stripe's `code` (`expired_card`).
fn refusal_parts(row: &Row, heard: Heard) -> (String, String, Option<ProviderObject>) {
    let from_error = |e: &StripeError, fallback: &str| {
        let code = e.decline().unwrap_or(fallback).to_owned();
        (code, e.message.clone().unwrap_or_default())
    };
    let (code, message) = match &heard {
        Heard::Answer(Answer {
            body: Body::Error(e),
            ..
        }) => from_error(e, e.kind.as_deref().unwrap_or(row.id)),
        Heard::Answer(Answer {
            body: Body::PaymentIntent(pi),
            ..
        }) => match &pi.last_payment_error {
            Some(e) if row.class == Class::Declined => from_error(e, "card_declined"),
            _ => (
                pi.status.clone(),
                format!(
                    "PaymentIntent {} is {}: cobro neither authenticates nor confirms later, nothing was charged",
                    pi.id, pi.status
                ),
            ),
        },
        Heard::Answer(Answer {
            body: Body::Refund(r),
            ..
        }) => (
            format!("refund_{}", r.status.as_deref().unwrap_or("null")),
            format!(
                "refund {} {} ({})",
                r.id,
                r.status.as_deref().unwrap_or("null"),
                r.failure_reason.as_deref().unwrap_or("no reason given")
            ),
        ),
        _ => (row.id.to_owned(), String::new()),
    };
    (code, message, object_of(heard))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pi(status: &str, error: bool) -> PaymentIntent {
        let last = if error {
            r#"{"type":"card_error","code":"card_declined","decline_code":"generic_decline","message":"Your card was declined."}"#
        } else {
            "null"
        };
        serde_json::from_str(&format!(
            r#"{{"id":"pi_1","object":"payment_intent","status":"{status}","amount":1999,"currency":"eur",
               "capture_method":"manual","metadata":{{"cobro_reference":"r/1"}},"last_payment_error":{last}}}"#
        ))
        .expect("PaymentIntent")
    }

    fn refund(status: &str) -> Refund {
        serde_json::from_str(&format!(
            r#"{{"id":"re_1","object":"refund","status":"{status}","amount":5,"currency":"eur","payment_intent":"pi_1"}}"#
        ))
        .expect("refund")
    }

    fn error(json: &str) -> StripeError {
        serde_json::from_str::<super::super::objects::ErrorBody>(json)
            .expect("error body")
            .error
    }

    fn heard(status: u16, should_retry: Option<bool>, body: Body) -> Heard {
        Heard::Answer(Answer {
            status,
            should_retry,
            body,
        })
    }

    fn decide(op: Op, heard: Heard) -> (&'static str, Outcome) {
        let row = row_for(op, &heard);
        (
            row.id,
            outcome(row, heard, Some("req_1"), &|s| s.to_owned()),
        )
    }

    fn check(op: Op, heard: Heard, id: &str, class: &str) -> Outcome {
        let (row, outcome) = decide(op, heard);
        assert_eq!(row, id);
        assert_eq!(outcome.class(), class, "{outcome:?}");
        outcome
    }

    #[test]
    fn not_connected_is_not_sent() {
        check(
            Op::Authorize,
            Heard::NotConnected("connect error".into()),
            "not_connected",
            "not_sent",
        );
    }

    #[test]
    fn no_answer_is_unknown() {
        check(
            Op::Capture,
            Heard::NoAnswer("timeout".into()),
            "no_answer",
            "unknown",
        );
    }

    #[test]
    fn proven_objects_succeed_for_each_operation() {
        for (op, body) in [
            (
                Op::Authorize,
                Body::PaymentIntent(pi("requires_capture", false)),
            ),
            (Op::Authorize, Body::PaymentIntent(pi("succeeded", false))),
            (Op::Capture, Body::PaymentIntent(pi("succeeded", false))),
            (Op::Void, Body::PaymentIntent(pi("canceled", false))),
            (Op::Refund, Body::Refund(refund("succeeded"))),
        ] {
            check(op, heard(200, None, body), "proven", "succeeded");
        }
    }

    #[test]
    fn authorize_declined_2xx_is_declined_with_the_issuers_code() {
        let o = check(
            Op::Authorize,
            heard(
                200,
                None,
                Body::PaymentIntent(pi("requires_payment_method", true)),
            ),
            "authorize_declined_2xx",
            "declined",
        );
        assert!(matches!(o, Outcome::Declined { code, .. } if code == "generic_decline"));
    }

    #[test]
    fn authorize_requires_action_passes_the_object_and_its_action_up() {
        let o = check(
            Op::Authorize,
            heard(200, None, Body::PaymentIntent(pi("requires_action", false))),
            "authorize_requires_action",
            "succeeded",
        );
        match o {
            Outcome::Succeeded(object) => {
                assert_eq!(object.status, crate::ProviderStatus::RequiresAction);
                assert!(object.next_action.is_some(), "{object:?}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn authorize_needs_customer_failed() {
        for status in ["requires_confirmation", "requires_payment_method"] {
            let o = check(
                Op::Authorize,
                heard(200, None, Body::PaymentIntent(pi(status, false))),
                "authorize_needs_customer",
                "failed",
            );
            assert!(matches!(o, Outcome::Failed { code, .. } if code == status));
        }
    }

    #[test]
    fn refund_refused_2xx_failed() {
        for status in ["failed", "canceled"] {
            check(
                Op::Refund,
                heard(200, None, Body::Refund(refund(status))),
                "refund_refused_2xx",
                "failed",
            );
        }
    }

    #[test]
    fn authorize_in_progress_2xx_passes_the_object_up() {
        let o = check(
            Op::Authorize,
            heard(200, None, Body::PaymentIntent(pi("processing", false))),
            "authorize_in_progress_2xx",
            "succeeded",
        );
        match o {
            Outcome::Succeeded(object) => {
                assert_eq!(
                    object.status,
                    crate::ProviderStatus::Other("processing".into())
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn not_yet_is_unknown() {
        for (op, body) in [
            (Op::Authorize, Body::PaymentIntent(pi("canceled", false))),
            (
                Op::Capture,
                Body::PaymentIntent(pi("requires_capture", false)),
            ),
            (Op::Capture, Body::PaymentIntent(pi("processing", false))),
            (Op::Void, Body::PaymentIntent(pi("succeeded", false))),
            (Op::Refund, Body::Refund(refund("pending"))),
            (Op::Refund, Body::Refund(refund("requires_action"))),
            (Op::Refund, Body::Refund(refund("brand_new"))),
        ] {
            check(op, heard(200, None, body), "not_yet", "unknown");
        }
    }

    #[test]
    fn malformed_2xx_is_unknown() {
        check(
            Op::Authorize,
            heard(200, None, Body::Malformed),
            "malformed_2xx",
            "unknown",
        );
        // A refund where a PaymentIntent was asked for is not an answer.
        check(
            Op::Capture,
            heard(200, None, Body::Refund(refund("succeeded"))),
            "malformed_2xx",
            "unknown",
        );
    }

    #[test]
    fn idempotency_mismatch_is_unknown_and_never_quotes_the_key() {
        let e = error(
            r#"{"error":{"message":"Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than 'key-7' if you meant to execute a different request.","type":"idempotency_error"}}"#,
        );
        let heard = heard(400, None, Body::Error(e));
        let row = row_for(Op::Authorize, &heard);
        assert_eq!(row.id, "idempotency_mismatch");
        let o = outcome(row, heard, None, &|s: &str| s.replace("key-7", "***"));
        assert_eq!(o.class(), "unknown");
        assert!(!format!("{o:?}").contains("key-7"));
    }

    #[test]
    fn key_in_use_is_unknown() {
        let e =
            error(r#"{"error":{"code":"idempotency_key_in_use","type":"invalid_request_error"}}"#);
        check(
            Op::Authorize,
            heard(409, Some(true), Body::Error(e)),
            "key_in_use",
            "unknown",
        );
        check(
            Op::Refund,
            heard(409, None, Body::Malformed),
            "key_in_use",
            "unknown",
        );
    }

    #[test]
    fn lock_timeout_is_unknown() {
        let e = error(r#"{"error":{"code":"lock_timeout","type":"invalid_request_error"}}"#);
        check(
            Op::Capture,
            heard(429, Some(true), Body::Error(e)),
            "lock_timeout",
            "unknown",
        );
    }

    #[test]
    fn rate_limited_is_not_sent() {
        let e = error(r#"{"error":{"code":"rate_limit","type":"invalid_request_error"}}"#);
        check(
            Op::Authorize,
            heard(429, None, Body::Error(e)),
            "rate_limited",
            "not_sent",
        );
        check(
            Op::Authorize,
            heard(429, None, Body::Malformed),
            "rate_limited",
            "not_sent",
        );
    }

    #[test]
    fn rate_limited_400_is_not_sent_like_a_429() {
        for kind in ["invalid_request_error", "rate_limit_error", "api_error"] {
            let e = error(&format!(
                r#"{{"error":{{"code":"rate_limit","type":"{kind}","message":"Too many requests hit the API too quickly."}}}}"#
            ));
            let o = check(
                Op::Authorize,
                heard(400, None, Body::Error(e)),
                "rate_limited_400",
                "not_sent",
            );
            assert!(
                matches!(&o, Outcome::NotSent(why) if why.starts_with("rate_limited_400: ")
                    && why.ends_with("(request req_1)")),
                "{o:?}"
            );
        }
        // Refunds and follow-ups alike.
        let e = error(r#"{"error":{"code":"rate_limit","type":"invalid_request_error"}}"#);
        check(
            Op::Refund,
            heard(400, Some(true), Body::Error(e)),
            "rate_limited_400",
            "not_sent",
        );
        // Another 400 stays what it was; a 402 `rate_limit` is not Stripe's
        // old answer.
        let other = error(
            r#"{"error":{"code":"parameter_invalid_integer","type":"invalid_request_error"}}"#,
        );
        check(
            Op::Authorize,
            heard(400, None, Body::Error(other)),
            "invalid_request",
            "failed",
        );
        let odd = error(r#"{"error":{"code":"rate_limit","type":"invalid_request_error"}}"#);
        check(
            Op::Authorize,
            heard(402, None, Body::Error(odd)),
            "invalid_request",
            "failed",
        );
    }

    #[test]
    fn unauthenticated_fails_having_done_nothing() {
        let e = error(
            r#"{"error":{"message":"Invalid API Key provided: sk_test_****1234","type":"invalid_request_error"}}"#,
        );
        let o = check(
            Op::Authorize,
            heard(401, None, Body::Error(e)),
            "unauthenticated",
            "failed",
        );
        assert!(
            !format!("{o:?}").contains("sk_test"),
            "Stripe's message is not repeated"
        );
        match o {
            Outcome::Failed { code, object, .. } => {
                assert_eq!(code, CREDENTIALS_REFUSED);
                assert_eq!(object, None);
            }
            other => panic!("{other:?}"),
        }
        check(
            Op::Void,
            heard(403, None, Body::Malformed),
            "unauthenticated",
            "failed",
        );
    }

    #[test]
    fn object_unknown_to_key_is_unknown_on_follow_ups_only() {
        let missing = || {
            error(
                r#"{"error":{"code":"resource_missing","param":"intent","message":"No such payment_intent: 'pi_1'","type":"invalid_request_error"}}"#,
            )
        };
        for op in [Op::Capture, Op::Void, Op::Refund] {
            check(
                op,
                heard(404, None, Body::Error(missing())),
                "object_unknown_to_key",
                "unknown",
            );
        }
        // On authorize the missing object is the payment method: nothing was created.
        check(
            Op::Authorize,
            heard(404, None, Body::Error(missing())),
            "invalid_request",
            "failed",
        );
    }

    #[test]
    fn refusal_stripe_says_retry_is_unknown() {
        let e = error(
            r#"{"error":{"code":"card_declined","decline_code":"try_again_later","type":"card_error"}}"#,
        );
        check(
            Op::Authorize,
            heard(402, Some(true), Body::Error(e)),
            "refusal_stripe_says_retry",
            "unknown",
        );
    }

    #[test]
    fn card_error_on_authorize_is_declined() {
        let e = error(
            r#"{"error":{"code":"card_declined","decline_code":"insufficient_funds","message":"Your card has insufficient funds.","type":"card_error",
                "payment_intent":{"id":"pi_1","object":"payment_intent","status":"requires_payment_method","last_payment_error":{"type":"card_error"}}}}"#,
        );
        let o = check(
            Op::Authorize,
            heard(402, Some(false), Body::Error(e)),
            "card_error_on_authorize",
            "declined",
        );
        match o {
            Outcome::Declined { code, object, .. } => {
                assert_eq!(code, "insufficient_funds");
                assert_eq!(
                    object.map(|o| o.status),
                    Some(crate::ProviderStatus::Declined)
                );
            }
            other => panic!("{other:?}"),
        }
        let expired = error(r#"{"error":{"code":"expired_card","type":"card_error"}}"#);
        let o = check(
            Op::Authorize,
            heard(402, None, Body::Error(expired)),
            "card_error_on_authorize",
            "declined",
        );
        assert!(matches!(o, Outcome::Declined { code, .. } if code == "expired_card"));
    }

    #[test]
    fn card_error_on_follow_up_failed() {
        let e = error(r#"{"error":{"code":"card_declined","type":"card_error"}}"#);
        check(
            Op::Capture,
            heard(402, None, Body::Error(e)),
            "card_error_on_follow_up",
            "failed",
        );
    }

    #[test]
    fn invalid_request_failed_with_the_payment_intent_as_it_is() {
        let e = error(
            r#"{"error":{"code":"payment_intent_unexpected_state","type":"invalid_request_error",
                "payment_intent":{"id":"pi_1","object":"payment_intent","status":"canceled","amount":5,"currency":"eur","latest_charge":"ch_1"}}}"#,
        );
        let o = check(
            Op::Capture,
            heard(400, None, Body::Error(e)),
            "invalid_request",
            "failed",
        );
        match o {
            Outcome::Failed { code, object, .. } => {
                assert_eq!(code, "payment_intent_unexpected_state");
                assert_eq!(
                    object.map(|o| o.status),
                    Some(crate::ProviderStatus::Voided)
                );
            }
            other => panic!("{other:?}"),
        }
        let no_code = error(
            r#"{"error":{"message":"Received unknown parameter: x","type":"invalid_request_error"}}"#,
        );
        check(
            Op::Refund,
            heard(400, None, Body::Error(no_code)),
            "invalid_request",
            "failed",
        );
    }

    #[test]
    fn server_error_replayed_is_unknown() {
        let e = error(r#"{"error":{"message":"An unknown error occurred","type":"api_error"}}"#);
        check(
            Op::Authorize,
            heard(500, Some(false), Body::Error(e)),
            "server_error_replayed",
            "unknown",
        );
    }

    #[test]
    fn server_error_is_unknown() {
        let e = || error(r#"{"error":{"message":"An unknown error occurred","type":"api_error"}}"#);
        check(
            Op::Authorize,
            heard(500, None, Body::Error(e())),
            "server_error",
            "unknown",
        );
        check(
            Op::Authorize,
            heard(503, Some(true), Body::Malformed),
            "server_error",
            "unknown",
        );
        check(
            Op::Authorize,
            heard(424, None, Body::Malformed),
            "server_error",
            "unknown",
        );
        check(
            Op::Refund,
            heard(400, None, Body::Error(e())),
            "server_error",
            "unknown",
        );
        // A card_error with a 5xx is Stripe's trouble, not the card's.
        let card = error(r#"{"error":{"code":"card_declined","type":"card_error"}}"#);
        check(
            Op::Authorize,
            heard(502, None, Body::Error(card)),
            "server_error",
            "unknown",
        );
    }

    #[test]
    fn malformed_error_is_unknown() {
        check(
            Op::Authorize,
            heard(400, None, Body::Malformed),
            "malformed_error",
            "unknown",
        );
        check(
            Op::Capture,
            heard(404, None, Body::Malformed),
            "malformed_error",
            "unknown",
        );
    }

    #[test]
    fn unexpected_is_unknown() {
        let e = || error(r#"{"error":{"type":"brand_new_error"}}"#);
        check(
            Op::Authorize,
            heard(400, None, Body::Error(e())),
            "unexpected",
            "unknown",
        );
        check(
            Op::Authorize,
            heard(302, None, Body::Error(e())),
            "unexpected",
            "unknown",
        );
        let invalid = error(r#"{"error":{"type":"invalid_request_error"}}"#);
        check(
            Op::Authorize,
            heard(405, None, Body::Error(invalid)),
            "unexpected",
            "unknown",
        );
    }

    /// Every row has a unit test above (named after its id) and the
    /// integration test it names; the README shows each row with both.
    #[test]
    fn the_table_its_tests_and_the_readme_agree() {
        let unit = include_str!("classify.rs");
        let integration = include_str!("../../tests/stripe.rs");
        let readme = include_str!("../../README.md");
        let mut ids = std::collections::BTreeSet::new();
        for row in TABLE {
            assert!(ids.insert(row.id), "{} twice", row.id);
            assert!(
                unit.contains(&format!("fn {}_", row.id)),
                "no unit test for {}",
                row.id
            );
            assert!(
                integration.contains(&format!("fn {}(", row.test)),
                "{} names the missing test {}",
                row.id,
                row.test
            );
            assert!(
                readme.contains(&row.markdown()),
                "the README lacks row {}; its table is\n{}",
                row.id,
                TABLE
                    .iter()
                    .map(Row::markdown)
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
        assert!(
            (TABLE[TABLE.len() - 1].matches)(Op::Authorize, &Heard::NoAnswer(String::new())),
            "the last row matches everything"
        );
    }
}
