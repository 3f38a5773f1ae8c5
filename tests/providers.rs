//! Several providers at once (issue 13, item 4): a registry of two
//! providers, `fake` (the fake's own API, the default) and `stripe` (its
//! Stripe dialect), both served by one in-process fake provider, which
//! serves both dialects at once. The registry, its clients, its workers'
//! and reconcilers' configurations and its webhook receivers are the ones
//! `cobro serve` builds (`cobro::provider`, `cobro::worker`); the store is
//! real on both backends, the HTTP is real, and the fake's ledger judges.
//!
//! Every test has its twin built in: an account on each provider, sharing
//! the order reference and the idempotency key.

use cobro::provider::{ProviderHandle, Registry};
use cobro_core::{AccountId, Clock, PaymentId};
use cobro_provider::Connector;
use cobro_test_support::{Backend, TestApp, on_both_backends, payment_body, t0, wait_for};
use cobro_worker::{Step, Worker};
use fake_provider::{FaultAction, FaultRule, Ledger, Operation, WebhookDialect, WebhookTarget};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

const STRIPE_WEBHOOK_SECRET: &str = "whsec_test_providers";

/// The app, the fake provider, the registry's clients and one worker per
/// provider (by name).
struct World {
    app: TestApp,
    provider: fake_provider::Running,
    handle: ProviderHandle,
    workers: Vec<(String, Arc<Worker<Connector>>)>,
    /// The account on `stripe` and its token (the app's own account is on
    /// the default, `fake`).
    stripe_account: AccountId,
    stripe_token: String,
}

/// The providers file of these tests: both providers at one fake.
fn providers_file(url: &str) -> String {
    format!(
        r#"
        default_provider = "fake"

        [[provider]]
        name = "fake"
        kind = "fake"
        base_url = "{url}"
        secret_env = "FAKE_KEY"
        request_timeout = "2s"

        [[provider]]
        name = "stripe"
        kind = "stripe"
        base_url = "{url}"
        secret_env = "STRIPE_KEY"
        webhook_secret_env = "STRIPE_WHSEC"
        request_timeout = "2s"
        search_lag = "60s"
        "#
    )
}

fn env(name: &str) -> Option<String> {
    match name {
        "FAKE_KEY" => Some("sk_test_cobro".into()),
        "STRIPE_KEY" => Some("sk_test_cobro_stripe".into()),
        "STRIPE_WHSEC" => Some(STRIPE_WEBHOOK_SECRET.into()),
        _ => None,
    }
}

impl World {
    async fn new(backend: Backend) -> Self {
        let mut app = TestApp::spawn(backend).await;
        let provider = fake_provider::start(fake_provider::Config {
            admin: true,
            webhook_dialect: WebhookDialect::Stripe,
            // One timeline: the creation times the provider's list reports
            // and the send times cobro records are comparable.
            clock_start: Some(app.clock.now()),
            ..Default::default()
        })
        .await
        .expect("fake provider");
        let registry = Registry::parse(
            &providers_file(&provider.url()),
            std::path::Path::new("."),
            &env,
        )
        .expect("providers file");
        // The API as `serve` configures it: each provider's webhooks at
        // /v1/webhooks/{name}, new payments to the default provider.
        let mut settings = cobro_api::ApiSettings {
            default_provider: Some(registry.default_name().to_owned()),
            ..Default::default()
        };
        for spec in registry.providers() {
            if let Some(receiver) = cobro::provider::webhook_receiver(spec) {
                settings.webhooks.insert(spec.name.clone(), receiver);
            }
        }
        app.serve_with(settings).await;
        let (handle, workers) = serve_workers(&app, registry, None).await;
        let stripe_account = app
            .db
            .store
            .create_account_with_provider("shop-on-stripe", Some("stripe"), t0())
            .await
            .expect("account");
        let stripe_token = format!("test_{}", uuid::Uuid::new_v4().simple());
        app.db
            .store
            .create_token(
                stripe_account,
                "test",
                &cobro_api::token_hash(&stripe_token),
                t0(),
            )
            .await
            .expect("token");
        World {
            app,
            provider,
            handle,
            workers,
            stripe_account,
            stripe_token,
        }
    }

    fn worker(&self, name: &str) -> &Arc<Worker<Connector>> {
        &self
            .workers
            .iter()
            .find(|(n, _)| n == name)
            .expect("worker")
            .1
    }

    /// Runs `name`'s worker until nothing of its provider is due.
    async fn drain(&self, name: &str) -> Vec<Step> {
        let mut steps = Vec::new();
        for _ in 0..5 {
            let batch = self.worker(name).run_once().await.expect("worker round");
            if batch.is_empty() {
                break;
            }
            steps.extend(batch);
        }
        steps
    }

    fn ledger(&self) -> Ledger {
        self.provider.control().ledger()
    }

    /// `POST path` as the account on `fake` (`stripe: false`) or `stripe`.
    async fn post(&self, stripe: bool, path: &str, key: &str, body: &Value) -> Value {
        let token = if stripe {
            &self.stripe_token
        } else {
            &self.app.token
        };
        let r = self
            .app
            .post_as(token, path, Some(key))
            .json(body)
            .send()
            .await
            .expect("send");
        let status = r.status().as_u16();
        let body: Value = r.json().await.expect("json");
        assert!(status == 201 || status == 202, "{path}: {status} {body}");
        body
    }

    async fn payment(&self, stripe: bool, id: &str) -> cobro_store::PaymentRow {
        let account = if stripe {
            self.stripe_account
        } else {
            self.app.account
        };
        self.app
            .db
            .store
            .payment_for_account(account, id.parse().expect("payment id"))
            .await
            .expect("read")
            .expect("payment")
    }

    /// The fake's Stripe dialect sends its signed events to cobro's
    /// `/v1/webhooks/stripe`.
    fn send_stripe_webhooks(&self) {
        self.provider.control().set_webhook(Some(WebhookTarget {
            url: format!("{}/v1/webhooks/stripe", self.app.url),
            secret: STRIPE_WEBHOOK_SECRET.to_owned(),
        }));
    }

    /// What cobro recorded about payment `id`: the types of its events to
    /// the merchant, its audit trail's decisions, its conflicts.
    async fn records(&self, id: &str) -> Records {
        let payment: PaymentId = id.parse().expect("payment id");
        let store = &self.app.db.store;
        Records {
            events: store
                .events_of_payment_any_account(payment)
                .await
                .expect("events")
                .into_iter()
                .map(|e| e.event_type)
                .collect(),
            decisions: store
                .decisions_of_payment_any_account(payment)
                .await
                .expect("decisions")
                .into_iter()
                .map(|d| d.decision)
                .collect(),
            conflicts: store
                .conflicts_of_payment_any_account(payment)
                .await
                .expect("conflicts")
                .len(),
        }
    }

    async fn attempts(&self, id: &str) -> Vec<cobro_store::AttemptRow> {
        self.app
            .db
            .store
            .attempts_of_payment_any_account(id.parse().expect("payment id"))
            .await
            .expect("attempts")
    }

    /// The reconciler `cobro serve` schedules for provider `name`.
    fn reconciler(&self, name: &str) -> cobro_reconciler::Reconciler<Connector> {
        scheduled_reconciler(&self.app, &self.handle, name)
    }

    /// One run of the reconciler of provider `name` over every candidate.
    async fn reconcile(&self, name: &str) -> cobro_reconciler::Summary {
        cobro_test_support::run_once(&self.reconciler(name)).await
    }

    /// Moves the app's manual clock to the provider's virtual one (which
    /// signs its webhooks with its own time).
    fn align_clocks(&self) {
        let gap = self.provider.control().now() - self.app.clock.now();
        match gap.to_std() {
            Ok(ahead) => self
                .app
                .clock
                .advance(chrono::Duration::from_std(ahead).expect("gap")),
            Err(_) => self
                .provider
                .control()
                .advance_clock((-gap).to_std().expect("gap")),
        }
    }
}

/// The workers `cobro serve` runs for `registry`, one per provider, on
/// `app`'s store and manual clock (backoff shortened for tests), each
/// reporting to `circuits` when routing; and the registry's clients.
pub(crate) async fn serve_workers(
    app: &TestApp,
    registry: Registry,
    circuits: Option<Arc<cobro_settle::routing::Circuits>>,
) -> (ProviderHandle, Vec<(String, Arc<Worker<Connector>>)>) {
    let worker_settings = cobro::settings::WorkerSettings {
        worker_lease: Duration::from_secs(30),
        worker_heartbeat: Duration::from_secs(10),
        worker_max_in_flight: 8,
        worker_poll: Duration::from_secs(1),
        action_expiry: Duration::from_secs(3600),
    };
    let configs =
        cobro::worker::worker_configs(&registry, &worker_settings).expect("worker configs");
    let handle = cobro::provider::connect(registry, false)
        .await
        .expect("clients");
    let workers = configs
        .into_iter()
        .map(|(name, mut config)| {
            config.backoff_base = Duration::from_millis(100);
            config.backoff_cap = Duration::from_secs(1);
            let client = handle.client(&name).expect("client").clone();
            let mut worker = Worker::new(
                app.db.store.clone(),
                Arc::new(client),
                Arc::new(app.clock.clone()),
                config,
                Arc::new(tokio::sync::Notify::new()),
            );
            if let Some(circuits) = &circuits {
                worker = worker.with_circuits(Arc::clone(circuits));
            }
            (name, Arc::new(worker))
        })
        .collect();
    (handle, workers)
}

/// The reconciler `cobro serve` schedules for provider `name` of `handle`,
/// on `app`'s store and manual clock.
pub(crate) fn scheduled_reconciler(
    app: &TestApp,
    handle: &ProviderHandle,
    name: &str,
) -> cobro_reconciler::Reconciler<Connector> {
    let settings = cobro::settings::ReconcileSettings {
        provider_search_lag: Duration::from_secs(60),
        provider_clock_skew: Duration::from_secs(10),
        reconcile_stuck_after: Duration::from_secs(300),
        reconcile_escalate_after: Duration::from_secs(24 * 3600),
        reconcile_no_retry: false,
        books: cobro::settings::BooksSettings {
            books_schedule: "0 */5 * * * *".into(),
            no_books: true,
            books_overlap: Duration::from_secs(600),
            books_settle_delay: Duration::from_secs(120),
            books_first_window: Duration::from_secs(24 * 3600),
        },
    };
    let spec = handle.registry.get(name).expect("spec");
    let mut config = settings.config(spec, handle.registry.scope(spec), "reconciler:test".into());
    // The app's manual clock is days from the database's: the bound is
    // tested where the clock is made to be off (tests/reconciler.rs).
    config.max_clock_gap = None;
    cobro_reconciler::Reconciler::new(
        app.db.store.clone(),
        Arc::new(handle.client(name).expect("client").clone()),
        Arc::new(app.clock.clone()),
        config,
    )
}

/// See [`World::records`].
#[derive(Debug)]
struct Records {
    events: Vec<String>,
    decisions: Vec<cobro_core::Decision>,
    conflicts: usize,
}

fn id(payment: &Value) -> String {
    payment["id"].as_str().expect("id").to_owned()
}

/// Drops the answer of the next Stripe PaymentIntent create, after the charge
/// was made.
fn drop_next_charge_answer(world: &World) {
    world.provider.control().add_fault(FaultRule {
        operation: Operation::Charge,
        action: FaultAction::DropResponseAfterEffect,
        reference_contains: None,
        next: Some(1),
        probability: None,
        delay_ms: None,
        lag_seconds: None,
    });
}

async fn each_account_is_charged_through_its_own_providers_api(backend: Backend) {
    let world = World::new(backend).await;
    // The twins: one order reference and one key under two accounts.
    let on_fake = world
        .post(false, "/v1/payments", "k-1", &payment_body("o-1"))
        .await;
    let on_stripe = world
        .post(true, "/v1/payments", "k-1", &payment_body("o-1"))
        .await;
    // Each worker claims only its provider's attempt.
    assert_eq!(
        world.drain("stripe").await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    assert_eq!(
        world.drain("fake").await,
        vec![Step::Recorded { class: "succeeded" }]
    );

    let ledger = world.ledger();
    assert_eq!(ledger.charges.len(), 2, "{ledger:?}");
    assert!(ledger.duplicate_charge_references.is_empty());

    // The Stripe account's payment: a PaymentIntent, with cobro's metadata.
    let stripe_payment = world.payment(true, &id(&on_stripe)).await;
    assert_eq!(stripe_payment.provider.as_deref(), Some("stripe"));
    assert_eq!(stripe_payment.status.to_string(), "captured");
    let intent = stripe_payment.provider_ref.clone().expect("provider ref");
    assert!(intent.starts_with("pi_"), "{intent}");
    let charge = ledger
        .charge_of_payment_intent(&intent)
        .expect("the PaymentIntent's charge");
    assert_eq!(charge.caller, "sk_test_cobro_stripe");
    assert_eq!(
        charge.metadata.get("cobro_payment").map(String::as_str),
        Some(id(&on_stripe).as_str())
    );
    assert_eq!(
        charge.metadata.get("cobro_account").map(String::as_str),
        Some(world.stripe_account.to_string().as_str())
    );
    assert_eq!(
        (charge.status.to_string(), charge.amount),
        ("captured".to_owned(), stripe_payment.amount)
    );
    let attempts = world.attempts(&id(&on_stripe)).await;
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].provider.as_deref(), Some("stripe"));
    let request_id = attempts[0].provider_request_id.clone().expect("request id");
    assert!(request_id.starts_with("req_"), "{request_id}");
    assert!(!attempts[0].provider_replayed);

    // The default account's payment: the fake's own API, its own charge.
    let fake_payment = world.payment(false, &id(&on_fake)).await;
    assert_eq!(fake_payment.provider.as_deref(), Some("fake"));
    assert_eq!(fake_payment.status.to_string(), "captured");
    let fake_charge = ledger
        .charge(fake_payment.provider_ref.as_deref().expect("provider ref"))
        .expect("the fake's charge");
    assert_eq!(fake_charge.caller, "sk_test_cobro");
    assert_eq!(
        fake_charge
            .metadata
            .get("cobro_payment")
            .map(String::as_str),
        Some(id(&on_fake).as_str())
    );
    assert!(
        !ledger
            .payment_intents
            .values()
            .any(|c| c == &fake_charge.id)
    );
    let attempts = world.attempts(&id(&on_fake)).await;
    assert_eq!(attempts[0].provider.as_deref(), Some("fake"));
}

async fn a_capture_and_a_refund_of_a_stripe_payment_go_to_stripe(backend: Backend) {
    let world = World::new(backend).await;
    let mut body = payment_body("o-1");
    body["capture_method"] = json!("manual");
    body["amount"] = json!(1000);
    let on_stripe = world.post(true, "/v1/payments", "k-1", &body).await;
    let on_fake = world.post(false, "/v1/payments", "k-1", &body).await;
    world.drain("stripe").await;
    world.drain("fake").await;
    let stripe_id = id(&on_stripe);
    world
        .post(
            true,
            &format!("/v1/payments/{stripe_id}/capture"),
            "cap-1",
            &json!({}),
        )
        .await;
    assert_eq!(
        world.drain("fake").await,
        vec![],
        "the capture is not the fake's"
    );
    assert_eq!(world.drain("stripe").await.len(), 1);
    world
        .post(
            true,
            &format!("/v1/payments/{stripe_id}/refunds"),
            "ref-1",
            &json!({"amount": 400}),
        )
        .await;
    assert_eq!(
        world.drain("fake").await,
        vec![],
        "the refund is not the fake's"
    );
    assert_eq!(world.drain("stripe").await.len(), 1);

    let payment = world.payment(true, &stripe_id).await;
    assert_eq!(payment.amount_captured, 1000);
    assert_eq!(payment.amount_refunded, 400);
    let attempts = world.attempts(&stripe_id).await;
    assert_eq!(attempts.len(), 3, "authorize, capture, refund");
    for attempt in &attempts {
        assert_eq!(attempt.provider.as_deref(), Some("stripe"), "{attempt:?}");
        assert!(attempt.provider_request_id.is_some(), "{attempt:?}");
    }
    // The judge: the PaymentIntent captured once, one refund of 400 on it;
    // the default account's authorisation untouched.
    let ledger = world.ledger();
    let charge = ledger
        .charge_of_payment_intent(payment.provider_ref.as_deref().expect("intent"))
        .expect("charge");
    assert_eq!(
        (charge.amount_captured, charge.amount_refunded),
        (1000, 400)
    );
    let refunds = ledger.refunds_of_charge(&charge.id);
    assert_eq!(refunds.len(), 1);
    assert_eq!(refunds[0].amount, 400);
    assert_eq!(refunds[0].caller, "sk_test_cobro_stripe");
    assert_eq!((ledger.totals.captures, ledger.totals.refunds), (1, 1));
    let fake_payment = world.payment(false, &id(&on_fake)).await;
    let fake_charge = ledger
        .charge(fake_payment.provider_ref.as_deref().expect("charge"))
        .expect("fake charge");
    assert_eq!(fake_charge.status, "authorized");
}

async fn the_stripe_reconciler_adopts_a_charge_whose_answer_was_lost(backend: Backend) {
    let world = World::new(backend).await;
    drop_next_charge_answer(&world);
    let on_stripe = world
        .post(true, "/v1/payments", "k-1", &payment_body("o-1"))
        .await;
    assert_eq!(
        world.drain("stripe").await,
        vec![Step::Rescheduled { class: "unknown" }]
    );
    let stripe_id = id(&on_stripe);
    assert_eq!(world.ledger().charges.len(), 1, "the charge was made");
    assert_eq!(
        world.payment(true, &stripe_id).await.status.to_string(),
        "processing"
    );
    // Later than the worker's retries: the reconciler's turn.
    world.app.clock.advance(chrono::Duration::minutes(10));
    let none = world.reconcile("fake").await;
    assert_eq!(
        none.examined, 0,
        "the fake's reconciler never asks about it"
    );
    let run = world.reconcile("stripe").await;
    assert_eq!(run.examined, 1, "{run:?}");
    assert_eq!(run.resolved.get("succeeded"), Some(&1), "{run:?}");

    let payment = world.payment(true, &stripe_id).await;
    assert_eq!(payment.status.to_string(), "captured");
    let ledger = world.ledger();
    let charge = ledger
        .charge_of_payment_intent(payment.provider_ref.as_deref().expect("adopted"))
        .expect("the PaymentIntent's charge");
    assert_eq!(
        charge.metadata.get("cobro_payment").map(String::as_str),
        Some(stripe_id.as_str())
    );
    // Nothing is sent again: one charge in all.
    world.drain("stripe").await;
    assert_eq!(world.ledger().charges.len(), 1);
    assert!(world.ledger().duplicate_charge_references.is_empty());
}

async fn a_stripe_signed_webhook_is_applied_at_its_providers_route(backend: Backend) {
    let world = World::new(backend).await;
    world.align_clocks();
    world.send_stripe_webhooks();
    // The worker never learns the answer: only the webhook can settle it.
    drop_next_charge_answer(&world);
    let on_stripe = world
        .post(true, "/v1/payments", "k-1", &payment_body("o-1"))
        .await;
    assert_eq!(
        world.drain("stripe").await,
        vec![Step::Rescheduled { class: "unknown" }]
    );
    let stripe_id = id(&on_stripe);
    let payment = wait_for(
        "the webhook settles the payment",
        Duration::from_secs(20),
        async || {
            let p = world.payment(true, &stripe_id).await;
            (p.status.to_string() == "captured").then_some(p)
        },
    )
    .await;
    // The fake records the delivery once our 200 reached it, just after
    // our commit.
    wait_for(
        "the fake saw the Stripe event acknowledged",
        Duration::from_secs(10),
        async || {
            let deliveries = world.provider.control().webhook_deliveries();
            deliveries
                .iter()
                .any(|d| d.event_type == "payment_intent.succeeded" && d.status == Some(200))
                .then_some(())
        },
    )
    .await;
    let ledger = world.ledger();
    assert_eq!(ledger.charges.len(), 1);
    let charge = ledger
        .charge_of_payment_intent(payment.provider_ref.as_deref().expect("adopted"))
        .expect("charge");
    assert_eq!(
        charge.metadata.get("cobro_payment").map(String::as_str),
        Some(stripe_id.as_str())
    );
}

/// The requests the fake received for `method path`, in order.
fn requests_to(world: &World, method: &str, path: &str) -> Vec<fake_provider::SeenRequest> {
    world
        .provider
        .control()
        .requests()
        .into_iter()
        .filter(|r| r.method == method && r.path == path)
        .collect()
}

/// Ten minutes on (past the worker's retries and the search lag), one run
/// of Stripe's reconciler adopts the payment's PaymentIntent: it is
/// captured, and the worker sends nothing more (`creates` PaymentIntent
/// creations in all). The payment as adopted.
async fn adopted_by_the_reconciler(
    world: &World,
    stripe_id: &str,
    creates: usize,
) -> cobro_store::PaymentRow {
    world.app.clock.advance(chrono::Duration::minutes(10));
    let run = world.reconcile("stripe").await;
    assert_eq!(run.resolved.get("succeeded"), Some(&1), "{run:?}");
    let payment = world.payment(true, stripe_id).await;
    assert_eq!(payment.status.to_string(), "captured");
    world.drain("stripe").await;
    assert_eq!(
        requests_to(world, "POST", "/v1/payment_intents").len(),
        creates
    );
    payment
}

/// `Stripe-Should-Retry: false` on an unknown outcome (a 500 after the
/// PaymentIntent was charged, which the key replays): the worker records
/// the call, sends nothing more and hands the attempt to the reconciler at
/// once, well inside its key window; the reconciler's search adopts the
/// one PaymentIntent. The twin on the fake's own API (same order and key,
/// the same fault, which there sends no such header) is retried under its
/// key, whose saved answer is the real one.
async fn a_stripe_500_saying_not_to_retry_is_handed_to_the_reconciler_without_a_resend(
    backend: Backend,
) {
    let world = World::new(backend).await;
    world.provider.control().add_fault(
        FaultRule::new(Operation::Charge, FaultAction::FailAfterEffectNoRetry).with_next(2),
    );
    let on_stripe = world
        .post(true, "/v1/payments", "k-1", &payment_body("o-1"))
        .await;
    let on_fake = world
        .post(false, "/v1/payments", "k-1", &payment_body("o-1"))
        .await;
    assert_eq!(world.drain("stripe").await, vec![Step::HandedOver]);
    let stripe_id = id(&on_stripe);
    let creates = requests_to(&world, "POST", "/v1/payment_intents");
    assert_eq!(creates.len(), 1, "one send, no resend");
    let attempts = world.attempts(&stripe_id).await;
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].state, cobro_core::AttemptState::Reconciling);
    assert_eq!(attempts[0].send_count, 1);
    assert!(
        attempts[0].provider_request_id.is_some(),
        "the call is recorded: {:?}",
        attempts[0]
    );
    let last_error = attempts[0].last_error.clone().unwrap_or_default();
    assert!(
        last_error.contains("server_error_replayed") && last_error.contains("would not help"),
        "{last_error}"
    );
    // The fake's twin: the same fault is a plain 500 there, retried.
    assert_eq!(
        world.drain("fake").await,
        vec![Step::Rescheduled { class: "unknown" }],
        "the fake sends no Stripe-Should-Retry"
    );
    world.app.clock.advance(chrono::Duration::seconds(2));
    assert_eq!(
        world.drain("fake").await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    assert_eq!(
        world.payment(false, &id(&on_fake)).await.status.to_string(),
        "captured"
    );
    assert_eq!(
        world.payment(true, &stripe_id).await.status.to_string(),
        "requires_reconciliation"
    );
    let ledger = world.ledger();
    assert_eq!(
        ledger.charges.len(),
        2,
        "one charge per account: {ledger:?}"
    );

    // The reconciler settles it from Stripe's search once the lag passed.
    let payment = adopted_by_the_reconciler(&world, &stripe_id, 1).await;
    let ledger = world.ledger();
    let charge = ledger
        .charge_of_payment_intent(payment.provider_ref.as_deref().expect("adopted"))
        .expect("the PaymentIntent's charge");
    assert_eq!(
        charge.metadata.get("cobro_payment").map(String::as_str),
        Some(stripe_id.as_str())
    );
    assert_eq!(
        (charge.status.as_str(), charge.amount_captured),
        ("captured", 1999)
    );
    assert_eq!(ledger.charges.len(), 2);
    assert!(cobro_test_support::double_charges(&ledger).is_empty());
}

/// A 500 that Stripe saved under the key (a plain one, without
/// `Stripe-Should-Retry: false`): the first answer is retried under the
/// key as any unknown outcome; the retry's answer is that 500 replayed
/// (`Idempotent-Replayed: true`), which shows that every resend would only
/// replay it again, so the worker hands the attempt to the reconciler then,
/// instead of resending until the key window closes. The reconciler adopts
/// the one PaymentIntent once it may decide.
async fn a_replayed_stripe_500_is_handed_to_the_reconciler_at_its_first_replay(backend: Backend) {
    let world = World::new(backend).await;
    world
        .provider
        .control()
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::FailAfterEffect).with_next(1));
    let created = world
        .post(true, "/v1/payments", "k-1", &payment_body("o-1"))
        .await;
    assert_eq!(
        world.drain("stripe").await,
        vec![Step::Rescheduled { class: "unknown" }]
    );
    world.app.clock.advance(chrono::Duration::seconds(2));
    assert_eq!(world.drain("stripe").await, vec![Step::HandedOver]);
    let creates = requests_to(&world, "POST", "/v1/payment_intents");
    assert_eq!(creates.len(), 2, "one send and one replayed resend");
    let stripe_id = id(&created);
    let attempts = world.attempts(&stripe_id).await;
    assert_eq!(
        (attempts.len(), attempts[0].state, attempts[0].send_count),
        (1, cobro_core::AttemptState::Reconciling, 2)
    );
    let last_error = attempts[0].last_error.clone().unwrap_or_default();
    assert!(last_error.contains("replay"), "{last_error}");
    assert_eq!(world.ledger().charges.len(), 1);

    adopted_by_the_reconciler(&world, &stripe_id, 2).await;
    let ledger = world.ledger();
    assert_eq!(ledger.charges.len(), 1);
    assert!(cobro_test_support::double_charges(&ledger).is_empty());
}

/// 3-D Secure on the Stripe connector: a PaymentIntent that waits for its
/// customer is kept, never canceled by cobro (issue 49; it used to be
/// failed and canceled at once). The payment waits in `requires_action`,
/// Stripe's `payment_intent.requires_action` event agrees with it, and
/// nothing was charged, held or voided.
async fn a_payment_intent_waiting_for_the_customer_is_kept_at_stripe(backend: Backend) {
    let world = World::new(backend).await;
    world.align_clocks();
    world.send_stripe_webhooks();
    let mut body = payment_body("o-1");
    body["payment_method"] = json!("pm_card_authenticationRequired");
    let on_stripe = world.post(true, "/v1/payments", "k-1", &body).await;
    assert_eq!(
        world.drain("stripe").await,
        vec![Step::Recorded {
            class: "requires_action"
        }]
    );
    let stripe_id = id(&on_stripe);
    let payment = world.payment(true, &stripe_id).await;
    assert_eq!(payment.status.to_string(), "requires_action");
    let attempts = world.attempts(&stripe_id).await;
    let key = attempts[0].provider_key.clone();
    assert_eq!(attempts[0].state.as_str(), "awaiting_customer");

    let creates = requests_to(&world, "POST", "/v1/payment_intents");
    assert_eq!(creates.len(), 1);
    assert_eq!(creates[0].idempotency_key.as_deref(), Some(key.as_str()));
    let cancels = world
        .provider
        .control()
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/cancel"))
        .count();
    assert_eq!(cancels, 0, "cobro waits for the customer");
    let pi = payment.provider_ref.clone().expect("the PaymentIntent");
    let at_stripe: Value = reqwest::Client::new()
        .get(format!("{}/v1/payment_intents/{pi}", world.provider.url()))
        .bearer_auth("sk_test_cobro_stripe")
        .header("stripe-version", fake_provider::STRIPE_API_VERSION)
        .send()
        .await
        .expect("GET the PaymentIntent")
        .json()
        .await
        .expect("json");
    assert_eq!(at_stripe["status"], "requires_action", "{at_stripe}");
    assert_eq!(at_stripe["metadata"]["cobro_payment"], stripe_id.as_str());
    let ledger = world.ledger();
    assert_eq!(
        ledger.totals,
        fake_provider::Effects::default(),
        "{ledger:?}"
    );
    assert!(ledger.charges.is_empty());
    wait_for(
        "the fake saw payment_intent.requires_action acknowledged",
        Duration::from_secs(10),
        async || {
            let deliveries = world.provider.control().webhook_deliveries();
            deliveries
                .iter()
                .any(|d| d.event_type == "payment_intent.requires_action" && d.status == Some(200))
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        world.payment(true, &stripe_id).await.status.to_string(),
        "requires_action"
    );
    let records = world.records(&stripe_id).await;
    assert_eq!(records.conflicts, 0, "{records:?}");
}

/// Stripe cancels a PaymentIntent left uncaptured for seven days
/// (`cancellation_reason: automatic`; the fake's Stripe does it as its
/// clock passes). Its `payment_intent.canceled` moves the authorized
/// payment to `canceled`, with the merchant's `payment.canceled` event and
/// a `provider_voided` decision, instead of leaving it `authorized`
/// forever; a capture asked for afterwards is refused by cobro and never
/// reaches Stripe.
async fn a_payment_intent_stripe_cancels_after_seven_days_cancels_the_payment(backend: Backend) {
    let world = World::new(backend).await;
    world.send_stripe_webhooks();
    let mut body = payment_body("o-1");
    body["capture_method"] = json!("manual");
    let on_stripe = world.post(true, "/v1/payments", "k-1", &body).await;
    assert_eq!(
        world.drain("stripe").await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let stripe_id = id(&on_stripe);
    // The authorisation's own event first, so the cancel is the news.
    wait_for(
        "the fake saw payment_intent.amount_capturable_updated acknowledged",
        Duration::from_secs(10),
        async || {
            let deliveries = world.provider.control().webhook_deliveries();
            deliveries
                .iter()
                .any(|d| {
                    d.event_type == "payment_intent.amount_capturable_updated"
                        && d.status == Some(200)
                })
                .then_some(())
        },
    )
    .await;
    // Seven days pass on both clocks (cobro's first: the event is never
    // signed ahead of it).
    let week = Duration::from_secs(7 * 24 * 3600 + 60);
    world
        .app
        .clock
        .advance(chrono::Duration::from_std(week).expect("week"));
    world.provider.control().advance_clock(week);
    wait_for(
        "the payment is canceled",
        Duration::from_secs(20),
        async || {
            let p = world.payment(true, &stripe_id).await;
            (p.status.to_string() == "canceled").then_some(())
        },
    )
    .await;
    let records = world.records(&stripe_id).await;
    assert_eq!(
        records.events.last().map(String::as_str),
        Some("payment.canceled"),
        "{records:?}"
    );
    assert_eq!(
        records.decisions.last(),
        Some(&cobro_core::Decision::ProviderVoided),
        "{records:?}"
    );
    assert_eq!(records.conflicts, 0, "{records:?}");
    // Nothing left to capture: refused here, never sent.
    let refused = world
        .app
        .post_as(
            &world.stripe_token,
            &format!("/v1/payments/{stripe_id}/capture"),
            Some("cap-1"),
        )
        .json(&json!({}))
        .send()
        .await
        .expect("send");
    assert!(refused.status().is_client_error(), "{}", refused.status());
    assert_eq!(world.drain("stripe").await, vec![]);
    let ledger = world.ledger();
    assert_eq!(
        (
            ledger.totals.charges,
            ledger.totals.voids,
            ledger.totals.captures
        ),
        (1, 1, 0),
        "{ledger:?}"
    );
}

/// A refund Stripe reports `failed` after it had succeeded (`refund.failed`:
/// the card's account was closed, say; the fake fails it on demand). cobro's
/// refund becomes `failed`, its amount refundable again (the payment back
/// to `captured`), the merchant gets `refund.failed`, and a new refund of
/// the whole amount is made, once.
async fn a_refund_stripe_fails_after_it_succeeded_is_failed_and_refundable_again(backend: Backend) {
    let world = World::new(backend).await;
    world.send_stripe_webhooks();
    let mut body = payment_body("o-1");
    body["amount"] = json!(1000);
    let on_stripe = world.post(true, "/v1/payments", "k-1", &body).await;
    world.drain("stripe").await;
    let stripe_id = id(&on_stripe);
    let refunds = format!("/v1/payments/{stripe_id}/refunds");
    world
        .post(true, &refunds, "ref-1", &json!({"amount": 400}))
        .await;
    assert_eq!(
        world.drain("stripe").await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let payment = world.payment(true, &stripe_id).await;
    assert_eq!(
        (payment.status.to_string(), payment.amount_refunded),
        ("partially_refunded".to_owned(), 400)
    );
    let charge = world
        .ledger()
        .charge_of_payment_intent(payment.provider_ref.as_deref().expect("intent"))
        .expect("charge")
        .id
        .clone();
    let refund = world.ledger().refunds_of_charge(&charge)[0].id.clone();

    assert!(world.provider.control().fail_refund(&refund));
    let payment = wait_for(
        "the refund failed and its amount is refundable again",
        Duration::from_secs(20),
        async || {
            let p = world.payment(true, &stripe_id).await;
            (p.status.to_string() == "captured").then_some(p)
        },
    )
    .await;
    assert_eq!(
        (payment.amount_refunded, payment.amount_refund_reserved),
        (0, 0)
    );
    let records = world.records(&stripe_id).await;
    assert!(
        records
            .events
            .ends_with(&["refund.failed".to_owned(), "payment.captured".to_owned()]),
        "{records:?}"
    );
    assert_eq!(
        records.decisions.last(),
        Some(&cobro_core::Decision::ProviderFailedRefund),
        "{records:?}"
    );
    assert_eq!(records.conflicts, 0, "{records:?}");

    // The whole amount is refundable again: refunded once more, once.
    world
        .post(true, &refunds, "ref-2", &json!({"amount": 1000}))
        .await;
    assert_eq!(
        world.drain("stripe").await,
        vec![Step::Recorded { class: "succeeded" }]
    );
    let payment = world.payment(true, &stripe_id).await;
    assert_eq!(
        (payment.status.to_string(), payment.amount_refunded),
        ("refunded".to_owned(), 1000)
    );
    let ledger = world.ledger();
    assert_eq!(
        (ledger.totals.refunds, ledger.totals.refund_failures),
        (2, 1),
        "{ledger:?}"
    );
    let charge = ledger
        .charge_of_payment_intent(payment.provider_ref.as_deref().expect("intent"))
        .expect("charge");
    assert_eq!(charge.amount_refunded, 1000);
}

/// A webhook proves things only about its own provider's attempts. An
/// event received at Stripe's route, signed with Stripe's secret, that
/// names an attempt sent to the fake provider (its reference, account,
/// payment and attempt, with the right amount) is kept unmatched: it never
/// settles that payment, which its own provider's answer settles, with its
/// own charge.
async fn a_webhook_settles_only_its_own_providers_attempts(backend: Backend) {
    let world = World::new(backend).await;
    drop_next_charge_answer(&world);
    let on_fake = world
        .post(false, "/v1/payments", "k-1", &payment_body("o-1"))
        .await;
    assert_eq!(
        world.drain("fake").await,
        vec![Step::Rescheduled { class: "unknown" }]
    );
    let fake_id = id(&on_fake);
    let attempt = world.attempts(&fake_id).await.remove(0);
    let intent = json!({
        "id": "pi_not_the_fakes", "object": "payment_intent", "amount": 1999,
        "amount_received": 1999, "capture_method": "automatic", "currency": "eur",
        "created": world.app.clock.now().timestamp(), "latest_charge": "ch_not_the_fakes",
        "last_payment_error": null, "livemode": false, "status": "succeeded",
        "metadata": {
            "cobro_account": world.app.account.to_string(),
            "cobro_payment": fake_id,
            "cobro_intent": "o-1:authorize-v1",
            "cobro_attempt": attempt.id.to_string(),
            "cobro_reference": attempt.reference,
        },
    });
    let t = world.app.clock.now().timestamp();
    let event = json!({
        "id": "evt_cross", "object": "event", "type": "payment_intent.succeeded",
        "created": t, "api_version": fake_provider::STRIPE_API_VERSION, "livemode": false,
        "data": {"object": intent},
    });
    let body = serde_json::to_vec(&event).expect("json");
    let receipt: Value = reqwest::Client::new()
        .post(format!("{}/v1/webhooks/stripe", world.app.url))
        .header("content-type", "application/json")
        .header(
            "stripe-signature",
            fake_provider::sign(STRIPE_WEBHOOK_SECRET, t, &body),
        )
        .body(body)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("receipt");
    assert_eq!(receipt["outcome"], "unmatched", "{receipt}");
    let payment = world.payment(false, &fake_id).await;
    assert_eq!(payment.status.to_string(), "processing");
    assert_eq!(payment.provider_ref, None);
    // Its own provider settles it: the retry, due after its backoff,
    // replays the fake's charge under the same key.
    world.app.clock.advance(chrono::Duration::seconds(2));
    world.drain("fake").await;
    let payment = world.payment(false, &fake_id).await;
    assert_eq!(payment.status.to_string(), "captured");
    let charge = payment.provider_ref.expect("the fake's charge");
    assert!(
        charge.starts_with("ch_") && charge != "ch_not_the_fakes",
        "{charge}"
    );
    assert_eq!(world.ledger().totals.charges, 1);
}

on_both_backends!(
    a_webhook_settles_only_its_own_providers_attempts,
    a_refund_stripe_fails_after_it_succeeded_is_failed_and_refundable_again,
    a_payment_intent_stripe_cancels_after_seven_days_cancels_the_payment,
    each_account_is_charged_through_its_own_providers_api,
    a_capture_and_a_refund_of_a_stripe_payment_go_to_stripe,
    the_stripe_reconciler_adopts_a_charge_whose_answer_was_lost,
    a_stripe_signed_webhook_is_applied_at_its_providers_route,
    a_stripe_500_saying_not_to_retry_is_handed_to_the_reconciler_without_a_resend,
    a_replayed_stripe_500_is_handed_to_the_reconciler_at_its_first_replay,
    a_payment_intent_waiting_for_the_customer_is_kept_at_stripe,
);
