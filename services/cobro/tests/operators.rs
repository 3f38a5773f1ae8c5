//! The operators' commands as an on-call engineer runs them: `cobro
//! reconcile` (dry run, JSON, exit codes) and `cobro payments
//! list|show|resolve`, against an embedded SQLite file and a fake provider
//! running in this test process. The ledger of the fake provider is the
//! judge of effects.

use chrono::Utc;
use cobro_core::{AttemptState, IntentName, Operation, OrderRef, PaymentId, PaymentStatus};
use cobro_store::settle::PaymentOutcome;
use cobro_store::{NewPayment, Store, StoreConfig};
use serde_json::Value;
use std::process::{Command, Output, Stdio};

struct Setup {
    dir: tempfile::TempDir,
    url: String,
    provider: fake_provider::Running,
}

impl Setup {
    async fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("cobro.db").display());
        let provider = fake_provider::start(fake_provider::Config {
            admin: true,
            ..Default::default()
        })
        .await
        .expect("fake provider");
        Self { dir, url, provider }
    }

    fn cobro(&self, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_cobro"));
        for (name, _) in std::env::vars() {
            if name.starts_with("COBRO_") {
                command.env_remove(name);
            }
        }
        command
            .args(args)
            .current_dir(self.dir.path())
            .env("COBRO_DATABASE_URL", &self.url)
            .env("COBRO_PROVIDER_URL", self.provider.url())
            .env("COBRO_PROVIDER_API_KEY", "sk_test_cobro")
            .env("COBRO_PROVIDER_SEARCH_LAG", "0s")
            .env("COBRO_RECONCILE_STUCK_AFTER", "0s")
            .env("COBRO_LOG", "warn")
            .env("USER", "alice")
            .stdin(Stdio::null());
        command
    }

    async fn run(&self, args: &[&str]) -> Output {
        let mut command = self.cobro(args);
        tokio::task::spawn_blocking(move || command.output().expect("cobro runs"))
            .await
            .expect("join")
    }

    async fn store(&self) -> Store {
        Store::connect(&StoreConfig::new(self.url.clone()))
            .await
            .expect("connect")
    }

    /// Every search at the provider fails from now on: nothing can be proven.
    /// Every lookup that could prove an outcome fails: the search and
    /// the consistent list.
    fn fail_searches(&self) {
        for operation in [
            fake_provider::Operation::Search,
            fake_provider::Operation::List,
        ] {
            self.provider
                .control()
                .add_fault(fake_provider::FaultRule::new(
                    operation,
                    fake_provider::FaultAction::FailBeforeEffect,
                ));
        }
    }

    /// `cobro reconcile` past the escalation horizon: exit 3, one payment
    /// escalated to `needs_review`.
    fn escalate_one(&self) {
        let escalate = self
            .cobro(&["reconcile", "--json"])
            .env("COBRO_RECONCILE_ESCALATE_AFTER", "1m")
            .output()
            .expect("runs");
        let summary = stdout_json(&escalate);
        assert_eq!(summary["escalated"], 1, "{summary}");
        assert_eq!(escalate.status.code(), Some(3));
    }

    /// A payment whose authorisation the worker handed to reconciliation:
    /// `charged` says whether the provider really made the charge.
    async fn uncertain_payment(&self, order: &str, charged: bool) -> PaymentId {
        let store = self.store().await;
        let now = Utc::now() - chrono::Duration::hours(1);
        let account = match store.find_account_by_name("acme").await.expect("find") {
            Some(a) => a,
            None => store.create_account("acme", now).await.expect("account"),
        };
        let order_ref = OrderRef::parse(order).expect("order");
        let intent = IntentName::new(&order_ref, Operation::Authorize, 1);
        let payment = NewPayment {
            id: PaymentId::new(),
            account,
            order_ref,
            intent: intent.clone(),
            amount: 1500,
            currency: cobro_core::Currency::parse("EUR").expect("EUR"),
            capture_method: cobro_core::CaptureMethod::Automatic,
            payment_method: "pm_card_visa".into(),
            description: None,
            metadata: "{}".into(),
            return_url: None,
            provider: None,
            route: None,
        };
        let mut tx = store.begin().await.expect("begin");
        tx.insert_payment(&payment, now)
            .await
            .expect("insert")
            .expect("inserted");
        let attempt = tx
            .open_intent(
                account,
                payment.id,
                None,
                Operation::Authorize,
                &intent,
                now,
            )
            .await
            .expect("intent");
        tx.resolve_attempt(
            attempt.id,
            AttemptState::Reconciling,
            None,
            Some("test"),
            now,
        )
        .await
        .expect("reconciling");
        tx.settle_payment(
            payment.id,
            PaymentStatus::Processing,
            PaymentStatus::RequiresReconciliation,
            &PaymentOutcome::default(),
            now,
        )
        .await
        .expect("settle")
        .expect("moved");
        tx.commit().await.expect("commit");
        if charged {
            // The worker records each send before it makes it: first an
            // hour ago, last now, when the charge is made; the consistent
            // list covers that window, and the horizon counts from the
            // first send.
            for (sends, at) in [
                (attempt.send_count, now),
                (attempt.send_count + 1, Utc::now()),
            ] {
                store
                    .record_replay(attempt.id, sends, at)
                    .await
                    .expect("send recorded")
                    .expect("reconciling");
            }
            let r = reqwest::Client::new()
                .post(format!("{}/v1/charges", self.provider.url()))
                .bearer_auth("sk_test_cobro")
                .header("idempotency-key", attempt.provider_key.clone())
                .json(&serde_json::json!({"amount": 1500, "currency": "EUR", "payment_method": "pm_card_visa", "capture": true, "reference": attempt.reference.clone()}))
                .send()
                .await
                .expect("charge");
            assert_eq!(r.status().as_u16(), 201);
        }
        store.close().await;
        payment.id
    }
}

/// `payments resolve ID --attempt A --outcome captured --provider-ref
/// CHARGE --reason ...` and `extra`.
fn resolve_captured<'a>(
    id: &'a str,
    attempt: &'a str,
    charge: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "payments",
        "resolve",
        id,
        "--attempt",
        attempt,
        "--outcome",
        "captured",
        "--provider-ref",
        charge,
        "--reason",
        "seen in dashboard",
    ];
    args.extend_from_slice(extra);
    args
}

fn stdout_json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn reconcile_dry_run_changes_nothing_then_a_real_run_adopts_the_charge() {
    let setup = Setup::new().await;
    assert!(setup.run(&["migrate"]).await.status.success());
    let id = setup.uncertain_payment("o-1", true).await;

    let dry = setup
        .run(&["reconcile", "--all", "--dry-run", "--json"])
        .await;
    let summary = stdout_json(&dry);
    assert_eq!(summary["dry_run"], true);
    assert_eq!(summary["examined"], 1);
    assert_eq!(summary["items"][0]["verdict"], "resolved");
    assert_eq!(summary["items"][0]["applied"], false);
    assert_eq!(dry.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&dry.stderr),
        "",
        "piped: no progress bar, no log lines below a warning"
    );
    let listed = stdout_json(&setup.run(&["payments", "list", "--json"]).await);
    assert_eq!(
        listed["payments"][0]["status"], "requires_reconciliation",
        "the dry run wrote nothing"
    );

    let real = setup.run(&["reconcile", "--json"]).await;
    assert_eq!(real.status.code(), Some(0), "nothing left unresolved");
    assert_eq!(stdout_json(&real)["resolved"]["succeeded"], 1);
    let shown = stdout_json(
        &setup
            .run(&["payments", "show", &id.to_string(), "--json"])
            .await,
    );
    assert_eq!(shown["status"], "captured");
    assert_eq!(shown["audit"][0]["decision"], "adopt_succeeded");
    assert_eq!(
        setup.provider.control().ledger().totals.charges,
        1,
        "adopted, not charged again"
    );
    // The table form is for humans; it still says what happened.
    let table = setup.run(&["reconcile"]).await;
    assert!(String::from_utf8_lossy(&table.stdout).contains("examined"));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unresolvable_payment_exits_3_and_a_resolve_needs_review_state_the_attempt_and_confirmation()
 {
    let setup = Setup::new().await;
    assert!(setup.run(&["migrate"]).await.status.success());
    let id = setup.uncertain_payment("o-2", true).await;
    setup.fail_searches();

    let run = setup.run(&["reconcile", "--json"]).await;
    assert_eq!(run.status.code(), Some(3), "something is left unresolved");
    let shown = stdout_json(
        &setup
            .run(&["payments", "show", &id.to_string(), "--json"])
            .await,
    );
    let attempt = shown["attempts"][0]["id"]
        .as_str()
        .expect("attempt id")
        .to_owned();

    assert_eq!(stdout_json(&run)["still_unknown"], 1);

    // Only a payment in needs_review can be resolved by hand.
    let early = setup
        .run(&[
            "payments",
            "resolve",
            &id.to_string(),
            "--attempt",
            &attempt,
            "--outcome",
            "captured",
            "--provider-ref",
            "ch_x",
            "--reason",
            "seen in dashboard",
            "--yes",
        ])
        .await;
    assert!(!early.status.success());
    assert!(String::from_utf8_lossy(&early.stderr).contains("needs_review"));

    // Past the horizon it escalates.
    setup.escalate_one();
    let listed = stdout_json(
        &setup
            .run(&["payments", "list", "--status", "needs_review", "--json"])
            .await,
    );
    assert_eq!(listed["payments"].as_array().map(Vec::len), Some(1));

    // A provider_ref that is not this attempt's charge at the provider is
    // refused: a typo would bind the payment to money not its own.
    let wrong = setup
        .run(&[
            "payments",
            "resolve",
            &id.to_string(),
            "--attempt",
            &attempt,
            "--outcome",
            "captured",
            "--provider-ref",
            "ch_x",
            "--reason",
            "seen in dashboard",
            "--yes",
        ])
        .await;
    assert!(!wrong.status.success());
    assert!(
        String::from_utf8_lossy(&wrong.stderr).contains("no charge ch_x"),
        "{}",
        String::from_utf8_lossy(&wrong.stderr)
    );
    let charge = setup.provider.control().ledger().charges[0].id.clone();
    // Without --yes and without a "y" on stdin, nothing changes.
    let unconfirmed = setup
        .run(&[
            "payments",
            "resolve",
            &id.to_string(),
            "--attempt",
            &attempt,
            "--outcome",
            "captured",
            "--provider-ref",
            &charge,
            "--reason",
            "seen in dashboard",
        ])
        .await;
    assert!(!unconfirmed.status.success());
    let confirmed = setup
        .run(&resolve_captured(
            &id.to_string(),
            &attempt,
            &charge,
            &["--yes"],
        ))
        .await;
    assert!(
        confirmed.status.success(),
        "{}",
        String::from_utf8_lossy(&confirmed.stderr)
    );
    let shown = stdout_json(
        &setup
            .run(&["payments", "show", &id.to_string(), "--json"])
            .await,
    );
    assert_eq!(shown["status"], "captured");
    let audit = shown["audit"].as_array().expect("audit");
    let manual = audit
        .iter()
        .find(|d| d["decision"] == "manual_resolve")
        .expect("audited");
    assert_eq!(manual["actor"], "operator:alice");
    assert_eq!(manual["reason"], "seen in dashboard");
    assert_eq!(setup.provider.control().ledger().totals.charges, 1);
}

/// Runs `cobro ARGS`, requires `code`, returns stdout as JSON.
async fn json_run(setup: &Setup, args: &[&str], code: i32) -> Value {
    let output = setup.run(args).await;
    assert_eq!(
        output.status.code(),
        Some(code),
        "cobro {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout_json(&output)
}

#[tokio::test(flavor = "multi_thread")]
async fn every_printing_command_prints_one_json_document_with_json() {
    let setup = Setup::new().await;
    let migrated = json_run(&setup, &["migrate", "--json"], 0).await;
    assert_eq!(migrated["backend"], "sqlite");
    assert!(migrated["schema_version"].as_i64().is_some_and(|v| v >= 7));
    let account = json_run(
        &setup,
        &["accounts", "create", "--name", "acme", "--json"],
        0,
    )
    .await;
    let accounts = json_run(&setup, &["accounts", "list", "--json"], 0).await;
    assert_eq!(accounts["accounts"][0]["id"], account["id"]);
    let token = json_run(
        &setup,
        &[
            "tokens",
            "create",
            "--account",
            "acme",
            "--expires-in",
            "30d",
            "--json",
        ],
        0,
    )
    .await;
    assert!(
        token["token"]
            .as_str()
            .is_some_and(|t| t.starts_with("cobro_"))
    );
    let tokens = json_run(&setup, &["tokens", "list", "--json"], 0).await;
    assert_eq!(tokens["tokens"][0]["id"], token["id"]);
    assert_eq!(tokens["tokens"][0]["expires_at"], token["expires_at"]);
    let id = token["id"].as_str().expect("id");
    let revoked = json_run(&setup, &["tokens", "revoke", id, "--json"], 0).await;
    assert_eq!(revoked["state"], "revoked");
    let dry = json_run(&setup, &["purge", "--dry-run", "--json"], 0).await;
    assert_eq!(dry["dry_run"], true);
    let purged = json_run(&setup, &["purge", "--json"], 0).await;
    assert_eq!(purged["dry_run"], false);

    let payment = setup.uncertain_payment("o-json", true).await.to_string();
    let listed = json_run(&setup, &["payments", "list", "--json"], 0).await;
    assert_eq!(listed["payments"][0]["id"], payment.as_str());
    let shown = json_run(&setup, &["payments", "show", &payment, "--json"], 0).await;
    assert_eq!(shown["status"], "requires_reconciliation");
    let attempt = shown["attempts"][0]["id"]
        .as_str()
        .expect("attempt")
        .to_owned();
    for key in ["attempts", "late_answers_kept", "audit", "conflicts"] {
        assert!(shown[key].is_array(), "{key}: {shown}");
    }
    let dry = json_run(&setup, &["reconcile", "--dry-run", "--json"], 0).await;
    assert_eq!(dry["examined"], 1);
    // The provider's search fails: the payment stays unknown, then escalates.
    setup.fail_searches();
    setup.escalate_one();
    let charge = setup.provider.control().ledger().charges[0].id.clone();
    let resolved = json_run(
        &setup,
        &resolve_captured(&payment, &attempt, &charge, &["--yes", "--json"]),
        0,
    )
    .await;
    assert_eq!(resolved["status"], "captured");
    assert_eq!(resolved["attempt_id"], attempt.as_str());
    let shown = json_run(&setup, &["payments", "show", &payment, "--json"], 0).await;
    assert_eq!(shown["status"], "captured");

    // Events and their endpoints.
    let events = json_run(
        &setup,
        &["events", "list", "--account", "acme", "--json"],
        0,
    )
    .await;
    assert!(
        events["events"]
            .as_array()
            .is_some_and(|e| e.iter().any(|e| e["type"] == "payment.captured")),
        "{events}"
    );
    let first = events["events"][0]["id"]
        .as_str()
        .expect("event id")
        .to_owned();
    let added = json_run(
        &setup,
        &[
            "events",
            "endpoints",
            "add",
            "--account",
            "acme",
            "--url",
            // A public address: a configured database allows no other.
            "https://93.184.216.34/cobro",
            "--json",
        ],
        0,
    )
    .await;
    assert!(
        added["secret"]
            .as_str()
            .is_some_and(|s| s.starts_with("whsec_"))
    );
    let endpoint = added["id"].as_str().expect("endpoint id").to_owned();
    let listed = json_run(&setup, &["events", "endpoints", "list", "--json"], 0).await;
    assert_eq!(listed["endpoints"][0]["id"], endpoint.as_str());
    assert!(
        listed["endpoints"][0].get("secret").is_none(),
        "never listed"
    );
    let rotated = json_run(
        &setup,
        &["events", "endpoints", "rotate", &endpoint, "--json"],
        0,
    )
    .await;
    assert_ne!(rotated["secret"], added["secret"]);
    let enabled = json_run(
        &setup,
        &["events", "endpoints", "enable", &endpoint, "--json"],
        0,
    )
    .await;
    assert_eq!(enabled["enabled"], true);
    let resent = json_run(&setup, &["events", "resend", &first, "--json"], 0).await;
    assert_eq!(resent["deliveries_queued"], 1);
    let dead = json_run(&setup, &["events", "resend", "--dead", "--json"], 0).await;
    assert_eq!(dead["dead_deliveries_queued"], 0);
    let removed = json_run(
        &setup,
        &["events", "endpoints", "remove", &endpoint, "--json"],
        0,
    )
    .await;
    assert_eq!(removed["removed"], true);
}

/// `cobro reconcile` replays an attempt's own key (the ladder's last rung)
/// only inside the provider's key retention as configured: past it the
/// provider may have forgotten the key, and the replay would charge anew.
#[tokio::test(flavor = "multi_thread")]
async fn reconcile_replays_a_key_only_inside_the_configured_key_retention() {
    let setup = Setup::new().await;
    assert!(setup.run(&["migrate"]).await.status.success());
    // Never charged; its key was first used an hour ago.
    setup.uncertain_payment("o-forgotten", false).await;
    let reconcile = |retention: &str| {
        setup
            .cobro(&["reconcile", "--json"])
            .env("COBRO_PROVIDER_KEY_RETENTION", retention)
            .env("COBRO_PROVIDER_KEY_SAFETY_MARGIN", "5m")
            .output()
            .expect("runs")
    };
    // Keys kept 30 minutes: the list's "nothing" decides, the key is not
    // replayed, and a new attempt (for the worker) is enabled.
    let past = stdout_json(&reconcile("30m"));
    assert_eq!(past["retried"], 1, "{past}");
    assert_eq!(setup.provider.control().ledger().totals.charges, 0);

    // Kept two hours: inside the window, the key is replayed first; the
    // provider never saw it, so the replay executes it, once.
    setup.uncertain_payment("o-kept", false).await;
    let inside = stdout_json(&reconcile("2h"));
    assert_eq!(inside["resolved"]["succeeded"], 1, "{inside}");
    assert_eq!(setup.provider.control().ledger().totals.charges, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn payments_list_filters_by_status_and_time_and_show_prints_no_debug_formatting() {
    let setup = Setup::new().await;
    assert!(setup.run(&["migrate"]).await.status.success());
    let uncertain = setup
        .uncertain_payment("o-unsettled", true)
        .await
        .to_string();
    let settled = setup.uncertain_payment("o-settled", true).await.to_string();
    let reconciled = setup
        .run(&["reconcile", "--payment", &settled, "--json"])
        .await;
    assert_eq!(reconciled.status.code(), Some(0));

    let ids = |v: &Value| -> Vec<String> {
        v["payments"]
            .as_array()
            .expect("payments")
            .iter()
            .map(|p| p["id"].as_str().expect("id").to_owned())
            .collect()
    };
    let list = |args: &'static [&'static str]| {
        let setup = &setup;
        async move {
            let mut all = vec!["payments", "list", "--json"];
            all.extend_from_slice(args);
            json_run(setup, &all, 0).await
        }
    };
    assert_eq!(
        ids(&list(&[]).await),
        vec![uncertain.clone()],
        "unsettled by default"
    );
    assert_eq!(
        ids(&list(&["--status", "unsettled"]).await),
        vec![uncertain.clone()]
    );
    let all = ids(&list(&["--status", "all"]).await);
    assert_eq!(all.len(), 2, "{all:?}");
    assert!(all.contains(&settled) && all.contains(&uncertain));
    assert_eq!(
        ids(&list(&["--status", "captured"]).await),
        vec![settled.clone()]
    );
    // Both were created an hour ago (the helper backdates them).
    assert_eq!(
        ids(&list(&["--status", "all", "--since", "30m"]).await),
        Vec::<String>::new()
    );
    assert_eq!(
        ids(&list(&["--status", "all", "--since", "2h"]).await).len(),
        2
    );
    assert_eq!(
        ids(&list(&["--status", "all", "--until", "30m"]).await).len(),
        2
    );
    assert_eq!(
        ids(&list(&["--status", "all", "--until", "2000-01-01T00:00:00Z"]).await),
        Vec::<String>::new()
    );
    let limited = list(&["--status", "all", "--limit", "1"]).await;
    assert_eq!(ids(&limited).len(), 1);
    assert_eq!(limited["truncated"], true);
    let unknown = setup
        .run(&["payments", "list", "--status", "nonsense"])
        .await;
    assert_eq!(unknown.status.code(), Some(1));

    let table = setup.run(&["payments", "list", "--status", "all"]).await;
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains(&settled) && text.contains("captured"),
        "{text}"
    );
    for id in [&settled, &uncertain] {
        let shown = setup.run(&["payments", "show", id]).await;
        assert!(shown.status.success());
        let text = String::from_utf8_lossy(&shown.stdout);
        for debug in ["Some(", "None", "\"", "DbTime", "DbId"] {
            assert!(!text.contains(debug), "`{debug}` in: {text}");
        }
        for section in ["attempts (1)", "audit trail"] {
            assert!(text.contains(section), "{section}: {text}");
        }
    }
    let shown = setup.run(&["payments", "show", &settled]).await;
    let text = String::from_utf8_lossy(&shown.stdout);
    let json = json_run(&setup, &["payments", "show", &settled, "--json"], 0).await;
    let charge = json["provider_ref"].as_str().expect("adopted charge");
    assert!(
        text.contains(charge),
        "the provider ref is shown plainly: {text}"
    );
    assert!(text.contains("adopt_succeeded"), "the audit trail: {text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn reconcile_draws_a_progress_bar_on_a_terminal_and_nothing_extra_when_piped() {
    let setup = Setup::new().await;
    assert!(setup.run(&["migrate"]).await.status.success());
    for order in ["o-bar-1", "o-bar-2", "o-bar-3"] {
        setup.uncertain_payment(order, false).await;
    }
    // `script` runs the command on a pseudo-terminal and copies what it
    // drew (stdout and stderr) to its own stdout.
    let command = setup.cobro(&[]);
    let program = env!("CARGO_BIN_EXE_cobro");
    let mut script = Command::new("script");
    script
        .args([
            "-qec",
            &format!("{program} reconcile --all --dry-run"),
            "/dev/null",
        ])
        .envs(command.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .current_dir(setup.dir.path())
        .stdin(Stdio::null());
    let drawn = tokio::task::spawn_blocking(move || script.output().expect("script runs"))
        .await
        .expect("join");
    let drawn = String::from_utf8_lossy(&drawn.stdout);
    // Draws are rate-limited, so which counts show is timing; the bar is not.
    assert!(
        drawn.contains(" attempts ") && drawn.contains(['\u{2588}', '\u{2591}']),
        "a progress bar: {drawn}"
    );
    // Piped, no bar is drawn. (Inside the key window a dry run decides
    // nothing, since a real run replays the key first: it ends with the
    // exit status and line of attempts left unresolved.)
    let piped = setup.run(&["reconcile", "--all", "--dry-run"]).await;
    let stderr = String::from_utf8_lossy(&piped.stderr);
    assert!(
        !stderr.contains(['\u{2588}', '\u{2591}', '\r']) && !stderr.contains(" attempts "),
        "{stderr}"
    );
    assert!(!String::from_utf8_lossy(&piped.stdout).contains(" attempts "));
}

/// A key the provider refuses (401: here a live key at the fake's Stripe,
/// which takes only test keys) stops `cobro worker` and `cobro reconcile`
/// at start-up with what to fix, instead of every send being refused
/// until the key window closes; nothing is sent.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_provider_key_stops_the_start_with_what_to_fix() {
    let setup = Setup::new().await;
    assert!(setup.run(&["migrate"]).await.status.success());
    let file = setup.dir.path().join("providers.toml");
    std::fs::write(
        &file,
        format!(
            r#"
            default_provider = "stripe"

            [[provider]]
            name = "stripe"
            kind = "stripe"
            base_url = "{}"
            secret_env = "STRIPE_KEY"
            "#,
            setup.provider.url()
        ),
    )
    .expect("providers file");
    for (command, key, refused) in [
        (&["worker"][..], "sk_live_not_for_the_fake", true),
        (
            &["reconcile", "--json"][..],
            "sk_live_not_for_the_fake",
            true,
        ),
        (&["reconcile", "--json"][..], "sk_test_accepted", false),
    ] {
        let output = setup
            .cobro(command)
            .env_remove("COBRO_PROVIDER_URL")
            .env_remove("COBRO_PROVIDER_API_KEY")
            .env("COBRO_PROVIDERS_FILE", &file)
            .env("STRIPE_KEY", key)
            .output()
            .expect("runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        if refused {
            assert_eq!(output.status.code(), Some(1), "{command:?}: {stderr}");
            assert!(
                stderr.contains("the provider `stripe` refused cobro's credentials")
                    && stderr.contains("(401)"),
                "{command:?}: {stderr}"
            );
            assert!(!stderr.contains(key), "the key is never printed: {stderr}");
        } else {
            assert_eq!(output.status.code(), Some(0), "{command:?}: {stderr}");
        }
    }
    let checks = setup
        .provider
        .control()
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path == "/v1/payment_intents")
        .count();
    assert_eq!(checks, 3, "one check per start");
    assert!(
        setup
            .provider
            .control()
            .requests()
            .iter()
            .all(|r| r.method == "GET"),
        "nothing sent"
    );
    assert_eq!(setup.provider.control().ledger().totals.charges, 0);
}

/// `cobro payments resolve` checks every verdict at the provider: "failed"
/// for a charge the provider made is refused and changes nothing; for a
/// payment that was never charged it is accepted once a consistent read
/// proves it; `--unverified` is accepted and the audit trail says it was
/// not verified and which OS user and host ran it.
#[tokio::test(flavor = "multi_thread")]
async fn resolve_checks_every_verdict_at_the_provider() {
    let setup = Setup::new().await;
    assert!(setup.run(&["migrate"]).await.status.success());
    let charged = setup.uncertain_payment("o-charged", true).await;
    let uncharged = setup.uncertain_payment("o-uncharged", false).await;
    setup.fail_searches();
    let escalate = setup
        .cobro(&["reconcile", "--json"])
        .env("COBRO_RECONCILE_ESCALATE_AFTER", "1m")
        .output()
        .expect("runs");
    assert_eq!(stdout_json(&escalate)["escalated"], 2);
    setup.provider.control().clear_faults();
    // A short key retention: the requests' lifetime (2 minutes) is over.
    let resolve = |id: &PaymentId, attempt: &str, extra: &[&str]| {
        let mut args = vec![
            "payments".to_owned(),
            "resolve".into(),
            id.to_string(),
            "--attempt".into(),
            attempt.into(),
            "--outcome".into(),
            "failed".into(),
            "--reason".into(),
            "no charge seen, ticket OPS-9".into(),
            "--yes".into(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut command = setup.cobro(&[]);
        command
            .args(args)
            .env("COBRO_PROVIDER_KEY_RETENTION", "2m")
            .env("COBRO_PROVIDER_KEY_SAFETY_MARGIN", "1m");
        command.output().expect("runs")
    };
    let attempt_of = async |id: &PaymentId| {
        let shown = json_run(&setup, &["payments", "show", &id.to_string(), "--json"], 0).await;
        shown["attempts"][0]["id"]
            .as_str()
            .expect("attempt")
            .to_owned()
    };

    let a = attempt_of(&charged).await;
    let refused = resolve(&charged, &a, &[]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("contradicts the verdict"), "{stderr}");
    let shown = json_run(
        &setup,
        &["payments", "show", &charged.to_string(), "--json"],
        0,
    )
    .await;
    assert_eq!(shown["status"], "needs_review", "nothing changed");

    let b = attempt_of(&uncharged).await;
    let proven = resolve(&uncharged, &b, &[]);
    assert!(
        proven.status.success(),
        "{}",
        String::from_utf8_lossy(&proven.stderr)
    );
    let shown = json_run(
        &setup,
        &["payments", "show", &uncharged.to_string(), "--json"],
        0,
    )
    .await;
    assert_eq!(shown["status"], "failed");
    let manual = shown["audit"]
        .as_array()
        .expect("audit")
        .iter()
        .find(|d| d["decision"] == "manual_resolve")
        .expect("audited")
        .clone();
    assert_eq!(manual["provider_said"]["verified"], true);
    assert!(
        manual["provider_said"]["invoked_by"]
            .as_str()
            .is_some_and(|by| by.contains('@')),
        "{manual}"
    );

    // The operator vouches: accepted, and the trail says so.
    let vouched = resolve(&charged, &a, &["--unverified"]);
    assert!(vouched.status.success());
    let table = setup.run(&["payments", "show", &charged.to_string()]).await;
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("NOT verified"), "{text}");
    assert_eq!(setup.provider.control().ledger().totals.charges, 1);
}

/// `cobro routing` as an operator runs it: rules from a file are checked
/// against the providers file before anything is stored (an invalid set
/// exits 1, names the problem and changes nothing), a valid one is stored
/// as version 1, `history` keeps who set what, `clear` removes it, and
/// `circuits` reports each provider of the file. The account's payments
/// are untouched by all of it: the provider made nothing.
#[tokio::test(flavor = "multi_thread")]
async fn routing_rules_are_checked_against_the_providers_file_and_every_change_is_kept() {
    let setup = Setup::new().await;
    json_run(&setup, &["migrate", "--json"], 0).await;
    json_run(
        &setup,
        &["accounts", "create", "--name", "acme", "--json"],
        0,
    )
    .await;
    let providers = setup.dir.path().join("providers.toml");
    std::fs::write(
        &providers,
        format!(
            "default_provider = \"fake\"\n\n\
             [[provider]]\nname = \"fake\"\nkind = \"fake\"\nbase_url = \"{url}\"\nsecret_env = \"FAKE_KEY\"\n\n\
             [[provider]]\nname = \"backup\"\nkind = \"fake\"\nbase_url = \"{url}\"\nsecret_env = \"FAKE_KEY\"\n\n\
             [routing]\ndefault = [\"fake\", \"backup\"]\n",
            url = setup.provider.url()
        ),
    )
    .expect("providers file");
    let run = |args: Vec<String>| {
        let mut command = setup.cobro(&args.iter().map(String::as_str).collect::<Vec<_>>());
        command
            .env_remove("COBRO_PROVIDER_URL")
            .env_remove("COBRO_PROVIDER_API_KEY")
            .env_remove("COBRO_PROVIDER_SEARCH_LAG")
            .env("COBRO_PROVIDERS_FILE", &providers)
            .env("FAKE_KEY", "sk_test_cobro");
        async move {
            tokio::task::spawn_blocking(move || command.output().expect("cobro runs"))
                .await
                .expect("join")
        }
    };
    let args = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let write = |name: &str, text: &str| {
        let path = setup.dir.path().join(name);
        std::fs::write(&path, text).expect("rules file");
        path.display().to_string()
    };

    let bad = write("bad.json", r#"{"default": ["fake", "elsewhere"]}"#);
    let refused = run(args(&["routing", "set", "acme", "--file", &bad])).await;
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("\"elsewhere\""), "{stderr}");
    let shown = stdout_json(&run(args(&["routing", "show", "acme", "--json"])).await);
    assert_eq!(
        (shown["rules"].clone(), shown["version"].clone()),
        (Value::Null, 0.into())
    );

    let good = write(
        "good.json",
        r#"{"rules": [{"name": "usd", "when": {"currencies": ["USD"]}, "providers": ["backup", "fake"]}],
            "default": ["fake", "backup"]}"#,
    );
    let set = run(args(&["routing", "set", "acme", "--file", &good, "--json"])).await;
    assert_eq!(
        set.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    assert_eq!(stdout_json(&set)["version"], 1);
    let shown = stdout_json(&run(args(&["routing", "show", "acme", "--json"])).await);
    assert_eq!(shown["rules"]["rules"][0]["name"], "usd");
    assert_eq!(shown["version"], 1);

    let cleared = run(args(&["routing", "clear", "acme", "--json"])).await;
    assert_eq!(stdout_json(&cleared)["version"], 2);
    let history = stdout_json(&run(args(&["routing", "history", "acme", "--json"])).await);
    let changes = history["changes"].as_array().expect("changes");
    assert_eq!(changes.len(), 2, "{history}");
    assert!(
        changes.iter().all(|c| c["actor"] == "operator:alice"),
        "{history}"
    );
    assert_eq!(
        changes.iter().filter(|c| c["rules"].is_null()).count(),
        1,
        "one set, one clear: {history}"
    );

    let circuits = stdout_json(&run(args(&["routing", "circuits", "--json"])).await);
    let names: Vec<&str> = circuits["providers"]
        .as_array()
        .expect("providers")
        .iter()
        .map(|p| {
            assert_eq!(p["state"], "closed");
            p["provider"].as_str().expect("name")
        })
        .collect();
    assert_eq!(names, ["fake", "backup"]);
    assert_eq!(setup.provider.control().ledger().totals.charges, 0);
}
