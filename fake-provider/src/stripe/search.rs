//! The subset of Stripe's search query language the fake understands:
//! `metadata['KEY']:'VALUE'` clauses joined by `AND`.
//!
//! Quotes are `'` or `"`; inside them a backslash escapes the next
//! character (`\'`, `\\`). Keywords are upper case, as in Stripe's
//! documentation. `OR`, negation, other fields (`status:`, `amount>`) and
//! substring matching (`~`) are refused with a 400 that says so, never
//! silently misread.

use std::collections::BTreeMap;

use super::error::StripeError;

/// A parsed query: every clause must hold.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Query {
    clauses: Vec<(String, String)>,
}

impl Query {
    pub(crate) fn parse(text: &str) -> Result<Self, StripeError> {
        let mut parser = Parser {
            rest: text,
            clauses: Vec::new(),
        };
        parser.query()?;
        Ok(Self {
            clauses: parser.clauses,
        })
    }

    /// Whether an object with this metadata matches every clause.
    pub(crate) fn matches(&self, metadata: &BTreeMap<String, String>) -> bool {
        self.clauses
            .iter()
            .all(|(key, value)| metadata.get(key) == Some(value))
    }

    /// One clause (the first), for the store's metadata index: only the
    /// objects carrying it are read.
    pub(crate) fn first_clause(&self) -> Option<(&str, &str)> {
        self.clauses
            .first()
            .map(|(key, value)| (key.as_str(), value.as_str()))
    }

    /// What fault rules match for this search: the clauses rendered like an
    /// object's reference (`key=value` by key, joined by `&`), so a rule
    /// that matches a payment's objects matches the searches for them.
    pub(crate) fn reference(&self) -> String {
        let clauses: BTreeMap<_, _> = self.clauses.iter().cloned().collect();
        super::reference_of(&clauses)
    }
}

struct Parser<'a> {
    rest: &'a str,
    clauses: Vec<(String, String)>,
}

fn invalid(message: impl std::fmt::Display) -> StripeError {
    StripeError::invalid(
        "query",
        format!(
            "Invalid query: {message}. The fake's Stripe search takes metadata['KEY']:'VALUE' \
             clauses joined by AND."
        ),
    )
}

impl Parser<'_> {
    fn query(&mut self) -> Result<(), StripeError> {
        loop {
            self.skip_spaces();
            self.clause()?;
            let before = self.rest.len();
            self.skip_spaces();
            if self.rest.is_empty() {
                return Ok(());
            }
            if self.rest.len() == before {
                return Err(invalid(format!("expected AND before {:?}", self.rest)));
            }
            if self.rest.starts_with("OR") {
                return Err(invalid("OR is not supported"));
            }
            self.expect("AND")?;
            if !self.rest.starts_with(char::is_whitespace) {
                return Err(invalid("AND must be followed by a space"));
            }
        }
    }

    fn clause(&mut self) -> Result<(), StripeError> {
        if self.rest.is_empty() {
            return Err(invalid("the query is empty or ends with AND"));
        }
        if !self.rest.starts_with("metadata[") {
            let field: String = self
                .rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '-')
                .collect();
            return Err(invalid(format!("unsupported clause starting {field:?}")));
        }
        self.expect("metadata[")?;
        let key = self.quoted()?;
        self.expect("]")?;
        if self.rest.starts_with('~') {
            return Err(invalid("substring matching (~) is not supported"));
        }
        self.expect(":")?;
        let value = self.quoted()?;
        if key.is_empty() {
            return Err(invalid("the metadata key is empty"));
        }
        self.clauses.push((key, value));
        Ok(())
    }

    /// A `'...'` or `"..."` string with backslash escapes.
    fn quoted(&mut self) -> Result<String, StripeError> {
        let mut chars = self.rest.char_indices();
        let quote = match chars.next() {
            Some((_, quote @ ('\'' | '"'))) => quote,
            _ => {
                return Err(invalid(format!(
                    "expected a quoted string at {:?}",
                    self.rest
                )));
            }
        };
        let mut text = String::new();
        while let Some((at, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, escaped)) => text.push(escaped),
                    None => break,
                },
                c if c == quote => {
                    self.rest = &self.rest[at + c.len_utf8()..];
                    return Ok(text);
                }
                c => text.push(c),
            }
        }
        Err(invalid("unterminated quoted string"))
    }

    fn expect(&mut self, token: &str) -> Result<(), StripeError> {
        match self.rest.strip_prefix(token) {
            Some(rest) => {
                self.rest = rest;
                Ok(())
            }
            None => Err(invalid(format!("expected {token:?} at {:?}", self.rest))),
        }
    }

    fn skip_spaces(&mut self) {
        self.rest = self.rest.trim_start();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn clauses(text: &str) -> Vec<(String, String)> {
        Query::parse(text).unwrap().clauses
    }

    #[test]
    fn metadata_clauses_joined_by_and_parse_with_either_quote_and_escapes() {
        assert_eq!(
            clauses(r#"metadata['cobro_intent']:'o-1:a\'b' AND metadata["k"]:"v \"q\" \\""#),
            vec![
                ("cobro_intent".to_owned(), "o-1:a'b".to_owned()),
                ("k".to_owned(), r#"v "q" \"#.to_owned()),
            ]
        );
        assert_eq!(clauses("  metadata['a']:''  ").len(), 1);
    }

    #[test]
    fn anything_else_is_refused() {
        for text in [
            "",
            "metadata['a']:'b' AND",
            "metadata['a']:'b' OR metadata['c']:'d'",
            "metadata['a']:'b' metadata['c']:'d'",
            "metadata['a']:'b'ANDmetadata['c']:'d'",
            "metadata['a']~'b'",
            "status:'succeeded'",
            "metadata[a]:'b'",
            "metadata['a']:b",
            "metadata['a']:'b",
            "metadata['']:'b'",
            "-metadata['a']:'b'",
        ] {
            assert!(Query::parse(text).is_err(), "{text:?} parsed");
        }
    }
}
