#!/usr/bin/env bash
# The books bench: one books run's time per 10 000 objects and its peak
# memory (tests/examples/books_run.rs says what it runs).
#
#   ops/bench/books.sh                         # both stores, 10 000 payments
#   STORES=sqlite PAYMENTS=50000 ops/bench/books.sh
#
# Prints one line per run. Never fails on a figure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PROFILE="${PROFILE:-release}"
cargo build -q --profile "$PROFILE" -p cobro-tests --example books_run
dir=release; [ "$PROFILE" = dev ] && dir=debug
bin="${CARGO_TARGET_DIR:-target}/$dir/examples/books_run"
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
