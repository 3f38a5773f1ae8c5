#!/usr/bin/env bash
# Event delivery latency: written -> acknowledged at the healthy endpoints,
# with a fifth of the endpoints failing, slow or hanging
# (tests/examples/delivery_latency.rs says what it runs).
#
#   ops/bench/delivery.sh                    # both stores, the defaults
#   STORES=sqlite ENDPOINTS=200 PAYMENTS=60 RATE=2 ops/bench/delivery.sh
#
# Prints one line of figures per store. Never fails on a figure.
exec "$(dirname "${BASH_SOURCE[0]}")/example.sh" delivery_latency
