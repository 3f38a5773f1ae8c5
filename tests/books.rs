//! The books (docs/books.md) at process level, on both stores: real
//! `cobro serve` processes make payments against the fake provider, the
//! database is taken back to a backup (PostgreSQL `pg_dump`/`pg_restore`,
//! SQLite `VACUUM INTO` and a file swap while no process runs), and
//! `cobro books` must find exactly what the restore lost as orphans, and
//! nothing else. Every test counts the provider's ledger: the books list
//! and record, they never move money.

use cobro_test_support::site::{SETTLE, Site, id_of};
use cobro_test_support::{ALL_TIME, Backend, Dialect, on_both_backends, payment_body, wait_for};
use serde_json::{Value, json};
use std::time::Duration;

on_both_backends!(
    a_restored_backup_leaves_exactly_the_lost_charges_and_refunds_as_orphans,
    a_restored_backup_leaves_exactly_the_lost_payment_intents_and_refunds_as_orphans_on_stripe,
    a_refund_made_at_the_provider_behind_cobros_back_is_recorded_once,
    an_authorisation_voided_at_the_provider_is_applied_once_through_the_settle_path,
    successes_the_provider_does_not_hold_are_missing_and_raised_once,
    adopting_the_orphans_of_a_restore_brings_the_books_to_all_matched,
    adopting_the_orphans_of_a_restore_on_stripe,
    scheduled_runs_move_their_checkpoint_and_apply_drift_once_across_overlaps,
);

/// Processes of these tests run no scheduled books: each run is the
/// test's own `cobro books`.
const NO_BOOKS: [(&str, &str); 1] = [("COBRO_NO_BOOKS", "true")];

/// `cobro books ARGS --json` to its end: exit code and the report.
async fn books(site: &Site, args: &[&str]) -> (Option<i32>, Value) {
    let mut all = vec!["books"];
    all.extend_from_slice(args);
    all.push("--json");
    let (code, out) = site.run_cli(&all, &NO_BOOKS).await;
    let report = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("cobro books printed no report ({e}): {out:?}"));
    (code, report)
}

/// A books run over `window` (RFC 3339 instants): exit code and its one
/// provider's report.
async fn run_books(site: &Site, window: &(String, String)) -> (Option<i32>, Value) {
    let (code, all) = books(site, &["--from", &window.0, "--to", &window.1]).await;
    let runs = all["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 1, "one provider: {all}");
    (code, runs[0].clone())
}

fn counts(report: &Value) -> [u64; 6] {
    let c = &report["counts"];
    [
        "objects", "matched", "orphan", "foreign", "drifted", "missing",
    ]
    .map(|k| c[k].as_u64().unwrap_or_else(|| panic!("{k} in {report}")))
}

/// A window around the test: a minute either side of now.
fn window_around_now() -> (String, String) {
    let now = chrono::Utc::now();
    let at =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    (
        at(now - chrono::Duration::minutes(10)),
        at(now + chrono::Duration::minutes(1)),
    )
}

/// Creates and waits out an automatic payment of `token`'s account.
async fn captured(site: &Site, url: &str, token: &str, key: &str, order: &str) -> Value {
    let created = site
        .post_as(token, url, "/v1/payments", key, &payment_body(order))
        .send()
        .await
        .expect("an answer");
    assert_eq!(created.status().as_u16(), 201, "create {key}");
    let payment: Value = created.json().await.expect("json");
    let id = id_of(&payment);
    wait_for(&format!("payment {id} captured"), SETTLE, async || {
        let (_, p) = site.get_as(token, url, &format!("/v1/payments/{id}")).await;
        (p["status"] == "captured").then_some(p)
    })
    .await
}

async fn refunded(site: &Site, url: &str, token: &str, payment: &Value, amount: i64) -> Value {
    let id = id_of(payment);
    let answer = site
        .post_as(
            token,
            url,
            &format!("/v1/payments/{id}/refunds"),
            &format!("refund-{id}"),
            &json!({ "amount": amount }),
        )
        .send()
        .await
        .expect("an answer");
    assert_eq!(answer.status().as_u16(), 201, "refund of {id}");
    let refund: Value = answer.json().await.expect("json");
    let refund_id = refund["id"].as_str().expect("refund id").to_owned();
    wait_for(
        &format!("refund {refund_id} succeeded"),
        SETTLE,
        async || {
            let (_, r) = site
                .get_as(
                    token,
                    url,
                    &format!("/v1/payments/{id}/refunds/{refund_id}"),
                )
                .await;
            (r["status"] == "succeeded").then_some(r)
        },
    )
    .await
}

/// The provider's ledger, once it is checked to hold exactly `charges`
/// charges and `refunds` refunds in all.
fn ledger_holds(site: &Site, charges: u64, refunds: u64) -> fake_provider::Ledger {
    let ledger = site.ledger();
    assert_eq!(
        (ledger.totals.charges, ledger.totals.refunds),
        (charges, refunds),
        "{:?}",
        ledger.totals
    );
    ledger
}

async fn stop(mut serve: cobro_test_support::process::Cobro) {
    serve.sigterm();
    let status = serve.exit_within(Duration::from_secs(30)).await;
    assert!(status.success(), "cobro serve stopped: {status:?}");
}

/// Two accounts share every order ref. The backup holds their first
/// payments; after it, each account captures a second payment and the
/// first of account A is partly refunded. Restored, cobro has lost two
/// charges and one refund the provider holds: the books find exactly
/// those three as orphans (with what their metadata says), match the two
/// charges the backup kept, and a second run changes nothing. Once an
/// operator acknowledged them, every object is matched and a further run
/// changes nothing. The provider's ledger never moves.
async fn a_restored_backup_leaves_exactly_the_lost_charges_and_refunds_as_orphans(
    backend: Backend,
) {
    restored_backup(backend, Dialect::Fake).await;
}

/// The same through the Stripe connector against the fake's Stripe
/// dialect: the books list PaymentIntents and refunds by `created`.
async fn a_restored_backup_leaves_exactly_the_lost_payment_intents_and_refunds_as_orphans_on_stripe(
    backend: Backend,
) {
    restored_backup(backend, Dialect::Stripe).await;
}

async fn restored_backup(backend: Backend, dialect: Dialect) {
    let site = Site::new_in(backend, dialect).await;
    let token_b = site.new_account("other merchant").await;
    let window = window_around_now();
    let (serve, url) = site.serve("serve-1", &[], &NO_BOOKS).await;
    let kept_a = captured(&site, &url, &site.token, "k-1", "order-1").await;
    let kept_b = captured(&site, &url, &token_b, "k-1", "order-1").await;
    stop(serve).await;
    let backup = site.back_up().await;

    let (serve, url) = site.serve("serve-2", &[], &NO_BOOKS).await;
    let lost_a = captured(&site, &url, &site.token, "k-2", "order-2").await;
    let lost_b = captured(&site, &url, &token_b, "k-2", "order-2").await;
    let lost_refund = refunded(&site, &url, &site.token, &kept_a, 500).await;
    stop(serve).await;
    ledger_holds(&site, 4, 1);
    site.restore(&backup).await;
    assert_eq!(site.count("payments").await, 2);
    assert_eq!(site.count("refunds").await, 0);

    let (code, report) = run_books(&site, &window).await;
    assert_eq!(code, Some(3), "orphans are not matched: {report}");
    assert_eq!(counts(&report), [5, 2, 3, 0, 0, 0], "{report}");
    let orphans: Vec<&Value> = report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .collect();
    let mut found: Vec<(String, String)> = orphans
        .iter()
        .map(|f| {
            assert_eq!(f["class"], "orphan", "{f}");
            assert_eq!(f["action"], "recorded", "{f}");
            (
                f["kind"].as_str().expect("kind").to_owned(),
                f["payment"].as_str().expect("payment").to_owned(),
            )
        })
        .collect();
    found.sort();
    let mut lost = vec![
        ("charge".to_owned(), id_of(&lost_a)),
        ("charge".to_owned(), id_of(&lost_b)),
        ("refund".to_owned(), id_of(&kept_a)),
    ];
    lost.sort();
    assert_eq!(found, lost, "{report}");

    // What each orphan's metadata says, as kept: account, payment,
    // attempt, the provider's id, amount, currency and status.
    let (code, listed) = books(&site, &["orphans"]).await;
    assert_eq!(code, Some(0), "{listed}");
    let kept = listed["orphans"].as_array().expect("orphans").clone();
    assert_eq!(kept.len(), 3, "{listed}");
    let ledger = site.ledger();
    for orphan in &kept {
        let object = orphan["object"].as_str().expect("object");
        let (amount, currency, status, metadata) = match orphan["kind"].as_str() {
            Some("charge") => {
                // A charge of the fake's API, or the one a Stripe
                // PaymentIntent's confirmation made.
                let charge = ledger
                    .charge(object)
                    .or_else(|| ledger.charge_of_payment_intent(object))
                    .expect("a charge of the ledger");
                (
                    charge.amount,
                    charge.currency.clone(),
                    charge.status.clone(),
                    charge.metadata.clone(),
                )
            }
            _ => {
                let refund = ledger
                    .refunds
                    .iter()
                    .find(|r| r.id == object)
                    .expect("a refund of the ledger");
                assert_eq!(refund.amount, 500);
                (
                    refund.amount,
                    refund.currency.clone(),
                    refund.status.clone(),
                    refund.metadata.clone(),
                )
            }
        };
        assert_eq!(orphan["amount"], amount, "{orphan}");
        let listed_currency = orphan["currency"].as_str().expect("currency");
        assert!(listed_currency.eq_ignore_ascii_case(&currency), "{orphan}");
        assert_eq!(orphan["status"], status.as_str(), "{orphan}");
        for (field, key) in [
            ("account", "cobro_account"),
            ("payment", "cobro_payment"),
            ("attempt", "cobro_attempt"),
            ("intent", "cobro_intent"),
        ] {
            assert_eq!(orphan[field], metadata[key].as_str(), "{field} of {orphan}");
        }
        assert_eq!(orphan["state"], "open");
    }
    let accounts: std::collections::BTreeSet<&str> = kept
        .iter()
        .filter(|o| o["kind"] == "charge")
        .map(|o| o["account"].as_str().expect("account"))
        .collect();
    assert_eq!(accounts.len(), 2, "one lost charge per account: {listed}");
    let refund_orphan = kept
        .iter()
        .find(|o| o["kind"] == "refund")
        .expect("the lost refund");
    assert_eq!(
        refund_orphan["charge"], kept_a["provider_ref"],
        "{refund_orphan}"
    );
    assert_eq!(lost_refund["amount"], 500);

    // A second run over the same window changes nothing.
    let (code, again) = run_books(&site, &window).await;
    assert_eq!(code, Some(3));
    assert_eq!(counts(&again), [5, 2, 3, 0, 0, 0], "{again}");
    assert!(
        again["findings"]
            .as_array()
            .expect("findings")
            .iter()
            .all(|f| f["action"] == "already recorded"),
        "{again}"
    );
    assert_eq!(site.count("books_orphans").await, 3);
    assert_eq!(site.count("evidence_conflicts").await, 0);
    assert_eq!(site.count("books_runs").await, 2);

    // The operator acknowledges each (audited), and the books match them.
    for orphan in &kept {
        let id = orphan["id"].as_str().expect("id");
        let (code, out) = site
            .run_cli(
                &[
                    "books",
                    "acknowledge",
                    id,
                    "--reason",
                    "lost in the restore of the 1st; refunded by hand",
                    "--operator",
                    "ana",
                ],
                &NO_BOOKS,
            )
            .await;
        assert_eq!(code, Some(0), "{out}");
    }
    let (code, listed) = books(&site, &["orphans", "--all"]).await;
    assert_eq!(code, Some(0));
    for orphan in listed["orphans"].as_array().expect("orphans") {
        assert_eq!(orphan["state"], "acknowledged", "{orphan}");
        assert_eq!(orphan["resolved_by"], "operator:ana", "{orphan}");
        assert!(
            orphan["reason"]
                .as_str()
                .is_some_and(|r| r.contains("restore"))
        );
    }
    let (code, settled) = run_books(&site, &window).await;
    assert_eq!(code, Some(0), "{settled}");
    assert_eq!(counts(&settled), [5, 5, 0, 0, 0, 0], "{settled}");
    let (code, once_more) = run_books(&site, &window).await;
    assert_eq!(code, Some(0));
    assert_eq!(counts(&once_more), [5, 5, 0, 0, 0, 0], "{once_more}");
    assert_eq!(site.count("books_orphans WHERE state = 'open'").await, 0);
    assert_eq!(site.count("payments").await, 2);
    assert_eq!(site.count("refunds").await, 0);
    assert_eq!(site.count("books_runs").await, 4);
    let (_, runs) = books(&site, &["runs"]).await;
    let runs = runs["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 4);
    assert_eq!(
        (runs[0]["matched"].as_i64(), runs[3]["orphan"].as_i64()),
        (Some(5), Some(3))
    );

    // The books never moved money, and the kept payments are their charges.
    let ledger = ledger_holds(&site, 4, 1);
    for payment in [&kept_a, &kept_b, &lost_a, &lost_b] {
        let charges = ledger.charges_with_metadata("cobro_payment", &id_of(payment));
        assert_eq!(charges.len(), 1, "{payment}");
        assert_eq!(charges[0].amount, 1999);
    }
}

/// A refund made with cobro's key but not by cobro (no metadata: the
/// provider's dashboard) of a payment cobro captured: the books record it
/// once as a succeeded refund of that payment with its event, and a
/// second run finds it matched and changes nothing. The other account's
/// payment of the same order is untouched. When the provider then fails
/// that refund, the next run fails it in cobro too (its amount refundable
/// again, its event), once.
async fn a_refund_made_at_the_provider_behind_cobros_back_is_recorded_once(backend: Backend) {
    let site = Site::new(backend).await;
    let token_b = site.new_account("other merchant").await;
    let window = window_around_now();
    let (serve, url) = site.serve("serve", &[], &NO_BOOKS).await;
    let ours = captured(&site, &url, &site.token, "k-1", "order-1").await;
    let theirs = captured(&site, &url, &token_b, "k-1", "order-1").await;
    let charge = ours["provider_ref"]
        .as_str()
        .expect("provider_ref")
        .to_owned();
    let made: Value = site
        .http
        .post(format!("{}/v1/refunds", site.provider.url()))
        .bearer_auth("sk_test_cobro")
        .json(&json!({ "charge": charge, "amount": 700, "reference": "dashboard" }))
        .send()
        .await
        .expect("an answer")
        .json()
        .await
        .expect("json");
    let outside = made["id"].as_str().expect("refund id").to_owned();

    let (code, report) = run_books(&site, &window).await;
    assert_eq!(code, Some(3), "{report}");
    assert_eq!(counts(&report), [3, 2, 0, 0, 1, 0], "{report}");
    let finding = &report["findings"][0];
    assert_eq!(finding["class"], "drifted", "{report}");
    assert_eq!(finding["object"], outside.as_str());
    assert_eq!(finding["payment"], id_of(&ours).as_str());
    assert_eq!(finding["action"], "applied: provider_refunded", "{report}");

    let payment = site.payment(&url, &id_of(&ours)).await;
    assert_eq!(payment["status"], "partially_refunded", "{payment}");
    assert_eq!(payment["amount_refunded"], 700, "{payment}");
    let refunds = format!("refunds WHERE provider_ref = '{outside}'");
    assert_eq!(site.count(&refunds).await, 1);
    let events = format!(
        "events WHERE type = 'refund.succeeded' AND object_id IN \
         (SELECT id FROM refunds WHERE provider_ref = '{outside}')"
    );
    assert_eq!(site.count(&events).await, 1, "the refund's event");
    let decisions = "reconciliation_decisions WHERE decision = 'provider_refunded'";
    assert_eq!(site.count(decisions).await, 1);

    let (code, again) = run_books(&site, &window).await;
    assert_eq!(code, Some(0), "{again}");
    assert_eq!(counts(&again), [3, 3, 0, 0, 0, 0], "{again}");
    assert_eq!(site.count(&refunds).await, 1);
    assert_eq!(site.count(decisions).await, 1);
    assert_eq!(site.count("refunds").await, 1);
    assert_eq!(site.count(&events).await, 1);
    let (_, other) = site
        .get_as(&token_b, &url, &format!("/v1/payments/{}", id_of(&theirs)))
        .await;
    assert_eq!(other["status"], "captured", "{other}");
    assert_eq!(other["amount_refunded"], 0, "{other}");

    // The provider then fails that refund (the card's account closed). Its
    // event names nothing of cobro's; the books see it failed and give the
    // amount back, once.
    assert!(site.provider.control().fail_refund(&outside));
    let (code, failed) = run_books(&site, &window).await;
    assert_eq!(code, Some(3), "{failed}");
    assert_eq!(counts(&failed), [3, 2, 0, 0, 1, 0], "{failed}");
    let finding = &failed["findings"][0];
    assert_eq!(finding["object"], outside.as_str(), "{failed}");
    assert_eq!(
        finding["action"], "applied: provider_failed_refund",
        "{failed}"
    );
    let payment = site.payment(&url, &id_of(&ours)).await;
    assert_eq!(payment["status"], "captured", "{payment}");
    assert_eq!(payment["amount_refunded"], 0, "{payment}");
    let failed_events = format!(
        "events WHERE type = 'refund.failed' AND object_id IN \
         (SELECT id FROM refunds WHERE provider_ref = '{outside}')"
    );
    assert_eq!(site.count(&failed_events).await, 1, "the failure's event");
    let (code, settled) = run_books(&site, &window).await;
    assert_eq!(code, Some(0), "{settled}");
    assert_eq!(counts(&settled), [3, 3, 0, 0, 0, 0], "{settled}");
    assert_eq!(site.count(&failed_events).await, 1);
    stop(serve).await;

    let ledger = ledger_holds(&site, 2, 1);
    assert_eq!(ledger.totals.refund_failures, 1);
    assert_eq!(ledger.refunds_of_charge(&charge).len(), 1);
}

/// In process (the rig's API, worker and store; the books as the
/// scheduler builds them): an authorisation cobro holds that the provider
/// voids on its own (Stripe expires one after seven days; here a void with
/// cobro's key, as from the dashboard) is applied by the books through the
/// webhooks' settle path once: the payment `canceled` with one
/// `provider_voided` decision; the next run finds it matched.
async fn an_authorisation_voided_at_the_provider_is_applied_once_through_the_settle_path(
    backend: Backend,
) {
    use cobro_test_support::{RIG_SECRET_KEY, Rig, manual_payment_body};
    let rig = Rig::new(backend).await;
    let created = rig.create_payment("k-1", &manual_payment_body("o-1")).await;
    rig.drain(1).await;
    let id: cobro_core::PaymentId = id_of(&created).parse().expect("payment id");
    let store = &rig.app.db.store;
    let payment = store
        .payment_any_account(id)
        .await
        .expect("read")
        .expect("payment");
    assert_eq!(payment.status.as_str(), "authorized");
    let charge = payment.provider_ref.clone().expect("provider_ref");
    let voided = rig
        .app
        .client
        .post(format!("{}/v1/charges/{charge}/void", rig.provider.url()))
        .bearer_auth(RIG_SECRET_KEY)
        .send()
        .await
        .expect("an answer");
    assert_eq!(voided.status().as_u16(), 200);

    let books = rig.books(rig.connector());
    let first = books.run(ALL_TIME, false, "test").await.expect("books run");
    let c = first.counts;
    assert_eq!(
        (c.objects, c.matched, c.drifted, c.missing),
        (1, 0, 1, 0),
        "{first:?}"
    );
    assert_eq!(first.findings[0].action, "applied: provider_voided");
    let payment = store
        .payment_any_account(id)
        .await
        .expect("read")
        .expect("payment");
    assert_eq!(payment.status.as_str(), "canceled");
    let decisions = "reconciliation_decisions WHERE decision = 'provider_voided'";
    assert_eq!(rig.app.db.count(decisions).await, 1);

    let second = books.run(ALL_TIME, false, "test").await.expect("books run");
    let c = second.counts;
    assert_eq!((c.objects, c.matched, c.drifted), (1, 1, 0), "{second:?}");
    assert_eq!(rig.app.db.count(decisions).await, 1);
    assert_eq!(rig.app.db.count("evidence_conflicts").await, 0);
    let ledger = rig.provider.control().ledger();
    assert_eq!((ledger.totals.charges, ledger.totals.voids), (1, 1));
}

/// cobro holds a captured payment and a succeeded refund of it, and the
/// books list a provider whose ledger has neither (another fake with the
/// same key: what a provider account swapped or wiped looks like): both
/// attempts are missing, each raises one critical `missing_at_provider`
/// conflict and sends its payment to `needs_review`; a second run counts
/// them missing again and raises nothing more. A payment the provider
/// declined moved no money and is never missing. The books move no money
/// at either provider.
async fn successes_the_provider_does_not_hold_are_missing_and_raised_once(backend: Backend) {
    use cobro_test_support::{ProviderClient, Rig};
    let rig = Rig::new(backend).await;
    let paid = rig
        .create_payment("k-1", &cobro_test_support::payment_body("o-1"))
        .await;
    rig.drain(2).await;
    let id = id_of(&paid);
    rig.post_ok(
        &format!("/v1/payments/{id}/refunds"),
        "r-1",
        json!({ "amount": 500 }),
    )
    .await;
    rig.drain(2).await;
    let mut declined_body = cobro_test_support::payment_body("o-2");
    declined_body["payment_method"] = json!("pm_card_declined");
    let declined = rig.create_payment("k-2", &declined_body).await;
    rig.drain(2).await;
    assert_eq!(rig.payment(&id).await["status"], "partially_refunded");
    assert_eq!(rig.payment(&id_of(&declined)).await["status"], "declined");
    let held = rig.ledger();
    assert_eq!((held.totals.charges, held.totals.refunds), (1, 1));

    let elsewhere = fake_provider::start(fake_provider::Config::default())
        .await
        .expect("a second fake provider");
    let client = ProviderClient {
        base_url: elsewhere.url(),
        request_timeout: Duration::from_secs(2),
    };
    let books = rig.books(client.connector(rig.dialect));
    let missing = "evidence_conflicts WHERE kind = 'missing_at_provider'";
    // A dry run (what it listed held in memory) finds them and writes
    // nothing; real runs (what they listed in `books_listed`, forgotten at
    // their end) raise each once.
    let dry = books.run(ALL_TIME, true, "test").await.expect("dry run");
    assert_eq!((dry.counts.objects, dry.counts.missing), (0, 2), "{dry:?}");
    assert_eq!(rig.app.db.count(missing).await, 0);
    for run in 0..2 {
        let report = books.run(ALL_TIME, false, "test").await.expect("books run");
        let c = report.counts;
        assert_eq!(
            (c.objects, c.matched, c.missing),
            (0, 0, 2),
            "run {run}: {report:?}"
        );
        assert!(
            report
                .findings
                .iter()
                .all(|f| f.class == cobro_reconciler::books::Class::Missing
                    && f.payment.as_deref() == Some(id.as_str())),
            "run {run}: {report:?}"
        );
        assert_eq!(rig.app.db.count(missing).await, 2, "run {run}");
        assert_eq!(rig.app.db.count("books_listed").await, 0, "run {run}");
        assert_eq!(
            rig.payment(&id).await["status"],
            "needs_review",
            "run {run}"
        );
        assert_eq!(rig.payment(&id_of(&declined)).await["status"], "declined");
    }
    let after = rig.ledger();
    assert_eq!((after.totals.charges, after.totals.refunds), (1, 1));
    let there = elsewhere.control().ledger();
    assert_eq!((there.totals.charges, there.totals.refunds), (0, 0));
    elsewhere.shutdown().await;
}

/// The scheduled path (`Books::run_due`, as every reconciling process
/// runs it): the first run reads its first window and sets the
/// checkpoint; the next reads from the checkpoint less the overlap, so an
/// object seen before is seen again and stays matched; a refund made at
/// the provider between runs is applied once although two overlapping
/// windows list it; a run that cannot list fails without moving the
/// checkpoint. Both clocks (cobro's and the provider's) move together.
async fn scheduled_runs_move_their_checkpoint_and_apply_drift_once_across_overlaps(
    backend: Backend,
) {
    use cobro_test_support::{ProviderClient, RIG_SECRET_KEY, Rig, payment_body};
    let rig = Rig::new(backend).await;
    let store = &rig.app.db.store;
    let advance = |minutes: i64| {
        rig.app.clock.advance(chrono::Duration::minutes(minutes));
        rig.provider
            .control()
            .advance_clock(Duration::from_secs(60 * minutes as u64));
    };
    let books = rig.books(rig.connector());
    let first_paid = rig.create_payment("k-1", &payment_body("o-1")).await;
    rig.drain(2).await;
    advance(5);

    let first = books.run_due("schedule").await.expect("run").expect("due");
    let c = first.counts;
    assert_eq!(
        (c.objects, c.matched, c.unmatched()),
        (1, 1, 0),
        "{first:?}"
    );
    let checkpoint = store.books_checkpoint("fake").await.expect("read");
    assert_eq!(checkpoint, Some(first.window.1), "{first:?}");

    let second_paid = rig.create_payment("k-2", &payment_body("o-2")).await;
    rig.drain(2).await;
    advance(5);
    let second = books.run_due("schedule").await.expect("run").expect("due");
    assert_eq!(
        second.window.0,
        first.window.1 - 600,
        "from the checkpoint less the overlap"
    );
    let c = second.counts;
    assert_eq!(
        (c.objects, c.matched, c.unmatched()),
        (2, 2, 0),
        "{second:?}"
    );

    let charge = rig.payment(&id_of(&first_paid)).await["provider_ref"]
        .as_str()
        .expect("provider_ref")
        .to_owned();
    let made = rig
        .app
        .client
        .post(format!("{}/v1/refunds", rig.provider.url()))
        .bearer_auth(RIG_SECRET_KEY)
        .json(&json!({ "charge": charge, "amount": 300, "reference": "dashboard" }))
        .send()
        .await
        .expect("an answer");
    assert_eq!(made.status().as_u16(), 201);
    advance(5);
    let applied = "reconciliation_decisions WHERE decision = 'provider_refunded'";
    let third = books.run_due("schedule").await.expect("run").expect("due");
    let c = third.counts;
    assert_eq!((c.objects, c.matched, c.drifted), (3, 2, 1), "{third:?}");
    assert_eq!(rig.app.db.count(applied).await, 1);
    advance(5);
    let fourth = books.run_due("schedule").await.expect("run").expect("due");
    assert!(fourth.window.0 < third.window.1, "the windows overlap");
    // The second charge and the refund: the first charge is behind it now.
    assert_eq!(rig.app.db.count("books_listed").await, 0);
    let c = fourth.counts;
    assert_eq!(
        (c.objects, c.matched, c.unmatched()),
        (2, 2, 0),
        "{fourth:?}"
    );
    assert_eq!(rig.app.db.count(applied).await, 1, "applied once");
    assert_eq!(
        rig.payment(&id_of(&first_paid)).await["amount_refunded"],
        300
    );
    assert_eq!(
        rig.payment(&id_of(&second_paid)).await["amount_refunded"],
        0
    );

    let before = store.books_checkpoint("fake").await.expect("read");
    advance(5);
    let unreachable = ProviderClient {
        base_url: "http://127.0.0.1:9".into(),
        request_timeout: Duration::from_secs(2),
    };
    let failing = rig.books(unreachable.connector(rig.dialect));
    assert!(failing.run_due("schedule").await.is_err());
    assert_eq!(store.books_checkpoint("fake").await.expect("read"), before);
    let runs = store.books_runs(10).await.expect("runs");
    assert_eq!(runs.len(), 5, "every run, the failed one too, has its row");
    let ledger = rig.ledger();
    assert_eq!((ledger.totals.charges, ledger.totals.refunds), (2, 1));
}

async fn adopting_the_orphans_of_a_restore_brings_the_books_to_all_matched(backend: Backend) {
    adopted_after_restore(backend, Dialect::Fake).await;
}

async fn adopting_the_orphans_of_a_restore_on_stripe(backend: Backend) {
    adopted_after_restore(backend, Dialect::Stripe).await;
}

/// `cobro books adopt ID --json` as operator `ana`: exit code and output
/// (standard output, then standard error).
async fn adopt(site: &Site, id: &str) -> (Option<i32>, String) {
    let reason = "lost in the restore; the merchant still wants it";
    let args = [
        "books",
        "adopt",
        id,
        "--reason",
        reason,
        "--operator",
        "ana",
        "--json",
    ];
    let mut command = site.command(&args, &NO_BOOKS);
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .expect("join")
        .expect("cobro runs");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (
        output.status.code(),
        text(&output.stdout) + &text(&output.stderr),
    )
}

/// The open orphan of `kind` whose metadata names `payment`.
fn orphan_of<'a>(listed: &'a Value, kind: &str, payment: &Value) -> &'a str {
    listed["orphans"]
        .as_array()
        .expect("orphans")
        .iter()
        .find(|o| o["kind"] == kind && o["payment"] == id_of(payment).as_str())
        .and_then(|o| o["id"].as_str())
        .unwrap_or_else(|| panic!("a {kind} orphan of {payment} in {listed}"))
}

/// A restore loses, for account A, a captured payment and its refund and
/// a refund of a payment the backup kept; for account B (same order refs),
/// a captured payment that B's client then pays again under the same key
/// (cobro had forgotten the key: a second charge for one order). The
/// operator adopts A's charge (its refund comes with it) and the lone
/// refund, each read again at the provider first; B's adoption is refused
/// with nothing written (the order has a payment again: the orphan is the
/// second charge) and is acknowledged instead. The books then match every
/// object, a second run changes nothing, and the adopted payment is an
/// ordinary one: its merchant reads it and refunds the rest through the
/// API and the outbox, which the provider's ledger shows.
async fn adopted_after_restore(backend: Backend, dialect: Dialect) {
    let site = Site::new_in(backend, dialect).await;
    let token_b = site.new_account("other merchant").await;
    let window = window_around_now();
    let (serve, url) = site.serve("serve-1", &[], &NO_BOOKS).await;
    let kept_a = captured(&site, &url, &site.token, "k-1", "order-1").await;
    captured(&site, &url, &token_b, "k-1", "order-1").await;
    stop(serve).await;
    let backup = site.back_up().await;

    let (serve, url) = site.serve("serve-2", &[], &NO_BOOKS).await;
    let lost_a = captured(&site, &url, &site.token, "k-2", "order-2").await;
    let lost_b = captured(&site, &url, &token_b, "k-2", "order-2").await;
    refunded(&site, &url, &site.token, &lost_a, 500).await;
    refunded(&site, &url, &site.token, &kept_a, 300).await;
    // Order 3 of A: declined (`authorize-v1`), then paid (`authorize-v2`).
    let mut declining = payment_body("order-3");
    declining["payment_method"] = json!("pm_card_declined");
    let declined = site
        .post_as(&site.token, &url, "/v1/payments", "k-3", &declining)
        .send()
        .await
        .expect("an answer");
    assert_eq!(declined.status().as_u16(), 201);
    let declined: Value = declined.json().await.expect("json");
    wait_for("order 3's first payment declined", SETTLE, async || {
        let path = format!("/v1/payments/{}", id_of(&declined));
        let (_, p) = site.get_as(&site.token, &url, &path).await;
        (p["status"] == "declined").then_some(())
    })
    .await;
    let second_try = captured(&site, &url, &site.token, "k-4", "order-3").await;
    stop(serve).await;
    ledger_holds(&site, 5, 2);
    site.restore(&backup).await;

    let (serve, url) = site.serve("serve-3", &[], &NO_BOOKS).await;
    let again_b = captured(&site, &url, &token_b, "k-2", "order-2").await;
    assert_ne!(id_of(&again_b), id_of(&lost_b), "cobro forgot the key");
    ledger_holds(&site, 6, 2);

    let (code, report) = run_books(&site, &window).await;
    assert_eq!(code, Some(3), "{report}");
    assert_eq!(counts(&report), [9, 3, 6, 0, 0, 0], "{report}");
    let (_, listed) = books(&site, &["orphans"]).await;

    let (code, out) = adopt(&site, orphan_of(&listed, "charge", &lost_a)).await;
    assert_eq!(code, Some(0), "{out}");
    let adopted: Value = serde_json::Deserializer::from_str(&out)
        .into_iter()
        .next()
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("a JSON answer: {out}"));
    assert_eq!(adopted["payment"], id_of(&lost_a).as_str(), "{adopted}");
    assert_eq!(adopted["status"], "partially_refunded", "{adopted}");
    assert_eq!(adopted["refunds"].as_array().map(Vec::len), Some(1));
    let (code, out) = adopt(&site, orphan_of(&listed, "refund", &kept_a)).await;
    assert_eq!(code, Some(0), "{out}");
    // Its merchant hears it as any payment: created, then captured, then
    // partially refunded.
    for kind in ["created", "captured", "partially_refunded"] {
        let events = format!(
            "events WHERE type = 'payment.{kind}' AND object_id = '{}'",
            id_of(&lost_a)
        );
        assert_eq!(site.count(&events).await, 1, "{kind}");
    }

    let payments = site.count("payments").await;
    let (code, out) = adopt(&site, orphan_of(&listed, "charge", &lost_b)).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("already has payment"), "{out}");
    assert_eq!(site.count("payments").await, payments, "nothing written");
    let second_charge = orphan_of(&listed, "charge", &lost_b);
    let (code, out) = site
        .run_cli(
            &[
                "books",
                "acknowledge",
                second_charge,
                "--reason",
                "refunded by hand",
            ],
            &NO_BOOKS,
        )
        .await;
    assert_eq!(code, Some(0), "{out}");
    // Order 3's second try cannot be adopted without its first: cobro
    // would number the order's next intent after one intent, onto it. Nor
    // can the decline, which holds no money. Both are acknowledged.
    for (lost, what) in [(&second_try, "gap"), (&declined, "holds no money")] {
        let orphan = orphan_of(&listed, "charge", lost);
        let (code, out) = adopt(&site, orphan).await;
        assert_ne!(code, Some(0), "{what}: {out}");
        assert!(out.contains(what), "{what}: {out}");
        assert_eq!(
            site.count("payments").await,
            payments,
            "{what}: nothing written"
        );
        let (code, out) = site
            .run_cli(
                &[
                    "books",
                    "acknowledge",
                    orphan,
                    "--reason",
                    "refunded by hand",
                ],
                &NO_BOOKS,
            )
            .await;
        assert_eq!(code, Some(0), "{out}");
    }
    let adoptions = "reconciliation_decisions WHERE decision = 'books_adopted'";
    assert_eq!(site.count(adoptions).await, 3);

    let (code, settled) = run_books(&site, &window).await;
    assert_eq!(code, Some(0), "{settled}");
    assert_eq!(counts(&settled), [9, 9, 0, 0, 0, 0], "{settled}");
    assert_eq!(site.count("books_orphans WHERE state = 'open'").await, 0);

    // The merchant reads the adopted payment and refunds the rest.
    let (status, payment) = site
        .get_as(
            &site.token,
            &url,
            &format!("/v1/payments/{}", id_of(&lost_a)),
        )
        .await;
    assert_eq!(status, 200, "{payment}");
    assert_eq!(
        (
            payment["status"].as_str(),
            payment["amount_refunded"].as_i64()
        ),
        (Some("partially_refunded"), Some(500)),
        "{payment}"
    );
    let (_, kept) = site
        .get_as(
            &site.token,
            &url,
            &format!("/v1/payments/{}", id_of(&kept_a)),
        )
        .await;
    assert_eq!(kept["amount_refunded"], 300, "{kept}");
    let id = id_of(&lost_a);
    let answer = site
        .post_as(
            &site.token,
            &url,
            &format!("/v1/payments/{id}/refunds"),
            "refund-the-rest",
            &json!({ "amount": 1499 }),
        )
        .send()
        .await
        .expect("an answer");
    assert_eq!(answer.status().as_u16(), 201);
    wait_for("the rest refunded", SETTLE, async || {
        let (_, p) = site
            .get_as(&site.token, &url, &format!("/v1/payments/{id}"))
            .await;
        (p["status"] == "refunded").then_some(())
    })
    .await;
    stop(serve).await;
    let (code, last) = run_books(&site, &window).await;
    assert_eq!(code, Some(0), "{last}");
    assert_eq!(counts(&last), [10, 10, 0, 0, 0, 0], "{last}");
    assert_eq!(site.count(adoptions).await, 3);

    let ledger = ledger_holds(&site, 6, 3);
    let charge = lost_a["provider_ref"].as_str().expect("provider_ref");
    let charge = ledger
        .charge(charge)
        .or_else(|| ledger.charge_of_payment_intent(charge))
        .expect("the adopted charge")
        .id
        .clone();
    assert_eq!(ledger.refunds_of_charge(&charge).len(), 2);
}
