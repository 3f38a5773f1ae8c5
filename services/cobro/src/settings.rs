//! Typed settings, read once at start from flags and `COBRO_*` environment
//! variables (a flag wins over its variable).
//!
//! Layout:
//! - [`GlobalSettings`]: what every subcommand needs (database, logging).
//! - [`ServeSettings`]: the HTTP server and its scheduled purge.
//! - [`RetentionSettings`]: the retention contract (docs/http-api.md §8), shared
//!   by `serve` (scheduled purge, replay of tombstones) and `purge`.
//! - [`DispatcherSettings`], [`ReconcileSettings`] and the provider groups:
//!   shared by `serve` and `worker` (and `reconcile`), each with the
//!   configuration it builds.
//! - [`DatabaseTarget`]: the database URL resolved and checked, or the
//!   embedded SQLite default.
//!
//! Values that clap can check (durations, addresses, numbers) are parsed by
//! clap, so a bad value stops the process before anything is touched. The
//! database URL is checked here rather than by clap because clap's error
//! would echo the value, and a URL can carry a password.

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use cobro_provider::WebhookSecret;
use cobro_store::StoreConfig;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// How long a command waits for a pooled connection before giving up. Not
/// a setting: a healthy database answers far sooner, and start-up must fail
/// fast and clearly when it is unreachable.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);

/// The embedded database's file name inside the data directory.
const EMBEDDED_DB_FILE: &str = "cobro.db";

/// Settings every subcommand shares.
#[derive(Args, Clone, Debug)]
pub struct GlobalSettings {
    /// Database URL (`postgres://...` or `sqlite://...`). Unset: the
    /// embedded SQLite database `<data-dir>/cobro.db` (demo setup).
    // The value is hidden in `--help` because it may carry a password.
    #[arg(
        long,
        env = "COBRO_DATABASE_URL",
        global = true,
        hide_env_values = true
    )]
    pub database_url: Option<String>,

    /// Directory of the embedded SQLite database (used only when no
    /// database URL is set); created if missing.
    #[arg(long, env = "COBRO_DATA_DIR", default_value = "./data", global = true)]
    pub data_dir: PathBuf,

    /// Log line format on stderr.
    #[arg(long, env = "COBRO_LOG_FORMAT", value_enum, default_value_t = LogFormat::Plain, global = true)]
    pub log_format: LogFormat,

    /// Log filter in `RUST_LOG` syntax, e.g. `info` or `cobro=debug,sqlx=warn`
    /// (`RUST_LOG`, when set, wins). Unset: `info` for `serve` and `worker`;
    /// warnings only for the operator commands, unless `-v`.
    #[arg(long = "log", env = "COBRO_LOG", global = true)]
    pub log_filter: Option<String>,

    /// More logs on stderr from the operator commands: `-v` INFO, `-vv`
    /// DEBUG (they log warnings only by default; `serve` and `worker` log
    /// INFO, and DEBUG with `-v`).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,

    /// Database pool size. PostgreSQL on 2 cores peaks around 8 to 16
    /// connections; SQLite is capped at 4 by the store.
    #[arg(long, env = "COBRO_DB_MAX_CONNECTIONS", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..), global = true)]
    pub db_max_connections: u32,

    /// Longest wait for a lock held by a concurrent transaction (the
    /// idempotency contract bounds this at about 2 s).
    #[arg(long, env = "COBRO_LOCK_TIMEOUT", default_value = "2s",
          value_parser = parse_duration, global = true)]
    pub lock_timeout: Duration,

    /// PostgreSQL: the longest cobro waits for any one answer of the
    /// database, so that one that stops answering without closing its
    /// connections (a frozen primary, a partition) fails requests with 503
    /// instead of holding them. cobro's own bound, never the server's
    /// `statement_timeout` (docs/high-availability.md). Migrations are not
    /// bounded by it.
    #[arg(long, env = "COBRO_DB_DEADLINE", default_value = "10s",
          value_parser = parse_duration, global = true)]
    pub db_deadline: Duration,
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Plain,
    /// One JSON object per line, for log shippers.
    Json,
}

/// Settings of `cobro serve`.
#[derive(Args, Clone, Debug)]
pub struct ServeSettings {
    /// Address to listen on; port 0 picks a free port (the bound address is
    /// printed on stdout).
    #[arg(long, env = "COBRO_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// Do not migrate at start; refuse to start unless the schema is
    /// exactly this binary's (for deployments that migrate as a separate step).
    #[arg(long)]
    pub no_migrate: bool,

    /// When the in-process purge runs: cron with seconds, in UTC.
    #[arg(long, env = "COBRO_PURGE_SCHEDULE", default_value = "0 */10 * * * *", value_parser = parse_cron)]
    pub purge_schedule: String,

    /// Rows per purge batch of the scheduled purge.
    #[arg(long = "purge-batch", env = "COBRO_PURGE_BATCH", default_value_t = DEFAULT_PURGE_BATCH,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub purge_batch: u32,

    /// After SIGTERM or SIGINT, how long in-flight requests may run before
    /// the process exits anyway.
    #[arg(long, env = "COBRO_SHUTDOWN_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Signing secret of the `fake` provider's webhooks, accepted at
    /// `POST /v1/webhooks/fake`. Unset: with the embedded fake provider a
    /// random one is generated at start (and given to it); otherwise
    /// webhooks are refused with 404.
    // Parsed into `WebhookSecret`, whose `Debug` hides the value.
    #[arg(long, env = "COBRO_WEBHOOK_SECRET", hide_env_values = true,
          value_parser = |s: &str| Ok::<_, String>(WebhookSecret::new(s)))]
    pub webhook_secret: Option<WebhookSecret>,

    /// While rotating the webhook secret: the previous one, still accepted
    /// next to `COBRO_WEBHOOK_SECRET` until the provider signs only with
    /// the new one (then unset it). See ops/RUNBOOK.md.
    #[arg(long, env = "COBRO_WEBHOOK_SECRET_PREVIOUS", hide_env_values = true,
          requires = "webhook_secret",
          value_parser = |s: &str| Ok::<_, String>(WebhookSecret::new(s)))]
    pub webhook_secret_previous: Option<WebhookSecret>,

    /// How far a webhook signature's timestamp may be from now before the
    /// delivery is refused as a possible replay.
    #[arg(long, env = "COBRO_WEBHOOK_TOLERANCE", default_value = "300s", value_parser = parse_duration)]
    pub webhook_tolerance: Duration,

    /// Test-only: hold keyed requests whose key starts with a prefix,
    /// forever, `before-commit:<prefix>` or `after-commit:<prefix>`, so a
    /// crash test can SIGKILL the server at that point
    /// (`cobro_api::TestHold`). Never set it in production.
    #[arg(long, env = "COBRO_TEST_HOLD", hide = true)]
    pub test_hold: Option<cobro_api::TestHold>,

    /// Requests per second per account in this process (0: no limit);
    /// over it: 429 `rate-limited`, never stored against a key.
    #[arg(long, env = "COBRO_RATE_LIMIT", default_value_t = 200)]
    pub rate_limit: u32,

    /// Burst of requests an account may send above the rate.
    #[arg(long, env = "COBRO_RATE_LIMIT_BURST", default_value_t = 400)]
    pub rate_limit_burst: u32,

    /// How long a live API token is remembered after it was read, so a
    /// request skips its token lookup: a token revoked (`cobro tokens
    /// revoke`) stops working within this bound; an expiring one stops at
    /// its expiry. `0s`: look every token up on every request.
    #[arg(long, env = "COBRO_TOKEN_CACHE_TTL", default_value = "2s", value_parser = parse_duration)]
    pub token_cache_ttl: Duration,

    #[command(flatten)]
    pub retention: RetentionSettings,

    /// Do not run the outbox worker inside `serve` (run `cobro worker`
    /// processes instead).
    #[arg(long, env = "COBRO_NO_WORKER")]
    pub no_worker: bool,

    #[command(flatten)]
    pub http: HttpSettings,

    #[command(flatten)]
    pub worker: WorkerSettings,

    #[command(flatten)]
    pub schedule: ReconcileSchedule,

    #[command(flatten)]
    pub dispatcher: DispatcherSettings,
}

impl ServeSettings {
    /// Refuses an empty or short `COBRO_WEBHOOK_SECRET` /
    /// `COBRO_WEBHOOK_SECRET_PREVIOUS` (`cobro_core::signature::MIN_SECRET_BYTES`),
    /// by flag or variable, with a message that names the setting and
    /// never the value (which is why clap does not check it: its error
    /// would echo the value).
    pub fn check_webhook_secrets(&self) -> anyhow::Result<()> {
        let settings = [
            (
                "COBRO_WEBHOOK_SECRET (--webhook-secret)",
                "COBRO_WEBHOOK_SECRET",
                &self.webhook_secret,
            ),
            (
                "COBRO_WEBHOOK_SECRET_PREVIOUS (--webhook-secret-previous)",
                "COBRO_WEBHOOK_SECRET_PREVIOUS",
                &self.webhook_secret_previous,
            ),
        ];
        for (name, variable, value) in settings {
            let problem = match value {
                Some(secret) => cobro_core::signature::check_secret_length(secret.expose()).err(),
                // clap reads a variable set to "" as unset; set is set.
                None if std::env::var_os(variable).is_some() => {
                    Some(cobro_core::signature::WeakSecret::Empty)
                }
                None => None,
            };
            if let Some(problem) = problem {
                bail!(
                    "{name} {problem}: use the webhook signing secret the provider gave (Stripe's whsec_... is longer), or unset it"
                );
            }
        }
        Ok(())
    }
}

/// The scheduled reconciler that every process with a provider runs
/// (`serve`, with or without its worker, and `cobro worker`). Several
/// processes at once are safe: every decision is a compare-and-set on the
/// attempt (pinned to the state and last send it read) in one transaction
/// with what it enables, so of two reconcilers deciding about one attempt
/// the second finds it decided and changes nothing.
#[derive(Args, Clone, Debug)]
pub struct ReconcileSchedule {
    /// When the in-process reconciler runs: cron with seconds, in UTC.
    #[arg(long, env = "COBRO_RECONCILE_SCHEDULE", default_value = "30 * * * * *", value_parser = parse_cron)]
    pub reconcile_schedule: String,

    /// Run no scheduled reconciler in this process (another process, or an
    /// operator with `cobro reconcile`, must).
    #[arg(long, env = "COBRO_NO_RECONCILER")]
    pub no_reconciler: bool,
}

/// The payment providers: the providers file, or (without one) the single
/// provider `fake` of these variables, where it is and how long a call may
/// take. Only the commands that call a provider (`serve`, `worker`,
/// `reconcile`, `payments resolve`) take these.
#[derive(Args, Clone, Debug)]
pub struct ProviderSettings {
    #[command(flatten)]
    pub file: ProvidersFile,

    /// The provider's base URL. Unset: `serve` starts the embedded fake
    /// provider on loopback (no real money moves); the other commands refuse.
    #[arg(long, env = "COBRO_PROVIDER_URL")]
    pub provider_url: Option<String>,

    /// cobro's API key at the provider (scopes its idempotency keys).
    #[arg(
        long,
        env = "COBRO_PROVIDER_API_KEY",
        default_value = "sk_test_cobro",
        hide_env_values = true
    )]
    pub provider_api_key: String,

    /// Connect timeout of a provider call (a failure here proves nothing was sent).
    #[arg(long, env = "COBRO_PROVIDER_CONNECT_TIMEOUT", default_value = "2s",
          value_parser = parse_duration)]
    pub provider_connect_timeout: Duration,

    /// Total timeout of a provider call (after it the outcome is unknown).
    #[arg(long, env = "COBRO_PROVIDER_TIMEOUT", default_value = "10s",
          value_parser = parse_duration)]
    pub provider_timeout: Duration,
}

/// The providers file (README.md, "Configuration"): every provider, its
/// secrets and contract, and the default one. When it is set the
/// `COBRO_PROVIDER_*` variables and `COBRO_WEBHOOK_SECRET*` are not read
/// (setting `COBRO_PROVIDER_URL` or `COBRO_WEBHOOK_SECRET` too is refused).
#[derive(Args, Clone, Debug, Default)]
pub struct ProvidersFile {
    /// A TOML file naming each provider (`[[provider]]`) and the
    /// `default_provider`. Unset: the single provider `fake` of
    /// `COBRO_PROVIDER_URL` and its neighbours.
    #[arg(long, env = "COBRO_PROVIDERS_FILE")]
    pub providers_file: Option<PathBuf>,
}

/// What every process that sends to the provider (`serve`, `worker`)
/// takes: the provider, its key window, and the scheduled reconciler's rules.
#[derive(Args, Clone, Debug)]
pub struct SenderSettings {
    #[command(flatten)]
    pub provider: ProviderSettings,
    #[command(flatten)]
    pub key_window: KeyWindowSettings,
    #[command(flatten)]
    pub reconcile: ReconcileSettings,
}

/// The provider's idempotency key window, which bounds every resend and
/// every replay: only the commands that send (`serve`, `worker`, and
/// `reconcile`, which replays an attempt's own key) take these.
#[derive(Args, Clone, Debug)]
pub struct KeyWindowSettings {
    /// How long the provider remembers an idempotency key. The worker never
    /// sends an attempt later than first send + this - the safety margin.
    #[arg(long, env = "COBRO_PROVIDER_KEY_RETENTION", default_value = "24h",
          value_parser = parse_duration)]
    pub provider_key_retention: Duration,

    /// Margin kept before the end of the provider's key window.
    #[arg(long, env = "COBRO_PROVIDER_KEY_SAFETY_MARGIN", default_value = "1h",
          value_parser = parse_duration)]
    pub provider_key_safety_margin: Duration,
}

/// How the reconciler decides (shared by `serve`'s schedule and `cobro reconcile`).
#[derive(Args, Clone, Debug)]
pub struct ReconcileSettings {
    /// The provider's documented search consistency delay (shown at start;
    /// no proof depends on it: a search that finds nothing proves nothing).
    #[arg(long, env = "COBRO_PROVIDER_SEARCH_LAG", default_value = "60s", value_parser = parse_duration)]
    pub provider_search_lag: Duration,

    /// The clock skew allowed between cobro's hosts, its database and the
    /// provider: the consistent list that proves no effect covers the
    /// attempt's window widened by it on both sides.
    #[arg(long, env = "COBRO_PROVIDER_CLOCK_SKEW", default_value = "10s", value_parser = parse_duration)]
    pub provider_clock_skew: Duration,

    /// Unknown attempts not sent for this long, and captures, voids and
    /// refunds waiting this long, are examined too.
    #[arg(long, env = "COBRO_RECONCILE_STUCK_AFTER", default_value = "5m", value_parser = parse_duration)]
    pub reconcile_stuck_after: Duration,

    /// Unresolved this long after the first send: `needs_review`.
    #[arg(long, env = "COBRO_RECONCILE_ESCALATE_AFTER", default_value = "24h", value_parser = parse_duration)]
    pub reconcile_escalate_after: Duration,

    /// After proof of no effect, fail the payment instead of scheduling a
    /// new attempt with a new provider key.
    #[arg(long, env = "COBRO_RECONCILE_NO_RETRY")]
    pub reconcile_no_retry: bool,

    #[command(flatten)]
    pub books: BooksSettings,
}

/// The books (docs/books.md): the provider's ledger matched against
/// cobro's record, scheduled beside the reconciler in every process that
/// runs it, incrementally from a checkpoint per provider.
#[derive(Args, Clone, Debug)]
pub struct BooksSettings {
    /// When the scheduled books run: cron with seconds, in UTC.
    #[arg(long, env = "COBRO_BOOKS_SCHEDULE", default_value = "0 */5 * * * *", value_parser = parse_cron)]
    pub books_schedule: String,

    /// Run no scheduled books in this process.
    #[arg(long, env = "COBRO_NO_BOOKS")]
    pub no_books: bool,

    /// How far before its checkpoint a scheduled run reads again (objects
    /// dated earlier than they were listed: the provider's clock, requests
    /// still executing).
    #[arg(long, env = "COBRO_BOOKS_OVERLAP", default_value = "10m", value_parser = parse_duration)]
    pub books_overlap: Duration,

    /// A scheduled window ends this long before now, so objects being
    /// created are listed by the next run.
    #[arg(long, env = "COBRO_BOOKS_SETTLE_DELAY", default_value = "2m", value_parser = parse_duration)]
    pub books_settle_delay: Duration,

    /// How far back the first scheduled run reads (no checkpoint yet).
    #[arg(long, env = "COBRO_BOOKS_FIRST_WINDOW", default_value = "24h", value_parser = parse_duration)]
    pub books_first_window: Duration,
}

/// The outbox worker's leases and pace.
#[derive(Args, Clone, Debug)]
pub struct WorkerSettings {
    /// How long a claimed row is this worker's without a heartbeat.
    #[arg(long, env = "COBRO_WORKER_LEASE", default_value = "30s", value_parser = parse_duration)]
    pub worker_lease: Duration,

    /// Lease renewal period while a call is in flight (keep it at most a
    /// third of the lease).
    #[arg(long, env = "COBRO_WORKER_HEARTBEAT", default_value = "10s", value_parser = parse_duration)]
    pub worker_heartbeat: Duration,

    /// Provider calls in flight at once in this process.
    #[arg(long, env = "COBRO_WORKER_MAX_IN_FLIGHT", default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub worker_max_in_flight: u32,

    /// Fallback poll when no wake-up arrives.
    #[arg(long, env = "COBRO_WORKER_POLL", default_value = "1s", value_parser = parse_duration)]
    pub worker_poll: Duration,

    /// How long a payment waits for its customer to authenticate (3-D
    /// Secure, `requires_action`) before the reconciler cancels it as
    /// abandoned (its PaymentIntent canceled at the provider).
    #[arg(long, env = "COBRO_ACTION_EXPIRY", default_value = "1h", value_parser = parse_duration)]
    pub action_expiry: Duration,
}

/// The bounds of every HTTP connection (`cobro_api::server`).
#[derive(Args, Clone, Debug)]
pub struct HttpSettings {
    /// From a request's first byte to the end of its headers; longer and
    /// the connection is closed.
    #[arg(long, env = "COBRO_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub http_header_timeout: Duration,

    /// A connection with no request running and no byte arriving (a new
    /// one, or a keep-alive between requests) is closed after this.
    #[arg(long, env = "COBRO_HTTP_IDLE_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub http_idle_timeout: Duration,

    /// From the end of a request's headers to its answer, body included:
    /// then 408 `request-timeout` and the connection is closed. A request
    /// already executing still finishes (retry it with the same key). Keep
    /// it above the longest `?wait=` (30 s).
    #[arg(long, env = "COBRO_HTTP_REQUEST_TIMEOUT", default_value = "45s", value_parser = parse_duration)]
    pub http_request_timeout: Duration,

    /// Connections served at once; one more is closed as soon as accepted.
    #[arg(long, env = "COBRO_HTTP_MAX_CONNECTIONS", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub http_max_connections: u32,
}

/// The event dispatcher of this process.
#[derive(Args, Clone, Debug)]
pub struct DispatcherSettings {
    /// Run no event dispatcher in this process (another process must, or
    /// merchants only pull `GET /v1/events`).
    #[arg(long, env = "COBRO_NO_DISPATCHER")]
    pub no_dispatcher: bool,

    /// One POST to a merchant endpoint, connection included.
    #[arg(long, env = "COBRO_EVENTS_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub events_timeout: Duration,

    /// How long a delivery is retried from its first attempt before it is
    /// dead; also how long an endpoint may fail every attempt before it is
    /// disabled.
    #[arg(long, env = "COBRO_EVENTS_RETRY_PERIOD", default_value = "3d", value_parser = parse_duration)]
    pub events_retry_period: Duration,

    /// How often an idle dispatcher looks for due deliveries.
    #[arg(long, env = "COBRO_EVENTS_POLL", default_value = "1s", value_parser = parse_duration)]
    pub events_poll: Duration,

    /// Retry backoff: a random delay up to base x 2^attempts, capped.
    #[arg(long, env = "COBRO_EVENTS_BACKOFF_BASE", default_value = "5s", value_parser = parse_duration)]
    pub events_backoff_base: Duration,

    #[arg(long, env = "COBRO_EVENTS_BACKOFF_CAP", default_value = "1h", value_parser = parse_duration)]
    pub events_backoff_cap: Duration,

    #[command(flatten)]
    pub endpoints: EndpointPolicySettings,
}

/// Where event endpoints may point (`cobro_core::egress`): checked when an
/// endpoint is registered (the API, `cobro events endpoints add`) and by
/// the dispatcher at every connection. By default only `https://` to
/// public addresses; the embedded demo (no database URL) also allows plain
/// http and this machine (`127.0.0.0/8`, `::1`, `localhost`).
#[derive(Args, Clone, Debug, Default)]
pub struct EndpointPolicySettings {
    /// Accept plain `http://` event endpoints (development and tests; never
    /// in production: events and their signatures would travel in clear).
    #[arg(long, env = "COBRO_EVENTS_ALLOW_HTTP")]
    pub events_allow_http: bool,

    /// Networks (`10.1.0.0/16`, `127.0.0.1/32`, `::1/128`) and host names
    /// (`hooks.internal`) event endpoints may reach although they are not
    /// public (private, loopback, link-local...), comma-separated. A listed
    /// host name is not resolved at registration and any address it
    /// resolves to is allowed. For tests and private deployments.
    #[arg(long, env = "COBRO_EVENTS_ALLOW", value_delimiter = ',', value_name = "CIDR_OR_HOST",
          value_parser = |s: &str| s.parse::<cobro_core::egress::AllowEntry>())]
    pub events_allow: Vec<cobro_core::egress::AllowEntry>,
}

impl EndpointPolicySettings {
    /// The policy of a process on the embedded demo database
    /// (`development`) or on a configured one.
    pub fn policy(&self, development: bool) -> cobro_core::egress::EgressPolicy {
        let policy = cobro_core::egress::EgressPolicy {
            allow_http: self.events_allow_http,
            allow: self.events_allow.clone(),
        };
        if development {
            policy.with_development_allowances()
        } else {
            policy
        }
    }
}

impl RetentionSettings {
    /// The retention contract the purge applies.
    pub fn retention(&self) -> cobro_store::purge::Retention {
        cobro_store::purge::Retention {
            idempotency: self.idempotency_retention,
            tombstone: self.tombstone_retention,
            webhook_event: self.webhook_event_retention,
        }
    }
}

impl HttpSettings {
    pub fn limits(&self) -> cobro_api::server::Limits {
        cobro_api::server::Limits {
            header_timeout: self.http_header_timeout,
            idle_timeout: self.http_idle_timeout,
            max_connections: self.http_max_connections as usize,
        }
    }
}

/// Rows per purge batch: small enough that no batch holds locks for long.
pub const DEFAULT_PURGE_BATCH: u32 = 500;

/// The retention contract (docs/http-api.md §8).
#[derive(Args, Clone, Debug)]
pub struct RetentionSettings {
    /// How long a full idempotency record (stored response) is kept before
    /// it is compacted to a tombstone.
    #[arg(long, env = "COBRO_IDEMPOTENCY_RETENTION", default_value = "24h", value_parser = parse_duration)]
    pub idempotency_retention: Duration,

    /// How long a tombstone is kept after that; then the key is new again.
    #[arg(long, env = "COBRO_TOMBSTONE_RETENTION", default_value = "30d", value_parser = parse_duration)]
    pub tombstone_retention: Duration,

    /// How long processed provider webhook event ids are kept; at least as
    /// long as the provider redelivers.
    #[arg(long, env = "COBRO_WEBHOOK_EVENT_RETENTION", default_value = "30d", value_parser = parse_duration)]
    pub webhook_event_retention: Duration,
}

/// Where the data lives, resolved from [`GlobalSettings`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DatabaseTarget {
    /// No URL was given: SQLite in the data directory, the demo setup.
    Embedded { data_dir: PathBuf, url: String },
    /// An operator-provided, syntactically checked URL.
    External { url: String },
}

impl DatabaseTarget {
    pub fn url(&self) -> &str {
        match self {
            DatabaseTarget::Embedded { url, .. } | DatabaseTarget::External { url } => url,
        }
    }

    /// The SQLite file of the embedded default; `None` for a configured URL.
    pub fn embedded_file(&self) -> Option<PathBuf> {
        match self {
            DatabaseTarget::Embedded { data_dir, .. } => Some(data_dir.join(EMBEDDED_DB_FILE)),
            DatabaseTarget::External { .. } => None,
        }
    }

    /// The URL with any password replaced, safe for logs and errors.
    pub fn redacted(&self) -> String {
        redact_url(self.url())
    }
}

impl GlobalSettings {
    /// Resolves and checks the database URL; never echoes it in an error.
    pub fn database(&self) -> anyhow::Result<DatabaseTarget> {
        let Some(url) = self.database_url.as_deref() else {
            let file = self.data_dir.join(EMBEDDED_DB_FILE);
            let path = file.to_str().with_context(|| {
                format!(
                    "the data directory {} is not valid UTF-8",
                    self.data_dir.display()
                )
            })?;
            return Ok(DatabaseTarget::Embedded {
                data_dir: self.data_dir.clone(),
                url: format!("sqlite://{path}"),
            });
        };
        let parsed = url::Url::parse(url).map_err(|e| {
            anyhow::anyhow!("COBRO_DATABASE_URL (--database-url) is not a valid URL: {e}")
        })?;
        match parsed.scheme() {
            "postgres" | "postgresql" | "sqlite" => Ok(DatabaseTarget::External {
                url: url.to_owned(),
            }),
            other => bail!(
                "COBRO_DATABASE_URL (--database-url) has the unsupported scheme `{other}`: \
                 expected postgres://... or sqlite://..."
            ),
        }
    }

    /// The store's connection settings for `target`.
    pub fn store_config(&self, target: &DatabaseTarget) -> StoreConfig {
        let mut config = StoreConfig::new(target.url());
        config.max_connections = self.db_max_connections;
        config.lock_timeout = self.lock_timeout;
        config.acquire_timeout = ACQUIRE_TIMEOUT;
        config.deadline = self.db_deadline;
        config
    }
}

/// Query parameters (URL form) and keywords (libpq's `key=value` form)
/// whose values are secrets.
const SECRET_KEYS: &[&str] = &["password", "sslpassword"];

/// `url` with every secret in it replaced by `***`: the password of the
/// user info (`postgres://u:secret@h/db`), secret query parameters
/// (`?password=secret`), and secret keywords of the `key=value` form
/// (`host=h password=secret`). Safe for logs and errors.
pub fn redact_url(url: &str) -> String {
    if !url.contains("://") {
        return redact_conninfo(url);
    }
    let Ok(mut parsed) = url::Url::parse(url) else {
        return "<unparsable URL>".to_owned();
    };
    if parsed.password().is_some() {
        // Only fails for URLs that cannot have a password, which this one has.
        let _ = parsed.set_password(Some("***"));
    }
    let pairs: Vec<(String, String)> = parsed.query_pairs().into_owned().collect();
    if pairs.iter().any(|(k, _)| is_secret_key(k)) {
        let masked = pairs.iter().map(|(k, v)| {
            let v = if is_secret_key(k) { "***" } else { v.as_str() };
            (k.as_str(), v)
        });
        parsed.query_pairs_mut().clear().extend_pairs(masked);
    }
    parsed.to_string()
}

/// Every secret `url` carries (as written and percent-decoded), for
/// [`mask_secrets`].
fn secrets_of(url: &str) -> Vec<String> {
    let mut found = Vec::new();
    if let Ok(parsed) = url::Url::parse(url) {
        if let Some(password) = parsed.password() {
            found.push(password.to_owned());
            found.push(percent_decoded(password));
        }
        for (key, value) in parsed.query_pairs() {
            if is_secret_key(&key) {
                found.push(value.into_owned());
            }
        }
        // As written, too (percent-encoded).
        for pair in parsed.query().unwrap_or_default().split('&') {
            if let Some((key, value)) = pair.split_once('=')
                && is_secret_key(key)
            {
                found.push(value.to_owned());
            }
        }
    }
    found.extend(conninfo_secrets(url).into_iter().map(|(_, v)| v.to_owned()));
    found.retain(|s| !s.is_empty() && s != "***");
    found
}

/// `text` with every secret of `url` replaced by `***`: the last pass over
/// an error message, whatever library wrote it.
pub fn mask_secrets(text: &str, url: Option<&str>) -> String {
    let mut text = text.to_owned();
    for secret in url.map(secrets_of).unwrap_or_default() {
        text = text.replace(&secret, "***");
    }
    text
}

fn is_secret_key(key: &str) -> bool {
    SECRET_KEYS
        .iter()
        .any(|k| k.eq_ignore_ascii_case(key.trim()))
}

/// `text` percent-decoded (as the URL's user info is written).
fn percent_decoded(text: &str) -> String {
    url::form_urlencoded::parse(format!("x={text}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned())
        .unwrap_or_default()
}

/// The byte ranges of secret values in a libpq `key=value` string (values
/// bare, or single-quoted with backslash escapes).
fn conninfo_secrets(text: &str) -> Vec<(std::ops::Range<usize>, &str)> {
    let bytes = text.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let key_start = i;
        while i < bytes.len() && !bytes[i].is_ascii_whitespace() && bytes[i] != b'=' {
            i += 1;
        }
        let key = &text[key_start..i];
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        if i >= bytes.len() || bytes[i] != b'=' {
            continue;
        }
        i += 1;
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let value_start = i;
        if i < bytes.len() && bytes[i] == b'\'' {
            i += 1;
            while i < bytes.len() && bytes[i] != b'\'' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(bytes.len());
        } else {
            while i < bytes.len() && !bytes[i].is_ascii_whitespace() {
                i += 1;
            }
        }
        if is_secret_key(key) {
            let value = &text[value_start..i];
            found.push((value_start..i, value.trim_matches('\'')));
        }
    }
    found
}

fn redact_conninfo(text: &str) -> String {
    let mut out = text.to_owned();
    for (range, _) in conninfo_secrets(text).into_iter().rev() {
        out.replace_range(range, "***");
    }
    out
}

/// A duration as `humantime` reads it (the fake provider's flags read them
/// the same way): `500ms`, `90s`, `10m`, `24h`, `30d`, `1h30m`. A bare
/// number is refused, because its unit would be a guess.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|e| format!("`{text}` is not a duration ({e}): write e.g. 90s, 10m, 24h or 30d"))
}

/// Checks a cron expression with the scheduler's own parser (six fields,
/// seconds first), so a bad schedule stops the process before it touches
/// the database.
pub fn parse_cron(text: &str) -> Result<String, String> {
    tokio_cron_scheduler::Job::new_async(text, |_, _| Box::pin(async {}))
        .map(|_| text.to_owned())
        .map_err(|_| {
            format!(
                "`{text}` is not a cron expression: six fields with seconds, e.g. `0 */10 * * * *`"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_in_every_unit() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("30d"), Ok(Duration::from_secs(30 * 86_400)));
        assert_eq!(parse_duration(" 2s "), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
    }

    #[test]
    fn durations_without_a_number_or_unit_or_with_an_unknown_unit_are_refused() {
        for bad in ["", "s", "10", "10x", "-1s", "1y2"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn overflowing_durations_are_refused_not_wrapped() {
        assert!(parse_duration("99999999999999999999s").is_err());
        assert!(parse_duration(&format!("{}d", u64::MAX / 2)).is_err());
    }

    #[test]
    fn cron_expressions_need_six_fields_with_seconds() {
        assert!(parse_cron("0 */10 * * * *").is_ok());
        assert!(parse_cron("*/10 * * * *").is_err());
        assert!(parse_cron("every minute").is_err());
    }

    #[test]
    fn passwords_are_redacted_from_database_urls() {
        assert_eq!(
            redact_url("postgres://cobro:s3cret@db:5432/cobro"),
            "postgres://cobro:***@db:5432/cobro"
        );
        assert_eq!(
            redact_url("sqlite://./data/cobro.db"),
            "sqlite://./data/cobro.db"
        );
        assert_eq!(
            redact_url("postgres://u:x@db:notaport/c"),
            "<unparsable URL>"
        );
    }

    #[test]
    fn query_and_keyword_passwords_are_redacted_too() {
        assert_eq!(
            redact_url("postgres://db/cobro?user=cobro&password=s3cret&sslmode=require"),
            "postgres://db/cobro?user=cobro&password=***&sslmode=require"
        );
        assert_eq!(
            redact_url("host=db user=cobro password=s3cret dbname=cobro"),
            "host=db user=cobro password=*** dbname=cobro"
        );
        assert_eq!(
            redact_url("host=db password = 'with space\\' q' sslpassword=k2"),
            "host=db password = *** sslpassword=***"
        );
    }

    #[test]
    fn every_form_of_secret_is_masked_in_any_text() {
        // Each secret as a library might echo it: as written, and decoded.
        for (url, forms) in [
            (
                "postgres://cobro:s3cr%40t@db/cobro",
                &["s3cr%40t", "s3cr@t"][..],
            ),
            (
                "postgres://db/cobro?password=s3cr%40t",
                &["s3cr%40t", "s3cr@t"],
            ),
            ("host=db password=s3cr@t", &["s3cr@t"]),
            ("host=db password='s3cr @t'", &["s3cr @t"]),
        ] {
            for form in forms {
                let text = format!("could not connect: password {form} refused");
                let masked = mask_secrets(&text, Some(url));
                assert_eq!(masked, "could not connect: password *** refused", "{url}");
            }
        }
        assert_eq!(mask_secrets("nothing", None), "nothing");
    }

    fn settings(database_url: Option<&str>) -> GlobalSettings {
        GlobalSettings {
            database_url: database_url.map(str::to_owned),
            data_dir: PathBuf::from("/tmp/cobro-data"),
            log_format: LogFormat::Plain,
            log_filter: None,
            verbose: 0,
            db_max_connections: 10,
            lock_timeout: Duration::from_secs(2),
            db_deadline: Duration::from_secs(10),
        }
    }

    #[test]
    fn no_database_url_means_the_embedded_sqlite_file_in_the_data_dir() {
        let target = settings(None).database().expect("resolves");
        assert_eq!(
            target.embedded_file(),
            Some(PathBuf::from("/tmp/cobro-data/cobro.db"))
        );
        assert_eq!(target.url(), "sqlite:///tmp/cobro-data/cobro.db");
    }

    #[test]
    fn unparsable_or_foreign_database_urls_are_refused_without_echoing_them() {
        let error = settings(Some("postgres://u:hunter2@db:notaport/x"))
            .database()
            .expect_err("bad port");
        assert!(!error.to_string().contains("hunter2"), "{error}");
        let error = settings(Some("mysql://db/x"))
            .database()
            .expect_err("bad scheme");
        assert!(error.to_string().contains("unsupported scheme"), "{error}");
    }
}
