//! Bounded HTTP (issue "Hardening"), against real `cobro serve` processes on
//! both stores: the slow and silent connections an attacker opens are
//! closed within their bounds, a body that never arrives is a 408 that
//! stores nothing, a connection over the cap is closed at once, and
//! shutdown closes connections still sending headers while the running
//! request finishes.
//!
//! Sockets are raw TCP (`tokio::net::TcpStream`), so each test sends exactly
//! the bytes it means to. Every wait has a deadline: "closed within the
//! bound" is the bound plus [`SLACK`] for a busy 2-core machine.

use cobro_test_support::process::{Cobro, cobro_binary};
use cobro_test_support::{Backend, TestDb, on_both_backends, payment_body, wait_for};
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

on_both_backends!(
    slow_and_silent_connections_are_closed_within_their_bounds,
    a_connection_over_the_cap_is_closed_at_once_and_the_next_served,
    shutdown_closes_connections_sending_headers_and_finishes_running_requests,
);

/// What a closed connection may take beyond its bound (the watchdog ticks
/// every quarter of the shortest bound; the machine may be busy).
const SLACK: Duration = Duration::from_secs(3);

/// A fresh database with an account and a token, and `cobro serve` on it
/// (no worker, no provider) with `env`.
struct Served {
    db: TestDb,
    token: String,
    process: Cobro,
    address: String,
}

async fn serve(backend: Backend, env: &[(&str, &str)]) -> Served {
    let db = TestDb::new(backend).await;
    let (_, token) = db.new_account("merchant", chrono::Utc::now()).await;
    let mut command = Command::new(cobro_binary());
    for (name, _) in std::env::vars() {
        if name.starts_with("COBRO_") {
            command.env_remove(name);
        }
    }
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--no-worker"])
        .env("COBRO_DATABASE_URL", &db.url)
        .env("COBRO_LOG", "info")
        .env("COBRO_WEBHOOK_SECRET", "whsec_bounds_test_secret")
        .envs(env.iter().copied());
    let mut process = Cobro::spawn("cobro serve", command);
    let url = process.line("cobro listening on ").await;
    let address = url.trim_start_matches("http://").to_owned();
    Served {
        db,
        token,
        process,
        address,
    }
}

/// Reads until the peer closes; what it sent, and how long that took.
async fn until_closed(stream: &mut TcpStream, deadline: Duration) -> (Vec<u8>, Duration) {
    let started = Instant::now();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(
            deadline.saturating_sub(started.elapsed()),
            stream.read(&mut buf),
        )
        .await
        {
            Ok(Ok(0)) | Ok(Err(_)) => return (received, started.elapsed()),
            Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
            Err(_) => panic!(
                "still open after {deadline:?}; received {:?}",
                String::from_utf8_lossy(&received)
            ),
        }
    }
}

async fn connect(address: &str) -> TcpStream {
    TcpStream::connect(address).await.expect("connect")
}

async fn slow_and_silent_connections_are_closed_within_their_bounds(backend: Backend) {
    let (header, idle, request) = (
        Duration::from_secs(1),
        Duration::from_secs(2),
        Duration::from_secs(2),
    );
    let served = serve(
        backend,
        &[
            ("COBRO_HTTP_HEADER_TIMEOUT", "1s"),
            ("COBRO_HTTP_IDLE_TIMEOUT", "2s"),
            ("COBRO_HTTP_REQUEST_TIMEOUT", "2s"),
        ],
    )
    .await;
    let address = served.address.as_str();

    let silent = async {
        let mut stream = connect(address).await;
        until_closed(&mut stream, idle + SLACK).await
    };
    let partial_line = async {
        let mut stream = connect(address).await;
        stream.write_all(b"GET /heal").await.expect("write");
        until_closed(&mut stream, header + SLACK).await
    };
    // One header line every 300 ms, forever: each byte is "recent", but the
    // headers never end.
    let trickle = async {
        let mut stream = connect(address).await;
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("write");
        let started = Instant::now();
        let mut buf = [0u8; 64];
        loop {
            tokio::select! {
                read = stream.read(&mut buf) => {
                    assert!(matches!(read, Ok(0) | Err(_)), "no answer to unfinished headers");
                    return (Vec::new(), started.elapsed());
                }
                () = tokio::time::sleep(Duration::from_millis(300)) => {
                    assert!(started.elapsed() < header + SLACK, "the trickle is still being read");
                    if stream.write_all(b"X-Trickle: 1\r\n").await.is_err() {
                        return (Vec::new(), started.elapsed());
                    }
                }
            }
        }
    };
    let keep_alive = async {
        let mut stream = connect(address).await;
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        until_closed(&mut stream, idle + SLACK).await
    };
    let token = served.token.clone();
    let body_never_arrives = async {
        let mut stream = connect(address).await;
        let head = format!(
            "POST /v1/payments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
             Idempotency-Key: key-slow-body\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{{\"amo"
        );
        stream.write_all(head.as_bytes()).await.expect("write");
        until_closed(&mut stream, request + SLACK).await
    };
    let unsigned_webhook_body_never_arrives = async {
        let mut stream = connect(address).await;
        stream
            .write_all(b"POST /v1/webhooks/fake HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{")
            .await
            .expect("write");
        until_closed(&mut stream, request + SLACK).await
    };
    let (silent, partial_line, trickle, keep_alive, body, webhook) = tokio::join!(
        silent,
        partial_line,
        trickle,
        keep_alive,
        body_never_arrives,
        unsigned_webhook_body_never_arrives
    );
    for (name, (bytes, took), bound) in [
        ("silent", &silent, idle),
        ("partial request line", &partial_line, header),
        ("trickled headers", &trickle, header),
        ("idle keep-alive", &keep_alive, idle),
    ] {
        assert!(*took <= bound + SLACK, "{name}: closed after {took:?}");
        if name != "idle keep-alive" {
            assert!(
                bytes.is_empty(),
                "{name}: answered {:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }
    let answered = String::from_utf8_lossy(&keep_alive.0);
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
    for (name, (bytes, took)) in [("payment body", &body), ("webhook body", &webhook)] {
        let answer = String::from_utf8_lossy(bytes);
        assert!(answer.starts_with("HTTP/1.1 408"), "{name}: {answer}");
        assert!(answer.contains("request-timeout"), "{name}: {answer}");
        assert!(*took <= request + SLACK, "{name}: closed after {took:?}");
    }
    // Nothing was stored, and the key is free for the real request.
    assert_eq!(served.db.count("payments").await, 0);
    assert_eq!(served.db.count("idempotency_records").await, 0);
    assert_eq!(served.db.count("webhook_events").await, 0);
    let response = reqwest::Client::new()
        .post(format!("http://{address}/v1/payments"))
        .bearer_auth(&served.token)
        .header("idempotency-key", "key-slow-body")
        .json(&payment_body("ord-slow"))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status().as_u16(), 201);
    let metrics = reqwest::get(format!("http://{address}/metrics"))
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    for reason in ["idle_timeout", "header_timeout"] {
        let line = format!("cobro_http_connections_closed_total{{reason=\"{reason}\"}}");
        assert!(metrics.contains(&line), "{line} missing from /metrics");
    }
    drop(served.process);
}

async fn a_connection_over_the_cap_is_closed_at_once_and_the_next_served(backend: Backend) {
    let served = serve(
        backend,
        &[
            ("COBRO_HTTP_MAX_CONNECTIONS", "4"),
            ("COBRO_HTTP_IDLE_TIMEOUT", "120s"),
        ],
    )
    .await;
    let address = served.address.as_str();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut stream = connect(address).await;
        // Served (so counted) before the next one is opened.
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 256];
        let n = stream.read(&mut buf).await.expect("answer");
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(stream);
    }
    // The idle timeout is two minutes: a close now is the cap's.
    let mut fifth = connect(address).await;
    let _ = fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let (answer, _) = until_closed(&mut fifth, SLACK * 2).await;
    assert!(
        answer.is_empty(),
        "over the cap, no answer: {:?}",
        String::from_utf8_lossy(&answer)
    );
    // One slot freed: a new connection is served again.
    drop(held.pop());
    let body = wait_for("a new connection is served", SLACK * 3, async || {
        let mut stream = connect(address).await;
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let (answer, _) = until_closed(&mut stream, SLACK * 2).await;
        let text = String::from_utf8_lossy(&answer).into_owned();
        text.starts_with("HTTP/1.1 200").then_some(text)
    })
    .await;
    assert!(
        body.contains("cobro_http_connections_closed_total{reason=\"refused\"}"),
        "the refusal is counted"
    );
    drop(held);
}

async fn shutdown_closes_connections_sending_headers_and_finishes_running_requests(
    backend: Backend,
) {
    let mut served = serve(
        backend,
        &[
            ("COBRO_HTTP_HEADER_TIMEOUT", "60s"),
            ("COBRO_HTTP_IDLE_TIMEOUT", "60s"),
            ("COBRO_SHUTDOWN_GRACE", "30s"),
            ("COBRO_LOG", "info,cobro_api=debug"),
        ],
    )
    .await;
    let address = served.address.clone();
    let http = reqwest::Client::new();
    // No worker: the payment stays `processing`, so a long poll on it runs
    // for its whole wait.
    let created: Value = http
        .post(format!("http://{address}/v1/payments"))
        .bearer_auth(&served.token)
        .header("idempotency-key", "key-shutdown")
        .json(&payment_body("ord-shutdown"))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let id = created["id"].as_str().expect("id").to_owned();
    let mut sending_headers = connect(&address).await;
    sending_headers
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    let mut idle = connect(&address).await;
    let long_poll = tokio::spawn({
        let (http, token) = (http.clone(), served.token.clone());
        async move {
            http.get(format!("http://{address}/v1/payments/{id}?wait=3"))
                .bearer_auth(token)
                .send()
                .await
                .map(|r| r.status().as_u16())
        }
    });
    // Running once the server logs that it started it (cobro_api's debug
    // line "request started", with its route).
    wait_for("the long poll is running", SLACK * 2, async || {
        served
            .process
            .stderr()
            .iter()
            .any(|l| l.contains("request started") && l.contains("/v1/payments/{id}"))
            .then_some(())
    })
    .await;
    let stopping = Instant::now();
    served.process.sigterm();
    let (_, headers_closed) = until_closed(&mut sending_headers, SLACK * 2).await;
    let (_, idle_closed) = until_closed(&mut idle, SLACK * 2).await;
    assert!(
        headers_closed < SLACK && idle_closed < SLACK,
        "{headers_closed:?} {idle_closed:?}"
    );
    let status = long_poll
        .await
        .expect("join")
        .expect("the running request is answered");
    assert_eq!(status, 200);
    let exit = served
        .process
        .exit_within(Duration::from_secs(3) + SLACK * 2)
        .await;
    assert!(exit.success(), "{exit:?}");
    assert!(
        stopping.elapsed() < Duration::from_secs(30),
        "well inside the grace period"
    );
    assert!(
        served
            .process
            .stderr()
            .iter()
            .any(|l| l.contains("stopped") && l.contains("drained=true")),
        "{:?}",
        served.process.stderr()
    );
}
