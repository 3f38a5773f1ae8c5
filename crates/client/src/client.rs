//! [`Client`]: journal first, then send; retry only what is safe to retry,
//! always with the journaled key and body.

use crate::error::{ApiProblem, Error, Problem, ProblemCode};
use crate::journal::{Intent, Journal, NewIntent, StoredAnswer};
use crate::retry::{self, RetryPolicy, Verdict};
use crate::types::{
    CreatePayment, CreateRefund, ListPayments, Operation, Payment, PaymentList, Refund,
};
use chrono::Utc;
use reqwest::header::{self, HeaderMap};
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::time::Duration;

/// The longest `?wait=` the server accepts, in seconds.
const MAX_SERVER_WAIT: u64 = 30;

/// A decoded answer and what its headers said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer<T> {
    pub value: T,
    pub status: u16,
    /// `Idempotent-Replayed`: `Some(false)` on the execution itself,
    /// `Some(true)` on a replay of a stored answer (the request had already
    /// been executed, e.g. by a try whose answer was lost); `None` where the
    /// server sends no such header (GETs).
    pub replayed: Option<bool>,
    /// `X-Request-Id` of the answer.
    pub request_id: Option<String>,
    /// `Location` on 201s.
    pub location: Option<String>,
    /// The `Idempotency-Key` the intent was sent with (keyed requests).
    pub idempotency_key: Option<String>,
    /// `true` when the intent was already complete in the journal and this
    /// is its stored answer: no request was made.
    pub from_journal: bool,
}

impl<T> Answer<T> {
    /// Whether the server said this was a replay.
    pub fn was_replayed(&self) -> bool {
        self.replayed == Some(true)
    }
}

/// What a resumed intent answered.
// One value per resumed intent, moved once: boxing the larger variant would
// cost every caller a dereference for no measurable saving.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Resource {
    Payment(Answer<Payment>),
    Refund(Answer<Refund>),
}

/// One intent [`Client::resume_pending`] sent again, and its outcome.
#[derive(Debug)]
pub struct Resumed {
    /// The intent as it was journaled (its reference, key and body).
    pub intent: Intent,
    pub outcome: Result<Resource, Error>,
}

/// What the client is doing, for logs and metrics. Called synchronously on
/// the task making the request: keep it quick.
#[derive(Debug)]
#[non_exhaustive]
pub enum Event<'a> {
    /// A new intent is in the journal (durably); nothing sent yet.
    Recorded(&'a Intent),
    /// Try `attempt` (1 for the first) is about to be sent.
    Sending { intent: &'a Intent, attempt: u32 },
    /// A final answer arrived; the journal does not have it yet.
    Answered { intent: &'a Intent, status: u16 },
    /// The journal has the final answer: the intent is complete.
    Completed { intent: &'a Intent, status: u16 },
    /// Try `attempt` failed with `cause`; the next one follows after `delay`.
    Retrying {
        intent: Option<&'a Intent>,
        attempt: u32,
        delay: Duration,
        cause: &'a Error,
    },
}

type Observer = Arc<dyn Fn(&Event<'_>) + Send + Sync>;

/// A client of cobro's payments API over a [`Journal`].
#[derive(Clone)]
pub struct Client<J> {
    base: String,
    token: String,
    http: reqwest::Client,
    journal: J,
    retry: RetryPolicy,
    observer: Option<Observer>,
}

impl<J> std::fmt::Debug for Client<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("retry", &self.retry)
            .finish_non_exhaustive()
    }
}

/// An answer as read off the wire.
struct Raw {
    stored: StoredAnswer,
    retry_after: Option<Duration>,
}

impl<J: Journal> Client<J> {
    /// A client of the cobro at `base_url` (`http://127.0.0.1:8080`) with
    /// bearer `token`, journaling into `journal`. Timeouts: 5 s to connect,
    /// 30 s per request ([`Client::with_http`] to change them).
    pub fn new(base_url: &str, token: &str, journal: J) -> Result<Self, Error> {
        let parsed = reqwest::Url::parse(base_url)
            .map_err(|e| Error::Config(format!("base URL `{base_url}`: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(Error::Config(format!(
                "base URL `{base_url}` is not http or https"
            )));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(30))
            .user_agent(concat!("cobro-client/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Config(e.to_string()))?;
        Ok(Self {
            base: base_url.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            http,
            journal,
            retry: RetryPolicy::default(),
            observer: None,
        })
    }

    /// Replaces the retry policy.
    pub fn with_retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Replaces the HTTP client (timeouts, proxies, TLS). Keep a request
    /// timeout: a try that hangs is only retried once it times out.
    pub fn with_http(mut self, http: reqwest::Client) -> Self {
        self.http = http;
        self
    }

    /// Calls `observer` with every [`Event`].
    pub fn with_observer(mut self, observer: impl Fn(&Event<'_>) + Send + Sync + 'static) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    pub fn journal(&self) -> &J {
        &self.journal
    }

    fn emit(&self, event: Event<'_>) {
        if let Some(observer) = &self.observer {
            observer(&event);
        }
    }

    /// `POST /v1/payments` as the intent `reference`.
    ///
    /// The first call with a reference generates a random key, journals
    /// the intent (durably) and only then sends. Every later call with the
    /// same reference and request, in this process or after a restart,
    /// reuses that key and body; once the intent has its final answer, that
    /// answer comes from the journal ([`Answer::from_journal`]). The same
    /// reference with a different request is [`Error::IntentConflict`].
    pub async fn create_payment(
        &self,
        reference: &str,
        request: &CreatePayment,
    ) -> Result<Answer<Payment>, Error> {
        let body = serde_json::to_vec(request).map_err(|e| Error::Config(e.to_string()))?;
        let (intent, answer, from_journal) = self
            .execute(reference, Operation::Authorize, "/v1/payments".into(), body)
            .await?;
        decode(&intent, answer, from_journal)
    }

    /// `POST /v1/payments/{id}/capture` as the intent `reference`.
    pub async fn capture(
        &self,
        reference: &str,
        payment_id: &str,
    ) -> Result<Answer<Payment>, Error> {
        let path = format!("/v1/payments/{}/capture", segment(payment_id));
        let (intent, answer, from_journal) = self
            .execute(reference, Operation::Capture, path, b"{}".to_vec())
            .await?;
        decode(&intent, answer, from_journal)
    }

    /// `POST /v1/payments/{id}/cancel` as the intent `reference`.
    pub async fn cancel(
        &self,
        reference: &str,
        payment_id: &str,
    ) -> Result<Answer<Payment>, Error> {
        let path = format!("/v1/payments/{}/cancel", segment(payment_id));
        let (intent, answer, from_journal) = self
            .execute(reference, Operation::Cancel, path, b"{}".to_vec())
            .await?;
        decode(&intent, answer, from_journal)
    }

    /// `POST /v1/payments/{id}/refunds` as the intent `reference`.
    pub async fn refund(
        &self,
        reference: &str,
        payment_id: &str,
        request: &CreateRefund,
    ) -> Result<Answer<Refund>, Error> {
        let path = format!("/v1/payments/{}/refunds", segment(payment_id));
        let body = serde_json::to_vec(request).map_err(|e| Error::Config(e.to_string()))?;
        let (intent, answer, from_journal) = self
            .execute(reference, Operation::Refund, path, body)
            .await?;
        decode(&intent, answer, from_journal)
    }

    /// Sends every pending intent of the journal again, oldest first, each
    /// with its own key and body, and completes each that gets a final
    /// answer. Call it when the process starts, before new work: whatever a
    /// previous process journaled and never saw answered (it died before
    /// the send, during it, or after cobro committed) ends here, executed
    /// exactly once by cobro. An intent whose retries give up stays pending
    /// for the next call. Fails only if the journal cannot be read.
    pub async fn resume_pending(&self) -> Result<Vec<Resumed>, Error> {
        let pending = self.journal.pending().await?;
        let mut resumed = Vec::with_capacity(pending.len());
        for intent in pending {
            let outcome = match self.send_until_final(&intent).await {
                Ok(answer) => match intent.operation {
                    Operation::Refund => decode(&intent, answer, false).map(Resource::Refund),
                    _ => decode(&intent, answer, false).map(Resource::Payment),
                },
                Err(e) => Err(e),
            };
            resumed.push(Resumed { intent, outcome });
        }
        Ok(resumed)
    }

    /// `GET /v1/payments/{id}`.
    pub async fn payment(&self, payment_id: &str) -> Result<Answer<Payment>, Error> {
        let path = format!("/v1/payments/{}", segment(payment_id));
        self.get(&path, &[], None).await
    }

    /// The payment once it has left `processing`, or as it is when
    /// `timeout` (rounded up to whole seconds) runs out: long polls of `GET /v1/payments/{id}?wait=N`
    /// (N at most 30 s, the server's limit), so the answer comes as soon as
    /// the payment changes, without polling in a loop.
    pub async fn wait_for_payment(
        &self,
        payment_id: &str,
        timeout: Duration,
    ) -> Result<Answer<Payment>, Error> {
        let path = format!("/v1/payments/{}", segment(payment_id));
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            // Whole seconds, the server's unit, rounded up.
            let wait = left.as_millis().div_ceil(1000);
            let wait = u64::try_from(wait).unwrap_or(u64::MAX).min(MAX_SERVER_WAIT);
            let answer: Answer<Payment> = self
                .get(
                    &path,
                    &[("wait", wait.to_string())],
                    // The server holds the answer up to `wait`.
                    Some(Duration::from_secs(wait + 10)),
                )
                .await?;
            if !answer.value.status.is_processing() || wait == 0 {
                return Ok(answer);
            }
        }
    }

    /// `GET /v1/payments` with filters, one page.
    pub async fn list_payments(&self, query: &ListPayments) -> Result<Answer<PaymentList>, Error> {
        self.get("/v1/payments", &query.query(), None).await
    }

    /// `GET /v1/payments/{id}/refunds/{refund_id}`.
    pub async fn get_refund(
        &self,
        payment_id: &str,
        refund_id: &str,
    ) -> Result<Answer<Refund>, Error> {
        let path = format!(
            "/v1/payments/{}/refunds/{}",
            segment(payment_id),
            segment(refund_id)
        );
        self.get(&path, &[], None).await
    }

    /// Journal, then send until a final answer; or the stored answer.
    async fn execute(
        &self,
        reference: &str,
        operation: Operation,
        path: String,
        body: Vec<u8>,
    ) -> Result<(Intent, StoredAnswer, bool), Error> {
        let key = uuid::Uuid::new_v4().to_string();
        let intent = self
            .journal
            .record(NewIntent {
                reference: reference.to_owned(),
                operation: operation.clone(),
                path: path.clone(),
                body: body.clone(),
                key: key.clone(),
            })
            .await?;
        if intent.operation != operation || intent.path != path || !same_json(&intent.body, &body) {
            return Err(Error::IntentConflict {
                reference: reference.to_owned(),
            });
        }
        if let Some(answer) = intent.answer.clone() {
            return Ok((intent, answer, true));
        }
        if intent.key == key {
            self.emit(Event::Recorded(&intent));
        }
        let answer = self.send_until_final(&intent).await?;
        Ok((intent, answer, false))
    }

    /// Sends `intent` (its key, its body) until a final answer, which the
    /// journal then records.
    async fn send_until_final(&self, intent: &Intent) -> Result<StoredAnswer, Error> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.emit(Event::Sending { intent, attempt });
            let request = self
                .http
                .post(format!("{}{}", self.base, intent.path))
                .bearer_auth(&self.token)
                .header("Idempotency-Key", &intent.key)
                .header(header::CONTENT_TYPE, "application/json")
                .body(intent.body.clone());
            let (cause, retry_after) = match self.send_once(request).await {
                Ok(raw) => match retry::verdict(raw.stored.status) {
                    Verdict::Final => {
                        let status = raw.stored.status;
                        self.emit(Event::Answered { intent, status });
                        self.journal
                            .complete(&intent.reference, &raw.stored)
                            .await?;
                        self.emit(Event::Completed { intent, status });
                        return Ok(raw.stored);
                    }
                    Verdict::Stop => return Err(error_of(&raw)),
                    Verdict::Retry => (error_of(&raw), raw.retry_after),
                },
                Err(e) => (e, None),
            };
            self.backoff(Some(intent), attempt, cause, retry_after)
                .await?;
        }
    }

    /// Waits before the next try, or ends the retries with
    /// [`Error::GaveUp`].
    async fn backoff(
        &self,
        intent: Option<&Intent>,
        attempt: u32,
        cause: Error,
        retry_after: Option<Duration>,
    ) -> Result<(), Error> {
        let delay = (attempt < self.retry.max_attempts.max(1))
            .then(|| self.retry.delay(attempt, retry_after))
            .flatten();
        let Some(delay) = delay else {
            return Err(Error::GaveUp {
                attempts: attempt,
                last: Box::new(cause),
            });
        };
        self.emit(Event::Retrying {
            intent,
            attempt,
            delay,
            cause: &cause,
        });
        tokio::time::sleep(delay).await;
        Ok(())
    }

    async fn send_once(&self, request: reqwest::RequestBuilder) -> Result<Raw, Error> {
        let response = request.send().await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        // A body cut short is a transport error like any other: retried.
        let body = response.bytes().await?.to_vec();
        Ok(Raw {
            retry_after: retry::retry_after(&headers),
            stored: StoredAnswer {
                status,
                body,
                replayed: header_text(&headers, "idempotent-replayed").map(|v| v == "true"),
                request_id: header_text(&headers, "x-request-id"),
                location: header_text(&headers, header::LOCATION.as_str()),
                received_at: Utc::now(),
            },
        })
    }

    /// A GET, retried like a keyed request (reads are always safe to retry).
    async fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
        timeout: Option<Duration>,
    ) -> Result<Answer<T>, Error> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut request = self
                .http
                .get(format!("{}{path}", self.base))
                .bearer_auth(&self.token)
                .query(query);
            if let Some(timeout) = timeout {
                request = request.timeout(timeout);
            }
            let (cause, retry_after) = match self.send_once(request).await {
                Ok(raw) => match retry::verdict(raw.stored.status) {
                    Verdict::Final | Verdict::Stop => return answer_of(raw.stored, None, false),
                    Verdict::Retry => (error_of(&raw), raw.retry_after),
                },
                Err(e) => (e, None),
            };
            self.backoff(None, attempt, cause, retry_after).await?;
        }
    }
}

/// Everything but RFC 3986's unreserved characters other than the dot.
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'~');

/// A path segment, percent-encoded (dots too, so `..` stays a segment):
/// an id can never change the route.
fn segment(id: &str) -> String {
    percent_encoding::utf8_percent_encode(id, SEGMENT).to_string()
}

fn same_json(a: &[u8], b: &[u8]) -> bool {
    a == b
        || matches!(
            (
                serde_json::from_slice::<serde_json::Value>(a),
                serde_json::from_slice::<serde_json::Value>(b),
            ),
            (Ok(x), Ok(y)) if x == y
        )
}

fn header_text(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// The error a non-2xx answer stands for.
fn error_of(raw: &Raw) -> Error {
    problem_error(&raw.stored, raw.retry_after)
}

fn problem_error(stored: &StoredAnswer, retry_after: Option<Duration>) -> Error {
    match serde_json::from_slice::<Problem>(&stored.body) {
        Ok(problem) => {
            let problem = Box::new(ApiProblem {
                status: stored.status,
                problem,
                replayed: stored.replayed,
                request_id: stored.request_id.clone(),
                retry_after,
            });
            if problem.problem.code == ProblemCode::IdempotencyKeyReused {
                Error::KeyReused(problem)
            } else {
                Error::Problem(problem)
            }
        }
        Err(_) => Error::Unexpected {
            status: stored.status,
            body: String::from_utf8_lossy(&stored.body).into_owned(),
        },
    }
}

fn answer_of<T: DeserializeOwned>(
    stored: StoredAnswer,
    key: Option<&str>,
    from_journal: bool,
) -> Result<Answer<T>, Error> {
    if !(200..300).contains(&stored.status) {
        return Err(problem_error(&stored, None));
    }
    let value = serde_json::from_slice(&stored.body).map_err(|source| Error::Decode {
        status: stored.status,
        source,
    })?;
    Ok(Answer {
        value,
        status: stored.status,
        replayed: stored.replayed,
        request_id: stored.request_id,
        location: stored.location,
        idempotency_key: key.map(str::to_owned),
        from_journal,
    })
}

fn decode<T: DeserializeOwned>(
    intent: &Intent,
    answer: StoredAnswer,
    from_journal: bool,
) -> Result<Answer<T>, Error> {
    answer_of(answer, Some(&intent.key), from_journal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_percent_encoded_into_one_path_segment() {
        assert_eq!(
            segment("0193a7c4-5f2e-7d41-9b7a-2c1d3e4f5a6b"),
            "0193a7c4-5f2e-7d41-9b7a-2c1d3e4f5a6b"
        );
        assert_eq!(segment("../x?y"), "%2E%2E%2Fx%3Fy");
    }

    #[test]
    fn bodies_are_the_same_request_whatever_their_spelling() {
        assert!(same_json(br#"{"a":1,"b":2}"#, br#"{ "b": 2, "a": 1 }"#));
        assert!(!same_json(br#"{"a":1}"#, br#"{"a":2}"#));
    }
}
