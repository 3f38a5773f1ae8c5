//! Webhook events: signing, at-least-once delivery, and delivery faults.
//!
//! Effects queue events (under the state lock, without IO); one dispatcher
//! task takes them in order and hands each to a delivery lane, by reference
//! (`Config::webhook_concurrency` lanes; one by default, which sends every
//! event in order). A failed delivery is retried by its own task with capped
//! exponential backoff until the receiver answers 2xx, so one broken event
//! does not hold back the others. The `webhook` fault rules act here:
//! `latency` (sleep before sending), `duplicate`, `reorder` and
//! `drop_then_redeliver`.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use chrono::{DateTime, Utc};
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::config::{WEBHOOK_RETRY_CAP, WebhookDialect};
use crate::faults::{FaultAction, Operation};
use crate::model::{Charge, Refund};
use crate::state::Shared;

/// The header carrying `t=<unix seconds>,v1=<hex HMAC-SHA256>` on events of
/// the fake dialect.
pub const SIGNATURE_HEADER: &str = "Fake-Signature";

/// The same signature on events of the Stripe dialect, under Stripe's name.
pub const STRIPE_SIGNATURE_HEADER: &str = "Stripe-Signature";

/// Timeout of one delivery attempt; a hanging receiver counts as a failure.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// The value of the `Fake-Signature` (or `Stripe-Signature`) header for
/// `body` sent at `timestamp` (unix seconds):
/// `t=<timestamp>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`, which is
/// Stripe's scheme with one `v1` signature.
pub fn sign(secret: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes())
        .expect("HMAC accepts keys of any length");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!(
        "t={timestamp},v1={}",
        hex::encode(mac.finalize().into_bytes())
    )
}

/// One attempt to deliver one event.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct WebhookDelivery {
    /// `evt_...` of the event.
    pub event_id: String,
    /// Event type, e.g. `charge.captured`.
    pub event_type: String,
    /// 1 for the first attempt of a copy, counting up through retries.
    pub attempt: u32,
    /// The receiver's HTTP status, if it answered.
    pub status: Option<u16>,
    /// Why no status: a transport error, or `dropped by fault`.
    pub error: Option<String>,
    /// Virtual time of the attempt.
    pub at: DateTime<Utc>,
}

impl WebhookDelivery {
    /// The receiver acknowledged this attempt with a 2xx.
    pub fn acknowledged(&self) -> bool {
        self.status
            .is_some_and(|status| (200..300).contains(&status))
    }
}

/// An event as queued by an effect, already serialised (under the state
/// lock, once), so every copy and retry sends the same bytes.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    pub(crate) id: String,
    pub(crate) kind: &'static str,
    /// What `reference_contains` of a webhook rule matches; not sent.
    pub(crate) reference: String,
    /// Which header signs it.
    pub(crate) dialect: WebhookDialect,
    pub(crate) body: Bytes,
}

/// The fake dialect's event body.
#[derive(Serialize)]
pub(crate) struct FakeEvent<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    created: DateTime<Utc>,
    /// The charge's sequence after this effect.
    sequence: u64,
    data: &'a FakeEventData,
}

impl FakeEvent<'_> {
    pub(crate) fn render(
        id: &str,
        kind: &'static str,
        created: DateTime<Utc>,
        sequence: u64,
        data: &FakeEventData,
    ) -> Vec<u8> {
        let event = FakeEvent {
            id,
            kind,
            created,
            sequence,
            data,
        };
        serde_json::to_vec(&event).unwrap_or_default()
    }
}

#[derive(Serialize, Debug, Clone)]
#[serde(untagged)]
pub(crate) enum FakeEventData {
    Charge(Charge),
    Refund(Refund),
}

/// Sends events to the current target and records each attempt.
#[derive(Clone)]
struct Sender {
    shared: Arc<Shared>,
    /// Built on the first delivery: most fakes (the tests') never deliver,
    /// and building a client reads the platform's CA roots.
    http: Arc<std::sync::OnceLock<Result<reqwest::Client, String>>>,
}

impl Sender {
    /// One attempt; true when there is nothing more to do (acknowledged, or
    /// no target any more).
    async fn attempt(&self, event: &Event, attempt: u32) -> bool {
        let Some(target) = self.shared.lock().webhook.clone() else {
            return true;
        };
        let http = self.http.get_or_init(|| {
            reqwest::Client::builder()
                .timeout(ATTEMPT_TIMEOUT)
                .build()
                .map_err(|e| format!("cannot build the webhook HTTP client: {e}"))
        });
        let http = match http {
            Ok(http) => http,
            Err(error) => return self.record(event, attempt, None, Some(error.clone())),
        };
        let now = self.shared.clock.now();
        let (header, content_type) = match event.dialect {
            WebhookDialect::Fake => (SIGNATURE_HEADER, "application/json"),
            WebhookDialect::Stripe => (STRIPE_SIGNATURE_HEADER, "application/json; charset=utf-8"),
        };
        let result = http
            .post(&target.url)
            .header(reqwest::header::CONTENT_TYPE, content_type)
            .header(header, sign(&target.secret, now.timestamp(), &event.body))
            .body(event.body.clone())
            .send()
            .await;
        let (status, error) = match result {
            Ok(response) => (Some(response.status().as_u16()), None),
            Err(error) => (None, Some(error.to_string())),
        };
        self.record(event, attempt, status, error)
    }

    fn record(
        &self,
        event: &Event,
        attempt: u32,
        status: Option<u16>,
        error: Option<String>,
    ) -> bool {
        let delivery = WebhookDelivery {
            event_id: event.id.clone(),
            event_type: event.kind.to_owned(),
            attempt,
            status,
            error,
            at: self.shared.clock.now(),
        };
        let acknowledged = delivery.acknowledged();
        self.shared.deliveries().push(delivery);
        acknowledged
    }

    /// Retries from attempt `attempt` on, with capped exponential backoff,
    /// until acknowledged.
    async fn retry(self, event: Event, mut attempt: u32) {
        loop {
            tokio::time::sleep(backoff(self.shared.webhook_retry_base, attempt - 1)).await;
            if self.attempt(&event, attempt).await {
                return;
            }
            attempt += 1;
        }
    }

    /// The first delivery of each copy of an event; failures go to a retry
    /// task so the lane moves on.
    async fn deliver(&self, event: Event, fault: Option<FaultAction>, retries: &mut JoinSet<()>) {
        let copies = if fault == Some(FaultAction::Duplicate) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let acknowledged = if fault == Some(FaultAction::DropThenRedeliver) {
                self.record(&event, 1, None, Some("dropped by fault".to_owned()))
            } else {
                self.attempt(&event, 1).await
            };
            if !acknowledged {
                retries.spawn(self.clone().retry(event.clone(), 2));
            }
        }
    }
}

/// Delay before the retry that follows `failures` failed attempts.
fn backoff(base: Duration, failures: u32) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1));
    base.saturating_mul(factor).min(WEBHOOK_RETRY_CAP)
}

/// Runs until shutdown: takes queued events in order, draws their faults and
/// hands each to its lane (see [`Lanes`]).
pub(crate) async fn dispatch(
    shared: Arc<Shared>,
    mut events: UnboundedReceiver<Event>,
    mut shutdown: watch::Receiver<bool>,
    concurrency: usize,
) {
    let sender = Sender {
        shared,
        http: Arc::default(),
    };
    let lanes = Lanes::start(&sender, concurrency, &shutdown);
    // A `reorder`ed event waits for the next one, but not forever: at-least-once
    // still holds when no other event comes.
    let mut held: Option<(Handed, Instant)> = None;
    loop {
        let release_at = held.as_ref().map(|(_, since)| *since + WEBHOOK_RETRY_CAP);
        let event = tokio::select! {
            _ = shutdown.changed() => break,
            () = sleep_until(release_at), if release_at.is_some() => {
                if let Some((handed, _)) = held.take() {
                    lanes.send(handed);
                }
                continue;
            }
            event = events.recv() => match event {
                Some(event) => event,
                None => break,
            },
        };
        let picked = {
            let mut state = sender.shared.lock();
            let state = &mut *state;
            state.faults.pick(
                Operation::Webhook,
                Some(&event.reference),
                &mut state.fault_rng,
            )
        };
        let fault = picked.outcome.map(|(action, _)| action);
        let handed = Handed {
            event,
            fault,
            latency: picked.latency,
        };
        if fault == Some(FaultAction::Reorder) && held.is_none() {
            held = Some((
                Handed {
                    fault: None,
                    ..handed
                },
                Instant::now(),
            ));
            continue;
        }
        lanes.send(handed);
        if let Some((earlier, _)) = held.take() {
            lanes.send(earlier);
        }
    }
    lanes.stop().await;
}

/// An event on its way to a lane, with the faults drawn for it.
struct Handed {
    event: Event,
    /// `duplicate` or `drop_then_redeliver` (a `reorder` was done by the
    /// dispatcher).
    fault: Option<FaultAction>,
    /// A `latency` rule's delay, slept by the lane before sending.
    latency: Option<Duration>,
}

/// The tasks that make first deliveries. Events with the same reference
/// always go to the same lane, which sends them one at a time in the order
/// it got them, so the events of one charge arrive in order (barring faults
/// and retries). Events of other references go out beside them unless they
/// share the lane: a slow delivery holds back its lane, about one event in
/// `concurrency`. With one lane every event waits for the one before it.
struct Lanes {
    queues: Vec<UnboundedSender<Handed>>,
    tasks: JoinSet<()>,
}

impl Lanes {
    fn start(sender: &Sender, concurrency: usize, shutdown: &watch::Receiver<bool>) -> Self {
        let mut tasks = JoinSet::new();
        let queues = (0..concurrency.max(1))
            .map(|_| {
                let (queue, events) = mpsc::unbounded_channel();
                tasks.spawn(lane(sender.clone(), events, shutdown.clone()));
                queue
            })
            .collect();
        Self { queues, tasks }
    }

    /// The lane of a reference: the first 8 bytes of its SHA-256, so the
    /// same reference takes the same lane on every machine and toolchain
    /// (std's `DefaultHasher` may change between releases).
    fn lane_of(reference: &str, lanes: usize) -> usize {
        let digest = Sha256::digest(reference.as_bytes());
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        // The remainder is below `lanes`, a `usize`.
        (u64::from_be_bytes(first) % lanes as u64) as usize
    }

    fn send(&self, handed: Handed) {
        let lane = Self::lane_of(&handed.event.reference, self.queues.len());
        // A lane stops only at shutdown, after which nothing is sent.
        let _ = self.queues[lane].send(handed);
    }

    /// Waits for the lanes to stop: each finishes the delivery it is
    /// making, and drops its queue and retries.
    async fn stop(mut self) {
        self.queues.clear();
        while self.tasks.join_next().await.is_some() {}
    }
}

/// One lane: the first delivery of each of its events, in order, after its
/// `latency` if it drew one (the lane's later events wait behind it: every
/// later event, with one lane); failures go to retry tasks of its own so the
/// lane moves on. Stops at shutdown, dropping what it has not sent, as the
/// provider does.
async fn lane(
    sender: Sender,
    mut events: UnboundedReceiver<Handed>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut retries = JoinSet::new();
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            Some(_) = retries.join_next(), if !retries.is_empty() => {}
            next = events.recv() => match next {
                Some(handed) => {
                    if let Some(delay) = handed.latency {
                        // The delay models a slow provider-side queue
                        // rather than a reordering.
                        tokio::time::sleep(delay).await;
                    }
                    sender.deliver(handed.event, handed.fault, &mut retries).await;
                }
                None => break,
            },
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
