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
