//! Logging, set up once per process: `tracing` events to stderr, plain or
//! JSON, filtered by `COBRO_LOG` (`RUST_LOG` syntax).
//!
//! What never reaches a log: tokens, idempotency keys, request bodies,
//! payment methods, database passwords. The HTTP layer (see `serve`) records
//! only method, path, status, latency and the request id.

use crate::settings::{GlobalSettings, LogFormat};
use anyhow::Context;
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. Fails on an invalid filter.
pub fn init(global: &GlobalSettings) -> anyhow::Result<()> {
    let filter = EnvFilter::try_new(&global.log_filter).with_context(|| {
        format!(
            "COBRO_LOG (--log) is not a valid filter: `{}`",
            global.log_filter
        )
    })?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let installed = match global.log_format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
    installed.map_err(|e| anyhow::anyhow!("could not install the log subscriber: {e}"))
}
