//! cobro's integration tests, one module per concern (tests/README.md says
//! what each proves), in one test binary: every test binary links the whole
//! stack, so one binary is one link. nextest runs each test in a process of
//! its own, so the modules share nothing at run time; filter them by path,
//! e.g. `ops/test.sh -E 'test(/^crash::/)'`.

mod authentication;
mod books;
mod browser;
mod contention;
mod crash;
mod delivery;
mod egress;
mod events;
mod evidence;
mod explorer;
mod hostile_input;
mod http_bounds;
mod localstripe;
mod observability;
mod openapi;
mod payments_api;
mod plans;
mod providers;
mod reconciler;
mod refunds;
mod routing;
mod routing_chaos;
mod scenarios;
mod schema_parity;
mod store_conformance;
mod verdicts;
mod webhooks;
mod worker;

/// The real merchant endpoint that `events` and `crash` deliver to.
mod merchant;
