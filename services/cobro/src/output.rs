//! What the binary promises on stdout. Logs go to stderr; stdout carries only
//! results a script or test harness reads (ids, tokens, tables, the
//! listening line, or with `--json` exactly one JSON document), each flushed
//! at once so a reader never waits on a buffer.

use anyhow::Context;
use chrono::{DateTime, SecondsFormat, Utc};
use clap::Args;
use std::fmt::Display;
use std::io::Write;

/// `--json`, shared by every printing command.
#[derive(Args, Clone, Copy, Debug, Default)]
pub struct JsonFlag {
    /// Print one JSON document on stdout instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Writes `text` and a newline to stdout and flushes.
pub fn say(text: impl Display) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{text}")
        .and_then(|()| stdout.flush())
        .context("could not write to stdout")
}

/// Writes `value` as one pretty-printed JSON document (the `--json` form of
/// every command).
pub fn say_json(value: &serde_json::Value) -> anyhow::Result<()> {
    say(serde_json::to_string_pretty(value).context("could not render JSON")?)
}

/// An instant as operators read and scripts parse it: RFC 3339 UTC.
pub fn instant(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// An optional value in a table cell: the value, or `-`.
pub fn or_dash(value: Option<impl Display>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}
