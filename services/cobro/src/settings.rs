//! Typed settings, read once at start from flags and `COBRO_*` environment
//! variables (a flag wins over its variable).
//!
//! Layout:
//! - [`GlobalSettings`]: what every subcommand needs (database, logging).
//! - [`ServeSettings`]: the HTTP server and its scheduled purge.
//! - [`RetentionSettings`]: the retention contract (spec section 8), shared
//!   by `serve` (scheduled purge, replay of tombstones) and `purge`.
//! - [`DatabaseTarget`]: the database URL resolved and checked, or the
//!   embedded SQLite default.
//!
//! Values that clap can check (durations, addresses, numbers) are parsed by
//! clap, so a bad value stops the process before anything is touched. The
//! database URL is checked here rather than by clap because clap's error
//! would echo the value, and a URL can carry a password.

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use cobro_api::WebhookSecret;
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

    /// Log filter in `RUST_LOG` syntax, e.g. `info` or `cobro=debug,sqlx=warn`.
    #[arg(long = "log", env = "COBRO_LOG", default_value = "info", global = true)]
    pub log_filter: String,

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

    /// How far a webhook signature's timestamp may be from now before the
    /// delivery is refused as a possible replay.
    #[arg(long, env = "COBRO_WEBHOOK_TOLERANCE", default_value = "300s", value_parser = parse_duration)]
    pub webhook_tolerance: Duration,

    /// Requests per second per account in this process (0: no limit);
    /// over it: 429 `rate-limited`, never stored against a key.
    #[arg(long, env = "COBRO_RATE_LIMIT", default_value_t = 200)]
    pub rate_limit: u32,

    /// Burst of requests an account may send above the rate.
    #[arg(long, env = "COBRO_RATE_LIMIT_BURST", default_value_t = 400)]
    pub rate_limit_burst: u32,

    #[command(flatten)]
    pub retention: RetentionSettings,

    /// Do not run the outbox worker inside `serve` (run `cobro worker`
    /// processes instead).
    #[arg(long, env = "COBRO_NO_WORKER")]
    pub no_worker: bool,

    #[command(flatten)]
    pub worker: WorkerSettings,

    #[command(flatten)]
    pub schedule: ReconcileSchedule,

    #[command(flatten)]
    pub dispatcher: crate::events::DispatcherSettings,
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

/// The payment provider and how the worker talks to it.
#[derive(Args, Clone, Debug)]
pub struct ProviderSettings {
    /// The provider's base URL. Unset: `serve` starts the embedded fake
    /// provider on loopback (no real money moves); `worker` refuses to start.
    #[arg(long, env = "COBRO_PROVIDER_URL", global = true)]
    pub provider_url: Option<String>,

    /// cobro's API key at the provider (scopes its idempotency keys).
    #[arg(
        long,
        env = "COBRO_PROVIDER_API_KEY",
        default_value = "sk_test_cobro",
        hide_env_values = true,
        global = true
    )]
    pub provider_api_key: String,

    /// How long the provider remembers an idempotency key. The worker never
    /// sends an attempt later than first send + this - the safety margin.
    #[arg(long, env = "COBRO_PROVIDER_KEY_RETENTION", default_value = "24h",
          value_parser = parse_duration, global = true)]
    pub provider_key_retention: Duration,

    /// Margin kept before the end of the provider's key window.
    #[arg(long, env = "COBRO_PROVIDER_KEY_SAFETY_MARGIN", default_value = "1h",
          value_parser = parse_duration, global = true)]
    pub provider_key_safety_margin: Duration,

    /// Connect timeout of a provider call (a failure here proves nothing was sent).
    #[arg(long, env = "COBRO_PROVIDER_CONNECT_TIMEOUT", default_value = "2s",
          value_parser = parse_duration, global = true)]
    pub provider_connect_timeout: Duration,

    /// Total timeout of a provider call (after it the outcome is unknown).
    #[arg(long, env = "COBRO_PROVIDER_TIMEOUT", default_value = "10s",
          value_parser = parse_duration, global = true)]
    pub provider_timeout: Duration,
}

/// How the reconciler decides (shared by `serve`'s schedule and `cobro reconcile`).
#[derive(Args, Clone, Debug)]
pub struct ReconcileSettings {
    /// The provider's documented search consistency delay: "not found" is
    /// proof of no effect only once this long has passed since the last send.
    #[arg(long, env = "COBRO_PROVIDER_SEARCH_LAG", default_value = "60s", value_parser = parse_duration, global = true)]
    pub provider_search_lag: Duration,

    /// Unknown attempts not sent for this long, and captures, voids and
    /// refunds waiting this long, are examined too.
    #[arg(long, env = "COBRO_RECONCILE_STUCK_AFTER", default_value = "5m", value_parser = parse_duration, global = true)]
    pub reconcile_stuck_after: Duration,

    /// Unresolved this long after the first send: `needs_review`.
    #[arg(long, env = "COBRO_RECONCILE_ESCALATE_AFTER", default_value = "24h", value_parser = parse_duration, global = true)]
    pub reconcile_escalate_after: Duration,

    /// After proof of no effect, fail the payment instead of scheduling a
    /// new attempt with a new provider key.
    #[arg(long, env = "COBRO_RECONCILE_NO_RETRY", global = true)]
    pub reconcile_no_retry: bool,
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
}

/// Rows per purge batch: small enough that no batch holds locks for long.
pub const DEFAULT_PURGE_BATCH: u32 = 500;

/// The retention contract (spec section 8).
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
        config
    }
}

/// `url` with its password (if any) replaced by `***`.
fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            // Only fails for URLs that cannot have a password, which this one has.
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        Ok(_) => url.to_owned(),
        Err(_) => "<unparsable URL>".to_owned(),
    }
}

/// Parses `90s`, `10m`, `24h`, `30d` (and `500ms`): one whole number and a
/// unit. Deliberately small: retention and timeouts need nothing finer, and a
/// bare number is refused because its unit would be a guess.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    if number.is_empty() {
        return Err(format!(
            "`{text}` is not a duration: expected e.g. 90s, 10m, 24h or 30d"
        ));
    }
    let n: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is too large a duration"))?;
    let seconds_per_unit: u64 = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "" => {
            return Err(format!(
                "`{text}` has no unit: write e.g. {n}s, {n}m, {n}h or {n}d"
            ));
        }
        other => {
            return Err(format!(
                "`{text}` has the unknown unit `{other}`: use ms, s, m, h or d"
            ));
        }
    };
    n.checked_mul(seconds_per_unit)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("`{text}` is too large a duration"))
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
    }

    #[test]
    fn durations_without_a_number_or_unit_or_with_an_unknown_unit_are_refused() {
        for bad in ["", "s", "10", "10x", "1.5h", "-1s", "10 s", "1h30m"] {
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
        assert_eq!(redact_url("not a url"), "<unparsable URL>");
    }

    fn settings(database_url: Option<&str>) -> GlobalSettings {
        GlobalSettings {
            database_url: database_url.map(str::to_owned),
            data_dir: PathBuf::from("/tmp/cobro-data"),
            log_format: LogFormat::Plain,
            log_filter: "info".to_owned(),
            db_max_connections: 10,
            lock_timeout: Duration::from_secs(2),
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
