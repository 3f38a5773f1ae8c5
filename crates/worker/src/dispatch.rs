//! The event dispatcher: every event to every endpoint that takes it, at
//! least once.
//!
//! One round ([`Dispatcher::run_once`]): sequence what committed since the
//! last round (feed positions and deliveries, `Store::sequence_events`),
//! claim due deliveries (one short statement: lease + fencing token, SKIP
//! LOCKED on PostgreSQL), release the connection, POST each one with a
//! timeout, then record each result fenced by its token. No transaction is
//! open during a POST, so a slow endpoint holds no connection and delays no
//! payment; a dispatcher that dies mid-POST leaves a lease that expires, and
//! the next one sends the same event (same id) again.
//!
//! Where: every POST goes only where the egress rule allows
//! (`DispatcherConfig::egress`, `cobro_core::egress`): the scheme and an
//! IP-literal host are checked before sending, a host name is resolved by
//! the client's guarded resolver (`crate::egress`), which connects only to
//! allowed addresses. No redirects, no proxy, and at most
//! [`ANSWER_READ_LIMIT`] bytes of an answer are read.
//!
//! Retries: capped exponential backoff with full jitter on cobro's clock
//! (`retry::backoff`), for `retry_period` from the first attempt; then the
//! delivery is `dead` (`cobro events resend --dead` replays it). An endpoint
//! that has failed every attempt for `disable_after` is disabled with the
//! reason (its deliveries wait; `cobro events endpoints enable` resumes).

use crate::egress::{GuardedResolver, Lookup, blocked_by, check_before_send, system_lookup};
use crate::retry::backoff;
use chrono::{DateTime, Utc};
use cobro_core::Clock;
use cobro_core::egress::EgressPolicy;
use cobro_store::events::{DeliveryClaim, DeliveryResult, Recorded};
use cobro_store::{Store, StoreError};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The header carrying `t=<unix seconds>,v1=<hex HMAC-SHA256(secret,
/// "<t>.<raw body>")>`, one `v1` per valid secret.
pub const SIGNATURE_HEADER: &str = "Cobro-Signature";

/// How much of an endpoint's answer is read: its status is what counts;
/// a larger body is dropped, with its connection.
pub const ANSWER_READ_LIMIT: usize = 4 * 1024;

/// Settings of a dispatcher.
#[derive(Clone, Debug)]
pub struct DispatcherConfig {
    /// Names this dispatcher in leases; unique per process.
    pub owner: String,
    /// How long a claimed delivery is ours; longer than `request_timeout`.
    pub lease: Duration,
    /// Deliveries claimed per round (and sent concurrently).
    pub batch: u32,
    /// How often an idle dispatcher looks again.
    pub poll_interval: Duration,
    /// One POST, connection included; a slower endpoint counts as failed.
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// How long a delivery is retried from its first attempt before it is
    /// dead. Events are kept at least this long.
    pub retry_period: Duration,
    /// An endpoint failing every attempt this long is disabled.
    pub disable_after: Duration,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Where events may go. The default is production's: `https://` to
    /// public addresses only; tests and private deployments list more.
    pub egress: EgressPolicy,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            owner: format!(
                "dispatcher-{}-{}",
                std::process::id(),
                uuid::Uuid::new_v4().simple()
            ),
            lease: Duration::from_secs(60),
            batch: 32,
            poll_interval: Duration::from_secs(1),
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(2),
            retry_period: Duration::from_secs(3 * 24 * 3600),
            disable_after: Duration::from_secs(3 * 24 * 3600),
            backoff_base: Duration::from_secs(5),
            backoff_cap: Duration::from_secs(3600),
            egress: EgressPolicy::default(),
        }
    }
}

/// What one delivery attempt came to (for tests and logs).
#[derive(Clone, Debug)]
pub struct DeliveryStep {
    pub event_id: uuid::Uuid,
    pub endpoint_id: uuid::Uuid,
    /// The endpoint's status, if it answered.
    pub status: Option<u16>,
    pub delivered: bool,
    /// `false`: another dispatcher took the delivery over meanwhile.
    pub recorded: bool,
    pub dead: bool,
    pub endpoint_disabled: bool,
}

pub struct Dispatcher {
    store: Store,
    clock: Arc<dyn Clock>,
    http: reqwest::Client,
    config: DispatcherConfig,
    egress: Arc<EgressPolicy>,
}

impl Dispatcher {
    pub fn new(
        store: Store,
        clock: Arc<dyn Clock>,
        config: DispatcherConfig,
    ) -> Result<Self, reqwest::Error> {
        Self::with_lookup(store, clock, config, system_lookup())
    }

    /// [`new`](Self::new) with the given name resolution (tests: a name
    /// that resolves to loopback, as a rebinding DNS server would answer).
    pub fn with_lookup(
        store: Store,
        clock: Arc<dyn Clock>,
        config: DispatcherConfig,
        lookup: Lookup,
    ) -> Result<Self, reqwest::Error> {
        let egress = Arc::new(config.egress.clone());
        let http = reqwest::Client::builder()
            .timeout(config.request_timeout)
            .connect_timeout(config.connect_timeout)
            // Endpoints answer; they do not send us elsewhere (a redirect
            // to an internal address would skip the registration check).
            .redirect(reqwest::redirect::Policy::none())
            // A proxy would resolve and connect in our place, past the
            // guarded resolver.
            .no_proxy()
            .dns_resolver(GuardedResolver::new(Arc::clone(&egress), lookup))
            .build()?;
        Ok(Self {
            store,
            clock,
            http,
            config,
            egress,
        })
    }

    pub fn config(&self) -> &DispatcherConfig {
        &self.config
    }

    /// One round: sequence, claim, send (concurrently), record.
    pub async fn run_once(&self) -> Result<Vec<DeliveryStep>, StoreError> {
        let now = self.clock.now();
        self.store.sequence_events(now).await?;
        let lease_until = now + chrono_duration(self.config.lease);
        let claims = self
            .store
            .claim_deliveries(&self.config.owner, now, lease_until, self.config.batch)
            .await?;
        let sends = claims.into_iter().map(|claim| self.deliver(claim));
        let mut steps = Vec::new();
        for step in futures::future::join_all(sends).await {
            steps.push(step?);
        }
        Ok(steps)
    }

    async fn deliver(&self, claim: DeliveryClaim) -> Result<DeliveryStep, StoreError> {
        let body = serde_json::to_vec(&claim.event.to_json())
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let sent_at = self.clock.now();
        let signature = cobro_core::signature::sign(
            &claim.endpoint.signing_secrets(sent_at),
            sent_at.timestamp(),
            &body,
        );
        let span = tracing::info_span!(
            "events.deliver",
            event_id = %claim.event.id.0,
            event_type = %claim.event.event_type,
            endpoint_id = %claim.endpoint.id.0,
            attempt = claim.attempts + 1,
        );
        let (status, error) = match self.allowed(&claim.endpoint.url) {
            Err(refused) => (None, Some(refused)),
            Ok(url) => {
                let answer = tracing::Instrument::instrument(
                    self.http
                        .post(url)
                        .header("content-type", "application/json")
                        .header(SIGNATURE_HEADER, signature)
                        .header("Cobro-Event-Id", claim.event.id.0.to_string())
                        .header("Cobro-Event-Type", &claim.event.event_type)
                        .body(body)
                        .send(),
                    span.clone(),
                )
                .await;
                match answer {
                    Ok(mut response) => {
                        let status = response.status().as_u16();
                        // A little of the body is read (within the
                        // timeout) so a small answer leaves the connection
                        // reusable; its content is ignored, and a larger
                        // one is not read further.
                        let mut read = 0;
                        while read < ANSWER_READ_LIMIT {
                            match response.chunk().await {
                                Ok(Some(chunk)) => read += chunk.len(),
                                _ => break,
                            }
                        }
                        (Some(status), None)
                    }
                    // The error's text names the host, never a secret.
                    Err(e) => (None, Some(transport_error(&e))),
                }
            }
        };
        if let Some(error) = error.as_deref().filter(|e| e.starts_with("refused")) {
            tracing::warn!(parent: &span, error, "event endpoint not allowed by the egress rule");
        }
        let now = self.clock.now();
        let result = match (status, error) {
            (Some(s), _) if (200..300).contains(&s) => DeliveryResult::Delivered { status: s },
            (status, error) => {
                let error = error.unwrap_or_else(|| format!("answered {}", status.unwrap_or(0)));
                DeliveryResult::Failed {
                    status,
                    error,
                    retry_at: self.retry_at(&claim, now),
                    disable_before: now - chrono_duration(self.config.disable_after),
                }
            }
        };
        let recorded = self.store.record_delivery(&claim, &result, now).await?;
        let (delivered, dead) = match &result {
            DeliveryResult::Delivered { .. } => (true, false),
            DeliveryResult::Failed { retry_at, .. } => (false, retry_at.is_none()),
        };
        let endpoint_disabled = matches!(
            recorded,
            Recorded::Written {
                endpoint_disabled: true
            }
        );
        if endpoint_disabled {
            tracing::warn!(parent: &span, "event endpoint disabled: it failed for the whole period");
        }
        tracing::info!(parent: &span, status, delivered, dead, "event delivery attempted");
        Ok(DeliveryStep {
            event_id: claim.event.id.0,
            endpoint_id: claim.endpoint.id.0,
            status,
            delivered,
            recorded: recorded != Recorded::LeaseLost,
            dead: dead && recorded != Recorded::LeaseLost,
            endpoint_disabled,
        })
    }

    /// The endpoint's URL, if its scheme and IP-literal host are allowed
    /// (a host name is checked by the resolver, at connect time); else
    /// why not, as the delivery's error.
    fn allowed(&self, url: &str) -> Result<reqwest::Url, String> {
        let url = reqwest::Url::parse(url).map_err(|_| "refused: the URL could not be read")?;
        check_before_send(&self.egress, &url).map_err(|refusal| format!("refused: {refusal}"))?;
        Ok(url)
    }

    /// When to try again, or `None` once the retry period is over.
    fn retry_at(&self, claim: &DeliveryClaim, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let first = claim.first_attempt_at.unwrap_or(now);
        let delay = backoff(
            self.config.backoff_base,
            self.config.backoff_cap,
            claim.attempts.max(0) as u32,
        );
        let next = now + chrono_duration(delay);
        (next < first + chrono_duration(self.config.retry_period)).then_some(next)
    }

    /// Rounds until `shutdown` turns true; sleeps `poll_interval` when a
    /// round found nothing. A database error is logged and retried.
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        tracing::info!(owner = %self.config.owner, "event dispatcher started");
        loop {
            if *shutdown.borrow() {
                break;
            }
            let busy = match self.run_once().await {
                Ok(steps) => !steps.is_empty(),
                Err(error) => {
                    tracing::warn!(error = %error, "event dispatcher round failed");
                    false
                }
            };
            if !busy {
                tokio::select! {
                    _ = tokio::time::sleep(self.config.poll_interval) => {}
                    _ = shutdown.changed() => {}
                }
            }
        }
        tracing::info!(owner = %self.config.owner, "event dispatcher stopped");
    }
}

fn transport_error(e: &reqwest::Error) -> String {
    if let Some(refusal) = blocked_by(e) {
        format!("refused: {refusal}")
    } else if e.is_timeout() {
        "timed out".to_owned()
    } else if e.is_connect() {
        "could not connect".to_owned()
    } else {
        "the connection failed before an answer".to_owned()
    }
}

fn chrono_duration(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}
