//! The command line: one binary, one subcommand per job.
//!
//! Layout:
//! - [`Cli`]: global settings plus the subcommand.
//! - [`Command`]: `serve`, `worker`, `reconcile`, `payments`, `migrate`,
//!   `accounts`, `tokens`, `purge`, `events`.
//! - [`run`]: dispatches a parsed command to its module.

use crate::settings::{
    DEFAULT_PURGE_BATCH, GlobalSettings, ProviderSettings, ReconcileSettings, RetentionSettings,
    ServeSettings, WorkerSettings,
};
use crate::{admin, events, reconcile, serve, worker};
use clap::{Args, Parser, Subcommand};

/// cobro: payment orchestration. Settings come from flags or `COBRO_*`
/// environment variables; logs go to stderr, results to stdout.
#[derive(Debug, Parser)]
#[command(name = "cobro", version, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalSettings,

    #[command(flatten)]
    pub provider: ProviderSettings,

    #[command(flatten)]
    pub reconcile: ReconcileSettings,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the HTTP API (migrates first unless --no-migrate). Without a
    /// database URL: the embedded SQLite demo setup with a dev token.
    Serve(ServeSettings),
    /// Apply the database migrations of this binary.
    Migrate,
    /// Manage merchant accounts.
    #[command(subcommand)]
    Accounts(AccountsCommand),
    /// Manage API tokens.
    #[command(subcommand)]
    Tokens(TokensCommand),
    /// Apply the retention contract once: compact old idempotency records to
    /// tombstones, delete expired tombstones and webhook event ids.
    Purge(PurgeArgs),
    /// Run the outbox worker alone (several may share one PostgreSQL):
    /// every provider call, with leases and fencing tokens.
    Worker(WorkerArgs),
    /// Ask the provider about every uncertain attempt and apply what it
    /// proves (audited). Exit code 0: nothing left unresolved; 2: some
    /// attempts are still unknown or need review.
    Reconcile(reconcile::ReconcileArgs),
    /// Look at payments and resolve the ones in `needs_review` by hand.
    #[command(subcommand)]
    Payments(reconcile::PaymentsCommand),
    /// Events to merchants: list, resend, and the endpoints they go to.
    #[command(subcommand)]
    Events(events::EventsCommand),
}

#[derive(Debug, Subcommand)]
pub enum AccountsCommand {
    /// Create an account; prints its id on stdout.
    Create {
        /// The account's unique name, e.g. `acme`.
        #[arg(long)]
        name: String,
    },
    /// List accounts: id, name, creation time.
    List,
}

#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Create an API token; prints it ONCE on stdout (only its hash is stored).
    Create {
        /// The account, by name or id.
        #[arg(long, value_name = "NAME_OR_ID")]
        account: String,
        /// What the token is for, e.g. `checkout-prod`.
        #[arg(long, default_value = "")]
        label: String,
    },
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub worker: WorkerSettings,

    #[command(flatten)]
    pub schedule: crate::settings::ReconcileSchedule,

    #[command(flatten)]
    pub dispatcher: events::DispatcherSettings,

    /// After SIGTERM or SIGINT, how long in-flight calls may run.
    #[arg(long, env = "COBRO_SHUTDOWN_GRACE", default_value = "10s",
          value_parser = crate::settings::parse_duration)]
    pub shutdown_grace: std::time::Duration,

    /// Serve `GET /metrics` (this worker's provider calls, retries and
    /// leases, and the database's view) on this address; port 0 picks one.
    /// Without it a lone worker's counters are not exposed.
    #[arg(long, env = "COBRO_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
}

#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Rows per batch; batches repeat until one comes back short.
    #[arg(long, default_value_t = DEFAULT_PURGE_BATCH, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch: u32,

    #[command(flatten)]
    pub retention: RetentionSettings,
}

/// Runs the parsed command to completion.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let global = &cli.global;
    match cli.command {
        Command::Serve(settings) => {
            serve::run(global, &cli.provider, &cli.reconcile, &settings).await
        }
        Command::Worker(args) => {
            worker::run_alone(global, &cli.provider, &cli.reconcile, &args).await
        }
        Command::Migrate => admin::migrate(global).await,
        Command::Accounts(AccountsCommand::Create { name }) => {
            admin::create_account(global, &name).await
        }
        Command::Accounts(AccountsCommand::List) => admin::list_accounts(global).await,
        Command::Tokens(TokensCommand::Create { account, label }) => {
            admin::create_token(global, &account, &label).await
        }
        Command::Purge(args) => admin::purge(global, &args.retention, args.batch).await,
        Command::Reconcile(args) => {
            reconcile::run(global, &cli.provider, &cli.reconcile, &args).await
        }
        Command::Payments(command) => reconcile::payments(global, &cli.provider, command).await,
        Command::Events(command) => events::run(global, command).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
