#!/usr/bin/env bash
# Event delivery latency: written -> acknowledged at the healthy endpoints,
# with a fifth of the endpoints failing, slow or hanging
# (tests/examples/delivery_latency.rs says what it runs).
#
#   ops/bench/delivery.sh                    # both stores, the defaults
#   STORES=sqlite ENDPOINTS=200 PAYMENTS=60 RATE=2 ops/bench/delivery.sh
#
# Prints one line of figures per store. Never fails on a figure.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PROFILE="${PROFILE:-release}"
cargo build -q --profile "$PROFILE" -p cobro-tests --example delivery_latency
dir=release; [ "$PROFILE" = dev ] && dir=debug
bin="${CARGO_TARGET_DIR:-target}/$dir/examples/delivery_latency"
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
