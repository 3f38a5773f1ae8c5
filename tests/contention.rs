//! The contract under contention (issue 53): several clients of two
//! accounts at once on a few shared order refs and their payments, mixing
//! create, capture, cancel, refund, GET, list and events, while the worker
//! runs and the fake provider declines some payments at once (its
//! declining payment method) and holds others (latency rules). Every
//! answer is checked against the `GET /openapi.json` the server serves:
//! its status is one documented for the operation and its body validates
//! against the documented schema (the `jsonschema` crate, formats
//! included, `$ref`s resolved in the document's components). Every id a
//! refusal names must exist, be the caller's and be about the resource in
//! question (for `order-has-active-payment`: a payment of that order).
//! Then, once the worker has settled everything, the invariants of the
//! store and of the provider's ledger: at most one active payment per
//! order, refunds never above the captured amount, one charge per payment
//! and each payment equal to its own charge.
//!
//! `COBRO_CONTENTION_SEED` (a u64) picks the clients' choices and the
//! fake's fault draws; the default is fixed. A failure prints the seed.
//! The interleaving itself is the scheduler's, so a seed reproduces the
//! requests each client sends, not their order.

use cobro_test_support::{Backend, Rig, on_both_backends, wait_for};
use fake_provider::{FaultAction, FaultRule, Operation};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reqwest::Method;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

on_both_backends!(
    concurrent_clients_on_shared_orders_get_only_documented_answers_naming_their_own_resources
);

const DEFAULT_SEED: u64 = 53;
/// Clients at once, half of them per account.
const CLIENTS: usize = 8;
/// Requests each client sends.
const REQUESTS_PER_CLIENT: usize = 120;
/// The order refs every client shares at once (in both accounts).
const ORDERS: usize = 3;
/// Requests after which the clients move on to the next generation of
/// order refs: a captured payment holds its order for good, so without
/// new orders the run would soon meet nothing but refusals.
const GENERATION: usize = 12;

/// The `k`th shared order ref of a client's `step`th request: every client
/// is on about the same step at once, so they race on the same orders.
fn order_ref(step: usize, k: usize) -> String {
    format!("o{}-{k}", step / GENERATION)
}
/// Every payment's amount: refunds draw below and above what is left.
const AMOUNT: i64 = 1000;

fn seed() -> u64 {
    std::env::var("COBRO_CONTENTION_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEED)
}

/// The served document and a validator per (operation, status, media
/// type), compiled on first use.
struct Contract {
    doc: Value,
    validators: Mutex<HashMap<String, Arc<jsonschema::Validator>>>,
}

impl Contract {
    /// The answer's status must be documented for `method path` and its
    /// body valid against that response's schema. `Err` says what is wrong.
    fn check(
        &self,
        method: &Method,
        path: &str,
        status: u16,
        content_type: &str,
        body: &Value,
    ) -> Result<(), String> {
        let operation = &self.doc["paths"][path][method.as_str().to_lowercase()];
        if operation.is_null() {
            return Err(format!("{method} {path} is not documented"));
        }
        let response = &operation["responses"][status.to_string()];
        if response.is_null() {
            return Err(format!("{method} {path} answered {status}, not documented"));
        }
        let Some(schema) = response["content"][content_type].get("schema") else {
            return Err(format!(
                "{method} {path} {status}: no schema for content type {content_type}"
            ));
        };
        let cache_key = format!("{method} {path} {status} {content_type}");
        let validator = {
            let mut cache = self.validators.lock().expect("validators");
            match cache.get(&cache_key) {
                Some(v) => Arc::clone(v),
                None => {
                    // The response's schema as the root of a document that
                    // also carries the components, so its
                    // `#/components/schemas/...` references resolve.
                    let mut root = schema.clone();
                    if let Some(object) = root.as_object_mut() {
                        object.insert("components".into(), self.doc["components"].clone());
                    } else {
                        return Err(format!("{cache_key}: the schema is not an object"));
                    }
                    let v = jsonschema::options()
                        .with_draft(jsonschema::Draft::Draft202012)
                        .should_validate_formats(true)
                        .build(&root)
                        .map_err(|e| format!("{cache_key}: the schema does not compile: {e}"))?;
                    let v = Arc::new(v);
                    cache.insert(cache_key.clone(), Arc::clone(&v));
                    v
                }
            }
        };
        let errors: Vec<String> = validator
            .iter_errors(body)
            .map(|e| format!("{e} at {}", e.instance_path()))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{cache_key}: the body does not match its schema: {}; body {body}",
                errors.join("; ")
            ))
        }
    }
}

/// One client's view: its account's token, what it saw.
#[derive(Clone)]
struct Client {
    app_url: String,
    http: reqwest::Client,
    token: String,
    account: usize,
    contract: Arc<Contract>,
    /// The payments each account has been told about (ids), shared by its
    /// clients.
    known: Arc<Mutex<Vec<String>>>,
    tally: Arc<Mutex<Tally>>,
    /// The request this client is at.
    step: usize,
}

/// What the run saw, and what was wrong.
#[derive(Default, Debug)]
struct Tally {
    by_status: BTreeMap<String, u32>,
    active_payment_refusals: u32,
    /// `order-has-active-payment` refusals whose `payment_id` is missing,
    /// empty, not a payment of the caller, or of another order.
    refusals_naming_no_payment_of_the_order: u32,
    violations: Vec<String>,
}

struct Answer {
    status: u16,
    replayed: Option<String>,
    body: Value,
    raw: Vec<u8>,
}

impl Client {
    /// Sends one request and checks its answer against the contract.
    async fn send(
        &self,
        method: Method,
        template: &str,
        path: &str,
        key: Option<&str>,
        body: Option<&Value>,
    ) -> Answer {
        let mut request = self
            .http
            .request(method.clone(), format!("{}{path}", self.app_url))
            .bearer_auth(&self.token);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.expect("send");
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let raw = response.bytes().await.expect("body").to_vec();
        let parsed: Value = serde_json::from_slice(&raw).unwrap_or(Value::Null);
        let mut tally = self.tally.lock().expect("tally");
        let label = match parsed["code"].as_str() {
            Some(code) => format!("{method} {template} {status} {code}"),
            None => format!("{method} {template} {status}"),
        };
        *tally.by_status.entry(label).or_default() += 1;
        if status >= 500 {
            tally
                .violations
                .push(format!("{method} {path}: {status} {parsed}"));
        }
        if let Err(e) = self
            .contract
            .check(&method, template, status, &content_type, &parsed)
        {
            tally.violations.push(e);
        }
        Answer {
            status,
            replayed,
            body: parsed,
            raw,
        }
    }

    /// The caller's own payment `id`, as GET shows it; `None` if the
    /// caller cannot see it (unknown, another account's, not an id).
    async fn own_payment(&self, id: &str) -> Option<Value> {
        // Not an id at all (empty, say): nobody's payment.
        uuid::Uuid::parse_str(id).ok()?;
        let answer = self
            .send(
                Method::GET,
                "/v1/payments/{id}",
                &format!("/v1/payments/{id}"),
                None,
                None,
            )
            .await;
        (answer.status == 200).then_some(answer.body)
    }

    fn violation(&self, what: String) {
        self.tally.lock().expect("tally").violations.push(what);
    }

    fn remember(&self, id: &str) {
        self.known.lock().expect("known").push(id.to_owned());
    }

    fn pick_known(&self, rng: &mut StdRng) -> Option<String> {
        let known = self.known.lock().expect("known");
        (!known.is_empty()).then(|| known[rng.random_range(0..known.len())].clone())
    }

    /// A refusal naming a payment: it must be one of the caller's, and
    /// `expected` (the path's payment) when given.
    async fn check_named_payment(&self, what: &str, answer: &Answer, expected: Option<&str>) {
        let named = answer.body["payment_id"].as_str().unwrap_or_default();
        if let Some(expected) = expected
            && named != expected
        {
            self.violation(format!(
                "{what}: names payment {named:?}, not the path's {expected}"
            ));
        }
        if self.own_payment(named).await.is_none() {
            self.violation(format!(
                "{what}: names payment {named:?}, which is not the caller's"
            ));
        }
    }

    async fn create(&self, rng: &mut StdRng, last: &mut Option<(String, Value, Answer)>) {
        // Now and then the previous create again, same key and body: a
        // 201 replays byte for byte; a refusal was never stored.
        if let Some((key, body, first)) = last.take_if(|_| rng.random_bool(0.15)) {
            let again = self
                .send(
                    Method::POST,
                    "/v1/payments",
                    "/v1/payments",
                    Some(&key),
                    Some(&body),
                )
                .await;
            let replayed = again.replayed.as_deref() == Some("true");
            if first.status == 201 && (again.status != 201 || again.raw != first.raw || !replayed) {
                self.violation(format!(
                    "a created payment's key answered {} {} on its retry",
                    again.status, again.body
                ));
            }
            if first.status == 422 && again.status == 422 && replayed {
                self.violation(format!(
                    "a refusal was stored against key {key}: {}",
                    again.body
                ));
            }
            self.after_create(&body, &again).await;
            *last = Some((key, body, again));
            return;
        }
        let order = order_ref(self.step, rng.random_range(0..ORDERS));
        let method = if rng.random_bool(0.7) {
            "pm_card_declined"
        } else {
            "pm_card_visa"
        };
        let capture = if rng.random_bool(0.5) {
            "manual"
        } else {
            "automatic"
        };
        let body = json!({
            "order_ref": order, "amount": AMOUNT, "currency": "EUR",
            "payment_method": method, "capture_method": capture,
        });
        let key = uuid::Uuid::new_v4().to_string();
        let answer = self
            .send(
                Method::POST,
                "/v1/payments",
                "/v1/payments",
                Some(&key),
                Some(&body),
            )
            .await;
        self.after_create(&body, &answer).await;
        *last = Some((key, body, answer));
    }

    async fn after_create(&self, body: &Value, answer: &Answer) {
        let order = body["order_ref"].as_str().expect("order");
        match (answer.status, answer.body["code"].as_str()) {
            (201, _) => self.remember(answer.body["id"].as_str().unwrap_or_default()),
            (422, Some("order-has-active-payment")) => {
                let named = answer.body["payment_id"].as_str().unwrap_or_default();
                let of_the_order = match self.own_payment(named).await {
                    Some(payment) => payment["order_ref"] == order,
                    None => false,
                };
                let mut tally = self.tally.lock().expect("tally");
                tally.active_payment_refusals += 1;
                if !of_the_order {
                    tally.refusals_naming_no_payment_of_the_order += 1;
                    tally.violations.push(format!(
                        "order-has-active-payment for {order} (account {}) names {named:?}, no payment of the caller's for that order",
                        self.account
                    ));
                }
            }
            _ => {}
        }
    }

    async fn payment_operation(&self, rng: &mut StdRng, verb: &str) {
        let Some(id) = self.pick_known(rng) else {
            return;
        };
        let key = uuid::Uuid::new_v4().to_string();
        let (template, path, body) = match verb {
            "refunds" => (
                "/v1/payments/{id}/refunds",
                format!("/v1/payments/{id}/refunds"),
                Some(json!({"amount": rng.random_range(1..=AMOUNT / 2)})),
            ),
            "capture" => (
                "/v1/payments/{id}/capture",
                format!("/v1/payments/{id}/capture"),
                None,
            ),
            _ => (
                "/v1/payments/{id}/cancel",
                format!("/v1/payments/{id}/cancel"),
                None,
            ),
        };
        let answer = self
            .send(Method::POST, template, &path, Some(&key), body.as_ref())
            .await;
        if answer.status == 422 {
            let what = format!("{verb} of {id}: {}", answer.body["code"]);
            self.check_named_payment(&what, &answer, Some(&id)).await;
        }
        if verb == "refunds" && answer.status == 201 && answer.body["payment_id"] != id.as_str() {
            self.violation(format!("a refund of {id} answered {}", answer.body));
        }
        if verb != "refunds" && answer.status == 202 && answer.body["id"] != id.as_str() {
            self.violation(format!("{verb} of {id} answered {}", answer.body));
        }
    }

    async fn read(&self, rng: &mut StdRng) {
        match rng.random_range(0..3) {
            0 => {
                if let Some(id) = self.pick_known(rng) {
                    match self.own_payment(&id).await {
                        Some(p) if p["id"] == id.as_str() => {}
                        other => self.violation(format!("GET of own {id}: {other:?}")),
                    }
                }
            }
            1 => {
                let order = order_ref(self.step, rng.random_range(0..ORDERS));
                let path = format!("/v1/payments?order_ref={order}&limit=5");
                let answer = self
                    .send(Method::GET, "/v1/payments", &path, None, None)
                    .await;
                for p in answer.body["data"].as_array().into_iter().flatten() {
                    if p["order_ref"] != order {
                        self.violation(format!("list of {order} shows {p}"));
                    }
                }
            }
            _ => {
                let Some(id) = self.pick_known(rng) else {
                    return;
                };
                let path = format!("/v1/events?object={id}&limit=20");
                let answer = self
                    .send(Method::GET, "/v1/events", &path, None, None)
                    .await;
                for event in answer.body["data"].as_array().into_iter().flatten() {
                    if event["payment_id"] != id.as_str() {
                        self.violation(format!("events of {id} show {event}"));
                    }
                }
            }
        }
    }

    async fn run(mut self, seed: u64, index: usize) {
        let mut rng = StdRng::seed_from_u64(seed ^ (index as u64).wrapping_mul(0x9e37_79b9));
        let mut last = None;
        for step in 0..REQUESTS_PER_CLIENT {
            self.step = step;
            match rng.random_range(0..100) {
                0..50 => self.create(&mut rng, &mut last).await,
                50..62 => self.payment_operation(&mut rng, "capture").await,
                62..72 => self.payment_operation(&mut rng, "cancel").await,
                72..84 => self.payment_operation(&mut rng, "refunds").await,
                _ => self.read(&mut rng).await,
            }
        }
    }
}

async fn concurrent_clients_on_shared_orders_get_only_documented_answers_naming_their_own_resources(
    backend: Backend,
) {
    let seed = seed();
    eprintln!("COBRO_CONTENTION_SEED={seed}");
    let provider = fake_provider::Config {
        admin: true,
        seed,
        ..Default::default()
    };
    let mut rig = Rig::on_provider(
        cobro_test_support::TestApp::spawn(backend).await,
        cobro_test_support::Dialect::Fake,
        provider,
        |_, _| {},
    )
    .await;
    // The manual clock never moves here, so a rate limiter on it would
    // never refill: off.
    rig.app
        .serve_with(cobro_api::ApiSettings {
            rate_limit: cobro_api::rate_limit::RateLimit {
                per_second: 0,
                burst: 0,
            },
            ..cobro_test_support::test_api_settings()
        })
        .await;
    // Held payments, captures and refunds: their order stays active, their
    // payment `capturing`, while the others race them.
    let control = rig.provider.control();
    for operation in [Operation::Charge, Operation::Capture, Operation::Refund] {
        control.add_fault(
            FaultRule::new(operation, FaultAction::Latency)
                .with_probability(0.3)
                .with_delay(Duration::from_millis(120)),
        );
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let worker = tokio::spawn(Arc::clone(&rig.worker).run(stopped, Duration::from_secs(5)));

    let document: Value = rig
        .app
        .client
        .get(format!("{}/openapi.json", rig.app.url))
        .send()
        .await
        .expect("openapi")
        .json()
        .await
        .expect("the document");
    let contract = Arc::new(Contract {
        doc: document,
        validators: Mutex::new(HashMap::new()),
    });
    let (_, second_token) = rig.app.new_account("second").await;
    let tokens = [rig.app.token.clone(), second_token];
    let known = [
        Arc::new(Mutex::new(Vec::new())),
        Arc::new(Mutex::new(Vec::new())),
    ];
    let tally = Arc::new(Mutex::new(Tally::default()));
    let started = std::time::Instant::now();
    let mut clients = Vec::new();
    for index in 0..CLIENTS {
        let account = index % 2;
        let client = Client {
            app_url: rig.app.url.clone(),
            http: rig.app.client.clone(),
            token: tokens[account].clone(),
            account,
            contract: Arc::clone(&contract),
            known: Arc::clone(&known[account]),
            tally: Arc::clone(&tally),
            step: 0,
        };
        clients.push(tokio::spawn(client.run(seed, index)));
    }
    for client in clients {
        client.await.expect("client");
    }
    let ran = started.elapsed();

    // Everything settles: nothing is left in a moving status.
    let db = &rig.app.db;
    wait_for(
        "every payment and refund settled",
        Duration::from_secs(30),
        async || {
            let moving = db
                .count(
                    "payments WHERE status IN ('processing', 'capturing', 'canceling', \
                 'requires_reconciliation')",
                )
                .await
                + db.count("refunds WHERE status IN ('processing', 'requires_reconciliation')")
                    .await;
            (moving == 0).then_some(())
        },
    )
    .await;
    let _ = stop.send(true);
    worker.await.expect("worker");

    let mut violations = std::mem::take(&mut tally.lock().expect("tally").violations);
    // The store: one active payment per order, refunds within the capture.
    let doubled = db
        .count(
            "(SELECT account_id, order_ref FROM payments \
             WHERE status NOT IN ('declined', 'failed', 'canceled') \
             GROUP BY account_id, order_ref HAVING COUNT(*) > 1) AS doubled",
        )
        .await;
    if doubled != 0 {
        violations.push(format!(
            "{doubled} orders with more than one active payment"
        ));
    }
    let over = db
        .count(
            "payments p WHERE p.amount_refunded > p.amount_captured \
             OR p.amount_refund_reserved > p.amount_captured \
             OR (SELECT COALESCE(SUM(r.amount), 0) FROM refunds r \
                 WHERE r.payment_id = p.id AND r.status <> 'failed') > p.amount_captured",
        )
        .await;
    if over != 0 {
        violations.push(format!("{over} payments refunded above their capture"));
    }
    // The ledger: one charge per payment, each payment its own charge.
    let ledger = rig.ledger();
    for (account, token) in tokens.iter().enumerate() {
        let mut ids = known[account].lock().expect("known").clone();
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            let payment: Value = rig
                .app
                .client
                .get(format!("{}/v1/payments/{id}", rig.app.url))
                .bearer_auth(token)
                .send()
                .await
                .expect("get")
                .json()
                .await
                .expect("json");
            let charges = ledger.charges_with_metadata("cobro_payment", &id);
            let status = payment["status"].as_str().unwrap_or_default();
            let [charge] = charges.as_slice() else {
                violations.push(format!(
                    "payment {id} ({status}) has {} charges at the provider",
                    charges.len()
                ));
                continue;
            };
            let expected = match status {
                "authorized" => "authorized",
                "captured" | "partially_refunded" | "refunded" => "captured",
                "canceled" => "voided",
                "declined" => "declined",
                other => other,
            };
            // A decline is recorded without the provider's reference.
            let reference_ok = payment["provider_ref"] == charge.id.as_str()
                || (status == "declined" && payment["provider_ref"].is_null());
            if charge.status != expected
                || !reference_ok
                || payment["amount_captured"] != charge.amount_captured
                || payment["amount_refunded"] != charge.amount_refunded
                || charge.amount_refunded > charge.amount_captured
            {
                violations.push(format!(
                    "payment {id} is not its charge: {status} captured {} refunded {} ref {} \
                     vs {} {} captured {} refunded {}",
                    payment["amount_captured"],
                    payment["amount_refunded"],
                    payment["provider_ref"],
                    charge.id,
                    charge.status,
                    charge.amount_captured,
                    charge.amount_refunded
                ));
            }
        }
    }
    let doubles = cobro_test_support::double_charges(&ledger);
    if !doubles.is_empty() {
        violations.push(format!("charged twice: {doubles:?}"));
    }

    let tally = std::mem::take(&mut *tally.lock().expect("tally"));
    eprintln!(
        "{CLIENTS} clients x {REQUESTS_PER_CLIENT} requests in {ran:?} on {backend:?}; \
         order-has-active-payment: {} refusals, {} naming no payment of the order",
        tally.active_payment_refusals, tally.refusals_naming_no_payment_of_the_order
    );
    for (label, n) in &tally.by_status {
        eprintln!("  {n:5} {label}");
    }
    assert!(
        violations.is_empty(),
        "seed {seed} (COBRO_CONTENTION_SEED={seed} reproduces the requests): {} violations:\n{}",
        violations.len(),
        violations.join("\n")
    );
    assert!(
        tally.active_payment_refusals > 0,
        "seed {seed}: the run met no active payment; it proves nothing about refusals"
    );
    rig.shutdown().await;
}
