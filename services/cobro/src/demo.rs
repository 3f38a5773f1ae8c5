//! The embedded demo default: with no database URL, `serve` runs on SQLite in
//! the data directory, with an account named `demo` and a dev token printed
//! in a banner, so `cobro serve` alone is enough to try the API.
//!
//! The dev token is kept in `<data-dir>/demo-token` (mode 0600, next to the
//! database it opens) and reused on every start while the API still accepts
//! it, so a restart does not add a token each time or break a pasted
//! `TOKEN=`. Revoke it (`cobro tokens revoke`) or delete the file, and the
//! next start issues a new one.
//!
//! Nothing here runs when a database URL is configured.

use crate::output::say;
use crate::settings::GlobalSettings;
use crate::token;
use anyhow::Context;
use chrono::{DateTime, Utc};
use cobro_store::Store;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;

/// The name of the demo account.
pub const DEMO_ACCOUNT: &str = "demo";

/// The file in the data directory that keeps the dev token.
pub const DEMO_TOKEN_FILE: &str = "demo-token";

/// Ensures the demo account exists and returns its dev token (for the
/// banner only): the kept one while it is live for that account, else a
/// new one, which is then kept.
pub async fn prepare(
    store: &Store,
    global: &GlobalSettings,
    now: DateTime<Utc>,
) -> anyhow::Result<String> {
    let account = match store.find_account_by_name(DEMO_ACCOUNT).await? {
        Some(id) => id,
        None => store
            .create_account(DEMO_ACCOUNT, now)
            .await
            .context("could not create the demo account")?,
    };
    let file = global.data_dir.join(DEMO_TOKEN_FILE);
    if let Ok(kept) = std::fs::read_to_string(&file) {
        let kept = kept.trim();
        let owner = store
            .account_for_token_at(&token::token_hash(kept), now)
            .await?;
        if owner == Some(account) {
            return Ok(kept.to_owned());
        }
        tracing::info!("the kept dev token is no longer accepted; issuing a new one");
    }
    let issued = token::issue(store, account, "dev (embedded demo)", now, None)
        .await
        .context("could not create the dev token")?;
    keep(&file, &issued.secret)
        .with_context(|| format!("could not keep the dev token in {}", file.display()))?;
    Ok(issued.secret)
}

/// Writes the token to `file`, readable by its owner only.
fn keep(file: &Path, secret: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(file)?;
    writeln!(out, "{secret}")?;
    out.sync_all()
}

/// Prints the banner: where to send requests, the dev token, a curl to
/// paste (the same lines as the README's "Try it", tested as pasted).
pub fn print_banner(address: SocketAddr, database: &Path, dev_token: &str) -> anyhow::Result<()> {
    let rule = "=".repeat(78);
    say(format_args!(
        "{rule}\n\
         EMBEDDED DEMO SETUP: SQLite at {}, demo account, dev token.\n\
         Not for production: set COBRO_DATABASE_URL to use PostgreSQL.\n\
         Event endpoints may be plain http on this machine here; with\n\
         COBRO_DATABASE_URL only https to public addresses (README, Events).\n\
         {rule}\n\
         url: http://{address}\n\
         dev token: {dev_token}\n\
         try (a new Idempotency-Key per new request; the same one on its retries):\n  \
         export URL=http://{address} TOKEN={dev_token}\n  \
         KEY=$(cat /proc/sys/kernel/random/uuid 2>/dev/null || uuidgen)\n  \
         curl -s -X POST $URL/v1/payments -H \"Authorization: Bearer $TOKEN\" \
         -H \"Idempotency-Key: $KEY\" -H 'content-type: application/json' \
         -d '{{\"order_ref\":\"pedido-842\",\"amount\":1999,\"currency\":\"EUR\",\"payment_method\":\"pm_card_visa\"}}'\n\
         {rule}",
        database.display()
    ))
}
