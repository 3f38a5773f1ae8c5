//! Merchant endpoints by the hundred: each a real HTTP server (axum on
//! 127.0.0.1, a port of its own) that records every request it receives
//! (the event's payment and sequence, the signature headers, when it came
//! and whether it was answered) and answers as its [`Behaviour`] says.
//! Lighter than `tests/merchant.rs` (no inbox): the load test and the
//! delivery latency bench (`examples/delivery_latency.rs`) start hundreds.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How an endpoint answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    /// 200 at once.
    Healthy,
    /// 503, always.
    Failing,
    /// 200 after this pause.
    Slow(Duration),
    /// Never answers.
    Hang,
    /// 410 Gone.
    Gone,
}

/// One request an endpoint received.
#[derive(Clone, Debug)]
pub struct Request {
    pub event_id: String,
    pub payment_id: String,
    pub sequence: i64,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub arrived: Instant,
    /// When it answered 2xx (`None`: it did not, or not yet).
    pub acknowledged: Option<Instant>,
}

pub struct Endpoint {
    pub url: String,
    behaviour: Mutex<Behaviour>,
    /// Events (payment, sequence) always answered 503.
    failing: Mutex<HashSet<(String, i64)>>,
    received: Mutex<Vec<Request>>,
}

impl Endpoint {
    pub async fn start(behaviour: Behaviour) -> Arc<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let endpoint = Arc::new(Endpoint {
            url: format!("http://{addr}/events"),
            behaviour: Mutex::new(behaviour),
            failing: Mutex::default(),
            received: Mutex::default(),
        });
        let router = axum::Router::new()
            .route("/events", axum::routing::post(receive))
            .with_state(Arc::clone(&endpoint));
        tokio::spawn(async move {
            axum::serve(listener, router).await.ok();
        });
        endpoint
    }

    pub fn behaviour(&self) -> Behaviour {
        *self.behaviour.lock().expect("lock")
    }

    pub fn set(&self, behaviour: Behaviour) {
        *self.behaviour.lock().expect("lock") = behaviour;
    }

    /// The event `sequence` of `payment_id` is always answered 503.
    pub fn fail_event(&self, payment_id: &str, sequence: i64) {
        self.failing
            .lock()
            .expect("lock")
            .insert((payment_id.to_owned(), sequence));
    }

    /// Every request so far, in arrival order.
    pub fn received(&self) -> Vec<Request> {
        self.received.lock().expect("lock").clone()
    }

    /// The sequences received per payment, in arrival order.
    pub fn sequences(&self) -> BTreeMap<String, Vec<i64>> {
        let mut by_payment: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for r in self.received.lock().expect("lock").iter() {
            by_payment
                .entry(r.payment_id.clone())
                .or_default()
                .push(r.sequence);
        }
        by_payment
    }

    /// The distinct events acknowledged (answered 2xx).
    pub fn acknowledged(&self) -> BTreeSet<String> {
        self.received
            .lock()
            .expect("lock")
            .iter()
            .filter(|r| r.acknowledged.is_some())
            .map(|r| r.event_id.clone())
            .collect()
    }
}

async fn receive(
    State(endpoint): State<Arc<Endpoint>>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let arrived = Instant::now();
    let event: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let payment_id = event["payment_id"].as_str().unwrap_or_default().to_owned();
    let index = {
        let mut received = endpoint.received.lock().expect("lock");
        received.push(Request {
            event_id: event["id"].as_str().unwrap_or_default().to_owned(),
            payment_id: payment_id.clone(),
            sequence: event["sequence"].as_i64().unwrap_or(-1),
            headers,
            body,
            arrived,
            acknowledged: None,
        });
        received.len() - 1
    };
    let sequence = event["sequence"].as_i64().unwrap_or(-1);
    let fail = endpoint
        .failing
        .lock()
        .expect("lock")
        .contains(&(payment_id.clone(), sequence));
    if fail {
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    let status = match endpoint.behaviour() {
        Behaviour::Healthy => StatusCode::OK,
        Behaviour::Failing => StatusCode::SERVICE_UNAVAILABLE,
        Behaviour::Slow(pause) => {
            tokio::time::sleep(pause).await;
            StatusCode::OK
        }
        Behaviour::Hang => std::future::pending().await,
        Behaviour::Gone => StatusCode::GONE,
    };
    if status.is_success() {
        endpoint.received.lock().expect("lock")[index].acknowledged = Some(Instant::now());
    }
    status
}
