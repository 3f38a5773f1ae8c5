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
