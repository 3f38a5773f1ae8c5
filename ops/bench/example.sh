#!/usr/bin/env bash
# Runs one of the test crate's benchmark examples (tests/examples/NAME.rs)
# on each store: builds it (`PROFILE`, release by default), then runs it
# with STORE=postgres on a throwaway PostgreSQL and with STORE=sqlite.
# The benches that are examples call it (delivery.sh, books.sh).
#
#   ops/bench/example.sh NAME        # STORES="postgres sqlite" by default
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
name=$1
PROFILE="${PROFILE:-release}"
cargo build -q --profile "$PROFILE" -p cobro-tests --example "$name"
dir=release; [ "$PROFILE" = dev ] && dir=debug
bin="${CARGO_TARGET_DIR:-target}/$dir/examples/$name"
for store in ${STORES:-postgres sqlite}; do
  if [ "$store" = postgres ]; then
    (
      # shellcheck source=../throwaway-postgres.sh
      source ops/throwaway-postgres.sh
      pg_up
      STORE=postgres "$bin"
    )
  else
    STORE=sqlite "$bin"
  fi
done
