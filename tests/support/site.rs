//! What the real `cobro` processes of one process-level test share: a
//! [`Site`] is a fresh database on either backend (with one account and its
//! API token), the fake provider running in the test process, and the
//! environment every `cobro serve`, `cobro worker` and `cobro reconcile`
//! of the test is started with. Used by tests/crash.rs and
//! tests/scenarios.rs.
//!
//! Both stores: the processes get `COBRO_DATABASE_URL` = the [`TestDb`]'s
//! URL, a PostgreSQL database or a SQLite file (several processes share one
//! SQLite file in WAL mode; a `cobro worker` process has no in-memory
//! wake-up from the API and wakes by its poll, `COBRO_WORKER_POLL`, 100 ms
//! here). Reads that work on both go through the [`TestDb`] ([`Site::count`],
//! [`TestDb::scalar`]); PostgreSQL-only checks (pg_stat_activity, pg_locks)
//! use [`Site::pg`].
//!
//! Time: the processes use the system clock, so a lease expiry is a real
//! wait. Leases are 2 s (heartbeat 500 ms) and every wait is a condition
//! polled with a deadline.
//!
//! Declare processes after the site, so they are killed before its
//! database is dropped.
//!
//! Dialects: a site in [`Dialect::Fake`] gives its processes the fake's
//! own API through the environment (`COBRO_PROVIDER_URL`, as before the
//! providers file); in [`Dialect::Stripe`] each process reads a providers
//! file (`COBRO_PROVIDERS_FILE`) naming one provider `stripe` of kind
//! `stripe` at the same fake, which answers in its Stripe dialect and
//! sends Stripe's webhooks. The `COBRO_PROVIDER_*` and
//! `COBRO_WEBHOOK_SECRET` variables a test passes become that file's
//! fields ([`Site::command`]), so one test body runs on either.
//!
//! Routed: a site made by [`Site::routed`] has two fake providers, `a`
//! ([`Site::provider`]) and `b` ([`Site::provider_b`]), each with its own
//! ledger, and every process reads the providers file the test wrote for
//! them (tests/routing_chaos.rs).

use crate::process::{Cobro, cobro_binary};
use crate::{Backend, Dialect, RIG_SECRET_KEY, TestDb, wait_for};
use fake_provider::{FaultAction, FaultRule, Ledger, LedgerCharge, Operation as FOp};
use serde_json::Value;
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use uuid::Uuid;

/// The variables the Stripe site's providers file names for the secrets
/// (set on each process, never written into the file). A routed site's
/// file names [`STRIPE_SECRET_ENV`] for the key of each of its providers.
pub const STRIPE_SECRET_ENV: &str = "COBRO_TEST_STRIPE_SECRET_KEY";
const STRIPE_WEBHOOK_SECRET_ENV: &str = "COBRO_TEST_STRIPE_WEBHOOK_SECRET";

/// The environment variables of the single environment-defined provider,
/// and the providers file field each becomes on a Stripe site.
const PROVIDER_FIELDS: [(&str, &str); 5] = [
    ("COBRO_PROVIDER_TIMEOUT", "request_timeout"),
    ("COBRO_PROVIDER_CONNECT_TIMEOUT", "connect_timeout"),
    ("COBRO_PROVIDER_KEY_RETENTION", "key_retention"),
    ("COBRO_PROVIDER_KEY_SAFETY_MARGIN", "key_safety_margin"),
    ("COBRO_PROVIDER_SEARCH_LAG", "search_lag"),
];

/// How long anything a test waits for may take once it is due.
pub const SETTLE: Duration = Duration::from_secs(15);
/// The worker lease the processes run with: an expired lease is this far away.
pub const LEASE: &str = "2s";
pub const HEARTBEAT: &str = "500ms";

/// The payment statuses that are not final: a settled site has none.
pub const UNSETTLED: &str = "('processing', 'requires_action', 'requires_reconciliation', 'needs_review', 'capturing', 'canceling')";

/// See the module docs.
pub struct Site {
    pub db: TestDb,
    /// A pool for PostgreSQL-only checks; `None` on SQLite.
    pg: Option<PgPool>,
    pub account: Uuid,
    pub token: String,
    pub provider: fake_provider::Running,
    pub http: reqwest::Client,
    /// Which of the fake's APIs the processes speak (see the module docs).
    pub dialect: Dialect,
    /// Where a Stripe site writes its providers files (removed with it).
    files: PathBuf,
    written: AtomicUsize,
    /// A routed site's second provider and the providers file every
    /// process reads ([`Site::routed`]); `None` on every other site.
    routed: Option<(fake_provider::Running, PathBuf)>,
}

impl Site {
    pub async fn new(backend: Backend) -> Self {
        Self::new_in(backend, Dialect::Fake).await
    }

    /// A site whose processes speak `dialect` to the fake provider.
    pub async fn new_in(backend: Backend, dialect: Dialect) -> Self {
        Self::with_provider_in(
            backend,
            dialect,
            fake_provider::Config {
                admin: true,
                ..Default::default()
            },
        )
        .await
    }

    /// A site whose fake provider runs with `config` (retention, seed).
    pub async fn with_provider(backend: Backend, config: fake_provider::Config) -> Self {
        Self::with_provider_in(backend, Dialect::Fake, config).await
    }

    /// A site speaking `dialect` whose fake provider runs with `config`;
    /// on the Stripe dialect the fake sends Stripe's webhooks.
    pub async fn with_provider_in(
        backend: Backend,
        dialect: Dialect,
        mut config: fake_provider::Config,
    ) -> Self {
        if dialect == Dialect::Stripe {
            config.webhook_dialect = fake_provider::WebhookDialect::Stripe;
        }
        let db = TestDb::new(backend).await;
        let (account, token) = db.new_account("merchant", chrono::Utc::now()).await;
        let pg = match backend {
            Backend::Postgres => Some(
                PgPoolOptions::new()
                    .max_connections(4)
                    .connect(&db.url)
                    .await
                    .expect("connect to the test database"),
            ),
            Backend::Sqlite => None,
        };
        let provider = fake_provider::start(config)
            .await
            .expect("start the fake provider");
        Self {
            db,
            pg,
            account: account.as_uuid(),
            token,
            provider,
            http: reqwest::Client::new(),
            dialect,
            files: std::env::temp_dir().join(format!("cobro-site-{}", Uuid::new_v4().simple())),
            written: AtomicUsize::new(0),
            routed: None,
        }
    }

    /// A site of two fake providers, each a server with its own ledger:
    /// `a` runs with `config_a` ([`Site::provider`]), `b` with `config_b`
    /// ([`Site::provider_b`]). Every process reads the providers file
    /// `file(a_url, b_url)` returns, whose providers name their key by
    /// [`STRIPE_SECRET_ENV`]; the `COBRO_PROVIDER_*` variables a test
    /// passes are passed as they are (the file says everything about the
    /// providers).
    pub async fn routed(
        backend: Backend,
        config_a: fake_provider::Config,
        config_b: fake_provider::Config,
        file: impl FnOnce(&str, &str) -> String,
    ) -> Self {
        let mut site = Self::with_provider(backend, config_a).await;
        let b = fake_provider::start(config_b)
            .await
            .expect("start the second fake provider");
        std::fs::create_dir_all(&site.files).expect("the site's directory");
        let path = site.files.join("providers-routed.toml");
        std::fs::write(&path, file(&site.provider.url(), &b.url()))
            .expect("write the providers file");
        site.routed = Some((b, path));
        site
    }

    /// A routed site's provider `b`.
    pub fn provider_b(&self) -> &fake_provider::Running {
        &self.routed.as_ref().expect("a routed site").0
    }

    /// The PostgreSQL database, for checks only PostgreSQL can make.
    pub fn pg(&self) -> &PgPool {
        self.pg
            .as_ref()
            .expect("a PostgreSQL-only check on a SQLite site")
    }

    /// Another account on this site; its API token.
    pub async fn new_account(&self, name: &str) -> String {
        self.db.new_account(name, chrono::Utc::now()).await.1
    }

    /// `cobro ARGS` against this site, with nothing inherited from the
    /// environment of whoever runs the tests; `env` comes last and wins.
    /// On a Stripe site the provider's variables of `env` are written into
    /// the providers file the process is given instead.
    pub fn command(&self, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut command = Command::new(cobro_binary());
        for (name, _) in std::env::vars() {
            if name.starts_with("COBRO_") {
                command.env_remove(name);
            }
        }
        let env: Vec<(&str, &str)> = match (&self.routed, self.dialect) {
            (Some((_, file)), _) => {
                command
                    .env("COBRO_PROVIDERS_FILE", file)
                    .env(STRIPE_SECRET_ENV, RIG_SECRET_KEY);
                env.to_vec()
            }
            (None, Dialect::Fake) => {
                command.env("COBRO_PROVIDER_URL", self.provider.url());
                env.to_vec()
            }
            (None, Dialect::Stripe) => {
                let (file, webhook_secret, rest) = self.providers_file(env);
                command
                    .env("COBRO_PROVIDERS_FILE", file)
                    .env(STRIPE_SECRET_ENV, RIG_SECRET_KEY);
                if let Some(secret) = webhook_secret {
                    command.env(STRIPE_WEBHOOK_SECRET_ENV, secret);
                }
                rest
            }
        };
        command
            .args(args)
            .env("COBRO_DATABASE_URL", &self.db.url)
            .env("COBRO_LOG", "warn")
            .env("COBRO_DB_MAX_CONNECTIONS", "5")
            .env("COBRO_WORKER_LEASE", LEASE)
            .env("COBRO_WORKER_HEARTBEAT", HEARTBEAT)
            .env("COBRO_WORKER_POLL", "100ms")
            // These tests load one account far above a merchant's rate.
            .env("COBRO_RATE_LIMIT", "0")
            // Their event endpoints are plain http on 127.0.0.1, which
            // production refuses (`local_endpoints`).
            .env("COBRO_EVENTS_ALLOW_HTTP", "true")
            .env("COBRO_EVENTS_ALLOW", "127.0.0.1/32")
            .envs(env.iter().copied());
        command
    }

    /// The providers file of a Stripe site for a process started with
    /// `env`: one provider `stripe` (the default) at the fake, with the
    /// contract `env`'s `COBRO_PROVIDER_*` variables give and the webhook
    /// secret of `COBRO_WEBHOOK_SECRET`. Returns its path, that secret and
    /// the rest of `env`.
    fn providers_file<'e>(
        &self,
        env: &[(&'e str, &'e str)],
    ) -> (PathBuf, Option<&'e str>, Vec<(&'e str, &'e str)>) {
        let mut text = format!(
            "default_provider = \"stripe\"\n\n[[provider]]\nname = \"stripe\"\nkind = \"stripe\"\n\
             base_url = \"{}\"\nsecret_env = \"{STRIPE_SECRET_ENV}\"\n",
            self.provider.url()
        );
        let (mut webhook_secret, mut rest) = (None, Vec::new());
        for &(name, value) in env {
            if let Some((_, field)) = PROVIDER_FIELDS.iter().find(|(n, _)| *n == name) {
                text.push_str(&format!("{field} = \"{value}\"\n"));
            } else if name == "COBRO_WEBHOOK_SECRET" {
                webhook_secret = Some(value);
                text.push_str(&format!(
                    "webhook_secret_env = \"{STRIPE_WEBHOOK_SECRET_ENV}\"\n"
                ));
            } else {
                rest.push((name, value));
            }
        }
        std::fs::create_dir_all(&self.files).expect("the site's directory");
        let n = self.written.fetch_add(1, Ordering::Relaxed);
        let path = self.files.join(format!("providers-{n}.toml"));
        std::fs::write(&path, text).expect("write the providers file");
        (path, webhook_secret, rest)
    }

    /// The fake's URL of this site's webhooks at `api` (an API process's
    /// base URL): `/v1/webhooks/fake`, or `/v1/webhooks/stripe` for the
    /// Stripe site's provider.
    pub fn webhook_url(&self, api: &str) -> String {
        format!("{api}/v1/webhooks/{}", self.dialect.webhook_provider())
    }

    /// `cobro serve --listen 127.0.0.1:0 ARGS`, ready; and its base URL.
    pub async fn serve(&self, name: &str, args: &[&str], env: &[(&str, &str)]) -> (Cobro, String) {
        let mut all = vec!["serve", "--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        let mut process = Cobro::spawn(name, self.command(&all, env));
        let url = process.line("cobro listening on ").await;
        (process, url)
    }

    /// SIGKILLs the worker `workers[victim]` and starts another in its
    /// place (named for chaos round `round`).
    pub async fn kill_and_restart_worker(
        &self,
        workers: &mut [Cobro],
        victim: usize,
        round: usize,
        env: &[(&str, &str)],
    ) {
        workers[victim].kill9();
        workers[victim] = self
            .worker(&format!("worker {victim} (restart {round})"), env)
            .await
            .0;
    }

    /// SIGKILLs the API process `api` (`serve --no-worker`, the second of
    /// `urls`) and serves another in its place, whose URL replaces its own.
    pub async fn kill_and_restart_api(
        &self,
        api: &mut Cobro,
        urls: &std::sync::Mutex<Vec<String>>,
        round: usize,
        env: &[(&str, &str)],
    ) {
        api.kill9();
        let (process, url) = self
            .serve(&format!("api b (restart {round})"), &["--no-worker"], env)
            .await;
        *api = process;
        urls.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)[1] = url;
    }

    /// `cobro worker`, running; and its lease owner name.
    pub async fn worker(&self, name: &str, env: &[(&str, &str)]) -> (Cobro, String) {
        let mut process = Cobro::spawn(name, self.command(&["worker"], env));
        let owner = process.line("cobro worker running as ").await;
        (process, owner)
    }

    /// Runs `cobro ARGS` to its end against the site; its exit code and stdout.
    pub async fn run_cli(&self, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
        let mut command = self.command(args, env);
        let output = tokio::task::spawn_blocking(move || command.output())
            .await
            .expect("join")
            .expect("cobro runs");
        (
            output.status.code(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    }

    /// `cobro reconcile ARGS --json` to its end: its exit code and summary.
    pub async fn reconcile(&self, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, Value) {
        let mut all = vec!["reconcile", "--json"];
        all.extend_from_slice(args);
        let (code, out) = self.run_cli(&all, env).await;
        let summary = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("cobro reconcile printed no summary ({e}): {out:?}"));
        (code, summary)
    }

    /// A keyed POST of `body` to `path` with `token`.
    pub fn post_as(
        &self,
        token: &str,
        base: &str,
        path: &str,
        key: &str,
        body: &Value,
    ) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{base}{path}"))
            .bearer_auth(token)
            .header("idempotency-key", key)
            .json(body)
    }

    pub fn post_payment(&self, base: &str, key: &str, body: &Value) -> reqwest::RequestBuilder {
        self.post_as(&self.token, base, "/v1/payments", key, body)
    }

    /// `POST /v1/payments` with `key` and `body`, answered (any status).
    pub async fn send_payment(&self, base: &str, key: &str, body: &Value) -> reqwest::Response {
        self.post_payment(base, key, body)
            .send()
            .await
            .expect("an answer")
    }

    /// A first execution: 201, not replayed; the payment's JSON.
    pub async fn create_payment(&self, base: &str, key: &str, body: &Value) -> Value {
        let response = self.send_payment(base, key, body).await;
        assert_eq!(response.status().as_u16(), 201, "create {key}");
        assert_eq!(replayed(&response), "false", "create {key}");
        response.json().await.expect("json")
    }

    /// `GET path` with `token`: status and JSON body.
    pub async fn get_as(&self, token: &str, base: &str, path: &str) -> (u16, Value) {
        let response = self
            .http
            .get(format!("{base}{path}"))
            .bearer_auth(token)
            .send()
            .await
            .expect("an answer");
        let status = response.status().as_u16();
        (status, response.json().await.expect("json"))
    }

    pub async fn payment(&self, base: &str, id: &str) -> Value {
        let (status, payment) = self
            .get_as(&self.token, base, &format!("/v1/payments/{id}"))
            .await;
        assert_eq!(status, 200, "GET payment {id}: {payment}");
        payment
    }

    /// The payment once it is in `status`, through the API.
    pub async fn payment_in(&self, base: &str, id: &str, status: &str) -> Value {
        wait_for(&format!("payment {id} is {status}"), SETTLE, async || {
            let payment = self.payment(base, id).await;
            (payment["status"] == status).then_some(payment)
        })
        .await
    }

    /// The payment once it has left `processing`, through the API.
    pub async fn settled_payment(&self, base: &str, id: &str) -> Value {
        wait_for(
            &format!("payment {id} leaves processing"),
            SETTLE,
            async || {
                let payment = self.payment(base, id).await;
                (payment["status"] != "processing").then_some(payment)
            },
        )
        .await
    }

    /// The provider makes the next charge, then holds its answer for `hold`
    /// (real time) before sending it.
    pub fn hold_next_charge_answer(&self, hold: Duration) {
        self.fault(
            FaultRule::new(FOp::Charge, FaultAction::DelayAfterEffect)
                .with_delay(hold)
                .with_next(1),
        );
    }

    pub fn fault(&self, rule: FaultRule) {
        self.provider.control().add_fault(rule);
    }

    /// How often rules of `action` on `operation` fired so far.
    pub fn fired(&self, operation: FOp, action: FaultAction) -> u64 {
        self.provider
            .control()
            .faults_fired()
            .iter()
            .filter(|f| f.operation == operation && f.action == action)
            .map(|f| f.count)
            .sum()
    }

    pub fn ledger(&self) -> Ledger {
        self.provider.control().ledger()
    }

    /// Waits until the provider has made the charge for `reference`.
    pub async fn charged(&self, reference: &str) {
        wait_for(
            &format!("the provider charged {reference}"),
            SETTLE,
            async || (crate::for_intent(&self.ledger(), reference).charges > 0).then_some(()),
        )
        .await;
    }

    /// The ids of the charges the provider holds for `reference`, asked
    /// through its own search API: the fake's charges, or on a Stripe site
    /// the PaymentIntents whose confirmation charged the card (Stripe's
    /// `payment_intents/search`).
    pub async fn provider_charges(&self, reference: &str) -> Vec<String> {
        if self.dialect == Dialect::Stripe {
            return self.provider_payment_intents(reference).await;
        }
        let found: Value = self
            .http
            // Intent names are `{order}:{verb}-v{n}`: nothing to escape.
            .get(format!(
                "{}/v1/charges?metadata[cobro_intent]={reference}",
                self.provider.url()
            ))
            .bearer_auth("sk_test_cobro")
            .send()
            .await
            .expect("provider search")
            .json()
            .await
            .expect("json");
        found["data"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|charge| charge["id"].as_str().expect("charge id").to_owned())
            .collect()
    }

    /// The Stripe dialect's PaymentIntents of intent `reference` that made
    /// a charge (declined ones left out), by Stripe's search.
    async fn provider_payment_intents(&self, reference: &str) -> Vec<String> {
        let found: Value = self
            .http
            .get(format!("{}/v1/payment_intents/search", self.provider.url()))
            .query(&[
                ("query", format!("metadata['cobro_intent']:'{reference}'")),
                ("limit", "100".to_owned()),
            ])
            .bearer_auth(RIG_SECRET_KEY)
            .header("stripe-version", fake_provider::STRIPE_API_VERSION)
            .send()
            .await
            .expect("provider search")
            .json()
            .await
            .expect("json");
        assert_eq!(found["has_more"], false, "{found}");
        found["data"]
            .as_array()
            .unwrap_or_else(|| panic!("a search result: {found}"))
            .iter()
            .filter(|pi| {
                !pi["latest_charge"].is_null() && pi["status"] != "requires_payment_method"
            })
            .map(|pi| pi["id"].as_str().expect("PaymentIntent id").to_owned())
            .collect()
    }

    /// `SELECT COUNT(*) FROM <from_where>`, on either backend.
    pub async fn count(&self, from_where: &str) -> i64 {
        self.db.count(from_where).await
    }

    /// Runs `cobro reconcile` until no payment is processing, unknown or
    /// in flight (at most 2 minutes).
    pub async fn reconcile_until_settled(&self, env: &[(&str, &str)]) {
        let unsettled = format!("payments WHERE status IN {UNSETTLED}");
        wait_for(
            "every payment is settled",
            Duration::from_secs(120),
            async || {
                let reconcile = self
                    .command(&["reconcile", "--json"], env)
                    .output()
                    .expect("cobro reconcile runs");
                assert!(
                    matches!(reconcile.status.code(), Some(0 | 3)),
                    "reconcile failed: {}",
                    String::from_utf8_lossy(&reconcile.stderr)
                );
                (self.count(&unsettled).await == 0).then_some(())
            },
        )
        .await;
    }

    /// The one money-moving charge the provider made for `payment` (found by
    /// cobro's attempt metadata, whatever its reference): it must be the
    /// payment's `provider_ref`, of its amount and currency.
    pub fn own_charge(&self, ledger: &Ledger, payment: &Value) -> LedgerCharge {
        let id = id_of(payment);
        let moved: Vec<&LedgerCharge> = ledger
            .charges_with_metadata("cobro_payment", &id)
            .into_iter()
            .filter(|charge| charge.status != "declined")
            .collect();
        let [charge] = moved.as_slice() else {
            panic!(
                "{id}: {} money-moving charges at the provider: {moved:?}",
                moved.len()
            );
        };
        assert_eq!(
            payment["provider_ref"],
            crate::provider_ref_of(ledger, &charge.id),
            "{payment}"
        );
        assert_eq!(payment["amount"], charge.amount, "{payment}");
        assert_eq!(payment["currency"], charge.currency.as_str(), "{payment}");
        (*charge).clone()
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.files);
    }
}

/// The `Idempotent-Replayed` header of an answer.
pub fn replayed(response: &reqwest::Response) -> &str {
    response
        .headers()
        .get("idempotent-replayed")
        .expect("an Idempotent-Replayed header")
        .to_str()
        .expect("ascii")
}

pub fn id_of(payment: &Value) -> String {
    payment["id"].as_str().expect("payment id").to_owned()
}

/// Asserts a payment the worker finished: captured, with the provider's one
/// charge for its reference as provider_ref, one attempt sent `sends` times;
/// and that the provider made no other charge.
pub async fn assert_captured_once(site: &Site, payment: &Value, sends: u64) {
    let reference = payment["intent"].as_str().expect("intent");
    assert_eq!(payment["status"], "captured", "{payment}");
    assert_eq!(payment["amount_captured"], 1999);
    let attempts = payment["attempts"].as_array().expect("attempts");
    assert_eq!(
        attempts.len(),
        1,
        "one attempt, one provider key: {payment}"
    );
    assert_eq!(attempts[0]["state"], "succeeded");
    assert_eq!(attempts[0]["sends"], sends, "{payment}");
    let charges = site.provider_charges(reference).await;
    assert_eq!(charges.len(), 1, "{reference}: {charges:?}");
    assert_eq!(payment["provider_ref"], charges[0].as_str());
    let ledger = site.ledger();
    assert_eq!(
        crate::for_intent(&ledger, reference).charges,
        1,
        "{reference}"
    );
    let charge = site.own_charge(&ledger, payment);
    assert_eq!(
        (charge.status.as_str(), charge.amount_captured),
        ("captured", 1999)
    );
    assert_eq!(ledger.totals.charges, 1);
    assert!(ledger.duplicate_charge_references.is_empty());
}

/// A consistent copy of a site's database ([`Site::back_up`]).
pub struct Backup {
    file: PathBuf,
}

impl Site {
    /// Copies the database: PostgreSQL with `pg_dump` (custom format, one
    /// snapshot), SQLite with `VACUUM INTO` (a consistent copy that
    /// includes what is still in the WAL).
    pub async fn back_up(&self) -> Backup {
        let dir = std::env::temp_dir().join(format!("cobro-backup-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("backup dir");
        let file = dir.join("backup");
        if self.db.url.starts_with("postgres") {
            let status = Command::new(pg_tool("pg_dump"))
                .args(["--format=custom", "--file"])
                .arg(&file)
                .arg(&self.db.url)
                .status()
                .expect("pg_dump runs");
            assert!(status.success(), "pg_dump: {status:?}");
        } else {
            self.db
                .exec(&format!("VACUUM INTO '{}'", file.display()))
                .await;
        }
        Backup { file }
    }

    /// Puts `backup` back while no `cobro` process runs. The test's own
    /// store is closed first (on SQLite its connections would otherwise
    /// keep the replaced file's WAL, and could delete the new one by name).
    pub async fn restore(&self, backup: &Backup) {
        self.db.store.close().await;
        if self.db.url.starts_with("postgres") {
            let status = Command::new(pg_tool("pg_restore"))
                .args(["--clean", "--if-exists", "--single-transaction", "--dbname"])
                .arg(&self.db.url)
                .arg(&backup.file)
                .status()
                .expect("pg_restore runs");
            assert!(status.success(), "pg_restore: {status:?}");
        } else {
            let path = PathBuf::from(self.db.url.trim_start_matches("sqlite://"));
            let staged = path.with_extension("restore");
            std::fs::copy(&backup.file, &staged).expect("stage the backup");
            for suffix in ["-wal", "-shm"] {
                let mut side = path.clone().into_os_string();
                side.push(suffix);
                let _ = std::fs::remove_file(PathBuf::from(side));
            }
            std::fs::rename(&staged, &path).expect("swap the backup in");
        }
    }
}

/// `pg_dump`/`pg_restore` of the throwaway cluster's binaries (`PG_BIN`,
/// exported by ops/throwaway-postgres.sh), else from the PATH.
fn pg_tool(name: &str) -> PathBuf {
    match std::env::var_os("PG_BIN") {
        Some(dir) => PathBuf::from(dir).join(name),
        None => PathBuf::from(name),
    }
}
