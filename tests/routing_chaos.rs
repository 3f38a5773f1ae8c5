//! Routing under chaos (issue 51, "Done when"; docs/routing.md): real
//! `cobro` processes over a routed [`Site`], two fake providers each with
//! its own ledger, `a` (the fake's own API) failing in every way the fake
//! knows, `b` (its Stripe dialect) the next of every payment's chain, and
//! worker processes SIGKILLed throughout.
//!
//! The run: two `cobro serve --no-worker` processes and two `cobro worker`
//! processes read one providers file (`a` then `b`, a breaker); every
//! process reconciles every 2 s. Two accounts send the same 150 orders
//! under the same keys (300 payments: automatic, manual then captured,
//! and declining cards). Eight times, as the payments come to rest, a
//! worker is SIGKILLed and another started (the second API process twice),
//! and the requests `a` holds are let through; at the second round `a` has
//! an outage that opens its circuit. Then `cobro reconcile` runs until
//! nothing is unsettled.
//!
//! The judge counts effects, never HTTP codes: per cobro payment, the
//! money-moving charges in both ledgers (by the `cobro_payment` metadata
//! each carries) must be exactly one for a captured payment, none for a
//! declined one, and never one at each provider; every move names a proof
//! of no effect and the attempt it proved, recorded at the provider it left;
//! every payment proven without effect at `a` moved, and every moved
//! payment whose card is good ended captured at `b`. A good card ends
//! `declined` in one shape only, which docs/routing.md §2 chose: a soft
//! decline at `a` that only the reconciler read (its answer lost, or the
//! charge answered `processing`) ends the payment declined, not moved;
//! each such payment is checked to be exactly that, and counted. The moves by proof,
//! the rescued share, the unknown outcomes at `a` that took effect there,
//! the faults that fired and the kills are printed and asserted: a run
//! that moved nothing, never opened `a`'s circuit or left a configured
//! fault unfired fails.

use cobro_test_support::chaos;
use cobro_test_support::process::Cobro;
use cobro_test_support::site::{STRIPE_SECRET_ENV, Site, UNSETTLED, id_of};
use cobro_test_support::{Backend, on_both_backends, payment_body, provider_ref_of, wait_for};
use fake_provider::{FaultAction, FaultRule, Ledger, LedgerCharge, Operation as FOp};
use futures::{StreamExt, stream};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

on_both_backends!(
    a_provider_failing_every_way_under_kills_charges_no_payment_twice_and_moves_only_on_proof,
);

/// Orders per account: both accounts share every order reference and
/// idempotency key, so the run makes twice as many payments.
const ORDERS: usize = 150;

/// The proofs a move may name (docs/routing.md §2).
const PROOFS: [&str; 4] = ["soft_decline", "not_sent", "circuit_open", "no_effect"];

/// The providers file every process reads. `a`: a 1 s request timeout
/// (a late answer is a timeout after the charge), and the fake's own 4 s
/// key retention with a 3 s margin, so an unknown attempt is sent for at
/// most 1 s and then only the reconciler may prove it absent. `b`: Stripe's
/// contract. A clock skew of 2 s (one host): "no effect" is proven 1 + 4 +
/// 2 s after an attempt's last send. The breaker opens `a`'s circuit when
/// half of 20 calls in 5 s fail, for 2 s.
fn providers_file(a: &str, b: &str) -> String {
    format!(
        r#"default_provider = "a"

[[provider]]
name = "a"
kind = "fake"
base_url = "{a}"
secret_env = "{STRIPE_SECRET_ENV}"
request_timeout = "1s"
key_retention = "4s"
key_safety_margin = "3s"
search_lag = "3s"
clock_skew = "2s"

[[provider]]
name = "b"
kind = "stripe"
base_url = "{b}"
secret_env = "{STRIPE_SECRET_ENV}"
request_timeout = "5s"
clock_skew = "2s"

[routing]
default = ["a", "b"]
breaker_window = "5s"
breaker_min_calls = 20
breaker_error_rate = 0.5
breaker_cool_down = "2s"
"#
    )
}

/// What an order becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// The card declines (`pm_card_declined`): declined wherever it goes.
    Declined,
    /// Manual capture, captured by the merchant once authorized.
    Manual,
    Automatic,
}

impl Plan {
    fn of(order: usize) -> Self {
        match order % 10 {
            0 => Plan::Declined,
            1 | 2 => Plan::Manual,
            _ => Plan::Automatic,
        }
    }
}

async fn a_provider_failing_every_way_under_kills_charges_no_payment_twice_and_moves_only_on_proof(
    backend: Backend,
) {
    let started = Instant::now();
    let site = Site::routed(
        backend,
        fake_provider::Config {
            admin: true,
            seed: 51,
            // `a` forgets a key 4 s after its first use (real time): key
            // windows close during the run.
            retention: Duration::from_secs(4),
            ..Default::default()
        },
        // `b` keeps keys for a day, as Stripe does.
        fake_provider::Config {
            admin: true,
            seed: 52,
            webhook_dialect: fake_provider::WebhookDialect::Stripe,
            ..Default::default()
        },
        providers_file,
    )
    .await;
    let (a, b) = (site.provider.control(), site.provider_b().control());
    let (_, token_b) = site.db.new_account("merchant-b", chrono::Utc::now()).await;
    let tokens = [site.token.clone(), token_b];

    // `a` fails in every way the fake knows (first matching rule wins, in
    // this order; latency adds to any outcome). Unknown outcomes with and
    // without a charge (a 503 before it, a 500 or a dropped connection
    // after it, an answer 2.5 s late past the 1 s timeout, a 409, a request
    // held and let through later or never), refusals (429), soft declines
    // (`try_again_later`), charges answered `processing`, a lagging search
    // and failing lookups.
    let chance = |op, action, p: f64| FaultRule::new(op, action).with_probability(p);
    let a_rules = [
        chance(FOp::Any, FaultAction::Latency, 0.1).with_delay(Duration::from_millis(150)),
        chance(FOp::Charge, FaultAction::FailBeforeEffect, 0.1),
        chance(FOp::Charge, FaultAction::FailAfterEffect, 0.05),
        chance(FOp::Charge, FaultAction::DropResponseAfterEffect, 0.05),
        chance(FOp::Charge, FaultAction::DelayAfterEffect, 0.04)
            .with_delay(Duration::from_millis(2500)),
        chance(FOp::Charge, FaultAction::InProgress, 0.04),
        chance(FOp::Charge, FaultAction::RateLimit, 0.04),
        chance(FOp::Charge, FaultAction::HoldEffect, 0.03),
        chance(FOp::Charge, FaultAction::SoftDecline, 0.12),
        chance(FOp::Charge, FaultAction::Processing, 0.05).with_lag_seconds(2),
        chance(FOp::Charge, FaultAction::SearchLag, 0.2).with_lag_seconds(2),
        chance(FOp::Capture, FaultAction::FailBeforeEffect, 0.2),
        chance(FOp::Capture, FaultAction::DropResponseAfterEffect, 0.2),
        // Lookups are few (only attempts handed to the reconciler need
        // one, and a search only when a list failed three times): half of
        // them fail, so the run certainly sees some fail.
        chance(FOp::Search, FaultAction::FailBeforeEffect, 0.5),
        chance(FOp::List, FaultAction::FailBeforeEffect, 0.5),
    ];
    for rule in a_rules.iter().cloned() {
        a.add_fault(rule);
    }
    // `b` is where rescued payments go and the end of their chain: light
    // faults only, unknown outcomes it settles under its own key (a day's
    // window) without ever moving a payment back, and few enough that its
    // own circuit stays closed.
    let b_rules = [
        chance(FOp::Any, FaultAction::Latency, 0.1).with_delay(Duration::from_millis(100)),
        chance(FOp::Charge, FaultAction::FailBeforeEffect, 0.08),
        chance(FOp::Charge, FaultAction::DropResponseAfterEffect, 0.08),
        chance(FOp::Capture, FaultAction::DropResponseAfterEffect, 0.2),
    ];
    for rule in b_rules.iter().cloned() {
        b.add_fault(rule);
    }

    let env: &[(&str, &str)] = &[
        // Every process's scheduled reconciler runs every 2 s, racing the
        // workers and the other processes' reconcilers.
        ("COBRO_RECONCILE_SCHEDULE", "*/2 * * * * *"),
        ("COBRO_RECONCILE_STUCK_AFTER", "5s"),
    ];
    let (_api_a, url_a) = site.serve("api a", &["--no-worker"], env).await;
    let (mut api_b, url_b) = site.serve("api b", &["--no-worker"], env).await;
    let urls = Arc::new(Mutex::new(vec![url_a.clone(), url_b]));
    let mut workers: Vec<Cobro> = Vec::new();
    for i in 0..2 {
        workers.push(site.worker(&format!("worker {i}"), env).await.0);
    }

    let journeys = drive_orders(&site, &tokens, &urls);

    // Kill a worker and start another, eight times, each once a tenth more
    // of the payments reached a resting state (final, or authorized); the
    // second API process too, twice. Each round also lets through the
    // requests `a` holds (those held less than its key retention make
    // their charge now, long after their sender gave up); at the second,
    // `a` has an outage: the next 60 charges that no other fault takes
    // fail before any effect, which opens its circuit.
    let total = 2 * ORDERS as i64;
    let (mut worker_kills, mut api_kills, mut released) = (0, 0, 0);
    for round in 0..8usize {
        let due = (round as i64 + 1) * total / 10;
        wait_for(
            &format!("{due} payments at rest (round {round})"),
            Duration::from_secs(30),
            async || (at_rest(&site, backend).await >= due).then_some(()),
        )
        .await;
        released += a.release_held();
        if round == 1 {
            a.add_fault(FaultRule::new(FOp::Charge, FaultAction::FailBeforeEffect).with_next(60));
        }
        let victim = round % workers.len();
        site.kill_and_restart_worker(&mut workers, victim, round, env)
            .await;
        worker_kills += 1;
        if round % 4 == 2 {
            site.kill_and_restart_api(&mut api_b, &urls, round, env)
                .await;
            api_kills += 1;
        }
    }
    let journeys = journeys.await.expect("the merchants' task");
    assert_eq!(journeys.len(), 2 * ORDERS);
    released += a.release_held();

    // `cobro reconcile` until nothing is unsettled (the workers still
    // run: a payment proven without effect at `a` is charged at `b` by
    // them).
    site.reconcile_until_settled(env).await;
    let settled_after = started.elapsed();

    // How many charges the outage failed: its rule is gone once it failed
    // 60 (it may not be, as an open circuit sends `a` little).
    let outage = 60 - a.faults().iter().filter_map(|f| f.rule.next).sum::<u32>();
    assert!(outage > 0, "the outage failed no charge");

    // The judge.
    a.clear_faults();
    b.clear_faults();
    let (ledger_a, ledger_b) = (a.ledger(), b.ledger());
    assert_eq!(site.count("payments").await, total);
    let http = site.http.clone();
    let judged: Vec<Judged> = stream::iter(journeys.iter())
        .map(|journey| {
            let (http, url, token) = (http.clone(), url_a.clone(), tokens[journey.account].clone());
            let (ledger_a, ledger_b) = (&ledger_a, &ledger_b);
            async move {
                let payment =
                    get(&http, &url, &token, &format!("/v1/payments/{}", journey.id)).await;
                judge(journey, payment, ledger_a, ledger_b)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let wrong: Vec<&String> = judged.iter().filter_map(|j| j.wrong.as_ref()).collect();

    // No charge in either ledger without its payment, and no payment
    // charged at both providers.
    for (name, ledger) in [("a", &ledger_a), ("b", &ledger_b)] {
        for charge in money_moving(ledger) {
            let payment = charge.metadata.get("cobro_payment");
            assert!(
                payment.is_some_and(|p| judged.iter().any(|j| &j.id == p)),
                "a charge at {name} of no payment of the run: {charge:?}"
            );
        }
    }
    let at_both = judged
        .iter()
        .filter(|j| j.charges_at_a > 0 && j.charges_at_b > 0)
        .count();
    assert_eq!(at_both, 0, "payments charged at both providers");

    // What routing did.
    let moved: Vec<&Judged> = judged.iter().filter(|j| !j.proofs.is_empty()).collect();
    let mut by_proof: BTreeMap<&str, usize> = BTreeMap::new();
    for j in &moved {
        for proof in &j.proofs {
            *by_proof.entry(proof.as_str()).or_default() += 1;
        }
    }
    let movable: Vec<&&Judged> = moved.iter().filter(|j| j.plan != Plan::Declined).collect();
    let rescued = movable
        .iter()
        .filter(|j| j.status == "captured" && j.provider == "b")
        .count();
    let started_at_b = judged.iter().filter(|j| j.starts_at("b")).count();
    let captured_at = |p: &str| {
        judged
            .iter()
            .filter(|j| j.status == "captured" && j.provider == p)
            .count()
    };
    let (captured_a, captured_b) = (captured_at("a"), captured_at("b"));
    // Attempts at `a` not settled by their first answer (resent under
    // their key, or handed to the reconciler) that took effect there:
    // their payments stayed at `a`, never moved.
    let unknown_then_charged_at_a = "attempts t WHERE t.provider = 'a' AND t.operation = 'payment.authorize' \
         AND t.state = 'succeeded' AND (t.send_count > 1 OR EXISTS \
         (SELECT 1 FROM reconciliation_decisions d WHERE d.attempt_id = t.id))";
    let adopted_at_a = site
        .count(
            "attempts t WHERE t.provider = 'a' AND t.operation = 'payment.authorize' \
             AND t.state = 'succeeded' AND EXISTS \
             (SELECT 1 FROM reconciliation_decisions d WHERE d.attempt_id = t.id)",
        )
        .await;
    let unknown_at_a = site.count(unknown_then_charged_at_a).await;
    let unknown_moved = site
        .count(&format!(
            "{unknown_then_charged_at_a} AND EXISTS \
             (SELECT 1 FROM payments p WHERE p.id = t.payment_id AND p.provider <> 'a')"
        ))
        .await;
    assert_eq!(unknown_moved, 0, "a payment charged at a moved");
    let circuit_opened = site
        .count("provider_circuits WHERE provider = 'a' AND opened_at IS NOT NULL")
        .await;
    // Good cards declined (softly, at `a`): each by the reconciler's
    // decision, none by another path.
    let soft_read = judged.iter().filter(|j| j.soft_decline_read).count();
    let good_declined =
        "payments p WHERE p.status = 'declined' AND p.payment_method <> 'pm_card_declined'";
    let by_the_reconciler = site
        .count(&format!(
            "{good_declined} AND EXISTS (SELECT 1 FROM reconciliation_decisions d \
             WHERE d.payment_id = p.id AND d.decision = 'adopt_declined')"
        ))
        .await;
    let good_declined = site.count(good_declined).await;

    let fired = |control: &fake_provider::Control| {
        control
            .faults_fired()
            .iter()
            .map(|f| ((f.operation, f.action), f.count))
            .collect::<BTreeMap<_, _>>()
    };
    let (fired_a, fired_b) = (fired(&a), fired(&b));
    eprintln!(
        "routing chaos ({backend:?}): {total} payments ({} declined cards; {} wrong) in {:.1} s to settle, {:.1} s in all; \
         moved {} ({by_proof:?}), {} of them with a good card, {rescued} rescued (captured at b); \
         {started_at_b} started at b (a's circuit open; opened: {circuit_opened}; {outage} charges failed by its outage); captured at a {captured_a}, at b {captured_b}; \
         {unknown_at_a} attempts at a resent or reconciled then charged there ({adopted_at_a} adopted by the reconciler), none moved; \
         {soft_read} soft declines at a only the reconciler read (ended declined, not moved); \
         a: {} charges, {} declines; b: {} charges, {} declines; {released} held requests let through; \
         {worker_kills} worker and {api_kills} API kills; faults fired at a {:?}, at b {:?}",
        judged.iter().filter(|j| j.plan == Plan::Declined).count(),
        wrong.len(),
        settled_after.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        moved.len(),
        movable.len(),
        ledger_a.totals.charges,
        ledger_a.totals.declines,
        ledger_b.totals.charges,
        ledger_b.totals.declines,
        fired_a
            .iter()
            .map(|((op, action), n)| format!("{op:?}/{action:?}={n}"))
            .collect::<Vec<_>>(),
        fired_b
            .iter()
            .map(|((op, action), n)| format!("{op:?}/{action:?}={n}"))
            .collect::<Vec<_>>(),
    );

    assert!(
        wrong.is_empty(),
        "{} of {} payments are wrong: {:#?}",
        wrong.len(),
        judged.len(),
        &wrong[..wrong.len().min(10)]
    );
    assert_eq!(
        (good_declined, by_the_reconciler),
        (soft_read as i64, soft_read as i64),
        "good cards declined other than by the reconciler reading a soft decline"
    );
    // A run that moved nothing, or rescued too little, proves nothing.
    assert!(!moved.is_empty(), "no payment moved");
    for proof in ["soft_decline", "no_effect"] {
        assert!(
            by_proof.contains_key(proof),
            "no move on {proof}: {by_proof:?}"
        );
    }
    assert!(
        rescued * 100 >= movable.len() * 99,
        "{rescued} of {} moved payments rescued",
        movable.len()
    );
    assert!(
        unknown_at_a > 0,
        "no unknown outcome at a took effect there"
    );
    assert!(adopted_at_a > 0, "the reconciler adopted nothing at a");
    // Every configured fault fired.
    for (name, rules, fired) in [("a", &a_rules[..], &fired_a), ("b", &b_rules[..], &fired_b)] {
        for rule in rules {
            assert!(
                fired
                    .get(&(rule.operation, rule.action))
                    .is_some_and(|n| *n > 0),
                "{name}: {:?} {:?} never fired",
                rule.operation,
                rule.action
            );
        }
    }
    // The outage opened `a`'s circuit, and new payments started at `b`
    // while it was open.
    assert_eq!(circuit_opened, 1, "a's circuit never opened");
    assert!(started_at_b > 0, "no payment started at b");
    assert_eq!((worker_kills, api_kills), (8, 2));

    // The routing decision is visible on each payment (every payment's
    // was checked by `judge`); a sample, in full.
    let sample = moved
        .iter()
        .find(|j| j.proofs[0] == "soft_decline" && j.plan != Plan::Declined)
        .expect("a soft-declined payment");
    let p = get(
        &http,
        &url_a,
        &tokens[sample.account],
        &format!("/v1/payments/{}", sample.id),
    )
    .await;
    assert_eq!(p["provider"], "b", "{p}");
    assert_eq!(p["routing"]["chain"], json!(["a", "b"]), "{p}");
    assert_eq!(p["routing"]["rule"], Value::Null, "{p}");
    assert_eq!(p["routing"]["reason"], "the deployment's default", "{p}");
    assert_eq!(p["routing"]["moves"][0]["from"], "a", "{p}");
    assert_eq!(p["routing"]["moves"][0]["to"], "b", "{p}");
    assert_eq!(
        p["routing"]["moves"][0]["proof"], "soft_decline: try_again_later",
        "{p}"
    );
    assert!(p["routing"]["moves"][0]["at"].is_string(), "{p}");
    if let Some(late) = judged.iter().find(|j| j.starts_at("b")) {
        let p = get(
            &http,
            &url_a,
            &tokens[late.account],
            &format!("/v1/payments/{}", late.id),
        )
        .await;
        let reason = p["routing"]["reason"].as_str().unwrap_or_default();
        assert!(reason.contains("circuit open"), "{p}");
    }
}

/// Payments in a resting state: final, or authorized (waiting for its
/// merchant's capture). PostgreSQL through the site's pool: the kill
/// rounds poll this every 20 ms.
async fn at_rest(site: &Site, backend: Backend) -> i64 {
    let from = format!("payments WHERE status NOT IN {UNSETTLED}");
    match backend {
        Backend::Postgres => sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {from}"))
            .fetch_one(site.pg())
            .await
            .expect("count"),
        Backend::Sqlite => site.count(&from).await,
    }
}

/// One order of one account, as its merchant drove it.
struct Journey {
    account: usize,
    plan: Plan,
    id: String,
}

/// One payment as the judge found it.
struct Judged {
    account: usize,
    plan: Plan,
    id: String,
    status: String,
    provider: String,
    chain: Vec<String>,
    /// The kind of each move's proof.
    proofs: Vec<String>,
    charges_at_a: usize,
    charges_at_b: usize,
    /// A good card declined softly at `a`, read by the reconciler
    /// ([`soft_decline_read`]).
    soft_decline_read: bool,
    /// Why the payment is wrong, if it is.
    wrong: Option<String>,
}

impl Judged {
    /// Whether its chain starts at `provider`.
    fn starts_at(&self, provider: &str) -> bool {
        self.chain.first().is_some_and(|p| p == provider)
    }
}

fn money_moving(ledger: &Ledger) -> impl Iterator<Item = &LedgerCharge> {
    ledger.charges.iter().filter(|c| c.status != "declined")
}

fn charges_of<'l>(ledger: &'l Ledger, id: &str) -> Vec<&'l LedgerCharge> {
    money_moving(ledger)
        .filter(|c| c.metadata.get("cobro_payment").map(String::as_str) == Some(id))
        .collect()
}

/// The payment as its merchant reads it, judged against both ledgers and
/// its own route ([`check`]).
fn judge(journey: &Journey, p: Value, a: &Ledger, b: &Ledger) -> Judged {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let routing = &p["routing"];
    let moves = routing["moves"].as_array().cloned().unwrap_or_default();
    let (at_a, at_b) = (charges_of(a, &journey.id), charges_of(b, &journey.id));
    let wrong = check(journey, &p, a, b).err().map(|why| {
        // Every charge of the payment at each provider, declines included.
        let all = |ledger: &Ledger| -> Vec<String> {
            ledger
                .charges_with_metadata("cobro_payment", &journey.id)
                .iter()
                .map(|c| format!("{} {} {}", c.id, c.status, c.reference))
                .collect()
        };
        format!(
            "{} ({:?}): {why}; at a {:?}, at b {:?}; {p}",
            journey.id,
            journey.plan,
            all(a),
            all(b)
        )
    });
    Judged {
        account: journey.account,
        plan: journey.plan,
        id: journey.id.clone(),
        status: text(&p["status"]),
        provider: text(&p["provider"]),
        chain: routing["chain"]
            .as_array()
            .map(|c| c.iter().map(text).collect())
            .unwrap_or_default(),
        proofs: moves
            .iter()
            .map(|m| {
                text(&m["proof"])
                    .split(':')
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect(),
        charges_at_a: at_a.len(),
        charges_at_b: at_b.len(),
        soft_decline_read: soft_decline_read(journey, &p, a),
        wrong,
    }
}

/// Whether a payment with a good card ended `declined` by the one shape
/// docs/routing.md §2 allows: `a` declined it softly (no card is declined
/// at the fake otherwise) and only the reconciler read that decline (the
/// answer was lost, or the charge answered `processing`), which ends the
/// payment declined, conservatively, instead of moving it. Then its one
/// attempt is at `a`, declined, and `a` holds a declined charge of it; no
/// move. (The reconciler's decision is counted in SQL by the caller.)
fn soft_decline_read(journey: &Journey, p: &Value, a: &Ledger) -> bool {
    let attempts = p["attempts"].as_array().cloned().unwrap_or_default();
    journey.plan != Plan::Declined
        && p["status"] == "declined"
        && p["provider"] == "a"
        && p["routing"]["moves"] == json!([])
        && matches!(attempts.as_slice(), [one]
            if one["operation"] == "payment.authorize"
                && one["provider"] == "a"
                && one["state"] == "declined")
        && a.charges_with_metadata("cobro_payment", &journey.id)
            .iter()
            .any(|c| c.status == "declined")
}

/// The payment against both ledgers and its own route; `Err`: why not.
fn check(journey: &Journey, p: &Value, a: &Ledger, b: &Ledger) -> Result<(), String> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let status = text(&p["status"]);
    let provider = text(&p["provider"]);
    let (at_a, at_b) = (charges_of(a, &journey.id), charges_of(b, &journey.id));
    let expected = match journey.plan {
        Plan::Declined => "declined",
        _ if soft_decline_read(journey, p, a) => "declined",
        _ => "captured",
    };
    if status != expected {
        return Err(format!("ended {status}, not {expected}"));
    }
    // Exactly one money-moving charge across both ledgers for a captured
    // payment, at the provider it names, captured in full; none for a
    // declined one.
    match (status.as_str(), at_a.as_slice(), at_b.as_slice()) {
        ("declined", [], []) => {}
        ("captured", [charge], []) | ("captured", [], [charge]) => {
            let (ledger, holder) = if at_a.is_empty() { (b, "b") } else { (a, "a") };
            if provider != holder
                || p["provider_ref"] != provider_ref_of(ledger, &charge.id)
                || charge.status != "captured"
                || p["amount"] != charge.amount
                || p["amount_captured"] != charge.amount_captured
            {
                return Err(format!("its charge at {holder} is {charge:?}"));
            }
        }
        _ => {
            return Err(format!(
                "money-moving charges: {} at a {at_a:?}, {} at b {at_b:?}",
                at_a.len(),
                at_b.len()
            ));
        }
    }

    // The route, as the merchant reads it.
    let routing = &p["routing"];
    let chain: Vec<String> = routing["chain"]
        .as_array()
        .map(|c| c.iter().map(text).collect())
        .unwrap_or_default();
    if !(chain == ["a", "b"] || chain == ["b", "a"]) {
        return Err(format!("chain {chain:?}"));
    }
    if text(&routing["reason"]).is_empty() {
        return Err("no routing reason".into());
    }
    let moves = routing["moves"].as_array().cloned().unwrap_or_default();
    if moves.len() > 1 || provider != chain[moves.len()] {
        return Err(format!("{} moves, at {provider}", moves.len()));
    }
    let attempts = p["attempts"].as_array().cloned().unwrap_or_default();
    for (i, m) in moves.iter().enumerate() {
        let (from, to) = (text(&m["from"]), text(&m["to"]));
        let proof = text(&m["proof"]);
        let kind = proof.split(':').next().unwrap_or_default();
        if from != chain[i] || to != chain[i + 1] || !PROOFS.contains(&kind) {
            return Err(format!("move {m}"));
        }
        // The attempt the move proved without effect: at the provider it
        // left, an authorisation recorded without effect (a soft decline
        // stays declined); its payment has no charge there (above).
        let Some(proven) = attempts.iter().find(|t| {
            text(&t["reference"]).rsplit_once('/').map(|(_, a)| a) == m["attempt"].as_str()
        }) else {
            return Err(format!("move {m} names no attempt of the payment"));
        };
        let state = if kind == "soft_decline" {
            "declined"
        } else {
            "no_effect"
        };
        if text(&proven["provider"]) != from
            || proven["operation"] != "payment.authorize"
            || proven["state"] != state
        {
            return Err(format!("move {m} proved {proven}"));
        }
    }
    // An authorisation at the chain's head proven without effect moved the
    // payment on: nothing that could move stayed behind.
    let stayed = moves.is_empty()
        && attempts.iter().any(|t| {
            t["operation"] == "payment.authorize"
                && text(&t["provider"]) == chain[0]
                && t["state"] == "no_effect"
        });
    if stayed {
        return Err("proven without effect at the chain's head, never moved".into());
    }
    let succeeded = attempts
        .iter()
        .filter(|t| t["operation"] == "payment.authorize" && t["state"] == "succeeded")
        .count();
    if succeeded != usize::from(status == "captured") {
        return Err(format!("{succeeded} succeeded authorisations"));
    }
    Ok(())
}

async fn get(http: &reqwest::Client, url: &str, token: &str, path: &str) -> Value {
    let response = http
        .get(format!("{url}{path}"))
        .bearer_auth(token)
        .send()
        .await
        .expect("GET");
    assert_eq!(response.status().as_u16(), 200, "GET {path}");
    response.json().await.expect("json")
}

/// Each order of each account, driven by a merchant's client to its end,
/// 16 at a time, in a task of its own.
fn drive_orders(
    site: &Site,
    tokens: &[String; 2],
    urls: &Arc<Mutex<Vec<String>>>,
) -> tokio::task::JoinHandle<Vec<Journey>> {
    let (http, tokens, urls) = (site.http.clone(), tokens.clone(), Arc::clone(urls));
    tokio::spawn(async move {
        stream::iter((0..ORDERS).flat_map(|order| [(order, 0usize), (order, 1usize)]))
            .map(|(order, account)| {
                let merchant = Merchant {
                    client: chaos::Merchant {
                        http: http.clone(),
                        token: tokens[account].clone(),
                        urls: Arc::clone(&urls),
                    },
                };
                async move { merchant.journey(order, account).await }
            })
            .buffer_unordered(16)
            .collect()
            .await
    })
}

/// A merchant's client ([`chaos::Merchant`]: the same key again until a
/// final answer) driving one order's journey.
struct Merchant {
    client: chaos::Merchant,
}

impl Merchant {
    async fn send(&self, path: &str, key: Option<&str>, body: Option<&Value>) -> (u16, Value) {
        self.client.send(path, key, body).await
    }

    async fn journey(&self, order: usize, account: usize) -> Journey {
        let plan = Plan::of(order);
        let mut body = payment_body(&format!("rc-{order}"));
        match plan {
            Plan::Declined => body["payment_method"] = json!("pm_card_declined"),
            Plan::Manual => body["capture_method"] = json!("manual"),
            Plan::Automatic => {}
        }
        // Both accounts send the same key for the same order.
        let key = |what: &str| format!("rc-{order}-{what}");
        let (status, created) = self
            .send("/v1/payments", Some(&key("create")), Some(&body))
            .await;
        assert_eq!(status, 201, "create {order}/{account}: {created}");
        let id = id_of(&created);
        if plan == Plan::Manual {
            // Long polls until the worker or the reconciler, at whichever
            // provider, authorised it. A payment waiting for the
            // reconciler answers at once: polled every 100 ms then.
            let deadline = Instant::now() + Duration::from_secs(120);
            let payment = loop {
                let (status, payment) = self
                    .send(&format!("/v1/payments/{id}?wait=5"), None, None)
                    .await;
                assert_eq!(status, 200, "GET {id}: {payment}");
                match payment["status"].as_str() {
                    Some("processing") => {}
                    Some("requires_reconciliation") => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    _ => break payment,
                }
                assert!(
                    Instant::now() < deadline,
                    "{id} never authorized: {payment}"
                );
            };
            // The judge says whether it should have been.
            if payment["status"] == "authorized" {
                let (status, answer) = self
                    .send(
                        &format!("/v1/payments/{id}/capture"),
                        Some(&key("capture")),
                        None,
                    )
                    .await;
                assert_eq!(status, 202, "capture {id}: {answer}");
            }
        }
        Journey { account, plan, id }
    }
}
