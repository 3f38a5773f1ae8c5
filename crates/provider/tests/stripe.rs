//! The Stripe connector against a scripted Stripe: an axum server on
//! 127.0.0.1:0 that answers each request with the next scripted reply
//! (Stripe's own bodies and headers, API version 2024-06-20) and records
//! exactly what it received. One test per row of the classification table
//! (`cobro_provider::stripe::CLASSIFICATION` names them), then the
//! queries: GET, search, refund listing.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use cobro_provider::stripe::STRIPE_VERSION;
use cobro_provider::{
    AuthorizeRequest, CallInfo, Credentials, Mutation, Outcome, Provider, ProviderStatus,
    RefundRequest, Sent, StripeConfig, StripeProvider, StripeSecretKey,
};
use serde_json::{Value, json};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SECRET: &str = "sk_test_51Hunter2";
const KEY: &str = "0192c7e4-key-1";
const REFERENCE: &str = "o-1:authorize-v1/0192c7e4-attempt";

/// One request as the scripted Stripe received it.
#[derive(Clone, Debug)]
struct Received {
    method: Method,
    path: String,
    query: Vec<(String, String)>,
    headers: HeaderMap,
    form: Vec<(String, String)>,
}

impl Received {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn form(&self) -> Vec<(&str, &str)> {
        self.form
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    fn query(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// What every request to Stripe carries.
    fn assert_stripe_headers(&self) {
        assert_eq!(
            self.header("authorization"),
            Some(format!("Bearer {SECRET}").as_str())
        );
        assert_eq!(self.header("stripe-version"), Some(STRIPE_VERSION));
    }

    /// What every POST carries besides: the attempt's own key, a form.
    fn assert_post(&self, path: &str) {
        assert_eq!(self.method, Method::POST);
        assert_eq!(self.path, path);
        self.assert_stripe_headers();
        assert_eq!(self.header("idempotency-key"), Some(KEY));
        assert_eq!(
            self.header("content-type"),
            Some("application/x-www-form-urlencoded")
        );
    }
}

/// One scripted answer.
#[derive(Clone, Debug)]
struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
    /// Never answer (the client times out).
    hang: bool,
}

impl Reply {
    fn new(status: u16, body: &Value) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.to_string(),
            hang: false,
        }
    }

    fn raw(status: u16, body: &str) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.to_owned(),
            hang: false,
        }
    }

    fn with(mut self, name: &'static str, value: &str) -> Self {
        self.headers.push((name, value.to_owned()));
        self
    }

    fn replayed(self) -> Self {
        self.with("idempotent-replayed", "true")
            .with("original-request", "req_original")
    }
}

#[derive(Default)]
struct Script {
    replies: Mutex<VecDeque<Reply>>,
    received: Mutex<Vec<Received>>,
}

impl Script {
    fn received(&self) -> Vec<Received> {
        self.received.lock().expect("lock").clone()
    }

    fn only(&self) -> Received {
        let received = self.received();
        assert_eq!(received.len(), 1, "{received:?}");
        received[0].clone()
    }
}

/// What cobro logged (spans as they close, events) while a guard lives.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .finish();
        (logs.clone(), tracing::subscriber::set_default(subscriber))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;

    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

fn pairs(text: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(text.as_bytes())
        .into_owned()
        .collect()
}

async fn answer(
    State(script): State<Arc<Script>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let n = {
        let mut received = script.received.lock().expect("lock");
        received.push(Received {
            method,
            path: uri.path().to_owned(),
            query: pairs(uri.query().unwrap_or_default()),
            headers: headers.clone(),
            form: pairs(&String::from_utf8_lossy(&body)),
        });
        received.len()
    };
    let Some(reply) = script.replies.lock().expect("lock").pop_front() else {
        return (StatusCode::IM_A_TEAPOT, "the script ran out").into_response();
    };
    if reply.hang {
        std::future::pending::<()>().await;
    }
    let mut response = (
        StatusCode::from_u16(reply.status).expect("status"),
        reply.body,
    )
        .into_response();
    let out = response.headers_mut();
    // What Stripe sends with every answer.
    out.insert("content-type", HeaderValue::from_static("application/json"));
    out.insert(
        "request-id",
        HeaderValue::from_str(&format!("req_{n}")).expect("ascii"),
    );
    out.insert("stripe-version", HeaderValue::from_static(STRIPE_VERSION));
    if let Some(key) = headers.get("idempotency-key") {
        out.insert("idempotency-key", key.clone());
    }
    for (name, value) in reply.headers {
        out.insert(
            HeaderName::from_static(name),
            HeaderValue::from_str(&value).expect("ascii"),
        );
    }
    response
}

/// A Stripe that answers `replies` in order, and a connector pointed at it.
async fn stripe_with(replies: Vec<Reply>, timeout: Duration) -> (StripeProvider, Arc<Script>) {
    let script = Arc::new(Script {
        replies: Mutex::new(replies.into()),
        received: Mutex::default(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = Router::new().fallback(answer).with_state(script.clone());
    tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    let mut config = StripeConfig::new(url, StripeSecretKey::new(SECRET));
    config.request_timeout = timeout;
    (StripeProvider::new(config).expect("provider"), script)
}

async fn stripe(replies: Vec<Reply>) -> (StripeProvider, Arc<Script>) {
    stripe_with(replies, Duration::from_secs(5)).await
}

fn metadata() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("cobro_account".to_owned(), "0192-account".to_owned()),
        ("cobro_attempt".to_owned(), "0192c7e4-attempt".to_owned()),
        ("cobro_intent".to_owned(), "o-1:authorize-v1".to_owned()),
        ("cobro_payment".to_owned(), "0192-payment".to_owned()),
    ])
}

fn authorization(capture: bool) -> AuthorizeRequest {
    AuthorizeRequest {
        amount: 1999,
        currency: "EUR".into(),
        payment_method: "pm_card_visa".into(),
        capture,
        reference: REFERENCE.into(),
        metadata: metadata(),
        return_url: None,
    }
}

fn refund_request() -> RefundRequest {
    RefundRequest {
        charge: "pi_3PqRsT".into(),
        amount: 500,
        reference: "o-1:refund-v1/0192-refund-attempt".into(),
        metadata: metadata(),
    }
}

/// The metadata Stripe echoes: what cobro sent, with its reference.
fn echoed(reference: &str) -> Value {
    let mut m: serde_json::Map<String, Value> = metadata()
        .into_iter()
        .map(|(k, v)| (k, Value::String(v)))
        .collect();
    m.insert("cobro_reference".into(), Value::String(reference.into()));
    Value::Object(m)
}

/// A PaymentIntent as Stripe renders it.
fn payment_intent(status: &str, capture_method: &str) -> Value {
    let captured = status == "succeeded";
    json!({
        "id": "pi_3PqRsT",
        "object": "payment_intent",
        "amount": 1999,
        "amount_capturable": if status == "requires_capture" { 1999 } else { 0 },
        "amount_details": {"tip": {}},
        "amount_received": if captured { 1999 } else { 0 },
        "application": null,
        "application_fee_amount": null,
        "automatic_payment_methods": null,
        "canceled_at": if status == "canceled" { json!(1_800_000_100) } else { Value::Null },
        "cancellation_reason": null,
        "capture_method": capture_method,
        "client_secret": "pi_3PqRsT_secret_abc",
        "confirmation_method": "automatic",
        "created": 1_800_000_000,
        "currency": "eur",
        "customer": null,
        "description": null,
        "last_payment_error": null,
        "latest_charge": "ch_3PqRsT",
        "livemode": false,
        "metadata": echoed(REFERENCE),
        "next_action": if status == "requires_action" {
            json!({"type": "use_stripe_sdk", "use_stripe_sdk": {}})
        } else { Value::Null },
        "payment_method": "pm_1PqRsT",
        "payment_method_types": ["card"],
        "processing": null,
        "status": status,
    })
}

fn declined_intent() -> Value {
    let mut pi = payment_intent("requires_payment_method", "manual");
    pi["last_payment_error"] = json!({
        "charge": "ch_3PqRsT",
        "code": "card_declined",
        "decline_code": "insufficient_funds",
        "doc_url": "https://stripe.com/docs/error-codes/card-declined",
        "message": "Your card has insufficient funds.",
        "type": "card_error",
    });
    pi["latest_charge"] = json!("ch_3PqRsT");
    pi
}

fn refund_object(status: &str) -> Value {
    json!({
        "id": "re_3PqRsT",
        "object": "refund",
        "amount": 500,
        "balance_transaction": null,
        "charge": "ch_3PqRsT",
        "created": 1_800_000_200,
        "currency": "eur",
        "destination_details": {"card": {"type": "pending"}, "type": "card"},
        "failure_reason": if status == "failed" { json!("expired_or_canceled_card") } else { Value::Null },
        "metadata": echoed("o-1:refund-v1/0192-refund-attempt"),
        "payment_intent": "pi_3PqRsT",
        "reason": null,
        "receipt_number": null,
        "status": status,
    })
}

/// The refunded PaymentIntent, as the connector reads it before a refund
/// (`GET /v1/payment_intents/{id}`) to learn its currency.
fn refunded_intent() -> Reply {
    Reply::new(200, &payment_intent("succeeded", "automatic"))
}

/// What the connector reads before each refund: the GET of its
/// PaymentIntent, without an idempotency key.
fn assert_currency_read(request: &Received) {
    assert_eq!(request.method, Method::GET);
    assert_eq!(request.path, "/v1/payment_intents/pi_3PqRsT");
    request.assert_stripe_headers();
    assert_eq!(request.header("idempotency-key"), None);
}

/// `{"error": ...}` as Stripe sends it.
fn error(kind: &str, code: Option<&str>, message: &str, extra: Value) -> Value {
    let mut e = json!({
        "type": kind,
        "message": message,
        "request_log_url": "https://dashboard.stripe.com/test/logs/req_1?t=1800000000",
    });
    if let Some(code) = code {
        e["code"] = json!(code);
        e["doc_url"] = json!(format!(
            "https://stripe.com/docs/error-codes/{}",
            code.replace('_', "-")
        ));
    }
    if let Value::Object(extra) = extra {
        for (k, v) in extra {
            e[k] = v;
        }
    }
    json!({ "error": e })
}

async fn authorize(provider: &StripeProvider, capture: bool) -> Sent {
    provider
        .send(KEY, Mutation::Authorize(&authorization(capture)))
        .await
}

fn reason(outcome: &Outcome) -> &str {
    match outcome {
        Outcome::NotSent(r) | Outcome::NotConnected(r) | Outcome::Unknown(r) => r,
        other => panic!("not a NotSent or Unknown: {other:?}"),
    }
}

fn assert_class(sent: &Sent, class: &str, row: &str) {
    assert_eq!(sent.outcome.class(), class, "{:?}", sent.outcome);
    if matches!(class, "not_sent" | "unknown") {
        assert!(
            reason(&sent.outcome).starts_with(&format!("{row}:")),
            "{:?}",
            sent.outcome
        );
    }
    let text = format!("{sent:?}");
    assert!(!text.contains(SECRET), "the secret leaked: {text}");
    assert!(!text.contains(KEY), "the key leaked: {text}");
}

// ---- one test per row ----

#[tokio::test]
async fn a_refused_connection_is_not_sent() {
    // Bind then drop: nothing listens there any more.
    let port = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let config = StripeConfig::new(
        format!("http://127.0.0.1:{port}"),
        StripeSecretKey::new(SECRET),
    );
    let provider = StripeProvider::new(config).expect("provider");
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "not_sent", "not_connected");
    assert!(
        matches!(sent.outcome, Outcome::NotConnected(_)),
        "nothing left cobro: the proof routing may move on: {:?}",
        sent.outcome
    );
    assert_eq!(sent.call, None, "no answer, nothing known of the call");
}

#[tokio::test]
async fn a_timeout_after_sending_is_unknown() {
    let hang = Reply {
        hang: true,
        ..Reply::raw(200, "")
    };
    let (provider, script) = stripe_with(vec![hang], Duration::from_millis(300)).await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "unknown", "no_answer");
    // It was sent, under the attempt's key: Stripe may have acted on it.
    script.only().assert_post("/v1/payment_intents");
}

#[tokio::test]
async fn a_manual_authorisation_is_sent_as_stripe_documents_it() {
    let (provider, script) = stripe(vec![Reply::new(
        200,
        &payment_intent("requires_capture", "manual"),
    )])
    .await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "succeeded", "proven");
    let Outcome::Succeeded(object) = &sent.outcome else {
        unreachable!()
    };
    assert_eq!(object.id, "pi_3PqRsT");
    assert_eq!(object.status, ProviderStatus::Authorized);
    assert_eq!(object.reference.as_deref(), Some(REFERENCE));
    assert_eq!(object.amount, Some(1999));
    assert_eq!(object.amount_captured, Some(0));
    assert_eq!(
        object.currency.as_deref(),
        Some("EUR"),
        "as cobro compares it"
    );
    assert_eq!(object.capture_method.as_deref(), Some("manual"));
    assert_eq!(
        object.metadata.get("cobro_attempt").map(String::as_str),
        Some("0192c7e4-attempt")
    );
    assert_eq!(
        sent.call,
        Some(CallInfo {
            request_id: Some("req_1".into()),
            replayed: false,
            should_retry: None,
        })
    );
    let request = script.only();
    request.assert_post("/v1/payment_intents");
    assert_eq!(
        request.form(),
        [
            ("amount", "1999"),
            ("currency", "eur"),
            ("capture_method", "manual"),
            ("confirm", "true"),
            ("payment_method", "pm_card_visa"),
            ("payment_method_types[0]", "card"),
            ("metadata[cobro_account]", "0192-account"),
            ("metadata[cobro_attempt]", "0192c7e4-attempt"),
            ("metadata[cobro_intent]", "o-1:authorize-v1"),
            ("metadata[cobro_payment]", "0192-payment"),
            ("metadata[cobro_reference]", REFERENCE),
        ]
    );
}

#[tokio::test]
async fn an_automatic_authorisation_is_captured_and_a_replay_says_so() {
    let reply = Reply::new(200, &payment_intent("succeeded", "automatic")).replayed();
    let (provider, script) = stripe(vec![reply]).await;
    let sent = authorize(&provider, true).await;
    assert_class(&sent, "succeeded", "proven");
    let Outcome::Succeeded(object) = &sent.outcome else {
        unreachable!()
    };
    assert_eq!(object.status, ProviderStatus::Captured);
    assert_eq!(object.amount_captured, Some(1999));
    assert!(sent.call.as_ref().is_some_and(|c| c.replayed));
    let request = script.only();
    assert!(request.form().contains(&("capture_method", "automatic")));
}

#[tokio::test]
async fn an_authorisation_answered_declined_with_2xx_is_declined() {
    let (provider, _) = stripe(vec![Reply::new(200, &declined_intent())]).await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "declined", "authorize_declined_2xx");
    let Outcome::Declined { code, object, .. } = &sent.outcome else {
        unreachable!()
    };
    assert_eq!(code, "insufficient_funds");
    assert_eq!(
        object.as_ref().map(|o| &o.status),
        Some(&ProviderStatus::Declined)
    );
}

/// The row, and the cancel that follows it: the PaymentIntent left
/// waiting for a confirmation cobro never gives is canceled under the
/// attempt's derived key `<key>:cancel`.
#[tokio::test]
async fn an_authorisation_that_needs_the_customer_failed() {
    let (provider, script) = stripe(vec![
        Reply::new(200, &payment_intent("requires_confirmation", "manual")),
        Reply::new(200, &payment_intent("canceled", "manual")),
    ])
    .await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "failed", "authorize_needs_customer");
    let Outcome::Failed { code, object, .. } = &sent.outcome else {
        unreachable!()
    };
    assert_eq!(code, "requires_confirmation");
    assert_eq!(
        object.as_ref().map(|o| &o.status),
        Some(&ProviderStatus::Other("requires_confirmation".into())),
        "kept, and never evidence"
    );
    let received = script.received();
    assert_eq!(received.len(), 2, "the authorisation and its cancel");
    let cancel = &received[1];
    assert_eq!(cancel.method, Method::POST);
    assert_eq!(cancel.path, "/v1/payment_intents/pi_3PqRsT/cancel");
    cancel.assert_stripe_headers();
    assert_eq!(
        cancel.header("idempotency-key"),
        Some(format!("{KEY}:cancel").as_str())
    );
    assert_eq!(cancel.form(), [("cancellation_reason", "abandoned")]);
}

/// 3-D Secure: the PaymentIntent waits for its customer. It is passed up
/// with its action (the redirect and the client secret), one request and
/// no cancel; the `return_url` is sent with the confirmation.
#[tokio::test]
async fn an_authorisation_that_needs_the_customer_waits_for_them() {
    let mut waiting = payment_intent("requires_action", "manual");
    waiting["next_action"] = json!({
        "type": "redirect_to_url",
        "redirect_to_url": {"url": "https://hooks.stripe.com/3d_secure_2/x", "return_url": "https://shop.example/back"},
    });
    let (provider, script) = stripe(vec![Reply::new(200, &waiting)]).await;
    let request = AuthorizeRequest {
        return_url: Some("https://shop.example/back".into()),
        ..authorization(false)
    };
    let sent = provider.send(KEY, Mutation::Authorize(&request)).await;
    assert_class(&sent, "succeeded", "authorize_requires_action");
    let Outcome::Succeeded(object) = &sent.outcome else {
        unreachable!()
    };
    assert_eq!(object.status, ProviderStatus::RequiresAction);
    let action = object.next_action.as_ref().expect("the action");
    assert_eq!(
        action.redirect_url.as_deref(),
        Some("https://hooks.stripe.com/3d_secure_2/x")
    );
    assert_eq!(
        action.client_secret.as_deref(),
        Some("pi_3PqRsT_secret_abc")
    );
    assert!(
        !format!("{object:?}").contains("secret_abc")
            && !serde_json::to_string(object)
                .unwrap_or_default()
                .contains("secret_abc"),
        "the client secret is never in a log line or in stored evidence"
    );
    let received = script.received();
    assert_eq!(received.len(), 1, "no cancel: cobro waits for the customer");
    assert!(
        received[0]
            .form()
            .contains(&("return_url", "https://shop.example/back")),
        "{:?}",
        received[0].form()
    );
}

/// Best effort: a cancel Stripe refuses (or never answers) changes
/// nothing of the authorisation's outcome, and is not retried here.
#[tokio::test]
async fn a_failed_cancel_of_a_payment_intent_left_for_the_customer_leaves_the_outcome_failed() {
    let (provider, script) = stripe(vec![
        Reply::new(200, &payment_intent("requires_confirmation", "manual")),
        Reply::new(
            500,
            &error("api_error", None, "An unknown error occurred", json!({})),
        ),
    ])
    .await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "failed", "authorize_needs_customer");
    assert_eq!(script.received().len(), 2);
}

#[tokio::test]
async fn a_refund_answered_failed_failed() {
    let (provider, script) = stripe(vec![
        refunded_intent(),
        Reply::new(200, &refund_object("failed")),
    ])
    .await;
    let sent = provider
        .send(KEY, Mutation::Refund(&refund_request()))
        .await;
    assert_class(&sent, "failed", "refund_refused_2xx");
    let Outcome::Failed { object, .. } = &sent.outcome else {
        unreachable!()
    };
    let refund = object.as_ref().expect("the refund");
    assert_eq!(refund.status, ProviderStatus::Failed);
    assert_eq!(refund.charge.as_deref(), Some("pi_3PqRsT"));
    let received = script.received();
    assert_eq!(received.len(), 2, "{received:?}");
    assert_currency_read(&received[0]);
    let request = &received[1];
    request.assert_post("/v1/refunds");
    assert_eq!(
        request.form(),
        [
            ("payment_intent", "pi_3PqRsT"),
            ("amount", "500"),
            ("metadata[cobro_account]", "0192-account"),
            ("metadata[cobro_attempt]", "0192c7e4-attempt"),
            ("metadata[cobro_intent]", "o-1:authorize-v1"),
            ("metadata[cobro_payment]", "0192-payment"),
            (
                "metadata[cobro_reference]",
                "o-1:refund-v1/0192-refund-attempt"
            ),
        ]
    );
}

/// A PaymentIntent answered `processing` is made and not final: passed up
/// with its object (cobro judges it in progress and hands it over), never
/// taken for an outcome or for nothing.
#[tokio::test]
async fn a_processing_payment_intent_is_passed_up_in_progress() {
    let (provider, _) = stripe(vec![Reply::new(
        200,
        &payment_intent("processing", "automatic"),
    )])
    .await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "succeeded", "authorize_in_progress_2xx");
    match &sent.outcome {
        Outcome::Succeeded(object) => {
            assert_eq!(object.id, "pi_3PqRsT");
            assert_eq!(object.status, ProviderStatus::Other("processing".into()));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_refund_answered_pending_is_unknown() {
    let (provider, _) = stripe(vec![
        refunded_intent(),
        Reply::new(200, &refund_object("pending")),
    ])
    .await;
    let sent = provider
        .send(KEY, Mutation::Refund(&refund_request()))
        .await;
    assert_class(&sent, "unknown", "not_yet");
    assert!(reason(&sent.outcome).contains("re_3PqRsT pending"));
}

#[tokio::test]
async fn a_malformed_success_is_unknown() {
    let (provider, _) = stripe(vec![Reply::raw(200, "<html>maintenance</html>")]).await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "unknown", "malformed_2xx");
}

#[tokio::test]
async fn an_idempotency_error_is_unknown_and_alarmed() {
    let body = error(
        "idempotency_error",
        None,
        &format!(
            "Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than '{KEY}' if you meant to execute a different request."
        ),
        json!({}),
    );
    let (provider, script) = stripe(vec![Reply::new(400, &body)]).await;
    let (logs, _guard) = Logs::capture();
    let sent = authorize(&provider, false).await;
    // Never a new key: unknown, and the key never quoted back.
    assert_class(&sent, "unknown", "idempotency_mismatch");
    assert_eq!(script.received().len(), 1, "no second send");
    let logs = logs.text();
    let alarm = logs
        .lines()
        .find(|l| l.contains("idempotency key reused with other parameters"))
        .unwrap_or_else(|| panic!("no alarm in {logs}"));
    assert!(alarm.contains("ERROR"), "{alarm}");
    assert!(alarm.contains("request_id=\"req_1\""), "{alarm}");
    assert!(logs.contains("outcome=\"idempotency_error\""), "{logs}");
    assert!(!logs.contains(KEY) && !logs.contains(SECRET), "{logs}");
}

#[tokio::test]
async fn a_key_in_use_is_unknown() {
    let body = error(
        "invalid_request_error",
        Some("idempotency_key_in_use"),
        "There is currently another in-progress request using this Stripe token (probably the same idempotency key). Please try again later.",
        json!({}),
    );
    let reply = Reply::new(409, &body).with("stripe-should-retry", "true");
    let (provider, _) = stripe(vec![reply]).await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "unknown", "key_in_use");
    assert_eq!(sent.call.and_then(|c| c.should_retry), Some(true));
}

#[tokio::test]
async fn a_lock_timeout_is_unknown() {
    let body = error(
        "invalid_request_error",
        Some("lock_timeout"),
        "This object cannot be accessed right now because another API request or Stripe process is currently accessing it. If you see this error intermittently, retry the request.",
        json!({}),
    );
    let reply = Reply::new(429, &body).with("stripe-should-retry", "true");
    let (provider, _) = stripe(vec![reply]).await;
    let sent = provider.send(KEY, Mutation::Capture("pi_3PqRsT")).await;
    assert_class(&sent, "unknown", "lock_timeout");
}

#[tokio::test]
async fn a_rate_limited_request_is_not_sent() {
    let body = error(
        "invalid_request_error",
        Some("rate_limit"),
        "Request rate limit exceeded. Learn more about rate limits here https://stripe.com/docs/rate-limits.",
        json!({}),
    );
    let (provider, _) = stripe(vec![Reply::new(429, &body)]).await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "not_sent", "rate_limited");
    assert!(
        matches!(sent.outcome, Outcome::NotSent(_)),
        "an answer, never proof that nothing left: {:?}",
        sent.outcome
    );
}

/// Stripe's older answer to rate limiting: a 400 with code `rate_limit`.
/// Nothing executed: the resend under the same key, with the same body,
/// is the first that runs.
#[tokio::test]
async fn a_legacy_400_rate_limit_is_not_sent() {
    let body = error(
        "invalid_request_error",
        Some("rate_limit"),
        "Too many requests hit the API too quickly. We recommend an exponential backoff of your requests.",
        json!({}),
    );
    let (provider, script) = stripe(vec![
        Reply::new(400, &body),
        Reply::new(200, &payment_intent("requires_capture", "manual")),
    ])
    .await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "not_sent", "rate_limited_400");
    assert!(
        reason(&sent.outcome).ends_with("(request req_1)"),
        "{sent:?}"
    );
    assert_eq!(
        sent.call.as_ref().and_then(|c| c.request_id.as_deref()),
        Some("req_1")
    );
    let resent = authorize(&provider, false).await;
    assert_eq!(resent.outcome.class(), "succeeded", "{resent:?}");
    let received = script.received();
    assert_eq!(received.len(), 2);
    for request in &received {
        request.assert_post("/v1/payment_intents");
    }
    assert_eq!(received[0].form, received[1].form, "the same request");
}

#[tokio::test]
async fn an_unauthenticated_request_fails_having_done_nothing() {
    let invalid = error(
        "invalid_request_error",
        None,
        "Invalid API Key provided: sk_test_****************ter2",
        json!({}),
    );
    let forbidden = error(
        "invalid_request_error",
        Some("secret_key_required"),
        "The provided key 'rk_test_****ter2' does not have the required permissions for this endpoint on account 'acct_1'.",
        json!({}),
    );
    let (provider, _) = stripe(vec![Reply::new(401, &invalid), Reply::new(403, &forbidden)]).await;
    let (logs, _guard) = Logs::capture();
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "failed", "unauthenticated");
    assert!(
        !format!("{sent:?}").contains("sk_test"),
        "Stripe's message is not repeated"
    );
    match &sent.outcome {
        Outcome::Failed { code, .. } => assert_eq!(code, "provider_credentials_refused"),
        other => panic!("{other:?}"),
    }
    let sent = provider.send(KEY, Mutation::Void("pi_3PqRsT")).await;
    assert_class(&sent, "failed", "unauthenticated");
    // The alert's source: an error line per refused call, naming no key.
    let text = logs.text();
    assert_eq!(
        text.matches("Stripe refused cobro's API key").count(),
        2,
        "{text}"
    );
    assert!(
        !text.contains("sk_test") && !text.contains("rk_test"),
        "{text}"
    );
}

#[tokio::test]
async fn a_capture_of_a_payment_intent_stripe_cannot_find_is_unknown() {
    let body = error(
        "invalid_request_error",
        Some("resource_missing"),
        "No such payment_intent: 'pi_3PqRsT'",
        json!({"param": "intent"}),
    );
    let (provider, script) = stripe(vec![Reply::new(404, &body)]).await;
    let sent = provider.send(KEY, Mutation::Capture("pi_3PqRsT")).await;
    assert_class(&sent, "unknown", "object_unknown_to_key");
    let request = script.only();
    request.assert_post("/v1/payment_intents/pi_3PqRsT/capture");
    assert!(request.form.is_empty(), "the whole amount: no parameters");
}

#[tokio::test]
async fn a_refusal_stripe_says_to_retry_is_unknown() {
    let body = error(
        "card_error",
        Some("card_declined"),
        "Your card was declined.",
        json!({"decline_code": "try_again_later", "payment_intent": declined_intent()}),
    );
    let reply = Reply::new(402, &body).with("stripe-should-retry", "true");
    let (provider, _) = stripe(vec![reply]).await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "unknown", "refusal_stripe_says_retry");
}

#[tokio::test]
async fn a_card_error_on_authorize_is_declined() {
    let body = error(
        "card_error",
        Some("card_declined"),
        "Your card has insufficient funds.",
        json!({
            "charge": "ch_3PqRsT",
            "decline_code": "insufficient_funds",
            "payment_intent": declined_intent(),
            "payment_method": {"id": "pm_1PqRsT", "object": "payment_method", "type": "card"},
        }),
    );
    let reply = Reply::new(402, &body).with("stripe-should-retry", "false");
    let (provider, script) = stripe(vec![reply]).await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "declined", "card_error_on_authorize");
    let Outcome::Declined {
        code,
        message,
        object,
    } = &sent.outcome
    else {
        unreachable!()
    };
    assert_eq!(code, "insufficient_funds");
    assert_eq!(message, "Your card has insufficient funds.");
    let intent = object.as_ref().expect("the PaymentIntent");
    assert_eq!(intent.status, ProviderStatus::Declined);
    assert_eq!(intent.reference.as_deref(), Some(REFERENCE));
    script.only().assert_post("/v1/payment_intents");
}

/// A soft decline (`try_again_later`: the issuer or processor could not
/// handle it now) is a decline like any other when Stripe does not say to
/// retry: nothing was charged, so a router may try another provider. As
/// the fake provider's `soft_decline` fault answers it: no
/// `Stripe-Should-Retry` header, or `false`.
#[tokio::test]
async fn a_soft_decline_on_authorize_is_declined_with_its_decline_code() {
    for should_retry in [None, Some("false")] {
        let mut intent = declined_intent();
        intent["last_payment_error"]["decline_code"] = json!("try_again_later");
        let body = error(
            "card_error",
            Some("card_declined"),
            "The card was declined for an unknown reason; try again or use another processor.",
            json!({
                "charge": "ch_3PqRsT",
                "decline_code": "try_again_later",
                "payment_intent": intent,
            }),
        );
        let mut reply = Reply::new(402, &body);
        if let Some(value) = should_retry {
            reply = reply.with("stripe-should-retry", value);
        }
        let (provider, _) = stripe(vec![reply]).await;
        let sent = authorize(&provider, false).await;
        assert_class(&sent, "declined", "card_error_on_authorize");
        let Outcome::Declined { code, object, .. } = &sent.outcome else {
            unreachable!()
        };
        assert_eq!(code, "try_again_later", "{should_retry:?}");
        assert_eq!(
            object.as_ref().map(|o| &o.status),
            Some(&ProviderStatus::Declined)
        );
    }
}

#[tokio::test]
async fn a_card_error_on_capture_failed() {
    let body = error(
        "card_error",
        Some("card_declined"),
        "Your card was declined.",
        json!({"payment_intent": payment_intent("requires_capture", "manual")}),
    );
    let (provider, _) = stripe(vec![Reply::new(402, &body)]).await;
    let sent = provider.send(KEY, Mutation::Capture("pi_3PqRsT")).await;
    assert_class(&sent, "failed", "card_error_on_follow_up");
}

#[tokio::test]
async fn a_capture_of_a_canceled_payment_intent_failed_with_it() {
    let body = error(
        "invalid_request_error",
        Some("payment_intent_unexpected_state"),
        "This PaymentIntent could not be captured because it has a status of canceled. Only a PaymentIntent with one of the following statuses may be captured: requires_capture.",
        json!({"payment_intent": payment_intent("canceled", "manual")}),
    );
    let (provider, _) = stripe(vec![Reply::new(400, &body)]).await;
    let sent = provider.send(KEY, Mutation::Capture("pi_3PqRsT")).await;
    assert_class(&sent, "failed", "invalid_request");
    let Outcome::Failed { code, object, .. } = &sent.outcome else {
        unreachable!()
    };
    assert_eq!(code, "payment_intent_unexpected_state");
    assert_eq!(
        object.as_ref().map(|o| (&o.id[..], &o.status)),
        Some(("pi_3PqRsT", &ProviderStatus::Voided)),
        "the truth of the charge travels with the refusal"
    );
}

#[tokio::test]
async fn a_replayed_server_error_is_unknown_and_says_not_to_retry() {
    let body = error("api_error", None, "An unknown error occurred", json!({}));
    let reply = Reply::new(500, &body)
        .replayed()
        .with("stripe-should-retry", "false");
    let (provider, _) = stripe(vec![reply]).await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "unknown", "server_error_replayed");
    assert_eq!(
        sent.call,
        Some(CallInfo {
            request_id: Some("req_1".into()),
            replayed: true,
            should_retry: Some(false),
        })
    );
    assert!(reason(&sent.outcome).contains("(request req_1)"));
}

#[tokio::test]
async fn a_server_error_is_unknown() {
    let body = error("api_error", None, "An unknown error occurred", json!({}));
    let (provider, _) = stripe(vec![
        Reply::new(500, &body),
        Reply::raw(503, "upstream connect error"),
    ])
    .await;
    assert_class(
        &authorize(&provider, false).await,
        "unknown",
        "server_error",
    );
    assert_class(
        &authorize(&provider, false).await,
        "unknown",
        "server_error",
    );
}

#[tokio::test]
async fn a_refusal_cobro_cannot_read_is_unknown() {
    let (provider, _) = stripe(vec![Reply::raw(400, "<html>Bad Request</html>")]).await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "unknown", "malformed_error");
}

#[tokio::test]
async fn an_unexpected_status_is_unknown() {
    let reply = Reply::raw(302, "").with("location", "/v1/elsewhere");
    let (provider, script) = stripe(vec![reply]).await;
    let sent = authorize(&provider, false).await;
    assert_class(&sent, "unknown", "unexpected");
    assert_eq!(script.received().len(), 1, "a redirect is never followed");
}

// ---- the other mutations, sent as Stripe documents them ----

#[tokio::test]
async fn a_void_cancels_the_payment_intent_under_the_attempts_key() {
    let (provider, script) =
        stripe(vec![Reply::new(200, &payment_intent("canceled", "manual"))]).await;
    let sent = provider.send(KEY, Mutation::Void("pi_3PqRsT")).await;
    assert_class(&sent, "succeeded", "proven");
    let Outcome::Succeeded(object) = &sent.outcome else {
        unreachable!()
    };
    assert_eq!(object.status, ProviderStatus::Voided);
    let request = script.only();
    request.assert_post("/v1/payment_intents/pi_3PqRsT/cancel");
    assert!(request.form.is_empty());
}

#[tokio::test]
async fn the_trait_methods_answer_what_send_answers() {
    let (provider, _) = stripe(vec![
        Reply::new(200, &payment_intent("succeeded", "manual")),
        refunded_intent(),
        Reply::new(200, &refund_object("succeeded")),
    ])
    .await;
    assert_eq!(
        provider.capture(KEY, "pi_3PqRsT").await.class(),
        "succeeded"
    );
    let Outcome::Succeeded(refund) = provider.refund(KEY, &refund_request()).await else {
        panic!("refund")
    };
    assert_eq!(refund.status, ProviderStatus::Succeeded);
    assert_eq!(
        refund.reference.as_deref(),
        Some("o-1:refund-v1/0192-refund-attempt")
    );
}

// ---- amounts as Stripe counts each currency ----

fn authorization_in(currency: &str, amount: i64) -> AuthorizeRequest {
    AuthorizeRequest {
        amount,
        currency: currency.into(),
        ..authorization(false)
    }
}

/// The PaymentIntent Stripe makes of `wire` in `currency`.
fn intent_in(currency: &str, wire: i64, status: &str) -> Value {
    let mut pi = payment_intent(status, "manual");
    pi["currency"] = json!(currency.to_ascii_lowercase());
    pi["amount"] = json!(wire);
    pi["amount_capturable"] = json!(if status == "requires_capture" {
        wire
    } else {
        0
    });
    pi["amount_received"] = json!(if status == "succeeded" { wire } else { 0 });
    pi
}

/// One currency of each of Stripe's rules: the `amount` sent is Stripe's
/// count of cobro's minor units, and what Stripe answers is read back in
/// cobro's minor units, so `fit` compares like with like.
#[tokio::test]
async fn each_currency_is_sent_as_stripe_counts_it_and_read_back_in_cobros_units() {
    let cases = [
        ("EUR", 1999, 1999),
        // Zero-decimal: whole yen.
        ("JPY", 500, 500),
        ("XOF", 5000, 5000),
        // ISK and UGX: whole units with two decimals 00 (ISK 5 000 is
        // `500000`; `5000` would be ISK 50.00).
        ("ISK", 5000, 500_000),
        ("UGX", 37_000, 3_700_000),
        // HUF and TWD: any two-decimal amount for a charge.
        ("HUF", 1045, 1045),
        ("TWD", 80_045, 80_045),
        // Three decimals ending in 0.
        ("BHD", 5120, 5120),
        ("JOD", 5120, 5120),
        ("KWD", 5120, 5120),
        ("OMR", 5120, 5120),
        ("TND", 5120, 5120),
        // Two ISO decimals Stripe does not count: MGA 5 000.00 is `5000`.
        ("MGA", 500_000, 5000),
    ];
    for (currency, minor, wire) in cases {
        let (provider, script) = stripe(vec![Reply::new(
            200,
            &intent_in(currency, wire, "requires_capture"),
        )])
        .await;
        let sent = provider
            .send(KEY, Mutation::Authorize(&authorization_in(currency, minor)))
            .await;
        let Outcome::Succeeded(object) = &sent.outcome else {
            panic!("{currency}: {sent:?}")
        };
        assert_eq!(object.amount, Some(minor), "{currency}");
        assert_eq!(object.currency.as_deref(), Some(currency));
        let request = script.only();
        request.assert_post("/v1/payment_intents");
        let lower = currency.to_ascii_lowercase();
        assert_eq!(
            request.form()[..2],
            [
                ("amount", wire.to_string().as_str()),
                ("currency", lower.as_str())
            ],
            "{currency}"
        );
    }
}

/// A refund's `amount` is counted in its PaymentIntent's currency, which
/// the connector reads first; Stripe's refund is read back in krónur.
#[tokio::test]
async fn an_isk_refund_is_sent_in_stripes_two_decimals_after_reading_the_currency() {
    let mut refund = refund_object("succeeded");
    refund["currency"] = json!("isk");
    refund["amount"] = json!(120_000);
    let (provider, script) = stripe(vec![
        Reply::new(200, &intent_in("ISK", 500_000, "succeeded")),
        Reply::new(200, &refund),
    ])
    .await;
    let request = RefundRequest {
        amount: 1200,
        ..refund_request()
    };
    let sent = provider.send(KEY, Mutation::Refund(&request)).await;
    let Outcome::Succeeded(object) = &sent.outcome else {
        panic!("{sent:?}")
    };
    assert_eq!(object.amount, Some(1200), "ISK 1 200, not 120 000");
    assert_eq!(object.currency.as_deref(), Some("ISK"));
    let received = script.received();
    assert_eq!(received.len(), 2, "{received:?}");
    assert_currency_read(&received[0]);
    received[1].assert_post("/v1/refunds");
    assert_eq!(
        received[1].form()[..2],
        [("payment_intent", "pi_3PqRsT"), ("amount", "120000")]
    );
}

/// BHD, JOD, KWD, OMR, TND amounts must end in 0 at Stripe. One that does
/// not is refused before anything is sent (never rounded to another
/// amount), as a definitive failure; so is an MGA fraction of an ariary.
#[tokio::test]
async fn an_amount_stripe_cannot_take_fails_and_is_never_sent() {
    for (currency, minor) in [
        ("BHD", 5124),
        ("JOD", 1),
        ("KWD", 5125),
        ("OMR", 99_999),
        ("TND", 5129),
        ("MGA", 150),
    ] {
        let (provider, script) = stripe(vec![]).await;
        let sent = provider
            .send(KEY, Mutation::Authorize(&authorization_in(currency, minor)))
            .await;
        match &sent.outcome {
            Outcome::Failed {
                code,
                message,
                object: None,
            } => {
                assert_eq!(code, "amount_not_accepted_by_stripe", "{currency}");
                assert!(message.contains(currency), "{message}");
                assert!(message.contains(&minor.to_string()), "{message}");
            }
            other => panic!("{currency}: {other:?}"),
        }
        assert_eq!(sent.call, None, "no call was made");
        assert!(script.received().is_empty(), "{currency}: sent anyway");
    }
    // A refund: only the read of its currency, no POST.
    let (provider, script) = stripe(vec![Reply::new(
        200,
        &intent_in("KWD", 10_000, "succeeded"),
    )])
    .await;
    let request = RefundRequest {
        amount: 1255,
        ..refund_request()
    };
    let sent = provider.send(KEY, Mutation::Refund(&request)).await;
    assert!(
        matches!(&sent.outcome, Outcome::Failed { code, .. } if code == "amount_not_accepted_by_stripe"),
        "{sent:?}"
    );
    let received = script.received();
    assert_eq!(received.len(), 1, "{received:?}");
    assert_currency_read(&received[0]);
}

/// Without the PaymentIntent's currency the refund's amount cannot be
/// written: nothing is sent, and the attempt is retried with its key.
#[tokio::test]
async fn a_refund_whose_payment_intent_cannot_be_read_is_not_sent() {
    let failing = error("api_error", None, "An unknown error occurred", json!({}));
    let missing = error(
        "invalid_request_error",
        Some("resource_missing"),
        "No such payment_intent: 'pi_3PqRsT'",
        json!({"param": "intent"}),
    );
    let (provider, script) =
        stripe(vec![Reply::new(500, &failing), Reply::new(404, &missing)]).await;
    for _ in 0..2 {
        let sent = provider
            .send(KEY, Mutation::Refund(&refund_request()))
            .await;
        assert_class(&sent, "not_sent", "refund_currency");
        assert!(
            reason(&sent.outcome).ends_with("the refund was not sent"),
            "{sent:?}"
        );
    }
    let received = script.received();
    assert_eq!(received.len(), 2, "two reads, no POST: {received:?}");
    for request in &received {
        assert_currency_read(request);
    }
}

// ---- queries ----

#[tokio::test]
async fn a_payment_intent_is_read_and_a_missing_one_is_none() {
    let missing = error(
        "invalid_request_error",
        Some("resource_missing"),
        "No such payment_intent: 'pi_gone'",
        json!({"param": "intent"}),
    );
    let failing = error("api_error", None, "An unknown error occurred", json!({}));
    let (provider, script) = stripe(vec![
        Reply::new(200, &payment_intent("requires_capture", "manual")),
        Reply::new(404, &missing),
        Reply::new(500, &failing),
    ])
    .await;
    let found = provider.get_charge("pi_3PqRsT").await.expect("query");
    assert_eq!(found.map(|o| o.status), Some(ProviderStatus::Authorized));
    assert_eq!(provider.get_charge("pi_gone").await.expect("query"), None);
    assert!(
        provider.get_charge("pi_3PqRsT").await.is_err(),
        "a 500 proves nothing"
    );
    let received = script.received();
    assert_eq!(received[0].method, Method::GET);
    assert_eq!(received[0].path, "/v1/payment_intents/pi_3PqRsT");
    received[0].assert_stripe_headers();
    assert_eq!(received[0].header("idempotency-key"), None);
}

#[tokio::test]
async fn a_search_quotes_the_reference_pages_through_and_keeps_only_exact_matches() {
    let reference = "o'1:authorize-v1/a\\b";
    let mut ours = payment_intent("requires_capture", "manual");
    ours["metadata"]["cobro_reference"] = json!(reference);
    let mut other = payment_intent("succeeded", "manual");
    other["id"] = json!("pi_other");
    other["metadata"]["cobro_reference"] = json!("O'1:AUTHORIZE-V1/A\\B");
    let first = json!({"object": "search_result", "url": "/v1/payment_intents/search",
        "has_more": true, "next_page": "page_2", "data": [other]});
    let second = json!({"object": "search_result", "url": "/v1/payment_intents/search",
        "has_more": false, "next_page": null, "data": [ours]});
    let (provider, script) = stripe(vec![Reply::new(200, &first), Reply::new(200, &second)]).await;
    let found = provider.search_charges(reference).await.expect("search");
    assert_eq!(
        found.iter().map(|o| o.id.as_str()).collect::<Vec<_>>(),
        ["pi_3PqRsT"]
    );
    let received = script.received();
    assert_eq!(received.len(), 2);
    for request in &received {
        assert_eq!(request.method, Method::GET);
        assert_eq!(request.path, "/v1/payment_intents/search");
        request.assert_stripe_headers();
        assert_eq!(
            request.query("query"),
            Some(r"metadata['cobro_reference']:'o\'1:authorize-v1/a\\b'")
        );
        assert_eq!(request.query("limit"), Some("100"));
    }
    assert_eq!(received[0].query("page"), None);
    assert_eq!(received[1].query("page"), Some("page_2"));
}

#[tokio::test]
async fn a_search_page_that_has_more_without_a_cursor_proves_nothing() {
    let broken = json!({"object": "search_result", "has_more": true, "data": []});
    let (provider, _) = stripe(vec![Reply::new(200, &broken)]).await;
    assert!(provider.search_charges(REFERENCE).await.is_err());
}

#[tokio::test]
async fn refunds_are_listed_by_payment_intent_page_by_page() {
    let reference = "o-1:refund-v1/0192-refund-attempt";
    let mut another = refund_object("succeeded");
    another["id"] = json!("re_another");
    another["metadata"]["cobro_reference"] = json!("o-1:refund-v2/other");
    let mut ours = refund_object("succeeded");
    ours["id"] = json!("re_ours");
    let first = json!({"object": "list", "url": "/v1/refunds", "has_more": true,
        "data": [refund_object("pending"), another]});
    let second = json!({"object": "list", "url": "/v1/refunds", "has_more": false, "data": [ours]});
    let (provider, script) = stripe(vec![Reply::new(200, &first), Reply::new(200, &second)]).await;
    let found = provider
        .search_refunds(reference, Some("pi_3PqRsT"))
        .await
        .expect("listing");
    assert_eq!(
        found
            .iter()
            .map(|o| (o.id.as_str(), &o.status))
            .collect::<Vec<_>>(),
        [
            ("re_3PqRsT", &ProviderStatus::Other("pending".into())),
            ("re_ours", &ProviderStatus::Succeeded)
        ]
    );
    let received = script.received();
    assert_eq!(received.len(), 2);
    for request in &received {
        assert_eq!(request.method, Method::GET);
        assert_eq!(request.path, "/v1/refunds");
        request.assert_stripe_headers();
        assert_eq!(request.query("payment_intent"), Some("pi_3PqRsT"));
        assert_eq!(request.query("limit"), Some("100"));
    }
    assert_eq!(received[0].query("starting_after"), None);
    assert_eq!(received[1].query("starting_after"), Some("re_another"));
}

#[tokio::test]
async fn without_the_refunded_payment_intent_a_refund_search_proves_nothing() {
    let (provider, script) = stripe(vec![]).await;
    assert!(provider.search_refunds(REFERENCE, None).await.is_err());
    assert!(script.received().is_empty(), "nothing to ask Stripe");
}

#[tokio::test]
async fn a_refund_listing_for_a_payment_intent_stripe_does_not_know_proves_nothing() {
    let missing = error(
        "invalid_request_error",
        Some("resource_missing"),
        "No such payment_intent: 'pi_gone'",
        json!({"param": "payment_intent"}),
    );
    let (provider, _) = stripe(vec![Reply::new(404, &missing)]).await;
    assert!(
        provider
            .search_refunds(REFERENCE, Some("pi_gone"))
            .await
            .is_err()
    );
}

/// The start-up check reads one PaymentIntent of the list proof of absence
/// needs: a 401 (wrong, revoked or other-mode key) and a 403 (a restricted
/// key without the permission) refuse, each saying what to fix; a 200
/// accepts; a 500 or a 429 says nothing either way.
#[tokio::test]
async fn the_credentials_check_reads_the_payment_intent_list_once() {
    let list =
        json!({"object": "list", "data": [], "has_more": false, "url": "/v1/payment_intents"});
    let refused = |code: &str| {
        error(
            "invalid_request_error",
            None,
            &format!("{code}: the key was refused"),
            json!({}),
        )
    };
    let cases = [
        (Reply::new(200, &list), "accepted"),
        (Reply::new(401, &refused("401")), "401"),
        (Reply::new(403, &refused("403")), "403"),
        (
            Reply::new(500, &error("api_error", None, "oops", json!({}))),
            "unknown",
        ),
        (
            Reply::new(
                429,
                &error(
                    "invalid_request_error",
                    Some("rate_limit"),
                    "slow down",
                    json!({}),
                ),
            ),
            "unknown",
        ),
    ];
    for (reply, expected) in cases {
        let (provider, script) = stripe(vec![reply]).await;
        let checked = provider.check_credentials().await;
        match (&checked, expected) {
            (Credentials::Accepted, "accepted") => {}
            (Credentials::Refused(why), "401") => assert!(why.contains("(401)"), "{why}"),
            (Credentials::Refused(why), "403") => {
                assert!(why.contains("restricted key"), "{why}")
            }
            (Credentials::Unknown(_), "unknown") => {}
            _ => panic!("{expected}: {checked:?}"),
        }
        let request = script.only();
        assert_eq!(request.method, Method::GET);
        assert_eq!(request.path, "/v1/payment_intents");
        assert_eq!(request.query, [("limit".to_owned(), "1".to_owned())]);
    }
}
