//! Hostile input (issue "Hardening"): text PostgreSQL cannot store, header
//! tricks and forged webhooks get a clear 4xx and change nothing, on both
//! stores alike. Each test counts rows (and, for webhooks, the events
//! stored) before and after.

use cobro_test_support::{Backend, Rig, TestApp, create, on_both_backends, payment_body};
use reqwest::StatusCode;
use serde_json::{Value, json};

on_both_backends!(
    nul_in_any_text_field_is_400_and_leaves_the_key_free,
    a_signed_webhook_with_a_nul_is_400_and_stores_nothing,
    the_bearer_scheme_is_case_insensitive_and_401_carries_a_challenge,
    two_authorization_lines_are_refused,
    an_invalid_key_is_never_echoed_and_a_valid_one_is_in_the_problem,
    bare_keys_may_start_with_a_quote,
    forged_webhooks_are_rate_limited_and_the_signed_ones_still_pass,
    a_webhook_secret_rotation_refuses_no_delivery,
    what_the_fuzzer_found_stays_as_documented,
    repeated_query_parameters_and_unusable_endpoint_urls_are_problems,
);

/// Every row a refused request could have written.
async fn effects(app: &TestApp) -> [i64; 4] {
    [
        app.db.count("payments").await,
        app.db.count("attempts").await,
        app.db.count("idempotency_records").await,
        app.db.count("outbox").await,
    ]
}

async fn nul_in_any_text_field_is_400_and_leaves_the_key_free(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut cases: Vec<(Value, &str)> = Vec::new();
    for (field, value) in [
        ("order_ref", json!("ord-\u{0}1")),
        ("description", json!("tea\u{0}")),
        ("currency", json!("EU\u{0}")),
        ("payment_method", json!("pm_card_visa\u{0}")),
    ] {
        let mut body = payment_body("ord-nul");
        body[field] = value;
        cases.push((body, field));
    }
    let mut body = payment_body("ord-nul");
    body["metadata"] = json!({"note": "a\u{0}b"});
    cases.push((body, "metadata.note"));
    let mut body = payment_body("ord-nul");
    body["metadata"] = json!({"no\u{0}te": "ab"});
    cases.push((body, "metadata"));
    let before = effects(&app).await;
    for (body, field) in &cases {
        let response = create(&app, "key-nul", body).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{field}");
        let problem: Value = response.json().await.expect("json");
        assert_eq!(problem["code"], "validation-error", "{field}");
        assert!(
            problem["errors"]
                .as_array()
                .expect("errors")
                .iter()
                .any(|e| e["field"] == *field
                    && e["message"].as_str().is_some_and(|m| m.contains("U+0000"))),
            "{field}: {problem}"
        );
    }
    assert_eq!(effects(&app).await, before, "nothing was written");
    // The key was never taken: the corrected request executes.
    let response = create(&app, "key-nul", &payment_body("ord-nul")).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let payment: Value = response.json().await.expect("json");

    // A refund reason is text too.
    app.db
        .exec(&format!(
            "UPDATE payments SET status = 'captured', amount_captured = amount WHERE id = '{}'",
            payment["id"].as_str().expect("id")
        ))
        .await;
    let before = effects(&app).await;
    let refunds = app.db.count("refunds").await;
    let response = app
        .post(
            &format!(
                "/v1/payments/{}/refunds",
                payment["id"].as_str().expect("id")
            ),
            Some("key-refund-nul"),
        )
        .json(&json!({"amount": 100, "reason": "dup\u{0}licate"}))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(effects(&app).await, before);
    assert_eq!(app.db.count("refunds").await, refunds);
}

async fn a_signed_webhook_with_a_nul_is_400_and_stores_nothing(backend: Backend) {
    let mut rig = Rig::new(backend).await;
    rig.accept_webhooks("whsec_nul", false).await;
    let body = serde_json::to_vec(&json!({
        "id": "evt_\u{0}1", "type": "charge.captured", "created": "2026-11-30T12:00:00Z",
        "sequence": 1,
        "data": {"id": "ch_x", "object": "charge", "amount": 1999, "currency": "EUR",
                 "reference": "ord-1:authorize-v1", "status": "captured", "sequence": 1},
    }))
    .expect("json");
    let response = rig.post_fake_event("whsec_nul", body).await.expect("send");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let problem: Value = response.json().await.expect("json");
    assert_eq!(problem["errors"][0]["field"], "id", "{problem}");
    assert_eq!(rig.app.db.count("webhook_events").await, 0);
    assert!(
        rig.ledger().charges.is_empty(),
        "nothing reached the provider"
    );
}

async fn the_bearer_scheme_is_case_insensitive_and_401_carries_a_challenge(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        let response = app
            .client
            .get(format!("{}/v1/payments", app.url))
            .header("authorization", format!("{scheme} {}", app.token))
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), StatusCode::OK, "{scheme}");
    }
    // Missing, wrong token, wrong scheme: one answer, one challenge.
    let mut answers = Vec::new();
    for authorization in [
        None,
        Some("Bearer nope".to_owned()),
        Some(format!("Basic {}", app.token)),
    ] {
        let mut request = app.client.get(format!("{}/v1/payments", app.url));
        if let Some(value) = authorization {
            request = request.header("authorization", value);
        }
        let response = request.send().await.expect("send");
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        let challenge = response
            .headers()
            .get("www-authenticate")
            .expect("WWW-Authenticate")
            .to_str()
            .expect("ascii")
            .to_owned();
        let mut problem: Value = response.json().await.expect("json");
        problem
            .as_object_mut()
            .expect("object")
            .remove("request_id");
        answers.push((challenge, problem));
    }
    assert_eq!(answers[0].0, "Bearer realm=\"cobro\"");
    assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
}

async fn two_authorization_lines_are_refused(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let (_, other) = app.new_account("other").await;
    let before = effects(&app).await;
    let response = app
        .client
        .post(format!("{}/v1/payments", app.url))
        .header("authorization", format!("Bearer {}", app.token))
        .header("authorization", format!("Bearer {other}"))
        .header("idempotency-key", "key-two-auth")
        .json(&payment_body("ord-two-auth"))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let problem: Value = response.json().await.expect("json");
    assert_eq!(problem["errors"][0]["field"], "Authorization", "{problem}");
    assert_eq!(effects(&app).await, before);
}

async fn an_invalid_key_is_never_echoed_and_a_valid_one_is_in_the_problem(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let long = "k".repeat(10_000);
    for bad in [long.as_str(), "has space", "\"a b\""] {
        let response = create(&app, bad, &payment_body("ord-echo")).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert!(
            response.headers().get("idempotency-key").is_none(),
            "{bad:.20}"
        );
        let text = response.text().await.expect("body");
        assert!(!text.contains(bad), "the body echoes {bad:.20}");
        assert!(text.len() < 1_000, "a short body");
    }
    let response = create(&app, "key-echo", &payment_body("ord-echo")).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()["idempotency-key"], "key-echo");
    let response = create(&app, "key-echo", &payment_body("ord-other")).await;
    assert_eq!(response.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(response.headers()["idempotency-key"], "key-echo");
    let problem: Value = response.json().await.expect("json");
    assert_eq!(problem["code"], "idempotency-key-reused");
    assert_eq!(problem["idempotency_key"], "key-echo");
    assert_eq!(app.db.count("payments").await, 1);
}

async fn bare_keys_may_start_with_a_quote(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let first = create(&app, "\"half-quoted", &payment_body("ord-q1")).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let replay = create(&app, "\"half-quoted", &payment_body("ord-q1")).await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    // The structured-field string and the bare form are one key.
    let quoted = create(&app, "\"plain\"", &payment_body("ord-q2")).await;
    assert_eq!(quoted.status(), StatusCode::CREATED);
    let bare = create(&app, "plain", &payment_body("ord-q2")).await;
    assert_eq!(bare.headers()["idempotent-replayed"], "true");
    assert_eq!(app.db.count("payments").await, 2);
}

async fn forged_webhooks_are_rate_limited_and_the_signed_ones_still_pass(backend: Backend) {
    let mut rig = Rig::new(backend).await;
    rig.accept_webhooks("whsec_flood", false).await;
    let t = cobro_core::Clock::now(&rig.app.clock).timestamp();
    let post = |body: Vec<u8>, signature: String| {
        rig.app
            .client
            .post(format!("{}/v1/webhooks/fake", rig.app.url))
            .header("content-type", "application/json")
            .header(fake_provider::SIGNATURE_HEADER, signature)
            .body(body)
            .send()
    };
    let event = |id: &str| {
        serde_json::to_vec(&json!({
            "id": id, "type": "charge.something_else", "created": "2026-11-30T12:00:00Z",
            "sequence": 1,
            "data": {"id": "ch_x", "object": "charge", "amount": 1999, "currency": "EUR",
                     "reference": "ord-1:authorize-v1", "status": "captured", "sequence": 1},
        }))
        .expect("json")
    };
    let budget = cobro_api::REFUSED_SIGNATURE_BUDGET.burst as usize;
    let mut statuses = Vec::new();
    for i in 0..budget + 5 {
        let response = post(event(&format!("evt_forged_{i}")), format!("t={t},v1=00"))
            .await
            .expect("send");
        statuses.push(response.status().as_u16());
    }
    assert!(statuses[..budget].iter().all(|s| *s == 400), "{statuses:?}");
    assert!(statuses[budget..].iter().all(|s| *s == 429), "{statuses:?}");
    // The clock has not moved, so the budget is still spent; a genuine
    // delivery is not judged by it.
    let body = event("evt_genuine");
    let signed = fake_provider::sign("whsec_flood", t, &body);
    let response = post(body, signed).await.expect("send");
    let status = response.status();
    assert_eq!(
        status,
        StatusCode::OK,
        "{}",
        response.text().await.unwrap_or_default()
    );
    assert_eq!(
        rig.app.db.count("webhook_events").await,
        1,
        "only the genuine one"
    );
}

/// Schemathesis findings (ops/fuzz.sh), kept as ordinary tests: the
/// document and the handler agree on `metadata: null`, on currencies in any
/// case, and on what a cursor is.
async fn what_the_fuzzer_found_stays_as_documented(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut body = payment_body("ord-fuzz-1");
    body["metadata"] = Value::Null;
    body["currency"] = json!("eUr");
    let response = create(&app, "key-fuzz-1", &body).await;
    assert_eq!(
        response.status(),
        StatusCode::CREATED,
        "null metadata is absent metadata"
    );
    let payment: Value = response.json().await.expect("json");
    assert_eq!(payment["currency"], "EUR");
    let mut body = payment_body("ord-fuzz-2");
    body["currency"] = json!("AAA");
    let response = create(&app, "key-fuzz-2", &body).await;
    assert_eq!(
        response.status(),
        StatusCode::BAD_REQUEST,
        "not a currency cobro knows"
    );
    let response = app
        .get("/v1/payments?cursor=not-a-cursor")
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(app.db.count("payments").await, 1);
}

/// More schemathesis findings: a repeated query parameter was axum's plain
/// text 400, and an endpoint URL the document allowed (`""`) was refused.
/// Now every query rejection is a problem, and the URL grammar is the
/// document's (no IPv6 literal, user, query or fragment).
async fn repeated_query_parameters_and_unusable_endpoint_urls_are_problems(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    for path in [
        "/v1/payments?status=captured&status=failed",
        "/v1/events?type=a&type=b",
        "/v1/payments?order_ref=ord%00x",
        "/v1/events?object=%00",
    ] {
        let response = app.get(path).send().await.expect("send");
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{path}"
        );
        let problem: Value = response.json().await.expect("json");
        assert_eq!(problem["errors"][0]["field"], "query", "{path}: {problem}");
    }
    for url in [
        "",
        "https://127.0.0.256/hook",
        "https://[::1]/",
        "https://shop.example/?secret=1",
        "https://u:p@shop.example/",
    ] {
        let response = app
            .client
            .post(format!("{}/v1/event_endpoints", app.url))
            .bearer_auth(&app.token)
            .json(&json!({"url": url}))
            .send()
            .await
            .expect("send");
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{url}");
    }
    assert_eq!(app.db.count("event_endpoints").await, 0);
    let response = app
        .client
        .post(format!("{}/v1/event_endpoints", app.url))
        .bearer_auth(&app.token)
        // Allowed by the test app's egress allowances (`local_endpoints`).
        .json(&json!({"url": "http://127.0.0.1:9/cobro"}))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(app.db.count("event_endpoints").await, 1);
}

/// ops/RUNBOOK.md's rotation: with the new secret current and the old one
/// as `COBRO_WEBHOOK_SECRET_PREVIOUS`, deliveries signed with either are
/// stored; any other secret is still refused.
async fn a_webhook_secret_rotation_refuses_no_delivery(backend: Backend) {
    let mut rig = Rig::new(backend).await;
    rig.accept_webhooks("whsec_old", false).await;
    let mut settings = cobro_api::ApiSettings::default();
    let receiver = cobro_api::WebhookReceiver {
        previous: Some(cobro_provider::WebhookSecret::new("whsec_old")),
        ..cobro_api::WebhookReceiver::fake(cobro_provider::WebhookSecret::new("whsec_new"))
    };
    settings.webhooks.insert("fake".into(), receiver);
    rig.app.serve_with(settings).await;
    let mut statuses = Vec::new();
    for (id, secret) in [
        ("evt_old", "whsec_old"),
        ("evt_new", "whsec_new"),
        ("evt_other", "whsec_other"),
    ] {
        let body = serde_json::to_vec(&json!({
            "id": id, "type": "charge.something_else", "created": "2026-11-30T12:00:00Z",
            "sequence": 1,
            "data": {"id": "ch_x", "object": "charge", "amount": 1999, "currency": "EUR",
                     "reference": "ord-1:authorize-v1", "status": "captured", "sequence": 1},
        }))
        .expect("json");
        let response = rig.post_fake_event(secret, body).await.expect("send");
        statuses.push(response.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 400]);
    assert_eq!(rig.app.db.count("webhook_events").await, 2);
}
