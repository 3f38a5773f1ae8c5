//! Stripe's request bodies: `application/x-www-form-urlencoded` with nested
//! keys (`metadata[cobro_intent]=...`, `payment_method_types[0]=card` or
//! `payment_method_types[]=card`).
//!
//! `serde_qs` (in form-encoding mode, so percent-encoded brackets are keys'
//! brackets, as Stripe's SDKs send them) turns the body into a tree of
//! strings, maps and lists; `serde_urlencoded` would not, it only knows flat
//! pairs. The typing is done here rather than by deriving `Deserialize`, so
//! every refusal names its `param` and carries Stripe's code
//! (`parameter_unknown`, `parameter_missing`, `parameter_invalid_integer`,
//! `parameter_invalid_empty`).

use std::collections::BTreeMap;

use axum::http::HeaderMap;
use axum::http::header::CONTENT_TYPE;
use serde_json::Value;

use super::error::StripeError;
use crate::model::{Created, METADATA_MAX_KEY_CHARS, METADATA_MAX_KEYS, METADATA_MAX_VALUE_CHARS};

/// The form content type, the only body Stripe takes.
const FORM: &str = "application/x-www-form-urlencoded";

/// A parsed form (or query string); its parameters are taken one by one.
#[derive(Debug)]
pub(crate) struct Form {
    fields: BTreeMap<String, Value>,
}

impl Form {
    /// A request body. A body of another type (JSON) is refused; an empty
    /// body is an empty form whatever its type.
    pub(crate) fn body(headers: &HeaderMap, body: &[u8]) -> Result<Self, StripeError> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self {
                fields: BTreeMap::new(),
            });
        }
        let content_type = headers
            .get(CONTENT_TYPE)
            .and_then(|value| value.to_str().ok());
        if content_type.is_some_and(|value| !value.trim_start().starts_with(FORM)) {
            return Err(StripeError::malformed(format!(
                "Invalid request: the body must be {FORM} (Stripe's API takes no JSON bodies)."
            )));
        }
        Self::parse(body)
    }

    /// A query string (or a body known to be a form).
    pub(crate) fn parse(text: &[u8]) -> Result<Self, StripeError> {
        let config = serde_qs::Config::new().use_form_encoding(true).max_depth(2);
        config
            .deserialize_bytes::<BTreeMap<String, Value>>(text)
            .map(|fields| Self { fields })
            .map_err(|error| {
                StripeError::malformed(format!(
                    "Invalid request: the form does not parse ({error})."
                ))
            })
    }

    /// The parameters in a fixed order (keys sorted, lists in order, both
    /// list syntaxes alike): what an idempotency key compares.
    pub(crate) fn canonical(&self) -> String {
        serde_json::to_string(&self.fields).unwrap_or_default()
    }

    /// Refuses the first parameter not in `known` (Stripe names it).
    pub(crate) fn only(&self, known: &[&str]) -> Result<(), StripeError> {
        match self
            .fields
            .keys()
            .find(|name| !known.contains(&name.as_str()))
        {
            Some(unknown) => Err(StripeError::unknown_param(unknown)),
            None => Ok(()),
        }
    }

    /// A plain value given once; `a` alone (no `=`) is the empty string.
    pub(crate) fn text(&mut self, name: &str) -> Result<Option<String>, StripeError> {
        match self.fields.remove(name) {
            None => Ok(None),
            Some(Value::Null) => Ok(Some(String::new())),
            Some(Value::String(text)) => Ok(Some(text)),
            Some(Value::Array(_)) => Err(StripeError::invalid(
                name,
                format!("Invalid {name}: give it once, as a plain value."),
            )),
            Some(_) => Err(StripeError::invalid(
                name,
                format!("Invalid {name}: expected a plain value, not a hash."),
            )),
        }
    }

    /// A non-empty plain value, if given.
    pub(crate) fn non_empty(&mut self, name: &str) -> Result<Option<String>, StripeError> {
        match self.text(name)? {
            Some(text) if text.is_empty() => Err(StripeError::empty_string(name)),
            other => Ok(other),
        }
    }

    /// A required non-empty plain value.
    pub(crate) fn required(&mut self, name: &str) -> Result<String, StripeError> {
        self.non_empty(name)?
            .ok_or_else(|| StripeError::missing_param(name))
    }

    /// An integer of at least 1, if given.
    pub(crate) fn positive(&mut self, name: &str) -> Result<Option<i64>, StripeError> {
        let Some(text) = self.non_empty(name)? else {
            return Ok(None);
        };
        let value: i64 = text
            .parse()
            .map_err(|_| StripeError::invalid_integer(name, format!("Invalid integer: {text}")))?;
        if value < 1 {
            let message = "This value must be greater than or equal to 1.";
            return Err(StripeError::invalid_integer(name, message));
        }
        Ok(Some(value))
    }

    /// `created`, as Stripe's lists take it: a unix time (`created=N`,
    /// exactly that second) or a range of `created[gt]`, `created[gte]`,
    /// `created[lt]`, `created[lte]` (any of them), as inclusive bounds in
    /// whole seconds.
    pub(crate) fn created(&mut self) -> Result<Created, StripeError> {
        let integer = |param: &str, value: &Value| match value {
            Value::String(text) if text.is_empty() => Err(StripeError::empty_string(param)),
            Value::String(text) => text.parse::<i64>().map_err(|_| {
                StripeError::invalid_integer(param, format!("Invalid integer: {text}"))
            }),
            _ => Err(StripeError::invalid(
                param,
                format!("Invalid {param}: expected a plain value."),
            )),
        };
        let mut created = Created::default();
        match self.fields.remove("created") {
            None => {}
            Some(Value::Object(bounds)) => {
                for (name, value) in &bounds {
                    let param = format!("created[{name}]");
                    let seconds = integer(&param, value)?;
                    let (gte, lte) = match name.as_str() {
                        "gt" => (Some(seconds.saturating_add(1)), None),
                        "gte" => (Some(seconds), None),
                        "lt" => (None, Some(seconds.saturating_sub(1))),
                        "lte" => (None, Some(seconds)),
                        _ => return Err(StripeError::unknown_param(&param)),
                    };
                    // Several lower (upper) bounds: the tightest holds.
                    created.gte = created.gte.max(gte);
                    created.lte = match (created.lte, lte) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
            }
            Some(value) => {
                let seconds = integer("created", &value)?;
                created.gte = Some(seconds);
                created.lte = Some(seconds);
            }
        }
        Ok(created)
    }

    /// `true` or `false`, if given.
    pub(crate) fn boolean(&mut self, name: &str) -> Result<Option<bool>, StripeError> {
        match self.non_empty(name)?.as_deref() {
            None => Ok(None),
            Some("true") => Ok(Some(true)),
            Some("false") => Ok(Some(false)),
            Some(other) => Err(StripeError::invalid(
                name,
                format!("Invalid boolean: {other}"),
            )),
        }
    }

    /// One of `allowed`, if given.
    pub(crate) fn one_of(
        &mut self,
        name: &str,
        allowed: &[&'static str],
    ) -> Result<Option<&'static str>, StripeError> {
        let Some(text) = self.non_empty(name)? else {
            return Ok(None);
        };
        match allowed.iter().find(|value| **value == text) {
            Some(value) => Ok(Some(value)),
            None => Err(StripeError::invalid(
                name,
                format!("Invalid {name}: must be one of {}", allowed.join(", ")),
            )),
        }
    }

    /// A list of plain values (`name[0]=a&name[1]=b` or `name[]=a&name[]=b`).
    pub(crate) fn list(&mut self, name: &str) -> Result<Option<Vec<String>>, StripeError> {
        let invalid = || StripeError::invalid(name, format!("Invalid array: {name}"));
        match self.fields.remove(name) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .into_iter()
                .map(|item| match item {
                    Value::String(text) if !text.is_empty() => Ok(text),
                    _ => Err(invalid()),
                })
                .collect::<Result<_, _>>()
                .map(Some),
            Some(_) => Err(invalid()),
        }
    }

    /// `metadata[KEY]=VALUE`s. As on Stripe, an empty value unsets its key
    /// (on creation: leaves it out) and `metadata=` (empty) means none.
    /// At most 50 keys of at most 40 characters, values of at most 500.
    pub(crate) fn metadata(&mut self) -> Result<BTreeMap<String, String>, StripeError> {
        let entries = match self.fields.remove("metadata") {
            None | Some(Value::Null) => return Ok(BTreeMap::new()),
            Some(Value::String(text)) if text.is_empty() => return Ok(BTreeMap::new()),
            Some(Value::Object(entries)) => entries,
            Some(_) => {
                return Err(StripeError::invalid(
                    "metadata",
                    "Invalid metadata: send it as metadata[KEY]=VALUE.",
                ));
            }
        };
        let mut metadata = BTreeMap::new();
        for (key, value) in entries {
            let param = format!("metadata[{key}]");
            let Value::String(value) = value else {
                let message = format!("Invalid {param}: metadata values must be strings.");
                return Err(StripeError::invalid(&param, message));
            };
            if key.is_empty() || key.chars().count() > METADATA_MAX_KEY_CHARS {
                let message = format!(
                    "Invalid metadata: keys must be 1 to {METADATA_MAX_KEY_CHARS} characters long."
                );
                return Err(StripeError::invalid(&param, message));
            }
            if value.chars().count() > METADATA_MAX_VALUE_CHARS {
                let message = format!(
                    "Invalid {param}: metadata values can be at most {METADATA_MAX_VALUE_CHARS} characters long."
                );
                return Err(StripeError::invalid(&param, message));
            }
            if !value.is_empty() {
                metadata.insert(key, value);
            }
        }
        if metadata.len() > METADATA_MAX_KEYS {
            let message = format!("Invalid metadata: at most {METADATA_MAX_KEYS} keys.");
            return Err(StripeError::invalid("metadata", message));
        }
        Ok(metadata)
    }
}
