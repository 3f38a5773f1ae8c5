//! Opening the store at start-up, with the schema policy of the caller and
//! error messages that say what to do. The URL in messages is redacted.

use crate::settings::{DatabaseTarget, GlobalSettings};
use anyhow::Context;
use cobro_store::{BackendKind, Store};

/// What to do about the schema once connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchemaPolicy {
    /// Apply this binary's migrations (refuses a newer schema).
    Migrate,
    /// Require exactly this binary's schema; change nothing.
    Require,
}

/// Connects to the configured database and applies `policy`. For the
/// embedded default the data directory is created first.
pub async fn open(
    global: &GlobalSettings,
    policy: SchemaPolicy,
) -> anyhow::Result<(Store, DatabaseTarget)> {
    let target = global.database()?;
    if let DatabaseTarget::Embedded { data_dir, .. } = &target {
        std::fs::create_dir_all(data_dir).with_context(|| {
            format!("could not create the data directory {}", data_dir.display())
        })?;
    }
    let where_ = target.redacted();
    let store = Store::connect(&global.store_config(&target))
        .await
        .with_context(|| format!("could not connect to the database at {where_}"))?;
    match policy {
        SchemaPolicy::Migrate => store
            .migrate()
            .await
            .with_context(|| format!("could not migrate the database at {where_}"))?,
        SchemaPolicy::Require => store
            .check_schema()
            .await
            .with_context(|| format!("the database at {where_} is not usable"))?,
    }
    tracing::info!(
        database = %where_,
        backend = ?store.backend(),
        schema_version = store.known_schema_version(),
        "database ready"
    );
    Ok((store, target))
}

/// Refuses a PostgreSQL pool that the connections this process holds for
/// as long as it runs would fill: `held` LISTEN connections (one per
/// worker for new work, one for the long polls' settled payments), plus at
/// least one for everything else. With fewer, the process started and
/// then never claimed (a worker) or answered a long poll with 503, logging
/// only a timeout every few seconds. SQLite holds none (no LISTEN).
pub fn require_pool(
    global: &GlobalSettings,
    store: &Store,
    held: usize,
    holders: &str,
) -> anyhow::Result<()> {
    let size = global.db_max_connections as usize;
    if store.backend() == BackendKind::Postgres && size <= held {
        anyhow::bail!(
            "COBRO_DB_MAX_CONNECTIONS (--db-max-connections) is {size}, but {holders} hold {held} \
             PostgreSQL connection(s) for as long as this process runs (LISTEN), which leaves none \
             for anything else: set it to at least {}",
            held + 1
        );
    }
    Ok(())
}

/// Refuses to start a process that sends when this host's clock is off the
/// database's by more than `max` (half the providers' smallest clock skew
/// allowance): its send times bound every proof of absence, all judged on
/// the database's clock (docs/proof-of-absence.md, "Times").
pub async fn check_clock(store: &Store, max: std::time::Duration) -> anyhow::Result<()> {
    check_clock_with(store, max, chrono::Utc::now).await
}

async fn check_clock_with(
    store: &Store,
    max: std::time::Duration,
    host_now: impl Fn() -> chrono::DateTime<chrono::Utc>,
) -> anyhow::Result<()> {
    let before = host_now();
    let database = store
        .database_now()
        .await
        .context("could not read the database's clock")?;
    let after = host_now();
    let half_trip = (after - before) / 2;
    let gap = database - (before + half_trip);
    let allowed = chrono::Duration::from_std(max).context("the clock bound is out of range")?;
    anyhow::ensure!(
        gap.abs() + half_trip <= allowed,
        "this host's clock is {:.3} s off the database's, more than the {} s allowed (half the smallest clock_skew of the providers): fix its time synchronisation (NTP) before it sends",
        -gap.as_seconds_f64(),
        max.as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod clock_tests {
    use super::*;
    use cobro_store::StoreConfig;

    #[tokio::test]
    async fn a_host_clock_off_the_databases_is_refused_and_one_on_it_accepted() {
        let dir = tempfile::tempdir().expect("dir");
        let url = format!("sqlite://{}", dir.path().join("clock.db").display());
        let store = Store::connect(&StoreConfig::new(url)).await.expect("store");
        let max = std::time::Duration::from_secs(5);
        check_clock_with(&store, max, chrono::Utc::now)
            .await
            .expect("the same clock");
        let ahead = || chrono::Utc::now() + chrono::Duration::seconds(60);
        let refused = check_clock_with(&store, max, ahead)
            .await
            .expect_err("a minute ahead");
        let text = refused.to_string();
        assert!(text.starts_with("this host's clock is 60."), "{text}");
        assert!(text.contains("more than the 5 s allowed"), "{text}");
    }
}
