//! The `cobro` binary's library, so that `main` is wiring and tests can
//! build the server in-process ([`app::Application`]).
//!
//! | module | what it owns |
//! |---|---|
//! | `cli` | the command line: subcommands, dispatch, exit codes |
//! | `settings` | typed flags and environment, each group with the commands that use it |
//! | `app` | the server process as a value: build (every start-up step), port, run until stopped |
//! | `serve` | `cobro serve`: signals, stdout lines, then the `app` |
//! | `worker` | `cobro worker`: one outbox worker per provider, its `/metrics` |
//! | `provider` | the provider registry (providers file or environment), its clients, webhook receivers, the embedded fake provider |
//! | `schedule` | the scheduled purge, reconciler and books of long-running processes |
//! | `shutdown` | SIGTERM/SIGINT and the `Stopper` every long-running part watches |
//! | `reconcile` | `cobro reconcile` |
//! | `books` | `cobro books` (run, orphans, acknowledge, runs) |
//! | `payments` | `cobro payments list/show/resolve` |
//! | `events` | `cobro events` and the event dispatcher's settings |
//! | `admin` | `migrate`, `accounts`, `tokens`, `purge` |
//! | `database` | opening the store (URL, embedded file, schema policy) |
//! | `demo` | the embedded default: demo account, dev token, banner |
//! | `token` | API token generation |
//! | `output` | the stdout contract (human lines or one JSON document) |
//! | `telemetry` | logs, traces, metrics |

mod admin;
pub mod app;
mod books;
pub mod cli;
mod database;
mod demo;
mod events;
mod output;
mod payments;
pub mod provider;
pub mod reconcile;
pub mod routing;
mod schedule;
pub mod serve;
pub mod settings;
pub mod shutdown;
pub mod telemetry;
mod token;
pub mod worker;
