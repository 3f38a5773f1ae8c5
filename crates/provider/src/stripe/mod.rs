//! The Stripe connector: [`StripeProvider`] speaks Stripe's API (pinned to
//! [`STRIPE_VERSION`]) behind the same [`Provider`] trait as the fake's
//! adapter, and [`StripeWebhooks`] reads Stripe's webhooks.
//!
//! Layout:
//! - `mod.rs`: configuration, the HTTP exchange, the [`Provider`] impl;
//! - `form.rs`: form bodies with Stripe's nested names, search quoting;
//! - `objects.rs`: Stripe's objects and their mapping onto
//!   [`ProviderObject`];
//! - `classify.rs`: the classification table, one row per kind of answer;
//! - `webhooks.rs`: `Stripe-Signature`, events, the derived sequence.
//!
//! Idempotency keys, per call: an authorisation creates and confirms the
//! PaymentIntent in one `POST /v1/payment_intents` under the attempt's own
//! provider idempotency key, unchanged; a capture, a void and a refund are
//! attempts of their own, each one POST under its own key.
//!
//! 3-D Secure: an authorisation Stripe answers `requires_action` is passed
//! up with its `next_action` (a `redirect_to_url` when the payment has a
//! `return_url`, which is sent with the confirmation) and its
//! `client_secret`: cobro records the payment `requires_action` and it
//! ends by proof (`payment_intent.succeeded`, `amount_capturable_updated`,
//! `payment_failed`, `canceled`, or a read of the PaymentIntent).
//!
//! One attempt makes a second call: an authorisation Stripe leaves in
//! `requires_confirmation` or `requires_payment_method` without an error
//! (cobro never confirms later) is recorded failed, and its
//! PaymentIntent is canceled at once, best effort, under the derived key
//! `<attempt key>:cancel` ([`derived_key`]). The suffix is fixed per
//! call, so a resend of the authorisation (which replays the same
//! PaymentIntent) resends the same cancel, which Stripe replays too: one
//! cancel per attempt. cobro's keys are 36 characters, so the derived one
//! (43) stays within Stripe's 255.

mod classify;
pub(crate) use classify::CREDENTIALS_REFUSED;
mod form;
mod list;
mod objects;
mod webhooks;

pub use classify::{Class, Row, TABLE as CLASSIFICATION};
pub use webhooks::StripeWebhooks;

use crate::http::{encoded, redact, traceparent};
use crate::pages::{self, read_to_end};
use crate::{
    AuthorizeRequest, CallInfo, Credentials, LedgerKind, LedgerPage, Mutation, Outcome, Provider,
    ProviderObject, QueryError, RefundRequest, Sent, Window, metadata,
};
use classify::{Answer, Body, Heard, Op};
use form::{Form, Unsent};
use objects::{ErrorBody, Page, PaymentIntent, Refund};
use reqwest::header::{CONTENT_TYPE, HeaderMap};
use serde::de::DeserializeOwned;
use std::fmt;
use std::time::{Duration, Instant};

/// The Stripe API version every request is sent with (`Stripe-Version`),
/// whatever the account's default: the shapes cobro reads are this
/// version's.
pub const STRIPE_VERSION: &str = "2024-06-20";

/// Stripe's API.
pub const STRIPE_API: &str = "https://api.stripe.com";

/// Whether this build can speak TLS: the workspace builds reqwest with
/// its `rustls` feature (rustls over aws-lc-rs, the platform's root
/// certificates), so `https://api.stripe.com` is reached. Were a build to
/// drop it, the configuration would refuse an `https` base URL rather than
/// let every call fail as not sent.
const TLS_BUILT_IN: bool = true;

/// A Stripe secret key (`sk_live_...`, `sk_test_...`, or a restricted
/// `rk_...`). Its `Debug` never shows the value, so settings can be
/// logged; it is sent only as `Authorization: Bearer`, which reqwest marks
/// sensitive.
#[derive(Clone, PartialEq, Eq)]
pub struct StripeSecretKey(String);

impl StripeSecretKey {
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into())
    }

    /// The key itself, for the `Authorization` header; never for logs.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for StripeSecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StripeSecretKey(***)")
    }
}

/// How cobro reaches one Stripe account.
#[derive(Clone, Debug)]
pub struct StripeConfig {
    /// [`STRIPE_API`] in production; the fake provider's Stripe dialect
    /// or localstripe in tests (plain `http` only to a loopback host).
    pub base_url: String,
    /// The account's secret key. It also scopes Stripe's idempotency
    /// keys: a key is remembered per account (and mode) for 24 hours.
    pub secret_key: StripeSecretKey,
    /// How long to wait for a connection: a connect failure proves
    /// nothing was sent, so it is short and separate.
    pub connect_timeout: Duration,
    /// How long a whole call may take; after it the outcome is unknown.
    /// Stripe's own libraries wait up to 80 s; card authorisations
    /// usually answer within seconds.
    pub request_timeout: Duration,
    /// The provider's name in spans and metrics (`provider` label), and the
    /// `{provider}` of its webhooks.
    pub name: String,
    /// How many pages (of 100) a search or a refund listing reads at most;
    /// past it the query fails (proves nothing) instead of looping.
    pub max_pages: usize,
    /// How many pages (of 100) a consistent list of PaymentIntents by
    /// creation time reads at most; past it the list proves nothing.
    pub list_max_pages: usize,
}

impl StripeConfig {
    pub fn new(base_url: impl Into<String>, secret_key: StripeSecretKey) -> Self {
        Self {
            base_url: base_url.into().trim_end_matches('/').to_owned(),
            secret_key,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(30),
            name: "stripe".to_owned(),
            max_pages: 10,
            list_max_pages: 100,
        }
    }
}

/// Why a [`StripeConfig`] cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StripeConfigError {
    #[error("the Stripe base URL is not an http(s) URL")]
    BaseUrl,
    #[error(
        "an https base URL needs TLS, which this build lacks (reqwest without its `rustls` feature)"
    )]
    NoTls,
    #[error(
        "plain http would send the secret key in the clear to {0}: only a loopback host (a local fake) is reached without TLS"
    )]
    PlainHttp(String),
    #[error("the Stripe secret key is empty")]
    EmptyKey,
    #[error("the HTTP client could not be built")]
    Client(#[source] reqwest::Error),
}

/// cobro's client of one Stripe account.
#[derive(Clone, Debug)]
pub struct StripeProvider {
    config: StripeConfig,
    client: reqwest::Client,
}

/// What a GET found.
enum Got<T> {
    Found(T),
    /// 404 `resource_missing`.
    Missing,
}

impl StripeProvider {
    pub fn new(config: StripeConfig) -> Result<Self, StripeConfigError> {
        let url = reqwest::Url::parse(&config.base_url).map_err(|_| StripeConfigError::BaseUrl)?;
        match url.scheme() {
            "https" if TLS_BUILT_IN => {}
            "https" => return Err(StripeConfigError::NoTls),
            "http" => {
                let loopback = match url.host() {
                    Some(url::Host::Domain(host)) => host == "localhost",
                    Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
                    Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
                    None => false,
                };
                if !loopback {
                    return Err(StripeConfigError::PlainHttp(
                        url.host_str().unwrap_or_default().to_owned(),
                    ));
                }
            }
            _ => return Err(StripeConfigError::BaseUrl),
        }
        if config.secret_key.expose().is_empty() {
            return Err(StripeConfigError::EmptyKey);
        }
        let client = crate::client_builder(&config.base_url)
            .connect_timeout(config.connect_timeout)
            .timeout(config.request_timeout)
            // A redirected POST would be resent as a GET elsewhere: an
            // answer cobro did not ask for. Stripe never redirects.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("cobro/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(StripeConfigError::Client)?;
        Ok(Self { config, client })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.config.base_url)
    }

    /// A span `provider.<operation>` (a client span), as the fake's
    /// adapter opens, with the table row that decided and Stripe's
    /// request id.
    fn span(&self, operation: &'static str) -> tracing::Span {
        tracing::info_span!(
            "provider.call",
            otel.name = format!("provider.{operation}"),
            otel.kind = "client",
            provider = %self.config.name,
            operation,
            outcome = tracing::field::Empty,
            stripe.row = tracing::field::Empty,
            stripe.request_id = tracing::field::Empty,
            http.response.status_code = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        )
    }

    /// Records the outcome on the span and in the metrics.
    fn finish(
        &self,
        span: &tracing::Span,
        operation: &'static str,
        outcome: &'static str,
        started: Instant,
    ) {
        span.record("outcome", outcome);
        if matches!(outcome, "unknown" | "error" | "idempotency_error") {
            span.record("otel.status_code", "ERROR");
        }
        cobro_telemetry::metrics::provider_call(
            &self.config.name,
            operation,
            outcome,
            started.elapsed(),
        );
    }

    /// `text` with the idempotency key and the secret key taken out (some
    /// of Stripe's messages quote the key).
    fn scrub(&self, text: &str, key: &str) -> String {
        let mut text = text.to_owned();
        let secret = self.config.secret_key.expose();
        if !secret.is_empty() {
            text = text.replace(secret, "<secret key>");
        }
        if !key.is_empty() {
            text = text.replace(key, "<idempotency key>");
        }
        text
    }

    fn request(&self, builder: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        builder
            .headers(traceparent())
            .bearer_auth(self.config.secret_key.expose())
            .header("stripe-version", STRIPE_VERSION)
    }

    /// One POST under `key`, classified by the table.
    async fn post(&self, op: Op, key: &str, path: &str, form: Form) -> Sent {
        self.post_classified(op, key, path, form).await.0
    }

    /// The authorisation's POST, then the cancel of a PaymentIntent it
    /// left waiting for a confirmation (see the module docs): that
    /// PaymentIntent holds no funds, but left open it could still be
    /// confirmed by someone else and would show as incomplete in the
    /// merchant's dashboard. Best effort: the authorisation's outcome
    /// stands whatever the cancel answers.
    async fn authorize_and_tidy(&self, key: &str, request: &AuthorizeRequest) -> Sent {
        let form = match authorize_form(request) {
            Ok(form) => form,
            Err(refused) => return not_sendable(refused),
        };
        let (sent, row) = self
            .post_classified(Op::Authorize, key, "/v1/payment_intents", form)
            .await;
        if row.id == classify::NEEDS_CUSTOMER
            && let Outcome::Failed {
                object: Some(intent),
                ..
            } = &sent.outcome
        {
            let path = format!("/v1/payment_intents/{}/cancel", encoded(&intent.id));
            let form = Form::new().field("cancellation_reason", "abandoned");
            let cancel = derived_key(key, "cancel");
            let canceled = self.post(Op::Void, &cancel, &path, form).await;
            if !matches!(canceled.outcome, Outcome::Succeeded(_)) {
                tracing::warn!(
                    provider = %self.config.name,
                    payment_intent = %intent.id,
                    outcome = canceled.outcome.class(),
                    "a PaymentIntent left waiting for the customer could not be canceled; \
                     it holds no funds (cancel it in the dashboard)"
                );
            }
        }
        sent
    }

    /// One POST under `key`, classified by the table; and the row that
    /// decided.
    async fn post_classified(
        &self,
        op: Op,
        key: &str,
        path: &str,
        form: Form,
    ) -> (Sent, &'static classify::Row) {
        let span = self.span(op.name());
        let started = Instant::now();
        let (heard, call) =
            tracing::Instrument::instrument(self.exchange(op, key, path, &form), span.clone())
                .await;
        let row = classify::row_for(op, &heard);
        let request_id = call.as_ref().and_then(|c| c.request_id.clone());
        let outcome = classify::outcome(row, heard, request_id.as_deref(), &|text| {
            self.scrub(text, key)
        });
        span.record("stripe.row", row.id);
        if let Some(id) = &request_id {
            span.record("stripe.request_id", id.as_str());
        }
        let label = if row.id == "idempotency_mismatch" {
            span.in_scope(|| {
                tracing::error!(
                    provider = %self.config.name,
                    operation = op.name(),
                    request_id = request_id.as_deref().unwrap_or("-"),
                    "Stripe refused an idempotency key reused with other parameters: a cobro bug \
                     (an attempt's key is never reused for another request); the attempt stays \
                     unknown and is never resent under a new key"
                );
            });
            "idempotency_error"
        } else if row.id == "unauthenticated" {
            span.in_scope(|| {
                tracing::error!(
                    provider = %self.config.name,
                    operation = op.name(),
                    request_id = request_id.as_deref().unwrap_or("-"),
                    "Stripe refused cobro's API key (401/403): nothing executed, the attempt \
                     fails; fix the key (wrong, revoked, rolled, or a restricted key without \
                     PaymentIntents and Refunds write access)"
                );
            });
            "credentials_refused"
        } else {
            outcome.class()
        };
        self.finish(&span, op.name(), label, started);
        (Sent { outcome, call }, row)
    }

    async fn exchange(
        &self,
        op: Op,
        key: &str,
        path: &str,
        form: &Form,
    ) -> (Heard, Option<CallInfo>) {
        let sent = self
            .request(self.client.post(self.url(path)))
            .header("idempotency-key", key)
            .header(CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(form.encode())
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            // Only a failure to connect (or to build the request at all)
            // proves nothing was sent.
            Err(e) if e.is_connect() || e.is_builder() => {
                return (Heard::NotConnected(redact(&e)), None);
            }
            Err(e) => return (Heard::NoAnswer(redact(&e)), None),
        };
        let status = response.status().as_u16();
        tracing::Span::current().record("http.response.status_code", status);
        let call = call_info(response.headers());
        let bytes = match response.bytes().await {
            Ok(bytes) => bytes,
            Err(e) => {
                let why = format!("body lost after status {status}: {}", redact(&e));
                // What the key stored was not read: it is not called a
                // replay (a reconciler takes a replayed unknown answer
                // for a stored error, and the worker hands it over),
                // since the lost body may be a stored success.
                let call = CallInfo {
                    replayed: false,
                    ..call
                };
                return (Heard::NoAnswer(why), Some(call));
            }
        };
        let body = read_body(op, status, &bytes);
        let answer = Answer {
            status,
            should_retry: call.should_retry,
            body,
        };
        (Heard::Answer(answer), Some(call))
    }

    /// A GET: the object, `Missing` for 404 `resource_missing`, else a
    /// [`QueryError`] (which proves nothing).
    async fn get<T: DeserializeOwned>(&self, path_and_query: &str) -> Result<Got<T>, QueryError> {
        let response = self
            .request(self.client.get(self.url(path_and_query)))
            .send()
            .await
            .map_err(|e| QueryError(redact(&e)))?;
        let status = response.status().as_u16();
        tracing::Span::current().record("http.response.status_code", status);
        let request = call_info(response.headers())
            .request_id
            .map(|id| format!(" (request {id})"))
            .unwrap_or_default();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| QueryError(format!("body lost after status {status}: {}", redact(&e))))?;
        if (200..300).contains(&status) {
            return serde_json::from_slice(&bytes)
                .map(Got::Found)
                .map_err(|_| QueryError(format!("malformed {status} answer{request}")));
        }
        match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(body) if status == 404 && body.error.has_code("resource_missing") => {
                Ok(Got::Missing)
            }
            Ok(body) => Err(QueryError(format!(
                "Stripe answered {status} {}/{}{request}",
                body.error.kind.as_deref().unwrap_or("-"),
                body.error.code.as_deref().unwrap_or("-")
            ))),
            Err(_) => Err(QueryError(format!("Stripe answered {status}{request}"))),
        }
    }

    /// Runs a query in its span and records its class.
    async fn query<T>(
        &self,
        operation: &'static str,
        run: impl Future<Output = Result<T, QueryError>>,
        found: impl Fn(&T) -> bool,
    ) -> Result<T, QueryError> {
        let span = self.span(operation);
        let started = Instant::now();
        let answer = tracing::Instrument::instrument(run, span.clone()).await;
        let class = match &answer {
            Ok(t) if found(t) => "found",
            Ok(_) => "not_found",
            Err(_) => "error",
        };
        self.finish(&span, operation, class, started);
        answer
    }

    /// `GET /v1/payment_intents/search` by the `cobro_reference`
    /// metadata, every page; only exact matches are kept (the search
    /// language's matching is Stripe's, the identity check is cobro's).
    async fn search_payment_intents(
        &self,
        reference: &str,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        let query = form::metadata_equals(metadata::REFERENCE, reference);
        let query = query.as_str();
        read_to_end(
            self.config.max_pages,
            "search results",
            |cursor| async move {
                let mut params = Form::new().field("query", query).field("limit", "100");
                if let Some(cursor) = &cursor {
                    params = params.field("page", cursor.as_str());
                }
                let path = format!("/v1/payment_intents/search?{}", params.encode());
                let list = match self.get::<Page<PaymentIntent>>(&path).await? {
                    Got::Found(list) => list,
                    // Search is not available everywhere (not in India): no
                    // answer about charges.
                    Got::Missing => {
                        return Err(QueryError("the search endpoint answered 404".into()));
                    }
                };
                Ok(pages::Page {
                    next: list.next_page,
                    has_more: list.has_more,
                    kept: PaymentIntent::referenced(list.data, reference),
                })
            },
        )
        .await
    }

    /// `GET /v1/refunds?payment_intent=...`, every page (Stripe has no
    /// refund search); only the refunds under `reference` are kept.
    async fn refunds_of(
        &self,
        reference: &str,
        intent: &str,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        read_to_end(self.config.max_pages, "refunds", |after| async move {
            let mut params = Form::new()
                .field("payment_intent", intent)
                .field("limit", "100");
            if let Some(last) = &after {
                params = params.field("starting_after", last.as_str());
            }
            let path = format!("/v1/refunds?{}", params.encode());
            let list = match self.get::<Page<Refund>>(&path).await? {
                Got::Found(list) => list,
                // The PaymentIntent cobro holds is not this key's: proves
                // nothing about its refunds.
                Got::Missing => {
                    return Err(QueryError(
                        "Stripe does not know the refunded PaymentIntent".into(),
                    ));
                }
            };
            Ok(pages::Page {
                next: list.data.last().map(|r| r.id.clone()),
                has_more: list.has_more,
                kept: list
                    .data
                    .into_iter()
                    .filter(|r| r.is_refund() && r.reference().as_deref() == Some(reference))
                    .map(Refund::into_object)
                    .collect(),
            })
        })
        .await
    }
}

/// The idempotency key of an attempt's second call `call` (see the
/// module docs): the attempt's key and a suffix fixed per call.
pub fn derived_key(key: &str, call: &str) -> String {
    format!("{key}:{call}")
}

/// What Stripe says about the call itself.
fn call_info(headers: &HeaderMap) -> CallInfo {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    CallInfo {
        request_id: text("request-id")
            .filter(|id| !id.is_empty())
            .map(str::to_owned),
        replayed: text("idempotent-replayed") == Some("true"),
        should_retry: match text("stripe-should-retry") {
            Some("true") => Some(true),
            Some("false") => Some(false),
            _ => None,
        },
    }
}

/// The body as what Stripe sends for `status`: the operation's object on
/// a 2xx, `{"error": ...}` otherwise; anything else is malformed.
fn read_body(op: Op, status: u16, bytes: &[u8]) -> Body {
    if (200..300).contains(&status) {
        if op == Op::Refund {
            match serde_json::from_slice::<Refund>(bytes) {
                Ok(refund) if refund.is_refund() => Body::Refund(refund),
                _ => Body::Malformed,
            }
        } else {
            match serde_json::from_slice::<PaymentIntent>(bytes) {
                Ok(intent) if intent.is_payment_intent() => Body::PaymentIntent(intent),
                _ => Body::Malformed,
            }
        }
    } else {
        match serde_json::from_slice::<ErrorBody>(bytes) {
            Ok(body) => Body::Error(body.error),
            Err(_) => Body::Malformed,
        }
    }
}

/// What a send answers without sending: an amount Stripe cannot take,
/// or a refund whose currency could not be read.
fn not_sendable(unsent: Unsent) -> Sent {
    Sent {
        outcome: unsent.into_outcome(),
        call: None,
    }
}

/// `POST /v1/payment_intents`: create and confirm in one request. `Err`:
/// an amount Stripe cannot take, never sent ([`form::amount`]).
fn authorize_form(request: &AuthorizeRequest) -> Result<Form, Unsent> {
    let mut metadata = request.metadata.clone();
    metadata.insert(metadata::REFERENCE.to_owned(), request.reference.clone());
    Ok(Form::new()
        .field("amount", form::amount(&request.currency, request.amount)?)
        .field("currency", request.currency.to_ascii_lowercase())
        .field(
            "capture_method",
            if request.capture {
                "automatic"
            } else {
                "manual"
            },
        )
        // Not `error_on_requires_action` (which would turn a 3-D Secure
        // challenge into a decline): cobro waits for the customer.
        .field("confirm", "true")
        .field("payment_method", request.payment_method.as_str())
        .array("payment_method_types", &["card"])
        .hash("metadata", &metadata)
        // Only with one: a payment created without it keeps the body its
        // key was first sent with.
        .field_opt("return_url", request.return_url.as_deref()))
}

/// `POST /v1/refunds`, its amount in `currency` (the refunded
/// PaymentIntent's). `Err`: an amount Stripe cannot take, never sent.
fn refund_form(request: &RefundRequest, currency: &str) -> Result<Form, Unsent> {
    let mut metadata = request.metadata.clone();
    metadata.insert(metadata::REFERENCE.to_owned(), request.reference.clone());
    Ok(Form::new()
        .field("payment_intent", request.charge.as_str())
        .field("amount", form::amount(currency, request.amount)?)
        .hash("metadata", &metadata))
}

impl StripeProvider {
    /// The currency of the PaymentIntent a refund is of: Stripe counts a
    /// refund's `amount` in it (ISK 5000 is `500000`), and a
    /// `RefundRequest` does not carry it. It is read first (`GET`, the
    /// `get_charge` query); a read that fails sends nothing (`NotSent`,
    /// retried with the same key). A resend reads the same currency, so
    /// it sends the same body under the same key.
    async fn refund_currency(&self, request: &RefundRequest) -> Result<String, Unsent> {
        let not_sent = |why: String| {
            Unsent::NotSent(format!("refund_currency: {why}: the refund was not sent"))
        };
        match self.get_charge(&request.charge).await {
            Ok(Some(intent)) => intent
                .currency
                .ok_or_else(|| not_sent(format!("PaymentIntent {} has no currency", intent.id))),
            Ok(None) => Err(not_sent(format!(
                "Stripe does not know PaymentIntent {}",
                request.charge
            ))),
            Err(e) => Err(not_sent(e.to_string())),
        }
    }
}

impl Provider for StripeProvider {
    fn name(&self) -> &str {
        &self.config.name
    }

    async fn authorize(&self, key: &str, request: &AuthorizeRequest) -> Outcome {
        self.send(key, Mutation::Authorize(request)).await.outcome
    }

    async fn capture(&self, key: &str, charge: &str) -> Outcome {
        self.send(key, Mutation::Capture(charge)).await.outcome
    }

    async fn void(&self, key: &str, charge: &str) -> Outcome {
        self.send(key, Mutation::Void(charge)).await.outcome
    }

    async fn refund(&self, key: &str, request: &RefundRequest) -> Outcome {
        self.send(key, Mutation::Refund(request)).await.outcome
    }

    async fn send(&self, key: &str, mutation: Mutation<'_>) -> Sent {
        match mutation {
            Mutation::Authorize(request) => self.authorize_and_tidy(key, request).await,
            Mutation::Capture(charge) => {
                let path = format!("/v1/payment_intents/{}/capture", encoded(charge));
                self.post(Op::Capture, key, &path, Form::new()).await
            }
            Mutation::Void(charge) => {
                let path = format!("/v1/payment_intents/{}/cancel", encoded(charge));
                self.post(Op::Void, key, &path, Form::new()).await
            }
            Mutation::Refund(request) => {
                let form = self
                    .refund_currency(request)
                    .await
                    .and_then(|currency| refund_form(request, &currency));
                match form {
                    Ok(form) => self.post(Op::Refund, key, "/v1/refunds", form).await,
                    Err(unsent) => not_sendable(unsent),
                }
            }
        }
    }

    async fn get_charge(&self, id: &str) -> Result<Option<ProviderObject>, QueryError> {
        let path = format!("/v1/payment_intents/{}", encoded(id));
        let run = async {
            match self.get::<PaymentIntent>(&path).await? {
                Got::Found(intent) if intent.is_payment_intent() => Ok(Some(intent.into_object())),
                Got::Found(_) => Err(QueryError("the answer is not a PaymentIntent".into())),
                Got::Missing => Ok(None),
            }
        };
        self.query("get_charge", run, Option::is_some).await
    }

    async fn search_charges(&self, reference: &str) -> Result<Vec<ProviderObject>, QueryError> {
        self.query(
            "search_charges",
            self.search_payment_intents(reference),
            |found| !found.is_empty(),
        )
        .await
    }

    /// Stripe cannot search refunds: they are listed by their
    /// PaymentIntent; without it there is nothing to list, and that proves
    /// nothing.
    async fn search_refunds(
        &self,
        reference: &str,
        charge: Option<&str>,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        let Some(intent) = charge else {
            return Err(QueryError(
                "Stripe has no refund search: refunds are listed by their PaymentIntent, which was not given"
                    .into(),
            ));
        };
        self.query(
            "search_refunds",
            self.refunds_of(reference, intent),
            |found| !found.is_empty(),
        )
        .await
    }

    /// `GET /v1/payment_intents?limit=1`: the list proof of absence reads.
    /// 401: the key is wrong, revoked or of the other mode; 403: a
    /// restricted key without the permission.
    async fn check_credentials(&self) -> Credentials {
        let answer = self
            .request(self.client.get(self.url("/v1/payment_intents?limit=1")))
            .send()
            .await;
        match answer {
            Ok(response) => Credentials::from_status(response.status().as_u16(), |status| {
                match status {
                401 => "Stripe refused the API key (401): a wrong, revoked or rolled key, or one of the other mode".to_owned(),
                _ => "Stripe refused the API key the read of PaymentIntents (403): a restricted key needs write access to PaymentIntents and Refunds".to_owned(),
            }
            }),
            Err(e) => Credentials::Unknown(redact(&e)),
        }
    }

    async fn list_charges(
        &self,
        reference: &str,
        window: Window,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        self.query(
            "list_charges",
            self.list_payment_intents(reference, window),
            |found| !found.is_empty(),
        )
        .await
    }

    async fn ledger_page(
        &self,
        kind: LedgerKind,
        window: Window,
        after: Option<&str>,
    ) -> Result<LedgerPage, QueryError> {
        self.query(
            "ledger_page",
            self.ledger_page_of(kind, window, after),
            |page| !page.objects.is_empty(),
        )
        .await
    }

    /// A PaymentIntent's refunds are a list, which Stripe reads
    /// consistently: the same read as [`Provider::search_refunds`].
    async fn list_refunds(
        &self,
        reference: &str,
        charge: &str,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        self.query(
            "list_refunds",
            self.refunds_of(reference, charge),
            |found| !found.is_empty(),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn config(url: &str) -> StripeConfig {
        StripeConfig::new(url, StripeSecretKey::new("sk_test_hunter2"))
    }

    #[test]
    fn the_secret_key_never_shows_in_debug_output() {
        let config = config("http://127.0.0.1:1");
        assert!(!format!("{config:?}").contains("hunter2"));
        let provider = StripeProvider::new(config).expect("provider");
        assert!(!format!("{provider:?}").contains("hunter2"));
        assert_eq!(
            format!("{:?}", StripeSecretKey::new("sk_live_x")),
            "StripeSecretKey(***)"
        );
    }

    #[test]
    fn the_base_url_must_be_reachable_without_leaking_the_key() {
        for ok in [
            "http://127.0.0.1:12111",
            "http://localhost:8089/",
            "http://[::1]:80",
        ] {
            assert!(StripeProvider::new(config(ok)).is_ok(), "{ok}");
        }
        assert!(matches!(
            StripeProvider::new(config("http://stripe.example:80")),
            Err(StripeConfigError::PlainHttp(host)) if host == "stripe.example"
        ));
        assert!(matches!(
            StripeProvider::new(config("ftp://127.0.0.1")),
            Err(StripeConfigError::BaseUrl)
        ));
        assert!(matches!(
            StripeProvider::new(config("not a url")),
            Err(StripeConfigError::BaseUrl)
        ));
        let empty = StripeConfig::new("http://127.0.0.1:1", StripeSecretKey::new(""));
        assert!(matches!(
            StripeProvider::new(empty),
            Err(StripeConfigError::EmptyKey)
        ));
    }

    #[test]
    fn an_https_base_url_is_accepted_now_that_the_build_speaks_tls() {
        for ok in [STRIPE_API, "https://stripe.example:8443/"] {
            let provider = StripeProvider::new(config(ok));
            assert!(provider.is_ok(), "{ok}: {:?}", provider.err());
        }
    }

    #[test]
    fn scrubbing_takes_out_the_key_and_the_secret() {
        let provider = StripeProvider::new(config("http://127.0.0.1:1")).expect("provider");
        let text = provider.scrub("key 'k-1' with sk_test_hunter2", "k-1");
        assert_eq!(text, "key '<idempotency key>' with <secret key>");
    }

    /// A replayed answer whose body is lost after its headers: what the key
    /// stored was not read (it may be a stored success), so the call is not
    /// reported as a replay, which the worker and the reconciler would take
    /// for a stored error. The request id is kept.
    #[tokio::test]
    async fn a_replay_whose_body_is_lost_is_not_reported_as_a_replay() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let _server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("accept");
            let mut buf = vec![0u8; 8192];
            let mut seen = Vec::new();
            // The whole form (its last field is the reference), then an
            // answer cut short: 40 of 4096 promised bytes.
            while !String::from_utf8_lossy(&seen).contains("o-1%3Aauthorize-v1") {
                let n = socket.read(&mut buf).await.expect("read");
                if n == 0 {
                    return;
                }
                seen.extend_from_slice(&buf[..n]);
            }
            let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                        idempotent-replayed: true\r\nrequest-id: req_cut\r\n\
                        content-length: 4096\r\n\r\n{\"id\": \"pi_1\", \"object\": \"payment_intent\"";
            socket.write_all(head.as_bytes()).await.expect("write");
            socket.shutdown().await.expect("shutdown");
        });
        let provider = StripeProvider::new(config(&url)).expect("provider");
        let request = AuthorizeRequest {
            amount: 1999,
            currency: "EUR".into(),
            payment_method: "pm_card_visa".into(),
            capture: true,
            reference: "o-1:authorize-v1".into(),
            metadata: BTreeMap::new(),
            return_url: None,
        };
        let sent = provider.send("k-1", Mutation::Authorize(&request)).await;
        assert_eq!(sent.outcome.class(), "unknown", "{:?}", sent.outcome);
        let call = sent.call.expect("the call's headers were read");
        assert!(!call.replayed, "{call:?}");
        assert_eq!(call.request_id.as_deref(), Some("req_cut"));
    }

    #[test]
    fn an_authorisation_is_one_create_and_confirm_with_the_reference_as_metadata() {
        let request = AuthorizeRequest {
            amount: 1999,
            currency: "EUR".into(),
            payment_method: "pm_card_visa".into(),
            capture: false,
            reference: "o-1:authorize-v1/a".into(),
            metadata: BTreeMap::from([(metadata::ATTEMPT.to_owned(), "a".to_owned())]),
            return_url: None,
        };
        let form = authorize_form(&request).expect("EUR 19.99 is sent");
        let pairs: Vec<(&str, &str)> = form
            .pairs()
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("amount", "1999"),
                ("currency", "eur"),
                ("capture_method", "manual"),
                ("confirm", "true"),
                ("payment_method", "pm_card_visa"),
                ("payment_method_types[0]", "card"),
                ("metadata[cobro_attempt]", "a"),
                ("metadata[cobro_reference]", "o-1:authorize-v1/a"),
            ]
        );
    }
}
