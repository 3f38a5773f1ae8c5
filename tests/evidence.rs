//! Evidence and identity (docs/evidence.md §7): regressions
//! for every defect of "Proof, not resemblance", on both backends, with the
//! real store, worker, reconciler and the fake provider over HTTP. Each test
//! counts the effects in the provider's ledger.

use chrono::Duration;
use cobro_core::{Clock, PaymentId};
use cobro_provider::Connector;
use cobro_reconciler::{
    ManualOutcome, ManualResolution, Reconciler, ReconcilerConfig, ResolveError, Scope, Verdict,
};
use cobro_settle::{Applied, Proof, Source, apply_proof};
use cobro_store::StoreError;
use cobro_test_support::{
    Backend, Dialect, RIG_SECRET_KEY, Rig, double_charges, manual_payment_body, on_both_backends,
    on_every_provider, payment_body,
};
use cobro_worker::Step;
use fake_provider::{FaultAction, FaultRule, Operation as FOp};
use serde_json::{Value, json};

mod dialects {
    use super::*;
    on_every_provider!(
        two_accounts_with_one_order_ref_never_share_a_charge,
        needs_review_blocks_every_new_send_and_the_operator_names_the_attempt,
        a_recovered_provider_is_drained_without_new_traffic,
        a_charge_for_an_attempt_recorded_no_effect_stops_the_line,
        a_capture_retried_after_no_effect_is_not_a_conflict_when_a_late_reconciler_sees_it,
        a_run_pages_through_every_candidate,
    );
}

// Fake dialect only, by their API shape: they act at the provider through
// the fake's own API (a dashboard capture, a charge made behind cobro's
// back) or keep a stale worker's answer in the fake's object shape.
on_both_backends!(
    a_refused_void_ends_with_the_providers_truth_once,
    a_refused_void_whose_truth_the_payment_cannot_take_stops_the_line,
    a_void_event_is_never_taken_for_a_held_cancel,
    a_charge_event_for_a_no_effect_attempt_is_not_stale_behind_its_retrys_charge,
    a_capture_event_of_another_charge_is_not_taken_for_the_open_capture,
    a_refund_the_provider_makes_late_after_no_effect_stops_the_line,
    a_refund_whose_first_attempt_refunded_late_is_never_failed_on_its_retry,
    an_operators_no_money_verdict_is_refused_over_a_charge_made_past_the_window,
    the_reconciler_reads_what_a_stale_worker_kept,
    a_charge_sent_and_never_recorded_is_found_with_no_worker_left,
    a_decline_beside_an_object_still_in_progress_proves_nothing,
    a_charge_held_in_the_providers_queue_is_never_taken_for_absence,
    a_held_charge_the_provider_abandoned_is_proven_absent_past_its_lifetime,
    a_charge_the_provider_made_late_in_its_lifetime_is_found_past_it,
    the_books_never_call_a_charge_the_provider_made_late_missing,
    an_operators_no_money_verdict_is_refused_over_a_charge_made_late_in_its_lifetime,
);

fn reconciler(rig: &Rig, tweak: impl FnOnce(&mut ReconcilerConfig)) -> Reconciler<Connector> {
    rig.reconciler(tweak)
}

async fn reconcile(rig: &Rig, scope: Scope) -> cobro_reconciler::Summary {
    reconciler(rig, |_| {})
        .run(&scope, false, "test", &|_, _| {})
        .await
        .expect("run")
}

fn every_candidate_now() -> Scope {
    Scope {
        older_than: Some(std::time::Duration::ZERO),
        ..Default::default()
    }
}

/// The provider's charge for cobro's `provider_ref` as the ledger knows
/// it (a Stripe-dialect PaymentIntent: the charge its confirmation made).
fn charge(rig: &Rig, id: &str) -> fake_provider::LedgerCharge {
    rig.ledger_charge(id)
        .unwrap_or_else(|| panic!("the provider has no charge {id}"))
}

/// Creates a payment (key `k-1`) whose authorisation is never executed
/// (503 on every send, until the fault is cleared) and lets the window
/// pass: the attempt is handed to the reconciler. Its id.
async fn handed_over(rig: &Rig, body: &Value) -> String {
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailBeforeEffect));
    let p = rig.create_payment("k-1", body).await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(1).await;
    rig.pass_the_key_window().await;
    id
}

/// One `effect_after_no_effect` conflict is kept and the payment is in
/// review: the line stopped for a charge its record denies.
async fn assert_stopped_for_an_effect_after_no_effect(rig: &Rig, id: &str) {
    assert_eq!(
        rig.app
            .db
            .count("evidence_conflicts WHERE kind = 'effect_after_no_effect'")
            .await,
        1
    );
    assert_eq!(rig.payment(id).await["status"], "needs_review");
}

/// The secret the tests' hand-signed fake events are signed with.
const WEBHOOK_SECRET: &str = "whsec_test_cobro";

/// A rig whose API takes the fake's events signed with
/// [`WEBHOOK_SECRET`] (the provider sends none by itself: the test does).
async fn rig_taking_signed_events(backend: Backend) -> Rig {
    let mut rig = Rig::new(backend).await;
    rig.accept_webhooks(WEBHOOK_SECRET, false).await;
    rig
}

/// Runs the reconciler past its threshold over the one attempt handed
/// over to it: proven to have done nothing, it is retried under a new key.
async fn proven_no_effect_and_retried(rig: &Rig) {
    rig.app.clock.advance(Duration::minutes(2));
    let summary = reconcile(rig, Scope::default()).await;
    assert_eq!(summary.items[0].verdict, Verdict::Retried, "{summary:?}");
}

/// A second merchant's account, and its payment for `order_ref` (key
/// `b-1`), created and run through the worker: its account, its token and
/// the payment as created.
async fn merchant_b_pays(rig: &Rig, order_ref: &str) -> (cobro_core::AccountId, String, Value) {
    let (account, token) = rig.app.new_account("merchant-b").await;
    let r = rig
        .app
        .post_as(&token, "/v1/payments", Some("b-1"))
        .json(&payment_body(order_ref))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 201);
    let payment: Value = r.json().await.expect("json");
    rig.drain(2).await;
    (account, token, payment)
}

async fn two_accounts_with_one_order_ref_never_share_a_charge(backend: Backend, dialect: Dialect) {
    let rig = Rig::new_in(backend, dialect).await;
    // Account B pays its ord-1.
    let (_, token_b, b) = merchant_b_pays(&rig, "ord-1").await;
    // B's charge as the provider names it to cobro (a charge or a
    // PaymentIntent id): its only one so far.
    let b_charge = match dialect {
        Dialect::Fake => rig.ledger().charges[0].id.clone(),
        Dialect::Stripe => rig
            .ledger()
            .payment_intents
            .keys()
            .next()
            .expect("b's PaymentIntent")
            .clone(),
    };

    // Account A pays its own ord-1; its attempt goes unknown.
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailBeforeEffect));
    let a = rig.create_payment("a-1", &payment_body("ord-1")).await;
    let a_id = a["id"].as_str().expect("id");
    rig.drain(1).await;
    // The release adopted B's charge here: same intent name, one API key.
    rig.app.clock.advance(Duration::milliseconds(50));
    let summary = reconcile(&rig, every_candidate_now()).await;
    assert_eq!(summary.examined, 1);
    assert!(
        matches!(summary.items[0].verdict, Verdict::StillUnknown { .. }),
        "{:?}",
        summary.items[0].verdict
    );
    let a_now = rig.payment(a_id).await;
    assert_eq!(a_now["status"], "processing");
    assert_eq!(a_now["provider_ref"], Value::Null);

    // The provider recovers: A gets a charge of its own.
    rig.provider.control().clear_faults();
    rig.app.clock.advance(Duration::seconds(2));
    rig.drain(3).await;
    let a_now = rig.payment(a_id).await;
    assert_eq!(a_now["status"], "captured");
    let a_charge = a_now["provider_ref"].as_str().expect("ref").to_owned();
    assert_ne!(a_charge, b_charge);
    let mine = charge(&rig, &a_charge);
    assert_eq!(mine.metadata["cobro_payment"], a_id);
    assert_ne!(
        mine.metadata["cobro_account"],
        charge(&rig, &b_charge).metadata["cobro_account"]
    );

    // A refunds: the money comes off A's charge, never B's.
    let r = rig
        .app
        .post(&format!("/v1/payments/{a_id}/refunds"), Some("ra-1"))
        .json(&json!({"amount": 700}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 201);
    rig.drain(2).await;
    let ledger = rig.ledger();
    assert_eq!(ledger.refunds_of_charge(&mine.id).len(), 1);
    assert!(
        ledger
            .refunds_of_charge(&charge(&rig, &b_charge).id)
            .is_empty()
    );
    assert_eq!(ledger.totals.charges, 2);
    assert!(
        double_charges(&ledger).is_empty(),
        "{:?}",
        double_charges(&ledger)
    );
    let b_view = rig
        .app
        .client
        .get(format!(
            "{}/v1/payments/{}",
            rig.app.url,
            b["id"].as_str().expect("id")
        ))
        .bearer_auth(&token_b)
        .send()
        .await
        .expect("get")
        .json::<Value>()
        .await
        .expect("json");
    assert_eq!(b_view["provider_ref"], b_charge);
    assert_eq!(b_view["amount_refunded"], 0);
}

async fn needs_review_blocks_every_new_send_and_the_operator_names_the_attempt(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    let id = handed_over(&rig, &payment_body("o-1")).await;
    // The provider cannot be asked; past the horizon it needs review.
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Search, FaultAction::FailBeforeEffect));
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::List, FaultAction::FailBeforeEffect));
    rig.app.clock.advance(Duration::hours(2));
    let summary = reconcile(&rig, Scope::default()).await;
    assert_eq!(summary.items[0].verdict, Verdict::Escalated);
    assert_eq!(rig.payment(&id).await["status"], "needs_review");

    // The provider recovers and proves no effect: recorded, nothing enabled.
    rig.provider.control().clear_faults();
    rig.app.clock.advance(Duration::minutes(2));
    let summary = reconcile(&rig, Scope::default()).await;
    assert_eq!(summary.items[0].verdict, Verdict::NoEffectInReview);
    assert_eq!(rig.attempts(&id).await.len(), 1, "no new attempt");
    assert!(rig.drain(3).await.is_empty(), "nothing to send");
    assert_eq!(rig.payment(&id).await["status"], "needs_review");
    // The schema refuses a sendable attempt for it, whatever the code does.
    let pid: PaymentId = id.parse().expect("id");
    let mut tx = rig.app.db.store.begin().await.expect("begin");
    let attempt = rig.attempts(&id).await.remove(0);
    let new_id = cobro_core::AttemptId::new();
    let refused = tx
        .enqueue_attempt(
            &cobro_store::NewAttempt {
                id: new_id,
                intent: attempt.intent_id,
                payment: pid,
                refund: None,
                operation: cobro_core::Operation::Authorize,
                provider_key: "forced".into(),
                reference: cobro_core::attempt_reference("o-1:authorize-v1", new_id),
            },
            rig.app.clock.now(),
            rig.app.clock.now(),
        )
        .await;
    assert!(
        matches!(refused, Err(StoreError::SendBlocked)),
        "{refused:?}"
    );
    drop(tx);

    // The operator names the attempt it resolves.
    let resolution = |attempt| ManualResolution {
        payment: pid,
        attempt,
        outcome: ManualOutcome::Failed,
        provider_ref: None,
        operator: "alice".into(),
        reason: "no charge at the provider".into(),
        invoked_by: "test@host".into(),
        verified: None,
    };
    let wrong = cobro_reconciler::resolve_by_hand(
        &rig.app.db.store,
        &resolution(cobro_core::AttemptId::new()),
        rig.app.clock.now(),
    )
    .await;
    assert!(wrong.is_err(), "another payment's or no attempt is refused");
    let after = cobro_reconciler::resolve_by_hand(
        &rig.app.db.store,
        &resolution(attempt.id),
        rig.app.clock.now(),
    )
    .await
    .expect("resolve");
    assert_eq!(after, "failed");
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 0, "never charged");
}

/// The charge is captured at the provider behind cobro's back (its
/// dashboard, another system), through the provider's own API.
async fn dashboard_capture(rig: &Rig, charge_id: &str) {
    let captured = rig
        .app
        .client
        .post(format!(
            "{}/v1/charges/{charge_id}/capture",
            rig.provider.url()
        ))
        .bearer_auth("sk_test_cobro")
        .header("idempotency-key", "dashboard-capture")
        .send()
        .await
        .expect("capture");
    assert_eq!(captured.status().as_u16(), 200);
}

async fn a_refused_void_ends_with_the_providers_truth_once(backend: Backend) {
    let rig = Rig::new(backend).await;
    // The charge is made, its answer lost: the payment stays processing.
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailAfterEffect).with_next(1));
    let p = rig.create_payment("k-1", &manual_payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(1).await;
    let r = rig
        .app
        .post(&format!("/v1/payments/{id}/cancel"), Some("c-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 202);
    // Meanwhile the authorisation is captured at the provider (its
    // dashboard, another system): a void can no longer succeed.
    let charge_id = rig.ledger().charges[0].id.clone();
    dashboard_capture(&rig, &charge_id).await;

    rig.app.clock.advance(Duration::seconds(2));
    let steps = rig.drain(6).await;
    assert!(!steps.is_empty());
    let p = rig.payment(&id).await;
    assert_eq!(p["status"], "captured", "the provider's truth");
    // Nothing keeps going: no second cancel intent, no loop.
    rig.app.clock.advance(Duration::seconds(30));
    assert!(rig.drain(6).await.is_empty());
    assert_eq!(
        rig.app
            .db
            .count("intents WHERE operation = 'payment.cancel'")
            .await,
        1
    );
    assert_eq!(
        rig.app
            .db
            .count("attempts WHERE operation = 'payment.cancel' AND state = 'failed'")
            .await,
        1
    );
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1);
    assert_eq!(ledger.totals.voids, 0);
    assert_eq!(ledger.totals.captures, 1);
}

/// Found by the explorer's soak (seed 13771, 2026-12-03): a cancel's void
/// still waits to go out when an operator resolves the payment
/// `authorized`; the charge is then captured at the provider (a
/// dashboard), the void goes out and is refused with the charge captured.
/// The payment cannot go `authorized -> captured`, and the refusal was
/// only logged: the payment said `authorized` over a captured charge that
/// cobro's own void had just learned of. It is a conflict now.
async fn a_refused_void_whose_truth_the_payment_cannot_take_stops_the_line(backend: Backend) {
    let rig = Rig::new(backend).await;
    let p = rig.create_payment("k-1", &manual_payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(1).await;
    assert_eq!(rig.payment(&id).await["status"], "authorized");
    let r = rig
        .app
        .post(&format!("/v1/payments/{id}/cancel"), Some("c-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 202);
    // The payment is stopped (any conflict) and an operator resolves it
    // `authorized` from the provider's truth, naming the authorisation;
    // the void has not gone out.
    let attempts = rig.attempts(&id).await;
    let (authorize, cancel) = (&attempts[0], &attempts[1]);
    let pid: PaymentId = id.parse().expect("payment id");
    let mut tx = rig.app.db.store.begin().await.expect("begin");
    let source = Source {
        name: "test",
        said: "{}",
    };
    cobro_settle::stop_the_line(
        &mut tx,
        Some(cancel),
        Some(pid),
        cobro_store::conflicts::ConflictKind::Unmatched,
        "a conflict for the operator",
        &source,
        rig.app.clock.now(),
    )
    .await
    .expect("stop the line");
    tx.commit().await.expect("commit");
    let charge_id = rig.ledger().charges[0].id.clone();
    let resolution = ManualResolution {
        payment: pid,
        attempt: authorize.id,
        outcome: ManualOutcome::Authorized,
        provider_ref: Some(charge_id.clone()),
        operator: "alice".into(),
        reason: "the charge is authorized".into(),
        invoked_by: "test@host".into(),
        verified: None,
    };
    let after =
        cobro_reconciler::resolve_by_hand(&rig.app.db.store, &resolution, rig.app.clock.now())
            .await
            .expect("resolve");
    assert_eq!(after, "authorized");
    let conflicts = rig.app.db.count("evidence_conflicts").await;
    // A dashboard captures the charge; then the void goes out.
    dashboard_capture(&rig, &charge_id).await;
    rig.app.clock.advance(Duration::seconds(2));
    rig.drain(6).await;
    let p = rig.payment(&id).await;
    assert_eq!(
        p["status"], "needs_review",
        "never `authorized` over a captured charge"
    );
    assert_eq!(
        rig.app.db.count("evidence_conflicts").await,
        conflicts + 1,
        "the refusal's truth is kept as a conflict"
    );
    assert_eq!(
        rig.app
            .db
            .count("evidence_conflicts WHERE kind = 'other_object' AND detail LIKE '%shows the charge captured%'")
            .await,
        1
    );
    // The void did go out, and its refusal settled the cancel attempt.
    assert_eq!(
        rig.app
            .db
            .count("attempts WHERE operation = 'payment.cancel' AND state = 'failed' AND send_count = 1")
            .await,
        1
    );
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1);
    assert_eq!(ledger.totals.captures, 1);
    assert_eq!(ledger.totals.voids, 0);
}

async fn a_recovered_provider_is_drained_without_new_traffic(backend: Backend, dialect: Dialect) {
    let rig = Rig::with_in(backend, dialect, |_, config| {
        config.retry_max = 2.0;
        config.retry_per_second = 0.5;
    })
    .await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailBeforeEffect));
    let mut ids = Vec::new();
    for i in 0..6 {
        let p = rig
            .create_payment(&format!("k-{i}"), &payment_body(&format!("o-{i}")))
            .await;
        ids.push(p["id"].as_str().expect("id").to_owned());
    }
    rig.drain(1).await;
    // The outage spends the budget: retries wait instead of multiplying.
    rig.app.clock.advance(Duration::seconds(2));
    let steps = rig.drain(1).await;
    assert!(steps.contains(&Step::BudgetWait), "{steps:?}");
    // The provider recovers; no new payment arrives. Time alone refills
    // the budget and the backlog drains.
    rig.provider.control().clear_faults();
    for _ in 0..20 {
        rig.app.clock.advance(Duration::seconds(5));
        rig.drain(3).await;
    }
    for id in &ids {
        assert_eq!(rig.payment(id).await["status"], "captured", "{id}");
    }
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 6);
    assert!(double_charges(&ledger).is_empty());
}

async fn a_charge_for_an_attempt_recorded_no_effect_stops_the_line(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    let id = handed_over(&rig, &payment_body("o-1")).await;
    proven_no_effect_and_retried(&rig).await;
    let first = rig.attempts(&id).await.remove(0);
    assert_eq!(first.state.as_str(), "no_effect");

    // Evidence arrives that the first attempt did charge after all.
    let mut tx = rig.app.db.store.begin().await.expect("begin");
    let proof = Proof::Succeeded {
        provider_ref: "ch_late".into(),
        captured: true,
    };
    let source = Source {
        name: "webhook:fake",
        said: r#"{"id":"ch_late"}"#,
    };
    let applied = apply_proof(&mut tx, &first, &proof, &source, rig.app.clock.now())
        .await
        .expect("apply");
    tx.commit().await.expect("commit");
    assert!(matches!(applied, Applied::Conflict { .. }), "{applied:?}");
    assert_stopped_for_an_effect_after_no_effect(&rig, &id).await;
    // The retry that was scheduled is blocked: the line stopped.
    rig.provider.control().clear_faults();
    let steps = rig.drain(2).await;
    assert_eq!(steps, [Step::Blocked]);
    assert_eq!(rig.ledger().totals.charges, 0);
}

/// A cancel asked for while the authorisation is unknown is held (never
/// sent) until the authorisation is proven. Here the authorisation is
/// proven to have done nothing and is retried, so the cancel stays held
/// for the retry. A `charge.voided` event then names the first
/// authorisation: it cannot be about the held cancel, which the provider
/// never saw. It is about the attempt it names, recorded no effect, so it
/// is a conflict that stops the line; the held cancel stays held and
/// nothing is charged or voided.
async fn a_void_event_is_never_taken_for_a_held_cancel(backend: Backend) {
    let rig = rig_taking_signed_events(backend).await;
    let id = handed_over(&rig, &manual_payment_body("o-1")).await;
    rig.post_ok(&format!("/v1/payments/{id}/cancel"), "c-1", json!({}))
        .await;
    proven_no_effect_and_retried(&rig).await;
    let state_of = async |operation: &str| -> Vec<String> {
        rig.attempts(&id)
            .await
            .into_iter()
            .filter(|a| a.operation.as_str() == operation)
            .map(|a| a.state.as_str().to_owned())
            .collect()
    };
    assert_eq!(
        state_of("payment.authorize").await,
        ["no_effect", "pending"]
    );
    assert_eq!(state_of("payment.cancel").await, ["held"]);
    let first = rig.attempts(&id).await.remove(0);

    let event = fake_charge_event("evt_void", "voided", "ch_elsewhere", &first.reference, 2);
    assert_eq!(deliver_fake_event(&rig, &event).await, "conflict");
    assert_stopped_for_an_effect_after_no_effect(&rig, &id).await;
    assert_eq!(state_of("payment.cancel").await, ["held"]);
    rig.provider.control().clear_faults();
    assert_eq!(rig.drain(2).await, [Step::Blocked]);
    let ledger = rig.ledger();
    assert_eq!((ledger.totals.charges, ledger.totals.voids), (0, 0));
}

/// A `charge.*` event in the fake's shape about charge `id` under
/// `reference`, with the charge's own event sequence.
fn fake_charge_event(
    event_id: &str,
    kind: &str,
    id: &str,
    reference: &str,
    sequence: i64,
) -> Value {
    json!({
        "id": event_id, "type": format!("charge.{kind}"), "created": "2026-11-30T12:00:00Z",
        "sequence": sequence,
        "data": {"id": id, "object": "charge", "amount": 1999, "currency": "EUR",
                 "payment_method": "pm_card_visa", "reference": reference,
                 "status": kind, "amount_captured": if kind == "captured" { 1999 } else { 0 },
                 "amount_refunded": 0, "created": "2026-11-30T12:00:00Z", "sequence": sequence},
    })
}

/// One object as the fake provider shows it (`GET /v1/{kind}/{id}`).
async fn fake_object(rig: &Rig, kind: &str, id: &str) -> Value {
    rig.app
        .client
        .get(format!("{}/v1/{kind}/{id}", rig.provider.url()))
        .bearer_auth(RIG_SECRET_KEY)
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("object")
}

/// The outcome cobro answers for a hand-signed fake event.
async fn deliver_fake_event(rig: &Rig, event: &Value) -> String {
    let receipt: Value = rig
        .post_fake_event(WEBHOOK_SECRET, serde_json::to_vec(event).expect("json"))
        .await
        .expect("send")
        .json()
        .await
        .expect("receipt");
    receipt["outcome"]
        .as_str()
        .unwrap_or_else(|| panic!("{receipt}"))
        .to_owned()
}

/// The provider numbers each charge's events on its own. An authorisation
/// proven to have done nothing is retried; the retry's charge and its
/// event (sequence 2) are recorded. Then an event of another charge
/// arrives, naming the first attempt: a charge the provider made after
/// all, the double charge the no-effect record denies. Its sequence (1) is
/// that charge's, not behind the retry's charge: it is evidence against
/// the no-effect record (a conflict that stops the line), never "stale".
async fn a_charge_event_for_a_no_effect_attempt_is_not_stale_behind_its_retrys_charge(
    backend: Backend,
) {
    let rig = rig_taking_signed_events(backend).await;
    // Another merchant's payment for the same order ref, charged and
    // recorded: the events below must never touch it.
    let (account_b, _, b) = merchant_b_pays(&rig, "o-1").await;
    let b_id: PaymentId = b["id"].as_str().expect("id").parse().expect("uuid");
    let b_row = async || {
        let row = rig
            .app
            .db
            .store
            .payment_for_account(account_b, b_id)
            .await
            .expect("read")
            .expect("B's payment");
        format!("{row:?}")
    };
    let b_before = b_row().await;
    assert!(b_before.contains("status: Captured"), "{b_before}");
    let id = handed_over(&rig, &payment_body("o-1")).await;
    proven_no_effect_and_retried(&rig).await;
    rig.provider.control().clear_faults();
    rig.drain(3).await;
    let payment = rig.payment(&id).await;
    assert_eq!(payment["status"], "captured");
    let retry_charge = payment["provider_ref"].as_str().expect("charge").to_owned();
    let attempts = rig.attempts(&id).await;
    let (first, retry) = (&attempts[0].reference, &attempts[1].reference);

    // The retry's charge's event: what the worker already recorded.
    let event = fake_charge_event("evt_b2", "captured", &retry_charge, retry, 2);
    assert_eq!(deliver_fake_event(&rig, &event).await, "duplicate_effect");
    // Another charge, under the first attempt's reference.
    let late = fake_charge_event("evt_a1", "captured", "ch_late", first, 1);
    assert_eq!(deliver_fake_event(&rig, &late).await, "conflict");
    assert_stopped_for_an_effect_after_no_effect(&rig, &id).await;
    // The retry's charge's own order still holds: its older event is stale.
    let old = fake_charge_event("evt_b1", "captured", &retry_charge, retry, 1);
    assert_eq!(deliver_fake_event(&rig, &old).await, "ignored_stale");
    // Merchant B's payment is untouched; each account has its one charge.
    assert_eq!(b_row().await, b_before);
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 2);
    assert!(
        double_charges(&ledger).is_empty(),
        "{:?}",
        double_charges(&ledger)
    );
}

/// A charge the provider makes past the attempt's window: held in its
/// queue (no answer, key reserved), the attempt proven without effect and
/// retried (the retry softly declined, so that nothing cobro recorded says
/// money moved), then the held request let through. cobro keeps its event
/// as a conflict, and the operator's check does not take the window's
/// empty list over it: "failed" (no money moved) is refused while the
/// conflict is kept, by the check and again in the resolution's own
/// transaction (which an unverified verdict, or a conflict kept after the
/// check passed, reaches), and the late charge, named, is read by its id
/// and found to be the attempt's own. Before the fix (explorer seed 32747)
/// the check read only the window: it accepted "failed" and refused the
/// true "captured".
async fn an_operators_no_money_verdict_is_refused_over_a_charge_made_past_the_window(
    backend: Backend,
) {
    let rig = rig_taking_signed_events(backend).await;
    let control = rig.provider.control();
    control.add_fault(FaultRule::new(FOp::Charge, FaultAction::HoldEffect).with_next(1));
    let id = rig.create_payment("k-1", &payment_body("o-1")).await["id"]
        .as_str()
        .expect("id")
        .to_owned();
    rig.drain(1).await;
    assert_eq!((control.held(), rig.ledger().charges.len()), (1, 0));
    rig.pass_the_key_window().await;
    control.add_fault(FaultRule::new(FOp::Charge, FaultAction::SoftDecline).with_next(1));
    proven_no_effect_and_retried(&rig).await;
    rig.drain(2).await;
    assert_eq!(rig.ledger().totals.declines, 1, "the retry was declined");
    assert_eq!(rig.payment(&id).await["status"], "declined");

    // An hour on at the provider (inside its key retention, so the
    // request is still held), it lets the request through: the charge is
    // made an hour after the attempt's window.
    control.advance_clock(std::time::Duration::from_secs(3600));
    assert_eq!(control.release_held(), 1);
    let first = rig.attempts(&id).await.remove(0);
    let ledger = rig.ledger();
    assert_eq!(ledger.charges.len(), 2, "the provider's late double");
    let late = ledger
        .charges
        .iter()
        .find(|c| c.idempotency_key.as_deref() == Some(first.provider_key.as_str()))
        .expect("the late charge, under the first attempt's key");
    let charge = fake_object(&rig, "charges", &late.id).await;
    let event = json!({"id": "evt_late_charge",
        "type": format!("charge.{}", charge["status"].as_str().expect("status")),
        "created": "2026-11-30T12:00:00Z", "sequence": charge["sequence"], "data": charge});
    assert_eq!(deliver_fake_event(&rig, &event).await, "conflict");
    assert_stopped_for_an_effect_after_no_effect(&rig, &id).await;

    let checker = reconciler(&rig, |_| {});
    let failed = ManualResolution {
        payment: id.parse().expect("payment id"),
        attempt: first.id,
        outcome: ManualOutcome::Failed,
        provider_ref: None,
        operator: "alice".into(),
        reason: "the list shows nothing".into(),
        invoked_by: "alice@desk".into(),
        verified: None,
    };
    let refused = checker.check_verdict(&failed).await;
    assert!(
        matches!(&refused, Err(ResolveError::KeptEffect(_))),
        "{refused:?}"
    );
    // The same rule holds in the resolution's own transaction: a verdict
    // that skipped the check (or a conflict kept after it passed) is
    // refused there, and the conflict stays open.
    let unverified =
        cobro_reconciler::resolve_by_hand(&rig.app.db.store, &failed, rig.app.clock.now()).await;
    assert!(
        matches!(&unverified, Err(ResolveError::KeptEffect(_))),
        "{unverified:?}"
    );
    // A name an unverified verdict gives was never read: it does not lift
    // the rule, even the late charge's own id.
    let named_unverified = ManualResolution {
        provider_ref: Some(late.id.clone()),
        ..failed.clone()
    };
    let refused = cobro_reconciler::resolve_by_hand(
        &rig.app.db.store,
        &named_unverified,
        rig.app.clock.now(),
    )
    .await;
    assert!(
        matches!(&refused, Err(ResolveError::KeptEffect(_))),
        "{refused:?}"
    );
    assert_eq!(
        rig.app
            .db
            .count(
                "evidence_conflicts WHERE kind = 'effect_after_no_effect' AND resolved_at IS NULL"
            )
            .await,
        1,
        "the conflict is still open"
    );
    captured_by_naming_the_late_charge(&rig, &checker, failed, &late.id).await;
    let totals = rig.ledger().totals;
    assert_eq!(
        (totals.charges, totals.declines),
        (1, 1),
        "nothing more charged"
    );
}

/// A captured payment whose refund the provider holds (no answer, its key
/// in progress), handed over past the key window, proven without effect
/// and retried under a new key (the retry not sent yet). Its id.
async fn refund_held_then_retried(rig: &Rig) -> String {
    let id = rig.create_payment("k-1", &payment_body("o-1")).await["id"]
        .as_str()
        .expect("id")
        .to_owned();
    rig.drain(2).await;
    assert_eq!(rig.payment(&id).await["status"], "captured");
    let control = rig.provider.control();
    control.add_fault(FaultRule::new(FOp::Refund, FaultAction::HoldEffect).with_next(1));
    rig.post_ok(
        &format!("/v1/payments/{id}/refunds"),
        "r-1",
        json!({"amount": 500}),
    )
    .await;
    rig.drain(1).await;
    assert_eq!((control.held(), rig.ledger().refunds.len()), (1, 0));
    rig.pass_the_key_window().await;
    proven_no_effect_and_retried(rig).await;
    id
}

/// A refund the provider makes late, after cobro proved it had none. The
/// refund's request is held (`hold_effect`: no answer, its key in
/// progress, nothing in search); the worker hands it over when its key
/// window closes; the reconciler proves it had no effect and retries it
/// under a new key, and the retry refunds. Then the provider lets the held
/// request through: two refunds at the provider for one refund, its own
/// doing. The late refund's event is evidence against the no-effect
/// record: a conflict that stops the line, and nothing more is sent.
async fn a_refund_the_provider_makes_late_after_no_effect_stops_the_line(backend: Backend) {
    let rig = rig_taking_signed_events(backend).await;
    let id = refund_held_then_retried(&rig).await;
    let control = rig.provider.control();
    rig.drain(2).await;
    assert_eq!(rig.ledger().refunds.len(), 1, "the retry refunded");

    assert_eq!(control.release_held(), 1);
    let ledger = rig.ledger();
    assert_eq!((ledger.refunds.len(), ledger.totals.charges), (2, 1));
    let first_key = rig
        .attempts(&id)
        .await
        .into_iter()
        .find(|a| a.refund_id.is_some())
        .expect("the refund's first attempt")
        .provider_key;
    let late = ledger
        .refunds
        .iter()
        .find(|r| r.idempotency_key.as_deref() == Some(first_key.as_str()))
        .expect("the late refund, under the first attempt's key");
    let refund = fake_object(&rig, "refunds", &late.id).await;
    let event = json!({"id": "evt_late_refund", "type": "refund.succeeded",
        "created": "2026-11-30T12:00:00Z", "sequence": refund["sequence"], "data": refund});
    assert_eq!(deliver_fake_event(&rig, &event).await, "conflict");
    assert_stopped_for_an_effect_after_no_effect(&rig, &id).await;
    assert!(rig.drain(3).await.is_empty(), "nothing more is sent");
    assert_eq!(rig.ledger().refunds.len(), 2);
}

/// The late refund of the test above, with the retry's outcome unknown:
/// the refund's first attempt refunded late (a conflict kept on it, the
/// payment in review), and its retry is then proven without effect. The
/// refund is not failed, which would release its amount to be refunded
/// again beside the late refund: the money the provider showed for one
/// attempt is the refund's. An operator's "failed" for the retry is
/// refused too. (Found by a read-only review, 2026-12-07: the rule was
/// kept per attempt, and the retry had no conflict of its own.)
async fn a_refund_whose_first_attempt_refunded_late_is_never_failed_on_its_retry(backend: Backend) {
    let rig = rig_taking_signed_events(backend).await;
    let id = refund_held_then_retried(&rig).await;
    let control = rig.provider.control();
    // The retry's sends all fail before any effect, and it is handed over.
    control.add_fault(FaultRule::new(FOp::Refund, FaultAction::FailBeforeEffect));
    rig.drain(1).await;
    rig.pass_the_key_window().await;
    control.clear_faults();
    assert_eq!(control.release_held(), 1);
    let late = rig.ledger().refunds[0].clone();
    let refund = fake_object(&rig, "refunds", &late.id).await;
    let event = json!({"id": "evt_late_refund", "type": "refund.succeeded",
        "created": "2026-11-30T12:00:00Z", "sequence": refund["sequence"], "data": refund});
    assert_eq!(deliver_fake_event(&rig, &event).await, "conflict");
    assert_stopped_for_an_effect_after_no_effect(&rig, &id).await;

    rig.app.clock.advance(Duration::minutes(2));
    let summary = reconcile(&rig, Scope::default()).await;
    assert!(
        summary
            .items
            .iter()
            .all(|i| i.verdict == Verdict::NoEffectInReview),
        "{summary:?}"
    );
    let in_review = "refunds WHERE status = 'needs_review'";
    assert_eq!(rig.app.db.count(in_review).await, 1, "not failed");
    let retry = rig
        .attempts(&id)
        .await
        .into_iter()
        .rfind(|a| a.refund_id.is_some())
        .expect("the retry");
    let failed = ManualResolution {
        payment: id.parse().expect("payment id"),
        attempt: retry.id,
        outcome: ManualOutcome::Failed,
        provider_ref: None,
        operator: "alice".into(),
        reason: "the retry made nothing".into(),
        invoked_by: "alice@desk".into(),
        verified: None,
    };
    let refused =
        cobro_reconciler::resolve_by_hand(&rig.app.db.store, &failed, rig.app.clock.now()).await;
    assert!(
        matches!(&refused, Err(ResolveError::KeptEffect(_))),
        "{refused:?}"
    );
    assert_eq!(rig.app.db.count(in_review).await, 1);
    assert!(rig.drain(3).await.is_empty(), "nothing more is sent");
    assert_eq!(rig.ledger().refunds.len(), 1, "the late refund only");
}

/// cobro captures and voids only the charge it adopted. A manual
/// payment's first authorisation is proven to have done nothing and its
/// retry authorises charge B; a capture of B is asked for and not sent
/// yet. A `charge.captured` of another charge then names the first
/// authorisation: it is not about the open capture (not B's event), it is
/// the charge the no-effect record denies. A conflict that stops the line,
/// not an event about nothing of cobro's; B is never captured.
async fn a_capture_event_of_another_charge_is_not_taken_for_the_open_capture(backend: Backend) {
    let rig = rig_taking_signed_events(backend).await;
    let id = handed_over(&rig, &manual_payment_body("o-1")).await;
    proven_no_effect_and_retried(&rig).await;
    rig.provider.control().clear_faults();
    rig.drain(3).await;
    assert_eq!(rig.payment(&id).await["status"], "authorized");
    rig.post_ok(&format!("/v1/payments/{id}/capture"), "cap-1", json!({}))
        .await;
    let first = rig.attempts(&id).await.remove(0).reference;

    let late = fake_charge_event("evt_a1", "captured", "ch_late", &first, 1);
    assert_eq!(deliver_fake_event(&rig, &late).await, "conflict");
    assert_stopped_for_an_effect_after_no_effect(&rig, &id).await;
    assert_eq!(rig.drain(2).await, [Step::Blocked]);
    let ledger = rig.ledger();
    assert_eq!((ledger.totals.charges, ledger.totals.captures), (1, 0));
}

/// Found by the chaos run (two reconcilers at once): capture A1 is
/// recorded no effect (its charge still authorized), its retry A2 captures
/// the charge, and a second reconciler that asked about A1 before that
/// decision reads "captured" for A1. A charge's state names no attempt, and
/// a charge is captured once whoever asked: that is A2's effect, not
/// conflicting evidence. The same late proof for an authorisation recorded
/// no effect stays a conflict (the test above).
async fn a_capture_retried_after_no_effect_is_not_a_conflict_when_a_late_reconciler_sees_it(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    let p = rig.create_payment("k-1", &manual_payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(2).await;
    assert_eq!(rig.payment(&id).await["status"], "authorized");
    // The capture is never executed (503 on every send) until the window
    // closes: the reconciler proves no effect and retries with a new key.
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Capture, FaultAction::FailBeforeEffect));
    let r = rig
        .app
        .post(&format!("/v1/payments/{id}/capture"), Some("cap-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 202);
    rig.drain(1).await;
    rig.pass_the_key_window().await;
    proven_no_effect_and_retried(&rig).await;
    rig.provider.control().clear_faults();
    rig.drain(3).await;
    let captured = rig.payment(&id).await;
    assert_eq!(captured["status"], "captured");
    let first_capture = rig
        .attempts(&id)
        .await
        .into_iter()
        .find(|a| a.operation.as_str() == "payment.capture")
        .expect("the first capture");
    assert_eq!(first_capture.state.as_str(), "no_effect");

    // The late reconciler's reading of A1: the charge, captured.
    let charge_id = captured["provider_ref"]
        .as_str()
        .expect("charge")
        .to_owned();
    let mut tx = rig.app.db.store.begin().await.expect("begin");
    let proof = Proof::Succeeded {
        provider_ref: charge_id.clone(),
        captured: true,
    };
    let source = Source {
        name: "reconciler:late",
        said: r#"{"status":"captured"}"#,
    };
    let applied = apply_proof(
        &mut tx,
        &first_capture,
        &proof,
        &source,
        rig.app.clock.now(),
    )
    .await
    .expect("apply");
    tx.commit().await.expect("commit");
    assert!(matches!(applied, Applied::AlreadySettled), "{applied:?}");
    assert_eq!(rig.payment(&id).await["status"], "captured");
    assert_eq!(rig.app.db.count("evidence_conflicts").await, 0);
    let ledger = rig.ledger();
    assert_eq!((ledger.totals.charges, ledger.totals.captures), (1, 1));
    assert_eq!(charge(&rig, &charge_id).amount_captured, 1999);
}

async fn the_reconciler_reads_what_a_stale_worker_kept(backend: Backend) {
    let rig = Rig::new(backend).await;
    // The charge is made and its answer lost; search will not see it for
    // far longer than cobro's configured lag (a provider slower than
    // documented).
    let control = rig.provider.control();
    control.add_fault(FaultRule::new(FOp::Charge, FaultAction::FailAfterEffect));
    control
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::SearchLag).with_lag_seconds(1_000_000));
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(1).await;
    rig.pass_the_key_window().await;
    // A stale owner kept the provider's answer to this attempt's key.
    let attempt = rig.attempts(&id).await.remove(0);
    let charge = rig.ledger().charges[0].clone();
    let object = json!({"id": charge.id, "status": "captured", "reference": charge.reference,
        "amount": charge.amount, "currency": charge.currency, "capture_method": "automatic",
        "metadata": charge.metadata});
    rig.app
        .db
        .store
        .record_observation(
            attempt.id,
            1,
            "succeeded",
            &object.to_string(),
            rig.app.clock.now(),
        )
        .await
        .expect("observation");
    rig.app.clock.advance(Duration::minutes(2));
    let summary = reconcile(&rig, Scope::default()).await;
    assert_eq!(
        summary.items[0].verdict,
        Verdict::Resolved {
            outcome: "succeeded".into()
        },
        "search saw nothing; the kept answer is the proof"
    );
    let p = rig.payment(&id).await;
    assert_eq!(p["status"], "captured");
    assert_eq!(p["provider_ref"], charge.id);
    assert_eq!(rig.ledger().totals.charges, 1, "never charged again");
}

/// Payment `o-1` (key `k-1`), its attempt claimed by a worker that marked
/// the send and died: its id, the claim and the payment as stored.
async fn sent_by_a_worker_that_died(
    rig: &Rig,
) -> (String, Vec<cobro_store::Claim>, cobro_store::PaymentRow) {
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    let store = &rig.app.db.store;
    let now = rig.app.clock.now();
    let claims = store
        .claim_due("doomed", now, now + Duration::seconds(30), 1)
        .await
        .expect("claim")
        .claims;
    assert_eq!(
        store.record_send(&claims[0], now).await.expect("send"),
        cobro_store::SendMark::Marked
    );
    let payment = store
        .payment_any_account(id.parse().expect("id"))
        .await
        .expect("read")
        .expect("payment");
    (id, claims, payment)
}

async fn a_charge_sent_and_never_recorded_is_found_with_no_worker_left(backend: Backend) {
    let rig = Rig::new(backend).await;
    // A worker claims, marks the send, the provider charges, and the worker
    // dies before recording anything.
    let (id, claims, payment) = sent_by_a_worker_that_died(&rig).await;
    let claim = &claims[0];
    let r = rig
        .app
        .client
        .post(format!("{}/v1/charges", rig.provider.url()))
        .bearer_auth("sk_test_cobro")
        .header("idempotency-key", &claim.attempt.provider_key)
        .json(
            &json!({"amount": payment.amount, "currency": payment.currency,
            "payment_method": payment.payment_method, "capture": true,
            "reference": claim.attempt.reference,
            "metadata": cobro_settle::evidence::identity(&claim.attempt, &payment)}),
        )
        .send()
        .await
        .expect("charge");
    assert_eq!(r.status().as_u16(), 201);
    // No worker is left; the reconciler's threshold passes.
    rig.app.clock.advance(Duration::minutes(6));
    let summary = reconcile(&rig, Scope::default()).await;
    assert_eq!(summary.examined, 1, "the stuck attempt is a candidate");
    assert_eq!(
        summary.items[0].verdict,
        Verdict::Resolved {
            outcome: "succeeded".into()
        }
    );
    assert_eq!(rig.payment(&id).await["status"], "captured");
    assert_eq!(rig.ledger().totals.charges, 1);
}

/// Two objects under one attempt's identity (a provider that made two of
/// one request): one declined, one still in progress. The decline proves
/// nothing while the other may still take money: the attempt stays
/// unknown, the payment is not declined (nor moved to another provider,
/// which a soft decline would do), and no further charge is made.
async fn a_decline_beside_an_object_still_in_progress_proves_nothing(backend: Backend) {
    let rig = Rig::new(backend).await;
    let (id, claims, payment) = sent_by_a_worker_that_died(&rig).await;
    let claim = &claims[0];
    for (n, method) in ["pm_card_declined", "pm_card_visa"].into_iter().enumerate() {
        if n == 1 {
            // The second one made stays `processing`.
            rig.provider
                .control()
                .add_fault(FaultRule::new(FOp::Charge, FaultAction::Processing).with_next(1));
        }
        rig.app
            .client
            .post(format!("{}/v1/charges", rig.provider.url()))
            .bearer_auth("sk_test_cobro")
            .header(
                "idempotency-key",
                format!("{}-{n}", claim.attempt.provider_key),
            )
            .json(
                &json!({"amount": payment.amount, "currency": payment.currency,
                "payment_method": method, "capture": true,
                "reference": claim.attempt.reference,
                "metadata": cobro_settle::evidence::identity(&claim.attempt, &payment)}),
            )
            .send()
            .await
            .expect("charge");
    }
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.declines, 1, "{ledger:?}");
    assert_eq!(
        ledger
            .charges
            .iter()
            .filter(|c| c.status == "processing")
            .count(),
        1,
        "{ledger:?}"
    );
    rig.app.clock.advance(Duration::minutes(6));
    let summary = reconcile(&rig, Scope::default()).await;
    assert_eq!(summary.examined, 1);
    assert!(
        matches!(summary.items[0].verdict, Verdict::StillUnknown { .. }),
        "{:?}",
        summary.items[0].verdict
    );
    assert_ne!(rig.payment(&id).await["status"], "declined");
    assert_eq!(
        rig.ledger().totals,
        ledger.totals,
        "nothing charged (or declined) again"
    );
}

async fn a_run_pages_through_every_candidate(backend: Backend, dialect: Dialect) {
    let rig = Rig::new_in(backend, dialect).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailAfterEffect));
    for i in 0..5 {
        rig.create_payment(&format!("k-{i}"), &payment_body(&format!("o-{i}")))
            .await;
    }
    rig.drain(1).await;
    rig.pass_the_key_window().await;
    // Capped: two of the five, and the run says candidates were left.
    let capped = reconciler(&rig, |c| c.page = 2)
        .run(
            &Scope {
                max: Some(2),
                ..Default::default()
            },
            false,
            "test",
            &|_, _| {},
        )
        .await
        .expect("run");
    assert_eq!(capped.examined, 2);
    assert!(capped.truncated, "candidates were left past --max");
    let summary = reconciler(&rig, |c| c.page = 2)
        .run(&Scope::default(), false, "test", &|_, _| {})
        .await
        .expect("run");
    assert_eq!(summary.examined, 3, "the rest, over two pages of two");
    assert_eq!(summary.resolved.get("succeeded"), Some(&3));
    assert_eq!(summary.unresolved(), 0);
    assert!(!summary.truncated);
    assert_eq!(rig.ledger().totals.charges, 5);
}

/// Clients that hang up mid-request never leave a transaction half-done on
/// a pooled connection: every handler runs to its end in its own task.
/// PostgreSQL only (it is where a pooled connection can sit "idle in
/// transaction"); afterwards every stored key has its payment, attempt and
/// outbox row, and no connection is inside a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_that_disconnect_mid_request_leave_no_transaction_open() {
    let app = cobro_test_support::TestApp::spawn(Backend::Postgres).await;
    let mut tasks = Vec::new();
    for i in 0..120u64 {
        // Timeouts from 1 ms to 12 ms: many requests are dropped while the
        // server is inside BEGIN, the key reservation or COMMIT.
        let client = reqwest::Client::builder()
            .timeout(std::time::Duration::from_millis(1 + i % 12))
            .build()
            .expect("client");
        let request = client
            .post(format!("{}/v1/payments", app.url))
            .bearer_auth(&app.token)
            .header("idempotency-key", format!("dc-{i}"))
            .json(&payment_body(&format!("dc-{i}")));
        tasks.push(tokio::spawn(async move { request.send().await.is_ok() }));
    }
    for task in tasks {
        let _answered = task.await.expect("task");
    }
    // Handlers go on after their clients left: wait until the database is
    // quiet (no other backend active or inside a transaction), then read
    // every count in one snapshot.
    let pool = sqlx::PgPool::connect(&app.db.url).await.expect("connect");
    let counts: (i64, i64, i64, i64) = cobro_test_support::wait_for(
        "the database is quiet and no connection is idle in a transaction",
        std::time::Duration::from_secs(20),
        async || {
            let busy: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND pid <> pg_backend_pid() AND (state = 'active' OR state LIKE 'idle in transaction%')",
            )
            .fetch_one(&pool)
            .await
            .expect("activity");
            if busy > 0 {
                return None;
            }
            Some(
                sqlx::query_as(
                    "SELECT (SELECT COUNT(*) FROM payments), (SELECT COUNT(*) FROM attempts), \
                     (SELECT COUNT(*) FROM outbox), (SELECT COUNT(*) FROM idempotency_records)",
                )
                .fetch_one(&pool)
                .await
                .expect("counts"),
            )
        },
    )
    .await;
    let (payments, attempts, outbox, keys) = counts;
    assert_eq!((attempts, outbox, keys), (payments, payments, payments));
}

/// Point 6: a cancel decides from the row its transaction holds. A worker's
/// transaction moves the payment `processing -> authorized` and holds the
/// row while the cancel arrives; the cancel waits for it and voids, instead
/// of storing `payment-not-cancelable` against its key from a stale read.
/// PostgreSQL only: SQLite's one writer already serialises the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_racing_the_workers_commit_decides_from_the_committed_row() {
    use sqlx::Connection;
    let app = cobro_test_support::TestApp::spawn(Backend::Postgres).await;
    let r = app
        .post("/v1/payments", Some("k-1"))
        .json(&manual_payment_body("o-1"))
        .send()
        .await
        .expect("send");
    let id = r.json::<Value>().await.expect("json")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    let mut worker = sqlx::PgConnection::connect(&app.db.url)
        .await
        .expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut worker)
        .await
        .expect("begin");
    sqlx::query(
        "UPDATE payments SET status = 'authorized', provider_ref = 'ch_1' WHERE id = $1::uuid",
    )
    .bind(&id)
    .execute(&mut worker)
    .await
    .expect("authorize");
    let cancel = app
        .post(&format!("/v1/payments/{id}/cancel"), Some("c-1"))
        .send();
    let cancel = tokio::spawn(cancel);
    cobro_test_support::wait_for(
        "the cancel waits for the payment row",
        std::time::Duration::from_secs(10),
        async || {
            let waiting = app
                .db
                .count("pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'")
                .await;
            (waiting > 0).then_some(())
        },
    )
    .await;
    sqlx::query("COMMIT")
        .execute(&mut worker)
        .await
        .expect("commit");
    let answer = cancel.await.expect("join").expect("answer");
    assert_eq!(answer.status().as_u16(), 202);
    let view: Value = answer.json().await.expect("json");
    assert_eq!(view["status"], "canceling");
    assert_eq!(
        app.db
            .count("idempotency_records WHERE status_code = 422")
            .await,
        0,
        "no refusal stored against the key"
    );
    assert_eq!(app.db.count("outbox").await, 2, "the void is queued");
}

/// The key retention cobro and the fake keep in the held-request tests.
const RETENTION: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// A payment whose charge the provider holds in its queue (no answer, key
/// reserved), handed to the reconciler past the key window, where no
/// replay can ask about it any more.
async fn held_past_the_key_window(rig: &Rig) -> String {
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::HoldEffect));
    let p = rig.create_payment("k-1", &payment_body("o-held")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(1).await;
    assert_eq!(rig.provider.control().held(), 1, "the provider holds it");
    rig.pass_the_key_window().await;
    id
}

/// As cobro sets it: the provider may act on a request until its key
/// retention has passed.
fn with_lifetime(c: &mut ReconcilerConfig) {
    c.request_lifetime = RETENTION;
}

/// Past the key window a consistent read that finds nothing is not proof
/// while a request sent under the key may still be in the provider's
/// queue: before the request lifetime, the attempt stayed unknown, and
/// the charge the provider made late was adopted, never charged twice.
/// Without the lifetime rule the read "proved" no effect and a new key
/// charged again.
async fn a_charge_held_in_the_providers_queue_is_never_taken_for_absence(backend: Backend) {
    let rig = Rig::new(backend).await;
    let id = held_past_the_key_window(&rig).await;
    let run = |rig: &Rig| {
        let reconciler = reconciler(rig, with_lifetime);
        async move {
            reconciler
                .run(&every_candidate_now(), false, "test", &|_, _| {})
                .await
                .expect("run")
        }
    };
    let summary = run(&rig).await;
    assert!(
        matches!(summary.items[0].verdict, Verdict::StillUnknown { .. }),
        "{summary:?}"
    );
    assert_eq!(rig.attempts(&id).await.len(), 1, "no new key");
    assert!(rig.drain(3).await.is_empty(), "nothing to send");

    // The provider's queue lets it through: one charge, adopted.
    assert_eq!(rig.provider.control().release_held(), 1);
    let summary = run(&rig).await;
    assert!(
        matches!(summary.items[0].verdict, Verdict::Resolved { .. }),
        "{summary:?}"
    );
    rig.drain(3).await;
    assert_eq!(rig.payment(&id).await["status"], "captured");
    assert_eq!(rig.attempts(&id).await.len(), 1);
    assert_eq!(rig.ledger().totals.charges, 1, "charged once");
}

/// The other side of the bound: a request still held a key retention after
/// it arrived is abandoned by the provider (its key forgotten, nothing
/// made), and once the last send's lifetime is over the consistent read
/// proves no effect and the payment is charged once under a new key.
async fn a_held_charge_the_provider_abandoned_is_proven_absent_past_its_lifetime(backend: Backend) {
    let rig = Rig::new(backend).await;
    let id = held_past_the_key_window(&rig).await;
    rig.provider.control().advance_clock(RETENTION);
    assert_eq!(rig.provider.control().held(), 0, "abandoned");
    assert_eq!(rig.provider.control().release_held(), 0, "nothing to make");
    // Lifetime over: last send + request timeout + lifetime + skew.
    rig.app.clock.advance(Duration::hours(1));
    let summary = reconciler(&rig, with_lifetime)
        .run(&every_candidate_now(), false, "test", &|_, _| {})
        .await
        .expect("run");
    assert_eq!(summary.items[0].verdict, Verdict::Retried, "{summary:?}");
    rig.provider.control().clear_faults();
    rig.drain(3).await;
    assert_eq!(rig.payment(&id).await["status"], "captured");
    assert_eq!(rig.attempts(&id).await.len(), 2);
    assert_eq!(rig.ledger().totals.charges, 1, "charged once");
}

/// A payment whose charge the provider held and let through an hour after
/// its send (dated then), adopted by a reconciler run past the send's
/// lifetime (last send + request timeout + lifetime + skew).
async fn late_charge_adopted_past_its_lifetime(rig: &Rig) -> String {
    let id = held_past_the_key_window(rig).await;
    rig.provider
        .control()
        .advance_clock(std::time::Duration::from_secs(3600));
    assert_eq!(
        rig.provider.control().release_held(),
        1,
        "made an hour late"
    );
    rig.app.clock.advance(Duration::hours(2));
    let summary = reconciler(rig, with_lifetime)
        .run(&every_candidate_now(), false, "test", &|_, _| {})
        .await
        .expect("run");
    assert!(
        matches!(summary.items[0].verdict, Verdict::Resolved { .. }),
        "{summary:?}"
    );
    id
}

/// A request held in the provider's queue and let through an hour after it
/// arrived makes its charge then, dated then: long after the attempt's
/// window closed (last send + request timeout + skew), well inside its
/// lifetime. Past the lifetime, with no replay possible, the list must
/// reach the end of that lifetime: stopping at the send's window it found
/// nothing, "proved" no effect, and a new key charged again (explorer
/// seeds 402680 and 403916, two captured charges for one payment, stopped
/// in review only afterwards).
async fn a_charge_the_provider_made_late_in_its_lifetime_is_found_past_it(backend: Backend) {
    let rig = Rig::new(backend).await;
    let id = late_charge_adopted_past_its_lifetime(&rig).await;
    let late = rig.ledger().charges[0].clone();
    rig.provider.control().clear_faults();
    rig.drain(3).await;
    let payment = rig.payment(&id).await;
    assert_eq!(payment["status"], "captured");
    assert_eq!(payment["provider_ref"], late.id.as_str(), "the late charge");
    assert_eq!(rig.attempts(&id).await.len(), 1, "no new key");
    assert_eq!(rig.ledger().totals.charges, 1, "charged once");
}

/// The books, once a charge the provider made late was adopted: a run
/// whose listed window covers the attempt's sends but not the moment the
/// provider let the held request through reads the charge by its id and
/// does not call it missing. Before, the list alone decided: a critical
/// `missing_at_provider` conflict sent a healthy captured payment to
/// review.
async fn the_books_never_call_a_charge_the_provider_made_late_missing(backend: Backend) {
    let rig = Rig::new(backend).await;
    let id = late_charge_adopted_past_its_lifetime(&rig).await;
    let sent = rig.attempts(&id).await[0]
        .first_send_at
        .expect("sent")
        .0
        .timestamp();
    let report = rig
        .books(rig.connector())
        .run((sent - 600, sent + 600), false, "test")
        .await
        .expect("books run");
    let c = report.counts;
    assert_eq!((c.objects, c.missing), (0, 0), "{report:?}");
    assert_eq!(
        rig.app
            .db
            .count("evidence_conflicts WHERE kind = 'missing_at_provider'")
            .await,
        0
    );
    assert_eq!(rig.payment(&id).await["status"], "captured");
    assert_eq!(rig.ledger().totals.charges, 1, "charged once");
}

/// The operator's side of the same late charge, with no event of it and no
/// conflict kept: the payment in review, the charge let through an hour
/// after its send, the operator's "failed" checked past the lifetime. The
/// check lists to the end of the lifetime, finds the attempt's charge and
/// refuses "no money moved"; naming the charge, "captured" is accepted.
/// With the check's list stopped at the send's window, "failed" passed and
/// freed the order while the customer's card held the charge.
async fn an_operators_no_money_verdict_is_refused_over_a_charge_made_late_in_its_lifetime(
    backend: Backend,
) {
    let rig = Rig::new(backend).await;
    let id = held_past_the_key_window(&rig).await;
    rig.provider
        .control()
        .advance_clock(std::time::Duration::from_secs(3600));
    assert_eq!(rig.provider.control().release_held(), 1);
    let late = rig.ledger().charges[0].clone();
    let attempt = rig.stop_the_line(&id).await;
    rig.app.clock.advance(Duration::hours(2));
    let checker = reconciler(&rig, with_lifetime);
    let failed = ManualResolution {
        payment: id.parse().expect("payment id"),
        attempt,
        outcome: ManualOutcome::Failed,
        provider_ref: None,
        operator: "alice".into(),
        reason: "nothing in the window".into(),
        invoked_by: "alice@desk".into(),
        verified: None,
    };
    let refused = checker.check_verdict(&failed).await;
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(rig.payment(&id).await["status"], "needs_review");
    captured_by_naming_the_late_charge(&rig, &checker, failed, &late.id).await;
    assert_eq!(rig.ledger().totals.charges, 1, "charged once");
}

/// The operator, refused "no money moved", names the late charge: read by
/// its id, it is the attempt's own, and the true verdict, checked, is
/// applied (the payment holds the late charge, its conflicts closed).
async fn captured_by_naming_the_late_charge(
    rig: &Rig,
    checker: &Reconciler<Connector>,
    refused: ManualResolution,
    late: &str,
) {
    let id = refused.payment.to_string();
    let named = ManualResolution {
        outcome: ManualOutcome::Captured,
        provider_ref: Some(late.to_owned()),
        ..refused
    };
    let showed = checker.check_verdict(&named).await.expect("read by its id");
    assert!(showed.contains(late), "{showed}");
    assert_eq!(rig.payment(&id).await["status"], "needs_review");
    let named = ManualResolution {
        verified: Some(showed),
        ..named
    };
    let after = cobro_reconciler::resolve_by_hand(&rig.app.db.store, &named, rig.app.clock.now())
        .await
        .expect("the true verdict");
    assert_eq!(after, "captured");
    assert_eq!(rig.payment(&id).await["provider_ref"], late);
}
