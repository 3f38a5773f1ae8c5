//! Helpers for the Stripe dialect: form-encoded POSTs with a pinned
//! `Stripe-Version`, answers with Stripe's headers.

use serde_json::Value;

use super::Provider;

/// The caller (test secret key) of the helpers that do not name one.
pub const SK: &str = "sk_test_cobro";
/// A second merchant, for the identity twins.
pub const SK_B: &str = "sk_test_other_merchant";
/// The version a client pins.
pub const VERSION: &str = "2024-06-20";

/// One Stripe answer with the headers that matter.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
    pub replayed: bool,
    pub request_id: Option<String>,
    pub should_retry: Option<String>,
}

impl Reply {
    /// `(status, error.type, error.code)`; the code is `""` when absent.
    pub fn error(&self) -> (u16, &str, &str) {
        let error = &self.body["error"];
        (
            self.status,
            error["type"].as_str().unwrap_or_default(),
            error["code"].as_str().unwrap_or_default(),
        )
    }

    pub fn param(&self) -> &str {
        self.body["error"]["param"].as_str().unwrap_or_default()
    }

    pub fn id(&self) -> &str {
        self.body["id"].as_str().unwrap_or_default()
    }

    pub fn status_of(&self) -> &str {
        self.body["status"].as_str().unwrap_or_default()
    }
}

/// `name=value&...` form-encoded as Stripe's SDKs send it (brackets
/// percent-encoded).
pub fn form(pairs: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}

/// A PaymentIntent created and confirmed with `pm_card_visa`.
pub fn intent_form<'a>(capture_method: &'a str, order: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("amount", "1250"),
        ("currency", "eur"),
        ("payment_method", "pm_card_visa"),
        ("confirm", "true"),
        ("capture_method", capture_method),
        ("payment_method_types[]", "card"),
        ("metadata[cobro_account]", "acct_1"),
        ("metadata[cobro_intent]", order),
    ]
}

impl Provider {
    /// POST a raw form body as `caller`.
    pub async fn stripe_post_raw(
        &self,
        caller: &str,
        path: &str,
        key: Option<&str>,
        body: String,
    ) -> reqwest::Result<Reply> {
        self.stripe_post_with(&self.http, caller, path, key, body)
            .await
    }

    /// POST through a given client (one with a short timeout, say).
    pub async fn stripe_post_with(
        &self,
        http: &reqwest::Client,
        caller: &str,
        path: &str,
        key: Option<&str>,
        body: String,
    ) -> reqwest::Result<Reply> {
        let mut request = http
            .post(format!("{}{path}", self.url))
            .bearer_auth(caller)
            .header("Stripe-Version", VERSION)
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        reply(request.send().await?).await
    }

    /// POST `pairs` as `caller`; panics on a transport error.
    pub async fn stripe_post_as(
        &self,
        caller: &str,
        path: &str,
        key: Option<&str>,
        pairs: &[(&str, &str)],
    ) -> Reply {
        self.stripe_post_raw(caller, path, key, form(pairs))
            .await
            .expect("POST completes")
    }

    pub async fn stripe_post(
        &self,
        path: &str,
        key: Option<&str>,
        pairs: &[(&str, &str)],
    ) -> Reply {
        self.stripe_post_as(SK, path, key, pairs).await
    }

    /// GET as `caller` (the query already encoded).
    pub async fn stripe_get_as(&self, caller: &str, path_and_query: &str) -> Reply {
        let response = self
            .http
            .get(format!("{}{path_and_query}", self.url))
            .bearer_auth(caller)
            .header("Stripe-Version", VERSION)
            .send()
            .await
            .expect("GET completes");
        reply(response).await.expect("GET body")
    }

    pub async fn stripe_get(&self, path_and_query: &str) -> Reply {
        self.stripe_get_as(SK, path_and_query).await
    }

    /// `GET /v1/payment_intents/search?query=...` ids, newest first.
    pub async fn stripe_search_as(&self, caller: &str, query: &str) -> Vec<String> {
        let path = format!("/v1/payment_intents/search?{}", form(&[("query", query)]));
        let reply = self.stripe_get_as(caller, &path).await;
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.body["object"], "search_result");
        super::ids(&reply.body["data"])
    }

    /// A confirmed PaymentIntent (`automatic` or `manual`) for `order`.
    pub async fn stripe_intent(
        &self,
        capture_method: &str,
        order: &str,
        key: Option<&str>,
    ) -> Reply {
        let reply = self
            .stripe_post(
                "/v1/payment_intents",
                key,
                &intent_form(capture_method, order),
            )
            .await;
        assert_eq!(reply.status, 200, "{reply:?}");
        reply
    }
}

pub async fn reply(response: reqwest::Response) -> reqwest::Result<Reply> {
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let replayed = header(fake_provider::REPLAYED_HEADER).is_some_and(|v| v == "true");
    let request_id = header(fake_provider::REQUEST_ID_HEADER);
    let should_retry = header(fake_provider::SHOULD_RETRY_HEADER);
    let status = response.status().as_u16();
    let bytes = response.bytes().await?;
    Ok(Reply {
        status,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        replayed,
        request_id,
        should_retry,
    })
}
