//! [`AdminClient`]: the control API over HTTP, for a provider running as a
//! separate process (`fake-provider --admin`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;

use crate::admin::{Advance, DialectBody, FaultId, Held, Now, Released};
use crate::config::{WebhookDialect, WebhookTarget};
use crate::control::ActiveFault;
use crate::faults::FaultRule;
use crate::ledger::Ledger;
use crate::webhooks::WebhookDelivery;

/// Why an admin call failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The request did not complete (connection, timeout, bad JSON).
    #[error("admin request failed: {0}")]
    Http(#[from] reqwest::Error),
    /// The provider answered with an error (404 when `--admin` is off).
    #[error("admin request answered {status}: {body}")]
    Status {
        /// HTTP status.
        status: u16,
        /// Response body, for the message.
        body: String,
    },
}

/// Client of `/__admin` on a provider at `base_url`.
#[derive(Clone, Debug)]
pub struct AdminClient {
    base_url: String,
    http: reqwest::Client,
}

impl AdminClient {
    /// `base_url` as printed by the binary, e.g. `http://127.0.0.1:8089`.
    pub fn new(base_url: impl Into<String>) -> Self {
        let base_url = base_url.into().trim_end_matches('/').to_owned();
        Self {
            base_url,
            // Plain HTTP to the fake: no CA roots to load (they cost
            // milliseconds per client, and tests make many).
            http: reqwest::Client::builder()
                .tls_certs_only(std::iter::empty())
                .build()
                .expect("a reqwest client with no TLS roots always builds"),
        }
    }

    /// See [`crate::Control::add_fault`]; invalid rules are refused with 400.
    pub async fn add_fault(&self, rule: FaultRule) -> Result<u64, AdminError> {
        let request = self.http.post(self.url("faults")).json(&rule);
        Ok(self.send::<FaultId>(request).await?.id)
    }

    /// See [`crate::Control::faults`].
    pub async fn faults(&self) -> Result<Vec<ActiveFault>, AdminError> {
        self.send(self.http.get(self.url("faults"))).await
    }

    /// See [`crate::Control::clear_faults`].
    pub async fn clear_faults(&self) -> Result<(), AdminError> {
        self.send_empty(self.http.delete(self.url("faults"))).await
    }

    /// See [`crate::Control::advance_clock`]; returns the new virtual time.
    pub async fn advance_clock(&self, by: Duration) -> Result<DateTime<Utc>, AdminError> {
        let request = self.http.post(self.url("clock/advance")).json(&Advance {
            seconds: by.as_secs_f64(),
        });
        Ok(self.send::<Now>(request).await?.now)
    }

    /// See [`crate::Control::now`].
    pub async fn now(&self) -> Result<DateTime<Utc>, AdminError> {
        Ok(self
            .send::<Now>(self.http.get(self.url("clock")))
            .await?
            .now)
    }

    /// See [`crate::Control::ledger`].
    pub async fn ledger(&self) -> Result<Ledger, AdminError> {
        self.send(self.http.get(self.url("ledger"))).await
    }

    /// See [`crate::Control::set_webhook`].
    pub async fn set_webhook(&self, target: Option<WebhookTarget>) -> Result<(), AdminError> {
        let request = match target {
            Some(target) => self.http.put(self.url("webhooks")).json(&target),
            None => self.http.delete(self.url("webhooks")),
        };
        self.send_empty(request).await
    }

    /// See [`crate::Control::set_webhook_dialect`].
    pub async fn set_webhook_dialect(&self, dialect: WebhookDialect) -> Result<(), AdminError> {
        let request = self
            .http
            .put(self.url("webhooks/dialect"))
            .json(&DialectBody { dialect });
        self.send_empty(request).await
    }

    /// See [`crate::Control::webhook_dialect`].
    pub async fn webhook_dialect(&self) -> Result<WebhookDialect, AdminError> {
        let body: DialectBody = self
            .send(self.http.get(self.url("webhooks/dialect")))
            .await?;
        Ok(body.dialect)
    }

    /// See [`crate::Control::webhook_deliveries`].
    pub async fn webhook_deliveries(&self) -> Result<Vec<WebhookDelivery>, AdminError> {
        self.send(self.http.get(self.url("webhooks/deliveries")))
            .await
    }

    /// See [`crate::Control::held`].
    pub async fn held(&self) -> Result<usize, AdminError> {
        Ok(self
            .send::<Held>(self.http.get(self.url("held")))
            .await?
            .held)
    }

    /// See [`crate::Control::release_held`].
    pub async fn release_held(&self) -> Result<usize, AdminError> {
        let request = self.http.post(self.url("held/release"));
        Ok(self.send::<Released>(request).await?.released)
    }

    fn url(&self, path: &str) -> String {
        format!("{}/__admin/{path}", self.base_url)
    }

    async fn send<T: DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<T, AdminError> {
        Ok(checked(request.send().await?).await?.json().await?)
    }

    async fn send_empty(&self, request: reqwest::RequestBuilder) -> Result<(), AdminError> {
        checked(request.send().await?).await.map(drop)
    }
}

async fn checked(response: reqwest::Response) -> Result<reqwest::Response, AdminError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let body = response.text().await.unwrap_or_default();
    Err(AdminError::Status {
        status: status.as_u16(),
        body,
    })
}
