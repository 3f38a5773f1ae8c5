//! Helpers shared by the integration tests: a provider on port 0, a reqwest
//! client speaking its API, and condition polling with a deadline.
#![allow(dead_code)] // each test binary uses a different subset

use std::future::Future;
use std::time::Duration;

use fake_provider::{Config, Control, Effects, Running};
use serde_json::{Value, json};

/// The caller (bearer token) of the helpers that do not name one.
pub const CALLER: &str = "sk_test_cobro";

/// How long a condition may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// A provider started for one test, plus a client for it.
pub struct Provider {
    pub running: Running,
    pub control: Control,
    pub url: String,
    pub http: reqwest::Client,
}

/// One answer: status, JSON body (Null if none) and the replay header.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
    pub replayed: bool,
}

impl Answer {
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or_default()
    }

    /// `(status, error code)`, for asserting refusals in one line.
    pub fn error(&self) -> (u16, &str) {
        (self.status, self.code())
    }

    pub fn id(&self) -> &str {
        self.body["id"].as_str().unwrap_or_default()
    }
}

pub async fn provider() -> Provider {
    provider_with(Config::default()).await
}

pub async fn provider_with(config: Config) -> Provider {
    let running = fake_provider::start(config).await.expect("provider starts");
    let control = running.control();
    let url = running.url();
    Provider {
        running,
        control,
        url,
        http: reqwest::Client::new(),
    }
}

/// Ledger counts with only `charges` set; combine with struct update syntax:
/// `Effects { captures: 1, ..charges(1) }`.
pub fn charges(n: u64) -> Effects {
    Effects {
        charges: n,
        ..Effects::default()
    }
}

/// One-line ledger expectations: `charges(1).captures(1).refunds(2)`.
pub trait EffectsExt {
    fn captures(self, n: u64) -> Effects;
    fn voids(self, n: u64) -> Effects;
    fn refunds(self, n: u64) -> Effects;
    fn declines(self, n: u64) -> Effects;
}

impl EffectsExt for Effects {
    fn captures(self, n: u64) -> Effects {
        Effects {
            captures: n,
            ..self
        }
    }
    fn voids(self, n: u64) -> Effects {
        Effects { voids: n, ..self }
    }
    fn refunds(self, n: u64) -> Effects {
        Effects { refunds: n, ..self }
    }
    fn declines(self, n: u64) -> Effects {
        Effects {
            declines: n,
            ..self
        }
    }
}

pub fn declines(n: u64) -> Effects {
    Effects {
        declines: n,
        ..Effects::default()
    }
}

pub fn refunds(n: u64) -> Effects {
    Effects {
        refunds: n,
        ..Effects::default()
    }
}

/// A valid charge body for `reference`.
pub fn charge_body(reference: &str) -> Value {
    json!({"amount": 1250, "currency": "EUR", "payment_method": "pm_card_visa", "capture": false, "reference": reference})
}

impl Provider {
    /// POST as caller `caller`, with an optional idempotency key.
    pub async fn post_as(
        &self,
        caller: &str,
        path: &str,
        key: Option<&str>,
        body: &Value,
    ) -> Result<Answer, reqwest::Error> {
        self.post_with(&self.http, caller, path, key, body).await
    }

    pub async fn post(
        &self,
        path: &str,
        key: Option<&str>,
        body: &Value,
    ) -> Result<Answer, reqwest::Error> {
        self.post_as(CALLER, path, key, body).await
    }

    /// POST through a specific client (e.g. one with a short timeout).
    pub async fn post_with(
        &self,
        http: &reqwest::Client,
        caller: &str,
        path: &str,
        key: Option<&str>,
        body: &Value,
    ) -> Result<Answer, reqwest::Error> {
        let mut request = http
            .post(format!("{}{path}", self.url))
            .bearer_auth(caller)
            .json(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        answer(request.send().await?).await
    }

    pub async fn charge(&self, key: Option<&str>, reference: &str) -> Answer {
        self.post("/v1/charges", key, &charge_body(reference))
            .await
            .expect("charge request completes")
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.get_as(CALLER, path).await
    }

    /// GET as caller `caller`.
    pub async fn get_as(&self, caller: &str, path: &str) -> Answer {
        let response = self
            .http
            .get(format!("{}{path}", self.url))
            .bearer_auth(caller)
            .send()
            .await;
        answer(response.expect("GET completes"))
            .await
            .expect("GET body")
    }

    /// The ledger's totals.
    pub fn totals(&self) -> Effects {
        self.control.ledger().totals
    }

    /// The ledger's counts for one reference.
    pub fn effects_of(&self, reference: &str) -> Effects {
        self.control.ledger().for_reference(reference)
    }

    pub async fn capture(&self, charge_id: &str, key: Option<&str>, body: Value) -> Answer {
        let path = format!("/v1/charges/{charge_id}/capture");
        self.post(&path, key, &body)
            .await
            .expect("capture request completes")
    }

    pub async fn void(&self, charge_id: &str) -> Answer {
        let path = format!("/v1/charges/{charge_id}/void");
        self.post(&path, None, &json!({}))
            .await
            .expect("void request completes")
    }

    /// A refund without idempotency key.
    pub async fn refund(&self, charge_id: &str, amount: i64, reference: &str) -> Answer {
        let body = json!({"charge": charge_id, "amount": amount, "reference": reference});
        self.post("/v1/refunds", None, &body)
            .await
            .expect("refund request completes")
    }

    /// Ids found by caller `caller` with a raw query string (`query`
    /// already encoded, see [`query`]), newest first.
    pub async fn search_as(&self, caller: &str, what: &str, query: &str) -> Vec<String> {
        let answer = self.get_as(caller, &format!("/v1/{what}?{query}")).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        ids(&answer.body["data"])
    }

    /// Ids returned by a search, newest first.
    pub async fn search(&self, what: &str, reference: &str) -> Vec<String> {
        let answer = self.get(&format!("/v1/{what}?reference={reference}")).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        answer.body["data"]
            .as_array()
            .expect("data is a list")
            .iter()
            .map(|item| item["id"].as_str().unwrap_or_default().to_owned())
            .collect()
    }
}

/// `name=value&...`, form-encoded (so `metadata[k]` and `/`, `&`, spaces in
/// values survive).
pub fn query(pairs: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}

/// The `id`s of a JSON list, in order.
pub fn ids(list: &Value) -> Vec<String> {
    list.as_array()
        .expect("a list")
        .iter()
        .map(|item| item["id"].as_str().unwrap_or_default().to_owned())
        .collect()
}

pub async fn answer(response: reqwest::Response) -> Result<Answer, reqwest::Error> {
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get(fake_provider::REPLAYED_HEADER)
        .is_some_and(|v| v == "true");
    let bytes = response.bytes().await?;
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Ok(Answer {
        status,
        body,
        replayed,
    })
}

/// Polls `condition` every 10 ms until it holds; fails the test after
/// [`DEADLINE`]. Waiting on a condition, never on a fixed sleep.
pub async fn wait_until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if condition().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub mod stripe;
