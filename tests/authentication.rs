//! Strong customer authentication (3-D Secure, issue 49), end to end on
//! both backends through the Stripe connector and the fake's Stripe
//! dialect: a card that asks its holder to authenticate leaves the payment
//! in `requires_action` with a `next_action`; the fake serves the
//! challenge page; the outcome arrives by proof (the provider's webhook)
//! through the one settle path. The ledger is the judge: a charge exists
//! only once the challenge is completed.
//!
//! Waits are on conditions with a deadline, never a sleep of a guessed
//! length.

use cobro_test_support::{
    ALL_TIME, Backend, Dialect, Rig, on_both_backends, payment_body, wait_for,
};
use fake_provider::{FaultAction, FaultRule, Operation as FOp};
use serde_json::{Value, json};
use std::time::Duration;

on_both_backends!(
    a_completed_challenge_ends_captured_with_one_charge_and_the_merchant_can_follow_it,
    a_failed_challenge_ends_declined_with_no_charge_and_frees_the_order,
    a_customer_paying_after_a_failed_challenge_before_the_cancel_is_shown_charged_once,
    a_customer_authorising_after_a_failed_challenge_is_voided_by_the_cancel,
    a_cancel_that_ends_unknown_is_never_done_while_the_payment_intent_is_open,
    a_card_declined_on_the_open_payment_intent_ends_declined_without_a_conflict,
    a_cancel_of_a_never_authorised_payment_intent_is_sent_again_whatever_the_policy,
    a_cancel_escalated_after_a_failed_challenge_keeps_the_decline_and_ends_declined,
    a_cancel_escalated_without_effect_is_sent_again_and_ends_declined,
    a_declined_verdict_waits_until_the_open_payment_intent_is_canceled,
    a_payment_in_review_whose_customer_never_acts_is_declined_once_its_payment_intent_is_canceled,
    a_declined_payment_whose_payment_intent_is_still_open_is_drift_in_the_books,
    an_unverified_failed_verdict_still_cancels_the_open_payment_intent,
    a_waiting_payment_is_never_resent_nor_handed_to_the_reconciler,
    the_same_order_refs_in_two_accounts_wait_and_end_apart,
    a_bad_return_url_is_refused_and_changes_nothing,
    an_abandoned_automatic_payment_is_canceled_at_its_expiry_without_review,
    an_abandoned_manual_payment_is_canceled_at_its_expiry_without_review,
    a_customer_completing_as_the_expiry_cancel_is_sent_wins,
    a_cancel_asked_while_the_customer_is_awaited_is_the_one_the_expiry_sends,
);

const SECRET: &str = "whsec_test_cobro";
const PATIENCE: Duration = Duration::from_secs(10);
/// Stripe's test card that always asks for authentication.
const THREE_DS_CARD: &str = "pm_card_authenticationRequired";
const RETURN_URL: &str = "https://shop.example/pedido/vuelta";

/// A Stripe-dialect rig whose provider sends its webhooks to the app.
async fn rig(backend: Backend) -> Rig {
    let mut rig = Rig::new_in(backend, Dialect::Stripe).await;
    rig.accept_webhooks(SECRET, true).await;
    rig
}

/// A create body for `order_ref` with the card that asks for 3-D Secure.
fn body_3ds(order_ref: &str) -> Value {
    let mut body = payment_body(order_ref);
    body["payment_method"] = json!(THREE_DS_CARD);
    body["return_url"] = json!(RETURN_URL);
    body
}

/// Creates a 3-D Secure payment and runs the worker: the payment waits for
/// its customer. Returns it as GET shows it.
async fn waiting_payment(rig: &Rig, order_ref: &str) -> Value {
    let created = rig
        .create_payment(&format!("k-{order_ref}"), &body_3ds(order_ref))
        .await;
    assert_eq!(created["status"], "processing");
    assert_eq!(created["return_url"], RETURN_URL);
    rig.drain(3).await;
    let id = created["id"].as_str().expect("id");
    let payment = rig.payment(id).await;
    assert_eq!(payment["status"], "requires_action", "{payment}");
    payment
}

/// The challenge page's URL the merchant sends its customer to.
fn challenge_url(payment: &Value) -> String {
    let action = &payment["next_action"];
    assert_eq!(action["type"], "redirect_to_url", "{payment}");
    assert_eq!(action["redirect_to_url"]["return_url"], RETURN_URL);
    action["redirect_to_url"]["url"]
        .as_str()
        .expect("the challenge URL")
        .to_owned()
}

/// Presses a button of the challenge page as a browser would (a form
/// POST), without following the redirect: its `Location`.
async fn press(challenge: &str, button: &str) -> String {
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let page = client.get(challenge).send().await.expect("page");
    assert_eq!(page.status().as_u16(), 200);
    let html = page.text().await.expect("html");
    assert!(html.contains(&format!("id=\"{button}\"")), "{html}");
    let answer = client
        .post(format!("{challenge}/{button}"))
        .send()
        .await
        .expect("press");
    assert_eq!(answer.status().as_u16(), 303, "a redirect back to the shop");
    answer
        .headers()
        .get("location")
        .and_then(|l| l.to_str().ok())
        .expect("location")
        .to_owned()
}

async fn wait_status(rig: &Rig, id: &str, status: &str) -> Value {
    wait_for(&format!("payment {id} is {status}"), PATIENCE, async || {
        let payment = rig.payment(id).await;
        (payment["status"] == status).then_some(payment)
    })
    .await
}

/// The types of the events of `payment`, in order.
async fn event_types(rig: &Rig, payment: &str) -> Vec<String> {
    let page = rig
        .get_json(&format!("/v1/events?object={payment}&limit=100"))
        .await;
    page["data"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["type"].as_str().unwrap_or_default().to_owned())
        .collect()
}

async fn conflicts(rig: &Rig) -> i64 {
    rig.app.db.count("evidence_conflicts").await
}

async fn a_completed_challenge_ends_captured_with_one_charge_and_the_merchant_can_follow_it(
    backend: Backend,
) {
    let rig = rig(backend).await;
    let payment = waiting_payment(&rig, "pedido-3ds").await;
    let id = payment["id"].as_str().expect("id").to_owned();
    let pi = payment["provider_ref"].as_str().expect("the PaymentIntent");
    assert!(pi.starts_with("pi_"), "{payment}");
    assert_eq!(
        payment["next_action"]["client_secret"],
        format!("{pi}_secret_fake"),
        "Stripe.js needs the client secret"
    );
    assert!(payment["action_expires_at"].is_string(), "{payment}");
    assert_eq!(
        rig.ledger().totals.charges,
        0,
        "nothing is charged before the challenge"
    );

    let back = press(&challenge_url(&payment), "complete").await;
    assert!(
        back.starts_with(RETURN_URL) && back.contains("redirect_status=succeeded"),
        "{back}"
    );
    let captured = wait_status(&rig, &id, "captured").await;
    assert_eq!(captured["amount_captured"], captured["amount"]);
    assert_eq!(captured["next_action"], Value::Null);

    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1, "one charge: {ledger:?}");
    assert_eq!(ledger.totals.declines + ledger.totals.voids, 0);
    assert_eq!(conflicts(&rig).await, 0, "no conflict, no needs_review");
    // The stream a merchant follows: requires_action (with the action),
    // then captured.
    assert_eq!(
        event_types(&rig, &id).await,
        [
            "payment.created",
            "payment.requires_action",
            "payment.captured"
        ]
    );
    let page = rig
        .get_json(&format!(
            "/v1/events?object={id}&type=payment.requires_action"
        ))
        .await;
    let waiting = &page["data"][0]["data"];
    assert_eq!(waiting["next_action"], payment["next_action"], "{waiting}");
    // A second press (a double click) changes nothing.
    let again = press_again(&challenge_url(&payment)).await;
    assert_eq!(again, 303);
    assert_eq!(rig.ledger().totals.charges, 1);
    rig.shutdown().await;
}

/// A POST to a challenge that is over: redirected again, nothing made.
async fn press_again(challenge: &str) -> u16 {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client")
        .post(format!("{challenge}/complete"))
        .send()
        .await
        .expect("press")
        .status()
        .as_u16()
}

/// A failed challenge leaves the PaymentIntent open
/// (`requires_payment_method`) and its client secret in the customer's
/// browser. cobro cancels it before the payment ends `declined` and the
/// order is free: a confirmation the browser sends afterwards, with a
/// card that works, is refused, and the order's next payment is its only
/// charge. Until 2026-12-08 the payment ended `declined` at once and the
/// PaymentIntent stayed open: that confirmation charged the customer
/// beside the next payment (two charges for one order).
async fn a_failed_challenge_ends_declined_with_no_charge_and_frees_the_order(backend: Backend) {
    let rig = rig(backend).await;
    let payment = waiting_payment(&rig, "pedido-3ds-fail").await;
    let id = payment["id"].as_str().expect("id").to_owned();
    let pi = payment["provider_ref"].as_str().expect("the PaymentIntent");
    let back = press(&challenge_url(&payment), "fail").await;
    assert!(back.contains("redirect_status=failed"), "{back}");
    let canceling = wait_status(&rig, &id, "canceling").await;
    assert!(canceling["failure"]["code"].is_string(), "{canceling}");
    assert_eq!(canceling["next_action"], Value::Null, "{canceling}");
    // The order is not free while the PaymentIntent is open.
    let early = rig
        .app
        .post("/v1/payments", Some("k-too-early"))
        .json(&payment_body("pedido-3ds-fail"))
        .send()
        .await
        .expect("create");
    assert_eq!(early.status().as_u16(), 422);
    let problem: Value = early.json().await.expect("problem");
    assert_eq!(problem["payment_id"], id.as_str(), "{problem}");
    rig.drain(3).await;
    let declined = wait_status(&rig, &id, "declined").await;
    assert_eq!(declined["failure"], canceling["failure"], "{declined}");
    assert_eq!(cancels_sent(&rig), 1, "the PaymentIntent is canceled");
    // The browser still holds the client secret: too late now.
    assert_eq!(confirm_again(&rig, pi, "pm_card_visa").await, 400);
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 0, "{ledger:?}");
    wait_acked(&rig, "payment_intent.canceled").await;
    assert_eq!(conflicts(&rig).await, 0, "no conflict, no needs_review");
    assert_eq!(rig.payment(&id).await["status"], "declined");
    assert_eq!(
        event_types(&rig, &id).await,
        [
            "payment.created",
            "payment.requires_action",
            "payment.canceling",
            "payment.declined"
        ]
    );
    // Terminal: the order takes a new payment (with a card that works).
    let retry = rig
        .create_payment("k-retry", &payment_body("pedido-3ds-fail"))
        .await;
    assert_eq!(retry["status"], "processing");
    rig.drain(3).await;
    let retried = rig.payment(retry["id"].as_str().expect("id")).await;
    assert_eq!(retried["status"], "captured");
    assert_eq!(rig.ledger().totals.charges, 1);
    rig.shutdown().await;
}

/// The cancel of a declined PaymentIntent ends unknown (the provider
/// answers 500 and changes nothing) and the reconciler reads the
/// PaymentIntent before the worker tries again: still open, it is not
/// canceled, and the payment does not end `declined` on that read (until
/// 2026-12-08 the read counted as the cancel, the payment ended
/// `declined` and the PaymentIntent stayed open, with nothing left to
/// cancel it). The cancel goes out again and closes it: no charge, and
/// the customer's late confirmation is refused.
async fn a_cancel_that_ends_unknown_is_never_done_while_the_payment_intent_is_open(
    backend: Backend,
) {
    let rig = rig(backend).await;
    let (id, pi) = failed_challenge(&rig, "pedido-3ds-open").await;
    let pi = pi.as_str();
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Void, FaultAction::FailBeforeEffect).with_next(1));
    rig.drain(1).await;
    assert_eq!(cancels_sent(&rig), 1);
    rig.app.clock.advance(chrono::Duration::minutes(30));
    rig.reconcile_once().await;
    let open = rig.payment(&id).await;
    assert_eq!(
        open["status"], "canceling",
        "the PaymentIntent is open: {open}"
    );
    for _ in 0..4 {
        rig.drain(3).await;
        if rig.payment(&id).await["status"] == "declined" {
            break;
        }
        rig.app.clock.advance(chrono::Duration::minutes(30));
        rig.reconcile_once().await;
    }
    wait_status(&rig, &id, "declined").await;
    assert_eq!(confirm_again(&rig, pi, "pm_card_visa").await, 400);
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 0, "{ledger:?}");
    assert_eq!(conflicts(&rig).await, 0);
    rig.shutdown().await;
}

/// The customer fails the challenge while the payment is stopped for
/// conflicting evidence: the line is stopped, so nothing cancels the
/// PaymentIntent, and an operator's "declined" would free the order with
/// it still open and its client secret in the browser. The verdict is
/// refused until the PaymentIntent is canceled at the provider (the
/// operator's dashboard), then passes: no charge, the late confirmation
/// refused.
async fn a_declined_verdict_waits_until_the_open_payment_intent_is_canceled(backend: Backend) {
    let rig = rig(backend).await;
    let payment = waiting_payment(&rig, "pedido-3ds-review").await;
    let id = payment["id"].as_str().expect("id").to_owned();
    let pi = payment["provider_ref"].as_str().expect("the PaymentIntent");
    let attempt = rig.stop_the_line(&id).await;
    press(&challenge_url(&payment), "fail").await;
    wait_acked(&rig, "payment_intent.payment_failed").await;
    assert_eq!(rig.payment(&id).await["status"], "needs_review");
    let mut verdict = declined_verdict(&id, attempt);
    let reconciler = rig.reconciler(|_| {});
    let refused = reconciler.check_verdict(&verdict).await;
    assert!(
        matches!(&refused, Err(cobro_reconciler::ResolveError::Unproven(why)) if why.contains(pi)),
        "{refused:?}"
    );
    assert_eq!(at_the_provider(&rig, pi, "cancel", "").await, 200);
    verdict.verified = Some(reconciler.check_verdict(&verdict).await.expect("proven"));
    let now = cobro_core::Clock::now(&rig.app.clock);
    let after = cobro_reconciler::resolve_by_hand(&rig.app.db.store, &verdict, now)
        .await
        .expect("resolved");
    assert_eq!(after, "declined");
    assert_eq!(confirm_again(&rig, pi, "pm_card_visa").await, 400);
    assert_eq!(rig.ledger().totals.charges, 0);
    rig.shutdown().await;
}

/// A payment stopped for conflicting evidence while its customer is asked
/// to authenticate, who never acts: no one expires it (only payments in
/// `requires_action` expire). An operator's "declined" is refused while
/// the PaymentIntent waits for the customer; once it is canceled at the
/// provider (the dashboard) the verdict passes, and the payment ends
/// `declined` through cobro's own cancel of it (refused: the
/// PaymentIntent is canceled already): no charge, the order free.
async fn a_payment_in_review_whose_customer_never_acts_is_declined_once_its_payment_intent_is_canceled(
    backend: Backend,
) {
    // No webhooks: the dashboard's cancel reaches cobro only through its
    // own cancel, refused as already done.
    let rig = Rig::new_in(backend, Dialect::Stripe).await;
    let payment = waiting_payment(&rig, "pedido-3ds-gone").await;
    let id = payment["id"].as_str().expect("id").to_owned();
    let pi = payment["provider_ref"].as_str().expect("the PaymentIntent");
    let attempt = rig.stop_the_line(&id).await;
    let mut verdict = declined_verdict(&id, attempt);
    let reconciler = rig.reconciler(|_| {});
    let refused = reconciler.check_verdict(&verdict).await;
    assert!(
        matches!(&refused, Err(cobro_reconciler::ResolveError::Unproven(why)) if why.contains("authenticate")),
        "{refused:?}"
    );
    assert_eq!(at_the_provider(&rig, pi, "cancel", "").await, 200);
    verdict.verified = Some(reconciler.check_verdict(&verdict).await.expect("proven"));
    let now = cobro_core::Clock::now(&rig.app.clock);
    let after = cobro_reconciler::resolve_by_hand(&rig.app.db.store, &verdict, now)
        .await
        .expect("resolved");
    assert_eq!(after, "canceling", "cobro closes the PaymentIntent itself");
    ends_declined_and_closed(&rig, &id, pi).await;
    let retry = rig
        .create_payment("k-again", &payment_body("pedido-3ds-gone"))
        .await;
    assert_eq!(retry["status"], "processing", "the order is free");
    rig.shutdown().await;
}

/// The customer fails the challenge, then confirms the open PaymentIntent
/// again with a card that is declined (a failed charge). cobro's cancel
/// then leaves a canceled PaymentIntent with a failed charge and no last
/// error (Stripe clears it on any update), which reads "voided": its
/// `payment_intent.canceled` event is the cancel's, not a contradiction of
/// the declined authorisation (a false `needs_review` before 2026-12-08).
async fn a_card_declined_on_the_open_payment_intent_ends_declined_without_a_conflict(
    backend: Backend,
) {
    let rig = rig(backend).await;
    let (id, pi) = failed_challenge(&rig, "pedido-3ds-twice").await;
    assert_eq!(
        confirm_again(&rig, &pi, "pm_card_chargeDeclined").await,
        402
    );
    ends_declined_and_closed(&rig, &id, &pi).await;
    wait_acked(&rig, "payment_intent.canceled").await;
    assert_eq!(conflicts(&rig).await, 0, "no needs_review");
    assert_eq!(rig.payment(&id).await["status"], "declined");
    assert_eq!(rig.ledger().totals.declines, 1);
    rig.shutdown().await;
}

/// The same cancel ending unknown under a reconciler that does not retry
/// what it proves had no effect (`retry_on_no_effect = false`): a cancel
/// "refused" would show the payment `authorized` though it never held
/// money, and leave the PaymentIntent open. A cancel of a PaymentIntent
/// that never held money moves none, so it is sent again whatever the
/// policy: `declined`, no charge.
async fn a_cancel_of_a_never_authorised_payment_intent_is_sent_again_whatever_the_policy(
    backend: Backend,
) {
    let rig = rig(backend).await;
    let (id, pi) = failed_challenge(&rig, "pedido-3ds-policy").await;
    let control = rig.provider.control();
    control.add_fault(FaultRule::new(FOp::Void, FaultAction::FailBeforeEffect));
    hand_the_cancel_over(&rig).await;
    control.clear_faults();
    let strict = rig.reconciler(|c| c.retry_on_no_effect = false);
    let summary = cobro_test_support::run_once(&strict).await;
    assert_eq!(summary.items.len(), 1, "{summary:?}");
    assert_eq!(summary.items[0].verdict, cobro_reconciler::Verdict::Retried);
    assert_eq!(rig.payment(&id).await["status"], "canceling");
    ends_declined_and_closed(&rig, &id, &pi).await;
    assert_eq!(conflicts(&rig).await, 0);
    rig.shutdown().await;
}

/// The cancel of a declined PaymentIntent ends unknown, and the
/// PaymentIntent cannot be read until past the escalation horizon: the
/// payment goes to `needs_review` keeping the decline's code (it was
/// cleared, so a proven cancel later ended the payment `canceled` and the
/// decline was lost). Once the provider can be read: a cancel that landed
/// (`landed`) is proven and the payment ends `declined` with the code it
/// had; one that did not is sent again (a new intent: the PaymentIntent is
/// still open, and "no effect" in review used to wait for an operator),
/// and then the same. No charge either way.
async fn escalated_cancel_after_a_failed_challenge(backend: Backend, landed: bool) {
    let rig = Rig::new_in(backend, Dialect::Stripe).await;
    let payment = waiting_payment(&rig, "pedido-3ds-late").await;
    let id = payment["id"].as_str().expect("id").to_owned();
    let pi = payment["provider_ref"].as_str().expect("the PaymentIntent");
    // Without webhooks: the reconciler's read of the waiting payment
    // brings the decline.
    press(&challenge_url(&payment), "fail").await;
    rig.app.clock.advance(chrono::Duration::minutes(10));
    rig.reconcile_once().await;
    let canceling = rig.payment(&id).await;
    assert_eq!(canceling["status"], "canceling", "{canceling}");
    let control = rig.provider.control();
    let fault = if landed {
        FaultAction::FailAfterEffect
    } else {
        FaultAction::FailBeforeEffect
    };
    control.add_fault(FaultRule::new(FOp::Void, fault));
    hand_the_cancel_over(&rig).await;
    control.clear_faults();
    for op in [FOp::Get, FOp::List, FOp::Search] {
        control.add_fault(FaultRule::new(op, FaultAction::FailBeforeEffect));
    }
    rig.app.clock.advance(chrono::Duration::hours(3));
    rig.reconcile_once().await;
    let review = rig.payment(&id).await;
    assert_eq!(review["status"], "needs_review", "{review}");
    assert_eq!(
        review["failure"], canceling["failure"],
        "the decline is kept"
    );
    control.clear_faults();
    rig.reconcile_once().await;
    let expected: &[&str] = if landed {
        &["payment.authorize declined", "payment.cancel succeeded"]
    } else {
        assert_eq!(rig.payment(&id).await["status"], "canceling");
        ends_declined_and_closed(&rig, &id, pi).await;
        &[
            "payment.authorize declined",
            "payment.cancel no_effect",
            "payment.cancel succeeded",
        ]
    };
    let declined = rig.payment(&id).await;
    assert_eq!(declined["status"], "declined", "{declined}");
    assert_eq!(declined["failure"], canceling["failure"]);
    let states: Vec<String> = rig
        .attempts(&id)
        .await
        .iter()
        .map(|a| format!("{} {}", a.operation, a.state.as_str()))
        .collect();
    assert_eq!(states, expected);
    assert_eq!(rig.ledger().totals.charges, 0);
    assert_eq!(confirm_again(&rig, pi, "pm_card_visa").await, 400);
    rig.shutdown().await;
}

async fn a_cancel_escalated_after_a_failed_challenge_keeps_the_decline_and_ends_declined(
    backend: Backend,
) {
    escalated_cancel_after_a_failed_challenge(backend, true).await;
}

async fn a_cancel_escalated_without_effect_is_sent_again_and_ends_declined(backend: Backend) {
    escalated_cancel_after_a_failed_challenge(backend, false).await;
}

/// Runs the worker on a payment's cancel, which the provider keeps
/// failing, until its budget is spent (the provider's key retention): the
/// cancel attempt is the reconciler's (`reconciling`).
async fn hand_the_cancel_over(rig: &Rig) {
    rig.drain(1).await;
    rig.app
        .clock
        .advance(chrono::Duration::hours(23) + chrono::Duration::minutes(1));
    rig.drain(2).await;
    let reconciling = "attempts WHERE operation = 'payment.cancel' AND state = 'reconciling'";
    assert_eq!(rig.app.db.count(reconciling).await, 1, "handed over");
}

/// An operator who cannot reach the provider says "failed" (`--unverified`)
/// for a payment in review whose customer is still asked to authenticate:
/// the order is not freed with the PaymentIntent open (the customer could
/// still complete it); cobro cancels it first, and the payment ends
/// `declined` once the cancel is proven. No charge.
async fn an_unverified_failed_verdict_still_cancels_the_open_payment_intent(backend: Backend) {
    let rig = rig(backend).await;
    let payment = waiting_payment(&rig, "pedido-3ds-blind").await;
    let id = payment["id"].as_str().expect("id").to_owned();
    let pi = payment["provider_ref"].as_str().expect("the PaymentIntent");
    let attempt = rig.stop_the_line(&id).await;
    let unverified = cobro_reconciler::ManualResolution {
        outcome: cobro_reconciler::ManualOutcome::Failed,
        ..declined_verdict(&id, attempt)
    };
    let now = cobro_core::Clock::now(&rig.app.clock);
    let after = cobro_reconciler::resolve_by_hand(&rig.app.db.store, &unverified, now)
        .await
        .expect("resolved");
    assert_eq!(after, "canceling");
    ends_declined_and_closed(&rig, &id, pi).await;
    assert_eq!(cancels_sent(&rig), 1);
    rig.shutdown().await;
}

/// An unverified "declined" (the operator could not reach the provider)
/// frees the order while the PaymentIntent is still open, as every such
/// payment declined before 2026-12-08 did: the books report it as drift,
/// naming the PaymentIntent to cancel, until it is canceled.
async fn a_declined_payment_whose_payment_intent_is_still_open_is_drift_in_the_books(
    backend: Backend,
) {
    let rig = rig(backend).await;
    let payment = waiting_payment(&rig, "pedido-3ds-books").await;
    let id = payment["id"].as_str().expect("id").to_owned();
    let pi = payment["provider_ref"].as_str().expect("the PaymentIntent");
    let attempt = rig.stop_the_line(&id).await;
    press(&challenge_url(&payment), "fail").await;
    wait_acked(&rig, "payment_intent.payment_failed").await;
    let unverified = declined_verdict(&id, attempt);
    let now = cobro_core::Clock::now(&rig.app.clock);
    let after = cobro_reconciler::resolve_by_hand(&rig.app.db.store, &unverified, now)
        .await
        .expect("resolved");
    assert_eq!(after, "declined");
    let books = rig.books(rig.connector());
    let report = books.run(ALL_TIME, false, "test").await.expect("books");
    assert_eq!(report.counts.drifted, 1, "{report:?}");
    assert!(format!("{report:?}").contains(pi), "{report:?}");
    assert_eq!(at_the_provider(&rig, pi, "cancel", "").await, 200);
    let report = books.run(ALL_TIME, false, "test").await.expect("books");
    let c = report.counts;
    assert_eq!((c.objects, c.matched, c.drifted), (1, 1, 0), "{report:?}");
    assert_eq!(rig.ledger().totals.charges, 0);
    rig.shutdown().await;
}

/// The worker sends what is due; payment `id` ends `declined` and its
/// PaymentIntent `pi` is closed: a confirmation with a card that works is
/// refused, and nothing was charged.
async fn ends_declined_and_closed(rig: &Rig, id: &str, pi: &str) {
    rig.drain(3).await;
    wait_status(rig, id, "declined").await;
    assert_eq!(confirm_again(rig, pi, "pm_card_visa").await, 400);
    assert_eq!(rig.ledger().totals.charges, 0);
}

/// A payment of `order_ref` whose customer failed the challenge, once it
/// is `canceling`: its id and its PaymentIntent's.
async fn failed_challenge(rig: &Rig, order_ref: &str) -> (String, String) {
    let payment = waiting_payment(rig, order_ref).await;
    let id = payment["id"].as_str().expect("id").to_owned();
    let pi = payment["provider_ref"].as_str().expect("the PaymentIntent");
    press(&challenge_url(&payment), "fail").await;
    wait_status(rig, &id, "canceling").await;
    (id, pi.to_owned())
}

/// The customer's browser confirms the PaymentIntent again (Stripe.js
/// with the client secret) with `card`, as after a failed try: the HTTP
/// status of the fake's answer.
async fn confirm_again(rig: &Rig, pi: &str, card: &str) -> u16 {
    at_the_provider(rig, pi, "confirm", &format!("payment_method={card}")).await
}

/// `POST /v1/payment_intents/{pi}/{verb}` with the form `body`, as someone
/// other than cobro (a browser, an operator's dashboard): the HTTP status.
async fn at_the_provider(rig: &Rig, pi: &str, verb: &str, body: &str) -> u16 {
    reqwest::Client::new()
        .post(format!(
            "{}/v1/payment_intents/{pi}/{verb}",
            rig.provider.url()
        ))
        .bearer_auth(cobro_test_support::RIG_SECRET_KEY)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body.to_owned())
        .send()
        .await
        .expect(verb)
        .status()
        .as_u16()
}

/// An operator's "declined" for `attempt` of payment `id`, not verified yet.
fn declined_verdict(
    id: &str,
    attempt: cobro_core::AttemptId,
) -> cobro_reconciler::ManualResolution {
    cobro_reconciler::ManualResolution {
        payment: id.parse().expect("payment id"),
        attempt,
        outcome: cobro_reconciler::ManualOutcome::Declined,
        provider_ref: None,
        operator: "alice".into(),
        reason: "the customer did not authenticate".into(),
        invoked_by: "alice@desk".into(),
        verified: None,
    }
}

/// The customer fails the challenge, then confirms again with a card that
/// works before cobro's cancel of the PaymentIntent goes out: the charge
/// is made at the provider, the cancel is refused (or settled by the
/// charge's webhook before it is sent), and the payment shows the money
/// (`captured`, one charge), never `declined` beside a charge.
async fn a_customer_paying_after_a_failed_challenge_before_the_cancel_is_shown_charged_once(
    backend: Backend,
) {
    let rig = rig(backend).await;
    let (id, pi) = failed_challenge(&rig, "pedido-3ds-again").await;
    let pi = pi.as_str();
    assert_eq!(confirm_again(&rig, pi, "pm_card_visa").await, 200);
    rig.drain(3).await;
    let captured = wait_status(&rig, &id, "captured").await;
    assert_eq!(captured["amount_captured"], captured["amount"]);
    wait_acked(&rig, "payment_intent.succeeded").await;
    let now = rig.payment(&id).await;
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1, "{ledger:?}");
    assert_eq!(now["status"], "captured", "{now}");
    assert_eq!(
        conflicts(&rig).await,
        0,
        "the charge's truth, not a conflict"
    );
    let authorisation = &rig.attempts(&id).await[0];
    assert_eq!(authorisation.state.as_str(), "succeeded", "nothing waits");
    // The webhook may settle the cancel (the charge is captured) before
    // the worker sends it: at most one.
    assert!(cancels_sent(&rig) <= 1);
    assert_eq!(
        event_types(&rig, &id).await,
        [
            "payment.created",
            "payment.requires_action",
            "payment.canceling",
            "payment.captured"
        ]
    );
    rig.shutdown().await;
}

/// The same race on a manual payment: the customer's second card is
/// authorised (funds held) just before cobro's cancel reaches the
/// PaymentIntent, and the cancel voids that authorisation. Its event
/// (`payment_intent.amount_capturable_updated`) comes before the cancel is
/// sent (a payment `canceling` takes no authorisation: the cancel on its
/// way decides) or after the cancel's own event. Either way the
/// authorisation is voided by the cancel: nothing held or captured at the
/// provider, the payment `declined` with the decline that started the
/// cancel, no conflict, and the books agree. (The record is not the whole
/// story: the customer did authorise, briefly. Showing that as
/// `canceled`, with the authorisation `succeeded`, needs the cancel's
/// proof to say whether it voided an authorisation; it moves no money.)
async fn a_customer_authorising_after_a_failed_challenge_is_voided_by_the_cancel(backend: Backend) {
    for late_event in [false, true] {
        let rig = rig(backend).await;
        let mut body = body_3ds("pedido-3ds-manual");
        body["capture_method"] = json!("manual");
        let created = rig.create_payment("k-manual", &body).await;
        let id = created["id"].as_str().expect("id").to_owned();
        rig.drain(3).await;
        let payment = rig.payment(&id).await;
        assert_eq!(payment["status"], "requires_action", "{payment}");
        let pi = payment["provider_ref"].as_str().expect("PI").to_owned();
        press(&challenge_url(&payment), "fail").await;
        wait_status(&rig, &id, "canceling").await;
        if late_event {
            rig.provider
                .control()
                .add_fault(FaultRule::new(FOp::Webhook, FaultAction::Reorder).with_next(1));
        }
        assert_eq!(confirm_again(&rig, &pi, "pm_card_visa").await, 200);
        if !late_event {
            wait_acked(&rig, "payment_intent.amount_capturable_updated").await;
            assert_eq!(rig.payment(&id).await["status"], "canceling");
        }
        rig.drain(3).await;
        wait_acked(&rig, "payment_intent.canceled").await;
        wait_acked(&rig, "payment_intent.amount_capturable_updated").await;
        let now = rig.payment(&id).await;
        assert_eq!(now["status"], "declined", "late event {late_event}: {now}");
        assert_eq!(now["amount_captured"], 0);
        assert_eq!(
            conflicts(&rig).await,
            0,
            "late event {late_event}: no review"
        );
        let totals = rig.ledger().totals;
        assert_eq!(
            (totals.charges, totals.voids, totals.captures),
            (1, 1, 0),
            "late event {late_event}: the authorisation voided, nothing taken"
        );
        let report = rig
            .books(rig.connector())
            .run(ALL_TIME, true, "test")
            .await
            .expect("books");
        let c = report.counts;
        assert_eq!((c.objects, c.matched), (1, 1), "{report:?}");
        rig.shutdown().await;
    }
}

async fn a_waiting_payment_is_never_resent_nor_handed_to_the_reconciler(backend: Backend) {
    let rig = rig(backend).await;
    let payment = waiting_payment(&rig, "pedido-3ds-wait").await;
    let id = payment["id"].as_str().expect("id").to_owned();
    let creates = || cobro_test_support::posts_to(&rig.provider, "/v1/payment_intents");
    assert_eq!(creates(), 1);
    // Past the worker's retry backoff and the reconciler's stuck horizon:
    // nothing is due, nothing is resent, the attempt is not unknown.
    rig.app.clock.advance(chrono::Duration::minutes(30));
    let steps = rig.drain(3).await;
    assert!(steps.is_empty(), "{steps:?}");
    let summary = rig.reconcile_once().await;
    assert_eq!(summary.examined, 0, "not the unknown-outcome path");
    assert_eq!(creates(), 1, "never resent, never a new key");
    let attempts = rig.attempts(&id).await;
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].state.as_str(), "awaiting_customer");
    assert_eq!(rig.payment(&id).await["status"], "requires_action");
    assert_eq!(rig.ledger().totals.charges, 0);
    // The books count the waiting PaymentIntent as matched: a wait is not
    // something an operator is paged for.
    let books = rig.books(rig.connector());
    let report = books.run(ALL_TIME, false, "test").await.expect("books");
    let c = report.counts;
    assert_eq!((c.objects, c.matched), (1, 1), "{report:?}");
    rig.shutdown().await;
}

async fn the_same_order_refs_in_two_accounts_wait_and_end_apart(backend: Backend) {
    let rig = rig(backend).await;
    let (_, other_token) = rig.app.new_account("other-shop").await;
    let mine = waiting_payment(&rig, "pedido-842").await;
    let theirs: Value = rig
        .app
        .post_as(&other_token, "/v1/payments", Some("k-pedido-842"))
        .json(&body_3ds("pedido-842"))
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("json");
    rig.drain(3).await;
    let their_id = theirs["id"].as_str().expect("id").to_owned();
    let their_path = format!("/v1/payments/{their_id}");
    let get_theirs = async || rig.app.get_json_as(&other_token, &their_path).await;
    let theirs = get_theirs().await;
    assert_eq!(theirs["status"], "requires_action", "{theirs}");
    assert_ne!(mine["provider_ref"], theirs["provider_ref"]);
    // Mine completes, theirs fails: each ends by its own proof.
    press(&challenge_url(&mine), "complete").await;
    press(&challenge_url(&theirs), "fail").await;
    wait_status(&rig, mine["id"].as_str().expect("id"), "captured").await;
    // Theirs cancels its PaymentIntent before it ends declined.
    wait_for("their payment is canceling", PATIENCE, async || {
        (get_theirs().await["status"] == "canceling").then_some(())
    })
    .await;
    rig.drain(3).await;
    wait_for("their payment is declined", PATIENCE, async || {
        (get_theirs().await["status"] == "declined").then_some(())
    })
    .await;
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1, "{ledger:?}");
    assert_eq!(cancels_sent(&rig), 1, "only theirs is canceled");
    assert_eq!(conflicts(&rig).await, 0);
    rig.shutdown().await;
}

async fn a_bad_return_url_is_refused_and_changes_nothing(backend: Backend) {
    let rig = rig(backend).await;
    let long = format!("https://shop.example/{}", "a".repeat(2100));
    for bad in [
        json!("/relative/path"),
        json!("javascript:alert(1)"),
        json!("ftp://shop.example/back"),
        json!("https://user:pass@shop.example/back"),
        json!(long),
        json!(42),
    ] {
        let mut body = body_3ds("pedido-bad-url");
        body["return_url"] = bad.clone();
        let answer = rig
            .app
            .post("/v1/payments", Some("k-bad-url"))
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!(answer.status().as_u16(), 400, "{bad}");
        assert!(
            answer
                .headers()
                .get("content-type")
                .and_then(|c| c.to_str().ok())
                .is_some_and(|c| c.starts_with("application/problem+json")),
            "{bad}"
        );
    }
    assert_eq!(rig.app.db.count("payments").await, 0);
    // The return URL is part of the request: the same key with another
    // one is refused, and nothing changes.
    rig.create_payment("k-url", &body_3ds("pedido-url")).await;
    let mut other = body_3ds("pedido-url");
    other["return_url"] = json!("https://shop.example/elsewhere");
    let replay = rig
        .app
        .post("/v1/payments", Some("k-url"))
        .json(&other)
        .send()
        .await
        .expect("send");
    assert_eq!(replay.status().as_u16(), 422);
    assert_eq!(rig.app.db.count("payments").await, 1);
    rig.drain(3).await;
    assert_eq!(rig.ledger().totals.charges, 0);
    rig.shutdown().await;
}

/// Both clocks (cobro's and the provider's, which signs its webhooks) past
/// the default expiry of one hour, then one reconciler run.
async fn past_the_expiry(rig: &Rig) {
    rig.app
        .clock
        .advance(chrono::Duration::hours(1) + chrono::Duration::minutes(1));
    rig.provider
        .control()
        .advance_clock(Duration::from_secs(3660));
    rig.reconcile_once().await;
}

/// The acknowledged deliveries of `event_type`.
/// Waits until the app acknowledged one `event_type` from the provider.
async fn wait_acked(rig: &Rig, event_type: &str) {
    let what = format!("{event_type} is acknowledged");
    wait_for(&what, PATIENCE, async || {
        (acked(rig, event_type) == 1).then_some(())
    })
    .await;
}

fn acked(rig: &Rig, event_type: &str) -> usize {
    rig.provider
        .control()
        .webhook_deliveries()
        .iter()
        .filter(|d| d.event_type == event_type && d.status == Some(200))
        .count()
}

/// Stripe's `payment_intent.canceled` for cobro's own cancel of an
/// abandoned PaymentIntent agrees with the canceled payment: no false
/// `needs_review` (the reproduced bug), in either capture mode.
async fn abandoned_is_canceled_at_its_expiry(backend: Backend, manual: bool) {
    let rig = rig(backend).await;
    let order = if manual { "pedido-m" } else { "pedido-a" };
    let mut body = body_3ds(order);
    if manual {
        body["capture_method"] = json!("manual");
    }
    let created = rig.create_payment("k-abandoned", &body).await;
    let id = created["id"].as_str().expect("id").to_owned();
    rig.drain(3).await;
    let waiting = rig.payment(&id).await;
    assert_eq!(waiting["status"], "requires_action");
    // Before the expiry, a run reads it and leaves it waiting.
    rig.reconcile_once().await;
    assert_eq!(rig.payment(&id).await["status"], "requires_action");

    past_the_expiry(&rig).await;
    assert_eq!(rig.payment(&id).await["status"], "canceling");
    rig.drain(3).await;
    let canceled = wait_status(&rig, &id, "canceled").await;
    assert_eq!(canceled["amount_captured"], 0);
    wait_acked(&rig, "payment_intent.canceled").await;
    assert_eq!(rig.payment(&id).await["status"], "canceled");
    assert_eq!(conflicts(&rig).await, 0, "no false needs_review");
    // The books agree: a PaymentIntent canceled with nothing taken.
    let books = rig.books(rig.connector());
    let report = books.run(ALL_TIME, false, "test").await.expect("books");
    let c = report.counts;
    assert_eq!((c.objects, c.matched), (1, 1), "{report:?}");
    let cancels = cancels_sent(&rig);
    assert_eq!(cancels, 1, "one cancel of the PaymentIntent");
    let ledger = rig.ledger();
    assert_eq!(
        ledger.totals,
        fake_provider::Effects::default(),
        "nothing charged, held or voided: {ledger:?}"
    );
    assert_eq!(
        event_types(&rig, &id).await,
        [
            "payment.created",
            "payment.requires_action",
            "payment.canceling",
            "payment.canceled"
        ]
    );
    // The customer who comes back late finds the challenge over.
    let late = reqwest::get(challenge_url(&waiting)).await.expect("page");
    assert_eq!(late.status().as_u16(), 409);
    // The order is free again.
    let next = rig.create_payment("k-next", &payment_body(order)).await;
    assert_eq!(next["status"], "processing");
    rig.shutdown().await;
}

async fn an_abandoned_automatic_payment_is_canceled_at_its_expiry_without_review(backend: Backend) {
    abandoned_is_canceled_at_its_expiry(backend, false).await;
}

async fn an_abandoned_manual_payment_is_canceled_at_its_expiry_without_review(backend: Backend) {
    abandoned_is_canceled_at_its_expiry(backend, true).await;
}

/// The customer completes the challenge after the expiry decided to
/// cancel, before the cancel reaches the provider: the provider refuses it
/// (the PaymentIntent succeeded) and the evidence wins: captured, one
/// charge, no void, no review.
async fn a_customer_completing_as_the_expiry_cancel_is_sent_wins(backend: Backend) {
    let rig = rig(backend).await;
    let payment = waiting_payment(&rig, "pedido-late").await;
    let id = payment["id"].as_str().expect("id").to_owned();
    past_the_expiry(&rig).await;
    assert_eq!(rig.payment(&id).await["status"], "canceling");
    press(&challenge_url(&payment), "complete").await;
    rig.drain(3).await;
    let captured = wait_status(&rig, &id, "captured").await;
    assert_eq!(captured["amount_captured"], captured["amount"]);
    wait_acked(&rig, "payment_intent.succeeded").await;
    assert_eq!(rig.payment(&id).await["status"], "captured");
    assert_eq!(conflicts(&rig).await, 0, "no needs_review");
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1, "{ledger:?}");
    assert_eq!(ledger.totals.voids, 0, "{ledger:?}");
    rig.shutdown().await;
}

/// The merchant cancels a manual payment while the customer is awaited
/// (an automatic one moves money at authorisation and refuses a cancel): the cancel is held
/// for the outcome. At the expiry that held cancel is the one sent (one
/// cancel of the PaymentIntent), and nothing is left held: the expiry
/// opened a second cancel beside it until 2026-12-07, which left the
/// merchant's for ever `held`.
async fn a_cancel_asked_while_the_customer_is_awaited_is_the_one_the_expiry_sends(
    backend: Backend,
) {
    let rig = rig(backend).await;
    let mut body = body_3ds("pedido-c");
    body["capture_method"] = json!("manual");
    let created = rig.create_payment("k-waiting", &body).await;
    let id = created["id"].as_str().expect("id").to_owned();
    rig.drain(3).await;
    assert_eq!(rig.payment(&id).await["status"], "requires_action");
    let cancel = rig
        .app
        .post(&format!("/v1/payments/{id}/cancel"), Some("k-cancel"))
        .json(&json!({}))
        .send()
        .await
        .expect("cancel");
    assert_eq!(cancel.status().as_u16(), 202);
    let held = "attempts WHERE state = 'held'";
    assert_eq!(rig.app.db.count(held).await, 1, "held for the outcome");

    past_the_expiry(&rig).await;
    assert_eq!(rig.payment(&id).await["status"], "canceling");
    assert_eq!(rig.app.db.count(held).await, 0, "the held cancel is sent");
    assert_eq!(
        rig.app
            .db
            .count("attempts WHERE operation = 'payment.cancel'")
            .await,
        1,
        "one cancel intent: the merchant's"
    );
    rig.drain(3).await;
    wait_status(&rig, &id, "canceled").await;
    let cancels = cancels_sent(&rig);
    assert_eq!(cancels, 1, "one cancel of the PaymentIntent");
    assert_eq!(rig.app.db.count(held).await, 0);
    assert_eq!(conflicts(&rig).await, 0);
    assert_eq!(rig.ledger().totals, fake_provider::Effects::default());
    rig.shutdown().await;
}

/// The cancels of a PaymentIntent the provider was sent.
fn cancels_sent(rig: &Rig) -> usize {
    rig.provider
        .control()
        .requests()
        .iter()
        .filter(|r| r.method == "POST" && r.path.ends_with("/cancel"))
        .count()
}
