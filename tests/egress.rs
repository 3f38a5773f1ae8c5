//! Event endpoints that cannot reach inside (issue 48), on both backends:
//! with only a merchant token, an endpoint into cobro's own network
//! (loopback, the metadata service, private networks, localhost) is
//! refused with a 422 problem and no row; the operator's allow-list and
//! plain-http setting are honoured; and the dispatcher's client checks
//! again at connect time, so an endpoint whose name later resolves to
//! loopback (DNS rebinding), or one already stored, is never connected to.

use cobro_core::egress::EgressPolicy;
use cobro_test_support::{Backend, TestApp, local_endpoints, on_both_backends, payment_body};
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

on_both_backends!(
    an_endpoint_into_cobros_network_is_refused_with_a_problem_and_nothing_is_created,
    the_allow_list_and_plain_http_are_honoured_when_the_operator_gives_them,
    the_dispatcher_never_connects_to_a_loopback_endpoint_the_allow_list_does_not_name,
    a_merchant_cannot_choose_an_endpoint_secret_and_cobros_own_is_long,
);

/// Issue 48's URLs, each a way into cobro's network, and their kin.
const INSIDE: &[&str] = &[
    "http://127.0.0.1:8080/internal/admin",
    "http://169.254.169.254/latest/meta-data",
    "http://10.0.0.1:2375/containers/create",
    "http://localhost:6379/",
    "http://192.168.1.1/",
    "https://127.0.0.1:8080/internal/admin",
    "https://169.254.169.254/latest/meta-data",
    "https://10.0.0.1:2375/containers/create",
    "https://localhost:6379/",
    "https://192.168.1.1/",
    "https://172.16.0.1/",
    "https://100.64.0.1/",
    "https://0.0.0.0/",
    "https://198.18.0.1/",
    "https://203.0.113.1/",
    "https://hooks.localhost/",
    // Public, but plain http.
    "http://8.8.8.8/hook",
];

async fn register(app: &TestApp, url: &str) -> reqwest::Response {
    app.post("/v1/event_endpoints", None)
        .json(&json!({"url": url}))
        .send()
        .await
        .expect("send")
}

async fn an_endpoint_into_cobros_network_is_refused_with_a_problem_and_nothing_is_created(
    backend: Backend,
) {
    let mut app = TestApp::spawn(backend).await;
    // Production's settings: no allowances.
    app.serve_with(cobro_api::ApiSettings::default()).await;
    for url in INSIDE {
        let response = register(&app, url).await;
        assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY, "{url}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{url}"
        );
        let problem: Value = response.json().await.expect("json");
        assert_eq!(problem["code"], "endpoint-url-not-allowed", "{problem}");
        assert_eq!(problem["type"], "/problems/endpoint-url-not-allowed");
        assert_eq!(problem["status"], 422);
        assert_eq!(problem["errors"][0]["field"], "url", "{problem}");
        let reason = problem["errors"][0]["message"].as_str().expect("reason");
        assert!(
            reason.contains("https://")
                || reason.contains("localhost")
                || reason.contains("which endpoints may not reach"),
            "{url}: {reason}"
        );
    }
    assert_eq!(app.db.count("event_endpoints").await, 0, "nothing created");
    // A public address over https is a merchant's ordinary endpoint.
    let created = register(&app, "https://8.8.8.8/cobro").await;
    assert_eq!(created.status(), StatusCode::CREATED);
    assert_eq!(app.db.count("event_endpoints").await, 1);
}

async fn the_allow_list_and_plain_http_are_honoured_when_the_operator_gives_them(backend: Backend) {
    let mut app = TestApp::spawn(backend).await;
    app.serve_with(cobro_api::ApiSettings {
        event_endpoints: EgressPolicy {
            allow_http: true,
            allow: ["127.0.0.1/32", "10.1.0.0/16", "hooks.internal"]
                .iter()
                .map(|e| e.parse().expect("entry"))
                .collect(),
        },
        ..Default::default()
    })
    .await;
    for url in [
        "http://127.0.0.1:4242/hook",
        "http://10.1.2.3/hook",
        // Listed by name: not resolved, any address it has is allowed.
        "http://hooks.internal/cobro",
    ] {
        let response = register(&app, url).await;
        assert_eq!(response.status(), StatusCode::CREATED, "{url}");
    }
    for url in [
        "http://127.0.0.2:4242/hook",
        "http://10.2.0.1/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://localhost:4242/hook",
    ] {
        let response = register(&app, url).await;
        assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY, "{url}");
    }
    assert_eq!(app.db.count("event_endpoints").await, 3);
}

/// An HTTP server on 127.0.0.1 that counts the TCP connections it accepts
/// and answers 200 to every request; its URL's port.
async fn counting_endpoint() -> (u16, Arc<AtomicUsize>) {
    use axum::serve::ListenerExt;
    let connections = Arc::new(AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let counted = Arc::clone(&connections);
    let listener = listener.tap_io(move |_| {
        counted.fetch_add(1, Ordering::SeqCst);
    });
    let app = axum::Router::new().fallback(|| async { StatusCode::OK });
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    (port, connections)
}

/// Answers every name with 127.0.0.1, as a rebinding DNS server does once
/// the endpoint was registered.
fn rebinding_lookup() -> cobro_worker::egress::Lookup {
    Arc::new(|_name| Box::pin(async { Ok(vec![std::net::Ipv4Addr::LOCALHOST.into()]) }))
}

fn dispatcher(app: &TestApp, egress: EgressPolicy) -> cobro_worker::Dispatcher {
    cobro_worker::Dispatcher::with_lookup(
        app.db.store.clone(),
        Arc::new(app.clock.clone()),
        cobro_worker::DispatcherConfig {
            owner: "egress".to_owned(),
            request_timeout: std::time::Duration::from_secs(5),
            backoff_base: std::time::Duration::from_secs(1),
            backoff_cap: std::time::Duration::from_secs(1),
            egress,
            ..Default::default()
        },
        rebinding_lookup(),
    )
    .expect("dispatcher")
}

async fn the_dispatcher_never_connects_to_a_loopback_endpoint_the_allow_list_does_not_name(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let (port, connections) = counting_endpoint().await;
    // Stored as they would be after passing registration: a name that
    // resolved to a public address then (it resolves to loopback now), and
    // a literal registered before the rule existed.
    let now = cobro_core::Clock::now(&app.clock);
    for url in [
        format!("http://merchant.example:{port}/hook"),
        format!("http://127.0.0.1:{port}/hook"),
    ] {
        app.db
            .store
            .create_endpoint(
                app.account,
                &url,
                &cobro_api::events::new_secret(),
                &[],
                now,
            )
            .await
            .expect("endpoint");
    }
    let created = app
        .post("/v1/payments", Some("k-egress"))
        .json(&payment_body("o-egress"))
        .send()
        .await
        .expect("payment");
    assert_eq!(created.status(), StatusCode::CREATED);

    // Plain http allowed, no allow-list: neither endpoint is reached.
    let strict = EgressPolicy {
        allow_http: true,
        allow: Vec::new(),
    };
    let steps = dispatcher(&app, strict).run_once().await.expect("round");
    assert_eq!(steps.len(), 2, "one event, two endpoints");
    assert!(steps.iter().all(|s| !s.delivered && s.status.is_none()));
    assert_eq!(connections.load(Ordering::SeqCst), 0, "never connected");
    let errors: Vec<String> = {
        let mut errors = Vec::new();
        for n in 0..2 {
            errors.push(
                app.db
                    .scalar::<String>(&format!(
                        "SELECT last_error FROM event_deliveries ORDER BY endpoint_id LIMIT 1 OFFSET {n}"
                    ))
                    .await,
            );
        }
        errors
    };
    for error in &errors {
        assert!(
            error.starts_with("refused: ") && error.contains("loopback"),
            "{errors:?}"
        );
    }

    // The same deliveries, once 127.0.0.1 is allowed: both arrive.
    app.clock.advance(chrono::Duration::minutes(5));
    let steps = dispatcher(&app, local_endpoints())
        .run_once()
        .await
        .expect("round");
    assert_eq!(steps.len(), 2);
    assert!(steps.iter().all(|s| s.delivered), "{steps:?}");
    assert!(connections.load(Ordering::SeqCst) >= 1);
}

/// Endpoint secrets are cobro's to make (`cobro_api::events::new_secret`,
/// 70 bytes): a merchant sending one, weak or not, is refused and nothing
/// is created; the secret cobro answers with passes the minimum.
async fn a_merchant_cannot_choose_an_endpoint_secret_and_cobros_own_is_long(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    for secret in ["", "x", "whsec_0123456789abcdef0123456789"] {
        let response = app
            .post("/v1/event_endpoints", None)
            .json(&json!({"url": "http://127.0.0.1:9/hook", "secret": secret}))
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{secret:?}");
        let problem: Value = response.json().await.expect("json");
        assert_eq!(problem["code"], "validation-error");
        assert_eq!(problem["errors"][0]["field"], "secret", "{problem}");
    }
    assert_eq!(app.db.count("event_endpoints").await, 0);
    let created: Value = register(&app, "http://127.0.0.1:9/hook")
        .await
        .json()
        .await
        .expect("json");
    let secret = created["secret"].as_str().expect("secret");
    assert_eq!(cobro_core::signature::check_secret_length(secret), Ok(()));
    let rotated: Value = app
        .post(
            &format!(
                "/v1/event_endpoints/{}/rotate_secret",
                created["id"].as_str().expect("id")
            ),
            None,
        )
        .send()
        .await
        .expect("rotate")
        .json()
        .await
        .expect("json");
    let rotated = rotated["secret"].as_str().expect("secret");
    assert_eq!(cobro_core::signature::check_secret_length(rotated), Ok(()));
}
