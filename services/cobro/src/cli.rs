//! The command line: one binary, one subcommand per job.
//!
//! Layout:
//! - [`Cli`]: the settings every subcommand shares (database, logging)
//!   plus the subcommand.
//! - [`Command`]: `serve`, `worker`, `reconcile`, `payments`, `migrate`,
//!   `accounts`, `tokens`, `purge`, `events`. Each command's own arguments live in the
//!   module that runs it (`serve::ServeArgs`, `worker::WorkerArgs`,
//!   `reconcile::ReconcileArgs`, `admin::TokensCommand`, ...), so a flag is
//!   accepted only by the commands that use it.
//! - [`run`]: dispatches a parsed command to its module.
//! - [`EXIT_CODES`]: the exit status contract, shown by `cobro --help`.

use crate::settings::GlobalSettings;
use crate::{admin, payments, reconcile, serve, worker};
use clap::{Parser, Subcommand};

/// The exit status of every command (also in ops/RUNBOOK.md).
pub const EXIT_CODES: &str = "\
Exit status (every command):
  0  success
  1  error: the message is on stderr
  2  usage error: an unknown flag or a bad value (nothing ran)
  3  reconcile: the run worked, but attempts are still unresolved
     (unknown, in review, in conflict, or candidates left past --max);
     books: the run worked, but objects or attempts are not matched
     (orphan, drifted or missing)

Results go to stdout (--json: one JSON document), logs to stderr.";

/// cobro: payment orchestration. Settings come from flags or `COBRO_*`
/// environment variables; logs go to stderr, results to stdout.
#[derive(Debug, Parser)]
#[command(name = "cobro", version, propagate_version = true, after_help = EXIT_CODES)]
pub struct Cli {
    // Under their own heading, so each command's help shows its own flags first.
    #[command(flatten, next_help_heading = "Global options (every command)")]
    pub global: GlobalSettings,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the HTTP API (migrates first unless --no-migrate). Without a
    /// database URL: the embedded SQLite demo setup with a dev token.
    Serve(Box<serve::ServeArgs>),
    /// Apply the database migrations of this binary.
    Migrate(admin::MigrateArgs),
    /// Manage merchant accounts.
    #[command(subcommand)]
    Accounts(admin::AccountsCommand),
    /// Manage API tokens: create (optionally expiring), list, revoke.
    #[command(subcommand)]
    Tokens(admin::TokensCommand),
    /// Apply the retention contract once: compact old idempotency records to
    /// tombstones, delete expired tombstones and webhook event ids
    /// (--dry-run: count them, change nothing).
    Purge(admin::PurgeArgs),
    /// Run the outbox worker alone (several may share one PostgreSQL):
    /// every provider call, with leases and fencing tokens.
    Worker(Box<worker::WorkerArgs>),
    /// Ask the provider about every uncertain attempt and apply what it
    /// proves (audited). Exit code 0: nothing left unresolved; 3: some
    /// attempts are still unknown or need review.
    #[command(after_help = EXIT_CODES)]
    Reconcile(Box<reconcile::ReconcileArgs>),
    /// The books: list every object the provider holds in a window and
    /// match it against cobro's attempts (matched, orphan, foreign,
    /// drifted, missing); `orphans`, `acknowledge` and `runs` for what it
    /// found. Exit code 0: everything matched (foreign objects are only
    /// reported); 3: something is not.
    #[command(after_help = EXIT_CODES)]
    Books(Box<crate::books::BooksArgs>),
    /// Look at payments (any status, with their attempts and audit trail)
    /// and resolve the ones in `needs_review` by hand.
    #[command(subcommand)]
    Payments(payments::PaymentsCommand),
    /// Events to merchants: list, resend, and the endpoints they go to.
    #[command(subcommand)]
    Events(crate::events::EventsCommand),
    /// Routing across providers: an account's rules, and each provider's
    /// circuit and health.
    #[command(subcommand)]
    Routing(crate::routing::RoutingCommand),
}

impl Cli {
    /// The log filter: `RUST_LOG` if set, else `--log`/`COBRO_LOG`, else by
    /// command: the long-running processes log INFO (`-v`: DEBUG), the
    /// operator commands only warnings (`-v`: INFO, `-vv`: DEBUG), so a
    /// script reads results on stdout and a human sees only what matters.
    pub fn log_filter(&self) -> String {
        if let Ok(filter) = std::env::var("RUST_LOG")
            && !filter.trim().is_empty()
        {
            return filter;
        }
        if let Some(filter) = &self.global.log_filter {
            return filter.clone();
        }
        let long_running = matches!(self.command, Command::Serve(_) | Command::Worker(_));
        let levels: &[&str] = if long_running {
            &["info", "debug"]
        } else {
            &["warn", "info", "debug"]
        };
        let chosen = usize::from(self.global.verbose).min(levels.len() - 1);
        levels[chosen].to_owned()
    }
}

/// Runs the parsed command to completion.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let global = &cli.global;
    match cli.command {
        Command::Serve(args) => serve::run(global, &args).await,
        Command::Worker(args) => worker::run_alone(global, &args).await,
        Command::Migrate(args) => admin::migrate(global, &args).await,
        Command::Accounts(command) => admin::accounts(global, command).await,
        Command::Tokens(command) => admin::tokens(global, command).await,
        Command::Purge(args) => admin::purge(global, &args).await,
        Command::Reconcile(args) => reconcile::run(global, &args).await,
        Command::Payments(command) => payments::run(global, command).await,
        Command::Books(args) => crate::books::run(global, *args).await,
        Command::Events(command) => crate::events::run(global, command).await,
        Command::Routing(command) => crate::routing::run(global, command).await,
    }
}

/// The exit status for an error (see [`EXIT_CODES`]): 3 when the command
/// worked but uncertain payments remain, 1 for anything else (2, a usage
/// error, is clap's own).
pub fn exit_code(error: &anyhow::Error) -> std::process::ExitCode {
    let unresolved = error.downcast_ref::<reconcile::Unresolved>().is_some()
        || error.downcast_ref::<crate::books::Unmatched>().is_some();
    if unresolved {
        std::process::ExitCode::from(reconcile::EXIT_UNRESOLVED)
    } else {
        std::process::ExitCode::FAILURE
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

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("cobro").chain(args.iter().copied()))
    }

    #[test]
    fn provider_and_reconcile_flags_belong_to_the_commands_that_use_them() {
        for refused in [
            &["migrate", "--provider-timeout", "5s"][..],
            &[
                "accounts",
                "create",
                "--name",
                "a",
                "--provider-url",
                "http://p",
            ],
            &["tokens", "list", "--provider-search-lag", "1s"],
            &["purge", "--reconcile-escalate-after", "1h"],
            &["payments", "list", "--provider-url", "http://p"],
            &["reconcile", "--worker-lease", "1s"],
        ] {
            let error = parse(refused).expect_err("refused");
            assert_eq!(error.exit_code(), 2, "{refused:?}: a usage error");
        }
        for accepted in [
            &[
                "reconcile",
                "--provider-timeout",
                "5s",
                "--provider-search-lag",
                "1s",
            ][..],
            &[
                "serve",
                "--provider-key-retention",
                "2h",
                "--reconcile-no-retry",
            ],
            &[
                "worker",
                "--provider-url",
                "http://p",
                "--worker-lease",
                "9s",
            ],
            &[
                "payments",
                "resolve",
                "p",
                "--attempt",
                "a",
                "--outcome",
                "failed",
                "--reason",
                "r",
                "--provider-url",
                "http://p",
            ],
            &["migrate", "--json", "-v"],
        ] {
            parse(accepted).unwrap_or_else(|e| panic!("{accepted:?}: {e}"));
        }
    }

    #[test]
    fn accounts_create_help_lists_only_its_own_and_the_shared_options() {
        let mut command = Cli::command();
        let create = command
            .find_subcommand_mut("accounts")
            .and_then(|a| a.find_subcommand_mut("create"))
            .expect("accounts create");
        let help = create.render_long_help().to_string();
        // It names a provider (checked against the providers file), but
        // takes none of the provider's connection settings.
        assert!(!help.contains("--provider-"), "{help}");
        assert!(help.contains("--provider <NAME>") && help.contains("--providers-file"));
        assert!(!help.contains("--reconcile"), "{help}");
        assert!(help.contains("--name") && help.contains("--json"), "{help}");
    }

    #[test]
    fn the_help_documents_every_exit_code() {
        let help = Cli::command().render_long_help().to_string();
        for code in ["0  success", "1  error", "2  usage error", "3  reconcile"] {
            assert!(help.contains(code), "{code}: {help}");
        }
    }

    #[test]
    fn operator_commands_log_warnings_only_unless_verbose() {
        // A filter in the environment of the test run wins by design.
        if std::env::var_os("RUST_LOG").is_some() || std::env::var_os("COBRO_LOG").is_some() {
            return;
        }
        let filter = |args: &[&str]| parse(args).expect("parses").log_filter();
        assert_eq!(filter(&["migrate"]), "warn");
        assert_eq!(filter(&["-v", "migrate"]), "info");
        assert_eq!(filter(&["tokens", "list", "-vv"]), "debug");
        assert_eq!(filter(&["serve"]), "info");
        assert_eq!(filter(&["serve", "-v"]), "debug");
        assert_eq!(
            filter(&["--log", "cobro=trace", "migrate", "-v"]),
            "cobro=trace"
        );
    }
}
