//! The reconciler against the fake provider, on both backends and through
//! both connectors (the fake's own API; the Stripe connector against the
//! fake's Stripe dialect, where search is `payment_intents/search`): it
//! applies only what the provider proves, and the ledger shows no second
//! charge.

use chrono::Duration;
use cobro_core::{Clock, PaymentId};
use cobro_provider::{Connector, Outcome, ProviderObject, QueryError};
use cobro_reconciler::{
    ManualOutcome, ManualResolution, Reconciler, ReconcilerConfig, Scope, Verdict,
};
use cobro_test_support::{Backend, Dialect, Rig, on_every_provider, payment_body};
use cobro_worker::Step;
use fake_provider::{FaultAction, FaultRule, Operation as FOp};
use serde_json::Value;

on_every_provider!(
    an_expired_key_window_with_an_existing_charge_is_adopted_not_charged_again,
    proven_no_effect_by_the_list_retries_with_a_new_key_once,
    a_reconciler_whose_clock_is_off_the_databases_proves_no_absence,
    a_search_that_never_catches_up_proves_nothing_and_the_list_adopts_the_charge,
    with_no_consistent_read_it_waits_and_escalates_never_charging_again,
    a_send_that_may_still_reach_the_provider_is_waited_for,
    a_refund_send_is_waited_for_two_request_timeouts,
    a_request_still_in_progress_under_its_key_is_never_absence,
    a_charge_answered_processing_is_read_until_it_ends_never_resent,
    a_failing_status_query_decides_nothing,
    unresolved_past_the_horizon_needs_review_and_an_operator_resolves_it,
    two_reconcilers_on_one_backlog_decide_each_payment_once,
    a_replay_by_another_reconciler_after_this_ones_read_is_never_taken_for_absence,
    a_stored_answer_to_a_replay_is_read_again_before_it_counts_as_absence,
    a_dry_run_changes_nothing,
    an_unreadable_candidate_is_an_error_and_the_run_settles_the_rest_on_later_pages,
);

/// Faults only the Stripe dialect knows.
mod stripe_only {
    use super::*;
    cobro_test_support::on_both_backends!(a_500_stripe_saved_under_the_key_never_proves_absence);
}

fn reconciler(rig: &Rig, tweak: impl FnOnce(&mut ReconcilerConfig)) -> Reconciler<Connector> {
    rig.reconciler(tweak)
}

fn no_progress(_: usize, _: usize) {}

/// Creates a payment whose first send has the given fault, then lets cobro's
/// clock pass the provider key window so the worker hands it over.
async fn handed_over(rig: &Rig, order: &str, fault: FaultAction) -> String {
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, fault).with_reference(format!("{order}:")));
    let p = rig
        .create_payment(&format!("key-{order}"), &payment_body(order))
        .await;
    let id = p["id"].as_str().expect("id").to_owned();
    let steps = rig.drain(1).await;
    assert!(
        steps.contains(&Step::Rescheduled { class: "unknown" }),
        "{steps:?}"
    );
    id
}

/// Payment `o-1`, whose every send failed before any effect, handed to
/// the reconciler past the worker's window; the provider's faults cleared.
async fn handed_over_unsent(rig: &Rig) -> String {
    let id = handed_over(rig, "o-1", FaultAction::FailBeforeEffect).await;
    pass_the_window(rig, 1).await;
    rig.provider.control().clear_faults();
    id
}

async fn pass_the_window(rig: &Rig, expected: usize) {
    rig.app
        .clock
        .advance(Duration::hours(23) + Duration::minutes(1));
    let steps = rig.drain(2).await;
    assert_eq!(
        steps.iter().filter(|s| **s == Step::HandedOver).count(),
        expected,
        "{steps:?}"
    );
}

async fn an_expired_key_window_with_an_existing_charge_is_adopted_not_charged_again(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    let id = handed_over(&rig, "o-1", FaultAction::FailAfterEffect).await;
    pass_the_window(&rig, 1).await;
    // The provider forgets the key: a resend now WOULD be a second charge.
    rig.provider
        .control()
        .advance_clock(std::time::Duration::from_secs(25 * 3600));
    assert_eq!(rig.payment(&id).await["status"], "requires_reconciliation");

    let summary = reconciler(&rig, |_| {})
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(summary.examined, 1);
    assert_eq!(
        summary.items[0].verdict,
        Verdict::Resolved {
            outcome: "succeeded".into()
        }
    );
    let p = rig.payment(&id).await;
    assert_eq!(p["status"], "captured");
    let ledger = rig.ledger();
    assert!(
        p["provider_ref"]
            .as_str()
            .is_some_and(|r| r.starts_with(dialect.charge_prefix()))
    );
    assert_eq!(
        cobro_test_support::for_intent(&ledger, "o-1:authorize-v1").charges,
        1,
        "adopted, never charged again"
    );
    // Nothing is left for the worker or a second run.
    assert!(rig.drain(2).await.is_empty());
    let again = reconciler(&rig, |_| {})
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(again.examined, 0);
    assert_eq!(
        rig.app
            .db
            .count("reconciliation_decisions WHERE decision = 'adopt_succeeded'")
            .await,
        1
    );
    assert_eq!(rig.ledger().totals.charges, 1);
}

async fn proven_no_effect_by_the_list_retries_with_a_new_key_once(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    let id = handed_over_unsent(&rig).await;
    let summary = reconciler(&rig, |_| {})
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(summary.items[0].verdict, Verdict::Retried);
    assert_eq!(rig.payment(&id).await["status"], "processing");
    rig.drain(2).await;
    let p = rig.payment(&id).await;
    assert_eq!(p["status"], "captured");
    let attempts = p["attempts"].as_array().expect("attempts");
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0]["state"], "no_effect");
    assert_eq!(attempts[1]["state"], "succeeded");
    assert_eq!(
        rig.app
            .db
            .count("(SELECT DISTINCT provider_key FROM attempts) k")
            .await,
        2,
        "a new provider key"
    );
    assert_eq!(
        rig.ledger().totals.charges,
        1,
        "exactly one charge in the end"
    );
}

/// Send times are bounded against the database's clock; a reconciler whose
/// clock is off it by more than the bound (half the skew allowance in
/// cobro) proves nothing, however empty the list: the attempt stays
/// unknown and nothing is charged. The same reconciler unbounded (as this
/// rig's manual clock, days from the database's, needs) proves it.
async fn a_reconciler_whose_clock_is_off_the_databases_proves_no_absence(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    let id = handed_over_unsent(&rig).await;
    let bounded = reconciler(&rig, |c| {
        c.max_clock_gap = Some(std::time::Duration::from_secs(5));
    })
    .run(&Scope::default(), false, "test", &no_progress)
    .await
    .expect("run");
    match &bounded.items[0].verdict {
        Verdict::StillUnknown { reason } => {
            assert!(reason.contains("off the database's clock"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(rig.payment(&id).await["status"], "requires_reconciliation");
    assert_eq!(rig.ledger().totals.charges, 0);
    let unbounded = reconciler(&rig, |_| {})
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(unbounded.items[0].verdict, Verdict::Retried);
    rig.drain(2).await;
    assert_eq!(rig.ledger().totals.charges, 1, "one charge, by the retry");
}

/// A payment whose charge is made but answered with a 500, in a provider
/// key window that closes right after the first send: the worker hands the
/// attempt over at once, so the reconciler looks while the last send is
/// still recent. The provider's search shows the charge `search_lag`
/// seconds after it was made (its list at once).
async fn handed_over_at_once(backend: Backend, dialect: Dialect, search_lag: u64) -> (Rig, String) {
    let rig = Rig::with_in(backend, dialect, |_, worker| {
        worker.key_retention = std::time::Duration::from_secs(2 * 3600);
        worker.safety_margin =
            std::time::Duration::from_secs(2 * 3600) - std::time::Duration::from_millis(1);
    })
    .await;
    rig.provider.control().add_fault(
        FaultRule::new(FOp::Charge, FaultAction::SearchLag).with_lag_seconds(search_lag),
    );
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailAfterEffect));
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    assert_eq!(rig.drain(1).await, vec![Step::HandedOver]);
    (rig, id)
}

/// The charge is made (answered 500), and the provider's search will not
/// show it for two days: an outage that never catches up. Ten minutes in,
/// the consistent list finds it and it is adopted: one charge. Before this
/// release, "not found" by the search after its lag was proof of no effect
/// and a second charge followed under a new key.
async fn a_search_that_never_catches_up_proves_nothing_and_the_list_adopts_the_charge(
    backend: Backend,
    dialect: Dialect,
) {
    let (rig, id) = handed_over_at_once(backend, dialect, 48 * 3600).await;
    advance(&rig, 600);
    adopts_the_charge(&rig, &id, &reconciler(&rig, |_| {})).await;
}

/// The same, with the provider's list failing too: no read can prove
/// absence, so nothing is decided however long the search has had, and at
/// the horizon the payment goes to `needs_review`. One charge throughout,
/// never a second under a new key.
async fn with_no_consistent_read_it_waits_and_escalates_never_charging_again(
    backend: Backend,
    dialect: Dialect,
) {
    let (rig, id) = handed_over_at_once(backend, dialect, 48 * 3600).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::List, FaultAction::FailBeforeEffect));
    let recon = reconciler(&rig, |_| {});
    advance(&rig, 6 * 3600);
    decides_nothing(&rig, &id, &recon, "no consistent read").await;
    advance(&rig, 19 * 3600);
    let summary = recon
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(summary.items[0].verdict, Verdict::Escalated);
    assert_eq!(rig.payment(&id).await["status"], "needs_review");
    assert!(rig.drain(1).await.is_empty(), "no new attempt");
    assert_eq!(rig.app.db.count("attempts").await, 1);
    assert_eq!(rig.ledger().totals.charges, 1, "never a second charge");
}

/// "No effect" waits until the last send can no longer reach the provider
/// (request timeout plus the clock skew allowance), even when the list
/// finds nothing: here the charge was never made, and the reconciler asks
/// 5 s after the send, inside a 10 s request timeout.
async fn a_send_that_may_still_reach_the_provider_is_waited_for(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::with_in(backend, dialect, |_, worker| {
        worker.key_retention = std::time::Duration::from_secs(2 * 3600);
        worker.safety_margin =
            std::time::Duration::from_secs(2 * 3600) - std::time::Duration::from_millis(1);
    })
    .await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailBeforeEffect));
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    assert_eq!(rig.drain(1).await, vec![Step::HandedOver]);
    rig.provider.control().clear_faults();
    let recon = reconciler(&rig, |c| {
        c.request_timeout = std::time::Duration::from_secs(10);
        c.key_window = None;
    });
    advance(&rig, 5);
    decides_nothing(&rig, &id, &recon, "could still reach").await;
    assert_eq!(rig.ledger().totals.charges, 0);
    advance(&rig, 30);
    let summary = recon
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(summary.items[0].verdict, Verdict::Retried);
    rig.drain(2).await;
    assert_eq!(rig.payment(&id).await["status"], "captured");
    assert_eq!(rig.ledger().totals.charges, 1, "one charge in the end");
}

/// A refund's send is two requests at Stripe (the PaymentIntent's charge
/// read, then the refund posted), each bounded by the request timeout: the
/// refund may reach the provider two timeouts after the send began, so
/// "no effect" waits for both (last send + 2 x timeout + skew). Past one
/// timeout and the skew, where an authorisation would be decided, nothing
/// is (found by a read-only review, 2026-12-07); past both, the refund is
/// retried under a new key and refunds once.
async fn a_refund_send_is_waited_for_two_request_timeouts(backend: Backend, dialect: Dialect) {
    let rig = Rig::with_in(backend, dialect, |_, worker| {
        worker.key_retention = std::time::Duration::from_secs(2 * 3600);
        worker.safety_margin =
            std::time::Duration::from_secs(2 * 3600) - std::time::Duration::from_millis(1);
    })
    .await;
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(2).await;
    assert_eq!(rig.payment(&id).await["status"], "captured");
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Refund, FaultAction::FailBeforeEffect));
    rig.post_ok(
        &format!("/v1/payments/{id}/refunds"),
        "r-1",
        serde_json::json!({ "amount": 500 }),
    )
    .await;
    assert_eq!(rig.drain(1).await, vec![Step::HandedOver]);
    rig.provider.control().clear_faults();
    let recon = reconciler(&rig, |c| {
        c.request_timeout = std::time::Duration::from_secs(10);
        c.key_window = None;
    });
    // One timeout and the skew (20 s) passed, not two (30 s).
    advance(&rig, 25);
    unknown_because(&recon, "could still reach").await;
    assert_eq!(rig.app.db.count("attempts").await, 2, "no new attempt");
    advance(&rig, 10);
    let summary = recon
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(summary.items[0].verdict, Verdict::Retried, "{summary:?}");
    rig.drain(2).await;
    assert_eq!(rig.ledger().totals.refunds, 1, "one refund in the end");
}

/// Stripe saves the 500 of a request that began executing and rolled back
/// (`fail_saved_before_effect`): nothing made, and every replay under the
/// key answers the same 500. Stripe documents such an answer as
/// indeterminate (it may complete the request later by itself), so the
/// replay's saved 500 and an empty list prove nothing: no new key, no
/// PaymentIntent; the attempt stays unknown and reaches `needs_review` at
/// the horizon. Before, the list read again after the replay "proved" no
/// effect a minute after the 500, and a new key charged (found by a
/// read-only review, 2026-12-07).
async fn a_500_stripe_saved_under_the_key_never_proves_absence(backend: Backend) {
    let rig = Rig::new_in(backend, Dialect::Stripe).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailSavedBeforeEffect).with_next(1));
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    assert_eq!(rig.drain(1).await, vec![Step::HandedOver]);
    advance(&rig, 120);
    // As cobro sets it for Stripe: a request lives as long as its key.
    let recon = reconciler(&rig, |c| {
        c.request_lifetime = std::time::Duration::from_secs(24 * 3600);
    });
    unknown_because(&recon, "indeterminate").await;
    let attempts = rig.attempts(&id).await;
    assert_eq!(attempts.len(), 1, "no new key");
    assert_eq!(attempts[0].send_count, 2, "the send and the replay");
    assert!(rig.drain(3).await.is_empty(), "nothing to send");
    advance(&rig, 24 * 3600);
    let summary = recon
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(summary.items[0].verdict, Verdict::Escalated, "{summary:?}");
    assert_eq!(rig.payment(&id).await["status"], "needs_review");
    assert_eq!(rig.attempts(&id).await.len(), 1);
    assert!(rig.ledger().charges.is_empty(), "no PaymentIntent charged");
}

/// A request the provider holds (its key in progress, no charge made yet)
/// while the list shows nothing: inside the key's retention the reconciler
/// replays the key before deciding, and "in progress" is never absence.
/// Once the provider makes the charge, it is adopted: one charge, never a
/// second under a new key. (The Stripe dialect cannot hold a request; there
/// the fault refuses it before any effect, and the replay makes the one
/// charge under the same key.)
async fn a_request_still_in_progress_under_its_key_is_never_absence(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::HoldEffect).with_next(1));
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    rig.drain(1).await;
    // The worker's budget is spent: it hands the attempt over while the
    // provider still holds the first request (or refused it).
    rig.app
        .clock
        .advance(Duration::hours(23) + Duration::minutes(1));
    rig.drain(2).await;
    advance(&rig, 60);
    let recon = reconciler(&rig, |c| {
        c.key_window = Some(std::time::Duration::from_secs(48 * 3600));
    });
    let summary = recon
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    match (&dialect, &summary.items[0].verdict) {
        (Dialect::Fake, Verdict::StillUnknown { reason }) => {
            assert!(reason.contains("replay"), "{reason}");
            assert_eq!(rig.ledger().totals.charges, 0);
            assert_eq!(rig.provider.control().release_held(), 1);
            adopts_the_charge(&rig, &id, &recon).await;
        }
        (Dialect::Stripe, Verdict::Resolved { .. }) => {}
        (_, other) => panic!("{dialect:?}: {other:?}"),
    }
    assert_eq!(rig.payment(&id).await["status"], "captured");
    assert_eq!(rig.app.db.count("attempts").await, 1, "never a new key");
    assert_eq!(rig.ledger().totals.charges, 1);
}

/// A charge the provider answers `processing` (made; its outcome known
/// only later): a resend under the same key would replay that answer for
/// as long as the key lives (the explorer found payments left `processing`
/// so), so the worker hands it to the reconciler at once, which reads it,
/// in progress, until it ends, then adopts it. One request, one charge.
async fn a_charge_answered_processing_is_read_until_it_ends_never_resent(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    rig.provider.control().add_fault(
        FaultRule::new(FOp::Charge, FaultAction::Processing)
            .with_next(1)
            .with_lag_seconds(600),
    );
    let p = rig.create_payment("k-1", &payment_body("o-1")).await;
    let id = p["id"].as_str().expect("id").to_owned();
    assert_eq!(rig.drain(1).await, vec![Step::HandedOver]);
    assert_eq!(rig.payment(&id).await["status"], "requires_reconciliation");
    advance(&rig, 60);
    let recon = reconciler(&rig, |_| {});
    let waiting = recon
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    match &waiting.items[0].verdict {
        Verdict::StillUnknown { reason } => assert!(reason.contains("in progress"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        rig.ledger().totals.charges,
        0,
        "not final: counted nowhere yet"
    );
    advance(&rig, 600);
    let done = recon
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert!(
        matches!(done.items[0].verdict, Verdict::Resolved { .. }),
        "{done:?}"
    );
    assert_eq!(rig.payment(&id).await["status"], "captured");
    assert_eq!(rig.drain(2).await, vec![], "nothing is resent");
    assert_eq!(rig.app.db.count("attempts").await, 1, "never a new key");
    let creates = rig
        .provider
        .control()
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST")
        .count();
    assert_eq!(creates, 1, "one request to the provider");
    assert_eq!(rig.ledger().totals.charges, 1);
}

/// A run of `recon` over the payment `id` decides nothing, for `why`: no
/// decision, no new attempt.
async fn decides_nothing<P: cobro_provider::Provider>(
    rig: &Rig,
    id: &str,
    recon: &Reconciler<P>,
    why: &str,
) {
    unknown_because(recon, why).await;
    assert_eq!(rig.payment(id).await["status"], "requires_reconciliation");
    assert_eq!(rig.app.db.count("reconciliation_decisions").await, 0);
    assert_eq!(rig.app.db.count("attempts").await, 1, "no new attempt");
}

/// A run of `recon` over its one candidate leaves it unknown, saying `why`.
async fn unknown_because<P: cobro_provider::Provider>(recon: &Reconciler<P>, why: &str) {
    let summary = recon
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    match &summary.items[0].verdict {
        Verdict::StillUnknown { reason } => assert!(reason.contains(why), "{reason}"),
        other => panic!("nothing is proven yet: {other:?}"),
    }
}

/// Both clocks, cobro's and the provider's, move on by `seconds`.
fn advance(rig: &Rig, seconds: u64) {
    rig.app.clock.advance(Duration::seconds(seconds as i64));
    rig.provider
        .control()
        .advance_clock(std::time::Duration::from_secs(seconds));
}

/// A run of `recon` finds the payment's charge and adopts it: captured,
/// one attempt, one charge.
async fn adopts_the_charge<P: cobro_provider::Provider>(
    rig: &Rig,
    id: &str,
    recon: &Reconciler<P>,
) {
    let summary = recon
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(
        summary.items[0].verdict,
        Verdict::Resolved {
            outcome: "succeeded".into()
        }
    );
    assert_eq!(rig.payment(id).await["status"], "captured");
    assert_eq!(rig.app.db.count("attempts").await, 1);
    assert_eq!(rig.ledger().totals.charges, 1, "one charge at the provider");
}

async fn a_failing_status_query_decides_nothing(backend: Backend, dialect: Dialect) {
    let rig = Rig::new_in(backend, dialect).await;
    let id = handed_over_unsent(&rig).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Search, FaultAction::FailBeforeEffect));
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::List, FaultAction::FailBeforeEffect));
    let summary = reconciler(&rig, |_| {})
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    match &summary.items[0].verdict {
        Verdict::StillUnknown { reason } => assert!(reason.contains("proves nothing"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(summary.unresolved(), 1);
    assert_eq!(rig.payment(&id).await["status"], "requires_reconciliation");
    assert!(rig.drain(1).await.is_empty(), "no new attempt");
    assert_eq!(rig.ledger().totals.charges, 0);
}

async fn unresolved_past_the_horizon_needs_review_and_an_operator_resolves_it(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    let id = handed_over(&rig, "o-1", FaultAction::FailAfterEffect).await;
    pass_the_window(&rig, 1).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Search, FaultAction::FailBeforeEffect));
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::List, FaultAction::FailBeforeEffect));
    rig.app.clock.advance(Duration::hours(2));
    let summary = reconciler(&rig, |_| {})
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(summary.items[0].verdict, Verdict::Escalated);
    assert_eq!(rig.payment(&id).await["status"], "needs_review");
    // Visible to monitoring without a token.
    let metrics = rig
        .app
        .client
        .get(format!("{}/metrics", rig.app.url))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        metrics.contains("cobro_payments_unsettled{status=\"needs_review\"} 1"),
        "{metrics}"
    );
    // needs_review still blocks a second payment for the order.
    let blocked = rig
        .app
        .post("/v1/payments", Some("another-key"))
        .json(&payment_body("o-1"))
        .send()
        .await
        .expect("send");
    assert_eq!(blocked.status().as_u16(), 422);

    let charge = rig.ledger();
    assert_eq!(
        cobro_test_support::for_intent(&charge, "o-1:authorize-v1").charges,
        1
    );
    let attempt = rig.attempts(&id).await[0].id;
    let after = cobro_reconciler::resolve_by_hand(
        &rig.app.db.store,
        &ManualResolution {
            payment: id.parse::<PaymentId>().expect("id"),
            attempt,
            outcome: ManualOutcome::Captured,
            provider_ref: Some("ch_looked_up_by_hand".into()),
            operator: "alice".into(),
            reason: "confirmed in the provider dashboard".into(),
            invoked_by: "test@host".into(),
            verified: None,
        },
        rig.app.clock.now(),
    )
    .await
    .expect("resolve");
    assert_eq!(after, "captured");
    let p = rig.payment(&id).await;
    assert_eq!(p["status"], "captured");
    assert_eq!(p["provider_ref"], "ch_looked_up_by_hand");
    let audited = rig.app.db.count("reconciliation_decisions WHERE decision = 'manual_resolve' AND actor = 'operator:alice' AND reason = 'confirmed in the provider dashboard'").await;
    assert_eq!(audited, 1);
    assert_eq!(
        rig.app
            .db
            .count("reconciliation_decisions WHERE decision = 'escalate'")
            .await,
        1
    );
    // A second resolve is refused: the payment is no longer in review.
    let again = cobro_reconciler::resolve_by_hand(
        &rig.app.db.store,
        &ManualResolution {
            payment: id.parse().expect("id"),
            attempt,
            outcome: ManualOutcome::Failed,
            provider_ref: None,
            operator: "bob".into(),
            reason: "x".into(),
            invoked_by: "test@host".into(),
            verified: None,
        },
        rig.app.clock.now(),
    )
    .await;
    assert!(again.is_err());
    assert_eq!(rig.ledger().totals.charges, 1);
}

async fn two_reconcilers_on_one_backlog_decide_each_payment_once(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    const N: usize = 10;
    let mut ids = Vec::new();
    for i in 0..N {
        ids.push(handed_over(&rig, &format!("o-{i}"), FaultAction::FailAfterEffect).await);
    }
    pass_the_window(&rig, N).await;
    let (a, b) = (
        reconciler(&rig, |c| c.actor = "reconciler:a".into()),
        reconciler(&rig, |c| c.actor = "reconciler:b".into()),
    );
    let scope = Scope::default();
    let (ra, rb) = tokio::join!(
        a.run(&scope, false, "test", &no_progress),
        b.run(&scope, false, "test", &no_progress)
    );
    let (ra, rb) = (ra.expect("a"), rb.expect("b"));
    let resolved = |s: &cobro_reconciler::Summary| s.resolved.values().sum::<usize>();
    assert_eq!(
        resolved(&ra) + resolved(&rb),
        N,
        "each payment decided exactly once"
    );
    assert_eq!(rig.app.db.count("reconciliation_decisions").await, N as i64);
    for id in &ids {
        let p: Value = rig.payment(id).await;
        assert_eq!(p["status"], "captured");
    }
    let ledger = rig.ledger();
    assert_eq!(ledger.totals.charges, N as u64);
    assert!(ledger.duplicate_charge_references.is_empty());
}

/// A provider that, once armed, holds the answer of its next consistent
/// list until released: a reconciler stopped between its read and what it
/// does with it.
struct HeldAfterList {
    inner: Connector,
    armed: std::sync::atomic::AtomicBool,
    held: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

impl cobro_provider::Provider for HeldAfterList {
    fn name(&self) -> &str {
        self.inner.name()
    }
    async fn authorize(&self, key: &str, r: &cobro_provider::AuthorizeRequest) -> Outcome {
        self.inner.authorize(key, r).await
    }
    async fn capture(&self, key: &str, charge: &str) -> Outcome {
        self.inner.capture(key, charge).await
    }
    async fn void(&self, key: &str, charge: &str) -> Outcome {
        self.inner.void(key, charge).await
    }
    async fn refund(&self, key: &str, r: &cobro_provider::RefundRequest) -> Outcome {
        self.inner.refund(key, r).await
    }
    async fn send(
        &self,
        key: &str,
        mutation: cobro_provider::Mutation<'_>,
    ) -> cobro_provider::Sent {
        self.inner.send(key, mutation).await
    }
    async fn get_charge(&self, id: &str) -> Result<Option<ProviderObject>, QueryError> {
        self.inner.get_charge(id).await
    }
    async fn search_charges(&self, reference: &str) -> Result<Vec<ProviderObject>, QueryError> {
        self.inner.search_charges(reference).await
    }
    async fn search_refunds(
        &self,
        reference: &str,
        charge: Option<&str>,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        self.inner.search_refunds(reference, charge).await
    }
    async fn list_charges(
        &self,
        reference: &str,
        window: cobro_provider::Window,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        let answer = self.inner.list_charges(reference, window).await;
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let released = self.release.notified();
            self.held.notify_one();
            released.await;
        }
        answer
    }
    async fn list_refunds(
        &self,
        reference: &str,
        charge: &str,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        self.inner.list_refunds(reference, charge).await
    }
}

/// Two reconcilers on one attempt whose key never executed (its sends
/// failed before any effect). B reads the consistent list (nothing) and is
/// held there. A reads too, replays the key: the provider makes the charge
/// and answers a 500 (Stripe saves it under the key). Then B goes on. Its
/// replay would be answered that stored 500, and an answer stored under the
/// key was taken for an earlier send's, which B's read covered: "no
/// effect", a new key, a second charge. B's replay is pinned to the sends
/// its read covered, so it is refused and B decides nothing; the next run
/// reads again and adopts the one charge.
async fn a_replay_by_another_reconciler_after_this_ones_read_is_never_taken_for_absence(
    backend: Backend,
    dialect: Dialect,
) {
    let (rig, id, b) = a_key_run_between_a_read_and_its_replay(backend, dialect, true).await;
    match &b {
        Verdict::StillUnknown { reason } => {
            assert!(reason.contains("sent again meanwhile"), "{reason}");
        }
        other => panic!("B decided on a read older than A's replay: {other:?}"),
    }
    advance(&rig, 60);
    let recon = reconciler(&rig, |c| {
        c.key_window = Some(std::time::Duration::from_secs(48 * 3600));
    });
    adopts_the_charge(&rig, &id, &recon).await;
}

/// The same, but the key's late run was a send B's read covered (a
/// request held at the provider and run after the read; here A's replay
/// with its send uncounted, which is what such a request leaves): the pin
/// lets B replay, and B's replay is answered the stored 500. A stored
/// answer means no request under the key still acts, so B reads again
/// before deciding, finds the charge and adopts it.
async fn a_stored_answer_to_a_replay_is_read_again_before_it_counts_as_absence(
    backend: Backend,
    dialect: Dialect,
) {
    let (rig, id, b) = a_key_run_between_a_read_and_its_replay(backend, dialect, false).await;
    assert_eq!(
        b,
        Verdict::Resolved {
            outcome: "succeeded".into()
        }
    );
    assert_eq!(rig.payment(&id).await["status"], "captured");
}

/// Payment `o-1`'s attempt, handed over with its key never run; B reads
/// the list and is held; A replays the key (the charge made, a 500
/// answered); with `counted` false, A's send is taken back off the attempt
/// (a send B's read covered). B then goes on and the worker drains; one
/// charge, one attempt. The rig, the payment and B's verdict.
async fn a_key_run_between_a_read_and_its_replay(
    backend: Backend,
    dialect: Dialect,
    counted: bool,
) -> (Rig, String, Verdict) {
    let rig = Rig::new_in(backend, dialect).await;
    let id = handed_over_unsent(&rig).await;
    rig.provider
        .control()
        .add_fault(FaultRule::new(FOp::Charge, FaultAction::FailAfterEffect).with_next(1));
    advance(&rig, 60);
    assert_eq!(rig.ledger().totals.charges, 0, "no send had an effect yet");
    // The key is still kept (the window set wide, as in the tests above).
    let config = Rig::reconciler_config(|c| {
        c.key_window = Some(std::time::Duration::from_secs(48 * 3600));
        c.actor = "reconciler:b".into();
    });
    let held = std::sync::Arc::new(HeldAfterList {
        inner: rig.connector(),
        armed: std::sync::atomic::AtomicBool::new(true),
        held: tokio::sync::Notify::new(),
        release: tokio::sync::Notify::new(),
    });
    let b = Reconciler::new(
        rig.app.db.store.clone(),
        std::sync::Arc::clone(&held),
        std::sync::Arc::new(rig.app.clock.clone()),
        config,
    );
    let b_read = held.held.notified();
    let b_run = tokio::spawn(async move {
        b.run(&Scope::default(), false, "test", &no_progress)
            .await
            .expect("b")
    });
    b_read.await;
    let a = reconciler(&rig, |c| {
        c.key_window = Some(std::time::Duration::from_secs(48 * 3600));
        c.actor = "reconciler:a".into();
    })
    .run(&Scope::default(), false, "test", &no_progress)
    .await
    .expect("a");
    assert!(
        matches!(a.items[0].verdict, Verdict::StillUnknown { .. }),
        "{:?}",
        a.items[0].verdict
    );
    assert_eq!(rig.ledger().totals.charges, 1, "A's replay made the charge");
    if !counted {
        rig.app
            .db
            .exec("UPDATE attempts SET send_count = send_count - 1")
            .await;
    }
    held.release.notify_one();
    let b = b_run.await.expect("b's task").items.remove(0).verdict;
    // Whatever B queued goes out before anything is judged.
    let sent = rig.drain(1).await;
    assert_eq!(
        rig.ledger().totals.charges,
        1,
        "B decided {b:?} on a read older than the key's run, and the worker sent {sent:?}"
    );
    assert_eq!(rig.app.db.count("attempts").await, 1, "never a new key");
    assert!(sent.is_empty(), "{sent:?}");
    (rig, id, b)
}

async fn a_dry_run_changes_nothing(backend: Backend, dialect: Dialect) {
    let rig = Rig::new_in(backend, dialect).await;
    let id = handed_over(&rig, "o-1", FaultAction::FailAfterEffect).await;
    pass_the_window(&rig, 1).await;
    let summary = reconciler(&rig, |_| {})
        .run(&Scope::default(), true, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(
        summary.items[0].verdict,
        Verdict::Resolved {
            outcome: "succeeded".into()
        }
    );
    assert!(!summary.items[0].applied);
    assert_eq!(rig.payment(&id).await["status"], "requires_reconciliation");
    assert_eq!(rig.app.db.count("reconciliation_decisions").await, 0);
    assert_eq!(rig.app.db.count("reconciliation_runs").await, 0);
    let json = serde_json::to_value(&summary).expect("summary serialises");
    assert_eq!(json["examined"], 1);
    assert_eq!(rig.ledger().totals.charges, 1);
}

async fn an_unreadable_candidate_is_an_error_and_the_run_settles_the_rest_on_later_pages(
    backend: Backend,
    dialect: Dialect,
) {
    let rig = Rig::new_in(backend, dialect).await;
    let mut ids = Vec::new();
    for order in ["o-1", "o-2", "o-3"] {
        ids.push(handed_over(&rig, order, FaultAction::FailAfterEffect).await);
    }
    // The run's items name payments by their bare UUID.
    let uuid = |id: &String| uuid::Uuid::from(id.parse::<PaymentId>().expect("id")).to_string();
    pass_the_window(&rig, 3).await;
    rig.provider
        .control()
        .advance_clock(std::time::Duration::from_secs(25 * 3600));
    // An operation cobro never writes: o-2's attempt cannot be read back.
    rig.app
        .db
        .corrupt_attempts_of("o-2", "operation", "limbo")
        .await;
    // One candidate per page: the cursor must pass the unreadable one.
    let summary = reconciler(&rig, |c| c.page = 1)
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!(summary.examined, 3);
    assert_eq!(summary.errors, 1);
    let verdicts: Vec<_> = summary
        .items
        .iter()
        .map(|i| (i.payment_id.clone(), i.verdict.name()))
        .collect();
    assert_eq!(
        verdicts,
        vec![
            (uuid(&ids[0]), "resolved"),
            (uuid(&ids[1]), "error"),
            (uuid(&ids[2]), "resolved"),
        ]
    );
    for id in [&ids[0], &ids[2]] {
        assert_eq!(rig.payment(id).await["status"], "captured");
    }
    let ledger = rig.ledger();
    for order in ["o-1", "o-2", "o-3"] {
        assert_eq!(
            cobro_test_support::for_intent(&ledger, &format!("{order}:authorize-v1")).charges,
            1,
            "{order}: charged at its first send, never again"
        );
    }
    // The next run reports it again and finds nothing else to do.
    let again = reconciler(&rig, |c| c.page = 1)
        .run(&Scope::default(), false, "test", &no_progress)
        .await
        .expect("run");
    assert_eq!((again.examined, again.errors), (1, 1));
    assert_eq!(rig.ledger().totals.charges, 3);
}
