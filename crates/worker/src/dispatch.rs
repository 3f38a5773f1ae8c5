//! The event dispatcher: every event to every endpoint that takes it, at
//! least once.
//!
//! The loop ([`Dispatcher::run`]): sequence what committed since the last
//! claim (feed positions and deliveries, `Store::sequence_events`), claim
//! as many due deliveries as there are free sending slots (one short
//! statement: lease + fencing token, SKIP LOCKED on PostgreSQL), release
//! the connection, and start one task per delivery that POSTs it with a
//! timeout and records the result fenced by its token. It does not wait
//! for a batch to finish: a finished delivery frees its slot and wakes the
//! loop, which claims again (the next event of that payment included). No
//! transaction is open during a POST, so a slow endpoint holds no
//! connection and delays no payment; a dispatcher that dies mid-POST leaves
//! a lease that expires, and the next one sends the same event (same id)
//! again. [`Dispatcher::run_once`] is one claim whose deliveries are all
//! awaited (tests step it).
//!
//! Order: the claim takes a payment's next delivery to an endpoint only
//! once the previous one is delivered or dead (`Store::claim_deliveries`),
//! in every dispatcher process alike, so an endpoint receives each
//! payment's events in `sequence` order. A POST is started only while its
//! lease will outlast it (`DeliveryClaim::lease_until`): a dispatcher that
//! waited too long gives the delivery back instead of sending it after
//! another dispatcher has sent it, and the next one, in its place.
//!
//! Isolation: at most [`DispatcherConfig::per_endpoint`] POSTs to one
//! endpoint at once; the claim skips an endpoint that has them all, and a
//! claim's deliveries beyond an endpoint's free slots are given back at
//! once (`Store::release_delivery`) rather than wait in a slot, so
//! a hanging or failing endpoint holds at most that many of the
//! [`DispatcherConfig::max_in_flight`] slots, each for at most
//! `request_timeout`, and never delays another endpoint's deliveries.
//!
//! Headers: `Cobro-Signature` (`cobro_core::signature`) and the Standard
//! Webhooks headers `webhook-id`, `webhook-timestamp`, `webhook-signature`
//! (`cobro_core::standard_webhooks`), signed with the same secrets.
//!
//! An endpoint that answers `410 Gone` is disabled at once with that
//! reason (`DeliveryResult::Gone`); its deliveries wait until an operator
//! or the merchant enables it again.
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
use cobro_core::standard_webhooks;
use cobro_core::{EndpointId, EventId};
use cobro_store::events::{DeliveryClaim, DeliveryResult, Recorded};
use cobro_store::{Store, StoreError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, Semaphore, watch};

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
    /// Deliveries claimed at most by one claim statement.
    pub batch: u32,
    /// POSTs of this dispatcher at once, all endpoints together.
    pub max_in_flight: usize,
    /// POSTs of this dispatcher at once to one endpoint: what a hanging
    /// endpoint can hold of `max_in_flight`, at most `request_timeout`
    /// each.
    pub per_endpoint: usize,
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
            max_in_flight: 128,
            per_endpoint: 4,
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
    pub event_id: EventId,
    pub endpoint_id: EndpointId,
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
    /// The sending slots of this dispatcher (`max_in_flight`).
    slots: Arc<Semaphore>,
    /// Each endpoint's own slots (`per_endpoint`), while it has any taken.
    gates: Mutex<HashMap<EndpointId, Arc<Semaphore>>>,
    /// Rung when a delivery finishes: its slot is free, and the next event
    /// of its payment may be claimable.
    finished: Notify,
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
            slots: Arc::new(Semaphore::new(config.max_in_flight.max(1))),
            gates: Mutex::default(),
            finished: Notify::new(),
            config,
            egress,
        })
    }

    pub fn config(&self) -> &DispatcherConfig {
        &self.config
    }

    /// One round: sequence, claim, send (concurrently), record, and wait
    /// for all of them (tests step the dispatcher with it; [`run`](Self::run)
    /// does not wait).
    pub async fn run_once(&self) -> Result<Vec<DeliveryStep>, StoreError> {
        let claims = self.claim(self.config.batch).await?;
        let sends = claims.into_iter().map(|claim| self.deliver_in_turn(claim));
        let mut steps = Vec::new();
        for step in futures::future::join_all(sends).await {
            steps.extend(step?);
        }
        Ok(steps)
    }

    /// Sequences, then claims up to `limit` deliveries, skipping the
    /// endpoints whose slots are all taken.
    async fn claim(&self, limit: u32) -> Result<Vec<DeliveryClaim>, StoreError> {
        let now = self.clock.now();
        self.store.sequence_events(now).await?;
        let lease_until = now + chrono_duration(self.config.lease);
        let full: Vec<EndpointId> = {
            let mut gates = self.gates.lock().unwrap_or_else(|e| e.into_inner());
            // An endpoint with every slot free and no delivery waiting for
            // one is forgotten.
            gates.retain(|_, gate| {
                Arc::strong_count(gate) > 1
                    || gate.available_permits() < self.config.per_endpoint.max(1)
            });
            gates
                .iter()
                .filter(|(_, gate)| gate.available_permits() == 0)
                .map(|(id, _)| *id)
                .collect()
        };
        self.store
            .claim_deliveries(&self.config.owner, now, lease_until, limit, &full)
            .await
    }

    fn gate(&self, endpoint: EndpointId) -> Arc<Semaphore> {
        let mut gates = self.gates.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(
            gates
                .entry(endpoint)
                .or_insert_with(|| Arc::new(Semaphore::new(self.config.per_endpoint.max(1)))),
        )
    }

    /// Waits for one of the endpoint's slots, then delivers; gives the
    /// delivery back unsent (`None`) if the lease would not outlast the
    /// POST by then.
    async fn deliver_in_turn(
        &self,
        claim: DeliveryClaim,
    ) -> Result<Option<DeliveryStep>, StoreError> {
        let gate = self.gate(claim.endpoint.id);
        let wait = (self.latest_start(&claim) - self.clock.now())
            .to_std()
            .unwrap_or(Duration::ZERO);
        match tokio::time::timeout(wait, gate.acquire_owned()).await {
            Ok(Ok(_turn)) => self.deliver_within_lease(claim).await,
            _ => self.give_back(&claim).await,
        }
    }

    /// The last instant a POST of `claim` may start: its lease must
    /// outlast the POST's timeout.
    fn latest_start(&self, claim: &DeliveryClaim) -> DateTime<Utc> {
        claim.lease_until - chrono_duration(self.config.request_timeout)
    }

    async fn deliver_within_lease(
        &self,
        claim: DeliveryClaim,
    ) -> Result<Option<DeliveryStep>, StoreError> {
        if self.clock.now() < self.latest_start(&claim) {
            self.deliver(claim).await.map(Some)
        } else {
            self.give_back(&claim).await
        }
    }

    /// Releases an unsent claim, due at once for any dispatcher.
    async fn give_back(&self, claim: &DeliveryClaim) -> Result<Option<DeliveryStep>, StoreError> {
        self.store.release_delivery(claim, self.clock.now()).await?;
        Ok(None)
    }

    async fn deliver(&self, claim: DeliveryClaim) -> Result<DeliveryStep, StoreError> {
        let body = serde_json::to_vec(&claim.event.to_json())
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let sent_at = self.clock.now();
        let secrets = claim.endpoint.signing_secrets(sent_at);
        let signature = cobro_core::signature::sign(&secrets, sent_at.timestamp(), &body);
        let event_id = claim.event.id.to_string();
        let standard_signature =
            standard_webhooks::sign(&secrets, &event_id, sent_at.timestamp(), &body);
        let span = tracing::info_span!(
            "events.deliver",
            event_id = %claim.event.id,
            event_type = %claim.event.event_type,
            endpoint_id = %claim.endpoint.id,
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
                        .header(standard_webhooks::ID_HEADER, &event_id)
                        .header(
                            standard_webhooks::TIMESTAMP_HEADER,
                            sent_at.timestamp().to_string(),
                        )
                        .header(standard_webhooks::SIGNATURE_HEADER, standard_signature)
                        .header("Cobro-Event-Id", &event_id)
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
            (Some(410), _) => DeliveryResult::Gone,
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
            DeliveryResult::Gone => (false, false),
        };
        let endpoint_disabled = matches!(
            recorded,
            Recorded::Written {
                endpoint_disabled: true
            }
        );
        if endpoint_disabled && matches!(result, DeliveryResult::Gone) {
            tracing::warn!(
                parent: &span,
                "event endpoint disabled: it answered 410 Gone; its deliveries wait until it is enabled again"
            );
        } else if endpoint_disabled {
            tracing::warn!(parent: &span, "event endpoint disabled: it failed for the whole period");
        }
        tracing::info!(parent: &span, status, delivered, dead, "event delivery attempted");
        Ok(DeliveryStep {
            event_id: claim.event.id,
            endpoint_id: claim.endpoint.id,
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

    /// Claims and sends until `shutdown` turns true, never waiting for a
    /// batch: each delivery is a task that frees its slot when recorded.
    /// With no free slot, or nothing claimed, it waits for a delivery to
    /// finish or `poll_interval`. A database error is logged and retried.
    /// On shutdown it waits for the deliveries in flight (each bounded by
    /// `request_timeout`).
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        tracing::info!(owner = %self.config.owner, "event dispatcher started");
        let mut tasks = tokio::task::JoinSet::new();
        loop {
            if *shutdown.borrow() {
                break;
            }
            while let Some(done) = tasks.try_join_next() {
                log_finished(done);
            }
            let free = self.slots.available_permits();
            let limit = u32::try_from(free)
                .unwrap_or(u32::MAX)
                .min(self.config.batch);
            let mut claimed = 0;
            if limit > 0 {
                match self.claim(limit).await {
                    Ok(claims) => {
                        for claim in claims {
                            // Both slots are taken here, in the loop, so the
                            // next claim's skip list is exact. A claim holds
                            // more deliveries to one endpoint than it has
                            // free slots: the rest go back at once instead of
                            // waiting in a slot another endpoint could use.
                            let gate = self.gate(claim.endpoint.id);
                            let (Ok(slot), Ok(turn)) = (
                                Arc::clone(&self.slots).try_acquire_owned(),
                                gate.try_acquire_owned(),
                            ) else {
                                self.give_back(&claim).await.ok();
                                continue;
                            };
                            claimed += 1;
                            let me = Arc::clone(&self);
                            tasks.spawn(async move {
                                let step = me.deliver_within_lease(claim).await;
                                drop((turn, slot));
                                me.finished.notify_one();
                                step
                            });
                        }
                    }
                    Err(error) => {
                        tracing::warn!(error = %error, "event dispatcher claim failed");
                    }
                }
            }
            if claimed == 0 {
                tokio::select! {
                    _ = tokio::time::sleep(self.config.poll_interval) => {}
                    _ = self.finished.notified() => {}
                    _ = shutdown.changed() => {}
                }
            }
        }
        while let Some(done) = tasks.join_next().await {
            log_finished(done);
        }
        tracing::info!(owner = %self.config.owner, "event dispatcher stopped");
    }
}

/// A delivery task's end: a database error (the delivery is retried once
/// its lease expires) or a panic is logged.
fn log_finished(done: Result<Result<Option<DeliveryStep>, StoreError>, tokio::task::JoinError>) {
    match done {
        Ok(Ok(_)) => {}
        Ok(Err(error)) => tracing::warn!(error = %error, "event delivery could not be recorded"),
        Err(error) => tracing::error!(error = %error, "event delivery task failed"),
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
