#!/usr/bin/env bash
# The whole test suite, on both backends: starts a throwaway PostgreSQL
# (installing it if needed), runs every test with nextest (and cobro-client's
# doc tests), stops it.
# Extra arguments go to `cargo nextest run` (e.g. a test name filter).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=ops/throwaway-postgres.sh
source ops/throwaway-postgres.sh
pg_up
cargo nextest run --workspace --no-fail-fast "$@"
# nextest does not run doc tests; cobro-client's crate example runs against
# a real cobro API.
cargo test --doc -p cobro-client
