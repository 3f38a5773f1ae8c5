//! What cobro writes to Stripe: `application/x-www-form-urlencoded` bodies
//! with Stripe's bracketed names for nested fields, and quoted strings of
//! its Search query language.
//!
//! A body is a flat, ordered list of `(name, value)` pairs whose names are
//! already spelled the way Stripe reads them (`metadata[cobro_attempt]`,
//! `payment_method_types[0]`), encoded by `form_urlencoded` (the rust-url
//! project's WHATWG encoder). No serde layer: cobro sends five kinds of
//! field, the wire names are the specification, and a test can compare
//! the exact list that was sent. (`serde_urlencoded` has no nested keys;
//! `serde_qs` has them, but would make the wire names a by-product of
//! struct shapes and its own array and bracket conventions.)

use crate::Outcome;
use cobro_core::Currency;
use cobro_core::money::stripe_wire_amount;
use std::collections::BTreeMap;

/// A form body (or query string) in the order it is sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Form(Vec<(String, String)>);

impl Form {
    pub fn new() -> Self {
        Self::default()
    }

    /// `name=value`.
    pub fn field(mut self, name: &str, value: impl Into<String>) -> Self {
        self.0.push((name.to_owned(), value.into()));
        self
    }

    /// `name=value` when there is a value; nothing otherwise.
    pub fn field_opt(self, name: &str, value: Option<&str>) -> Self {
        match value {
            Some(value) => self.field(name, value),
            None => self,
        }
    }

    /// `name[key]=value` for every entry, in key order (a hash, as
    /// `metadata`).
    pub fn hash(mut self, name: &str, entries: &BTreeMap<String, String>) -> Self {
        for (key, value) in entries {
            // A bracket in a key would be read as another level of nesting;
            // cobro's keys are its own constants.
            debug_assert!(!key.contains(['[', ']']), "nested key {key}");
            self.0.push((format!("{name}[{key}]"), value.clone()));
        }
        self
    }

    /// `name[0]=..&name[1]=..` (an array, as `payment_method_types`).
    pub fn array(mut self, name: &str, items: &[&str]) -> Self {
        for (i, item) in items.iter().enumerate() {
            self.0.push((format!("{name}[{i}]"), (*item).to_owned()));
        }
        self
    }

    /// The pairs, as they are sent.
    #[cfg(test)]
    pub fn pairs(&self) -> &[(String, String)] {
        &self.0
    }

    /// The encoded body or query string: every byte but `A-Z a-z 0-9 * -
    /// . _` percent-encoded (UTF-8), a space as `+`.
    pub fn encode(&self) -> String {
        form_urlencoded::Serializer::new(String::new())
            .extend_pairs(&self.0)
            .finish()
    }
}

/// A send answered before anything was sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unsent {
    /// A definitive refusal: `Outcome::Failed` with this code and message
    /// and no object.
    Refused { code: &'static str, message: String },
    /// What the body needs could not be read: `Outcome::NotSent`, retried
    /// with the same key.
    NotSent(String),
}

impl Unsent {
    pub fn into_outcome(self) -> Outcome {
        match self {
            Unsent::Refused { code, message } => Outcome::Failed {
                code: code.to_owned(),
                message,
                object: None,
            },
            Unsent::NotSent(why) => Outcome::NotSent(why),
        }
    }
}

/// The `amount` field: `minor` of cobro's minor units of `currency` (ISO,
/// any case) as Stripe counts them, by the one currency table
/// ([`stripe_wire_amount`]): ISK 5000 is `500000`, KWD 5120 is `5120`.
/// `Err` is the definitive refusal of what Stripe cannot take (KWD 5124,
/// whose last of three decimals is not 0; MGA 150, a fraction of an
/// ariary) or of a currency cobro does not know: nothing is sent, and an
/// amount is never rounded into another one.
pub fn amount(currency: &str, minor: i64) -> Result<String, Unsent> {
    let Ok(known) = Currency::parse(currency) else {
        return Err(Unsent::Refused {
            code: "currency_unknown",
            message: format!("cobro does not know the currency {currency:?}: nothing was sent"),
        });
    };
    stripe_wire_amount(known, minor)
        .map(|wire| wire.to_string())
        .map_err(|e| Unsent::Refused {
            code: e.code(),
            message: format!("{e}: nothing was sent"),
        })
}

/// A string value of Stripe's Search query language, quoted: `'...'` with
/// a backslash before every `\` and `'` inside. cobro's references never
/// hold either (the order reference alphabet is `A-Z a-z 0-9 . _ : -`),
/// but a search that could be widened by its input is not written.
pub fn search_quoted(text: &str) -> String {
    let mut quoted = String::with_capacity(text.len() + 2);
    quoted.push('\'');
    for c in text.chars() {
        if c == '\\' || c == '\'' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('\'');
    quoted
}

/// `metadata['<key>']:'<value>'`: an exact match on one metadata entry.
pub fn metadata_equals(key: &str, value: &str) -> String {
    format!("metadata[{}]:{}", search_quoted(key), search_quoted(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded(encoded: &str) -> Vec<(String, String)> {
        form_urlencoded::parse(encoded.as_bytes())
            .into_owned()
            .collect()
    }

    #[test]
    fn nested_names_are_spelled_with_brackets_in_order() {
        let metadata = BTreeMap::from([
            ("cobro_b".to_owned(), "2".to_owned()),
            ("cobro_a".to_owned(), "1".to_owned()),
        ]);
        let form = Form::new()
            .field("amount", "1999")
            .array("payment_method_types", &["card", "link"])
            .hash("metadata", &metadata);
        assert_eq!(
            form.encode(),
            "amount=1999&payment_method_types%5B0%5D=card&payment_method_types%5B1%5D=link\
             &metadata%5Bcobro_a%5D=1&metadata%5Bcobro_b%5D=2"
        );
        assert_eq!(decoded(&form.encode()), form.pairs());
    }

    #[test]
    fn reserved_characters_and_unicode_survive_the_round_trip() {
        let value = "o'1 & a=b + c/d?e#f%g\u{e9}\u{20ac}\u{1f600}";
        let form = Form::new().field("metadata[cobro_reference]", value);
        let encoded = form.encode();
        // Only the form's own separator is left bare: one `=`, no `&`.
        assert_eq!(encoded.matches('=').count(), 1, "{encoded}");
        assert!(
            !encoded.contains(['&', '\'', '#', '?', '/', ' ']),
            "{encoded}"
        );
        assert!(encoded.contains("%27"), "' is %27: {encoded}");
        assert!(encoded.contains("%26"), "& is %26: {encoded}");
        assert!(encoded.contains("%3D"), "= is %3D: {encoded}");
        assert!(encoded.contains("%2B"), "+ is %2B: {encoded}");
        assert!(encoded.contains("+"), "a space is +: {encoded}");
        assert!(
            encoded.contains("%C3%A9%E2%82%AC%F0%9F%98%80"),
            "UTF-8: {encoded}"
        );
        assert_eq!(
            decoded(&encoded),
            vec![("metadata[cobro_reference]".to_owned(), value.to_owned())]
        );
    }

    #[test]
    fn amounts_are_written_as_stripe_counts_their_currency() {
        assert_eq!(amount("EUR", 1999), Ok("1999".to_owned()));
        assert_eq!(amount("eur", 1999), Ok("1999".to_owned()));
        assert_eq!(amount("JPY", 500), Ok("500".to_owned()));
        assert_eq!(amount("ISK", 5000), Ok("500000".to_owned()));
        assert_eq!(amount("UGX", 5000), Ok("500000".to_owned()));
        assert_eq!(amount("HUF", 1045), Ok("1045".to_owned()));
        assert_eq!(amount("TWD", 80045), Ok("80045".to_owned()));
        for code in ["BHD", "JOD", "KWD", "OMR", "TND"] {
            assert_eq!(amount(code, 5120), Ok("5120".to_owned()), "{code}");
        }
    }

    #[test]
    fn an_amount_stripe_cannot_take_is_a_definitive_failure_never_rounded() {
        for code in ["BHD", "JOD", "KWD", "OMR", "TND"] {
            let refused = amount(code, 5124).expect_err("refused, not rounded");
            match refused.clone() {
                Unsent::Refused {
                    code: failure,
                    message,
                } => {
                    assert_eq!(failure, "amount_not_accepted_by_stripe");
                    assert!(message.contains(code), "{message}");
                    assert!(message.contains("5124"), "{message}");
                    assert!(message.ends_with("nothing was sent"), "{message}");
                }
                other => panic!("{code}: {other:?}"),
            }
            // Definitive, with no object: nothing exists at Stripe.
            assert!(matches!(
                refused.into_outcome(),
                Outcome::Failed { object: None, .. }
            ));
        }
        assert!(matches!(
            amount("MGA", 150),
            Err(Unsent::Refused {
                code: "amount_not_accepted_by_stripe",
                ..
            })
        ));
        assert!(matches!(
            amount("XYZ", 100),
            Err(Unsent::Refused {
                code: "currency_unknown",
                ..
            })
        ));
        assert_eq!(
            Unsent::NotSent("why".into()).into_outcome(),
            Outcome::NotSent("why".into())
        );
    }

    #[test]
    fn an_empty_form_is_an_empty_body() {
        assert_eq!(Form::new().encode(), "");
    }

    #[test]
    fn search_strings_escape_backslashes_and_single_quotes() {
        assert_eq!(
            search_quoted("o-1:authorize-v1/0192"),
            "'o-1:authorize-v1/0192'"
        );
        assert_eq!(search_quoted("it's"), r"'it\'s'");
        assert_eq!(search_quoted(r"a\'b"), r"'a\\\'b'");
        assert_eq!(
            search_quoted("\"x\""),
            "'\"x\"'",
            "double quotes need nothing"
        );
        assert_eq!(
            metadata_equals("cobro_reference", "o'1"),
            r"metadata['cobro_reference']:'o\'1'"
        );
    }
}
