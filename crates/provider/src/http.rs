//! The HTTP adapter for the fake provider's API (and any provider with the
//! same shape): JSON over HTTP, `Authorization: Bearer`, `Idempotency-Key`.

use crate::pages::{Page, read_page, read_to_end};
use crate::{
    AuthorizeRequest, Credentials, LedgerKind, LedgerPage, Outcome, Provider, ProviderObject,
    QueryError, RefundRequest, Window,
};
use reqwest::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct HttpProviderConfig {
    /// Base URL, e.g. `http://127.0.0.1:8089`.
    pub base_url: String,
    /// cobro's API key at the provider; it scopes the provider's idempotency keys.
    pub api_key: String,
    /// How long to wait for a connection. A connect failure proves nothing
    /// was sent, so it is kept short and separate.
    pub connect_timeout: Duration,
    /// How long a whole call may take. After this the outcome is unknown.
    pub request_timeout: Duration,
    /// The provider's name in spans and metrics (`provider` label), the
    /// `{provider}` of its webhooks.
    pub name: String,
    /// The most pages (of 100) a consistent list may take; past them the
    /// list proves nothing (a [`QueryError`]).
    pub list_max_pages: usize,
}

/// A reference (a query value) or a provider id (a path segment),
/// percent-encoded: everything but RFC 3986's unreserved characters.
pub(crate) fn encoded(text: &str) -> percent_encoding::PercentEncode<'_> {
    const UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    percent_encoding::utf8_percent_encode(text, UNRESERVED)
}

impl HttpProviderConfig {
    pub fn new(base_url: impl Into<String>, api_key: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into().trim_end_matches('/').to_owned(),
            api_key: api_key.into(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(10),
            name: "fake".to_owned(),
            list_max_pages: 100,
        }
    }
}

#[derive(Clone, Debug)]
pub struct HttpProvider {
    config: HttpProviderConfig,
    client: reqwest::Client,
}

impl HttpProvider {
    pub fn new(config: HttpProviderConfig) -> Result<Self, reqwest::Error> {
        let client = crate::client_builder(&config.base_url)
            .connect_timeout(config.connect_timeout)
            .timeout(config.request_timeout)
            // A redirect's failed connection would look like a send that
            // never left, after the POST reached the first server.
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Self { config, client })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.config.base_url)
    }

    /// A span `provider.<operation>` (a client span: the provider sees it
    /// as the parent in the `traceparent` it is sent).
    fn span(&self, operation: &'static str) -> tracing::Span {
        tracing::info_span!(
            "provider.call",
            otel.name = format!("provider.{operation}"),
            otel.kind = "client",
            provider = %self.config.name,
            operation,
            outcome = tracing::field::Empty,
            http.response.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        )
    }

    /// Records the outcome class on the span and in the metrics.
    fn finish(
        &self,
        span: &tracing::Span,
        operation: &'static str,
        outcome: &'static str,
        started: std::time::Instant,
    ) {
        span.record("outcome", outcome);
        if outcome == "unknown" || outcome == "error" {
            span.record("otel.status_code", "ERROR");
        }
        cobro_telemetry::metrics::provider_call(
            &self.config.name,
            operation,
            outcome,
            started.elapsed(),
        );
    }

    async fn mutate(&self, operation: &'static str, key: &str, path: &str, body: Value) -> Outcome {
        let span = self.span(operation);
        let started = std::time::Instant::now();
        let outcome =
            tracing::Instrument::instrument(self.send_mutation(key, path, body), span.clone())
                .await;
        let label = match &outcome {
            Outcome::Failed { code, .. } if code == crate::stripe::CREDENTIALS_REFUSED => {
                span.in_scope(|| {
                    tracing::error!(
                        provider = %self.config.name,
                        operation,
                        "the provider refused cobro's API key (401/403): nothing executed, the \
                         attempt fails; fix the key"
                    );
                });
                "credentials_refused"
            }
            outcome => outcome.class(),
        };
        self.finish(&span, operation, label, started);
        outcome
    }

    async fn send_mutation(&self, key: &str, path: &str, body: Value) -> Outcome {
        let sent = self
            .client
            .post(self.url(path))
            .headers(traceparent())
            .bearer_auth(&self.config.api_key)
            .header("idempotency-key", key)
            .json(&body)
            .send()
            .await;
        let response = match sent {
            Ok(r) => r,
            Err(e) => return classify_transport_error(&e),
        };
        let status = response.status();
        tracing::Span::current().record("http.response.status_code", status.as_u16());
        let bytes = match response.bytes().await {
            Ok(b) => b,
            // The status arrived but the body did not: the request was
            // executed or not, we cannot tell which way it went.
            Err(e) => {
                return Outcome::Unknown(format!(
                    "body lost after status {status}: {}",
                    redact(&e)
                ));
            }
        };
        classify_answer(status, &bytes)
    }

    async fn query<T: for<'de> Deserialize<'de>>(
        &self,
        operation: &'static str,
        path_and_query: &str,
    ) -> Result<Option<T>, QueryError> {
        let span = self.span(operation);
        let started = std::time::Instant::now();
        let answer =
            tracing::Instrument::instrument(self.send_query(path_and_query), span.clone()).await;
        let class = match &answer {
            Ok(Some(_)) => "found",
            Ok(None) => "not_found",
            Err(_) => "error",
        };
        self.finish(&span, operation, class, started);
        answer
    }

    async fn send_query<T: for<'de> Deserialize<'de>>(
        &self,
        path_and_query: &str,
    ) -> Result<Option<T>, QueryError> {
        let response = self
            .client
            .get(self.url(path_and_query))
            .headers(traceparent())
            .bearer_auth(&self.config.api_key)
            .send()
            .await
            .map_err(|e| QueryError(redact(&e)))?;
        tracing::Span::current().record("http.response.status_code", response.status().as_u16());
        match response.status() {
            StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => response
                .json::<T>()
                .await
                .map(Some)
                .map_err(|e| QueryError(format!("malformed answer: {}", redact(&e)))),
            s => Err(QueryError(format!("status {s}"))),
        }
    }

    async fn search(
        &self,
        operation: &'static str,
        path: &str,
        reference: &str,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        #[derive(Deserialize)]
        struct List {
            data: Vec<ProviderObject>,
        }
        let list: Option<List> = self
            .query(
                operation,
                &format!("{path}?reference={}", encoded(reference)),
            )
            .await?;
        // A 404 on a search endpoint is not an answer about charges.
        list.map(|l| l.data)
            .ok_or_else(|| QueryError("search endpoint answered 404".into()))
    }
}

impl HttpProvider {
    /// A consistent list (`GET {path}?{filter}&limit=100&starting_after=`),
    /// every page, keeping the objects under `reference`. Any failure, or
    /// more pages than `list_max_pages`, proves nothing.
    async fn list(
        &self,
        operation: &'static str,
        path: &str,
        filter: &str,
        reference: &str,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        read_to_end(self.config.list_max_pages, operation, |after| async move {
            let mut page = self.list_page(operation, path, filter, after).await?;
            page.kept
                .retain(|o| o.reference.as_deref() == Some(reference));
            Ok(page)
        })
        .await
    }

    /// One page of a consistent list (`GET {path}?{filter}&limit=100`,
    /// after the object `after`), every object of it.
    async fn list_page(
        &self,
        operation: &'static str,
        path: &str,
        filter: &str,
        after: Option<String>,
    ) -> Result<Page, QueryError> {
        #[derive(Deserialize)]
        struct Listed {
            data: Vec<ProviderObject>,
            has_more: bool,
        }
        let cursor = after
            .map(|id| format!("&starting_after={}", encoded(&id)))
            .unwrap_or_default();
        let page: Listed = self
            .query(operation, &format!("{path}?{filter}&limit=100{cursor}"))
            .await?
            .ok_or_else(|| QueryError("the list endpoint answered 404".into()))?;
        Ok(Page {
            next: page.data.last().map(|o| o.id.clone()),
            has_more: page.has_more,
            kept: page.data,
        })
    }
}

/// `created[gte]=..&created[lte]=..` of a window (percent-encoded).
fn created_filter(window: Window) -> String {
    let mut filter = format!("created%5Bgte%5D={}", window.from);
    if let Some(to) = window.to {
        filter.push_str(&format!("&created%5Blte%5D={to}"));
    }
    filter
}

/// The W3C trace context of the current span (the `provider.*` span), for
/// the provider's logs and traces; empty when tracing is off.
pub(crate) fn traceparent() -> reqwest::header::HeaderMap {
    let mut headers = reqwest::header::HeaderMap::new();
    cobro_telemetry::inject_current(&mut headers);
    headers
}

/// A transport error says nothing about the provider's side unless it
/// happened before the connection existed.
fn classify_transport_error(e: &reqwest::Error) -> Outcome {
    if e.is_connect() {
        Outcome::NotConnected(redact(e))
    } else {
        // Timeouts, resets after the request was written, a closed
        // connection without an answer: the effect may have happened.
        Outcome::Unknown(redact(e))
    }
}

/// A log-safe description: the kind of failure and its cause chain, never
/// the URL (reqwest's own Display includes it).
pub(crate) fn redact(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect error"
    } else if e.is_body() || e.is_decode() {
        "body error"
    } else {
        "request error"
    };
    let mut text = kind.to_owned();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[derive(Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
    #[serde(default)]
    charge: Option<ProviderObject>,
}

#[derive(Deserialize)]
struct ErrorDetail {
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    message: Option<String>,
}

/// The classification table of docs/recovery.md §2, for a
/// call that got an HTTP answer.
pub(crate) fn classify_answer(status: StatusCode, body: &[u8]) -> Outcome {
    // The provider's own error body, with its code: a 4xx without one is
    // a proxy's, a gateway's or a load balancer's page, which proves
    // nothing about the provider (the request may have executed behind it).
    let error = || {
        serde_json::from_slice::<ErrorBody>(body)
            .ok()
            .filter(|e| e.error.code.is_some())
    };
    let without_body = || {
        Outcome::Unknown(format!(
            "provider answered {status} without its error body: another server's answer proves nothing"
        ))
    };
    let code_of = |e: &Option<ErrorBody>| {
        e.as_ref()
            .and_then(|e| e.error.code.clone())
            .unwrap_or_else(|| format!("http_{}", status.as_u16()))
    };
    let message_of = |e: &Option<ErrorBody>| {
        e.as_ref()
            .and_then(|e| e.error.message.clone())
            .unwrap_or_default()
    };
    match status.as_u16() {
        200..=299 => match serde_json::from_slice::<ProviderObject>(body) {
            Ok(object) => Outcome::Succeeded(object),
            Err(_) => Outcome::Unknown(format!("malformed {status} answer")),
        },
        402 => {
            let Some(e) = error() else {
                return without_body();
            };
            let e = Some(e);
            Outcome::Declined {
                code: code_of(&e),
                message: message_of(&e),
                object: e.and_then(|e| e.charge),
            }
        }
        // The provider refused to execute: nothing happened, same key again.
        429 => Outcome::NotSent(format!("provider answered {status}")),
        // Same key still executing at the provider.
        409 => Outcome::Unknown("provider answered 409: request with this key in progress".into()),
        400 | 404 | 422 => {
            let Some(e) = error() else {
                return without_body();
            };
            let e = Some(e);
            let code = code_of(&e);
            if code == "idempotency_error" {
                // The key was used with other parameters: something is off
                // and the first use may have had an effect. Never conclude.
                Outcome::Unknown("provider reported an idempotency key mismatch".into())
            } else {
                Outcome::Failed {
                    code,
                    message: message_of(&e),
                    object: e.and_then(|e| e.charge),
                }
            }
        }
        // The provider authenticates cobro's key before it executes
        // anything (the fake does, as Stripe does): final, nothing
        // happened, and it pages (`credentials_refused`). A 401/403 without
        // the provider's own body is another server's, and proves nothing.
        401 | 403 => {
            let Some(e) = error() else {
                return without_body();
            };
            Outcome::Failed {
                code: crate::stripe::CREDENTIALS_REFUSED.to_owned(),
                message: message_of(&Some(e)),
                object: None,
            }
        }
        // 5xx and anything unexpected: no proof either way.
        _ => Outcome::Unknown(format!("provider answered {status}")),
    }
}

impl Provider for HttpProvider {
    fn name(&self) -> &str {
        &self.config.name
    }

    async fn authorize(&self, key: &str, request: &AuthorizeRequest) -> Outcome {
        let body = serde_json::to_value(request).unwrap_or(Value::Null);
        self.mutate("authorize", key, "/v1/charges", body).await
    }

    async fn capture(&self, key: &str, charge: &str) -> Outcome {
        self.mutate(
            "capture",
            key,
            &format!("/v1/charges/{}/capture", encoded(charge)),
            json!({}),
        )
        .await
    }

    async fn void(&self, key: &str, charge: &str) -> Outcome {
        self.mutate(
            "void",
            key,
            &format!("/v1/charges/{}/void", encoded(charge)),
            json!({}),
        )
        .await
    }

    async fn refund(&self, key: &str, request: &RefundRequest) -> Outcome {
        let body = serde_json::to_value(request).unwrap_or(Value::Null);
        self.mutate("refund", key, "/v1/refunds", body).await
    }

    async fn get_charge(&self, id: &str) -> Result<Option<ProviderObject>, QueryError> {
        self.query("get_charge", &format!("/v1/charges/{}", encoded(id)))
            .await
    }

    async fn search_charges(&self, reference: &str) -> Result<Vec<ProviderObject>, QueryError> {
        self.search("search_charges", "/v1/charges", reference)
            .await
    }

    /// The fake searches refunds by reference; the charge is not needed.
    async fn search_refunds(
        &self,
        reference: &str,
        _charge: Option<&str>,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        self.search("search_refunds", "/v1/refunds", reference)
            .await
    }

    /// `GET /v1/charges?created[gte]=&created[lte]=`: every charge of the
    /// window, whatever its search lag (fake-provider/README.md).
    async fn list_charges(
        &self,
        reference: &str,
        window: Window,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        let filter = created_filter(window);
        self.list("list_charges", "/v1/charges", &filter, reference)
            .await
    }

    /// `GET /v1/charges?created[..]` or `GET /v1/refunds?created[..]`:
    /// every object of the window, one page (read again on failure).
    async fn ledger_page(
        &self,
        kind: LedgerKind,
        window: Window,
        after: Option<&str>,
    ) -> Result<LedgerPage, QueryError> {
        let (operation, path) = match kind {
            LedgerKind::Charges => ("ledger_charges", "/v1/charges"),
            LedgerKind::Refunds => ("ledger_refunds", "/v1/refunds"),
        };
        let filter = created_filter(window);
        let after = after.map(str::to_owned);
        let page = read_page(
            &mut |after| self.list_page(operation, path, &filter, after),
            &after,
        )
        .await?;
        Ok(LedgerPage::from(page))
    }

    /// `GET /v1/refunds?charge=`: every refund of the charge.
    async fn list_refunds(
        &self,
        reference: &str,
        charge: &str,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        let filter = format!("charge={}", encoded(charge));
        self.list("list_refunds", "/v1/refunds", &filter, reference)
            .await
    }

    /// `GET /v1/charges?created[gte]=0&limit=1`: the consistent list, as
    /// little of it as can be asked.
    async fn check_credentials(&self) -> Credentials {
        let answer = self
            .client
            .get(self.url("/v1/charges?created%5Bgte%5D=0&limit=1"))
            .bearer_auth(&self.config.api_key)
            .send()
            .await;
        match answer {
            Ok(response) => Credentials::from_status(response.status().as_u16(), |status| {
                format!("the provider refused cobro's API key ({status})")
            }),
            Err(e) => Credentials::Unknown(redact(&e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    fn class(status: u16, body: &str) -> &'static str {
        classify_answer(
            StatusCode::from_u16(status).expect("status"),
            body.as_bytes(),
        )
        .class()
    }

    #[test]
    fn each_answer_is_classified_as_the_spec_table_says() {
        let charge = r#"{"id":"ch_1","status":"captured","reference":"o:authorize-v1"}"#;
        assert_eq!(class(201, charge), "succeeded");
        assert_eq!(class(200, charge), "succeeded");
        let decline = r#"{"error":{"code":"card_declined","message":"no"},"charge":{"id":"ch_2","status":"declined"}}"#;
        assert_eq!(class(402, decline), "declined");
        assert_eq!(
            class(400, r#"{"error":{"code":"invalid_amount"}}"#),
            "failed"
        );
        assert_eq!(
            class(400, r#"{"error":{"code":"charge_not_capturable"}}"#),
            "failed"
        );
        assert_eq!(
            class(400, r#"{"error":{"code":"idempotency_error"}}"#),
            "unknown"
        );
        assert_eq!(
            class(409, r#"{"error":{"code":"idempotency_in_progress"}}"#),
            "unknown"
        );
        assert_eq!(class(500, ""), "unknown");
        assert_eq!(class(503, ""), "unknown");
        assert_eq!(
            class(200, "<html>not json</html>"),
            "unknown",
            "a malformed answer proves nothing"
        );
        assert_eq!(class(401, ""), "unknown", "not the provider's own answer");
        assert_eq!(class(429, ""), "not_sent");
    }

    /// The provider authenticates cobro's key before executing anything:
    /// its own 401/403 is final (nothing happened, the order is free, and
    /// it pages), like Stripe's; the same status from a proxy is unknown.
    #[test]
    fn the_providers_own_401_or_403_fails_having_done_nothing() {
        for status in [401, 403] {
            let answer = classify_answer(
                StatusCode::from_u16(status).expect("status"),
                br#"{"error":{"code":"unauthorized","message":"bad key"}}"#,
            );
            assert!(
                matches!(&answer, Outcome::Failed { code, .. } if code == "provider_credentials_refused"),
                "{status}: {answer:?}"
            );
            assert_eq!(class(status, "<html>Forbidden</html>"), "unknown");
        }
    }

    /// A 4xx that is not the provider's own error body (a proxy's HTML
    /// page, an empty body, JSON without the provider's error code) proves
    /// nothing: the request may have executed behind the proxy. Taken as a
    /// definitive failure it would free the order for a second charge.
    #[test]
    fn a_4xx_without_the_providers_error_body_is_unknown() {
        for status in [400, 402, 404, 422] {
            for body in [
                "",
                "<html><body>502 Bad Gateway</body></html>",
                r#"{"message":"Not Found"}"#,
                r#"{"error":{"message":"no code"}}"#,
            ] {
                assert_eq!(class(status, body), "unknown", "{status} {body:?}");
            }
        }
        assert_eq!(
            class(404, r#"{"error":{"code":"resource_missing"}}"#),
            "failed"
        );
        assert_eq!(
            class(402, r#"{"error":{"code":"card_declined"}}"#),
            "declined"
        );
    }

    #[test]
    fn a_decline_keeps_the_providers_code_and_charge() {
        let body = r#"{"error":{"code":"insufficient_funds","message":"m"},"charge":{"id":"ch_9","status":"declined"}}"#;
        match classify_answer(StatusCode::PAYMENT_REQUIRED, body.as_bytes()) {
            Outcome::Declined { code, object, .. } => {
                assert_eq!(code, "insufficient_funds");
                assert_eq!(object.map(|o| o.id), Some("ch_9".to_owned()));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_refusal_keeps_the_charge_as_it_is_now() {
        let body = r#"{"error":{"code":"charge_not_voidable","message":"m"},"charge":{"id":"ch_3","status":"captured","amount":5,"currency":"EUR","capture_method":"manual","metadata":{"cobro_attempt":"a"}}}"#;
        match classify_answer(StatusCode::BAD_REQUEST, body.as_bytes()) {
            Outcome::Failed { code, object, .. } => {
                assert_eq!(code, "charge_not_voidable");
                let charge = object.expect("the charge travels with the refusal");
                assert_eq!(charge.status, crate::ProviderStatus::Captured);
                assert_eq!(
                    charge.metadata.get("cobro_attempt").map(String::as_str),
                    Some("a")
                );
            }
            other => panic!("{other:?}"),
        }
    }

    fn provider(url: String, timeout: Duration) -> HttpProvider {
        let mut config = HttpProviderConfig::new(url, "sk_test");
        config.request_timeout = timeout;
        HttpProvider::new(config).expect("client")
    }

    fn request() -> AuthorizeRequest {
        AuthorizeRequest {
            amount: 100,
            currency: "EUR".into(),
            payment_method: "pm_card_visa".into(),
            capture: true,
            reference: "o:authorize-v1".into(),
            metadata: Default::default(),
            return_url: None,
        }
    }

    #[tokio::test]
    async fn a_refused_connection_is_not_sent() {
        // Bind then drop: nothing listens on that port any more.
        let port = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let p = provider(format!("http://127.0.0.1:{port}"), Duration::from_secs(5));
        let outcome = p.authorize("k", &request()).await;
        assert_eq!(outcome.class(), "not_sent");
        assert!(matches!(outcome, Outcome::NotConnected(_)), "{outcome:?}");
    }

    #[tokio::test]
    async fn a_connection_closed_after_the_request_was_written_is_unknown() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            // Read the whole request (headers and body), then hang up
            // without a byte of answer: the provider may have acted on it.
            let mut buf = vec![0u8; 4096];
            let mut seen = Vec::new();
            while !String::from_utf8_lossy(&seen).contains("o:authorize-v1") {
                let n = socket.read(&mut buf).await.expect("read");
                if n == 0 {
                    break;
                }
                seen.extend_from_slice(&buf[..n]);
            }
            drop(socket);
            seen
        });
        let p = provider(url, Duration::from_secs(5));
        let outcome = p.authorize("k", &request()).await;
        assert_eq!(outcome.class(), "unknown", "{outcome:?}");
        let seen = String::from_utf8(server.await.expect("server")).expect("utf8");
        assert!(
            seen.contains("idempotency-key: k"),
            "the key travels with the request"
        );
    }

    #[tokio::test]
    async fn a_timeout_after_sending_is_unknown() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let _server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            let mut buf = vec![0u8; 4096];
            // Keep reading, never answer.
            while socket.read(&mut buf).await.map(|n| n > 0).unwrap_or(false) {}
        });
        let p = provider(url, Duration::from_millis(300));
        assert_eq!(p.authorize("k", &request()).await.class(), "unknown");
    }
}
