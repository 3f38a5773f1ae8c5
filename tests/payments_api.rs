//! The payments API contract (docs/http-api.md), on both backends, through a
//! real HTTP server. Effects are counted in the database: payments, attempts
//! and outbox rows (provider calls belong to the worker).

use chrono::Duration;
use cobro_test_support::{Backend, TestApp, create, on_both_backends, payment_body};
use reqwest::StatusCode;
use serde_json::{Value, json};
use std::collections::HashSet;

on_both_backends!(
    same_key_and_body_replays_the_stored_answer_byte_for_byte,
    same_key_with_a_different_body_is_422_and_changes_nothing,
    the_structured_field_form_of_a_key_is_the_same_key,
    a_missing_or_invalid_key_is_400_and_nothing_is_stored,
    requests_without_a_valid_token_are_401_and_change_nothing,
    revoked_and_expired_tokens_are_401_and_change_nothing,
    invalid_bodies_list_every_field_and_leave_the_key_free,
    a_body_over_16_kib_is_413,
    a_second_active_payment_for_an_order_is_422_and_not_stored_against_the_key,
    the_same_key_under_two_accounts_is_two_payments_neither_visible_to_the_other,
    capture_of_a_payment_that_is_not_authorized_is_a_stored_422,
    capture_of_an_authorized_payment_enqueues_a_capture_attempt,
    cancel_while_the_authorisation_is_unknown_is_recorded_not_executed,
    cancel_of_an_automatic_capture_payment_is_refused,
    concurrent_refunds_with_different_keys_never_exceed_the_captured_amount,
    concurrent_requests_with_one_key_make_one_payment,
    concurrent_requests_for_one_order_with_different_keys_make_one_payment,
    tombstones_replay_the_current_resource_and_expire_into_a_new_key,
    list_is_newest_first_with_cursor_pagination,
    get_waits_for_nothing_once_the_payment_left_processing,
    over_the_rate_limit_is_429_and_leaves_the_key_free,
    without_a_database_answers_are_503_and_readyz_fails,
    a_write_transaction_held_elsewhere_is_waited_for_within_the_lock_timeout,
    a_sane_request_id_is_kept_and_any_other_replaced,
);

async fn json_of(response: reqwest::Response) -> Value {
    response.json().await.expect("json body")
}

fn header<'a>(r: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    r.headers().get(name).and_then(|v| v.to_str().ok())
}

async fn assert_problem(r: reqwest::Response, status: u16, code: &str) -> Value {
    assert_eq!(r.status().as_u16(), status, "status for {code}");
    assert_eq!(header(&r, "content-type"), Some("application/problem+json"));
    let body = json_of(r).await;
    assert_eq!(body["code"], json!(code));
    assert_eq!(body["type"], json!(format!("/problems/{code}")));
    assert_eq!(body["status"], json!(status));
    assert!(
        body["request_id"].is_string(),
        "problem carries the request id: {body}"
    );
    body
}

/// Counts (payments, attempts, outbox rows): the effects of the API.
async fn effects(app: &TestApp) -> (i64, i64, i64) {
    (
        app.db.count("payments").await,
        app.db.count("attempts").await,
        app.db.count("outbox").await,
    )
}

async fn set_status(app: &TestApp, payment_id: &str, status: &str) {
    app.db
        .exec(&format!(
            "UPDATE payments SET status = '{status}', amount_captured = CASE WHEN '{status}' = 'captured' THEN amount ELSE 0 END WHERE id = '{payment_id}'"
        ))
        .await;
}

async fn same_key_and_body_replays_the_stored_answer_byte_for_byte(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let first = create(&app, "k-1", &payment_body("pedido-842")).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert_eq!(header(&first, "idempotent-replayed"), Some("false"));
    assert_eq!(header(&first, "idempotency-key"), Some("k-1"));
    let location = header(&first, "location").expect("location").to_owned();
    let first_bytes = first.bytes().await.expect("body");
    let payment: Value = serde_json::from_slice(&first_bytes).expect("json");
    assert_eq!(payment["status"], "processing");
    assert_eq!(payment["intent"], "pedido-842:authorize-v1");
    assert_eq!(
        location,
        format!("/v1/payments/{}", payment["id"].as_str().expect("id"))
    );
    assert_eq!(payment["attempts"][0]["state"], "pending");
    assert!(
        payment["attempts"][0].get("provider_key").is_none(),
        "the provider key is never shown"
    );
    assert!(
        !payment.to_string().contains("pm_card_visa"),
        "the payment method is not echoed"
    );

    // The same request again, with different transport headers and JSON spelling.
    let respelled = r#"{ "payment_method":"pm_card_visa" , "currency":"eur", "amount":1999, "order_ref":"pedido-842" }"#;
    let again = app
        .post("/v1/payments", Some("k-1"))
        .header("user-agent", "another-sdk/2.0")
        .header("x-request-id", "retry-1")
        .body(respelled)
        .send()
        .await
        .expect("send");
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(header(&again, "idempotency-key"), Some("k-1"));
    assert_eq!(header(&again, "location"), Some(location.as_str()));
    assert_eq!(
        again.bytes().await.expect("body"),
        first_bytes,
        "byte for byte"
    );
    assert_eq!(
        effects(&app).await,
        (1, 1, 1),
        "one payment, one attempt, one outbox row"
    );
}

async fn same_key_with_a_different_body_is_422_and_changes_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    assert_eq!(
        create(&app, "k-1", &payment_body("o-1")).await.status(),
        StatusCode::CREATED
    );
    let mut changed = payment_body("o-1");
    changed["amount"] = json!(2000);
    let r = create(&app, "k-1", &changed).await;
    assert_eq!(header(&r, "idempotency-key"), Some("k-1"));
    assert_problem(r, 422, "idempotency-key-reused").await;
    // A different operation default counts as a different request too.
    let mut manual = payment_body("o-1");
    manual["capture_method"] = json!("manual");
    assert_problem(
        create(&app, "k-1", &manual).await,
        422,
        "idempotency-key-reused",
    )
    .await;
    assert_eq!(effects(&app).await, (1, 1, 1));
    let listed = json_of(app.get("/v1/payments").send().await.expect("list")).await;
    assert_eq!(
        listed["data"][0]["amount"], 1999,
        "the stored payment is unchanged"
    );
}

async fn the_structured_field_form_of_a_key_is_the_same_key(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let bare = create(&app, "abc-123", &payment_body("o-1")).await;
    let bare_body = bare.bytes().await.expect("body");
    let quoted = create(&app, "\"abc-123\"", &payment_body("o-1")).await;
    assert_eq!(header(&quoted, "idempotent-replayed"), Some("true"));
    assert_eq!(quoted.bytes().await.expect("body"), bare_body);
    assert_eq!(effects(&app).await, (1, 1, 1));
}

async fn a_missing_or_invalid_key_is_400_and_nothing_is_stored(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let missing = app
        .post("/v1/payments", None)
        .json(&payment_body("o-1"))
        .send()
        .await
        .expect("send");
    assert_problem(missing, 400, "idempotency-key-missing").await;
    // (`"unterminated` is a valid bare key: docs/http-api.md §3.)
    for bad in ["has space", &"x".repeat(256), "\"quoted space\""] {
        let r = create(&app, bad, &payment_body("o-1")).await;
        assert_problem(r, 400, "idempotency-key-invalid").await;
    }
    let two_lines = app
        .post("/v1/payments", Some("k-a"))
        .header("idempotency-key", "k-b")
        .json(&payment_body("o-1"))
        .send()
        .await
        .expect("send");
    assert_problem(two_lines, 400, "idempotency-key-invalid").await;
    assert_eq!(effects(&app).await, (0, 0, 0));
    assert_eq!(app.db.count("idempotency_records").await, 0);
}

async fn requests_without_a_valid_token_are_401_and_change_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let created = json_of(create(&app, "k-1", &payment_body("o-1")).await).await;
    let id = created["id"].as_str().expect("id");
    let no_token = app
        .client
        .post(format!("{}/v1/payments", app.url))
        .header("idempotency-key", "k-2")
        .json(&payment_body("o-2"))
        .send()
        .await
        .expect("send");
    assert_problem(no_token, 401, "unauthenticated").await;
    let wrong = app
        .post_as("not-a-token", "/v1/payments", Some("k-2"))
        .json(&payment_body("o-2"))
        .send()
        .await
        .expect("send");
    assert_problem(wrong, 401, "unauthenticated").await;
    // The same answer whether or not the payment exists.
    for path in [
        format!("/v1/payments/{id}"),
        format!("/v1/payments/{}", uuid::Uuid::now_v7()),
    ] {
        let r = app
            .client
            .get(format!("{}{path}", app.url))
            .bearer_auth("nope")
            .send()
            .await
            .expect("send");
        assert_problem(r, 401, "unauthenticated").await;
    }
    // A replay re-authenticates.
    let replay_wrong = app
        .post_as("nope", "/v1/payments", Some("k-1"))
        .json(&payment_body("o-1"))
        .send()
        .await
        .expect("send");
    assert_problem(replay_wrong, 401, "unauthenticated").await;
    assert_eq!(effects(&app).await, (1, 1, 1));
    // Health needs no token.
    let health = app
        .client
        .get(format!("{}/healthz", app.url))
        .send()
        .await
        .expect("send");
    assert_eq!(health.status(), StatusCode::OK);
}

async fn revoked_and_expired_tokens_are_401_and_change_nothing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    // Expiry is judged on the API's injected clock: a token expiring in an
    // hour is live now and refused once the clock has moved two hours.
    let now = cobro_core::Clock::now(&app.clock);
    let store = &app.db.store;
    let mut tokens = Vec::new();
    for (label, expires) in [
        ("expiring", now + Duration::hours(1)),
        ("live", now + Duration::days(1)),
    ] {
        let token = format!("test_{label}_{}", uuid::Uuid::new_v4().simple());
        let row = cobro_store::accounts::NewTokenRow {
            label,
            token_hash: &cobro_api::token_hash(&token),
            prefix: "",
            expires_at: Some(expires),
        };
        store
            .create_token_expiring(app.account, &row, now - Duration::hours(2))
            .await
            .expect("token");
        tokens.push(token);
    }
    let (expired, live) = (&tokens[0], &tokens[1]);
    let get = |token: &str| {
        app.client
            .get(format!("{}/v1/payments", app.url))
            .bearer_auth(token)
            .send()
    };
    assert_eq!(
        get(expired).await.expect("send").status(),
        StatusCode::OK,
        "not yet expired"
    );
    app.clock.advance(Duration::hours(2));
    let now = cobro_core::Clock::now(&app.clock);
    assert_eq!(get(live).await.expect("send").status(), StatusCode::OK);
    assert_eq!(
        get(&app.token).await.expect("send").status(),
        StatusCode::OK
    );
    assert_problem(get(expired).await.expect("send"), 401, "unauthenticated").await;
    let created = app
        .post_as(expired, "/v1/payments", Some("k-expired"))
        .json(&payment_body("o-1"))
        .send()
        .await
        .expect("send");
    assert_problem(created, 401, "unauthenticated").await;

    // Revoke the app's own token (as `cobro tokens revoke` does).
    let listed = store.list_tokens(Some(app.account)).await.expect("list");
    let own = listed
        .iter()
        .find(|t| t.label == "test")
        .expect("the app's token");
    assert!(store.revoke_token(own.id, now).await.expect("revoke"));
    // The token was read within the API's token cache bound (it has just
    // been used): it is still accepted until that bound has passed on the
    // API's clock, and refused from then on, by every route.
    assert_eq!(
        get(&app.token).await.expect("send").status(),
        StatusCode::OK,
        "remembered for at most the cache's bound"
    );
    let bound = cobro_api::ApiSettings::default().token_cache_ttl;
    app.clock
        .advance(Duration::from_std(bound).expect("a bound in range"));
    assert_problem(get(&app.token).await.expect("send"), 401, "unauthenticated").await;
    let created = app
        .post("/v1/payments", Some("k-revoked"))
        .json(&payment_body("o-1"))
        .send()
        .await
        .expect("send");
    assert_problem(created, 401, "unauthenticated").await;
    assert_eq!(get(live).await.expect("send").status(), StatusCode::OK);
    assert_eq!(effects(&app).await, (0, 0, 0), "nothing was created");
    assert_eq!(app.db.count("idempotency_records").await, 0);
}

async fn invalid_bodies_list_every_field_and_leave_the_key_free(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let bad = json!({
        "order_ref": "has space", "amount": 10.5, "currency": "XYZ",
        "payment_method": "", "capture_method": "later", "surprise": true,
        "metadata": {"k": 1},
    });
    let body = assert_problem(create(&app, "k-1", &bad).await, 400, "validation-error").await;
    let fields: HashSet<String> = body["errors"]
        .as_array()
        .expect("errors")
        .iter()
        .map(|e| e["field"].as_str().expect("field").to_owned())
        .collect();
    for f in [
        "order_ref",
        "amount",
        "currency",
        "payment_method",
        "capture_method",
        "surprise",
        "metadata.k",
    ] {
        assert!(fields.contains(f), "{f} is reported: {body}");
    }
    for (amount, ok) in [
        (json!(0), false),
        (json!(1e1), false),
        (json!(99_999_999_999i64), true),
        (json!(100_000_000_000i64), false),
    ] {
        let mut b = payment_body("o-amounts");
        b["amount"] = amount.clone();
        let r = create(&app, &format!("amount-{amount}"), &b).await;
        assert_eq!(r.status().is_success(), ok, "amount {amount}");
        if ok {
            set_status(&app, json_of(r).await["id"].as_str().expect("id"), "failed").await;
        }
    }
    let not_json = app
        .post("/v1/payments", Some("k-1"))
        .body("{nope")
        .send()
        .await
        .expect("send");
    assert_problem(not_json, 400, "validation-error").await;
    // The key was not used up by the invalid attempts.
    assert_eq!(
        create(&app, "k-1", &payment_body("o-1")).await.status(),
        StatusCode::CREATED
    );
    assert_eq!(app.db.count("payments WHERE order_ref = 'o-1'").await, 1);
}

async fn a_body_over_16_kib_is_413(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut body = payment_body("o-1");
    body["description"] = json!("x".repeat(17 * 1024));
    assert_problem(create(&app, "k-1", &body).await, 413, "body-too-large").await;
    assert_eq!(effects(&app).await, (0, 0, 0));
}

async fn a_second_active_payment_for_an_order_is_422_and_not_stored_against_the_key(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let first = json_of(create(&app, "k-1", &payment_body("pedido-842")).await).await;
    let first_id = first["id"].as_str().expect("id").to_owned();
    // This transaction fails midway (after the key is reserved): it must
    // leave nothing behind.
    let second = create(&app, "k-2", &payment_body("pedido-842")).await;
    let problem = assert_problem(second, 422, "order-has-active-payment").await;
    assert_eq!(problem["payment_id"], json!(first_id));
    assert_eq!(effects(&app).await, (1, 1, 1));
    assert_eq!(
        app.db.count("idempotency_records").await,
        1,
        "k-2 is not stored"
    );

    // Once the first payment is declined, the same key k-2 creates v2.
    set_status(&app, &first_id, "declined").await;
    let retried = create(&app, "k-2", &payment_body("pedido-842")).await;
    assert_eq!(retried.status(), StatusCode::CREATED);
    assert_eq!(json_of(retried).await["intent"], "pedido-842:authorize-v2");
    assert_eq!(effects(&app).await, (2, 2, 2));
}

async fn the_same_key_under_two_accounts_is_two_payments_neither_visible_to_the_other(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let (_, other_token) = app.new_account("other").await;
    let mine = json_of(create(&app, "shared-key", &payment_body("o-1")).await).await;
    let theirs_r = app
        .post_as(&other_token, "/v1/payments", Some("shared-key"))
        .json(&payment_body("o-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(theirs_r.status(), StatusCode::CREATED);
    assert_eq!(header(&theirs_r, "idempotent-replayed"), Some("false"));
    let theirs = json_of(theirs_r).await;
    assert_ne!(mine["id"], theirs["id"]);
    assert_eq!(effects(&app).await, (2, 2, 2));
    // Neither can read, capture or refund the other's payment: 404 like a missing one.
    let their_id = theirs["id"].as_str().expect("id");
    assert_problem(
        app.get(&format!("/v1/payments/{their_id}"))
            .send()
            .await
            .expect("get"),
        404,
        "not-found",
    )
    .await;
    let capture = app
        .post(&format!("/v1/payments/{their_id}/capture"), Some("c-1"))
        .send()
        .await
        .expect("send");
    assert_problem(capture, 404, "not-found").await;
    let listed = json_of(app.get("/v1/payments").send().await.expect("list")).await;
    assert_eq!(listed["data"].as_array().expect("data").len(), 1);
}

async fn capture_of_a_payment_that_is_not_authorized_is_a_stored_422(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let p = json_of(create(&app, "k-1", &payment_body("o-1")).await).await;
    let path = format!("/v1/payments/{}/capture", p["id"].as_str().expect("id"));
    let first = app.post(&path, Some("cap-1")).send().await.expect("send");
    assert_eq!(header(&first, "idempotent-replayed"), Some("false"));
    let first_body = assert_problem(first, 422, "payment-not-capturable").await;
    // Final and stored: the same key answers the same, even after the state changed.
    set_status(&app, p["id"].as_str().expect("id"), "authorized").await;
    let again = app.post(&path, Some("cap-1")).send().await.expect("send");
    assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(json_of(again).await, first_body);
    assert_eq!(
        effects(&app).await,
        (1, 1, 1),
        "no capture attempt was made"
    );
}

async fn capture_of_an_authorized_payment_enqueues_a_capture_attempt(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut body = payment_body("o-1");
    body["capture_method"] = json!("manual");
    let p = json_of(create(&app, "k-1", &body).await).await;
    let id = p["id"].as_str().expect("id");
    set_status(&app, id, "authorized").await;
    let path = format!("/v1/payments/{id}/capture");
    let r = app.post(&path, Some("cap-1")).send().await.expect("send");
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    assert_eq!(json_of(r).await["status"], "capturing");
    let replay = app.post(&path, Some("cap-1")).send().await.expect("send");
    assert_eq!(replay.status(), StatusCode::ACCEPTED);
    assert_eq!(header(&replay, "idempotent-replayed"), Some("true"));
    // A second capture with a new key finds the payment capturing: refused.
    let other = app.post(&path, Some("cap-2")).send().await.expect("send");
    assert_problem(other, 422, "payment-not-capturable").await;
    assert_eq!(effects(&app).await, (1, 2, 2));
    assert_eq!(
        app.db.count("intents WHERE name = 'o-1:capture-v1'").await,
        1
    );
}

async fn cancel_while_the_authorisation_is_unknown_is_recorded_not_executed(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut body = payment_body("o-1");
    body["capture_method"] = json!("manual");
    let p = json_of(create(&app, "k-1", &body).await).await;
    let id = p["id"].as_str().expect("id");
    let r = app
        .post(&format!("/v1/payments/{id}/cancel"), Some("cancel-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let view = json_of(r).await;
    assert_eq!(
        view["status"], "processing",
        "nothing is decided before the outcome is known"
    );
    assert_eq!(view["cancel_requested"], true);
    // The cancel is an intent of its own whose attempt is held: its
    // provider key is stored, but it has no outbox row, so nothing is sent.
    assert_eq!(
        effects(&app).await,
        (1, 2, 1),
        "no void is sendable before the authorisation is known"
    );
    assert_eq!(app.db.count("attempts WHERE state = 'held'").await, 1);
    // Asked again with another key: still one cancel intent.
    let again = app
        .post(&format!("/v1/payments/{id}/cancel"), Some("cancel-1b"))
        .send()
        .await
        .expect("send");
    assert_eq!(again.status(), StatusCode::ACCEPTED);
    assert_eq!(
        app.db
            .count("intents WHERE operation = 'payment.cancel'")
            .await,
        1
    );

    // Once authorized, a cancel voids.
    set_status(&app, id, "authorized").await;
    let r = app
        .post(&format!("/v1/payments/{id}/cancel"), Some("cancel-2"))
        .send()
        .await
        .expect("send");
    assert_eq!(json_of(r).await["status"], "canceling");
    assert_eq!(effects(&app).await, (1, 2, 2));
}

async fn cancel_of_an_automatic_capture_payment_is_refused(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let p = json_of(create(&app, "k-1", &payment_body("o-1")).await).await;
    let r = app
        .post(
            &format!("/v1/payments/{}/cancel", p["id"].as_str().expect("id")),
            Some("c-1"),
        )
        .send()
        .await
        .expect("send");
    assert_problem(r, 422, "payment-not-cancelable").await;
    assert_eq!(effects(&app).await, (1, 1, 1));
}

async fn concurrent_refunds_with_different_keys_never_exceed_the_captured_amount(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut body = payment_body("o-1");
    body["amount"] = json!(1000);
    let p = json_of(create(&app, "k-1", &body).await).await;
    let id = p["id"].as_str().expect("id").to_owned();
    let not_yet = app
        .post(&format!("/v1/payments/{id}/refunds"), Some("r-0"))
        .json(&json!({"amount": 100}))
        .send()
        .await
        .expect("send");
    assert_problem(not_yet, 422, "payment-not-refundable").await;
    set_status(&app, &id, "captured").await;

    let requests = (0..10).map(|i| {
        app.post(
            &format!("/v1/payments/{id}/refunds"),
            Some(&format!("r-{}", i + 1)),
        )
        .json(&json!({"amount": 300}))
        .send()
    });
    let answers = futures::future::join_all(requests).await;
    let mut created = 0;
    for r in answers {
        let r = r.expect("send");
        match r.status().as_u16() {
            201 => created += 1,
            422 => {
                assert_problem(r, 422, "refund-exceeds-captured").await;
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(created, 3, "3 x 300 fit in 1000, a fourth does not");
    assert_eq!(app.db.count("refunds").await, 3);
    assert_eq!(
        app.db
            .count("payments WHERE amount_refund_reserved = 900")
            .await,
        1
    );
    assert_eq!(
        app.db
            .count("attempts WHERE operation = 'refund.create'")
            .await,
        3
    );
    let intents = app
        .db
        .count("intents WHERE name IN ('o-1:refund-v1', 'o-1:refund-v2', 'o-1:refund-v3')")
        .await;
    assert_eq!(
        intents, 3,
        "refund intents are numbered without gaps or duplicates"
    );
}

async fn concurrent_requests_with_one_key_make_one_payment(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    const N: usize = 50;
    let body = payment_body("pedido-842");
    let answers = futures::future::join_all((0..N).map(|_| create(&app, "the-key", &body))).await;
    let mut created_bodies = HashSet::new();
    let (mut fresh, mut in_progress) = (0, 0);
    for r in answers {
        let r = r;
        match r.status().as_u16() {
            201 => {
                if header(&r, "idempotent-replayed") == Some("false") {
                    fresh += 1;
                }
                created_bodies.insert(r.bytes().await.expect("body"));
            }
            409 => {
                assert_eq!(header(&r, "retry-after"), Some("1"));
                assert_problem(r, 409, "idempotency-request-in-progress").await;
                in_progress += 1;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!(fresh, 1, "exactly one execution");
    assert_eq!(created_bodies.len(), 1, "every 201 is the stored answer");
    assert!(in_progress < N);
    assert_eq!(effects(&app).await, (1, 1, 1));
}

async fn concurrent_requests_for_one_order_with_different_keys_make_one_payment(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let body = payment_body("pedido-842");
    let keys: Vec<String> = (0..20).map(|i| format!("key-{i}")).collect();
    let answers = futures::future::join_all(keys.iter().map(|k| create(&app, k, &body))).await;
    let mut statuses = Vec::new();
    for r in answers {
        statuses.push(r.status().as_u16());
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 201).count(),
        1,
        "{statuses:?}"
    );
    assert!(
        statuses.iter().all(|s| *s == 201 || *s == 422 || *s == 409),
        "{statuses:?}"
    );
    assert_eq!(effects(&app).await, (1, 1, 1));
    assert_eq!(app.db.count("idempotency_records").await, 1);
}

async fn tombstones_replay_the_current_resource_and_expire_into_a_new_key(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let first = json_of(create(&app, "k-1", &payment_body("o-1")).await).await;
    let id = first["id"].as_str().expect("id").to_owned();
    set_status(&app, &id, "captured").await;

    // Younger than the retention: nothing is compacted.
    let retention = Duration::hours(24);
    assert_eq!(
        app.db
            .store
            .compact_idempotency_records(app.clock.now_minus(retention), 100)
            .await
            .expect("compact"),
        0
    );
    app.clock.advance(retention + Duration::seconds(1));
    assert_eq!(
        app.db
            .store
            .compact_idempotency_records(app.clock.now_minus(retention), 100)
            .await
            .expect("compact"),
        1
    );

    let replay = create(&app, "k-1", &payment_body("o-1")).await;
    assert_eq!(replay.status(), StatusCode::CREATED, "the original status");
    assert_eq!(header(&replay, "idempotent-replayed"), Some("true"));
    let current = json_of(replay).await;
    assert_eq!(current["id"], json!(id));
    assert_eq!(current["status"], "captured", "the resource as it is now");
    let mut changed = payment_body("o-1");
    changed["amount"] = json!(1);
    assert_problem(
        create(&app, "k-1", &changed).await,
        422,
        "idempotency-key-reused",
    )
    .await;

    // After the tombstone retention the key is new again, and the order rule
    // still prevents a second active payment.
    app.clock.advance(Duration::days(30));
    let cutoff = app.clock.now_minus(retention + Duration::days(30));
    assert_eq!(
        app.db
            .store
            .delete_expired_tombstones(cutoff, 100)
            .await
            .expect("purge"),
        1
    );
    let problem = assert_problem(
        create(&app, "k-1", &payment_body("o-1")).await,
        422,
        "order-has-active-payment",
    )
    .await;
    assert_eq!(problem["payment_id"], json!(id));
    assert_eq!(effects(&app).await, (1, 1, 1));
}

async fn list_is_newest_first_with_cursor_pagination(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let p =
            json_of(create(&app, &format!("k-{i}"), &payment_body(&format!("o-{i}"))).await).await;
        ids.push(p["id"].as_str().expect("id").to_owned());
    }
    ids.reverse();
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/payments?limit=2&cursor={c}"),
            None => "/v1/payments?limit=2".to_owned(),
        };
        let page = json_of(app.get(&path).send().await.expect("list")).await;
        for p in page["data"].as_array().expect("data") {
            seen.push(p["id"].as_str().expect("id").to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, ids, "newest first, every payment once");
    let filtered = json_of(
        app.get("/v1/payments?order_ref=o-3")
            .send()
            .await
            .expect("list"),
    )
    .await;
    assert_eq!(filtered["data"].as_array().expect("data").len(), 1);
    assert_problem(
        app.get("/v1/payments?status=bogus")
            .send()
            .await
            .expect("list"),
        400,
        "validation-error",
    )
    .await;
    assert_problem(
        app.get("/v1/payments?limit=1000")
            .send()
            .await
            .expect("list"),
        400,
        "validation-error",
    )
    .await;
    assert_eq!(effects(&app).await, (5, 5, 5));
}

async fn get_waits_for_nothing_once_the_payment_left_processing(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let p = json_of(create(&app, "k-1", &payment_body("o-1")).await).await;
    let id = p["id"].as_str().expect("id");
    set_status(&app, id, "captured").await;
    // With a 30 s wait the answer must come at once (the test would time
    // out otherwise): the payment already left `processing`.
    let got = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        app.get(&format!("/v1/payments/{id}?wait=30")).send(),
    )
    .await
    .expect("answered without waiting")
    .expect("send");
    assert_eq!(json_of(got).await["status"], "captured");
    assert_problem(
        app.get(&format!("/v1/payments/{id}?wait=31"))
            .send()
            .await
            .expect("get"),
        400,
        "validation-error",
    )
    .await;
    assert_problem(
        app.get("/v1/payments/not-a-uuid")
            .send()
            .await
            .expect("get"),
        404,
        "not-found",
    )
    .await;
    assert_eq!(effects(&app).await, (1, 1, 1));
}

async fn over_the_rate_limit_is_429_and_leaves_the_key_free(backend: Backend) {
    let mut app = TestApp::spawn(backend).await;
    app.serve_with(cobro_api::ApiSettings {
        rate_limit: cobro_api::rate_limit::RateLimit {
            per_second: 1,
            burst: 2,
        },
        ..Default::default()
    })
    .await;
    assert_eq!(
        create(&app, "k-1", &payment_body("o-1")).await.status(),
        StatusCode::CREATED
    );
    assert_eq!(
        create(&app, "k-2", &payment_body("o-2")).await.status(),
        StatusCode::CREATED
    );
    let limited = create(&app, "k-3", &payment_body("o-3")).await;
    assert_eq!(header(&limited, "retry-after"), Some("1"));
    assert_eq!(header(&limited, "idempotency-key"), Some("k-3"));
    assert_problem(limited, 429, "rate-limited").await;
    assert_eq!(effects(&app).await, (2, 2, 2));
    assert_eq!(
        app.db.count("idempotency_records").await,
        2,
        "k-3 is not stored"
    );
    // Another account is not limited by this one's traffic.
    let (_, other) = app.new_account("other").await;
    let theirs = app
        .post_as(&other, "/v1/payments", Some("k-3"))
        .json(&payment_body("o-3"))
        .send()
        .await
        .expect("send");
    assert_eq!(theirs.status(), StatusCode::CREATED);
    // A second later the same key executes.
    app.clock.advance(Duration::seconds(1));
    let retried = create(&app, "k-3", &payment_body("o-3")).await;
    assert_eq!(retried.status(), StatusCode::CREATED);
    assert_eq!(header(&retried, "idempotent-replayed"), Some("false"));
    assert_eq!(effects(&app).await, (4, 4, 4));
}

/// A write transaction of this process is held open (a stuck writer).
/// PostgreSQL's writers do not exclude each other: a new payment goes
/// through beside it. SQLite has one writer per database, and this
/// process's writes queue for its one writer connection: the request waits
/// no longer than the lock timeout, answers 503 (retry with the same key),
/// and writes nothing; once the writer is free the same key executes once.
async fn a_write_transaction_held_elsewhere_is_waited_for_within_the_lock_timeout(
    backend: Backend,
) {
    let db = cobro_test_support::TestDb::with_config(backend, |c| {
        c.lock_timeout = std::time::Duration::from_millis(300);
    })
    .await;
    let app = TestApp::spawn_on(db).await;
    let held = app.db.store.begin().await.expect("begin");
    let r = create(&app, "k-1", &payment_body("o-1")).await;
    let replayed_after = match backend {
        Backend::Postgres => {
            assert_eq!(r.status(), StatusCode::CREATED);
            assert_eq!(effects(&app).await, (1, 1, 1));
            "true"
        }
        Backend::Sqlite => {
            assert_eq!(header(&r, "retry-after"), Some("1"));
            assert_problem(r, 503, "service-unavailable").await;
            assert_eq!(effects(&app).await, (0, 0, 0), "nothing was written");
            "false"
        }
    };
    held.rollback().await.expect("rollback");
    let r = create(&app, "k-1", &payment_body("o-1")).await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(header(&r, "idempotent-replayed"), Some(replayed_after));
    assert_eq!(
        effects(&app).await,
        (1, 1, 1),
        "one payment, whatever came first"
    );
}

async fn without_a_database_answers_are_503_and_readyz_fails(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    assert_eq!(
        create(&app, "k-1", &payment_body("o-1")).await.status(),
        StatusCode::CREATED
    );
    let ready = app
        .client
        .get(format!("{}/readyz", app.url))
        .send()
        .await
        .expect("readyz");
    assert_eq!(ready.status(), StatusCode::OK);
    // The database goes away (the pool is closed: every query fails).
    app.db.store.close().await;
    let ready = app
        .client
        .get(format!("{}/readyz", app.url))
        .send()
        .await
        .expect("readyz");
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
    let health = app
        .client
        .get(format!("{}/healthz", app.url))
        .send()
        .await
        .expect("healthz");
    assert_eq!(
        health.status(),
        StatusCode::OK,
        "the process itself is alive"
    );
    let r = create(&app, "k-2", &payment_body("o-2")).await;
    assert_eq!(header(&r, "retry-after"), Some("1"));
    let body = assert_problem(r, 503, "service-unavailable").await;
    assert!(
        !body.to_string().contains("pool"),
        "no internal detail: {body}"
    );
}

async fn a_sane_request_id_is_kept_and_any_other_replaced(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let missing = format!("/v1/payments/{}", uuid::Uuid::now_v7());
    let answer = async |id: Option<&str>| {
        let mut request = app.get(&missing);
        if let Some(id) = id {
            request = request.header("x-request-id", id);
        }
        request.send().await.expect("send")
    };
    // Kept: 1 to 128 visible ASCII characters, in the header and the body.
    let sane = format!("req-1:~!{}", "x".repeat(120));
    let kept = answer(Some(&sane)).await;
    assert_eq!(header(&kept, "x-request-id"), Some(sane.as_str()));
    assert_eq!(
        assert_problem(kept, 404, "not-found").await["request_id"],
        json!(sane)
    );
    // Replaced by a new UUID: absent, too long, a space, a tab.
    let too_long = "x".repeat(129);
    for id in [None, Some(too_long.as_str()), Some("a b"), Some("a\tb")] {
        let replaced = answer(id).await;
        let echoed = header(&replaced, "x-request-id").expect("an id").to_owned();
        assert!(uuid::Uuid::parse_str(&echoed).is_ok(), "{id:?} -> {echoed}");
        assert_eq!(
            assert_problem(replaced, 404, "not-found").await["request_id"],
            json!(echoed)
        );
    }
}

/// Ends every connection of this test's database as PostgreSQL's fast
/// shutdown does at a switchover (`57P01 admin_shutdown`), from outside
/// cobro's pool.
async fn end_cobro_connections(app: &TestApp) -> i64 {
    use sqlx::Connection;
    let mut admin = sqlx::PgConnection::connect(&app.db.url)
        .await
        .expect("connect");
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()) t",
    )
    .fetch_one(&mut admin)
    .await
    .expect("terminate");
    admin.close().await.expect("close");
    ended
}

/// Creates `key` until it is not 503, asserting that nothing else (a 500
/// above all) is ever answered in between; returns the final answer and how
/// many 503s came first.
async fn create_retrying_503(app: &TestApp, key: &str, order: &str) -> (reqwest::Response, usize) {
    for unavailable in 0..20 {
        let r = create(app, key, &payment_body(order)).await;
        if r.status() != StatusCode::SERVICE_UNAVAILABLE {
            return (r, unavailable);
        }
        assert_eq!(header(&r, "retry-after"), Some("1"));
        assert_problem(r, 503, "service-unavailable").await;
    }
    panic!("still 503 after 20 tries");
}

/// A switchover ends the primary's connections under cobro's pool
/// (`57P01`): each pooled connection fails its next statement, which is a
/// retryable 503 (it was a 500), the dead connection is dropped, and the
/// client's retry with the same key executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_ended_by_the_server_answer_503_and_the_retry_executes_once() {
    let app = TestApp::spawn(cobro_test_support::Backend::Postgres).await;
    assert_eq!(
        create(&app, "k-1", &payment_body("o-1")).await.status(),
        StatusCode::CREATED
    );
    assert!(
        end_cobro_connections(&app).await >= 1,
        "cobro held a connection"
    );
    let (r, unavailable) = create_retrying_503(&app, "k-2", "o-2").await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(
        unavailable >= 1,
        "the first request met an ended connection"
    );
    assert_eq!(effects(&app).await, (2, 2, 2), "k-2 executed once");
    let again = create(&app, "k-2", &payment_body("o-2")).await;
    assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(effects(&app).await, (2, 2, 2));
}

/// A connection that reaches a standby (a demoted primary, or a router
/// that has not noticed the failover yet) is refused every write
/// (`25006 read_only_sql_transaction`): 503, nothing written, and once
/// the connection reaches a primary again the same key executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_server_answers_503_and_writes_nothing() {
    let app = TestApp::spawn(cobro_test_support::Backend::Postgres).await;
    assert_eq!(
        create(&app, "k-1", &payment_body("o-1")).await.status(),
        StatusCode::CREATED
    );
    let database: String = app.db.scalar("SELECT current_database()").await;
    app.db
        .exec(&format!(
            "ALTER DATABASE \"{database}\" SET default_transaction_read_only = on"
        ))
        .await;
    end_cobro_connections(&app).await;
    // Every new connection is now read-only, as a standby's are.
    for _ in 0..3 {
        let r = create(&app, "k-2", &payment_body("o-2")).await;
        assert_eq!(header(&r, "retry-after"), Some("1"));
        assert_problem(r, 503, "service-unavailable").await;
    }
    assert_eq!(effects(&app).await, (1, 1, 1), "nothing was written");
    // From the server's own database: a session in this one is read-only.
    {
        use sqlx::Connection;
        let mut admin = sqlx::PgConnection::connect(&cobro_test_support::postgres_admin_url())
            .await
            .expect("connect");
        sqlx::query(&format!(
            "ALTER DATABASE \"{database}\" RESET default_transaction_read_only"
        ))
        .execute(&mut admin)
        .await
        .expect("reset");
        admin.close().await.expect("close");
    }
    end_cobro_connections(&app).await;
    let (r, _) = create_retrying_503(&app, "k-2", "o-2").await;
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(effects(&app).await, (2, 2, 2), "k-2 executed once");
}
