//! The embedded demo default: with no database URL, `serve` runs on SQLite in
//! the data directory, with an account named `demo` and a fresh dev token
//! printed once in a banner, so `cobro serve` alone is enough to try the API.
//!
//! Nothing here runs when a database URL is configured.

use crate::output::say;
use crate::token;
use anyhow::Context;
use chrono::{DateTime, Utc};
use cobro_store::Store;
use std::net::SocketAddr;
use std::path::Path;

/// The name of the demo account.
pub const DEMO_ACCOUNT: &str = "demo";

/// Ensures the demo account exists and issues a new dev token for it; the
/// secret is returned for the banner only. A fresh token each start, because
/// the previous one was shown once and is not recoverable.
pub async fn prepare(store: &Store, now: DateTime<Utc>) -> anyhow::Result<String> {
    let account = match store.find_account_by_name(DEMO_ACCOUNT).await? {
        Some(id) => id,
        None => store
            .create_account(DEMO_ACCOUNT, now)
            .await
            .context("could not create the demo account")?,
    };
    token::issue(store, account, "dev (embedded demo)", now)
        .await
        .context("could not create the dev token")
}

/// Prints the banner: where to send requests, the dev token, a curl to paste.
pub fn print_banner(address: SocketAddr, database: &Path, dev_token: &str) -> anyhow::Result<()> {
    let rule = "=".repeat(78);
    say(format_args!(
        "{rule}\n\
         EMBEDDED DEMO SETUP: SQLite at {}, demo account, dev token.\n\
         Not for production: set COBRO_DATABASE_URL to use PostgreSQL.\n\
         {rule}\n\
         url: http://{address}\n\
         dev token: {dev_token}\n\
         try:\n  \
         export URL=http://{address} TOKEN={dev_token}\n  \
         curl -X POST $URL/v1/payments -H \"Authorization: Bearer $TOKEN\" \
         -H \"Idempotency-Key: $(uuidgen)\" -H 'content-type: application/json' \
         -d '{{\"order_ref\":\"pedido-842\",\"amount\":1999,\"currency\":\"EUR\",\"payment_method\":\"pm_card_visa\"}}'\n\
         {rule}",
        database.display()
    ))
}
