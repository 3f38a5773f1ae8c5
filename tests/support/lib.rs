//! Shared helpers for cobro's integration tests: fresh databases on both
//! backends, dropped when the test ends (also when it panics).

use chrono::{DateTime, TimeZone, Utc};
use cobro_store::{Store, StoreConfig};
use sqlx::Connection;
use std::path::PathBuf;

/// Which backend a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

/// A fresh, migrated database that disappears with this value.
pub struct TestDb {
    pub store: Store,
    pub url: String,
    cleanup: Cleanup,
}

enum Cleanup {
    Postgres { admin_url: String, name: String },
    Sqlite { dir: PathBuf },
}

/// The superuser URL of the throwaway cluster started by `ops/test.sh`.
/// PostgreSQL tests fail (never skip) without it: a suite that silently
/// skipped its production backend would prove nothing.
pub fn postgres_admin_url() -> String {
    std::env::var("COBRO_TEST_PG_URL").unwrap_or_else(|_| {
        panic!("COBRO_TEST_PG_URL is not set: run the suite with ops/test.sh, which starts a throwaway PostgreSQL")
    })
}

impl TestDb {
    pub async fn new(backend: Backend) -> Self {
        Self::with_config(backend, |_| {}).await
    }

    /// A fresh database whose store config `tweak` may adjust (pool size,
    /// lock timeout).
    pub async fn with_config(backend: Backend, tweak: impl FnOnce(&mut StoreConfig)) -> Self {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let (url, cleanup) = match backend {
            Backend::Postgres => {
                let admin_url = postgres_admin_url();
                let name = format!("cobro_test_{suffix}");
                let mut admin = sqlx::PgConnection::connect(&admin_url)
                    .await
                    .expect("connect to the throwaway PostgreSQL");
                sqlx::query(&format!("CREATE DATABASE {name}"))
                    .execute(&mut admin)
                    .await
                    .expect("create test database");
                let base = admin_url
                    .rsplit_once('/')
                    .map(|(b, _)| b)
                    .unwrap_or(&admin_url);
                (
                    format!("{base}/{name}"),
                    Cleanup::Postgres { admin_url, name },
                )
            }
            Backend::Sqlite => {
                let dir = std::env::temp_dir().join(format!("cobro-test-{suffix}"));
                std::fs::create_dir_all(&dir).expect("temp dir");
                (
                    format!("sqlite://{}", dir.join("cobro.db").display()),
                    Cleanup::Sqlite { dir },
                )
            }
        };
        let mut config = StoreConfig::new(url.clone());
        tweak(&mut config);
        let store = Store::connect(&config).await.expect("connect test store");
        store.migrate().await.expect("migrate test store");
        TestDb {
            store,
            url,
            cleanup,
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        match &self.cleanup {
            Cleanup::Sqlite { dir } => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Cleanup::Postgres { admin_url, name } => {
                // Drop runs outside any runtime guarantee (and possibly while
                // panicking), so use a private thread and runtime.
                let (admin_url, name) = (admin_url.clone(), name.clone());
                let _ = std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("runtime");
                    rt.block_on(async move {
                        if let Ok(mut admin) = sqlx::PgConnection::connect(&admin_url).await {
                            let _ = sqlx::query(&format!(
                                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                            ))
                            .execute(&mut admin)
                            .await;
                        }
                    });
                })
                .join();
            }
        }
    }
}

/// A fixed starting instant for tests that drive a manual clock.
pub fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0)
        .single()
        .expect("valid instant")
}

/// Generates one `#[tokio::test]` per backend for each listed async test
/// function taking a `Backend`: the conformance-suite pattern.
#[macro_export]
macro_rules! on_both_backends {
    ($($test:ident),+ $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test($crate::Backend::Postgres).await;
                }
            )+
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    super::$test($crate::Backend::Sqlite).await;
                }
            )+
        }
    };
}
