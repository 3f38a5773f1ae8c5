//! The interleaving explorer: a seeded, model-based test that drives the
//! real store (both backends), the real worker, reconciler and webhook code
//! and the fake provider, step by step in an order chosen by the seed, and
//! checks the invariants of docs/evidence.md (§7) against the
//! provider's ledger after every step.
//!
//! Steps: API requests from two accounts with colliding order refs
//! (create, capture, cancel, refund, replays); two workers whose claim,
//! send and record are separate steps (a [`Gate`] parks each provider call
//! before it goes out and again before its answer comes back), crashes
//! between any two of them (the task is aborted: a step that never
//! completes); provider faults on the next call; clock jumps (lease expiry,
//! the reconciler's threshold, the search lag, the provider's key
//! retention, the escalation horizon; in one seed in four, whose provider
//! forgets keys after a minute and whose search always lags, jumps to the
//! edges of a recent send: its request timing out, the lag passing, its
//! key window closing); reconciler runs, one or two at once,
//! and reconcilers whose runs are steps (each query parks once answered,
//! so anything can happen between what a reconciler read and what it
//! applies; a reconciler can die there too);
//! webhook deliveries built from the provider's own charges, duplicated and
//! late; authorized charges captured or voided at the provider behind
//! cobro's back (a dashboard), which cobro learns when it next acts on them;
//! charges and refunds the provider makes late (a `hold_effect` fault
//! holds the request, answering nothing, until a later step releases it,
//! inside the key retention, as the provider's contract allows: cobro may
//! prove that attempt without effect only once no held request can still
//! act, so a late effect beside a retry's is a double charge like any
//! other).
//!
//! Invariants after every step: no intent of one account charged twice; no
//! payment bound to a charge of another attempt or account; no send marked
//! for a payment in `requires_reconciliation` or `needs_review`; refunds at
//! the provider never above what the payment captured. Once quiet (faults
//! cleared, every parked call and held request released, workers and
//! reconcilers run until nothing is left, and in a seed that made late
//! effects every charge's and refund's event delivered, the late ones
//! last): every payment's state, amount and refunds equal its own
//! charge's, and no authorisation or refund recorded without effect was
//! contradicted by an effect (an `effect_after_no_effect` conflict).
//!
//! **Routing seeds** (one in four, [`routing`]: `seed % 8` is 2, or 5, which
//! is also a short-window seed, so routing meets both key windows; the
//! seeds of `FOUND` are 3 mod 4 and never route): two providers, `fake` and
//! `backup`, two names in front of the one fake provider (one ledger, so
//! every invariant above counts the charges made through either name, and
//! "no intent charged twice" is "no intent charged at two providers"). The
//! API routes every payment along `fake, backup` (the second account, in
//! half of these seeds, along `backup, fake` by rules of its own), with a
//! breaker that opens a circuit for 2 minutes on 2 calls in 5 minutes half
//! of which got no answer ([`breaker`]); an open circuit puts its provider
//! at the end of new chains.
//! Three workers (two of `fake`, one of `backup`), each claiming only its
//! provider's attempts, share one set of circuits; the step reconcilers
//! (two of `fake`, one of `backup`) and every whole run are one provider's
//! (a run's provider drawn). A webhook goes to the route of the provider
//! whose name its object was made through, and one in four goes first to
//! the other provider's route, which must keep it unmatched. One fault in
//! three is routing's own: a soft decline (`try_again_later`) or a 429 on
//! the next charges, or connections to one provider refused (nothing sent:
//! the worker's `not_sent`). A routing seed's own draws come from a fourth
//! stream, so the other seeds draw what they drew before. After every step
//! in these seeds: a payment's route moves forward only along its chain
//! (each provider visited once) and the payment is where its moves lead;
//! each move names an authorisation of the payment at the provider it
//! left, recorded `declined` for a soft decline (whose declined charge the
//! ledger holds) and `no_effect` for every other proof, under whose key the
//! provider made no money-moving charge, and one moved as
//! never sent (`not_sent`, `circuit_open`) was never sent through any name;
//! every authorisation at a provider the payment left is `no_effect` or
//! `declined` and none is at one it never visited; its captures, voids and
//! refunds, and the authorisation whose charge it holds, are at its
//! current provider; every attempt went out only through its own
//! provider's name. Once quiet, every payment equals its own charge
//! wherever it was taken (above). Each run prints the moves by proof, the
//! seeds whose circuit opened and the events delivered at the wrong route,
//! and fails if 20 or more routing seeds moved no payment at all (400 or
//! more: none on one of the proofs).
//!
//! **Stripe seeds** (one in four, [`stripe`]: `seed % 8` is 1, a
//! short-window seed, or 6; never a routing seed, nor a seed of `FOUND`):
//! the rig speaks the fake provider's Stripe dialect. The workers and
//! reconcilers drive it through cobro's Stripe connector (PaymentIntents
//! created and confirmed under the attempt's key, captured and canceled,
//! refunds, the PaymentIntent search and the consistent lists by creation
//! time); the payments hold PaymentIntent ids, which the judge maps to the
//! charges their confirmations made, so every invariant above counts the
//! same ledger. Webhooks are Stripe's events (`payment_intent.*`,
//! `refund.*`, one event per state an object reached, built from the
//! object as the dialect renders it), signed with `Stripe-Signature` at
//! `/v1/webhooks/stripe`; a dashboard captures or cancels the
//! PaymentIntent. What only Stripe does: a fault that would hold a request
//! (the dialect holds none), and half the other cached 500s, are the 500
//! Stripe saves under the key with `Stripe-Should-Retry: false` (the worker
//! must hand the attempt to the reconciler, which proves "no effect" only
//! from the consistent list, never from search: a worker round answered so
//! that ends any other way than handing over, or losing its lease, fails
//! the seed, as does any money the reconciler's "no effect" missed, by the
//! invariants above); in-progress charges
//! answered `processing` are PaymentIntents `processing`; and one day-long
//! clock step in three is a week, after which Stripe cancels every
//! PaymentIntent left uncaptured (behind cobro's back, judged as a
//! dashboard's void). These draws come from a fifth stream. A run prints
//! what its Stripe seeds reached, and fails if 20 or more of them ran and
//! not one fired the no-retry 500.
//!
//! `EXPLORE_SEEDS=N` sets how many seeds each backend runs (CI: the default
//! below; `EXPLORE_FIRST_SEED=F` starts them at F, for runs in chunks;
//! progress is printed every 1000 seeds), `EXPLORE_SEED=S` runs that one seed alone (a failure prints its
//! seed and step trace; it replays the same steps). `ops/explore.sh`.

use cobro_core::routing::Route;
use cobro_core::{AttemptState, Clock, Operation, PaymentId};
use cobro_provider::Connector;
use cobro_reconciler::{Reconciler, ReconcilerConfig, Scope};
use cobro_settle::routing::{BreakerPolicy, Circuits};
use cobro_store::ProviderScope;
use cobro_test_support::{Backend, Dialect, RIG_SECRET_KEY, Rig, TestApp, TestDb};
use cobro_worker::{Worker, WorkerConfig};
use fake_provider::{FaultAction, FaultRule, Operation as FOp};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::{Notify, oneshot};

const SECRET: &str = "whsec_explorer";
/// Steps per seed before the run is driven to quiet.
const STEPS: usize = 60;
/// Seeds per backend when `EXPLORE_SEEDS` is not set.
const DEFAULT_SEEDS: u64 = 200;
/// How long one step may take to settle (a parked call, a finished task).
const STEP_DEADLINE: Duration = Duration::from_secs(20);
/// What a step that missed [`STEP_DEADLINE`] reports.
const STEP_NOT_SETTLED: &str = "a worker step did not settle";
/// The real-time timeout of every provider call a seed makes (a seed's
/// own timeouts are virtual: `Gate::time_out_unsent`).
const REAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Seeds run at once (each on its own database) when `EXPLORE_LANES` is
/// not set.
const LANES: usize = 4;
/// The key window of one seed in four (`seed % 4 == 1`): a provider that
/// forgets an idempotency key a minute after its first use, whose search
/// always lags by the full lag the reconciler is told, and workers that
/// send no later than 30 s after an attempt's first send. Their attempts
/// reach the reconciler within the search lag of their last send, where
/// "no effect" is decided at the edge of what the provider can show.
const SHORT_RETENTION: Duration = Duration::from_secs(60);
/// How long the fake's search lags in a short-window seed (and an edge the
/// clock jumps to): no proof depends on it any more, and a rule that still
/// leaned on it fails at its edges.
const SEARCH_LAG: Duration = Duration::from_secs(60);
const SHORT_MARGIN: Duration = Duration::from_secs(30);
/// A search lag longer than any run: an outage's index that never catches
/// up while the explorer looks.
const NEVER_CAUGHT_UP: Duration = Duration::from_secs(30 * 24 * 3600);

/// Seeds that once found something, run again by every default run (after
/// `0..DEFAULT_SEEDS`): 13771 a settle that adopted a refused void's truth
/// the payment could not take (fixed in crates/settle), 72815 an invariant
/// of this judge that was wrong (a void proven without effect, then the
/// operator's `authorized`, then a dashboard's capture: cobro cannot know
/// of it; see `answered_on_charge`), 41099 an invariant of this judge that
/// was too strict (a payment resolved `failed` while its charge was held,
/// its order paid again, then the held charge: see `check_quiet`), 32747
/// an operator's check that read only the attempt's window (a held charge
/// made after it: the true "captured" refused, a mistaken "failed"
/// accepted; fixed in `Reconciler::check_verdict`). Runs
/// are timing-dependent, so each finds its interleaving in some runs, not
/// all.
const FOUND: &[u64] = &[13771, 72815, 41099, 32747];
/// The seeds of `FOUND` found before held requests existed: they never
/// hold one, so that they replay the steps they were found with.
const FOUND_BEFORE_HOLDS: &[u64] = &[13771, 72815];

/// One fault in this many on a charge holds it (`hold_effect`), drawn from
/// the seed's second stream (see `Explorer::late`).
const HOLD_ONE_IN: u32 = 3;
/// While a charge is held, one step in this many releases it.
const RELEASE_ONE_IN: u32 = 12;
/// How long a charge answered `processing` takes to become final (virtual
/// time, which the explorer's steps advance).
const PROCESSING_LAG: Duration = Duration::from_secs(20);

/// A Stripe seed's longest clock step: past the seven days after which
/// Stripe cancels an uncaptured PaymentIntent on its own.
const STRIPE_WEEK: Duration = Duration::from_secs(7 * 24 * 3600 + 60);
/// One cached 500 (`fail_after_effect`) in this many of a Stripe seed says
/// `Stripe-Should-Retry: false`, as does every fault that would have held
/// a request (the Stripe dialect holds none).
const NO_RETRY_ONE_IN: u32 = 2;

fn short_window(seed: u64) -> bool {
    seed % 4 == 1
}

/// One seed in four runs on the fake provider's Stripe dialect (see the
/// module doc): `seed % 8` is 1 (also a short-window seed) or 6 (the
/// default key window), so the Stripe dialect meets both key windows. It
/// never coincides with a routing seed (2 or 5): a Stripe seed has one
/// provider, `stripe`. Routing is proven across dialects by tests/routing.rs
/// (`a` the fake's API, `b` its Stripe dialect); combined here it would need
/// both names' workers, reconcilers, webhook routes and signatures in the
/// Stripe dialect, and a routing judge of one ledger seen through two
/// Stripe accounts, which this explorer does not model. The seeds of
/// `FOUND` (3 mod 4) keep the fake dialect and replay as found.
fn stripe(seed: u64) -> bool {
    matches!(seed % 8, 1 | 6)
}

/// How a seed runs, for its failure's first line (and `EXPLORE_VERBOSE`):
/// its dialect, key window and whether it routes, so a replay says what it
/// replays.
fn describe(seed: u64) -> String {
    let dialect = if stripe(seed) {
        "Stripe dialect (PaymentIntents, Stripe-Signature at /v1/webhooks/stripe)"
    } else {
        "fake dialect"
    };
    let window = if short_window(seed) {
        "short key window"
    } else {
        "default key window"
    };
    let routed = if routing(seed) {
        ", routing fake and backup"
    } else {
        ""
    };
    format!("{dialect}, {window}{routed}")
}

/// The provider every payment starts at (its worker and reconcilers are
/// the rig's own), and the one a routing seed adds: two names in front of
/// the same fake provider.
const PRIMARY: &str = "fake";
const BACKUP: &str = "backup";
const PROVIDERS: [&str; 2] = [PRIMARY, BACKUP];
/// The proofs a move may name (docs/routing.md §2), in the order counted.
const PROOFS: [&str; 4] = ["soft_decline", "not_sent", "circuit_open", "no_effect"];
/// A run of at least this many routing seeds must move some payment (the
/// default run has 50), and one of the second many must have moved
/// payments on every proof (2 000 seeds moved 49 to 394 on each).
const ROUTING_SEEDS_THAT_MUST_MOVE: u64 = 20;
const ROUTING_SEEDS_THAT_MUST_SEE_EVERY_PROOF: u64 = 400;
/// A run of at least this many Stripe seeds must have fired the Stripe
/// dialect's cached 500 with `Stripe-Should-Retry: false` (the default run
/// has 50).
const STRIPE_SEEDS_THAT_MUST_SEE_NO_RETRY: u64 = 20;

/// One seed in four routes across two providers (see the module doc):
/// half of them with the default key window (`seed % 8 == 2`), half with
/// the short one (`seed % 8 == 5`, a `short_window` seed). The seeds of
/// `FOUND` are 3 mod 4: they replay as they were found.
fn routing(seed: u64) -> bool {
    matches!(seed % 8, 2 | 5)
}

/// The breaker of a routing seed: 2 calls in 5 minutes, half of them
/// without an answer, open a circuit for 2 minutes (a seed makes few
/// calls, and its clock moves by 2 s, 35 s, 400 s or a day at a time).
fn breaker() -> BreakerPolicy {
    BreakerPolicy {
        window: Duration::from_secs(300),
        min_calls: 2,
        error_rate: 0.5,
        cool_down: Duration::from_secs(120),
        read_every: Duration::from_secs(1),
    }
}

/// Which attempts a routing seed's worker or reconciler of `provider`
/// handles (the primary's also those naming no provider, of which a
/// routing seed makes none).
fn scope(provider: &str) -> ProviderScope {
    ProviderScope {
        name: provider.to_owned(),
        is_default: provider == PRIMARY,
    }
}

/// The API of a routing seed: webhooks of both providers (the fake's
/// scheme, one secret), the default chain `fake, backup`, the account's
/// rules read at every create, and the seed's breaker.
fn routed_settings() -> cobro_api::ApiSettings {
    let mut settings = cobro_test_support::test_api_settings();
    for name in PROVIDERS {
        let secret = cobro_provider::WebhookSecret::new(SECRET);
        settings
            .webhooks
            .insert(name.to_owned(), cobro_api::WebhookReceiver::fake(secret));
    }
    let names: Vec<String> = PROVIDERS.iter().map(|p| (*p).to_owned()).collect();
    settings.default_provider = Some(PRIMARY.to_owned());
    settings.routing = cobro_api::routing::RoutingSettings {
        providers: names.clone(),
        default_chain: names,
        rules_ttl: Duration::ZERO,
    };
    settings.breaker = breaker();
    settings
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn explore_postgres() {
    explore(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn explore_sqlite() {
    explore(Backend::Sqlite).await;
}

async fn explore(backend: Backend) {
    // Logs of the code under test go to the test's output (shown on failure).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(std::env::var("COBRO_TEST_LOG").unwrap_or_else(|_| "error".into()))
        .with_test_writer()
        .try_init();
    let seeds: Vec<u64> = match std::env::var("EXPLORE_SEED") {
        Ok(one) => vec![one.parse().expect("EXPLORE_SEED is a number")],
        Err(_) => {
            let n = std::env::var("EXPLORE_SEEDS")
                .ok()
                .and_then(|n| n.parse().ok())
                .unwrap_or(DEFAULT_SEEDS);
            let first = std::env::var("EXPLORE_FIRST_SEED")
                .ok()
                .and_then(|n| n.parse::<u64>().ok());
            let asked = std::env::var("EXPLORE_SEEDS").is_ok() || first.is_some();
            let first = first.unwrap_or(0);
            let mut seeds: Vec<u64> = (first..first + n).collect();
            if !asked {
                seeds.extend(FOUND.iter().filter(|s| **s >= first + n));
            }
            seeds
        }
    };
    let started = std::time::Instant::now();
    // Each seed runs on a lane: a migrated database, wiped between its
    // seeds (with `EXPLORE_FRESH_LANES`, a fresh one per seed). A lane
    // whose seed failed is kept for inspection.
    let lanes = Mutex::new(Vec::new());
    let failed_lanes = Mutex::new(Vec::new());
    let finished = std::sync::atomic::AtomicU64::new(0);
    let violations = std::sync::atomic::AtomicU64::new(0);
    // Seeds that made late charges or refunds: printed at the end, so a
    // run shows it reached them.
    let with_late = std::sync::atomic::AtomicU64::new(0);
    // What the routing seeds reached (printed and asserted at the end).
    let routed = Mutex::new(RoutingTally::default());
    // What the Stripe seeds reached (likewise).
    let striped = Mutex::new(StripeTally::default());
    // `EXPLORE_STOP_AT_FIRST`: no new seed starts after a violation (for
    // hunting a known defect: which seed finds it first).
    let stop_at_first = std::env::var("EXPLORE_STOP_AT_FIRST").is_ok();
    let stopped = std::sync::atomic::AtomicBool::new(false);
    // Each lane's database (and its pool) is wiped and reused between its
    // seeds: about three times faster on PostgreSQL, where a CREATE and
    // DROP DATABASE cost about 370 ms of server CPU (the default since the
    // soak of tests/results/explorer.md ran clean in this mode). `EXPLORE_FRESH_LANES`
    // gives every seed a fresh database instead. The violations once seen
    // mostly in reuse mode were a real defect that the reused tables'
    // statistics exposed (a claim of batch 1 leasing several rows; see
    // `Gate::park`), so a failure found here may need its lane's history to
    // happen again: replay it with the same first seed and lanes.
    let reuse_lanes = std::env::var("EXPLORE_FRESH_LANES").is_err();
    // `EXPLORE_LANES`: seeds run at once (a seed spends part of its time
    // waiting on the database, so more lanes than cores can use them
    // better; tests/results/explorer.md has the measurements).
    let lanes_at_once = std::env::var("EXPLORE_LANES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(LANES);
    let failures_found = futures::stream::iter(seeds.clone())
        .map(|seed| {
            let (lanes, failed_lanes, finished, violations, stopped, reuse_lanes) = (
                &lanes,
                &failed_lanes,
                &finished,
                &violations,
                &stopped,
                reuse_lanes,
            );
            let (with_late, routed, striped) = (&with_late, &routed, &striped);
            async move {
                if stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    return None;
                }
                let spare = lanes.lock().unwrap_or_else(PoisonError::into_inner).pop();
                let lane = match spare {
                    Some(lane) => lane,
                    None => TestDb::new(backend).await,
                };
                let outcome = run_seed(backend, seed, lane.lend()).await;
                // A violation's first line goes out at once (the full
                // report comes at the end), so a long run stopped early
                // still says what it found.
                match &outcome {
                    Ok(reached) => {
                        let ordering = std::sync::atomic::Ordering::Relaxed;
                        with_late.fetch_add(u64::from(reached.late_effects > 0), ordering);
                        if let Some(reached) = &reached.routing {
                            routed
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .add(reached);
                        }
                        if let Some(reached) = &reached.stripe {
                            striped
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .add(reached);
                        }
                    }
                    Err(violation) => {
                        eprintln!(
                            "explorer {backend:?}: VIOLATION {}",
                            violation.report.lines().next().unwrap_or_default()
                        );
                        violations.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
                let done = finished.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if done % 1000 == 0 {
                    eprintln!(
                        "explorer {backend:?}: {done} seeds in {:.1?}, {} violations",
                        started.elapsed(),
                        violations.load(std::sync::atomic::Ordering::Relaxed)
                    );
                }
                if outcome.is_ok() && reuse_lanes {
                    lane.wipe().await;
                    lanes
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(lane);
                } else if outcome.is_ok() {
                    // Closed first: a pool's PostgreSQL listener would
                    // otherwise try to reconnect to the dropped database.
                    lane.store.close().await;
                    drop(lane);
                } else {
                    stopped.store(stop_at_first, std::sync::atomic::Ordering::Relaxed);
                    failed_lanes
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(lane);
                }
                outcome.err()
            }
        })
        .buffer_unordered(lanes_at_once)
        .filter_map(|f| async move { f })
        .collect::<Vec<Violation>>()
        .await;
    // A violation the machine may have chosen is replayed alone, on a fresh
    // lane, with nothing else running: believed if it fails again, voided
    // (and said) if it passes. One the machine cannot have chosen stands.
    let mut failures = Vec::new();
    for violation in failures_found {
        if !violation.load_bound {
            failures.push(violation.report);
            continue;
        }
        match run_seed(backend, violation.seed, TestDb::new(backend).await).await {
            Ok(_) => eprintln!(
                "explorer {backend:?}: seed {} voided: it failed while the machine held a provider call or a step past its real-time limit, and passes replayed alone ({})",
                violation.seed,
                violation.report.lines().next().unwrap_or_default()
            ),
            Err(again) => failures.push(again.report),
        }
    }
    eprintln!(
        "explorer {backend:?}: {} seeds x {STEPS} steps in {:.1?}; late charges or refunds made in {} seeds",
        seeds.len(),
        started.elapsed(),
        with_late.load(std::sync::atomic::Ordering::Relaxed),
    );
    let routed = routed.into_inner().unwrap_or_else(PoisonError::into_inner);
    eprintln!("explorer {backend:?}: {}", routed.summary());
    let striped = striped.into_inner().unwrap_or_else(PoisonError::into_inner);
    eprintln!("explorer {backend:?}: {}", striped.summary());
    // Wiped lanes go now; a failed one is kept (dropped while panicking).
    for lane in lanes.into_inner().unwrap_or_else(PoisonError::into_inner) {
        lane.store.close().await;
    }
    // The first three in full (trace and replay line); the rest in a line.
    let shown: Vec<&str> = failures
        .iter()
        .enumerate()
        .map(|(i, f)| {
            if i < 3 {
                f.as_str()
            } else {
                f.lines().next().unwrap_or_default()
            }
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} seed(s) violated an invariant:\n{}",
        failures.len(),
        shown.join("\n\n")
    );
    // The routing mode cannot silently do nothing.
    assert!(
        routed.seeds < ROUTING_SEEDS_THAT_MUST_MOVE || routed.moves.iter().sum::<u64>() > 0,
        "{} routing seeds moved no payment: {}",
        routed.seeds,
        routed.summary()
    );
    assert!(
        routed.seeds < ROUTING_SEEDS_THAT_MUST_SEE_EVERY_PROOF
            || routed.moves.iter().all(|n| *n > 0),
        "{} routing seeds never moved a payment on some proof: {}",
        routed.seeds,
        routed.summary()
    );
    // Nor can the Stripe dialect's own fault.
    assert!(
        striped.seeds < STRIPE_SEEDS_THAT_MUST_SEE_NO_RETRY || striped.no_retry > 0,
        "{} Stripe seeds never had a 500 saying Stripe-Should-Retry: false: {}",
        striped.seeds,
        striped.summary()
    );
}

/// What the Stripe seeds of a run reached, added up.
#[derive(Default)]
struct StripeTally {
    seeds: u64,
    no_retry: u64,
    seeds_with_no_retry: u64,
    processing: u64,
    expired: u64,
    seeds_with_expired: u64,
}

impl StripeTally {
    fn add(&mut self, reached: &StripeReached) {
        self.seeds += 1;
        self.no_retry += reached.no_retry;
        self.seeds_with_no_retry += u64::from(reached.no_retry > 0);
        self.processing += reached.processing;
        self.expired += reached.expired;
        self.seeds_with_expired += u64::from(reached.expired > 0);
    }

    fn summary(&self) -> String {
        format!(
            "Stripe dialect in {} seeds: {} 500s saying Stripe-Should-Retry: false fired in {} seeds, {} PaymentIntents answered processing, {} authorisations Stripe canceled uncaptured after seven days in {} seeds",
            self.seeds,
            self.no_retry,
            self.seeds_with_no_retry,
            self.processing,
            self.expired,
            self.seeds_with_expired,
        )
    }
}

/// What the routing seeds of a run reached, added up.
#[derive(Default)]
struct RoutingTally {
    seeds: u64,
    /// Moves by proof (`PROOFS`' order).
    moves: [u64; 4],
    seeds_with_moves: u64,
    seeds_with_open_circuit: u64,
    /// Events delivered at the route of the provider they are not about
    /// (each one kept unmatched, or a duplicate of such a delivery).
    misdelivered: u64,
}

impl RoutingTally {
    fn add(&mut self, reached: &RoutingReached) {
        self.seeds += 1;
        for (total, n) in self.moves.iter_mut().zip(reached.moves) {
            *total += n;
        }
        self.seeds_with_moves += u64::from(reached.moves.iter().sum::<u64>() > 0);
        self.seeds_with_open_circuit += u64::from(reached.circuit_opened);
        self.misdelivered += reached.misdelivered;
    }

    fn summary(&self) -> String {
        let by_proof: Vec<String> = PROOFS
            .iter()
            .zip(self.moves)
            .map(|(proof, n)| format!("{proof} {n}"))
            .collect();
        format!(
            "routing in {} seeds: {} moves in {} seeds ({}), a circuit opened in {} seeds, {} events delivered at the other provider's route and kept unmatched",
            self.seeds,
            self.moves.iter().sum::<u64>(),
            self.seeds_with_moves,
            by_proof.join(", "),
            self.seeds_with_open_circuit,
            self.misdelivered,
        )
    }
}

// ---------------------------------------------------------------------------
// The gate: provider calls that wait for the explorer.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Claimed and marked sent; the request has not gone out.
    Before,
    /// The provider answered; the worker has not recorded it.
    After,
}

#[derive(Default)]
struct GateState {
    /// The parked call; sending `false` lets it go on, `true` times it out.
    parked: Option<(Stage, oneshot::Sender<bool>, String)>,
    /// Virtual time that passed while the parked call waited.
    age: Duration,
    /// Let every call through without parking (driving to quiet).
    open: bool,
    /// Calls that parked while another was parked here, as (held,
    /// newcomer). One worker of batch 1 makes one call at a time, so this
    /// means a claim took more rows than its limit (the PostgreSQL defect
    /// fixed on 2026-12-02) or a harness defect; either way the explorer
    /// would think one call parked while another ran, so the check fails
    /// the seed on any.
    doubles: Vec<(String, String)>,
}

/// Parks each provider call of one worker twice: before it goes out and
/// before its answer is returned.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Notify,
    /// Answers of unknown outcome that said `Stripe-Should-Retry: false`
    /// (the Stripe dialect's cached 500), counted as they come back: the
    /// round of a worker that got one must hand its attempt over
    /// ([`handed_over_when_told`]).
    told_not_to_retry: AtomicU32,
    /// Provider calls that ran into their real-time timeout
    /// ([`Gated::timed`]): the machine, not the seed, decided their outcome.
    real_timeouts: AtomicU32,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `true`: the call timed out while parked (the explorer moved the
    /// clock past the request timeout before it went out).
    async fn park(&self, stage: Stage, what: &str) -> bool {
        let wait = {
            let mut state = self.lock();
            if state.open {
                return false;
            }
            let (release, wait) = oneshot::channel();
            let newcomer = format!("{stage:?} {what}");
            if let Some((_, _, held)) = state.parked.replace((stage, release, newcomer.clone())) {
                state.doubles.push((held, newcomer));
            }
            state.age = Duration::ZERO;
            wait
        };
        self.changed.notify_waiters();
        match wait.await {
            Ok(timed_out) => timed_out,
            // The sender was dropped: the explorer crashed this call
            // (`clear`) or another call parked over it. A crashed call never
            // completes, whatever is left of its task (a worker's call runs
            // in a task of `run_once`'s `JoinSet`, which aborting `run_once`
            // aborts only later). Until 2026-12-02 it went on here,
            // unreleased, while the judge read; the calls parked over others
            // were PostgreSQL claims of batch 1 that leased several rows (a
            // cobro defect, now fixed and tested in `store_conformance`), and
            // `doubles` makes any such call fail its seed.
            Err(_) => std::future::pending().await,
        }
    }

    fn doubled(&self) -> Vec<(String, String)> {
        self.lock().doubles.clone()
    }

    fn parked(&self) -> Option<Stage> {
        self.lock().parked.as_ref().map(|(stage, _, _)| *stage)
    }

    fn release(&self) {
        if let Some((_, release, _)) = self.lock().parked.take() {
            let _ = release.send(false);
        }
    }

    /// `by` of virtual time passes. A request that has not gone out cannot
    /// outlive its timeout: once it has waited longer, it is timed out (the
    /// worker sees an unknown outcome, nothing was sent). Until then it may
    /// still go out, and reach the provider that much after its send was
    /// marked: the lateness the reconciler allows for.
    fn time_out_unsent(&self, by: Duration, timeout: Duration) -> bool {
        let mut state = self.lock();
        if !matches!(state.parked, Some((Stage::Before, _, _))) {
            return false;
        }
        state.age += by;
        if state.age <= timeout {
            return false;
        }
        if let Some((_, release, _)) = state.parked.take() {
            let _ = release.send(true);
        }
        true
    }

    fn clear(&self) {
        self.lock().parked = None;
    }

    fn open(&self) {
        let mut state = self.lock();
        state.open = true;
        if let Some((_, release, _)) = state.parked.take() {
            let _ = release.send(false);
        }
    }
}

/// Each provider key a worker sent, with the provider names it went out
/// through (every [`Front`] of a seed shares one).
type SentLog = Arc<Mutex<BTreeMap<String, BTreeSet<&'static str>>>>;

/// A provider name in front of the seed's one fake provider: what a
/// [`Gated`] reports as its `name()`, the connections a routing seed's
/// fault refuses there, and the log of what went out through it.
#[derive(Clone)]
struct Front {
    name: &'static str,
    /// Sends still to be refused before a connection is made: nothing is
    /// sent, and the worker is answered `NotConnected`.
    refusals: Arc<AtomicU32>,
    sent: SentLog,
}

impl Front {
    fn new(name: &'static str, sent: &SentLog) -> Self {
        Front {
            name,
            refusals: Arc::new(AtomicU32::new(0)),
            sent: Arc::clone(sent),
        }
    }

    /// Whether this send is refused (using up one refusal).
    fn refuse(&self) -> bool {
        self.refusals
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    fn note_sent(&self, key: &str) {
        self.sent
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key.to_owned())
            .or_default()
            .insert(self.name);
    }
}

/// A provider whose calls wait for the explorer. A worker's mutations park
/// before they go out and before their answer returns; a reconciler's
/// queries (`queries: true`) park once answered, so the explorer can act
/// between what a reconciler read and what it applies. It answers to its
/// front's name (a routing seed's worker of `backup` sends through one
/// named `backup`, to the same fake provider), and speaks the rig's
/// dialect: the fake's API, or its Stripe dialect through cobro's Stripe
/// connector (named `stripe`), whose [`cobro_provider::CallInfo`] (a 500's
/// `Stripe-Should-Retry: false`) reaches the worker through `send`.
struct Gated {
    inner: Connector,
    gate: Arc<Gate>,
    queries: bool,
    front: Front,
}

impl Gated {
    fn new(rig: &Rig, gate: &Arc<Gate>, queries: bool, front: &Front) -> Self {
        // Real time, for a loaded machine: the request timeout of the
        // explorer's virtual time is the reconcilers' (`Gate::time_out_unsent`).
        let timeout = REAL_TIMEOUT;
        let inner: Connector = match rig.dialect {
            Dialect::Fake => {
                let mut client =
                    cobro_provider::HttpProviderConfig::new(rig.provider.url(), RIG_SECRET_KEY);
                client.request_timeout = timeout;
                client.name = front.name.to_owned();
                cobro_provider::HttpProvider::new(client)
                    .expect("client")
                    .into()
            }
            // Stripe seeds never route: one provider, named as its route.
            Dialect::Stripe => {
                let mut client = cobro_provider::StripeConfig::new(
                    rig.provider.url(),
                    cobro_provider::StripeSecretKey::new(RIG_SECRET_KEY),
                );
                client.request_timeout = timeout;
                client.name = Dialect::Stripe.webhook_provider().to_owned();
                cobro_provider::StripeProvider::new(client)
                    .expect("stripe client")
                    .into()
            }
        };
        Gated {
            inner,
            gate: Arc::clone(gate),
            queries,
            front: front.clone(),
        }
    }

    /// Runs one call to the provider, counting it on the gate when it took
    /// the whole real-time timeout. Everything else in a seed runs on
    /// virtual time; a call that a loaded machine kept past that timeout
    /// reaches the provider whenever the machine lets it, perhaps after
    /// the explorer jumped both clocks by days: an order of events the
    /// seed did not choose and no provider can produce (a request landing
    /// days after its send). A violation in such a seed is replayed before
    /// it is believed ([`explore`]).
    async fn timed<T>(&self, call: impl std::future::Future<Output = T>) -> T {
        let started = std::time::Instant::now();
        let answer = call.await;
        if started.elapsed() >= REAL_TIMEOUT {
            self.gate.real_timeouts.fetch_add(1, Ordering::SeqCst);
        }
        answer
    }

    async fn query<T>(&self, query: impl std::future::Future<Output = T>) -> T {
        let answer = self.timed(query).await;
        if self.queries {
            self.gate.park(Stage::After, "query").await;
        }
        answer
    }
}

impl cobro_provider::Provider for Gated {
    fn name(&self) -> &str {
        self.inner.name()
    }
    /// Every mutation: parked before it goes out and before its answer
    /// returns, with what the provider said of the call.
    async fn send(
        &self,
        key: &str,
        mutation: cobro_provider::Mutation<'_>,
    ) -> cobro_provider::Sent {
        if self.gate.park(Stage::Before, key).await {
            return cobro_provider::Sent {
                outcome: cobro_provider::Outcome::Unknown("timed out before it was sent".into()),
                call: None,
            };
        }
        // A refused connection sends nothing (the call is never polled).
        let sent = if self.front.refuse() {
            cobro_provider::Sent {
                outcome: cobro_provider::Outcome::NotConnected(format!(
                    "connection to {} refused (the explorer's fault): nothing was sent",
                    self.front.name
                )),
                call: None,
            }
        } else {
            self.front.note_sent(key);
            self.timed(self.inner.send(key, mutation)).await
        };
        if matches!(sent.outcome, cobro_provider::Outcome::Unknown(_))
            && sent.call.as_ref().and_then(|c| c.should_retry) == Some(false)
        {
            self.gate.told_not_to_retry.fetch_add(1, Ordering::SeqCst);
        }
        self.gate.park(Stage::After, key).await;
        sent
    }
    async fn authorize(
        &self,
        key: &str,
        request: &cobro_provider::AuthorizeRequest,
    ) -> cobro_provider::Outcome {
        self.send(key, cobro_provider::Mutation::Authorize(request))
            .await
            .outcome
    }
    async fn capture(&self, key: &str, charge: &str) -> cobro_provider::Outcome {
        self.send(key, cobro_provider::Mutation::Capture(charge))
            .await
            .outcome
    }
    async fn void(&self, key: &str, charge: &str) -> cobro_provider::Outcome {
        self.send(key, cobro_provider::Mutation::Void(charge))
            .await
            .outcome
    }
    async fn refund(
        &self,
        key: &str,
        request: &cobro_provider::RefundRequest,
    ) -> cobro_provider::Outcome {
        self.send(key, cobro_provider::Mutation::Refund(request))
            .await
            .outcome
    }
    async fn get_charge(
        &self,
        id: &str,
    ) -> Result<Option<cobro_provider::ProviderObject>, cobro_provider::QueryError> {
        self.query(self.inner.get_charge(id)).await
    }
    async fn search_charges(
        &self,
        reference: &str,
    ) -> Result<Vec<cobro_provider::ProviderObject>, cobro_provider::QueryError> {
        self.query(self.inner.search_charges(reference)).await
    }
    async fn search_refunds(
        &self,
        reference: &str,
        charge: Option<&str>,
    ) -> Result<Vec<cobro_provider::ProviderObject>, cobro_provider::QueryError> {
        self.query(self.inner.search_refunds(reference, charge))
            .await
    }
    async fn list_charges(
        &self,
        reference: &str,
        window: cobro_provider::Window,
    ) -> Result<Vec<cobro_provider::ProviderObject>, cobro_provider::QueryError> {
        self.query(self.inner.list_charges(reference, window)).await
    }
    async fn list_refunds(
        &self,
        reference: &str,
        charge: &str,
    ) -> Result<Vec<cobro_provider::ProviderObject>, cobro_provider::QueryError> {
        self.query(self.inner.list_refunds(reference, charge)).await
    }
}

/// One worker or reconciler the explorer drives: its gate and its
/// current round (a task that ends with what it found wrong, if anything).
struct Driven<A> {
    actor: Arc<A>,
    gate: Arc<Gate>,
    task: Option<tokio::task::JoinHandle<Result<(), String>>>,
}

impl<A> Driven<A> {
    fn new(actor: A, gate: Arc<Gate>) -> Self {
        Self {
            actor: Arc::new(actor),
            gate,
            task: None,
        }
    }

    fn busy(&self) -> bool {
        self.task.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Waits until the task has finished or its call is parked at a stage.
    async fn settle(&mut self) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + STEP_DEADLINE;
        loop {
            let notified = self.gate.changed.notified();
            if self.gate.parked().is_some() {
                return Ok(());
            }
            let Some(task) = self.task.as_mut() else {
                return Ok(());
            };
            tokio::select! {
                ended = task => {
                    self.task = None;
                    return ended.map_err(|e| format!("task failed: {e}"))?;
                }
                _ = notified => {}
                _ = tokio::time::sleep_until(deadline) => return Err(STEP_NOT_SETTLED.into()),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// One seed.

struct Account {
    token: String,
}

/// A request sent, kept for replays.
#[derive(Clone, Debug)]
struct Sent {
    account: usize,
    path: String,
    key: String,
    body: Value,
}

struct Explorer {
    rig: Rig,
    rng: StdRng,
    accounts: Vec<Account>,
    workers: Vec<Driven<Worker<Gated>>>,
    /// Reconcilers whose runs are steps: each query parks once answered.
    reconcilers: Vec<Driven<Reconciler<Gated>>>,
    /// The provider each worker, and each step reconciler, is of (in a
    /// seed that does not route, every one is the primary's and handles
    /// every attempt).
    worker_providers: Vec<&'static str>,
    reconciler_providers: Vec<&'static str>,
    payments: Vec<(usize, String)>,
    sent: Vec<Sent>,
    /// Webhook bodies delivered, each with the provider whose route it was
    /// delivered to, for duplicates and late deliveries.
    events: Vec<(&'static str, Vec<u8>)>,
    trace: Vec<String>,
    next_key: u64,
    /// Tasks of crashed workers and reconcilers (aborted; awaited at the
    /// seed's end).
    crashed: Vec<tokio::task::JoinHandle<Result<(), String>>>,
    /// Charges a dashboard captured or voided (or tried to) behind cobro's
    /// back, each with the captures and voids of its payment that cobro had
    /// already answered by then (see [`answered_on_charge`]): their answers
    /// predate the dashboard's move, so they cannot tell cobro of it.
    dashboard: BTreeMap<String, BTreeSet<cobro_core::AttemptId>>,
    /// The reconcilers' settings: the explorer's model of time (a request
    /// reaches the provider at most `request_timeout` after its send is
    /// marked; search shows an object at most `search_lag` after it is made).
    model: cobro_reconciler::ReconcilerConfig,
    /// This seed's key window (`short_window`), and how long after an
    /// attempt's first send its workers may still send.
    short: bool,
    send_window: Duration,
    /// When each worker request was marked sent (its call parked before
    /// going out), for the clock's edges.
    sends: Vec<chrono::DateTime<chrono::Utc>>,
    /// The seed's second stream, for held charges and their release only:
    /// the first stream draws exactly what it drew before held charges
    /// existed, so a seed without any replays its old steps (the seeds of
    /// `FOUND_BEFORE_HOLDS` never hold one).
    late: StdRng,
    /// The seed's third stream: which in-progress charge faults answer
    /// `processing` instead (the charge made, its outcome final later), so
    /// neither earlier stream draws differently.
    slow: StdRng,
    holds: bool,
    /// Charges and refunds the provider made when a held request was
    /// released (`ch_...`, `re_...`).
    late_effects: BTreeSet<String>,
    /// What the reconcilers of the last round of `settle_all` decided of
    /// each attempt they examined (attempt id, verdict), for a liveness
    /// failure's report.
    last_verdicts: Vec<(String, String)>,
    /// Every provider key sent, with the names it went out through.
    sent_through: SentLog,
    /// A routing seed's own state; `None` in the other seeds.
    routing: Option<Routing>,
    /// A Stripe seed's own state; `None` in the seeds of the fake dialect.
    stripe: Option<StripeSide>,
}

/// What only a Stripe seed has.
struct StripeSide {
    /// The seed's fifth stream: every draw only a Stripe seed makes (which
    /// cached 500s say `Stripe-Should-Retry: false`, which day-long clock
    /// jumps are a week), so the other streams draw as in any seed.
    rng: StdRng,
    /// Each event built, by id (`evt_<object>_<status>`: one per state an
    /// object reached, as Stripe sends one per change), as first built: a
    /// later delivery of that state is the same event again.
    events: BTreeMap<String, Vec<u8>>,
    /// When each charge and refund was first seen in each of its states
    /// (unix seconds, by id and ledger status; see `Explorer::observe`).
    seen: BTreeMap<String, BTreeMap<String, i64>>,
    /// Authorisations Stripe canceled on its own (uncaptured for seven
    /// days: `cancellation_reason: automatic`).
    expired: u64,
}

/// What only a routing seed has.
struct Routing {
    /// The seed's fourth stream: every draw only a routing seed makes (the
    /// provider of a whole reconciler run, routing's faults, webhooks at
    /// the wrong route, the second account's rules).
    rng: StdRng,
    /// Both providers' fronts (`PROVIDERS`' order).
    fronts: Vec<Front>,
    /// Events delivered at the route of the provider they are not about.
    misdelivered: u64,
}

/// What a seed reached that is rare: late charges or refunds made; and
/// what a routing or Stripe seed reached.
#[derive(Default)]
struct Reached {
    late_effects: u64,
    routing: Option<RoutingReached>,
    stripe: Option<StripeReached>,
}

/// What a Stripe seed reached, once quiet: how often its Stripe-only
/// faults fired at the provider, and how many authorisations Stripe
/// canceled on its own.
#[derive(Default)]
struct StripeReached {
    /// `fail_after_effect_no_retry` (a 500 saved under the key with
    /// `Stripe-Should-Retry: false`), on any operation.
    no_retry: u64,
    /// Charges answered `processing` (a PaymentIntent `processing`).
    processing: u64,
    expired: u64,
}

/// What a routing seed reached, once quiet.
struct RoutingReached {
    /// Moves by proof (`PROOFS`' order).
    moves: [u64; 4],
    circuit_opened: bool,
    misdelivered: u64,
}

/// A seed's violation, and whether the machine may have chosen it: a
/// provider call ran into its real-time timeout, or a step did not settle
/// within its real-time deadline.
struct Violation {
    seed: u64,
    report: String,
    load_bound: bool,
}

async fn run_seed(backend: Backend, seed: u64, db: TestDb) -> Result<Reached, Violation> {
    let mut x = Explorer::new(db, seed).await;
    let outcome = match x.run().await {
        Ok(()) => x.routing_reached().await.map(|routing| Reached {
            late_effects: x.late_effects.len() as u64,
            routing,
            stripe: x.stripe_reached(),
        }),
        Err(violation) => Err(violation),
    };
    let trace = std::mem::take(&mut x.trace);
    let real_timeouts: u32 = x
        .workers
        .iter()
        .map(|d| &d.gate)
        .chain(x.reconcilers.iter().map(|d| &d.gate))
        .map(|g| g.real_timeouts.load(Ordering::SeqCst))
        .sum();
    x.finish().await;
    if std::env::var("EXPLORE_VERBOSE").is_ok() {
        eprintln!(
            "TRACE {seed} ({backend:?}, {}):\n    {}",
            describe(seed),
            trace.join("\n    ")
        );
    }
    outcome.map_err(|violation| {
        let load_bound = real_timeouts > 0 || violation.contains(STEP_NOT_SETTLED);
        Violation {
            seed,
            report: format!(
                "seed {seed} ({backend:?}, {}) after {} steps{}: {violation}\n  replay: EXPLORE_SEED={seed} ops/explore.sh\n  trace:\n    {}",
                describe(seed),
                trace.len(),
                if real_timeouts > 0 {
                    format!(" ({real_timeouts} provider call(s) took their whole real-time timeout)")
                } else {
                    String::new()
                },
                trace.join("\n    ")
            ),
            load_bound,
        }
    })
}

impl Explorer {
    async fn new(db: TestDb, seed: u64) -> Self {
        let model = Rig::reconciler_config(|_| {});
        let short = short_window(seed);
        let defaults = WorkerConfig::default();
        let (retention, margin) = if short {
            (SHORT_RETENTION, SHORT_MARGIN)
        } else {
            (defaults.key_retention, defaults.safety_margin)
        };
        // The reconcilers replay a key only inside the workers' window.
        let key_window = retention.checked_sub(margin);
        let model = cobro_reconciler::ReconcilerConfig {
            key_window,
            // As cobro sets it: the fake abandons a held request once its
            // key is forgotten, and not before.
            request_lifetime: retention,
            ..model
        };
        let provider = fake_provider::Config {
            admin: true,
            retention,
            ..Default::default()
        };
        let dialect = if stripe(seed) {
            Dialect::Stripe
        } else {
            Dialect::Fake
        };
        let mut rig = Rig::on_provider(
            TestApp::spawn_on(db).await,
            dialect,
            provider,
            |_, worker| {
                worker.key_retention = retention;
                worker.safety_margin = margin;
            },
        )
        .await;
        rig.accept_webhooks(SECRET, false).await;
        let routed = routing(seed);
        if routed {
            // Served again, routing (the clocks stay aligned).
            rig.app.serve_with(routed_settings()).await;
        }
        if short {
            for operation in [FOp::Charge, FOp::Refund] {
                let lag = FaultRule::new(operation, FaultAction::SearchLag)
                    .with_lag_seconds(SEARCH_LAG.as_secs());
                rig.provider.control().add_fault(lag);
            }
        }
        let store = rig.app.db.store.clone();
        let clock: Arc<dyn Clock> = Arc::new(rig.app.clock.clone());
        let sent_through = SentLog::default();
        let fronts: Vec<Front> = PROVIDERS
            .iter()
            .map(|name| Front::new(name, &sent_through))
            .collect();
        let front = |provider: &str| {
            fronts
                .iter()
                .find(|f| f.name == provider)
                .expect("a provider of the seed")
        };
        // A routing seed's workers are one "process": one set of circuits
        // (the API has its own, as another process would).
        let circuits =
            routed.then(|| Arc::new(Circuits::new(store.clone(), Arc::clone(&clock), breaker())));
        let (worker_providers, reconciler_providers) = if routed {
            (
                vec![PRIMARY, PRIMARY, BACKUP],
                vec![PRIMARY, PRIMARY, BACKUP],
            )
        } else {
            (vec![PRIMARY; 2], vec![PRIMARY; 2])
        };
        let mut workers = Vec::new();
        for (w, provider) in worker_providers.iter().enumerate() {
            let gate = Arc::new(Gate::default());
            let config = WorkerConfig {
                owner: format!("explorer-{w}"),
                batch: 1,
                backoff_base: Duration::from_secs(1),
                backoff_cap: Duration::from_secs(10),
                key_retention: retention,
                safety_margin: margin,
                provider: routed.then(|| scope(provider)),
                ..Default::default()
            };
            let mut worker = Worker::new(
                store.clone(),
                Arc::new(Gated::new(&rig, &gate, false, front(provider))),
                Arc::clone(&clock),
                config,
                Arc::new(Notify::new()),
            );
            if let Some(circuits) = &circuits {
                worker = worker.with_circuits(Arc::clone(circuits));
            }
            workers.push(Driven::new(worker, gate));
        }
        let reconcilers = reconciler_providers
            .iter()
            .enumerate()
            .map(|(r, provider)| {
                let gate = Arc::new(Gate::default());
                let reconciler = Reconciler::new(
                    store.clone(),
                    Arc::new(Gated::new(&rig, &gate, true, front(provider))),
                    Arc::clone(&clock),
                    Rig::reconciler_config(|c| {
                        c.actor = format!("reconciler:explorer-step-{r}");
                        c.key_window = key_window;
                        // As cobro sets it (the model's): without it these
                        // reconcilers proved absence a send's window after
                        // a held request, which the fake may still let
                        // through for a key retention (seeds 309420, 314475).
                        c.request_lifetime = retention;
                        c.provider = routed.then(|| scope(provider));
                    }),
                );
                Driven::new(reconciler, gate)
            })
            .collect();
        let (_, b_token) = rig.app.new_account("merchant-b").await;
        let mut routing = routed.then(|| Routing {
            rng: StdRng::seed_from_u64(seed ^ 0x726f_7574),
            fronts: fronts.clone(),
            misdelivered: 0,
        });
        let mut trace = Vec::new();
        // Half the routing seeds: the second account's own rules start its
        // payments at `backup`.
        if let Some(routing) = &mut routing
            && routing.rng.random_bool(0.5)
        {
            let r = rig
                .app
                .client
                .put(format!("{}/v1/routing", rig.app.url))
                .bearer_auth(&b_token)
                .json(&json!({"default": [BACKUP, PRIMARY]}))
                .send()
                .await
                .expect("PUT /v1/routing");
            assert_eq!(
                r.status().as_u16(),
                200,
                "seed {seed}: the second account's rules"
            );
            trace.push(format!("acct 1 routes along {BACKUP}, {PRIMARY}"));
        }
        let accounts = vec![
            Account {
                token: rig.app.token.clone(),
            },
            Account { token: b_token },
        ];
        Self {
            rig,
            rng: StdRng::seed_from_u64(seed),
            accounts,
            workers,
            reconcilers,
            worker_providers,
            reconciler_providers,
            payments: Vec::new(),
            sent: Vec::new(),
            events: Vec::new(),
            trace,
            next_key: 0,
            crashed: Vec::new(),
            dashboard: BTreeMap::new(),
            model,
            short,
            send_window: retention - margin,
            sends: Vec::new(),
            late: StdRng::seed_from_u64(seed ^ 0x6c61_7465),
            slow: StdRng::seed_from_u64(seed ^ 0x736c_6f77),
            holds: !FOUND_BEFORE_HOLDS.contains(&seed),
            late_effects: BTreeSet::new(),
            last_verdicts: Vec::new(),
            sent_through,
            routing,
            stripe: (dialect == Dialect::Stripe).then(|| StripeSide {
                rng: StdRng::seed_from_u64(seed ^ 0x7374_7269),
                events: BTreeMap::new(),
                seen: BTreeMap::new(),
                expired: 0,
            }),
        }
    }

    /// Ends everything of this seed: every worker and reconciler task
    /// (parked ones included) is aborted and awaited, then the provider and
    /// the app stop. Nothing of the seed is left to touch its lane's
    /// database, which the next seed gets wiped.
    async fn finish(self) {
        let Explorer {
            rig,
            workers,
            reconcilers,
            crashed,
            ..
        } = self;
        let tasks = workers
            .into_iter()
            .filter_map(|d| d.task)
            .chain(reconcilers.into_iter().filter_map(|d| d.task))
            .chain(crashed);
        for task in tasks {
            task.abort();
            let _ = task.await;
        }
        rig.shutdown().await;
    }

    async fn run(&mut self) -> Result<(), String> {
        for _ in 0..STEPS {
            self.step().await?;
            self.check().await?;
        }
        self.quiesce().await?;
        self.check().await?;
        self.check_quiet().await
    }

    fn note(&mut self, what: String) {
        self.trace.push(what);
    }

    /// Advances cobro's clock and the provider's by the same amount. A
    /// request still waiting to go out times out first (in life the gap
    /// between the worker's last check and the bytes on the wire is bounded
    /// by the request timeout, not by the explorer).
    async fn advance(&mut self, by: Duration) -> Result<(), String> {
        for w in 0..self.workers.len() {
            if self.workers[w]
                .gate
                .time_out_unsent(by, self.model.request_timeout)
            {
                self.workers[w].settle().await?;
                self.trace.push(format!("worker {w} unsent call timed out"));
            }
        }
        // A Stripe seed notes what the provider holds before the clocks
        // move (when each state was reached: see `observe`), and what
        // holds money, of which Stripe may cancel some as its clock moves.
        let before = if self.stripe.is_some() {
            let ledger = self.rig.ledger();
            self.observe(&ledger);
            Some(
                ledger
                    .charges
                    .into_iter()
                    .filter(|c| matches!(c.status.as_str(), "authorized" | "processing"))
                    .map(|c| c.id)
                    .collect::<BTreeSet<String>>(),
            )
        } else {
            None
        };
        self.rig
            .app
            .clock
            .advance(chrono::Duration::from_std(by).expect("duration"));
        self.rig.provider.control().advance_clock(by);
        let Some(before) = before else {
            return Ok(());
        };
        // Stripe cancels a PaymentIntent left uncaptured for seven days
        // (`cancellation_reason: automatic`) as its clock passes that
        // mark: its charge voided behind cobro's back, as a dashboard's
        // void is (cobro learns it from the event, or when it next acts on
        // the charge).
        let ledger = self.rig.ledger();
        self.observe(&ledger);
        let expired: Vec<String> = ledger
            .charges
            .iter()
            .filter(|c| c.status == "voided" && before.contains(&c.id))
            .map(|c| c.id.clone())
            .collect();
        for id in expired {
            let intent = cobro_test_support::provider_ref_of(&ledger, &id).to_owned();
            self.note(format!(
                "stripe cancels {intent} ({id}), uncaptured for seven days"
            ));
            if let Some(stripe) = &mut self.stripe {
                stripe.expired += 1;
            }
            let answered = self.answered_before_dashboard(&id).await?;
            self.dashboard.entry(id).or_default().extend(answered);
        }
        Ok(())
    }

    async fn step(&mut self) -> Result<(), String> {
        if self.rig.provider.control().held() > 0 && self.late.random_ratio(1, RELEASE_ONE_IN) {
            let deliver = self.late.random_bool(0.5);
            return self.release_held(deliver).await;
        }
        match self.rng.random_range(0..100) {
            0..=14 => self.create().await,
            15..=18 => self.payment_op("capture").await,
            19..=22 => self.payment_op("cancel").await,
            23..=27 => self.refund().await,
            28..=30 => self.replay().await,
            31..=52 => {
                let w = self.rng.random_range(0..self.workers.len());
                self.worker_step(w).await
            }
            53..=56 => {
                let which = self
                    .rng
                    .random_range(0..self.workers.len() + self.reconcilers.len());
                self.crash(which);
                Ok(())
            }
            57..=65 => {
                self.fault();
                Ok(())
            }
            66 => self.dashboard().await,
            // A short-window seed lands half its clock steps on an edge of
            // a recent send.
            67..=77 if self.short && self.rng.random_bool(0.5) => self.jump_to_edge().await,
            67..=77 => {
                let by = match self.rng.random_range(0..10) {
                    0..=2 => Duration::from_secs(2),
                    3..=5 => Duration::from_secs(35),
                    6..=8 => Duration::from_secs(400),
                    // One day-long jump in three of a Stripe seed is a
                    // week: every authorisation still uncaptured expires.
                    _ if self
                        .stripe
                        .as_mut()
                        .is_some_and(|s| s.rng.random_ratio(1, 3)) =>
                    {
                        STRIPE_WEEK
                    }
                    _ => Duration::from_secs(25 * 3600),
                };
                self.note(format!("clock +{by:?}"));
                self.advance(by).await
            }
            78..=82 => self.reconcile(1).await,
            83..=87 => {
                let r = self.rng.random_range(0..self.reconcilers.len());
                self.reconciler_step(r).await
            }
            88..=89 => self.reconcile(2).await,
            90..=94 => self.webhook().await,
            95..=96 => self.operator().await,
            _ => self.late_webhook().await,
        }
    }

    fn key(&mut self) -> String {
        self.next_key += 1;
        format!("x-{}", self.next_key)
    }

    async fn post(&mut self, sent: Sent) -> Result<(u16, Value), String> {
        let token = self.accounts[sent.account].token.clone();
        let response = self
            .rig
            .app
            .post_as(&token, &sent.path, Some(&sent.key))
            .json(&sent.body)
            .send()
            .await
            .map_err(|e| format!("POST {}: {e}", sent.path))?;
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        // 503 is an honest "not executed, retry with the same key" (a busy
        // SQLite write lock); any other 5xx is a defect.
        if status >= 500 && status != 503 {
            return Err(format!("POST {} answered {status}: {body}", sent.path));
        }
        self.note(format!(
            "acct {} POST {} key {} -> {status} {}",
            sent.account,
            sent.path,
            sent.key,
            body.get("code")
                .or_else(|| body.get("status"))
                .cloned()
                .unwrap_or(Value::Null)
        ));
        // A payment made by any POST (a first send or a replay that runs
        // fresh because the first answer was not stored) is watched.
        if sent.path == "/v1/payments"
            && status == 201
            && let Some(id) = body["id"].as_str()
            && !self.payments.iter().any(|(_, known)| known == id)
        {
            self.payments.push((sent.account, id.to_owned()));
        }
        self.sent.push(sent);
        Ok((status, body))
    }

    async fn create(&mut self) -> Result<(), String> {
        let account = self.rng.random_range(0..self.accounts.len());
        // Two order refs shared by both accounts, one of them most of the
        // time: names collide across accounts.
        let order = if self.rng.random_bool(0.7) {
            "ord-0"
        } else {
            "ord-1"
        };
        let manual = self.rng.random_bool(0.5);
        let amount = [1999, 500, 1999, 7000][self.rng.random_range(0..4)];
        let mut body = json!({"order_ref": order, "amount": amount, "currency": "EUR",
            "payment_method": "pm_card_visa"});
        if manual {
            body["capture_method"] = json!("manual");
        }
        if self.rng.random_range(0..10) == 0 {
            body["payment_method"] = json!("pm_card_declined");
        }
        let key = self.key();
        self.post(Sent {
            account,
            path: "/v1/payments".into(),
            key,
            body,
        })
        .await
        .map(drop)
    }

    fn pick_payment(&mut self) -> Option<(usize, String)> {
        if self.payments.is_empty() {
            return None;
        }
        let i = self.rng.random_range(0..self.payments.len());
        Some(self.payments[i].clone())
    }

    async fn payment_op(&mut self, verb: &str) -> Result<(), String> {
        let Some((account, id)) = self.pick_payment() else {
            return Ok(());
        };
        let key = self.key();
        self.post(Sent {
            account,
            path: format!("/v1/payments/{id}/{verb}"),
            key,
            body: json!({}),
        })
        .await
        .map(drop)
    }

    async fn refund(&mut self) -> Result<(), String> {
        let Some((account, id)) = self.pick_payment() else {
            return Ok(());
        };
        let amount = [300, 700, 1999][self.rng.random_range(0..3)];
        let key = self.key();
        self.post(Sent {
            account,
            path: format!("/v1/payments/{id}/refunds"),
            key,
            body: json!({"amount": amount}),
        })
        .await
        .map(drop)
    }

    async fn replay(&mut self) -> Result<(), String> {
        if self.sent.is_empty() {
            return Ok(());
        }
        let i = self.rng.random_range(0..self.sent.len());
        let again = self.sent[i].clone();
        self.post(again).await.map(drop)
    }

    /// Moves worker `w` one step: claim (a new batch of one), send (the
    /// parked request goes out), or record (the parked answer comes back).
    async fn worker_step(&mut self, w: usize) -> Result<(), String> {
        let driven = &mut self.workers[w];
        let what = match (driven.busy(), driven.gate.parked()) {
            (false, _) => {
                let worker = Arc::clone(&driven.actor);
                let gate = Arc::clone(&driven.gate);
                driven.task = Some(tokio::spawn(async move {
                    let told = gate.told_not_to_retry.load(Ordering::SeqCst);
                    match worker.run_once().await {
                        Ok(steps) if steps.len() > 1 => {
                            Err(format!("a claim of batch 1 took {} rows", steps.len()))
                        }
                        Ok(steps) => handed_over_when_told(
                            gate.told_not_to_retry.load(Ordering::SeqCst) - told,
                            &steps,
                        ),
                        Err(e) => {
                            tracing::warn!(error = %e, "explorer worker round failed");
                            Ok(())
                        }
                    }
                }));
                "claim"
            }
            (true, Some(Stage::Before)) => {
                driven.gate.release();
                "send"
            }
            (true, Some(Stage::After)) => {
                driven.gate.release();
                "record"
            }
            (true, None) => "wait",
        };
        driven.settle().await?;
        let parked = driven.gate.parked();
        if what == "claim" && parked == Some(Stage::Before) {
            self.sends.push(self.rig.app.clock.now());
        }
        let of = self.of_provider(self.worker_providers[w]);
        self.note(format!("worker {w}{of} {what} -> {parked:?}"));
        Ok(())
    }

    /// Moves the clocks to an edge of one of the last sends, chosen among
    /// those still ahead: its request timing out, the search lag passing
    /// (and a second later), the lag plus the request timeout (when the
    /// reconciler may take "not found" as no effect), its key window
    /// closing; half the time a reconciler run follows at once. Rules that
    /// are wrong by a second fail here.
    async fn jump_to_edge(&mut self) -> Result<(), String> {
        let now = self.rig.app.clock.now();
        let (timeout, lag) = (self.model.request_timeout, SEARCH_LAG);
        let offsets = [
            timeout,
            lag,
            lag + Duration::from_secs(1),
            lag + timeout,
            self.send_window,
        ];
        let edges: Vec<_> = self
            .sends
            .iter()
            .rev()
            .take(4)
            .flat_map(|&sent| {
                offsets.map(|o| sent + chrono::Duration::from_std(o).expect("offset"))
            })
            .filter(|&at| at > now)
            .collect();
        if edges.is_empty() {
            self.note("clock to an edge: none ahead".into());
            return Ok(());
        }
        let at = edges[self.rng.random_range(0..edges.len())];
        let by = (at - now).to_std().expect("an edge ahead");
        self.note(format!("clock +{by:?} (an edge)"));
        self.advance(by).await?;
        // Half the time a reconciler asks right there, before anything
        // else moves.
        if self.rng.random_bool(0.5) {
            self.reconcile(1).await?;
        }
        Ok(())
    }

    /// Moves reconciler `r` one step: a run starts (and goes until its
    /// first query is answered), or the parked answer is let through (and
    /// the run goes on: it applies what it read, then reads the next).
    /// Anything may happen in between: that is the point.
    async fn reconciler_step(&mut self, r: usize) -> Result<(), String> {
        let now = self.rng.random_bool(0.5);
        let driven = &mut self.reconcilers[r];
        let what = match (driven.busy(), driven.gate.parked()) {
            (false, _) => {
                let reconciler = Arc::clone(&driven.actor);
                let scope = Scope {
                    older_than: now.then_some(Duration::ZERO),
                    ..Default::default()
                };
                driven.task = Some(tokio::spawn(async move {
                    let run = reconciler.run(&scope, false, "explorer", &|_, _| {}).await;
                    verdicts_of(run).map(drop)
                }));
                if now {
                    "start --older-than 0s"
                } else {
                    "start"
                }
            }
            (true, Some(_)) => {
                driven.gate.release();
                "apply"
            }
            (true, None) => "wait",
        };
        driven.settle().await?;
        let parked = driven.gate.parked();
        let of = self.of_provider(self.reconciler_providers[r]);
        self.note(format!("reconciler {r}{of} {what} -> {parked:?}"));
        Ok(())
    }

    /// A worker or reconciler dies wherever it is: its step never
    /// completes; a worker's lease stays until it expires.
    fn crash(&mut self, which: usize) {
        let (name, gate, task) = match which.checked_sub(self.workers.len()) {
            None => {
                let d = &mut self.workers[which];
                ("worker", &d.gate, &mut d.task)
            }
            Some(r) => {
                let d = &mut self.reconcilers[r];
                ("reconciler", &d.gate, &mut d.task)
            }
        };
        if let Some(task) = task.take() {
            task.abort();
            self.crashed.push(task);
        }
        gate.clear();
        let index = which.checked_sub(self.workers.len()).unwrap_or(which);
        self.note(format!("{name} {index} crash"));
    }

    fn fault(&mut self) {
        // One fault in three of a routing seed is routing's own (drawn from
        // its stream): a soft decline or a 429 on the next charges (whatever
        // provider name sends them), or the next connections to one
        // provider refused.
        if let Some(routing) = &mut self.routing
            && routing.rng.random_ratio(1, 3)
        {
            let next = routing.rng.random_range(1..=3u32);
            let what = match routing.rng.random_range(0..3) {
                0 => FaultAction::SoftDecline,
                1 => FaultAction::RateLimit,
                _ => {
                    let front = &routing.fronts[routing.rng.random_range(0..routing.fronts.len())];
                    front.refusals.fetch_add(next, Ordering::SeqCst);
                    let note = format!("fault next {next} connection(s) to {} refused", front.name);
                    self.note(note);
                    return;
                }
            };
            let rule = FaultRule::new(FOp::Charge, what).with_next(next);
            self.rig.provider.control().add_fault(rule);
            self.note(format!("fault next {next} Charge {what:?}"));
            return;
        }
        let operation = [
            FOp::Charge,
            FOp::Capture,
            FOp::Void,
            FOp::Refund,
            FOp::Search,
        ][self.rng.random_range(0..5)];
        let action = [
            FaultAction::DropResponseAfterEffect,
            FaultAction::FailBeforeEffect,
            FaultAction::FailAfterEffect,
            FaultAction::InProgress,
            FaultAction::SearchLag,
        ][self.rng.random_range(0..5)];
        let (operation, action) = match (operation, action) {
            // Lookups only fail: the search, or (drawn with an action of
            // an even place, so no draw moves) the consistent list, which
            // leaves nothing to prove absence with. Lag applies to what a
            // POST creates.
            (
                FOp::Search,
                FaultAction::DropResponseAfterEffect
                | FaultAction::FailAfterEffect
                | FaultAction::SearchLag,
            ) => (FOp::List, FaultAction::FailBeforeEffect),
            (FOp::Search, _) => (FOp::Search, FaultAction::FailBeforeEffect),
            (FOp::Capture | FOp::Void, FaultAction::SearchLag) => {
                (operation, FaultAction::FailBeforeEffect)
            }
            (FOp::Charge | FOp::Refund, _)
                if self.holds && self.late.random_ratio(1, HOLD_ONE_IN) =>
            {
                (operation, FaultAction::HoldEffect)
            }
            // Half the in-progress charges (of seeds that may hold, so the
            // seeds found before either replay their steps) are answered
            // `processing`: made, their outcome known only later.
            (FOp::Charge, FaultAction::InProgress) if self.holds && self.slow.random_bool(0.5) => {
                (operation, FaultAction::Processing)
            }
            pair => pair,
        };
        // A Stripe seed's own faults (drawn from its stream): the Stripe
        // dialect holds no request, so a fault that would hold one is
        // Stripe's cached 500 saying `Stripe-Should-Retry: false` (a
        // resend under the key replays it: the worker must hand the
        // attempt to the reconciler at once), and so is one in
        // `NO_RETRY_ONE_IN` of its other cached 500s (the Stripe dialect
        // saves a `fail_after_effect` 500 under the key too, without the
        // header: the worker resends and gets it again).
        let action = match action {
            FaultAction::HoldEffect if self.stripe.is_some() => FaultAction::FailAfterEffectNoRetry,
            FaultAction::FailAfterEffect
                if self
                    .stripe
                    .as_mut()
                    .is_some_and(|s| s.rng.random_ratio(1, NO_RETRY_ONE_IN)) =>
            {
                FaultAction::FailAfterEffectNoRetry
            }
            action => action,
        };
        let mut rule = FaultRule::new(operation, action).with_next(1);
        if action == FaultAction::Processing {
            rule = rule.with_lag_seconds(PROCESSING_LAG.as_secs());
        }
        if action == FaultAction::SearchLag {
            // The provider's documented lag, or (half the time, drawn from
            // the third stream) an outage's search that never catches up
            // within the run: no proof depends on the search, so neither
            // may change a verdict.
            let lag = if self.holds && self.slow.random_bool(0.5) {
                NEVER_CAUGHT_UP
            } else {
                SEARCH_LAG
            };
            rule = rule.with_lag_seconds(lag.as_secs());
        }
        self.rig.provider.control().add_fault(rule);
        self.note(format!("fault next {operation:?} {action:?}"));
    }

    async fn reconcile(&mut self, at_once: usize) -> Result<(), String> {
        // Half the runs are an operator's `cobro reconcile --older-than 0s`:
        // every unknown attempt is a candidate at once.
        let now = self.rng.random_bool(0.5);
        let scope = Scope {
            older_than: now.then_some(Duration::ZERO),
            ..Default::default()
        };
        // A routing seed's runs are each one provider's (drawn).
        let providers: Vec<Option<&'static str>> = (0..at_once)
            .map(|_| {
                self.routing
                    .as_mut()
                    .map(|r| PROVIDERS[r.rng.random_range(0..PROVIDERS.len())])
            })
            .collect();
        let runs: Vec<_> = providers
            .iter()
            .enumerate()
            .map(|(i, provider)| {
                self.reconciler_of(*provider, |c| {
                    c.actor = format!("reconciler:explorer-{i}");
                })
            })
            .collect();
        let results = futures::future::join_all(
            runs.iter()
                .map(|r| r.run(&scope, false, "explorer", &|_, _| {})),
        )
        .await;
        let mut verdicts = Vec::new();
        for result in results {
            verdicts.extend(verdicts_of(result)?);
        }
        let scope = if now { " --older-than 0s" } else { "" };
        let of = if self.routing.is_some() {
            format!(" {providers:?}")
        } else {
            String::new()
        };
        self.note(format!("reconcile x{at_once}{of}{scope} -> {verdicts:?}"));
        Ok(())
    }

    /// An operator resolves a payment in `needs_review` from the provider's
    /// truth: the charge one of its own authorizations made (read from the
    /// ledger by idempotency key), naming that attempt; with none, its
    /// latest authorization as failed. cobro may refuse (an attempt still in
    /// flight, say): that is noted, and the invariants judge the rest.
    async fn operator(&mut self) -> Result<(), String> {
        use cobro_reconciler::{ManualOutcome, ManualResolution};
        let store = &self.rig.app.db.store;
        let in_review = store
            .payments_any_account(&cobro_store::reconcile::OperatorQuery {
                statuses: Some(&[cobro_core::PaymentStatus::NeedsReview]),
                limit: 100,
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string())?;
        if in_review.is_empty() {
            return Ok(());
        }
        let payment = in_review[self.rng.random_range(0..in_review.len())].id;
        let attempts = store
            .attempts_of_payment_any_account(payment)
            .await
            .map_err(|e| e.to_string())?;
        let authorizations: Vec<_> = attempts
            .iter()
            .filter(|a| a.operation == Operation::Authorize)
            .collect();
        let ledger = self.rig.ledger();
        let mut charged = ledger
            .charges
            .iter()
            .filter(|c| c.status != "declined")
            .filter_map(|c| {
                authorizations
                    .iter()
                    .find(|a| c.idempotency_key.as_deref() == Some(a.provider_key.as_str()))
                    .map(|a| (*a, c))
            });
        let (first, second) = (charged.next(), charged.next());
        // Two charges for one payment, or two refunds for one refund (one
        // the provider made late): an operator gives one back before
        // resolving; this one leaves the payment in review.
        let mut refunds_of_intent: BTreeMap<cobro_core::IntentId, usize> = BTreeMap::new();
        for r in &ledger.refunds {
            if let Some(a) = attempts
                .iter()
                .find(|a| r.idempotency_key.as_deref() == Some(a.provider_key.as_str()))
            {
                *refunds_of_intent.entry(a.intent_id).or_default() += 1;
            }
        }
        if second.is_some() || refunds_of_intent.values().any(|n| *n > 1) {
            self.note(format!(
                "operator leaves {payment} in review: a double charge or refund"
            ));
            return Ok(());
        }
        let charged = first;
        let (attempt, outcome, provider_ref) = match charged {
            Some((a, c)) => (
                a,
                match c.status.as_str() {
                    "authorized" => ManualOutcome::Authorized,
                    "voided" => ManualOutcome::Canceled,
                    _ => ManualOutcome::Captured,
                },
                // The charge's id, or (Stripe) its PaymentIntent's.
                Some(cobro_test_support::provider_ref_of(&ledger, &c.id).to_owned()),
            ),
            None => match authorizations.last() {
                Some(a) => (*a, ManualOutcome::Failed, None),
                None => return Ok(()),
            },
        };
        // One operator in four gets it wrong (drawn from the third stream,
        // so the other draws stay as they were): "no money moved" for a
        // charge the ledger holds, or a charge that is not the attempt's
        // for one it does not. The check at the provider must refuse it.
        let mistaken = self.slow.random_ratio(1, 4);
        let (outcome, provider_ref) = match (mistaken, charged) {
            (false, _) => (outcome, provider_ref),
            (true, Some(_)) => (ManualOutcome::Failed, None),
            (true, None) => (
                ManualOutcome::Captured,
                Some(format!(
                    "{}not_this_attempts",
                    self.rig.dialect.charge_prefix()
                )),
            ),
        };
        let mut resolution = ManualResolution {
            payment,
            attempt: attempt.id,
            outcome,
            provider_ref,
            operator: "explorer".into(),
            reason: "the provider's ledger says so".into(),
            invoked_by: "explorer@test".into(),
            verified: None,
        };
        // Checked at the provider the attempt went to (in a seed that does
        // not route, the rig's reconciler of every attempt).
        let at = self
            .routing
            .as_ref()
            .and(attempt.provider.as_deref())
            .and_then(|p| PROVIDERS.iter().copied().find(|known| *known == p));
        let checker = self.reconciler_of(at, |_| {});
        let result = match checker.check_verdict(&resolution).await {
            Ok(showed) => {
                resolution.verified = Some(showed);
                cobro_reconciler::resolve_by_hand(store, &resolution, self.rig.app.clock.now())
                    .await
            }
            Err(refused) => Err(refused),
        };
        let said = match &result {
            Ok(after) => after.clone(),
            Err(e) => format!("refused: {e}"),
        };
        self.note(format!(
            "operator resolves {payment} as {outcome:?}{} -> {said}",
            if mistaken { " (mistaken)" } else { "" }
        ));
        if mistaken && result.is_ok() {
            return Err(format!(
                "an operator's mistaken verdict on {payment} passed the check at the provider"
            ));
        }
        Ok(())
    }

    /// Delivers the current state of one of the provider's charges as a
    /// signed webhook event.
    async fn webhook(&mut self) -> Result<(), String> {
        let charges = self.rig.ledger().charges;
        if charges.is_empty() {
            return Ok(());
        }
        let mut id = charges[self.rng.random_range(0..charges.len())].id.clone();
        // One event in three is a refund's, when there are refunds (drawn
        // from the second stream; see `late`).
        let refunds = self.rig.ledger().refunds;
        if self.holds && !refunds.is_empty() && self.late.random_ratio(1, 3) {
            id = refunds[self.late.random_range(0..refunds.len())].id.clone();
        }
        self.deliver_charge(&id).await
    }

    /// Delivers the current state of charge or refund `id` (`ch_...`,
    /// `re_...`) as a signed event: `charge.<status>`, `refund.<status>`.
    async fn deliver_charge(&mut self, id: &str) -> Result<(), String> {
        if self.stripe.is_some() {
            return self.deliver_stripe(id).await;
        }
        let kind = if id.starts_with("re_") {
            "refund"
        } else {
            "charge"
        };
        let object: Value = self
            .rig
            .app
            .client
            .get(format!("{}/v1/{kind}s/{id}", self.rig.provider.url()))
            .bearer_auth("sk_test_cobro")
            .send()
            .await
            .map_err(|e| format!("GET {kind}: {e}"))?
            .json()
            .await
            .map_err(|e| format!("{kind} json: {e}"))?;
        let sequence = object["sequence"].as_i64().unwrap_or(1);
        let status = object["status"].as_str().unwrap_or("authorized").to_owned();
        let event = json!({"id": format!("evt_{id}_{sequence}"), "type": format!("{kind}.{status}"),
            "created": "2026-12-01T00:00:00Z", "sequence": sequence, "data": object});
        let body = serde_json::to_vec(&event).map_err(|e| e.to_string())?;
        // To the route of the provider whose name the object was made
        // through; in a routing seed one in four goes to the other's route
        // first, which must keep it unmatched (the event is signed by the
        // provider it is about, and proves nothing about another's).
        let route = self.route_of_effect(id);
        if let (Some(routing), Some(to)) = (&mut self.routing, route)
            && routing.rng.random_ratio(1, 4)
        {
            routing.misdelivered += 1;
            let wrong = PROVIDERS.iter().copied().find(|p| *p != to);
            self.deliver_at(wrong.expect("two providers"), body.clone(), true)
                .await?;
        }
        let route = route.unwrap_or(PRIMARY);
        self.events.push((route, body.clone()));
        self.deliver(route, body).await
    }

    /// A Stripe seed notes when each charge and refund of `ledger` was
    /// first seen in its current state: cobro's clock now, which is when
    /// the state was reached (the ledger is read after every step and
    /// before every clock move, and nothing at the provider changes
    /// between steps). That is its Stripe event's `created`, from which
    /// cobro derives the event's sequence: a state's event is as old as
    /// the state, however late it is delivered.
    fn observe(&mut self, ledger: &fake_provider::Ledger) {
        let now = self.rig.app.clock.now().timestamp();
        let Some(stripe) = &mut self.stripe else {
            return;
        };
        let charges = ledger.charges.iter().map(|c| (&c.id, &c.status));
        let refunds = ledger.refunds.iter().map(|r| (&r.id, &r.status));
        for (id, status) in charges.chain(refunds) {
            let states = stripe.seen.entry(id.clone()).or_default();
            if !states.contains_key(status) {
                states.insert(status.clone(), now);
            }
        }
    }

    /// A Stripe seed's event about charge or refund `id` (`ch_...`,
    /// `re_...`): the event Stripe sends for the state its PaymentIntent
    /// (`payment_intent.amount_capturable_updated`, `.succeeded`,
    /// `.canceled`, `.payment_failed`, `.processing`) or refund
    /// (`refund.created`, `refund.failed`, `refund.updated`) is in now, as
    /// the Stripe dialect renders the object, signed with
    /// `Stripe-Signature` and delivered at `/v1/webhooks/stripe`. One event
    /// per state: built the first time that state is delivered, `created`
    /// when the state was reached (`observe`), the same event every later
    /// time.
    async fn deliver_stripe(&mut self, id: &str) -> Result<(), String> {
        let ledger = self.rig.ledger();
        self.observe(&ledger);
        // When the charge (or refund) reached the state it is in now.
        let charges = ledger.charges.iter().map(|c| (&c.id, &c.status));
        let refunds = ledger.refunds.iter().map(|r| (&r.id, &r.status));
        let reached = charges
            .chain(refunds)
            .find(|(made, _)| made.as_str() == id)
            .and_then(|(made, status)| self.stripe.as_ref()?.seen.get(made)?.get(status))
            .copied();
        let refund = id.starts_with("re_");
        let path = if refund {
            format!("/v1/refunds/{id}")
        } else {
            format!(
                "/v1/payment_intents/{}",
                cobro_test_support::provider_ref_of(&ledger, id)
            )
        };
        let response = self
            .rig
            .app
            .client
            .get(format!("{}{path}", self.rig.provider.url()))
            .bearer_auth(RIG_SECRET_KEY)
            .header("stripe-version", fake_provider::STRIPE_API_VERSION)
            .send()
            .await
            .map_err(|e| format!("GET {path}: {e}"))?;
        let found = response.status().is_success();
        let object: Value = response
            .json()
            .await
            .map_err(|e| format!("{path} json: {e}"))?;
        let status = object["status"].as_str().unwrap_or_default().to_owned();
        let kind = match (refund, status.as_str()) {
            _ if !found => None,
            (false, "requires_capture") => Some("payment_intent.amount_capturable_updated"),
            (false, "succeeded") => Some("payment_intent.succeeded"),
            (false, "canceled") => Some("payment_intent.canceled"),
            (false, "requires_payment_method") => Some("payment_intent.payment_failed"),
            (false, "processing") => Some("payment_intent.processing"),
            (false, _) => None,
            (true, "succeeded" | "pending") => Some("refund.created"),
            (true, "failed") => Some("refund.failed"),
            (true, _) => Some("refund.updated"),
        };
        let Some(kind) = kind else {
            self.note(format!("webhook: no Stripe event for {path} ({status:?})"));
            return Ok(());
        };
        let object_id = object["id"].as_str().unwrap_or(id).to_owned();
        let event_id = format!("evt_{object_id}_{status}");
        let created = reached.unwrap_or_else(|| self.rig.app.clock.now().timestamp());
        let body = match self.stripe.as_ref().and_then(|s| s.events.get(&event_id)) {
            Some(body) => body.clone(),
            None => serde_json::to_vec(&json!({
                "id": event_id, "object": "event",
                "api_version": fake_provider::STRIPE_API_VERSION, "created": created,
                "data": {"object": object}, "livemode": false, "pending_webhooks": 1,
                "request": {"id": null, "idempotency_key": null}, "type": kind,
            }))
            .map_err(|e| e.to_string())?,
        };
        if let Some(stripe) = &mut self.stripe {
            stripe
                .events
                .entry(event_id)
                .or_insert_with(|| body.clone());
        }
        self.events.push((PRIMARY, body.clone()));
        self.deliver(PRIMARY, body).await
    }

    /// The provider whose name the charge or refund `id` was made through
    /// (its idempotency key's send): in a seed that does not route, the
    /// primary; `None` when no one name sent it.
    fn route_of_effect(&self, id: &str) -> Option<&'static str> {
        if self.routing.is_none() {
            return Some(PRIMARY);
        }
        let ledger = self.rig.ledger();
        let charges = ledger.charges.iter().map(|c| (&c.id, &c.idempotency_key));
        let refunds = ledger.refunds.iter().map(|r| (&r.id, &r.idempotency_key));
        let key = charges
            .chain(refunds)
            .find(|(made, _)| *made == id)
            .and_then(|(_, key)| key.clone())?;
        let sent = self
            .sent_through
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match sent.get(&key).map(|names| names.iter().collect::<Vec<_>>()) {
            Some(names) if names.len() == 1 => Some(names[0]),
            _ => None,
        }
    }

    /// The provider makes every charge and refund it held (a `hold_effect`
    /// fault), as if each request had just come through its queue: under
    /// the key and reference cobro sent, whatever cobro has decided about
    /// that attempt since. With `deliver`, each late effect's event follows
    /// at once.
    async fn release_held(&mut self, deliver: bool) -> Result<(), String> {
        let control = self.rig.provider.control();
        let before: BTreeSet<String> = self.effect_ids().into_iter().collect();
        let released = control.release_held();
        let mut made = self.effect_ids();
        made.retain(|id| !before.contains(id));
        self.note(format!(
            "provider releases {released} held request(s): made {made:?}"
        ));
        self.late_effects.extend(made.iter().cloned());
        if deliver {
            for id in &made {
                self.deliver_charge(id).await?;
            }
        }
        Ok(())
    }

    /// The merchant's dashboard (or another system with the same API key)
    /// captures or voids an authorized charge behind cobro's back. cobro is
    /// not told: its payment stays `authorized` until it acts on the charge,
    /// when the provider's refusal carries the charge's truth (a void
    /// refused because the charge was captured ends `captured`;
    /// docs/evidence.md §7.5). The call goes to the provider's own API, so a fault
    /// armed for the next capture or void may fire on it instead of on
    /// cobro's call; whatever it answers, the ledger says what happened.
    async fn dashboard(&mut self) -> Result<(), String> {
        let authorized: Vec<String> = self
            .rig
            .ledger()
            .charges
            .into_iter()
            .filter(|c| c.status == "authorized")
            .map(|c| c.id)
            .collect();
        if authorized.is_empty() {
            return Ok(());
        }
        let id = authorized[self.rng.random_range(0..authorized.len())].clone();
        let verb = if self.rng.random_bool(0.5) {
            "capture"
        } else {
            "void"
        };
        let key = format!("dashboard-{}", self.key());
        // In a Stripe seed, the dashboard acts on the charge's
        // PaymentIntent, through Stripe's API (a void is its cancel).
        let (path, stripe_version) = match self.rig.dialect {
            Dialect::Fake => (format!("/v1/charges/{id}/{verb}"), None),
            Dialect::Stripe => {
                let intent =
                    cobro_test_support::provider_ref_of(&self.rig.ledger(), &id).to_owned();
                let verb = if verb == "void" { "cancel" } else { verb };
                (
                    format!("/v1/payment_intents/{intent}/{verb}"),
                    Some(fake_provider::STRIPE_API_VERSION),
                )
            }
        };
        let mut request = self
            .rig
            .app
            .client
            .post(format!("{}{path}", self.rig.provider.url()))
            .bearer_auth(RIG_SECRET_KEY)
            .header("idempotency-key", key);
        if let Some(version) = stripe_version {
            request = request.header("stripe-version", version);
        }
        let answer = request
            .send()
            .await
            .map(|r| r.status().as_u16().to_string())
            .unwrap_or_else(|e| format!("no answer ({e})"));
        let what = match stripe_version {
            Some(_) => format!("{path} ({id})"),
            None => id.clone(),
        };
        self.note(format!("dashboard {verb} {what}: {answer}"));
        let before = self.answered_before_dashboard(&id).await?;
        self.dashboard.entry(id).or_default().extend(before);
        Ok(())
    }

    /// The captures and voids of the payment holding `charge` (its
    /// authorisation's provider key is the charge's idempotency key) that
    /// the provider has already answered ([`answered_on_charge`]).
    async fn answered_before_dashboard(
        &self,
        charge: &str,
    ) -> Result<Vec<cobro_core::AttemptId>, String> {
        let Some(key) = self
            .rig
            .ledger()
            .charges
            .into_iter()
            .find(|c| c.id == charge)
            .and_then(|c| c.idempotency_key)
        else {
            return Ok(Vec::new());
        };
        let store = &self.rig.app.db.store;
        for (_, id) in &self.payments {
            let pid: PaymentId = id.parse().map_err(|_| "payment id".to_owned())?;
            let attempts = store
                .attempts_of_payment_any_account(pid)
                .await
                .map_err(|e| e.to_string())?;
            if attempts.iter().any(|a| a.provider_key == key) {
                return Ok(attempts
                    .iter()
                    .filter(|a| answered_on_charge(a))
                    .map(|a| a.id)
                    .collect());
            }
        }
        Ok(Vec::new())
    }

    /// Delivers an event delivered before again: a duplicate, or (when the
    /// charge moved since) a late, out-of-order one.
    async fn late_webhook(&mut self) -> Result<(), String> {
        if self.events.is_empty() {
            return Ok(());
        }
        let (route, body) = self.events[self.rng.random_range(0..self.events.len())].clone();
        self.deliver(route, body).await
    }

    async fn deliver(&mut self, route: &'static str, body: Vec<u8>) -> Result<(), String> {
        self.deliver_at(route, body, false).await
    }

    /// Posts `body` to provider `route`'s webhook route, signed as the fake
    /// provider signs; `wrong`: the event is about an attempt sent to the
    /// other provider, and must be kept unmatched (or be a duplicate of
    /// such a delivery), never applied.
    async fn deliver_at(
        &mut self,
        route: &'static str,
        body: Vec<u8>,
        wrong: bool,
    ) -> Result<(), String> {
        // Signed at cobro's clock now, as a provider signs each delivery
        // (a late one too); a seed that does not route has one route, its
        // dialect's (`fake`, or `stripe` with `Stripe-Signature`).
        let (path, header) = match (self.routing.is_some(), self.rig.dialect) {
            (true, _) | (false, Dialect::Fake) => (route, fake_provider::SIGNATURE_HEADER),
            (false, Dialect::Stripe) => (
                Dialect::Stripe.webhook_provider(),
                fake_provider::STRIPE_SIGNATURE_HEADER,
            ),
        };
        let t = self.rig.app.clock.now().timestamp();
        let response = self
            .rig
            .app
            .client
            .post(format!("{}/v1/webhooks/{path}", self.rig.app.url))
            .header("content-type", "application/json")
            .header(header, fake_provider::sign(SECRET, t, &body))
            .body(body.clone())
            .send()
            .await
            .map_err(|e| format!("webhook: {e}"))?;
        let status = response.status().as_u16();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        let event: Value = serde_json::from_slice(&body).unwrap_or_default();
        if status != 200 && status != 503 {
            return Err(format!("webhook answered {status}: {answer}"));
        }
        let at = if self.routing.is_some() {
            format!(
                " at {route}{}",
                if wrong { " (the wrong route)" } else { "" }
            )
        } else {
            String::new()
        };
        // The fake's events carry a sequence; Stripe's their id.
        let which = match &event["sequence"] {
            Value::Null => &event["id"],
            sequence => sequence,
        };
        self.note(format!(
            "webhook {} {which}{at} -> {status} {}",
            event["type"], answer["outcome"]
        ));
        let kept = matches!(
            answer["outcome"].as_str(),
            Some("unmatched" | "duplicate_delivery")
        );
        if wrong && status == 200 && !kept {
            return Err(format!(
                "event {} ({}) about an attempt sent to the other provider was delivered at {route}'s route and answered {answer}: it must be kept unmatched",
                event["id"], event["type"]
            ));
        }
        Ok(())
    }

    /// Faults cleared, parked calls released, workers and reconcilers run,
    /// clocks moved past leases and search lag, until nothing is left.
    async fn quiesce(&mut self) -> Result<(), String> {
        self.note("quiesce".into());
        self.rig.provider.control().clear_faults();
        for front in self.routing.iter().flat_map(|r| &r.fronts) {
            front.refusals.store(0, Ordering::SeqCst);
        }
        for driven in &mut self.workers {
            driven.gate.open();
            if let Some(task) = driven.task.take() {
                task.await
                    .map_err(|e| format!("worker task failed: {e}"))??;
            }
        }
        for driven in &mut self.reconcilers {
            driven.gate.open();
            if let Some(task) = driven.task.take() {
                task.await
                    .map_err(|e| format!("reconciler task failed: {e}"))??;
            }
        }
        // What the provider still holds comes through once cobro has
        // settled everything it can without it (a short-window seed decides
        // "no effect" and charges again meanwhile); the late charges'
        // events are delivered after that, so that each lands after
        // whatever cobro decided.
        self.settle_all().await?;
        // A 500 the Stripe dialect saved under a key without
        // `Stripe-Should-Retry` replays on every resend (`replayed: true`),
        // so its worker retries until the attempt's key window closes and
        // then hands it over (seed 902): in a Stripe seed with anything
        // still due, the clocks pass that window, and everything settles
        // again.
        if self.stripe.is_some()
            && self
                .rig
                .app
                .db
                .count("outbox WHERE state = 'pending'")
                .await
                > 0
        {
            let by = self.send_window + Duration::from_secs(61);
            self.note(format!("clock +{by:?} (past the key window)"));
            self.advance(by).await?;
            self.settle_all().await?;
        }
        if self.rig.provider.control().held() > 0 {
            self.release_held(false).await?;
            self.settle_all().await?;
        }
        if self.late_effects.is_empty() {
            return Ok(());
        }
        // Every other charge's and refund's event first, as the provider
        // sends them: the adopted charge's raises its payment's sequence,
        // so a late charge's event (sequence 1 of its own charge) comes in
        // behind it and must still be taken as evidence, not as stale.
        let (late, others): (Vec<String>, Vec<String>) = self
            .effect_ids()
            .into_iter()
            .partition(|id| self.late_effects.contains(id));
        for id in others.iter().chain(&late) {
            self.deliver_charge(id).await?;
        }
        self.settle_all().await
    }

    /// Workers and reconcilers run, clocks moved past leases and search
    /// lag, until nothing is left.
    async fn settle_all(&mut self) -> Result<(), String> {
        let mut last = String::new();
        for round in 0..12 {
            self.advance(Duration::from_secs(61)).await?;
            for driven in &self.workers {
                loop {
                    let told = driven.gate.told_not_to_retry.load(Ordering::SeqCst);
                    match driven.actor.run_once().await {
                        Ok(steps) if steps.is_empty() => break,
                        Ok(steps) => handed_over_when_told(
                            driven.gate.told_not_to_retry.load(Ordering::SeqCst) - told,
                            &steps,
                        )?,
                        // A busy write lock: the row stays due, try again.
                        Err(e) if e.to_string().contains("timed out waiting for a lock") => {}
                        Err(e) => return Err(format!("worker: {e}")),
                    }
                }
            }
            // One run of every provider's reconciler (of the rig's, which
            // sees every attempt, in a seed that does not route).
            let providers: Vec<Option<&'static str>> = match self.routing {
                Some(_) => PROVIDERS.iter().copied().map(Some).collect(),
                None => vec![None],
            };
            let (mut examined, mut busy) = (0, false);
            self.last_verdicts.clear();
            for provider in providers {
                let run = self
                    .reconciler_of(provider, |_| {})
                    .run(
                        &Scope {
                            older_than: Some(Duration::ZERO),
                            ..Default::default()
                        },
                        false,
                        "explorer",
                        &|_, _| {},
                    )
                    .await;
                match run {
                    Ok(summary) => {
                        examined += summary.examined;
                        self.last_verdicts.extend(
                            summary
                                .items
                                .iter()
                                .map(|i| (i.attempt_id.clone(), format!("{:?}", i.verdict))),
                        );
                    }
                    Err(e) if e.to_string().contains("timed out waiting for a lock") => busy = true,
                    Err(e) => return Err(format!("reconcile: {e}")),
                }
            }
            if busy {
                last = format!("round {round}: a reconciler found the database busy");
                continue;
            }
            let pending = self
                .rig
                .app
                .db
                .count("outbox WHERE state = 'pending'")
                .await;
            // Payments still waiting on an outcome when nothing is left to
            // run: said in the trace (the judge decides whether that is
            // right: a held request's payment waits for its release).
            let waiting = self
                .rig
                .app
                .db
                .count(
                    "payments WHERE status IN \
                     ('processing', 'requires_reconciliation', 'capturing', 'canceling')",
                )
                .await;
            if examined == 0 && pending == 0 {
                if waiting > 0 {
                    self.note(format!(
                        "quiet in round {round} with {waiting} payments waiting on an outcome"
                    ));
                }
                return Ok(());
            }
            last = format!(
                "round {round}: {examined} examined, {pending} outbox rows pending, \
                 {waiting} payments waiting on an outcome"
            );
        }
        // Not quiet: the judge says what is left; this says how the last
        // round ended, for its report.
        self.note(format!("not quiet after 12 rounds ({last})"));
        Ok(())
    }

    /// The invariants that hold after every step. The judge reads the
    /// provider's ledger by the idempotency key each charge was made under,
    /// never by what cobro sent as metadata: a charge belongs to the attempt
    /// whose provider key made it.
    async fn check(&mut self) -> Result<(), String> {
        let ledger = self.rig.ledger();
        self.observe(&ledger);
        let store = &self.rig.app.db.store;
        // Every payment and its attempts: one read of the payments, one of
        // each payment's attempts (at once).
        let rows = self.all_payments().await?;
        let payments: BTreeMap<String, cobro_store::PaymentRow> =
            rows.into_iter().map(|p| (p.id.to_string(), p)).collect();
        let attempts_of: BTreeMap<String, Vec<cobro_store::AttemptRow>> =
            futures::future::try_join_all(payments.values().map(|p| async move {
                store
                    .attempts_of_payment_any_account(p.id)
                    .await
                    .map(|attempts| (p.id.to_string(), attempts))
            }))
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .collect();
        // Every attempt's provider key -> (payment, intent).
        let mut owner_of_key: BTreeMap<String, (String, String)> = BTreeMap::new();
        for (id, attempts) in &attempts_of {
            for a in attempts {
                owner_of_key.insert(
                    a.provider_key.clone(),
                    (id.clone(), a.intent_id.to_string()),
                );
            }
        }
        let gates = self.workers.iter().map(|d| &d.gate);
        let doubled: Vec<_> = gates
            .chain(self.reconcilers.iter().map(|d| &d.gate))
            .flat_map(|g| g.doubled())
            .collect();
        if !doubled.is_empty() {
            let calls: Vec<Vec<String>> = attempts_of
                .values()
                .flatten()
                .filter(|a| {
                    doubled
                        .iter()
                        .any(|(x, y)| x.ends_with(&a.provider_key) || y.ends_with(&a.provider_key))
                })
                .map(|a| {
                    vec![
                        a.provider_key.clone(),
                        format!("{:?}", a.operation),
                        format!("{:?}", a.state),
                        a.payment_id.to_string(),
                        a.send_count.to_string(),
                    ]
                })
                .collect();
            return Err(format!(
                "a worker of batch 1 had two calls in flight (a claim took more rows than its limit, or a harness defect): {doubled:?}; {calls:?}"
            ));
        }
        // Every effect counts, one the provider made late (a held request
        // released) too, and one intent (a payment's authorisation, a
        // refund) has at most one.
        let charges = ledger
            .charges
            .iter()
            .filter(|c| c.status != "declined")
            .map(|c| (&c.id, &c.idempotency_key, &c.reference));
        let refunds = ledger
            .refunds
            .iter()
            .map(|r| (&r.id, &r.idempotency_key, &r.reference));
        for (what, effects) in [
            ("charged", per_intent(charges, &owner_of_key)?),
            ("refunded", per_intent(refunds, &owner_of_key)?),
        ] {
            if let Some((intent, ids)) = effects.iter().find(|(_, ids)| ids.len() > 1) {
                return Err(format!("intent {intent} was {what} twice: {ids:?}"));
            }
        }
        for (_, id) in &self.payments {
            let Some(p) = payments.get(id) else {
                return Err(format!("payment {id} vanished"));
            };
            if let Some(charge) = p.provider_ref.as_deref() {
                let Some(c) = charge_of(&ledger, charge) else {
                    // Read again: made after the first read means a call
                    // moved while the judge read (see `Gate::park`).
                    let later = charge_of(&self.rig.ledger(), charge).is_some();
                    return Err(format!(
                        "payment {id} names {charge}, which the provider never made \
                         (in a second read of the ledger: {later})"
                    ));
                };
                let made_by = c.idempotency_key.as_ref().and_then(|k| owner_of_key.get(k));
                if made_by.map(|(payment, _)| payment.as_str()) != Some(id.as_str()) {
                    return Err(format!(
                        "payment {id} is bound to {charge}, made by {:?}",
                        made_by.map(|(payment, _)| payment)
                    ));
                }
            }
            if matches!(
                p.status.as_str(),
                "requires_reconciliation" | "needs_review"
            ) {
                let attempts = attempts_of.get(id).map(Vec::as_slice).unwrap_or_default();
                if let Some(a) = attempts.iter().find(|a| {
                    a.last_send_at.is_some_and(|t| {
                        t.0 > p.status_changed_at.0 && a.state.as_str() == "pending"
                    })
                }) {
                    return Err(format!(
                        "attempt {} of payment {id} was sent while it was {}",
                        a.id, p.status
                    ));
                }
            }
            let refunded: i64 = ledger
                .refunds
                .iter()
                .filter(|r| {
                    r.idempotency_key
                        .as_ref()
                        .and_then(|k| owner_of_key.get(k))
                        .is_some_and(|(payment, _)| payment == id)
                })
                .map(|r| r.amount)
                .sum();
            if refunded > p.amount {
                return Err(format!(
                    "payment {id} of {} had {refunded} refunded at the provider",
                    p.amount
                ));
            }
        }
        if self.routing.is_some() {
            let sent = self
                .sent_through
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for (id, p) in &payments {
                let attempts = attempts_of.get(id).map(Vec::as_slice).unwrap_or_default();
                check_route(p, attempts, &sent, &ledger)
                    .map_err(|e| format!("payment {id}: {e}"))?;
            }
        }
        Ok(())
    }

    /// Once quiet: every payment equals its own charge.
    async fn check_quiet(&mut self) -> Result<(), String> {
        let ledger = self.rig.ledger();
        let store = &self.rig.app.db.store;
        let all = self.all_payments().await?;
        let failed = |status: &str| matches!(status, "declined" | "failed" | "canceled");
        for (_, id) in &self.payments {
            let pid: PaymentId = id.parse().map_err(|_| "payment id".to_owned())?;
            let p = store
                .payment_any_account(pid)
                .await
                .map_err(|e| e.to_string())?
                .ok_or("payment vanished")?;
            let attempts = store
                .attempts_of_payment_any_account(pid)
                .await
                .map_err(|e| e.to_string())?;
            // Whether cobro acted on the charge itself (a capture or void the
            // provider answered) after any dashboard move on it: then it
            // must know the charge's truth. An answer from before the move
            // cannot tell of it, nor can a void or capture ended without an
            // answer (proven to have had no effect, or a held cancel ended
            // unsent): seed 72815 proved a void without effect, had the
            // operator confirm `authorized`, then a dashboard captured.
            let answered_before = p
                .provider_ref
                .as_deref()
                .and_then(|r| charge_of(&ledger, r))
                .and_then(|charge| self.dashboard.get(&charge.id));
            let acted_on_charge = attempts.iter().any(|a| {
                answered_on_charge(a)
                    && answered_before.is_none_or(|before| !before.contains(&a.id))
            });
            let conflicts = store
                .conflicts_of_payment_any_account(pid)
                .await
                .map_err(|e| e.to_string())?;
            // "No effect" is decided only from a consistent read once no
            // request under the key can still act, and this provider keeps
            // its contract (a held request acts inside the key retention or
            // never): an authorisation or refund recorded without money and
            // then shown to have made some was decided wrong, even though
            // the conflict stopped the line, a late effect included (seeds
            // 402680, 403916: a list that stopped at the send's window). A
            // capture or void recorded refused may be contradicted by a
            // dashboard's move, which is not cobro's to see.
            for c in conflicts
                .iter()
                .filter(|c| c.kind == cobro_store::conflicts::ConflictKind::EffectAfterNoEffect)
            {
                let wrong = attempts.iter().any(|a| {
                    Some(a.id) == c.attempt_id
                        && matches!(a.operation, Operation::Authorize | Operation::Refund)
                });
                if wrong {
                    return Err(format!(
                        "payment {id}: a decision without money was wrong: {}",
                        c.detail
                    ));
                }
            }
            // A terminal failure whose order ref another payment of its
            // account now holds cannot go back to `needs_review` (one active
            // payment per order ref): evidence against it is kept as a
            // conflict row, which is what the operator sees
            // (`flag_for_review`). Seed 41099: the operator resolved a
            // payment `failed` while its charge was held, the merchant paid
            // the order again, then the held charge came through.
            let order_taken = all.iter().any(|o| {
                o.id != p.id
                    && o.account_id == p.account_id
                    && o.order_ref == p.order_ref
                    && !failed(o.status.as_str())
            });
            let open_conflict = conflicts.iter().any(|c| c.resolved_at.is_none());
            if failed(p.status.as_str()) && order_taken && open_conflict {
                continue;
            }
            let keys: Vec<String> = attempts.into_iter().map(|a| a.provider_key).collect();
            let mine: Vec<_> = ledger
                .charges
                .iter()
                .filter(|c| c.status != "declined")
                .filter(|c| c.idempotency_key.as_ref().is_some_and(|k| keys.contains(k)))
                .collect();
            let flagged = conflicts.len()
                + store
                    .decisions_of_payment_any_account(pid)
                    .await
                    .map_err(|e| e.to_string())?
                    .iter()
                    .filter(|d| d.decision.as_str() == "escalate")
                    .count();
            let expected_charge = match p.status.as_str() {
                "needs_review" if flagged > 0 => continue,
                "needs_review" => {
                    return Err(format!("payment {id} in needs_review with no reason kept"));
                }
                "processing" | "requires_reconciliation" | "capturing" | "canceling" => {
                    let state = self.stuck_state(pid, &ledger).await;
                    return Err(format!(
                        "payment {id} still {} once quiet\n{state}",
                        p.status
                    ));
                }
                "declined" | "failed" => {
                    if !mine.is_empty() {
                        return Err(format!(
                            "payment {id} is {} but the provider holds {:?}",
                            p.status,
                            mine.iter().map(|c| (&c.id, &c.status)).collect::<Vec<_>>()
                        ));
                    }
                    continue;
                }
                "authorized" => "authorized",
                "canceled" => "voided",
                _ => "captured",
            };
            let [charge] = mine.as_slice() else {
                return Err(format!(
                    "payment {id} is {} with {} charges of its own",
                    p.status,
                    mine.len()
                ));
            };
            let charge_ref = cobro_test_support::provider_ref_of(&ledger, &charge.id);
            if p.provider_ref.as_deref() != Some(charge_ref) {
                return Err(format!(
                    "payment {id} names {:?}, its charge is {charge_ref} ({})",
                    p.provider_ref, charge.id
                ));
            }
            // A dashboard's capture or void is not cobro's to know until
            // cobro settles a capture or void of its own on that charge:
            // `authorized` stays right until then.
            let unknown_to_cobro = p.status.as_str() == "authorized"
                && !acted_on_charge
                && self.dashboard.contains_key(&charge.id);
            let expected_charge = if unknown_to_cobro {
                charge.status.as_str()
            } else {
                expected_charge
            };
            if charge.status != expected_charge || charge.amount != p.amount {
                return Err(format!(
                    "payment {id} is {} of {}, its charge {} is {} of {}",
                    p.status, p.amount, charge.id, charge.status, charge.amount
                ));
            }
            if charge.amount_refunded != p.amount_refunded {
                return Err(format!(
                    "payment {id} has {} refunded, its charge {}",
                    p.amount_refunded, charge.amount_refunded
                ));
            }
            let refunds = store
                .refunds_of_payment_any_account(pid)
                .await
                .map_err(|e| e.to_string())?;
            let by_status: BTreeMap<&str, usize> =
                refunds.iter().fold(BTreeMap::new(), |mut m, r| {
                    *m.entry(r.status.as_str()).or_default() += 1;
                    m
                });
            for r in &refunds {
                if matches!(r.status.as_str(), "processing" | "requires_reconciliation") {
                    return Err(format!(
                        "refund {} still {} once quiet ({by_status:?})",
                        r.id, r.status
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Explorer {
    /// A whole-run reconciler with the explorer's model of time, adjusted
    /// by `tweak`: provider `provider`'s (its scope, through a connector
    /// of its name), or with `None` the rig's, which examines every attempt.
    fn reconciler_of(
        &self,
        provider: Option<&'static str>,
        tweak: impl FnOnce(&mut ReconcilerConfig),
    ) -> Reconciler<Connector> {
        let mut config = self.model.clone();
        tweak(&mut config);
        let Some(name) = provider else {
            return self.rig.reconciler(|c| *c = config);
        };
        config.provider = Some(scope(name));
        let mut client =
            cobro_provider::HttpProviderConfig::new(&self.rig.client.base_url, RIG_SECRET_KEY);
        client.request_timeout = self.rig.client.request_timeout;
        client.name = name.to_owned();
        let connector: Connector = cobro_provider::HttpProvider::new(client)
            .expect("client")
            .into();
        Reconciler::new(
            self.rig.app.db.store.clone(),
            Arc::new(connector),
            Arc::new(self.rig.app.clock.clone()),
            config,
        )
    }

    /// ` (provider)` in a routing seed's trace; nothing otherwise.
    fn of_provider(&self, provider: &str) -> String {
        if self.routing.is_some() {
            format!(" ({provider})")
        } else {
            String::new()
        }
    }

    /// What a Stripe seed reached (`None` in the other seeds): its
    /// Stripe-only faults that fired, and the authorisations Stripe
    /// canceled on its own.
    fn stripe_reached(&self) -> Option<StripeReached> {
        let stripe = self.stripe.as_ref()?;
        let fired = self.rig.provider.control().faults_fired();
        let count = |action: FaultAction| {
            fired
                .iter()
                .filter(|f| f.action == action)
                .map(|f| f.count)
                .sum()
        };
        Some(StripeReached {
            no_retry: count(FaultAction::FailAfterEffectNoRetry),
            processing: count(FaultAction::Processing),
            expired: stripe.expired,
        })
    }

    /// What a routing seed reached once quiet (`None` in the other seeds):
    /// its payments' moves by proof, whether a circuit opened.
    async fn routing_reached(&self) -> Result<Option<RoutingReached>, String> {
        let Some(routing) = &self.routing else {
            return Ok(None);
        };
        let mut moves = [0; 4];
        for p in self.all_payments().await? {
            let route = p.route.as_deref().and_then(Route::from_json);
            for m in route.iter().flat_map(|r| &r.moves) {
                let kind = m.proof.split_once(':').map_or(m.proof.as_str(), |(k, _)| k);
                if let Some(i) = PROOFS.iter().position(|p| *p == kind) {
                    moves[i] += 1;
                }
            }
        }
        let circuits = self
            .rig
            .app
            .db
            .store
            .circuits()
            .await
            .map_err(|e| e.to_string())?;
        Ok(Some(RoutingReached {
            moves,
            circuit_opened: circuits.iter().any(|c| c.opened_at.is_some()),
            misdelivered: routing.misdelivered,
        }))
    }

    /// Every payment of every account, as the store has it now.
    async fn all_payments(&self) -> Result<Vec<cobro_store::PaymentRow>, String> {
        self.rig
            .app
            .db
            .store
            .payments_any_account(&cobro_store::reconcile::OperatorQuery {
                limit: 10_000,
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string())
    }

    /// The ids of the provider's charges, then of its refunds, each in the
    /// order it made them.
    fn effect_ids(&self) -> Vec<String> {
        let ledger = self.rig.ledger();
        let charges = ledger.charges.into_iter().map(|c| c.id);
        charges
            .chain(ledger.refunds.into_iter().map(|r| r.id))
            .collect()
    }

    /// Whether the provider made a late charge or refund (a held request
    /// released) under this provider key.
    /// What a payment left unsettled holds, for the failure's report: its
    /// attempts (state, sends, last error, outbox row), what the provider's
    /// ledger holds under each attempt's key, and its last decisions.
    async fn stuck_state(&self, pid: PaymentId, ledger: &fake_provider::Ledger) -> String {
        let store = &self.rig.app.db.store;
        let mut lines = Vec::new();
        let attempts = store
            .attempts_of_payment_any_account(pid)
            .await
            .unwrap_or_default();
        for a in &attempts {
            let outbox: String = self
                .rig
                .app
                .db
                .scalar(&format!(
                    "SELECT COALESCE(MAX(state || ' due ' || CAST(due_at AS TEXT)), 'none') \
                     FROM outbox WHERE attempt_id = '{}'",
                    a.id
                ))
                .await;
            let at_provider: Vec<(&str, &str)> = ledger
                .charges
                .iter()
                .filter(|c| c.idempotency_key.as_deref() == Some(a.provider_key.as_str()))
                .map(|c| (c.id.as_str(), c.status.as_str()))
                .collect();
            lines.push(format!(
                "  attempt {} {:?} {:?}: sent {} time(s) (first {:?}, last {:?}), replayed {}, error {:?}, outbox {outbox}, at the provider {at_provider:?}",
                a.id,
                a.operation,
                a.state,
                a.send_count,
                a.first_send_at,
                a.last_send_at,
                a.provider_replayed,
                a.last_error,
            ));
        }
        for (attempt, verdict) in &self.last_verdicts {
            if attempts.iter().any(|a| a.id.to_string() == *attempt) {
                lines.push(format!("  last round's verdict on {attempt}: {verdict}"));
            }
        }
        let decisions = store
            .decisions_of_payment_any_account(pid)
            .await
            .unwrap_or_default();
        for d in decisions.iter().rev().take(6).rev() {
            lines.push(format!(
                "  decision {:?} by {} at {:?}: {} -> {} ({}): {:?}",
                d.decision,
                d.actor,
                d.decided_at,
                d.state_before,
                d.state_after,
                d.provider_said,
                d.reason
            ));
        }
        lines.join("\n")
    }
}

/// The invariants of routing (docs/routing.md) on one payment of a routing
/// seed and its attempts, after any step: its route moves forward only
/// along its chain and the payment is where its moves lead; each move
/// names an authorisation of the payment at the provider it left, proven
/// without effect (`declined` for a soft decline, whose declined charge the
/// ledger holds; `no_effect` for every other proof), under whose key the
/// provider made no money-moving charge, and one never
/// sent (`not_sent`, `circuit_open`) went out through no provider name;
/// every authorisation at a provider it left is `no_effect` or `declined`,
/// none is at a provider it never reached, and everything else (captures,
/// voids, refunds, the charge it holds) is at its current provider; every
/// attempt went out only through its own provider's name.
fn check_route(
    p: &cobro_store::PaymentRow,
    attempts: &[cobro_store::AttemptRow],
    sent: &BTreeMap<String, BTreeSet<&'static str>>,
    ledger: &fake_provider::Ledger,
) -> Result<(), String> {
    let route = p
        .route
        .as_deref()
        .and_then(Route::from_json)
        .ok_or_else(|| format!("no readable route: {:?}", p.route))?;
    let chain = &route.chain;
    let distinct: BTreeSet<&String> = chain.iter().collect();
    if chain.is_empty()
        || distinct.len() != chain.len()
        || chain.iter().any(|c| !PROVIDERS.contains(&c.as_str()))
    {
        return Err(format!("a chain of {chain:?}"));
    }
    let place = |name: &str| chain.iter().position(|c| c == name);
    let mut current = chain[0].as_str();
    let mut left = BTreeSet::new();
    for m in &route.moves {
        let forward = place(&m.to)
            .zip(place(&m.from))
            .is_some_and(|(to, from)| to > from);
        if m.from != current || !forward {
            return Err(format!(
                "moved {} -> {} while at {current} along {chain:?}: a route moves forward only, one provider at a time",
                m.from, m.to
            ));
        }
        let kind = m.proof.split_once(':').map_or(m.proof.as_str(), |(k, _)| k);
        if !PROOFS.contains(&kind) {
            return Err(format!("moved on {:?}, which is no proof", m.proof));
        }
        let Some(a) = attempts.iter().find(|a| a.id.to_string() == m.attempt) else {
            return Err(format!(
                "moved on attempt {}, which is none of its",
                m.attempt
            ));
        };
        let recorded = if kind == "soft_decline" {
            AttemptState::Declined
        } else {
            AttemptState::NoEffect
        };
        if a.operation != Operation::Authorize
            || a.provider.as_deref() != Some(m.from.as_str())
            || a.state != recorded
        {
            return Err(format!(
                "moved from {} on {:?}, naming its {:?} attempt {} at {:?}, recorded {}",
                m.from, m.proof, a.operation, m.attempt, a.provider, a.state
            ));
        }
        if matches!(kind, "not_sent" | "circuit_open")
            && let Some(names) = sent.get(&a.provider_key)
        {
            return Err(format!(
                "moved from {} on {:?}, but its attempt {} went out through {names:?}",
                m.from, m.proof, m.attempt
            ));
        }
        let under_key: Vec<&fake_provider::LedgerCharge> = ledger
            .charges
            .iter()
            .filter(|c| c.idempotency_key.as_deref() == Some(a.provider_key.as_str()))
            .collect();
        if let Some(c) = under_key.iter().find(|c| c.status != "declined") {
            return Err(format!(
                "moved from {} on {:?}, but the provider holds {} ({}) under its attempt {}'s key",
                m.from, m.proof, c.id, c.status, m.attempt
            ));
        }
        if kind == "soft_decline" && !under_key.iter().any(|c| c.status == "declined") {
            return Err(format!(
                "moved from {} on {:?}, but the provider declined nothing under its attempt {}'s key",
                m.from, m.proof, m.attempt
            ));
        }
        left.insert(m.from.as_str());
        current = m.to.as_str();
    }
    if p.provider.as_deref() != Some(current) {
        return Err(format!(
            "at {:?}, but its moves ({:?}) lead to {current}",
            p.provider, route.moves
        ));
    }
    for a in attempts {
        let Some(at) = a.provider.as_deref() else {
            return Err(format!("attempt {} names no provider", a.id));
        };
        if let Some(names) = sent.get(&a.provider_key)
            && names.iter().any(|name| *name != at)
        {
            return Err(format!(
                "{:?} attempt {} of provider {at} went out through {names:?}",
                a.operation, a.id
            ));
        }
        let wrong = match a.operation {
            Operation::Authorize if left.contains(at) => {
                !matches!(a.state, AttemptState::NoEffect | AttemptState::Declined)
            }
            _ => at != current,
        };
        if wrong {
            return Err(format!(
                "its {:?} attempt {} at {at} is {} while the payment is at {current} (left {left:?})",
                a.operation, a.id, a.state
            ));
        }
    }
    if let Some(charge) = p.provider_ref.as_deref()
        && let Some(key) = ledger
            .charge(charge)
            .and_then(|c| c.idempotency_key.as_deref())
        && let Some(a) = attempts.iter().find(|a| a.provider_key == key)
        && a.provider.as_deref() != Some(current)
    {
        return Err(format!(
            "holds {charge}, made by attempt {} at {:?}, while it is at {current}",
            a.id, a.provider
        ));
    }
    Ok(())
}

/// The ledger's charge of cobro's `provider_ref`: the charge itself (the
/// fake's API), or the one its PaymentIntent's confirmation made (the
/// Stripe dialect).
fn charge_of<'l>(
    ledger: &'l fake_provider::Ledger,
    provider_ref: &str,
) -> Option<&'l fake_provider::LedgerCharge> {
    ledger
        .charge(provider_ref)
        .or_else(|| ledger.charge_of_payment_intent(provider_ref))
}

/// The provider's effects (id, idempotency key, reference) by the intent
/// whose attempt's provider key made each, late ones included; an effect
/// made under a key no attempt of cobro's holds is a violation.
fn per_intent<'a>(
    effects: impl Iterator<Item = (&'a String, &'a Option<String>, &'a String)>,
    owner_of_key: &'a BTreeMap<String, (String, String)>,
) -> Result<BTreeMap<&'a str, Vec<&'a str>>, String> {
    let mut per_intent: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (id, key, reference) in effects {
        let Some((_, intent)) = key.as_ref().and_then(|k| owner_of_key.get(k)) else {
            return Err(format!(
                "{id} ({reference}, key {key:?}) was made under a key no attempt of cobro's holds"
            ));
        };
        per_intent.entry(intent).or_default().push(id);
    }
    Ok(per_intent)
}

/// A worker's round whose send was answered an unknown outcome with
/// `Stripe-Should-Retry: false` (`told` such answers) handed its attempt
/// to the reconciler at once (docs/proof-of-absence.md: a resend under the
/// key would only replay the saved 500; only a query can tell what
/// happened), unless its lease was lost meanwhile.
fn handed_over_when_told(told: u32, steps: &[cobro_worker::Step]) -> Result<(), String> {
    use cobro_worker::Step;
    if told == 0
        || steps
            .iter()
            .any(|s| matches!(s, Step::HandedOver | Step::LeaseLost))
    {
        return Ok(());
    }
    Err(format!(
        "a worker answered an unknown outcome with Stripe-Should-Retry: false ended its round {steps:?}, not handing the attempt to the reconciler"
    ))
}

/// What one reconciler run decided, one verdict per item; a run that could
/// not start or finish under a busy write lock decided nothing ("busy": the
/// next run retries); any other error, or an item in error, is a violation.
fn verdicts_of(
    run: Result<cobro_reconciler::Summary, cobro_reconciler::ReconcileError>,
) -> Result<Vec<Value>, String> {
    let summary = match run {
        Ok(summary) => summary,
        Err(e) if e.to_string().contains("timed out waiting for a lock") => {
            return Ok(vec![json!("busy")]);
        }
        Err(e) => return Err(format!("reconcile failed: {e}")),
    };
    if summary.errors > 0 {
        return Err(format!(
            "reconcile examined with errors: {:?}",
            summary.items
        ));
    }
    Ok(summary
        .items
        .iter()
        .map(|i| serde_json::to_value(&i.verdict).unwrap_or_default()["verdict"].clone())
        .collect())
}

/// A capture or void of cobro's that the provider answered (it was sent and
/// ended succeeded, declined or failed): the answer carries the charge's
/// state at that moment (docs/evidence.md §7.5).
fn answered_on_charge(a: &cobro_store::payments::AttemptRow) -> bool {
    matches!(a.operation, Operation::Capture | Operation::Cancel)
        && a.send_count > 0
        && matches!(
            a.state,
            AttemptState::Succeeded | AttemptState::Declined | AttemptState::Failed
        )
}
