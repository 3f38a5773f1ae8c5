//! The event delivery bench (ops/bench/delivery.sh runs it): the load
//! test's setup (`tests/delivery.rs`) with the service's default
//! dispatcher settings, measured. `ENDPOINTS` endpoints of one account
//! (every fifth one failing with 503, slow by 300 ms, or hanging), two
//! dispatchers (as two processes would run), and `PAYMENTS` payments
//! created at `RATE` per second; each writes one event (`payment.created`)
//! to every endpoint. It prints, for the healthy endpoints, the latency
//! from the event written (taken as the start of the POST that writes it,
//! so an upper bound) to the endpoint's 2xx, as median, p99 and max.
//!
//! `STORE`: `sqlite` (default) or `postgres` (then `COBRO_TEST_PG_URL`,
//! as `ops/throwaway-postgres.sh` sets it). A benchmark, not a test: it
//! asserts no speed.

use cobro_test_support::fleet::{Behaviour, Endpoint};
use cobro_test_support::{Backend, Rig, payment_body};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let backend = match std::env::var("STORE").as_deref() {
        Ok("postgres") => Backend::Postgres,
        _ => Backend::Sqlite,
    };
    let (endpoints, payments, rate) = (
        setting("ENDPOINTS", 200),
        setting("PAYMENTS", 60),
        setting("RATE", 2).max(1),
    );
    let rig = Rig::new(backend).await;
    let mut fleet = Vec::new();
    for i in 0..endpoints {
        let behaviour = match (i % 5, (i / 5) % 3) {
            (0, 0) => Behaviour::Failing,
            (0, 1) => Behaviour::Slow(Duration::from_millis(300)),
            (0, _) => Behaviour::Hang,
            _ => Behaviour::Healthy,
        };
        let endpoint = Endpoint::start(behaviour).await;
        let r = rig
            .app
            .post("/v1/event_endpoints", None)
            .json(&serde_json::json!({"url": endpoint.url}))
            .send()
            .await
            .expect("create endpoint");
        assert_eq!(r.status().as_u16(), 201);
        fleet.push(endpoint);
    }
    // cobro's clock follows real time, so retries come due as they would.
    let clock = rig.app.clock.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            tick.tick().await;
            clock.advance(chrono::Duration::milliseconds(50));
        }
    });
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    for name in ["bench-d-1", "bench-d-2"] {
        // The service's defaults (services/cobro/src/settings.rs), with
        // the lease it derives and endpoints on 127.0.0.1 allowed.
        let config = cobro_worker::DispatcherConfig {
            owner: name.to_owned(),
            request_timeout: Duration::from_secs(10),
            lease: Duration::from_secs(20),
            poll_interval: Duration::from_secs(1),
            backoff_base: Duration::from_secs(5),
            egress: cobro_test_support::local_endpoints(),
            ..Default::default()
        };
        let dispatcher = cobro_worker::Dispatcher::new(
            rig.app.db.store.clone(),
            Arc::new(rig.app.clock.clone()),
            config,
        )
        .expect("dispatcher");
        tokio::spawn(Arc::new(dispatcher).run(stopped.clone()));
    }

    let began = Instant::now();
    let mut written: HashMap<String, Instant> = HashMap::new();
    let mut pace = tokio::time::interval(Duration::from_millis(1000 / rate));
    for i in 0..payments {
        pace.tick().await;
        let start = Instant::now();
        let p = rig
            .create_payment(&format!("k-{i}"), &payment_body(&format!("o-{i}")))
            .await;
        written.insert(p["id"].as_str().expect("id").to_owned(), start);
    }
    let healthy: Vec<&Arc<Endpoint>> = fleet
        .iter()
        .filter(|e| e.behaviour() == Behaviour::Healthy)
        .collect();
    let expected = healthy.len() * written.len();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let acknowledged: usize = healthy.iter().map(|e| e.acknowledged().len()).sum();
        if acknowledged >= expected || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut latencies: Vec<Duration> = Vec::new();
    for endpoint in &healthy {
        for r in endpoint.received() {
            if let (Some(ack), Some(start)) = (r.acknowledged, written.get(&r.payment_id)) {
                latencies.push(ack.duration_since(*start));
            }
        }
    }
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q).ceil() as usize).saturating_sub(1)];
    println!(
        "store={backend:?} endpoints={endpoints} (healthy {}) payments={payments} rate={rate}/s \
         deliveries to healthy endpoints={} of {expected} in {:.1} s",
        healthy.len(),
        latencies.len(),
        began.elapsed().as_secs_f64()
    );
    if latencies.is_empty() {
        println!("nothing was delivered");
        return;
    }
    println!(
        "written -> acknowledged: median {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        at(0.5).as_secs_f64() * 1000.0,
        at(0.99).as_secs_f64() * 1000.0,
        latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    );
}
