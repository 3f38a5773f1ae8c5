//! Extractors: the authenticated account, the Idempotency-Key header and a
//! JSON body whose every rejection is the API's own problem+json.

use crate::AppState;
use crate::error::{ApiError, FieldError};
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use cobro_core::{AccountId, IdempotencyKey};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// The largest request body accepted (docs/http-api.md §6).
pub const BODY_LIMIT: usize = 16 * 1024;

/// The account behind a valid bearer token.
#[derive(Clone, Copy, Debug)]
pub struct Account(pub AccountId);

/// The SHA-256 (hex) under which a token is stored and looked up.
pub fn token_hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

impl FromRequestParts<AppState> for Account {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer_token(&parts.headers)?;
        // Tokens are high-entropy: one SHA-256 and, unless it was read
        // within the cache's bound, one indexed lookup; no slow password
        // hash per request.
        let (hash, now) = (token_hash(token), state.clock.now());
        let account = match state.tokens.get(&hash, now) {
            Some(account) => account,
            None => {
                let live = state
                    .store
                    .live_token(&hash, now)
                    .await?
                    .ok_or(ApiError::Unauthenticated)?;
                state.tokens.put(&hash, live, now);
                live.account
            }
        };
        tracing::Span::current().record("account_id", tracing::field::display(account));
        // Before anything else: a refused request never touches a key.
        if !state.rate_limiter.allow(account) {
            return Err(ApiError::RateLimited);
        }
        Ok(Account(account))
    }
}

/// The token of the one `Authorization: Bearer <token>` line. The scheme is
/// case-insensitive (RFC 9110 section 11.1); a second `Authorization` line
/// is refused (400: which of the two would be the caller?); anything else
/// is the same 401 whatever was sent.
fn bearer_token(headers: &axum::http::HeaderMap) -> Result<&str, ApiError> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let (first, second) = (values.next(), values.next());
    if second.is_some() {
        return Err(ApiError::Validation(vec![FieldError::new(
            "Authorization",
            "must be sent once",
        )]));
    }
    first
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .filter(|t| !t.is_empty())
        .ok_or(ApiError::Unauthenticated)
}

/// The `Idempotency-Key` of a POST: required, exactly one header line.
#[derive(Clone, Debug)]
pub struct KeyHeader(pub IdempotencyKey);

impl<S: Send + Sync> FromRequestParts<S> for KeyHeader {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        let mut values = parts.headers.get_all("idempotency-key").iter();
        let first = values.next().ok_or(ApiError::KeyMissing)?;
        if values.next().is_some() {
            return Err(ApiError::KeyInvalid);
        }
        let raw = first.to_str().map_err(|_| ApiError::KeyInvalid)?;
        let key = IdempotencyKey::parse(raw).map_err(|_| ApiError::KeyInvalid)?;
        // Only the hash ever reaches a log line.
        tracing::Span::current()
            .record("idempotency_key_hash", tracing::field::display(key.hash()));
        Ok(KeyHeader(key))
    }
}

/// The query string, deserialized like axum's `Query`, with every
/// rejection (a repeated parameter, a value of the wrong type) the API's
/// own 400 problem rather than axum's plain text.
#[derive(Debug)]
pub struct Params<T>(pub T);

impl<T: serde::de::DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Params<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        // A NUL reaches no query either (a filter bound to a statement).
        if parts.uri.query().is_some_and(|q| q.contains("%00")) {
            return Err(ApiError::Validation(vec![FieldError::new(
                "query",
                "must not contain U+0000 (NUL)",
            )]));
        }
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Params(value)),
            Err(rejection) => Err(ApiError::Validation(vec![FieldError::new(
                "query",
                rejection.body_text(),
            )])),
        }
    }
}

/// A JSON object body, at most [`BODY_LIMIT`] bytes. An empty body reads as
/// `{}` (capture and cancel take no fields).
#[derive(Debug)]
pub struct JsonObject(pub Map<String, Value>);

impl<S: Send + Sync> FromRequest<S> for JsonObject {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::BodyTooLarge { limit: BODY_LIMIT }
            } else {
                ApiError::Validation(vec![FieldError::new("body", "the body could not be read")])
            }
        })?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(JsonObject(Map::new()));
        }
        match serde_json::from_slice::<Value>(&bytes) {
            Ok(Value::Object(map)) => match cobro_core::text::unstorable_text(&map) {
                None => Ok(JsonObject(map)),
                Some(field) => Err(ApiError::Validation(vec![FieldError::new(
                    field,
                    "must not contain U+0000 (NUL)",
                )])),
            },
            Ok(_) => Err(ApiError::Validation(vec![FieldError::new(
                "body",
                "must be a JSON object",
            )])),
            Err(e) => Err(ApiError::Validation(vec![FieldError::new(
                "body",
                format!("is not valid JSON ({})", e.classify_name()),
            )])),
        }
    }
}

trait ClassifyName {
    fn classify_name(&self) -> &'static str;
}

impl ClassifyName for serde_json::Error {
    fn classify_name(&self) -> &'static str {
        match self.classify() {
            serde_json::error::Category::Io => "io",
            serde_json::error::Category::Syntax => "syntax error",
            serde_json::error::Category::Data => "data error",
            serde_json::error::Category::Eof => "unexpected end",
        }
    }
}

/// Reads typed fields out of a JSON object, collecting every problem so the
/// client sees all of them at once. Unknown fields are errors too: they can
/// never silently differ between two requests with the same key.
pub struct Fields {
    map: Map<String, Value>,
    pub errors: Vec<FieldError>,
}

impl Fields {
    pub fn new(map: Map<String, Value>, allowed: &[&str]) -> Self {
        let errors = map
            .keys()
            .filter(|k| !allowed.contains(&k.as_str()))
            .map(|k| FieldError::new(k.clone(), "unknown field"))
            .collect();
        Self { map, errors }
    }

    fn present(&self, name: &str) -> Option<&Value> {
        self.map.get(name).filter(|v| !v.is_null())
    }

    pub fn error(&mut self, field: &str, message: impl Into<String>) {
        self.errors.push(FieldError::new(field, message));
    }

    pub fn string(&mut self, name: &str, required: bool) -> Option<String> {
        match self.present(name) {
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => {
                self.error(name, "must be a string");
                None
            }
            None => {
                if required {
                    self.error(name, "is required");
                }
                None
            }
        }
    }

    pub fn integer(&mut self, name: &str, required: bool) -> Option<i64> {
        match self.present(name) {
            Some(v @ Value::Number(_)) => {
                let n = v.as_i64();
                if n.is_none() {
                    self.error(name, "must be an integer (minor units)");
                }
                n
            }
            Some(_) => {
                self.error(name, "must be an integer (minor units)");
                None
            }
            None => {
                if required {
                    self.error(name, "is required");
                }
                None
            }
        }
    }

    pub fn object(&mut self, name: &str) -> Option<Map<String, Value>> {
        match self.present(name) {
            Some(Value::Object(m)) => Some(m.clone()),
            Some(_) => {
                self.error(name, "must be an object");
                None
            }
            None => None,
        }
    }

    pub fn finish(self) -> Result<(), ApiError> {
        if self.errors.is_empty() {
            Ok(())
        } else {
            Err(ApiError::Validation(self.errors))
        }
    }
}
