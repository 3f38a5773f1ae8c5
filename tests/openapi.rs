//! The served OpenAPI document against the router it documents: every route
//! and only those (the router answers exactly the documented operations), every error code with its status, the idempotency headers,
//! and real answers checked against the documented schemas. SQLite only: the
//! document does not depend on the backend.

use chrono::Duration;
use cobro_api::ApiError;
use cobro_api::error::FieldError;
use cobro_test_support::{Backend, TestApp, payment_body};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use std::collections::BTreeSet;

/// One of each `ApiError` variant.
fn every_error() -> Vec<ApiError> {
    let id = || "p".to_owned();
    let st = || "processing".to_owned();
    let errors = vec![
        ApiError::Unauthenticated,
        ApiError::NotFound,
        ApiError::Validation(vec![FieldError::new("amount", "is required")]),
        ApiError::BodyTooLarge { limit: 1 },
        ApiError::KeyMissing,
        ApiError::KeyInvalid,
        ApiError::KeyReused {
            idempotency_key: "k".into(),
        },
        ApiError::InProgress {
            idempotency_key: "k".into(),
        },
        ApiError::OrderHasActivePayment {
            payment_id: cobro_core::PaymentId::new(),
        },
        ApiError::NotCapturable {
            payment_id: id(),
            status: st(),
        },
        ApiError::NotCancelable {
            payment_id: id(),
            status: st(),
        },
        ApiError::NotRefundable {
            payment_id: id(),
            status: st(),
        },
        ApiError::RefundExceedsCaptured { payment_id: id() },
        ApiError::RefundReferenceExists {
            payment_id: id(),
            refund_id: id(),
        },
        ApiError::EndpointUrlNotAllowed {
            reason: cobro_core::egress::Refusal::PlainHttp,
        },
        ApiError::WebhookSignatureInvalid,
        ApiError::RateLimited,
        ApiError::RequestTimeout {
            limit: std::time::Duration::from_secs(45),
        },
        ApiError::Unavailable(None),
        ApiError::internal(std::io::Error::other("x")),
    ];
    // A new variant fails to compile here until it is added above.
    for e in &errors {
        match e {
            ApiError::Unauthenticated
            | ApiError::NotFound
            | ApiError::Validation(_)
            | ApiError::BodyTooLarge { .. }
            | ApiError::KeyMissing
            | ApiError::KeyInvalid
            | ApiError::KeyReused { .. }
            | ApiError::InProgress { .. }
            | ApiError::OrderHasActivePayment { .. }
            | ApiError::NotCapturable { .. }
            | ApiError::NotCancelable { .. }
            | ApiError::NotRefundable { .. }
            | ApiError::RefundExceedsCaptured { .. }
            | ApiError::RefundReferenceExists { .. }
            | ApiError::EndpointUrlNotAllowed { .. }
            | ApiError::WebhookSignatureInvalid
            | ApiError::RateLimited
            | ApiError::RequestTimeout { .. }
            | ApiError::Unavailable(_)
            | ApiError::Internal(_) => {}
        }
    }
    errors
}

/// Codes in `status_and_code` that no route answers today.
const NEVER_SENT: &[&str] = &[];

async fn served_document(app: &TestApp) -> Value {
    let response = app
        .client
        .get(format!("{}/openapi.json", app.url))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        header(&response, "content-type"),
        Some("application/json"),
        "served as JSON"
    );
    response.json().await.expect("the document parses as JSON")
}

fn header<'a>(r: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    r.headers().get(name).and_then(|v| v.to_str().ok())
}

/// Every (method, path, operation) of the document.
fn operations(doc: &Value) -> Vec<(String, String, &Value)> {
    let mut found = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("path item") {
            if [
                "get", "put", "post", "delete", "options", "head", "patch", "trace",
            ]
            .contains(&method.as_str())
            {
                found.push((method.to_uppercase(), path.clone(), operation));
            }
        }
    }
    found
}

/// Follows a local `$ref`.
fn resolve<'a>(doc: &'a Value, value: &'a Value) -> &'a Value {
    match value["$ref"].as_str() {
        Some(reference) => {
            let pointer = reference.trim_start_matches('#');
            doc.pointer(pointer)
                .unwrap_or_else(|| panic!("dangling reference {reference}"))
        }
        None => value,
    }
}

fn schema<'a>(doc: &'a Value, name: &str) -> &'a Value {
    &doc["components"]["schemas"][name]
}

/// The member names of an object answer must be documented properties, and
/// every required property must be present.
fn assert_matches_schema(doc: &Value, name: &str, body: &Value) {
    let schema = schema(doc, name);
    let properties = schema["properties"].as_object().expect("properties");
    let body = body.as_object().expect("an object answer");
    for key in body.keys() {
        assert!(
            properties.contains_key(key),
            "`{key}` is in a real {name} answer but not documented"
        );
    }
    for required in schema["required"].as_array().into_iter().flatten() {
        let required = required.as_str().expect("name");
        assert!(
            body.contains_key(required),
            "{name} documents `{required}` as required but the answer lacks it: {body:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_is_openapi_3_1_with_the_contract_in_its_description() {
    let app = TestApp::spawn(Backend::Sqlite).await;
    let doc = served_document(&app).await;
    assert_eq!(doc["openapi"], "3.1.0");
    let description = doc["info"]["description"].as_str().expect("description");
    for needle in [
        "Idempotency-Key",
        "random UUID",
        "fingerprint",
        "Idempotent-Replayed: true",
        "idempotency-key-reused",
        "Retry-After: 1",
        "24 h",
        "30 days",
        "tombstone",
    ] {
        assert!(
            description.contains(needle),
            "info.description mentions {needle}"
        );
    }
    let bearer = &doc["components"]["securitySchemes"]["bearer"];
    assert_eq!(bearer["type"], "http");
    assert_eq!(bearer["scheme"], "bearer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_the_router_answers_is_documented_and_nothing_else() {
    let app = TestApp::spawn(Backend::Sqlite).await;
    let doc = served_document(&app).await;

    // The router is built from the document's own operations (utoipa-axum's
    // `routes!`), so there is no list to keep here: what is checked is that
    // the router really answers exactly what the document says.
    let documented: BTreeSet<(String, String)> = operations(&doc)
        .into_iter()
        .map(|(method, path, _)| (method, path))
        .collect();
    assert!(
        documented.contains(&("POST".to_owned(), "/v1/payments".to_owned())),
        "the document has the operations: {documented:?}"
    );

    // A documented operation is never the router's own 404 or 405; every
    // other method on the same path is 405, and its `Allow` is exactly the
    // documented methods (HEAD, which axum answers for every GET route, is
    // left out on purpose).
    let id = uuid::Uuid::now_v7().to_string();
    let paths: BTreeSet<&str> = documented.iter().map(|(_, p)| p.as_str()).collect();
    for path in paths {
        let url = format!(
            "{}{}",
            app.url,
            path.replace("{id}", &id)
                .replace("{refund_id}", &id)
                .replace("{provider}", "fake")
        );
        let methods: BTreeSet<String> = documented
            .iter()
            .filter(|(_, p)| p == path)
            .map(|(m, _)| m.clone())
            .collect();
        for method in [
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::PATCH,
            Method::DELETE,
        ] {
            let response = app
                .client
                .request(method.clone(), &url)
                .bearer_auth(&app.token)
                .send()
                .await
                .expect("send");
            let status = response.status();
            let is_problem = header(&response, "content-type") == Some("application/problem+json");
            if methods.contains(method.as_str()) {
                assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
                assert!(
                    status != StatusCode::NOT_FOUND || is_problem,
                    "{method} {path} reached a handler (a 404 from a handler is a problem)"
                );
            } else {
                assert_eq!(
                    status,
                    StatusCode::METHOD_NOT_ALLOWED,
                    "{method} {path} is not served"
                );
                let allowed: BTreeSet<String> = header(&response, "allow")
                    .unwrap_or_default()
                    .split(',')
                    .map(|m| m.trim().to_owned())
                    .filter(|m| !m.is_empty() && m != "HEAD")
                    .collect();
                assert_eq!(
                    allowed, methods,
                    "{path}: the router serves the documented methods"
                );
            }
        }
    }
    let unknown = app
        .client
        .get(format!("{}/v1/refunds", app.url))
        .bearer_auth(&app.token)
        .send()
        .await
        .expect("send");
    assert_eq!(unknown.status(), StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_code_is_documented_with_its_status() {
    let app = TestApp::spawn(Backend::Sqlite).await;
    let doc = served_document(&app).await;

    let vocabulary: BTreeSet<&str> = schema(&doc, "ProblemCode")["enum"]
        .as_array()
        .expect("ProblemCode enum")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    // (status, code) of every problem answer of every operation.
    let mut answered = BTreeSet::new();
    for (method, path, operation) in operations(&doc) {
        for (status, response) in operation["responses"].as_object().expect("responses") {
            let response = resolve(&doc, response);
            let Some(content) = response["content"].get("application/problem+json") else {
                continue;
            };
            let codes = &content["schema"]["allOf"][1]["properties"]["code"]["enum"];
            for code in codes.as_array().expect("codes of {method} {path}") {
                let code = code.as_str().expect("code");
                assert!(
                    content["examples"].get(code).is_some(),
                    "{method} {path} {status} has an example for {code}"
                );
                assert!(vocabulary.contains(code), "{code} is in ProblemCode");
                answered.insert((status.clone(), code.to_owned()));
            }
        }
    }

    for error in every_error() {
        let (status, code) = error.status_and_code();
        assert!(vocabulary.contains(code), "{code} is in ProblemCode");
        if NEVER_SENT.contains(&code) {
            continue;
        }
        assert!(
            answered.contains(&(status.as_u16().to_string(), code.to_owned())),
            "{code} is documented as a {status} answer of some operation"
        );
    }
    assert!(answered.contains(&("422".to_owned(), "refusal-compacted".to_owned())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posts_document_the_key_and_every_answer_its_headers() {
    let app = TestApp::spawn(Backend::Sqlite).await;
    let doc = served_document(&app).await;

    let key = &doc["components"]["parameters"]["IdempotencyKey"];
    assert_eq!(key["in"], "header");
    assert_eq!(key["name"], "Idempotency-Key");
    assert_eq!(key["required"], true);
    let pattern = key["schema"]["pattern"].as_str().expect("key pattern");
    assert!(pattern.contains(&format!("{{1,{}}}", cobro_core::IdempotencyKey::MAX_LEN)));

    for (method, path, operation) in operations(&doc) {
        let parameters: Vec<&str> = operation["parameters"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["$ref"].as_str())
            .collect();
        // Provider webhooks are authenticated by their signature and
        // deduplicated by their event id: no bearer, no key.
        let webhook = path.starts_with("/v1/webhooks/");
        // Managing event endpoints moves no money: no key.
        let is_post = method == "POST" && !webhook && !path.starts_with("/v1/event_endpoints");
        assert_eq!(
            parameters.contains(&"#/components/parameters/IdempotencyKey"),
            is_post,
            "{method} {path}: Idempotency-Key on merchant POSTs only"
        );
        let secured = path.starts_with("/v1/") && !webhook;
        assert_eq!(
            operation.get("security").is_some(),
            secured,
            "{method} {path}: bearer on merchant /v1 routes only"
        );
        for (status, response) in operation["responses"].as_object().expect("responses") {
            let headers = &resolve(&doc, response)["headers"];
            assert!(
                headers.get("X-Request-Id").is_some(),
                "{method} {path} {status}"
            );
            if is_post {
                assert!(
                    headers.get("Idempotency-Key").is_some(),
                    "{method} {path} {status} echoes the key"
                );
                if status.starts_with('2') {
                    assert!(headers.get("Idempotent-Replayed").is_some());
                }
            }
            if status == "401" {
                assert!(
                    headers.get("WWW-Authenticate").is_some(),
                    "{method} {path} 401 names the scheme"
                );
            }
            if status == "409" || (status == "503" && secured) {
                assert!(
                    headers.get("Retry-After").is_some(),
                    "{method} {path} {status} says when to retry"
                );
            }
        }
    }

    let amount = schema(&doc, "Amount");
    assert_eq!(amount["minimum"], json!(cobro_core::Amount::MIN));
    assert_eq!(amount["maximum"], json!(cobro_core::Amount::MAX));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_answers_match_the_documented_schemas_and_headers() {
    let app = TestApp::spawn(Backend::Sqlite).await;
    let doc = served_document(&app).await;

    let created = app
        .post("/v1/payments", Some("k-1"))
        .json(&payment_body("o-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(created.status(), StatusCode::CREATED);
    for name in [
        "location",
        "idempotency-key",
        "idempotent-replayed",
        "x-request-id",
    ] {
        assert!(header(&created, name).is_some(), "201 carries {name}");
    }
    let payment: Value = created.json().await.expect("json");
    assert_matches_schema(&doc, "Payment", &payment);
    for attempt in payment["attempts"].as_array().expect("attempts") {
        assert_matches_schema(&doc, "Attempt", attempt);
    }
    let statuses = &schema(&doc, "PaymentStatus")["enum"];
    assert!(
        statuses
            .as_array()
            .expect("enum")
            .contains(&payment["status"])
    );

    let list: Value = app
        .get("/v1/payments")
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_matches_schema(&doc, "PaymentList", &list);
    for item in list["data"].as_array().expect("data") {
        assert_matches_schema(&doc, "Payment", item);
        assert!(item.get("attempts").is_none(), "lists omit attempts");
    }

    let endpoint = app
        .post("/v1/event_endpoints", None)
        .json(&json!({"url": "http://127.0.0.1:9/events", "event_types": ["payment.captured"]}))
        .send()
        .await
        .expect("send");
    assert_eq!(endpoint.status(), StatusCode::CREATED);
    let endpoint: Value = endpoint.json().await.expect("json");
    assert_matches_schema(&doc, "EventEndpoint", &endpoint);
    let events: Value = app
        .get("/v1/events")
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_matches_schema(&doc, "EventList", &events);
    let types = &schema(&doc, "EventType")["enum"];
    for event in events["data"].as_array().expect("data") {
        assert_matches_schema(&doc, "Event", event);
        assert!(types.as_array().expect("enum").contains(&event["type"]));
    }

    let refused = app
        .post("/v1/payments", Some("k-2"))
        .json(&json!({"amount": 0, "colour": "red"}))
        .send()
        .await
        .expect("send");
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    let problem: Value = refused.json().await.expect("json");
    assert_matches_schema(&doc, "Problem", &problem);
    for field_error in problem["errors"].as_array().expect("errors") {
        assert_matches_schema(&doc, "FieldError", field_error);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_refusal_replays_the_documented_body() {
    let app = TestApp::spawn(Backend::Sqlite).await;
    let doc = served_document(&app).await;
    let payment: Value = app
        .post("/v1/payments", Some("k-1"))
        .json(&payment_body("o-1"))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let capture = format!(
        "/v1/payments/{}/capture",
        payment["id"].as_str().expect("id")
    );

    // Still `processing`: a refusal stored against the key.
    let first = app.post(&capture, Some("c-1")).send().await.expect("send");
    assert_eq!(first.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(header(&first, "idempotent-replayed"), Some("false"));

    app.clock
        .advance(Duration::hours(24) + Duration::seconds(1));
    let compacted = app
        .db
        .store
        .compact_idempotency_records(app.clock.now_minus(Duration::hours(24)), 100)
        .await
        .expect("compact");
    assert_eq!(compacted, 2, "the payment's record and the refusal's");

    let replay = app.post(&capture, Some("c-1")).send().await.expect("send");
    assert_eq!(replay.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(header(&replay, "idempotent-replayed"), Some("true"));
    let body: Value = replay.json().await.expect("json");
    let documented = &doc["paths"]["/v1/payments/{id}/capture"]["post"]["responses"]["422"]["content"]
        ["application/problem+json"]["examples"]["refusal-compacted"]["value"];
    assert_eq!(&body, documented);
}
