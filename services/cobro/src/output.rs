//! What the binary promises on stdout. Logs go to stderr; stdout carries only
//! results a script or test harness reads (ids, tokens, the listening line),
//! each flushed at once so a reader never waits on a buffer.

use anyhow::Context;
use std::fmt::Display;
use std::io::Write;

/// Writes `text` and a newline to stdout and flushes.
pub fn say(text: impl Display) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{text}")
        .and_then(|()| stdout.flush())
        .context("could not write to stdout")
}
