//! The operator cannot move money by mistake: every manual verdict is
//! checked at the provider with the reconciler's own evidence
//! (`Reconciler::check_verdict`), a verdict never overrides what cobro
//! recorded from a proof, and a refund in review can always be resolved.
//! On both backends, with two accounts sharing order refs where identity
//! matters; every test counts the provider's charges and refunds.

use chrono::Duration;
use cobro_core::{AttemptId, Clock, PaymentId};
use cobro_reconciler::{ManualOutcome, ManualResolution, ResolveError, Scope, Verdict};
use cobro_test_support::{Backend, Rig, on_both_backends, payment_body};
use fake_provider::{FaultAction, FaultRule, Operation as FOp};
use serde_json::{Value, json};

on_both_backends!(
    a_no_money_verdict_is_refused_while_the_provider_holds_the_charge,
    a_no_money_verdict_needs_a_consistent_read_that_proves_it,
    a_refund_in_review_proven_without_effect_is_failed_and_refundable_again,
    a_refund_in_review_is_resolved_on_its_own_while_its_payment_is_captured,
    a_verdict_against_a_recorded_capture_is_refused,
    a_captured_verdict_follows_what_is_refunded_now_not_the_status_before_review,
);

/// The provider cannot be read (list and search fail) past the horizon:
/// the reconciler escalates every open attempt to `needs_review`.
async fn escalate(rig: &Rig) {
    let control = rig.provider.control();
    control.add_fault(FaultRule::new(FOp::Search, FaultAction::FailBeforeEffect));
    control.add_fault(FaultRule::new(FOp::List, FaultAction::FailBeforeEffect));
    rig.app.clock.advance(Duration::hours(2));
    let summary = reconcile(rig).await;
    assert!(
        summary
            .items
            .iter()
            .all(|i| i.verdict == Verdict::Escalated),
        "{summary:?}"
    );
}

async fn reconcile(rig: &Rig) -> cobro_reconciler::Summary {
    rig.reconciler(|_| {})
        .run(&Scope::default(), false, "test", &|_, _| {})
        .await
        .expect("run")
}

/// A payment of `order_ref` whose charge the provider made (`charged`) or
/// not, its answer lost, escalated to `needs_review`: the payment's id.
async fn in_review(rig: &Rig, order_ref: &str, charged: bool) -> String {
    let fault = if charged {
        FaultAction::DropResponseAfterEffect
    } else {
        FaultAction::FailBeforeEffect
    };
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, fault));
    let p = rig
        .create_payment(&format!("k-{order_ref}"), &payment_body(order_ref))
        .await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(1).await;
    rig.pass_the_key_window().await;
    escalate(rig).await;
    assert_eq!(rig.payment(&id).await["status"], "needs_review");
    rig.provider.control().clear_faults();
    id
}

fn verdict(
    payment: &str,
    attempt: AttemptId,
    outcome: ManualOutcome,
    provider_ref: Option<&str>,
) -> ManualResolution {
    ManualResolution {
        payment: payment.parse::<PaymentId>().expect("payment id"),
        attempt,
        outcome,
        provider_ref: provider_ref.map(str::to_owned),
        operator: "alice".into(),
        reason: "checked".into(),
        invoked_by: "alice@desk".into(),
        verified: None,
    }
}

/// Checks `r` at the provider, then applies it, as `cobro payments
/// resolve` does: the status after, or the refusal.
async fn resolve(rig: &Rig, mut r: ManualResolution) -> Result<String, ResolveError> {
    r.verified = Some(rig.reconciler(|_| {}).check_verdict(&r).await?);
    cobro_reconciler::resolve_by_hand(&rig.app.db.store, &r, rig.app.clock.now()).await
}

async fn first_attempt(rig: &Rig, payment: &str) -> AttemptId {
    rig.attempts(payment).await[0].id
}

/// The provider charged; the operator says "failed": refused, with the
/// charge named. Another account's charge for the same order ref does
/// not make a "captured" verdict true either. The true verdict passes,
/// is audited with who ran it, and the provider holds one charge per
/// payment.
async fn a_no_money_verdict_is_refused_while_the_provider_holds_the_charge(backend: Backend) {
    let rig = Rig::new(backend).await;
    let id = in_review(&rig, "o-1", true).await;
    let attempt = first_attempt(&rig, &id).await;
    let charge = rig.ledger().charges[0].id.clone();

    for wrong in [ManualOutcome::Failed, ManualOutcome::Declined] {
        let refused = resolve(&rig, verdict(&id, attempt, wrong, None)).await;
        assert!(
            matches!(&refused, Err(ResolveError::Contradicted(why)) if why.contains(&charge)),
            "{refused:?}"
        );
    }
    // Merchant B pays its own "o-1": its charge is not A's.
    let (_, token_b) = rig.app.new_account("merchant-b").await;
    let r = rig
        .app
        .post_as(&token_b, "/v1/payments", Some("b-1"))
        .json(&payment_body("o-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status().as_u16(), 201);
    rig.drain(2).await;
    let b_charge = rig
        .ledger()
        .charges
        .iter()
        .map(|c| c.id.clone())
        .find(|c| *c != charge)
        .expect("B's charge");
    let refused = resolve(
        &rig,
        verdict(&id, attempt, ManualOutcome::Captured, Some(&b_charge)),
    )
    .await;
    assert!(
        matches!(refused, Err(ResolveError::Contradicted(_))),
        "{refused:?}"
    );
    assert_eq!(rig.payment(&id).await["status"], "needs_review");

    let after = resolve(
        &rig,
        verdict(&id, attempt, ManualOutcome::Captured, Some(&charge)),
    )
    .await
    .expect("the true verdict");
    assert_eq!(after, "captured");
    assert_eq!(rig.payment(&id).await["provider_ref"], charge.as_str());
    let audited = rig
        .app
        .db
        .count(
            "reconciliation_decisions WHERE decision = 'manual_resolve' \
             AND provider_said LIKE '%alice@desk%' AND provider_said LIKE '%\"verified\":true%'",
        )
        .await;
    assert_eq!(audited, 1, "who ran it, and that it was checked");
    assert_eq!(rig.ledger().totals.charges, 2, "one charge per payment");
}

/// Nothing was charged, but "failed" needs proof: refused while the
/// provider cannot be read consistently, accepted once it can. The order
/// is then free and paid once.
async fn a_no_money_verdict_needs_a_consistent_read_that_proves_it(backend: Backend) {
    let rig = Rig::new(backend).await;
    let id = in_review(&rig, "o-2", false).await;
    let attempt = first_attempt(&rig, &id).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::List, FaultAction::FailBeforeEffect));
    let refused = resolve(&rig, verdict(&id, attempt, ManualOutcome::Failed, None)).await;
    assert!(
        matches!(refused, Err(ResolveError::Unproven(_))),
        "{refused:?}"
    );
    // A success nobody can show is refused too.
    let refused = resolve(
        &rig,
        verdict(&id, attempt, ManualOutcome::Captured, Some("ch_made_up")),
    )
    .await;
    assert!(
        matches!(refused, Err(ResolveError::Contradicted(_))),
        "{refused:?}"
    );
    rig.provider.control().clear_faults();
    let after = resolve(&rig, verdict(&id, attempt, ManualOutcome::Failed, None))
        .await
        .expect("proven");
    assert_eq!(after, "failed");
    assert_eq!(rig.ledger().totals.charges, 0);
    // The order is free: paid again, once.
    let p = rig
        .create_payment("k-o-2-again", &payment_body("o-2"))
        .await;
    rig.drain(2).await;
    let again = p["id"].as_str().expect("id");
    assert_eq!(rig.payment(again).await["status"], "captured");
    assert_eq!(rig.ledger().totals.charges, 1);
}

/// A captured payment of `order_ref` and a refund of all of it whose
/// answer was lost (`refunded`: the provider made it), escalated to
/// `needs_review`: the payment's id and the refund as created.
async fn refund_in_review(rig: &Rig, order_ref: &str, refunded: bool) -> (String, Value) {
    let p = rig
        .create_payment(&format!("k-{order_ref}"), &payment_body(order_ref))
        .await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(1).await;
    assert_eq!(rig.payment(&id).await["status"], "captured");
    let fault = if refunded {
        FaultAction::DropResponseAfterEffect
    } else {
        FaultAction::FailBeforeEffect
    };
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Refund, fault));
    let refund = refund_all(rig, &id, "r-1").await;
    assert_eq!(refund.0, 201, "{:?}", refund.1);
    rig.drain(1).await;
    rig.pass_the_key_window().await;
    escalate(rig).await;
    let shown = rig.payment(&id).await;
    assert_eq!(shown["status"], "captured", "the payment is not in review");
    rig.provider.control().clear_faults();
    (id, refund.1)
}

/// POST a refund of the whole 1999: its status code and body.
async fn refund_all(rig: &Rig, payment: &str, key: &str) -> (u16, Value) {
    let r = rig
        .app
        .post(&format!("/v1/payments/{payment}/refunds"), Some(key))
        .json(&json!({ "amount": 1999 }))
        .send()
        .await
        .expect("send");
    (r.status().as_u16(), r.json().await.expect("json"))
}

async fn refund_status(rig: &Rig, payment: &str, refund: &Value) -> String {
    let id = refund["id"].as_str().expect("refund id");
    let shown = rig
        .get_json(&format!("/v1/payments/{payment}/refunds/{id}"))
        .await;
    shown["status"].as_str().expect("status").to_owned()
}

/// A refund in review whose absence the provider then proves is failed,
/// its amount released: the merchant refunds again and the customer is
/// refunded once. Before, it stayed in review for ever, holding its
/// amount (`refund-exceeds-captured`).
async fn a_refund_in_review_proven_without_effect_is_failed_and_refundable_again(backend: Backend) {
    let rig = Rig::new(backend).await;
    let (id, refund) = refund_in_review(&rig, "o-3", false).await;
    assert_eq!(refund_status(&rig, &id, &refund).await, "needs_review");
    let (held, _) = refund_all(&rig, &id, "r-2").await;
    assert_eq!(held, 422, "the amount is held by the refund in review");

    rig.app.clock.advance(Duration::minutes(2));
    let summary = reconcile(&rig).await;
    assert_eq!(
        summary.items[0].verdict,
        Verdict::FailedNoEffect,
        "{summary:?}"
    );
    assert_eq!(refund_status(&rig, &id, &refund).await, "failed");
    assert_eq!(rig.ledger().totals.refunds, 0);

    let (again, _) = refund_all(&rig, &id, "r-3").await;
    assert_eq!(again, 201);
    rig.drain(2).await;
    assert_eq!(rig.payment(&id).await["status"], "refunded");
    assert_eq!(rig.ledger().totals.refunds, 1, "refunded once");
}

/// A refund in review while its payment is `captured` is resolved on its
/// own: "failed" is refused while the provider holds the refund, and the
/// true verdict settles it.
async fn a_refund_in_review_is_resolved_on_its_own_while_its_payment_is_captured(backend: Backend) {
    let rig = Rig::new(backend).await;
    let (id, refund) = refund_in_review(&rig, "o-4", true).await;
    let refund_attempt = rig
        .attempts(&id)
        .await
        .into_iter()
        .find(|a| a.refund_id.is_some())
        .map(|a| a.id)
        .expect("the refund's attempt");
    let made = rig.ledger().refunds[0].id.clone();
    let refused = resolve(
        &rig,
        verdict(&id, refund_attempt, ManualOutcome::Failed, None),
    )
    .await;
    assert!(
        matches!(refused, Err(ResolveError::Contradicted(_))),
        "{refused:?}"
    );
    assert_eq!(refund_status(&rig, &id, &refund).await, "needs_review");
    resolve(
        &rig,
        verdict(&id, refund_attempt, ManualOutcome::Captured, Some(&made)),
    )
    .await
    .expect("the true verdict");
    assert_eq!(refund_status(&rig, &id, &refund).await, "succeeded");
    assert_eq!(rig.payment(&id).await["status"], "refunded");
    assert_eq!(rig.ledger().totals.refunds, 1);
}

/// A captured payment stopped by a conflict: "failed" would free the
/// order while the charge stays captured (and could no longer be
/// refunded through cobro). Refused, even unverified; "captured" restores it.
async fn a_verdict_against_a_recorded_capture_is_refused(backend: Backend) {
    let rig = Rig::new(backend).await;
    let p = rig.create_payment("k-1", &payment_body("o-5")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(1).await;
    let attempt = rig.stop_the_line(&id).await;

    let checked = resolve(&rig, verdict(&id, attempt, ManualOutcome::Failed, None)).await;
    assert!(
        matches!(checked, Err(ResolveError::Contradicted(_))),
        "{checked:?}"
    );
    let unverified = cobro_reconciler::resolve_by_hand(
        &rig.app.db.store,
        &verdict(&id, attempt, ManualOutcome::Failed, None),
        rig.app.clock.now(),
    )
    .await;
    assert!(
        matches!(unverified, Err(ResolveError::ContradictsRecord(_))),
        "{unverified:?}"
    );
    let charge = rig.ledger().charges[0].id.clone();
    let after = resolve(
        &rig,
        verdict(&id, attempt, ManualOutcome::Captured, Some(&charge)),
    )
    .await
    .expect("restored");
    assert_eq!(after, "captured");
    let (refunded, _) = refund_all(&rig, &id, "r-1").await;
    assert_eq!(refunded, 201, "still refundable through cobro");
    rig.drain(2).await;
    assert_eq!(rig.ledger().totals.charges, 1);
    assert_eq!(rig.ledger().totals.refunds, 1);
}

/// A refunded payment stopped by a conflict, whose refund the provider
/// then fails (its amount given back while the payment is in review): the
/// operator's "captured" ends it `captured`, refundable again, where it
/// restored `refunded`, the status the conflict had stopped, with nothing
/// refunded and no refund possible through cobro.
async fn a_captured_verdict_follows_what_is_refunded_now_not_the_status_before_review(
    backend: Backend,
) {
    let mut rig = Rig::new(backend).await;
    rig.accept_webhooks("whsec_verdicts", true).await;
    let p = rig.create_payment("k-1", &payment_body("o-6")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(1).await;
    let (refunded, _) = refund_all(&rig, &id, "r-1").await;
    assert_eq!(refunded, 201);
    rig.drain(1).await;
    assert_eq!(rig.payment(&id).await["status"], "refunded");
    let attempt = rig.stop_the_line(&id).await;

    let made = rig.ledger().refunds[0].id.clone();
    assert!(rig.provider.control().fail_refund(&made));
    cobro_test_support::wait_for(
        "the refund failed while its payment is in review",
        std::time::Duration::from_secs(20),
        async || {
            let p = rig.payment(&id).await;
            (p["amount_refunded"] == 0).then_some(())
        },
    )
    .await;
    assert_eq!(rig.payment(&id).await["status"], "needs_review");

    let charge = rig.ledger().charges[0].id.clone();
    let after = resolve(
        &rig,
        verdict(&id, attempt, ManualOutcome::Captured, Some(&charge)),
    )
    .await
    .expect("the true verdict");
    assert_eq!(after, "captured", "nothing is refunded now");
    let (again, body) = refund_all(&rig, &id, "r-2").await;
    assert_eq!(again, 201, "refundable through cobro again: {body}");
    rig.drain(2).await;
    assert_eq!(rig.payment(&id).await["status"], "refunded");
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, 1);
    assert_eq!(
        (ledger.totals.refunds, ledger.totals.refund_failures),
        (2, 1),
        "refunded once for good"
    );
}
