//! The `cobro` binary: parses the command line, sets up telemetry, runs the
//! subcommand, and turns an error into a message on stderr and an exit
//! code. Everything else is in the library (src/lib.rs).

use clap::Parser;
use cobro::{cli, settings, telemetry};
use std::process::ExitCode;

/// mimalloc instead of glibc's malloc: a request allocates and frees
/// hundreds of small objects (headers, JSON, rows) across worker threads,
/// which glibc's arenas serve slowly (ops/bench/results/bench.md, "Where
/// cobro's CPU goes").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
            cli::exit_code(&error)
        }
    }
}
