//! The `cobro` binary: parses the command line, sets up logging, runs the
//! subcommand, and turns an error into a message on stderr and exit code 1.
//!
//! Layout: `cli` (subcommands and dispatch), `settings` (typed flags and
//! environment), `telemetry` (logs, traces, metrics), `database` (opening the store),
//! `serve` (HTTP server, shutdown, scheduled purge), `demo` (the embedded
//! default), `admin` (operator commands), `purge` (retention), `token` (API
//! tokens), `worker` (the outbox worker and the provider), `events` (the event
//! dispatcher and `cobro events`), `output` (the stdout contract).

mod admin;
mod cli;
mod database;
mod demo;
mod events;
mod output;
mod purge;
mod reconcile;
mod serve;
mod settings;
mod telemetry;
mod token;
mod worker;

use clap::Parser;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let database_url = cli.global.database_url.clone();
    let outcome = match telemetry::init(&cli.global, &cli.log_filter()) {
        Ok(telemetry) => {
            let outcome = cli::run(cli).await;
            telemetry.shutdown().await;
            outcome
        }
        Err(error) => Err(error),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Whatever library wrote the message, no database secret leaves.
            let message = settings::mask_secrets(&format!("{error:#}"), database_url.as_deref());
            eprintln!("cobro: error: {message}");
            // Exit 3: the command worked, but uncertain payments remain
            // (2 is clap's usage error, 1 any other error; cli::EXIT_CODES).
            match error.downcast_ref::<reconcile::Unresolved>() {
                Some(_) => ExitCode::from(reconcile::EXIT_UNRESOLVED),
                None => ExitCode::FAILURE,
            }
        }
    }
}
